"""Paged decode attention: one query token per sequence, GQA-packed, split-KV (flash-decoding).

One program per (sequence, KV head, split) loads the GROUP query heads that share the KV head as
the M dimension of tl.dot (padded to 16), so each K/V page is read once per KV head. Long contexts
with few sequences are split into NUM_SPLITS segments (a fixed number per launch; empty segments
exit at once) whose partial outputs and log-sum-exps a second kernel merges.
"""

from dataclasses import dataclass
from typing import Unpack

import torch
import triton
import triton.language as tl

from kernels.checks import (
    check_block,
    check_paged_args,
    dot_settings,
    kernel_options,
    next_pow2,
    output_buffers,
    pages_in_pool,
)
from kernels.options import AttendOptions
from kernels.paged import LN2, LOG2E, NO_WINDOW, _dot, _kv_pages, _softcap

MAX_SPLITS = 32


@triton.jit
def _decode_kernel(
    q_ptr,  # [B, Hq, D]
    blocks_ptr,  # [N + 1, 2, L, P, Hkv, D]; float8_e4m3fn where IS_FP8
    scales_ptr,  # [N + 1, 2, L, P, Hkv, D // QUANT_GROUP] (IS_FP8; else unused)
    lut_ptr,  # [B, cols]
    cache_lengths_ptr,  # [B]
    out_ptr,  # [B, Hq, D]           (NUM_SPLITS == 1)
    lse_ptr,  # [B, Hq] fp32         (NUM_SPLITS == 1 and RETURN_LSE)
    part_o_ptr,  # [B, Hq, S, D] fp32 (NUM_SPLITS > 1)
    part_lse_ptr,  # [B, Hq, S] fp32, base 2
    layer,
    num_pages,
    lut_cols,
    scale,
    softcap,
    window,  # sliding window; NO_WINDOW without one
    stride_q_seq,
    stride_q_head,
    stride_blocks_page,
    stride_blocks_kv,
    stride_blocks_layer,
    stride_blocks_token,
    stride_blocks_head,
    stride_s_page,
    stride_s_kv,
    stride_s_layer,
    stride_s_token,
    stride_s_head,
    stride_lut_seq,
    stride_out_seq,
    stride_out_head,
    stride_lse_seq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    IS_FP8: tl.constexpr,
    QUANT_GROUP: tl.constexpr,  # channels per scale (IS_FP8)
    NUM_SCALE_GROUPS: tl.constexpr,  # HEAD_DIM // QUANT_GROUP (IS_FP8)
    FP8_AS_F16: tl.constexpr,  # IS_FP8: the dots on f16 operands (else q's dtype)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    # The query sits at position cache_len; its own K/V are stored, so it sees cache_len + 1 tokens.
    kv_len = tl.load(cache_lengths_ptr + seq).to(tl.int32) + 1
    start = tl.maximum(kv_len - window, 0)
    chunk = tl.cdiv(tl.cdiv(kv_len - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, kv_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    part_row = (seq * num_q_heads + heads).to(tl.int64) * NUM_SPLITS + split
    if lo >= hi:  # only with NUM_SPLITS > 1: segment 0 always holds the query's own position
        if NUM_SPLITS > 1:  # tell the merge to ignore this segment
            tl.store(part_lse_ptr + part_row, tl.full([BLOCK_G], float("-inf"), tl.float32), mask=g_mask)
        return

    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    if IS_FP8 and FP8_AS_F16 and not UPCAST_DOT:
        # e4m3 widens to f16 in one instruction per pair and to bf16 only through f16 (three more); the
        # dots then take f16 operands, q converted once here (|q| must stay under f16's 65504).
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lut_row_ptr = lut_ptr + seq.to(tl.int64) * stride_lut_seq
    k_base = blocks_ptr + layer * stride_blocks_layer + kv_head * stride_blocks_head
    v_base = k_base + stride_blocks_kv
    ks_base = scales_ptr + layer * stride_s_layer + kv_head * stride_s_head  # (IS_FP8)
    vs_base = ks_base + stride_s_kv
    for tile_lo in range(lo, hi, BLOCK_N):
        pos = tile_lo + tl.arange(0, BLOCK_N)
        valid = pos < hi
        page, token = _kv_pages(lut_row_ptr, pos, hi, lut_cols, num_pages, PAGE_SIZE)  # one LUT read a tile
        rows = page * stride_blocks_page + token * stride_blocks_token
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_base + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_base + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IS_FP8:
            # Half the bytes of a 16-bit pool; the values are widened in registers. One scale per (token,
            # head) is folded into the scores and probabilities; per-channel-group scales scale the tile.
            srows = page * stride_s_page + token * stride_s_token
            wide = tl.float32 if UPCAST_DOT else q.dtype
            if NUM_SCALE_GROUPS == 1:
                k_scale = tl.load(ks_base + srows, mask=valid, other=0.0).to(tl.float32)  # [BLOCK_N]
                v_scale = tl.load(vs_base + srows, mask=valid, other=0.0).to(tl.float32)
                k = k.to(wide)
                v = v.to(wide)
            else:
                s_off = srows[:, None] + (d // QUANT_GROUP)[None, :]
                k_scale2 = tl.load(ks_base + s_off, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
                v_scale2 = tl.load(vs_base + s_off, mask=kv_mask, other=0.0).to(tl.float32)
                k = (k.to(tl.float32) * k_scale2).to(wide)
                v = (v.to(tl.float32) * v_scale2).to(wide)
        s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * scale  # [BLOCK_G, BLOCK_N]
        if IS_FP8 and NUM_SCALE_GROUPS == 1:
            s = s * k_scale[None, :]
        if USE_SOFTCAP:
            s = _softcap(s, softcap)
        s = tl.where(valid[None, :], s * LOG2E, float("-inf"))
        # Every tile holds position tile_lo < hi, so m_new is finite on every row.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IS_FP8 and NUM_SCALE_GROUPS == 1:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    o = acc / l_i[:, None]
    lse2 = m_i + tl.log2(l_i)
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_out_seq + heads[:, None] * stride_out_head + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
        if RETURN_LSE:
            tl.store(lse_ptr + seq.to(tl.int64) * stride_lse_seq + heads, lse2 * LN2, mask=g_mask)
    else:
        tl.store(part_o_ptr + part_row[:, None] * BLOCK_D + d[None, :], o, mask=g_mask[:, None])
        tl.store(part_lse_ptr + part_row, lse2, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr,  # [B, Hq, S, BLOCK_D] fp32
    part_lse_ptr,  # [B, Hq, S] fp32, base 2; -inf marks an empty segment
    out_ptr,  # [B, Hq, D]
    lse_ptr,  # [B, Hq]
    stride_out_seq,
    stride_out_head,
    stride_lse_seq,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq.to(tl.int64) * tl.num_programs(1) + head
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    lse_s = tl.load(part_lse_ptr + row * NUM_SPLITS + sp)  # [S]
    used = lse_s > float("-inf")
    m = tl.max(lse_s, 0)  # finite: segment 0 always holds the query's own position
    w = tl.where(used, tl.exp2(lse_s - m), 0.0)
    o_s = tl.load(
        part_o_ptr + (row * NUM_SPLITS + sp)[:, None] * BLOCK_D + d[None, :], mask=used[:, None], other=0.0
    )  # [S, BLOCK_D]
    total = tl.sum(w, 0)
    o = tl.sum(w[:, None] * o_s, 0) / total
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_out_seq + head * stride_out_head + d,
        o.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )
    if RETURN_LSE:
        tl.store(lse_ptr + seq.to(tl.int64) * stride_lse_seq + head, (m + tl.log2(total)) * LN2)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter gains nothing from splitting
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def pick_num_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Segments per sequence: enough programs for ~2 per SM when batch x heads alone cannot fill the GPU.

    Depends only on shapes (never on lengths, which would need a device sync), so a launch has one
    fixed grid for CUDA graphs; segments that a short sequence leaves empty exit at once.
    """
    programs, sms = batch * num_kv_heads, _sm_count(device)
    if programs >= sms:
        return 1
    return min(MAX_SPLITS, next_pow2(-(-2 * sms // programs)))


def paged_decode(
    q: torch.Tensor,
    blocks: torch.Tensor,
    layer: int,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    *,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    **options: Unpack[AttendOptions],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Hq, D] at position cache_lengths[b] -> out [B, Hq, D] (q's dtype) [, lse [B, Hq] fp32].

    The query's own K/V must already be stored (it attends cache_lengths[b] + 1 positions).
    `out`/`lse` may be given to write into; `num_splits` (a power of 2 up to 32), `block_n`,
    `num_warps` and `num_stages` override the tuned choices (benchmarks.kernels.bench --tune sweeps them).
    """
    a = check_paged_args(q, blocks, layer, lookup_table, cache_lengths)
    out, lse = output_buffers(q, out, lse, return_lse)
    splits = num_splits or pick_num_splits(a.batch, a.num_kv_heads, q.device)
    if splits < 1 or splits > MAX_SPLITS or splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of 2 in [1, {MAX_SPLITS}], not {splits}")
    block_n = check_block("block_n", block_n or 64)
    launch = Launch(splits, block_n, num_warps, num_stages)
    lse = lse if return_lse else None  # (a buffer given without return_lse is never written)
    decode_launch(q, blocks, None, layer, a.lookup_table, a.cache_lengths, out, lse, launch, **options)
    return (out, lse) if return_lse and lse is not None else out


@dataclass(frozen=True)
class Launch:
    """The launch choices paged_decode takes (checked there): splits, BLOCK_N, warps and stages; on FP8
    pages, whether the dots take f16 operands (16-bit queries only)."""

    splits: int
    block_n: int = 64
    num_warps: int | None = None
    num_stages: int | None = None
    fp8_as_f16: bool = False


def decode_launch(
    q: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor | None,
    layer: int,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    launch: Launch,
    **options: Unpack[AttendOptions],
) -> None:
    """The launch behind paged_decode, and the FP8 decode of kernels.attention_fp8 (blocks float8_e4m3fn with
    `scales` [N + 1, 2, L, P, Hkv, D // g]): arguments already checked by the caller."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = blocks.shape[4], blocks.shape[3]
    scale, softcap, window, use_softcap = kernel_options(options, head_dim, NO_WINDOW)
    return_lse, splits, block_n = lse is not None, launch.splits, launch.block_n
    if batch == 0:
        return
    group = num_q_heads // num_kv_heads
    block_d = max(16, next_pow2(head_dim))
    on_gpu = q.device.type == "cuda"
    lse_arg = lse if lse is not None else out  # never written unless RETURN_LSE
    if splits > 1:
        part_o = torch.empty(batch, num_q_heads, splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_q_heads, splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    sb = blocks.stride()
    is_fp8 = scales is not None
    as_f16 = is_fp8 and launch.fp8_as_f16 and q.dtype != torch.float32
    ss = scales.stride() if scales is not None else (0,) * 6
    groups = scales.shape[-1] if scales is not None else 1
    dots = dot_settings(q.dtype, q.device)
    if is_fp8:  # the interpreter widens FP8 to float32 (its bfloat16 dots are wrong)
        dots["UPCAST_DOT"] = not on_gpu
    _decode_kernel[(batch, num_kv_heads, splits)](
        q, blocks, blocks if scales is None else scales, lookup_table, cache_lengths, out, lse_arg, part_o, part_lse,
        layer, pages_in_pool(blocks.shape[0]), lookup_table.shape[1],
        scale, softcap, window,
        q.stride(0), q.stride(1),
        sb[0], sb[1], sb[2], sb[3], sb[4],
        ss[0], ss[1], ss[2], ss[3], ss[4],
        lookup_table.stride(0),
        out.stride(0), out.stride(1),
        lse.stride(0) if lse is not None else 0,
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        NUM_SPLITS=splits, USE_SOFTCAP=use_softcap, RETURN_LSE=return_lse,
        **dots, IS_FP8=is_fp8, QUANT_GROUP=head_dim // groups, NUM_SCALE_GROUPS=groups, FP8_AS_F16=as_f16,
        num_warps=launch.num_warps or 4, num_stages=launch.num_stages or (3 if on_gpu else 1),
    )  # fmt: skip
    if splits > 1:
        _decode_reduce_kernel[(batch, num_q_heads)](
            part_o, part_lse, out, lse_arg,
            out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0,
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits, RETURN_LSE=return_lse,
            num_warps=4,
        )  # fmt: skip
