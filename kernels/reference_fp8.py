"""Torch references of FP8 (e4m3, or e5m2) KV pages with per-group scales.

  blocks  float8_e4m3fn (or float8_e5m2) [num_pages + 1, 2, L, P, H, D]
  scales  scale_dtype   [num_pages + 1, 2, L, P, H, D // g]: one scale per token, head and group of
          g channels; value = fp8 * scale. An unwritten slot has scale 0 (and values 0).

Quantization: scale = amax(|x| over the group) / 448 (448 = largest finite e4m3), rounded to the
scale dtype; fp8 = round-to-nearest-even(x / scale), saturated to ±448. A group of zeros gets scale
0 and values 0 (no 0/0). An e5m2 pool divides by its own largest finite value (57344) instead.
"""

from typing import Unpack

import torch

from kernels.options import AttendOptions
from kernels.reference import paged_attention_ref

FP8_MAX = 448.0


def quantize_fp8(
    x: torch.Tensor,
    group: int,
    scale_dtype: torch.dtype = torch.float32,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] float -> (fp8 [..., D] in fp8_dtype, scales [..., D // group] in scale_dtype)."""
    fp8_max = torch.finfo(fp8_dtype).max  # 448 for e4m3
    grouped = x.float().unflatten(-1, (x.shape[-1] // group, group))  # [..., D//g, g]
    amax = grouped.abs().amax(dim=-1)
    scale = (amax / fp8_max).to(scale_dtype)
    s = scale.float()[..., None]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    y = torch.where(s > 0, grouped / safe, torch.zeros_like(grouped)).clamp(-fp8_max, fp8_max)
    return y.flatten(-2).to(fp8_dtype), scale


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp8 [..., D], scales [..., D // g] -> float32 [..., D]."""
    group = values.shape[-1] // scales.shape[-1]
    return (values.float().unflatten(-1, (scales.shape[-1], group)) * scales.float()[..., None]).flatten(-2)


def store_kv_fp8_ref(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    layer: int | None = None,
) -> None:
    """Quantize and write K/V of T tokens: k, v [T, H, D] for one `layer` or [L, T, H, D] for all.

    Slots that are negative or on the null page are skipped, as in store_kv_ref.
    """
    num_pages, page_size = blocks.shape[0] - 1, blocks.shape[3]
    group = blocks.shape[-1] // scales.shape[-1]
    slots = slots.to(torch.int64)
    pages, offsets = slots // page_size, slots % page_size
    keep = (slots >= 0) & (pages < num_pages)
    pages, offsets = pages[keep], offsets[keep]
    for i, x in enumerate((k, v)):
        values, s = quantize_fp8(x, group, scales.dtype, blocks.dtype)
        if layer is None:
            # blocks[pages, i, :, offsets] -> [T, L, H, D]
            blocks[pages, i, :, offsets] = values[:, keep].transpose(0, 1)
            scales[pages, i, :, offsets] = s[:, keep].transpose(0, 1)
        else:
            blocks[pages, i, layer, offsets] = values[keep]
            scales[pages, i, layer, offsets] = s[keep]


def paged_attention_fp8_ref(
    q: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    layer: int,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    query_start_loc: torch.Tensor,
    **options: Unpack[AttendOptions],
) -> torch.Tensor:
    """paged_attention_ref over the dequantized pages of `layer`. q: [T, Hq, D] -> [T, Hq, D]."""
    pages = dequantize_fp8(blocks[:, :, layer], scales[:, :, layer])  # [N+1, 2, P, H, D] fp32
    out = paged_attention_ref(q, pages.unsqueeze(2), 0, lookup_table, cache_lengths, query_start_loc, **options)
    assert isinstance(out, torch.Tensor)
    return out
