"""Paged attention on the CPU: decode batches of a float32 pool compiled (kernels/_cpu_decode.c), the rest
through the torch reference.

The torch path gathers every sequence's pages into a batch padded to the longest and permutes K and V
into matmul layout: on a decode step of a few short sequences those copies and a dozen small torch
calls cost ~10x the arithmetic. The compiled decode reads each K/V row it needs once, in place.
"""

import importlib
from types import ModuleType
from typing import Unpack

import torch

from kernels.batched_reference import one_query_per_sequence, paged_attention_batched
from kernels.options import AttendOptions, attend_options

native: ModuleType | None
try:
    native = importlib.import_module("kernels._cpu_decode")
except ImportError:  # not built (a source tree used without `pip install`): the torch path does all
    native = None


# A window at least as long as every position is no window; the C side takes a ssize_t.
WINDOW_CAP = 2**62


def compiled_decode_applies(q: torch.Tensor, blocks: torch.Tensor, query_start_loc: torch.Tensor) -> bool:
    """One query per sequence, a contiguous float32 pool of K and V on the CPU, and the module built."""
    return (
        native is not None
        and blocks.device.type == "cpu"
        and blocks.dtype == torch.float32
        and blocks.dim() == 6
        and blocks.shape[1] == 2
        and blocks.is_contiguous()
        and q.dim() == 3
        and q.is_floating_point()
        and one_query_per_sequence(q, query_start_loc)
    )


def paged_decode_compiled(
    q: torch.Tensor,
    blocks: torch.Tensor,
    layer: int,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    **options: Unpack[AttendOptions],
) -> torch.Tensor:
    """One query per sequence at position cache_lengths[b]. q: [B, Hq, D] -> [B, Hq, D] (q's dtype).

    blocks: float32 [N + 1, 2, L, P, H, D], C-contiguous, on the CPU; lookup_table: [B, cols] int64
    or uint32. The C function checks every shape, position and page id before it computes.
    """
    if native is None:
        raise RuntimeError("kernels/_cpu_decode.c is not built: run `pip install -e .`")
    scale, sliding_window, softcap = attend_options(options, q.shape[-1])
    qf = q.detach().to(torch.float32).contiguous()
    out = torch.empty_like(qf)
    positions = cache_lengths.to(torch.int64).contiguous().numpy()
    lut = lookup_table if lookup_table.dtype in (torch.int64, torch.uint32) else lookup_table.to(torch.int64)
    native.decode(
        qf.numpy(),
        blocks.numpy(),
        layer,
        lut.contiguous().numpy(),
        positions,
        float(scale),
        min(int(sliding_window or 0), WINDOW_CAP),
        float(softcap or 0.0),
        out.numpy(),
    )
    return out.to(q.dtype)


def paged_attention_cpu(
    q: torch.Tensor,
    blocks: torch.Tensor,
    layer: int,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    query_start_loc: torch.Tensor,
    **options: Unpack[AttendOptions],
) -> torch.Tensor:
    """kernels.reference.paged_attention_ref's result (q: [T, Hq, D] -> [T, Hq, D]), compiled where it can be."""
    _, sliding_window, softcap = attend_options(options, q.shape[-1])
    plain = (softcap is None or softcap > 0) and (sliding_window is None or sliding_window >= 0)
    if plain and compiled_decode_applies(q, blocks, query_start_loc):
        return paged_decode_compiled(q, blocks, layer, lookup_table, cache_lengths, **options)
    return paged_attention_batched(q, blocks, layer, lookup_table, cache_lengths, query_start_loc, **options)
