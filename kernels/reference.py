"""Torch references of the paged kernels; the service runs these on the CPU.

Conventions shared with the Triton kernels:
  blocks        [num_pages + 1, 2, num_layers, page_size, num_kv_heads, head_dim]; K at 0, V at 1;
                page num_pages is the null page (the sentinel of every lookup table).
  lookup_table  uint32/int32 [batch, cols]: pages of each sequence, then the sentinel.
  cache_lengths [batch]: tokens cached before this step's queries.
  query_start_loc int [batch + 1]: sequence i's queries are q[query_start_loc[i]:query_start_loc[i+1]],
                at positions cache_lengths[i] + j; each attends causally to positions <= its own.
"""

import math
from typing import Any

import torch


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


def paged_attention_ref(
    q: torch.Tensor,
    blocks: torch.Tensor,
    layer: int,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal paged attention with GQA. q: [T, Hq, D] -> out [T, Hq, D] (q's dtype), lse [T, Hq] fp32.

    sliding_window W: a query at position p sees positions (p - W, p]. softcap c: s = c * tanh(s / c).
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = blocks.shape[4]
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for i, cache_len in enumerate(cache_lengths.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        total = int(cache_len) + hi - lo
        k, v = gather_kv(blocks, layer, lookup_table[i], total)
        qi = q[lo:hi].float().view(hi - lo, num_kv_heads, group, head_dim)
        s = torch.einsum("thgd,khd->hgtk", qi, k.float()) * scale  # [Hkv, G, Tq, Tk]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        q_pos = torch.arange(cache_len, total, device=q.device)[:, None]
        k_pos = torch.arange(total, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window:
            visible &= k_pos > q_pos - sliding_window
        s = s.masked_fill(~visible, float("-inf"))
        lse_i = torch.logsumexp(s, dim=-1)  # [Hkv, G, Tq]
        p = torch.exp(s - lse_i[..., None])
        o = torch.einsum("hgtk,khd->thgd", p, v.float())
        out[lo:hi] = o.reshape(hi - lo, num_q_heads, head_dim).to(q.dtype)
        lse[lo:hi] = lse_i.permute(2, 0, 1).reshape(hi - lo, num_q_heads)
    return (out, lse) if return_lse else out


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
