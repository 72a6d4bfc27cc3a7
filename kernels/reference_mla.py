"""Torch references of MLA (multi-head latent attention) over a latent page pool.

blocks  [num_pages + 1, 1, L, P, 1, D]: one latent of D = kv_lora_rank + rope channels per token
        (the K/V dimension and the KV-head dimension are both 1).
q       [T, Hq, D]: queries already absorbed into the latent space (q_nope·W_UK ++ q_rope).
scores  q · latent over all D channels; values = latent[:, :kv_lora_rank]; out [T, Hq, kv_lora_rank].
"""

from typing import Unpack

import torch

from kernels.options import AttendOptions
from kernels.reference import paged_attention_ref


def store_latent_ref(blocks: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor, layer: int | None = None) -> None:
    """Write latents of T tokens: [T, 1, D] into `layer`, or [L, T, 1, D] into every layer.

    Negative slots and slots on the null page are skipped.
    """
    num_pages, page_size = blocks.shape[0] - 1, blocks.shape[3]
    slots = slots.to(torch.int64)
    pages, offsets = slots // page_size, slots % page_size
    keep = (slots >= 0) & (pages < num_pages)
    pages, offsets = pages[keep], offsets[keep]
    if layer is None:
        blocks[pages, 0, :, offsets] = latent[:, keep].transpose(0, 1).to(blocks.dtype)  # [T, L, 1, D]
    else:
        blocks[pages, 0, layer, offsets] = latent[keep].to(blocks.dtype)


def mla_attention_ref(
    q: torch.Tensor,
    blocks: torch.Tensor,
    layer: int,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_lora_rank: int,
    **options: Unpack[AttendOptions],
) -> torch.Tensor:
    """Causal MLA decode/prefill. q: [T, Hq, D] -> [T, Hq, kv_lora_rank] in q's dtype.

    Values are the latent's first kv_lora_rank channels, so attention with V = the whole latent,
    cut to its first kv_lora_rank output channels, is MLA exactly (the output is linear in V).
    """
    latent = blocks[:, :, layer : layer + 1]  # [N+1, 1, 1, P, 1, D]
    kv = latent.expand(-1, 2, -1, -1, -1, -1)  # K = V = latent, a view
    out = paged_attention_ref(q, kv, 0, lookup_table, cache_lengths, query_start_loc, **options)
    assert isinstance(out, torch.Tensor)
    return out[..., :kv_lora_rank].contiguous()
