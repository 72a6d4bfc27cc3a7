"""Torch references of the paged kernels; the service runs these on the CPU.

Conventions shared with the Triton kernels:
  blocks        [num_pages + 1, 2, num_layers, page_size, num_kv_heads, head_dim]; K at 0, V at 1;
                page num_pages is the null page (the sentinel of every lookup table).
  lookup_table  uint32/int32 [batch, cols]: pages of each sequence, then the sentinel.
  cache_lengths [batch]: tokens cached before this step's queries.
  query_start_loc int [batch + 1]: sequence i's queries are q[query_start_loc[i]:query_start_loc[i+1]],
                at positions cache_lengths[i] + j; each attends causally to positions <= its own.
"""

from typing import Any, Unpack

import torch

from kernels.options import AttendOptions, attend_options


def store_kv_ref(
    blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, layer: int | None = None
) -> None:
    """Write K/V of T tokens into their slots (slot = page * page_size + offset).

    k, v: [T, H, D] for one `layer`, or [L, T, H, D] for all layers when `layer` is None.
    Writes whose page is the null page (or beyond it) or whose slot is negative are skipped.
    """
    num_pages, page_size = blocks.shape[0] - 1, blocks.shape[3]
    slots = slots.to(torch.int64)
    pages, offsets = slots // page_size, slots % page_size
    keep = (slots >= 0) & (pages < num_pages)
    pages, offsets = pages[keep], offsets[keep]
    if layer is None:
        # blocks[pages, i, :, offsets] -> [T, L, H, D]
        blocks[pages, 0, :, offsets] = k[:, keep].transpose(0, 1).to(blocks.dtype)
        blocks[pages, 1, :, offsets] = v[:, keep].transpose(0, 1).to(blocks.dtype)
    else:
        blocks[pages, 0, layer, offsets] = k[keep].to(blocks.dtype)
        blocks[pages, 1, layer, offsets] = v[keep].to(blocks.dtype)


def gather_kv(blocks: torch.Tensor, layer: int, pages: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [length, H, D] of one sequence of one layer, in token order."""
    page_size = blocks.shape[3]
    num = -(-length // page_size)
    kv = blocks[pages[:num].to(torch.int64), :, layer]  # [num, 2, P, H, D]
    kv = kv.transpose(0, 1).reshape(2, num * page_size, *blocks.shape[4:])[:, :length]
    return kv[0], kv[1]


def gather_heads(blocks: torch.Tensor, kv: int, layer: int, pages: torch.Tensor, length: int) -> torch.Tensor:
    """K (kv 0) or V (kv 1) of one sequence of one layer as float32 [H, length, D]: one row per head."""
    page_size, num_heads, head_dim = blocks.shape[3:]
    num = -(-length // page_size)
    by_head = blocks[:, kv, layer].permute(2, 0, 1, 3)  # a view [H, N+1, P, D]
    x = by_head.index_select(1, pages[:num].to(torch.int64))  # the one copy: [H, num, P, D]
    return x.view(num_heads, num * page_size, head_dim)[:, :length].float()


# Scores of one block of queries against its keys stay under this many float32 elements (1 MiB), so a
# long prefill takes memory linear in its length: the whole [Hq, T, T] score matrix of a 4,096-token
# prompt with 16 query heads would be 1 GiB, and the softmax's temporaries a few times that. Blocks
# this small cost no time on one CPU thread (the server's setting) against blocks 16 times larger.
SCORE_BLOCK_ELEMENTS = 1 << 18


def paged_attention_ref(
    q: torch.Tensor,
    blocks: torch.Tensor,
    layer: int,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    return_lse: bool = False,
    **options: Unpack[AttendOptions],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal paged attention with GQA. q: [T, Hq, D] -> out [T, Hq, D] (q's dtype), lse [T, Hq] fp32.

    sliding_window W: a query at position p sees positions (p - W, p]. softcap c: s = c * tanh(s / c).
    Each sequence's queries go in blocks whose scores fit SCORE_BLOCK_ELEMENTS; a block reads only the
    keys its queries can see, so memory is linear in the sequence length and the causal half is skipped.
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = blocks.shape[4]
    group = num_q_heads // num_kv_heads
    scale, sliding_window, softcap = attend_options(options, head_dim)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for i, cache_len in enumerate(cache_lengths.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        total = int(cache_len) + hi - lo
        k, v = (gather_heads(blocks, kv, layer, lookup_table[i], total) for kv in (0, 1))  # [Hkv, total, D]
        rows = max(1, SCORE_BLOCK_ELEMENTS // (num_q_heads * total))
        for a in range(lo, hi, rows):
            b = min(a + rows, hi)
            first, last = int(cache_len) + a - lo, int(cache_len) + b - 1 - lo  # the block's query positions
            # Keys no query of the block can see (after `last`; before `first`'s window) are left out.
            k_lo = max(0, first - sliding_window + 1) if sliding_window and sliding_window > 0 else 0
            o, lse_block = _attend_block(
                q[a:b].float().view(b - a, num_kv_heads, group, head_dim),
                k[:, k_lo : last + 1],
                v[:, k_lo : last + 1],
                torch.arange(first, last + 1, device=q.device),
                torch.arange(k_lo, last + 1, device=q.device),
                scale,
                sliding_window,
                softcap,
            )
            out[a:b] = o.reshape(b - a, num_q_heads, head_dim).to(q.dtype)
            lse[a:b] = lse_block.reshape(b - a, num_q_heads)
    return (out, lse) if return_lse else out


def _attend_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 q: [Tq, Hkv, G, D] at q_pos [Tq]; k, v: [Hkv, Tk, D] at k_pos [Tk].

    Returns o [Tq, Hkv, G, D] and lse [Tq, Hkv, G].
    """
    num_q, num_kv_heads, group, head_dim = q.shape
    q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * num_q, head_dim)  # a GQA group's rows share K/V
    s = torch.matmul(q, k.transpose(1, 2)).mul_(scale).view(num_kv_heads, group, num_q, -1)  # [Hkv, G, Tq, Tk]
    if softcap:
        s = s.div_(softcap).tanh_().mul_(softcap)
    visible = k_pos[None, :] <= q_pos[:, None]  # [Tq, Tk]
    if sliding_window:
        visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
    s.masked_fill_(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hkv, G, Tq]
    p = s.sub_(lse[..., None]).exp_().view(num_kv_heads, group * num_q, -1)
    o = torch.matmul(p, v).view(num_kv_heads, group, num_q, head_dim)
    return o.permute(2, 0, 1, 3), lse.permute(2, 0, 1)


def paged_decode_ref(
    q: torch.Tensor,
    blocks: torch.Tensor,
    layer: int,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    **options: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel's reference: one query per sequence, q: [B, Hq, D] at position cache_lengths[b]."""
    query_start_loc = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_attention_ref(q, blocks, layer, lookup_table, cache_lengths, query_start_loc, **options)
