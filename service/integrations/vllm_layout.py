"""vLLM's per-layer KV cache, as K and V views indexed like kvpool's pages, for the block layouts vLLM uses.

vLLM 0.32 keeps one tensor per layer of logical shape [num_blocks, num_kv_heads, block_size, 2 * head_dim],
and its backends store K/V into it two ways:

- `Layout.CPU_VEC`, the CPU attention ('vec' kernels): the tensor is read as [num_blocks, num_kv_heads,
  2 * block_size, head_dim], per block and head K first, stored transposed ([head_dim, block_size]), then V as
  is ([block_size, head_dim]). The CPU backend allocates it contiguous (it supports only KVCacheLayout.LBHNC).
- `Layout.TOKEN_KV`, the GPU backends (flash_attn.py `do_kv_cache_update`, triton_attn.py and flashinfer.py
  alike: `key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)`): per block, head and
  token, K in the first head_dim of the last dim, then V. This holds of the *logical* tensor: vLLM allocates it
  with a stride order (vllm/v1/kv_cache_layout.py, KVCacheLayout: LBNHC, token-major, is the default, LBHNC,
  BLHNC... what the backends accept) and hands out the permuted view, so the views below slice that view and
  keep its strides, whatever the physical order.

The views are strided (no copy). `check_layout` proves which layout a backend writes at start, by writing
known K/V through the backend's own `do_kv_cache_update` into a scratch cache shaped and strided like the
real one and reading them back through each layout's views; a backend that lays blocks out some other way
raises, and the connector then learns its layout (vllm_blockmap) or refuses it, instead of reading it wrong.
"""

from enum import Enum
from typing import Any

import torch


class Layout(Enum):
    CPU_VEC = "vLLM's CPU attention ('vec' kernels)"
    TOKEN_KV = "vLLM's GPU attention backends (flash_attn, triton_attn, flashinfer: K then V per token)"


def kv_views(cache: torch.Tensor, layout: Layout = Layout.CPU_VEC) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer's cache, each [num_blocks, num_kv_heads, block_size, head_dim] (views)."""
    if cache.dim() != 4 or cache.shape[3] % 2:
        raise ValueError(f"expected a [blocks, heads, block_size, 2 * head_dim] cache, not {tuple(cache.shape)}")
    num_blocks, num_heads, block_size, twice_d = cache.shape
    d = twice_d // 2
    if layout is Layout.TOKEN_KV:
        return cache[..., :d], cache[..., d:]
    if not cache.is_contiguous():
        raise ValueError(f"expected a contiguous cache for {layout.value}, not strides {cache.stride()}")
    s_block, s_head = cache.stride(0), cache.stride(1)
    offset = cache.storage_offset()
    # K[b, h, t, c] at (b, h) base + c * block_size + t; V[b, h, t, c] at base + block_size * d + t * d + c.
    k = cache.as_strided((num_blocks, num_heads, block_size, d), (s_block, s_head, 1, block_size), offset)
    v = cache.as_strided((num_blocks, num_heads, block_size, d), (s_block, s_head, d, 1), offset + block_size * d)
    return k, v


def scratch_like(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A zeroed cache of `num_blocks` blocks with `cache`'s dims in the same physical order (its stride order)."""
    order = sorted(range(cache.dim()), key=lambda dim: cache.stride(dim), reverse=True)  # outermost first
    shape = (num_blocks, *cache.shape[1:])
    physical = torch.zeros([shape[dim] for dim in order], dtype=cache.dtype, device=cache.device)
    return physical.permute([order.index(dim) for dim in range(cache.dim())])


def check_layout(layer: Any, cache: torch.Tensor) -> Layout:
    """The layout `layer`'s attention backend writes into `cache`; ValueError when no known layout reads it."""
    backend = type(getattr(layer, "impl", layer)).__name__
    refusal = (
        f"kvpool's vLLM connector does not know the KV block layout of {backend} (cache shape "
        f"{tuple(cache.shape)}): it supports {'; '.join(layout.value for layout in Layout)}"
    )
    if cache.dim() != 4 or cache.shape[3] % 2:
        raise ValueError(refusal)
    _, num_heads, block_size, twice_d = cache.shape
    scratch = scratch_like(cache, 2)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn((block_size, num_heads, twice_d // 2), generator=gen).to(cache.dtype).to(cache.device)
    value = torch.randn((block_size, num_heads, twice_d // 2), generator=gen).to(cache.dtype).to(cache.device)
    slots = torch.arange(block_size, 2 * block_size, device=cache.device)  # block 1, every offset
    try:
        layer.impl.do_kv_cache_update(layer, key, value, scratch, slots)
    except Exception as exc:
        raise ValueError(f"{refusal}; writing a probe failed: {exc}") from exc
    for layout in Layout:
        if layout is Layout.CPU_VEC and not scratch.is_contiguous():
            continue  # its views reinterpret contiguous memory
        k, v = kv_views(scratch, layout)
        # k[1]: [heads, block_size, head_dim] -> [block_size, heads, head_dim] like `key`.
        if torch.equal(k[1].transpose(0, 1), key) and torch.equal(v[1].transpose(0, 1), value):
            return layout
    raise ValueError(refusal)
