"""Paged attention (decode and prefill) over FP8 pages with per-group scales; the same kernel
reads 16/32-bit pages when IS_FP8 is off, which is what the FP8-vs-bf16 benchmark compares.

One program per (sequence, KV head, block of BLOCK_M query tokens): the BLOCK_M tokens × the GQA
group's query heads form the M rows of each tl.dot, so a K/V tile is loaded once per KV head.
K/V tiles are BLOCK_N tokens with a per-token page lookup (any page size). FP8 values are
converted in registers; with one scale group per head (g == head_dim) the scales are folded into
the dot products (scores × k_scale per key, probabilities × v_scale per key), otherwise each tile
is dequantized in registers with its per-channel-group scales before the dot.
"""

import os
from typing import Unpack

import torch
import triton
import triton.language as tl

from kernels.checks import dot_precision, ragged_output
from kernels.decode import Launch, decode_launch, pick_num_splits
from kernels.options import AttendOptions, attend_options

LOG2E = 1.4426950408889634


@triton.jit
def _attention_fp8_kernel(
    q_ptr,
    out_ptr,
    blocks_ptr,  # the layer's view: [N+1, 2, P, H, D]
    scales_ptr,  # [N+1, 2, P, H, D // g] (unused when not IS_FP8)
    lut_ptr,
    cache_len_ptr,
    qsl_ptr,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_b_page,
    stride_b_kv,
    stride_b_tok,
    stride_b_head,
    stride_s_page,
    stride_s_kv,
    stride_s_tok,
    stride_s_head,
    stride_lut_row,
    sm_scale,
    softcap,
    window,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT_GROUP: tl.constexpr,
    NUM_SCALE_GROUPS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b, h, mb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if mb * BLOCK_M >= q_len:
        return
    cache_len = tl.load(cache_len_ptr + b)
    rows = tl.arange(0, BLOCK_M * BLOCK_H)
    tok = mb * BLOCK_M + rows // BLOCK_H  # query index within the sequence
    head = rows % BLOCK_H
    row_valid = (tok < q_len) & (head < GROUP)
    q_pos = cache_len + tok
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q_off = (q_start + tok)[:, None].to(tl.int64) * stride_q_t + (h * GROUP + head)[:, None] * stride_q_h + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_valid[:, None] & d_valid[None, :], other=0.0).to(DOT_DTYPE)  # [M, D]

    m_i = tl.full([BLOCK_M * BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_D], dtype=tl.float32)
    kv_end = tl.minimum(cache_len + q_len, cache_len + (mb + 1) * BLOCK_M)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(cache_len + mb * BLOCK_M - window + 1, 0)
    for start in range(kv_start, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_valid = n < kv_end
        page = tl.load(lut_ptr + b * stride_lut_row + n // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
        base = page * stride_b_page + (n % PAGE_SIZE) * stride_b_tok + h * stride_b_head  # [BLOCK_N]
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(blocks_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        v = tl.load(blocks_ptr + stride_b_kv + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IS_FP8:
            s_base = page * stride_s_page + (n % PAGE_SIZE) * stride_s_tok + h * stride_s_head
            if NUM_SCALE_GROUPS == 1:
                k_scale = tl.load(scales_ptr + s_base, mask=n_valid, other=0.0).to(tl.float32)  # [BLOCK_N]
                v_scale = tl.load(scales_ptr + stride_s_kv + s_base, mask=n_valid, other=0.0).to(tl.float32)
                s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * k_scale[None, :]
            else:
                s_off = s_base[:, None] + (d // QUANT_GROUP)[None, :]
                k_scale2 = tl.load(scales_ptr + s_off, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, D]
                v_scale2 = tl.load(scales_ptr + stride_s_kv + s_off, mask=kv_mask, other=0.0).to(tl.float32)
                s = tl.dot(q, tl.trans((k.to(tl.float32) * k_scale2).to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        else:
            s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        s = s * sm_scale
        if USE_SOFTCAP:
            # softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        visible = (n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        if USE_WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s * 1.4426950408889634, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if IS_FP8:
            if NUM_SCALE_GROUPS == 1:
                acc += tl.dot((p * v_scale[None, :]).to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
            else:
                acc += tl.dot(
                    p.to(DOT_DTYPE), (v.to(tl.float32) * v_scale2).to(DOT_DTYPE), input_precision=DOT_PRECISION
                )
        else:
            acc += tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q_start + tok)[:, None].to(tl.int64) * stride_o_t + (h * GROUP + head)[:, None] * stride_o_h + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


DOT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype of tl.dot operands: q's dtype on the GPU; float32 in the interpreter, whose
    tl.dot on bfloat16 operands returns garbage (triton 3.9 carries bfloat16 as raw uint16)."""
    return tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else DOT_DTYPES[dtype]


def paged_attention_fp8(
    q: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor | None,
    layer: int,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    max_q_len: int | None = None,
    block_n: int = 32,
    out: torch.Tensor | None = None,
    decode_block_n: int | None = 128,  # an H200 (2026-11-27, graph replay, B 64 x 4k): 314 us, 400 at 64
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8_as_f16: bool = False,
    **options: Unpack[AttendOptions],
) -> torch.Tensor:
    """Causal paged GQA attention. q: [T, Hq, D] -> [T, Hq, D] in q's dtype.

    blocks: [N+1, 2, L, P, H, D], float8_e4m3fn with `scales` [N+1, 2, L, P, H, D // g], or a
    16/32-bit pool with scales None. lookup_table: int [B, cols]; cache_lengths: int [B];
    query_start_loc: int [B + 1] (on the device); max_q_len: the longest q_len (computed from
    query_start_loc when not given, which syncs).
    decode_block_n: BLOCK_N of the decode kernel that a batch of one query per
    sequence runs on FP8 pages (None: this kernel instead); num_warps/num_stages: that kernel's, or this
    one's; fp8_as_f16: that decode's dots on f16 operands (benchmarks/gpu/probe.py times them all).
    """
    is_fp8 = blocks.dtype == torch.float8_e4m3fn
    assert is_fp8 == (scales is not None), "scales come with an FP8 pool, and only with one"
    assert blocks.dim() == 6 and blocks.shape[1] == 2 and blocks.stride(-1) == 1
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    scale, sliding_window, softcap = attend_options(options, head_dim)
    num_kv_heads = blocks.shape[4]
    assert head_dim == blocks.shape[5] and num_q_heads % num_kv_heads == 0 and q.stride(-1) == 1
    assert q.dtype in DOT_DTYPES and 0 <= layer < blocks.shape[2]
    out, batch, max_q_len = ragged_output(q, lookup_table, cache_lengths, query_start_loc, out, head_dim, max_q_len)
    if max_q_len == 0:
        return out
    if is_fp8 and max_q_len == 1 and q.shape[0] == batch and decode_block_n is not None:
        # Decode (one query per sequence: T = B and none longer than 1): kernels.decode's GQA-packed,
        # split-KV kernel, which reads FP8 pages too; this kernel keeps one program per (sequence, KV head),
        # which left the first GPU run's FP8 decode at half the bf16 decode's tokens/s.
        splits = pick_num_splits(batch, num_kv_heads, q.device)
        launch = Launch(splits, decode_block_n, num_warps, num_stages, fp8_as_f16)
        decode_launch(q, blocks, scales, layer, lookup_table, cache_lengths, out, None, launch, **options)
        return out
    group = num_q_heads // num_kv_heads
    block_m = 1 if max_q_len == 1 else max(1, 64 // triton.next_power_of_2(group))
    block_h = max(triton.next_power_of_2(group), 16 // block_m)  # tl.dot wants M >= 16
    layer_blocks = blocks[:, :, layer]
    layer_scales = scales[:, :, layer] if scales is not None else layer_blocks
    num_scale_groups = scales.shape[-1] if scales is not None else 1
    grid = (batch, num_kv_heads, triton.cdiv(max_q_len, block_m))
    dot_type = dot_dtype(q.dtype)
    _attention_fp8_kernel[grid](
        q,
        out,
        layer_blocks,
        layer_scales,
        lookup_table,
        cache_lengths,
        query_start_loc,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *layer_blocks.stride()[:4],
        *layer_scales.stride()[:4],
        lookup_table.stride(0),
        scale,
        softcap or 1.0,
        sliding_window or 0,
        GROUP=group,
        BLOCK_H=block_h,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        QUANT_GROUP=head_dim // num_scale_groups,
        NUM_SCALE_GROUPS=num_scale_groups,
        PAGE_SIZE=blocks.shape[3],
        BLOCK_N=block_n,
        IS_FP8=is_fp8,
        USE_SOFTCAP=bool(softcap),
        USE_WINDOW=bool(sliding_window),
        DOT_DTYPE=dot_type,
        DOT_PRECISION=dot_precision(dot_type == tl.float32),
        **{k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None},
    )
    return out
