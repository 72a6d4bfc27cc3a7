"""vLLM's per-layer KV cache on the CPU backend, as K and V views indexed like kvpool's pages.

vLLM 0.32's CPU attention keeps one tensor per layer, [num_blocks, num_kv_heads, block_size, 2 * head_dim],
and reads it as [num_blocks, num_kv_heads, 2 * block_size, head_dim]: per block and head, K first, then V.
Its "vec" kernels store K transposed ([head_dim, block_size] per block and head) and V as is
([block_size, head_dim]). The views below undo that with strides (no copy), and `check_layout` proves
it at start by writing known K/V through the backend's own `do_kv_cache_update` into a scratch cache:
a backend or ISA that lays blocks out differently is refused instead of read wrong.
"""

from typing import Any

import torch


def kv_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer's cache, each [num_blocks, num_kv_heads, block_size, head_dim] (views)."""
    if cache.dim() != 4 or cache.shape[3] % 2 or not cache.is_contiguous():
        shape = tuple(cache.shape)
        raise ValueError(f"expected a contiguous [blocks, heads, block_size, 2 * head_dim] cache, not {shape}")
    num_blocks, num_heads, block_size, twice_d = cache.shape
    d = twice_d // 2
    s_block, s_head = cache.stride(0), cache.stride(1)
    offset = cache.storage_offset()
    # K[b, h, t, c] at (b, h) base + c * block_size + t; V[b, h, t, c] at base + block_size * d + t * d + c.
    k = cache.as_strided((num_blocks, num_heads, block_size, d), (s_block, s_head, 1, block_size), offset)
    v = cache.as_strided((num_blocks, num_heads, block_size, d), (s_block, s_head, d, 1), offset + block_size * d)
    return k, v


def check_layout(layer: Any, cache: torch.Tensor) -> None:
    """Raise ValueError unless `kv_views` reads what `layer`'s attention backend writes into `cache`."""
    backend = type(getattr(layer, "impl", layer)).__name__
    refusal = (
        f"kvpool's vLLM connector does not know the KV block layout of {backend} (cache shape "
        f"{tuple(cache.shape)}): it supports vLLM's CPU attention ('vec' kernels)"
    )
    if cache.dim() != 4 or cache.shape[3] % 2:
        raise ValueError(refusal)
    _, num_heads, block_size, twice_d = cache.shape
    scratch = torch.zeros((2, num_heads, block_size, twice_d), dtype=cache.dtype, device=cache.device)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn((block_size, num_heads, twice_d // 2), generator=gen).to(cache.dtype).to(cache.device)
    value = torch.randn((block_size, num_heads, twice_d // 2), generator=gen).to(cache.dtype).to(cache.device)
    slots = torch.arange(block_size, 2 * block_size, device=cache.device)  # block 1, every offset
    try:
        layer.impl.do_kv_cache_update(layer, key, value, scratch, slots)
    except Exception as exc:
        raise ValueError(f"{refusal}; writing a probe failed: {exc}") from exc
    k, v = kv_views(scratch)
    # k[1]: [heads, block_size, head_dim] -> [block_size, heads, head_dim] like `key`.
    if not (torch.equal(k[1].transpose(0, 1), key) and torch.equal(v[1].transpose(0, 1), value)):
        raise ValueError(refusal)
