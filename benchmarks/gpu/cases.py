"""Paged batches for the GPU check, made on the device: random pools (every page random, the null page
zero, so a wrong page or an unwritten output shows), ragged lengths on randomly permuted pages."""

from dataclasses import dataclass

import torch

from service.core.layout import lut_columns, pages_for, sentinel


@dataclass
class Batch:
    blocks: torch.Tensor  # [N + 1, KV, 1, P, Hkv, D] (KV 2, or 1 for MLA), one layer
    lookup_table: torch.Tensor  # uint32 [B, cols], sentinel-padded, as the service builds it
    lengths: list[int]  # tokens of K/V each sequence attends (cache + new)
    slots: torch.Tensor  # int64 [sum(lengths)]: every sequence's token slots, in order


def paged_batch(
    lengths: list[int], page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device, seed: int, kv: int = 2,
) -> Batch:  # fmt: skip
    gen = torch.Generator(device).manual_seed(seed)
    need = [pages_for(n, page_size) for n in lengths]
    num_pages = sum(need) + 7  # a few pages no sequence owns: reading one shows
    shape = (num_pages + 1, kv, 1, page_size, num_kv_heads, head_dim)
    blocks = torch.randn(shape, generator=gen, device=device)
    blocks = blocks.to(dtype) if dtype != torch.float8_e4m3fn else (blocks * 4).to(dtype)
    blocks[num_pages] = 0
    perm = torch.randperm(num_pages, generator=gen, device=device)
    lut = torch.full((len(lengths), lut_columns(max(need))), sentinel(num_pages), dtype=torch.int64, device=device)
    slots, used = [], 0
    for i, n in enumerate(lengths):
        pages = perm[used : used + need[i]]
        lut[i, : need[i]] = pages
        pos = torch.arange(n, device=device)
        slots.append(pages[pos // page_size] * page_size + pos % page_size)
        used += need[i]
    return Batch(blocks, lut.to(torch.uint32), lengths, torch.cat(slots))


def fp8_scales(blocks: torch.Tensor, group: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Per-group scales [N + 1, 2, 1, P, H, D // group], random in [0.01, 0.05), zero on the null page."""
    gen = torch.Generator(blocks.device).manual_seed(seed)
    shape = (*blocks.shape[:5], blocks.shape[5] // group)
    scales = (torch.rand(shape, generator=gen, device=blocks.device) * 0.04 + 0.01).to(dtype)
    scales[-1] = 0
    return scales


def query_split(lengths: list[int], new: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(cache_lengths int32 [B], query_start_loc int32 [B + 1], max q_len): the last new[i] tokens of
    sequence i are its queries (decode: new = 1 each)."""
    q_lens = [min(a, n) for a, n in zip(new, lengths)]
    cache = torch.tensor([n - q for n, q in zip(lengths, q_lens)], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return cache, qsl, max(q_lens)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64; inf where got holds a NaN (an element was not written)."""
    got, want = got.double(), want.double()
    if torch.isnan(got).any():
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))
