"""The CPU serving path: decode attention as one set of torch ops for the whole batch, and K/V stores.

`paged_attention_ref` loops over the sequences, a dozen small torch ops each; on the CPU the op
overhead, not the arithmetic, is the cost of a decode step (`kvpool bench http`; docs/benchmarks.md,
"Figures behind the code"). Here the batch's pages are gathered at once, padded to the longest
sequence, and the padding masked out; prefill batches (several queries per sequence) still go through
the per-sequence reference. Same conventions and results as kernels/reference.py (attention to
rounding, stores exactly).
"""

from typing import Unpack

import torch

from kernels.options import AttendOptions, attend_options
from kernels.reference import paged_attention_ref, store_kv_ref


def one_query_per_sequence(q: torch.Tensor, query_start_loc: torch.Tensor) -> bool:
    """A decode batch: query_start_loc is 0, 1, ..., B and q has B rows."""
    batch = query_start_loc.shape[0] - 1
    return q.shape[0] == batch and query_start_loc.tolist() == list(range(batch + 1))


def paged_attention_batched(
    q: torch.Tensor,
    blocks: torch.Tensor,
    layer: int,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    query_start_loc: torch.Tensor,
    **options: Unpack[AttendOptions],
) -> torch.Tensor:
    """paged_attention_ref's result (q: [T, Hq, D] -> [T, Hq, D]); batched when every sequence has one query."""
    if not one_query_per_sequence(q, query_start_loc):
        out = paged_attention_ref(q, blocks, layer, lookup_table, cache_lengths, query_start_loc, **options)
        assert isinstance(out, torch.Tensor)
        return out
    return paged_decode_batched(q, blocks, layer, lookup_table, cache_lengths, **options)


def paged_decode_batched(
    q: torch.Tensor,
    blocks: torch.Tensor,
    layer: int,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    **options: Unpack[AttendOptions],
) -> torch.Tensor:
    """One query per sequence at position cache_lengths[b]. q: [B, Hq, D] -> [B, Hq, D] (q's dtype)."""
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = blocks.shape[3], blocks.shape[4]
    group = num_q_heads // num_kv_heads
    scale, sliding_window, softcap = attend_options(options, head_dim)
    if batch == 0:
        return torch.empty_like(q)
    positions = [int(c) for c in cache_lengths.tolist()]  # each query's position; it sees 0..position
    num = -(-(max(positions) + 1) // page_size)  # pages of the longest sequence
    pages = lookup_table[:, :num].reshape(-1).to(torch.int64)  # [B * num]: the sentinel pads short sequences
    kv = blocks[:, :, layer].index_select(0, pages)  # [B * num, 2, P, H, D]
    kv = kv.view(batch, num, 2, page_size, num_kv_heads, head_dim).float()
    # [B, H, num, P, D] -> [B, H, K, D] with K = num * P positions, the padding masked below
    k = kv[:, :, 0].permute(0, 3, 1, 2, 4).reshape(batch, num_kv_heads, num * page_size, head_dim)
    v = kv[:, :, 1].permute(0, 3, 1, 2, 4).reshape(batch, num_kv_heads, num * page_size, head_dim)
    q_pos = torch.tensor(positions, device=q.device)[:, None]  # [B, 1]
    k_pos = torch.arange(num * page_size, device=q.device)[None, :]  # [1, K]
    visible = k_pos <= q_pos  # [B, K]
    if sliding_window:
        visible &= k_pos > q_pos - sliding_window
    qf = q.float().reshape(batch, num_kv_heads, group, head_dim)  # [B, H, G, D]
    s = torch.matmul(qf, k.transpose(2, 3)) * scale  # [B, H, G, K]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    hidden = ~visible
    s.masked_fill_(hidden[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    # Padding positions have p == 0, but the pages behind them may hold anything (NaN included): zero them.
    v.masked_fill_(hidden[:, None, :, None], 0.0)  # v is the gathered copy, not the pool
    o = torch.matmul(p, v)  # [B, H, G, D]
    return o.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def store_kv_direct(
    blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, layer: int | None = None
) -> None:
    """store_kv_ref with a third of its torch ops when every slot lies on a real page (the core's always do).

    store_kv_ref masks out negative and null-page slots with half a dozen torch ops before writing; on the
    CPU the range check costs less in numpy. Any slot out of range, or a tensor off the CPU: store_kv_ref.
    k, v: [T, H, D] for one `layer`, or [L, T, H, D] for all layers when `layer` is None; slots: [T].
    """
    num_pages, page_size = blocks.shape[0] - 1, blocks.shape[3]
    if slots.device.type != "cpu" or blocks.device.type != "cpu" or slots.numel() == 0:
        store_kv_ref(blocks, k, v, slots, layer)
        return
    s = slots.numpy().astype("int64", copy=False)
    if s.min() < 0 or s.max() >= num_pages * page_size:
        store_kv_ref(blocks, k, v, slots, layer)
        return
    pages, offsets = torch.from_numpy(s // page_size), torch.from_numpy(s % page_size)
    if layer is None:
        # blocks[pages, i, :, offsets] -> [T, L, H, D]
        blocks[pages, 0, :, offsets] = k.transpose(0, 1).to(blocks.dtype)
        blocks[pages, 1, :, offsets] = v.transpose(0, 1).to(blocks.dtype)
    else:
        blocks[pages, 0, layer, offsets] = k.to(blocks.dtype)
        blocks[pages, 1, layer, offsets] = v.to(blocks.dtype)
