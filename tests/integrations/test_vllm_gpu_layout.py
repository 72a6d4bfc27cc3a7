"""The GPU attention backends' KV block layout, on the CPU: the views, the start-up probe, and the connector's
save and load copies through it, for caches strided as vLLM allocates them."""

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from service.integrations.vllm_copy import KVCopier
from service.integrations.vllm_layout import Layout, check_layout, kv_views, scratch_like
from tests.integrations.test_vllm_layout import placement

pytest.importorskip("vllm")

from vllm.v1.kv_cache_layout import KVCacheLayout


class GPUBackend:
    """vLLM 0.32's GPU `do_kv_cache_update`, with torch indexing in place of its CUDA / Triton kernel.

    vllm/v1/attention/backends/flash_attn.py:1443 (and triton_attn.py:796, flashinfer.py:2661,
    flex_attention.py:1233): `key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)`,
    then `reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, ...)`, which stores token i
    at key_cache[slot // block_size, slot % block_size] (vllm/v1/attention/ops/triton_reshape_and_cache_flash.py
    lines 61-67: block_idx = slot_idx // block_size, block_offset = slot_idx % block_size).
    """

    def do_kv_cache_update(
        self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(key.shape[-1], dim=-1)  # [B, N, H, D] each
        block_size = key_cache.shape[1]
        blocks, offsets = slots // block_size, slots % block_size
        key_cache[blocks, offsets] = key
        value_cache[blocks, offsets] = value


class SwappedBackend:
    """V before K per token: a layout no vLLM backend uses, which the probe must refuse."""

    def do_kv_cache_update(
        self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        GPUBackend().do_kv_cache_update(layer, value, key, kv_cache, slots)


def gpu_write(cache: torch.Tensor) -> Any:
    layer = SimpleNamespace(impl=GPUBackend())
    return lambda key, value, slots: layer.impl.do_kv_cache_update(layer, key, value, cache, slots)


def vllm_caches(layout: KVCacheLayout, layers: int, num_blocks: int, heads: int, block: int, d: int, **kw: Any) -> Any:
    """Every layer's logical [B, H, N, 2D] view of one buffer in `layout`'s physical order, as vLLM allocates them
    (vllm/v1/kv_cache_interface.py compute_layout_strides + create_kv_cache_views, without page padding):
    LBNHC (vLLM's default) keeps a block token-major, BLHNC interleaves the layers' blocks."""
    logical = (layers, num_blocks, heads, block, 2 * d)  # [L, B, H, N, C]
    order = layout.stride_order  # physical position -> logical dim
    physical = torch.randn([logical[dim] for dim in order], **kw)
    view = physical.permute([order.index(dim) for dim in range(5)])
    return [view[layer] for layer in range(layers)]


LAYOUTS = [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLHNC]


def cpu_layer(dtype: torch.dtype, block_size: int, head_dim: int, heads: int) -> Any:
    """A layer with vLLM's real CPU attention implementation (its do_kv_cache_update, its kernel)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from tests.integrations.test_vllm_layout import vec_isa

    config = VllmConfig()
    # The constructor reads the model's dtype from the current config; no model is loaded here.
    object.__setattr__(config, "model_config", SimpleNamespace(dtype=dtype))
    with set_current_vllm_config(config):
        impl = CPUAttentionBackendImpl(heads, head_dim, 1.0, heads, None, None, "auto")
    isa = vec_isa(dtype, block_size, head_dim)
    return SimpleNamespace(impl=impl, isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probe_picks_each_backends_layout(dtype: torch.dtype) -> None:
    heads, block, d = 2, 32, 32
    cpu_cache = torch.zeros(4, heads, block, 2 * d, dtype=dtype)
    assert check_layout(cpu_layer(dtype, block, d, heads), cpu_cache) is Layout.CPU_VEC
    for layout in LAYOUTS:
        cache = vllm_caches(layout, 2, 4, heads, block, d, dtype=dtype)[1]
        scratch = scratch_like(cache, 2)  # the probe's: the real cache's dims in the same physical order
        assert scratch.shape == (2, heads, block, 2 * d) and not scratch.any()
        assert sorted(range(4), key=scratch.stride) == sorted(range(4), key=cache.stride), layout
        assert check_layout(SimpleNamespace(impl=GPUBackend()), cache) is Layout.TOKEN_KV, layout
        with pytest.raises(ValueError, match="does not know the KV block layout of SwappedBackend"):
            check_layout(SimpleNamespace(impl=SwappedBackend()), cache)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_gpu_views_read_what_the_backend_writes_without_copies(layout: KVCacheLayout) -> None:
    num_blocks, heads, block, d, n = 5, 2, 16, 8, 61
    cache = vllm_caches(layout, 2, num_blocks, heads, block, d)[0]
    key, value = torch.randn(n, heads, d), torch.randn(n, heads, d)
    slots = torch.randperm(num_blocks * block)[:n]
    gpu_write(cache)(key, value, slots)
    k, v = kv_views(cache, Layout.TOKEN_KV)
    assert k.shape == v.shape == (num_blocks, heads, block, d)
    blocks, offsets = slots // block, slots % block
    assert torch.equal(k[blocks, :, offsets], key) and torch.equal(v[blocks, :, offsets], value)
    assert k.data_ptr() == cache.data_ptr() and v.data_ptr() == cache.data_ptr() + d * cache.element_size()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [32, 16, 48, 8])  # = block, and != block (runs of 16, 16 and 8)
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize(("first", "last"), [(0, 3), (1, 4)])
def test_save_and_load_in_the_gpu_layout_are_exact(
    layout: KVCacheLayout, dtype: torch.dtype, page_size: int, consecutive: bool, first: int, last: int
) -> None:
    """Pages [first, last) of a sequence go from vLLM blocks (32 tokens) into poisoned pool pages and back into
    poisoned blocks, exactly, and nothing else changes; the copier takes the torch path for this layout."""
    start, end = first * page_size, last * page_size
    gen = torch.Generator().manual_seed(start * 1000 + end + page_size)
    layers, num_blocks, num_pages, heads, d, block = 2, 12, 13, 2, 32, 32
    caches = vllm_caches(layout, layers, num_blocks, heads, block, d, generator=gen, dtype=dtype)
    pool = torch.randn(num_pages + 1, 2, layers, page_size, heads, d, generator=gen).to(dtype)  # the poison
    block_ids, pages, in_blocks, in_pages = placement(
        gen, start, end, (block, num_blocks), (page_size, num_pages), consecutive
    )
    expected = pool.clone()
    for i, cache in enumerate(caches):  # token by token, through the logical tensor: K then V per token
        expected[in_pages[0], 0, i, in_pages[1]] = cache[in_blocks[0], :, in_blocks[1], :d]
        expected[in_pages[0], 1, i, in_pages[1]] = cache[in_blocks[0], :, in_blocks[1], d:]
    copier = KVCopier(dict(enumerate(caches)), {}, block, layout=Layout.TOKEN_KV)
    assert not copier.native  # the compiled copy knows the CPU layout only
    for _ in range(2):  # the second time through reused buffers
        copier.save(pool, block_ids, pages, start, end)
        assert torch.equal(pool, expected)

    loaded = vllm_caches(layout, layers, num_blocks, heads, block, d, generator=gen, dtype=dtype)  # poisoned
    poison = [cache.clone() for cache in loaded]
    writers = {i: gpu_write(cache) for i, cache in enumerate(loaded)}
    KVCopier(dict(enumerate(loaded)), writers, block, layout=Layout.TOKEN_KV).load(pool, pages, block_ids, start, end)
    for cache, before, original in zip(loaded, poison, caches, strict=True):
        assert torch.equal(cache[in_blocks[0], :, in_blocks[1]], original[in_blocks[0], :, in_blocks[1]])
        before[in_blocks[0], :, in_blocks[1]] = original[in_blocks[0], :, in_blocks[1]]
        assert torch.equal(cache, before)  # nothing else written
