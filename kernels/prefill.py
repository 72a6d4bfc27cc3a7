"""Paged prefill attention: ragged batches of new query tokens on top of a cached prefix.

Sequence b's queries are q[query_start_loc[b]:query_start_loc[b+1]] at positions cache_lengths[b] + j;
each sees the whole prefix and, causally, the new tokens up to its own (their K/V already stored).
One program per (query tile, KV head): a tile is BLOCK_Q tokens x the GROUP query heads of the KV
head, packed as BLOCK_M = BLOCK_Q * GROUP (padded) rows of one tl.dot, so each K/V tile is read
once for the whole GQA group.
"""

from typing import Unpack

import torch
import triton
import triton.language as tl

from kernels.checks import check_block, check_paged_args, dot_settings, kernel_options, next_pow2, output_buffers
from kernels.options import AttendOptions
from kernels.paged import LN2, LOG2E, NO_WINDOW, _dot, _kv_row_offsets, _softcap


@triton.jit
def _prefill_tile(
    q,  # [BLOCK_M, BLOCK_D]
    m_i,  # [BLOCK_M] running max, base 2
    l_i,  # [BLOCK_M] running sum
    acc,  # [BLOCK_M, BLOCK_D] fp32
    k_base,
    v_base,
    lut_row_ptr,
    tile_lo,
    kv_hi,
    lut_cols,
    num_pages,
    stride_blocks_page,
    stride_blocks_token,
    scale,
    softcap,
    q_pos,  # [BLOCK_M]: row i sees keys in (lower[i], q_pos[i]]
    lower,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One online-softmax step over keys [tile_lo, tile_lo + BLOCK_N) -> the new (m_i, l_i, acc)."""
    pos = tile_lo + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    rows = _kv_row_offsets(
        lut_row_ptr, pos, kv_hi, lut_cols, num_pages, stride_blocks_page, stride_blocks_token, PAGE_SIZE
    )
    kv_mask = (pos < kv_hi)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_base + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(v_base + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * scale  # [BLOCK_M, BLOCK_N]
    if USE_SOFTCAP:
        s = _softcap(s, softcap)
    s = s * LOG2E
    if MASKED:
        visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > lower[:, None])
        s = tl.where(visible, s, float("-inf"))
    # A sliding window can hide a whole tile from some rows: keep their max at -inf without NaNs.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    blocks_ptr,  # [N + 1, 2, L, P, Hkv, D]
    lut_ptr,  # [B, cols]
    cache_lengths_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    out_ptr,  # [T, Hq, D]
    lse_ptr,  # [T, Hq] fp32 (RETURN_LSE)
    layer,
    num_seqs,
    num_pages,
    lut_cols,
    scale,
    softcap,
    window,  # sliding window; NO_WINDOW without one
    stride_q_token,
    stride_q_head,
    stride_blocks_page,
    stride_blocks_kv,
    stride_blocks_layer,
    stride_blocks_token,
    stride_blocks_head,
    stride_lut_seq,
    stride_out_token,
    stride_out_head,
    stride_lse_token,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Sequence b owns programs [start_b // BLOCK_Q + b, ...): at least cdiv(q_len_b, BLOCK_Q) of them,
    # cdiv(T, BLOCK_Q) + B in all, so the grid needs no host-side knowledge of the lengths.
    b = tl.arange(0, BLOCK_B)
    starts = tl.load(query_start_loc_ptr + b, mask=b < num_seqs, other=0).to(tl.int32)
    first_program = tl.where(b < num_seqs, starts // BLOCK_Q + b, 2147483647)
    seq = tl.sum((first_program <= pid).to(tl.int32), 0) - 1
    q_begin = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_end = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32)
    tok_lo = q_begin + (pid - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if tok_lo >= q_end:
        return
    tok_hi = tl.minimum(tok_lo + BLOCK_Q, q_end)
    cache_len = tl.load(cache_lengths_ptr + seq).to(tl.int32)

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    tok = tok_lo + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (tok < tok_hi)
    d_mask = d < HEAD_DIM
    # Padding rows take the tile's last position, so no row is left with nothing visible.
    q_pos = cache_len + tl.minimum(tok, tok_hi - 1) - q_begin  # [BLOCK_M]
    q = tl.load(
        q_ptr + tok.to(tl.int64)[:, None] * stride_q_token + heads[:, None] * stride_q_head + d[None, :],
        mask=row_ok[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    kv_hi = cache_len + tok_hi - q_begin  # one past the tile's last position
    # Keys at or below `lower` are outside the sliding window (none are without one).
    kv_lo = tl.maximum(cache_len + tok_lo - q_begin - window + 1, 0)
    lower = q_pos - window
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lut_row_ptr = lut_ptr + seq.to(tl.int64) * stride_lut_seq
    k_base = blocks_ptr + layer * stride_blocks_layer + kv_head * stride_blocks_head
    v_base = k_base + stride_blocks_kv
    # KV tiles start at kv_lo. Tiles [full_first, full_end) hold only keys that every row sees (at or
    # before the first row's position, inside the last row's window): they skip the mask. The rest,
    # the window's ragged start and the causal diagonal, are masked.
    num_tiles = tl.cdiv(kv_hi - kv_lo, BLOCK_N)
    full_first = tl.cdiv(tl.maximum(kv_hi - window, 0) - kv_lo, BLOCK_N)
    full_end = tl.maximum((cache_len + tok_lo - q_begin + 1 - kv_lo) // BLOCK_N, full_first)
    for tile in range(0, full_first):
        m_i, l_i, acc = _prefill_tile(
            q, m_i, l_i, acc, k_base, v_base, lut_row_ptr, kv_lo + tile * BLOCK_N, kv_hi, lut_cols, num_pages,
            stride_blocks_page, stride_blocks_token, scale, softcap, q_pos, lower,
            HEAD_DIM, PAGE_SIZE, BLOCK_D, BLOCK_N, True, USE_SOFTCAP, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
    for tile in range(full_first, full_end):
        m_i, l_i, acc = _prefill_tile(
            q, m_i, l_i, acc, k_base, v_base, lut_row_ptr, kv_lo + tile * BLOCK_N, kv_hi, lut_cols, num_pages,
            stride_blocks_page, stride_blocks_token, scale, softcap, q_pos, lower,
            HEAD_DIM, PAGE_SIZE, BLOCK_D, BLOCK_N, False, USE_SOFTCAP, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
    for tile in range(full_end, num_tiles):
        m_i, l_i, acc = _prefill_tile(
            q, m_i, l_i, acc, k_base, v_base, lut_row_ptr, kv_lo + tile * BLOCK_N, kv_hi, lut_cols, num_pages,
            stride_blocks_page, stride_blocks_token, scale, softcap, q_pos, lower,
            HEAD_DIM, PAGE_SIZE, BLOCK_D, BLOCK_N, True, USE_SOFTCAP, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip

    o = acc / l_i[:, None]  # l_i > 0: every row sees its own position
    tl.store(
        out_ptr + tok.to(tl.int64)[:, None] * stride_out_token + heads[:, None] * stride_out_head + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_mask[None, :],
    )
    if RETURN_LSE:
        tl.store(lse_ptr + tok.to(tl.int64) * stride_lse_token + heads, (m_i + tl.log2(l_i)) * LN2, mask=row_ok)


def _tile_shape(group: int, head_dim: int, on_gpu: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages): 128 x 64 tiles on a GPU (as FA2-style
    Triton kernels use for head_dim <= 128), 64 x 64 beyond; smaller in the interpreter."""
    rows = (128 if head_dim <= 128 else 64) if on_gpu else 32
    block_m = max(16, rows, next_pow2(group))
    return block_m, 64 if on_gpu else 32, 8 if block_m >= 128 else 4, 2 if on_gpu else 1


def paged_prefill(
    q: torch.Tensor,
    blocks: torch.Tensor,
    layer: int,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    **options: Unpack[AttendOptions],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D] -> out [T, Hq, D] (q's dtype) [, lse [T, Hq] fp32]; see kernels.reference.paged_attention_ref.

    `out`/`lse` may be given to write into; `block_m` (rows = query tokens x GQA group, a power of 2),
    `block_n`, `num_warps` and `num_stages` override the tuned choices (benchmarks.kernels.bench --tune sweeps them).
    """
    a = check_paged_args(q, blocks, layer, lookup_table, cache_lengths, query_start_loc)
    assert a.query_start_loc is not None
    out, lse = output_buffers(q, out, lse, return_lse)
    scale, softcap, window, use_softcap = kernel_options(options, a.head_dim, NO_WINDOW)
    num_tokens, batch, head_dim = q.shape[0], a.batch, a.head_dim
    if num_tokens == 0 or batch == 0:
        return (out, lse) if return_lse and lse is not None else out

    group = a.num_q_heads // a.num_kv_heads
    tuned_m, tuned_n, tuned_warps, tuned_stages = _tile_shape(group, head_dim, q.device.type == "cuda")
    block_m = block_m or tuned_m
    if block_m < 16 or block_m & (block_m - 1) or block_m < group:
        raise ValueError(f"block_m must be a power of 2 >= max(16, group={group}), not {block_m}")
    block_n = check_block("block_n", block_n or tuned_n)
    block_q = block_m // group
    sb = blocks.stride()
    grid = (-(-num_tokens // block_q) + batch, a.num_kv_heads)
    _prefill_kernel[grid](
        q, blocks, a.lookup_table, a.cache_lengths, a.query_start_loc, out, lse if lse is not None else out,
        layer, batch, a.num_pages, a.lookup_table.shape[1],
        scale, softcap, window,
        q.stride(0), q.stride(1),
        sb[0], sb[1], sb[2], sb[3], sb[4],
        a.lookup_table.stride(0),
        out.stride(0), out.stride(1),
        lse.stride(0) if lse is not None else 0,
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=a.page_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_D=max(16, next_pow2(head_dim)), BLOCK_N=block_n,
        BLOCK_B=next_pow2(batch + 1), USE_SOFTCAP=use_softcap, RETURN_LSE=return_lse,
        **dot_settings(blocks.dtype, q.device),
        num_warps=num_warps or tuned_warps, num_stages=num_stages or tuned_stages,
    )  # fmt: skip
    return (out, lse) if return_lse and lse is not None else out
