"""MLA decode and prefill over a latent page pool, and the latent store.

blocks [N+1, 1, L, P, 1, D], D = kv_lora_rank (R) + rope channels. One program per (sequence,
block of BLOCK_H query heads, block of BLOCK_M query tokens): each latent tile [BLOCK_N, D] is
loaded once, as its first R channels (the values, and the no-rope part of the keys) and its rope
channels; scores = q[:, :R]·c^T + q[:, R:]·r^T, and the same c tile is the value tile of p·c.
"""

from typing import Unpack

import torch
import triton
import triton.language as tl

from kernels.attention_fp8 import DOT_DTYPES, dot_dtype
from kernels.checks import dot_precision, ragged_output
from kernels.options import AttendOptions, attend_options


@triton.jit
def _store_latent_kernel(
    src_ptr,
    slot_ptr,
    blocks_ptr,
    stride_src_l,
    stride_src_t,
    stride_b_page,
    stride_b_layer,
    stride_b_tok,
    first_layer,
    num_pages,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t, layer = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = slot // PAGE_SIZE
    valid = (slot >= 0) & (page < num_pages)  # never write the null page
    d = tl.arange(0, BLOCK_D)
    mask = d < tl.where(valid, HEAD_DIM, 0)  # a scalar bound: the interpreter rejects mask & scalar
    x = tl.load(src_ptr + layer * stride_src_l + t * stride_src_t + d, mask=mask)
    dst = page * stride_b_page + (first_layer + layer) * stride_b_layer + (slot % PAGE_SIZE) * stride_b_tok
    tl.store(blocks_ptr + dst + d, x.to(blocks_ptr.dtype.element_ty), mask=mask)


def store_latent(blocks: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor, layer: int | None = None) -> None:
    """latent [T, 1, D] into `layer`, or [L, T, 1, D] into every layer; slots int [T]."""
    assert blocks.dim() == 6 and blocks.shape[1] == 1 and blocks.shape[4] == 1 and blocks.stride(-1) == 1
    if layer is not None:
        latent = latent.unsqueeze(0)
    num_layers, num_tokens, _, head_dim = latent.shape
    assert latent.shape[2] == 1 and head_dim == blocks.shape[5] and latent.stride(-1) == 1
    assert slots.shape == (num_tokens,)
    if num_tokens == 0:
        return
    _store_latent_kernel[(num_tokens, num_layers)](
        latent,
        slots,
        blocks,
        latent.stride(0),
        latent.stride(1),
        blocks.stride(0),
        blocks.stride(2),
        blocks.stride(3),
        layer or 0,
        blocks.shape[0] - 1,
        PAGE_SIZE=blocks.shape[3],
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _mla_kernel(
    q_ptr,
    out_ptr,
    lat_ptr,  # the layer's latents: [N+1, P, D] (strided view)
    lut_ptr,
    cache_len_ptr,
    qsl_ptr,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_l_page,
    stride_l_tok,
    stride_lut_row,
    sm_scale,
    softcap,
    window,
    NUM_Q_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b, hb, mb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if mb * BLOCK_M >= q_len:
        return
    cache_len = tl.load(cache_len_ptr + b)
    rows = tl.arange(0, BLOCK_M * BLOCK_H)
    tok = mb * BLOCK_M + rows // BLOCK_H
    head = hb * BLOCK_H + rows % BLOCK_H
    row_valid = (tok < q_len) & (head < NUM_Q_HEADS)
    q_pos = cache_len + tok
    c = tl.arange(0, BLOCK_R)  # value / no-rope channels
    r = tl.arange(0, BLOCK_ROPE)  # rope channels, at RANK + r
    q_row = (q_start + tok)[:, None].to(tl.int64) * stride_q_t + head[:, None] * stride_q_h
    q_c = tl.load(q_ptr + q_row + c[None, :], mask=row_valid[:, None] & (c < RANK)[None, :], other=0.0)
    q_r = tl.load(q_ptr + q_row + RANK + r[None, :], mask=row_valid[:, None] & (r < ROPE)[None, :], other=0.0)
    q_c, q_r = q_c.to(DOT_DTYPE), q_r.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M * BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_R], dtype=tl.float32)
    kv_end = tl.minimum(cache_len + q_len, cache_len + (mb + 1) * BLOCK_M)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(cache_len + mb * BLOCK_M - window + 1, 0)
    for start in range(kv_start, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_valid = n < kv_end
        page = tl.load(lut_ptr + b * stride_lut_row + n // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
        base = page * stride_l_page + (n % PAGE_SIZE) * stride_l_tok  # [BLOCK_N]
        lat_c = tl.load(lat_ptr + base[:, None] + c[None, :], mask=n_valid[:, None] & (c < RANK)[None, :], other=0.0)
        lat_r = tl.load(
            lat_ptr + base[:, None] + RANK + r[None, :], mask=n_valid[:, None] & (r < ROPE)[None, :], other=0.0
        )
        lat_c = lat_c.to(DOT_DTYPE)
        s = tl.dot(q_c, tl.trans(lat_c), input_precision=DOT_PRECISION) + tl.dot(
            q_r, tl.trans(lat_r.to(DOT_DTYPE)), input_precision=DOT_PRECISION
        )
        s = s * sm_scale
        if USE_SOFTCAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        visible = (n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        if USE_WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s * 1.4426950408889634, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), lat_c, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q_start + tok)[:, None].to(tl.int64) * stride_o_t + head[:, None] * stride_o_h + c[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & (c < RANK)[None, :])


def mla_attention(
    q: torch.Tensor,
    blocks: torch.Tensor,
    layer: int,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_lora_rank: int,
    *,
    max_q_len: int | None = None,
    block_n: int = 32,
    out: torch.Tensor | None = None,
    **options: Unpack[AttendOptions],
) -> torch.Tensor:
    """Causal MLA. q: [T, Hq, D] -> [T, Hq, kv_lora_rank] in q's dtype; scale default 1/sqrt(D)."""
    assert blocks.dim() == 6 and blocks.shape[1] == 1 and blocks.shape[4] == 1 and blocks.stride(-1) == 1
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    scale, sliding_window, softcap = attend_options(options, head_dim)
    assert head_dim == blocks.shape[5] and 0 < kv_lora_rank < head_dim and q.stride(-1) == 1
    assert q.dtype in DOT_DTYPES and 0 <= layer < blocks.shape[2]
    out, batch, max_q_len = ragged_output(q, lookup_table, cache_lengths, query_start_loc, out, kv_lora_rank, max_q_len)
    if max_q_len == 0:
        return out
    block_h = min(16, triton.next_power_of_2(num_q_heads))
    block_m = 1 if max_q_len == 1 else max(1, 32 // block_h)
    block_h = max(block_h, 16 // block_m)  # tl.dot wants M >= 16
    latents = blocks[:, 0, layer, :, 0]  # [N+1, P, D]
    rope = head_dim - kv_lora_rank
    dot_type = dot_dtype(q.dtype)  # (float32 in the interpreter, whose tl.dot on bfloat16 is wrong)
    grid = (batch, triton.cdiv(num_q_heads, block_h), triton.cdiv(max_q_len, block_m))
    _mla_kernel[grid](
        q,
        out,
        latents,
        lookup_table,
        cache_lengths,
        query_start_loc,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        latents.stride(0),
        latents.stride(1),
        lookup_table.stride(0),
        scale,
        softcap or 1.0,
        sliding_window or 0,
        NUM_Q_HEADS=num_q_heads,
        BLOCK_H=block_h,
        BLOCK_M=block_m,
        RANK=kv_lora_rank,
        BLOCK_R=max(16, triton.next_power_of_2(kv_lora_rank)),
        ROPE=rope,
        BLOCK_ROPE=max(16, triton.next_power_of_2(rope)),
        PAGE_SIZE=blocks.shape[3],
        BLOCK_N=block_n,
        USE_SOFTCAP=bool(softcap),
        USE_WINDOW=bool(sliding_window),
        DOT_DTYPE=dot_type,
        DOT_PRECISION=dot_precision(dot_type == tl.float32),
        num_warps=8 if kv_lora_rank >= 256 else 4,  # the [M, R] accumulator: 16 x 512 fp32 at R = 512
    )
    return out
