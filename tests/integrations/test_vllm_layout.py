"""The CPU block layout the vLLM connector reads, against what vLLM's own CPU kernel writes."""

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from service.integrations.vllm_layout import check_layout, kv_views


class NaturalLayout:
    """A backend that stores K as [block_size, head_dim] per block and head (not vLLM's CPU layout)."""

    def do_kv_cache_update(
        self, layer: Any, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        blocks, offsets = slots // cache.shape[2], slots % cache.shape[2]
        d = cache.shape[3] // 2
        cache[blocks, :, offsets, :d] = key
        cache[blocks, :, offsets, d:] = value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [32, 64])
def test_views_read_what_vllms_cpu_kernel_writes(dtype: torch.dtype, block_size: int) -> None:
    ops = pytest.importorskip("vllm._custom_ops")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    num_blocks, heads, d, n = 5, 2, 32, 3 * block_size - 7
    cache = torch.zeros(num_blocks, heads, block_size, 2 * d, dtype=dtype)
    key, value = torch.randn(n, heads, d).to(dtype), torch.randn(n, heads, d).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:n]  # scattered over blocks and offsets
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, _get_attn_isa(dtype, block_size, d))
    k, v = kv_views(cache)
    blocks, offsets = slots // block_size, slots % block_size
    assert torch.equal(k[blocks, :, offsets], key) and torch.equal(v[blocks, :, offsets], value)


def test_a_layout_it_does_not_know_is_refused() -> None:
    layer = SimpleNamespace(impl=NaturalLayout())
    with pytest.raises(ValueError, match="does not know the KV block layout of NaturalLayout"):
        check_layout(layer, torch.zeros(4, 2, 32, 64))
    with pytest.raises(ValueError, match=r"cache shape \(2, 4, 32, 2, 32\)"):
        check_layout(layer, torch.zeros(2, 4, 32, 2, 32))  # a GPU-style [2, blocks, block_size, heads, d]


@pytest.mark.parametrize("unit_size", [16, 32])
@pytest.mark.parametrize(("start", "end"), [(0, 64), (32, 96), (5, 70), (17, 18), (0, 1)])
def test_read_and_write_tokens_match_a_token_by_token_copy(unit_size: int, start: int, end: int) -> None:
    from service.integrations.vllm_layout import read_tokens, write_tokens

    gen = torch.Generator().manual_seed(start * 1000 + end)
    num_units, heads, d = 12, 2, 8
    units = torch.randn(num_units, heads, unit_size, d, generator=gen)
    unit_ids = torch.randperm(num_units, generator=gen).tolist()  # the sequence's units, out of order
    tokens = torch.arange(start, end)
    where = torch.tensor(unit_ids)[tokens // unit_size], tokens % unit_size
    assert torch.equal(read_tokens(units, unit_ids, start, end), units[where[0], :, where[1]])
    values = torch.randn(end - start, heads, d, generator=gen)
    expected = units.clone()
    expected[where[0], :, where[1]] = values
    write_tokens(units, unit_ids, start, values)
    assert torch.equal(units, expected)  # the tokens written, and nothing else changed
    # A transposed view, as the pool is read ([pages, P, H, D] -> [pages, H, P, D]): writes land in the base.
    base = torch.zeros(num_units, unit_size, heads, d)
    write_tokens(base.transpose(1, 2), unit_ids, start, values)
    assert torch.equal(base.transpose(1, 2)[where[0], :, where[1]], values)
    assert int((base != 0).sum()) == values.numel()
