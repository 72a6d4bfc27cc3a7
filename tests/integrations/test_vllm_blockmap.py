"""Learned block layouts (vllm_blockmap) against vLLM's own CPU cache writers: AMX tiles, FP8 bytes, MLA.

The writers are vLLM's kernels (cpu_attn_reshape_and_cache for each ISA and KV-cache dtype, the AMX MLA
writer, the reference CPU MLA one), called as the backends' do_kv_cache_update calls them. Each case learns
the map, saves a sequence written by the writer into kvpool-shaped pages, loads it into a poisoned cache at
other blocks, and compares bits: the pages hold each token's K/V as kvpool's page layout says, and the
loaded blocks hold what the writer wrote.
"""

from collections.abc import Callable

import pytest
import torch

pytest.importorskip("vllm")

from service.integrations.vllm_blockmap import (
    SYMBOLS,
    LearnedCopier,
    UnknownLayout,
    learn_block_map,
    raw_bits,
)
from service.integrations.vllm_layout import Layout, kv_views

BLOCK, PAGE, HEADS, HEAD_DIM = 32, 16, 2, 64
FP8 = {"fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}


def has_amx() -> bool:
    return bool(torch.cpu._is_amx_tile_supported())


def attention_writer(isa: str, kv_cache_dtype: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """vLLM's CPU attention writer (CPUAttentionBackendImpl.do_kv_cache_update) for one ISA and cache dtype."""
    from vllm import _custom_ops as ops

    def write(values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        num_blocks, heads, block, _ = cache.shape
        key_cache, value_cache = cache.view(num_blocks, heads, 2 * block, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            values[0], values[1], key_cache, value_cache, slots, isa, 1.0, 1.0, kv_cache_dtype
        )

    return write


def mla_writer(kind: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    def write(values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        latent, rope = values[0, :, 0, :512].contiguous(), values[0, :, :, 512:].contiguous()
        if kind == "amx":
            ops.amx_mla_concat_and_cache(latent, rope.squeeze(1), cache, slots)
        else:  # the reference writer uses nothing of its instance
            CPUMLAImpl.do_kv_cache_update(None, latent, rope, cache, slots, "auto", torch.ones(()))  # type: ignore[arg-type]

    return write


CASES = {
    # name: (writer, components, heads, head_dim, model dtype, cache dtype, block, needs AMX)
    "vec-float32": (attention_writer("vec", "auto"), 2, HEADS, HEAD_DIM, torch.float32, torch.float32, BLOCK, False),
    "amx-bfloat16": (attention_writer("amx", "auto"), 2, HEADS, HEAD_DIM, torch.bfloat16, torch.bfloat16, BLOCK, True),
    "vec-fp8_e5m2": (attention_writer("vec", "fp8_e5m2"), 2, HEADS, HEAD_DIM, torch.float32, torch.uint8, BLOCK, False),
    "vec-fp8_e4m3": (attention_writer("vec", "fp8_e4m3"), 2, HEADS, HEAD_DIM, torch.float32, torch.uint8, BLOCK, False),
    "amx-fp8_e5m2": (attention_writer("amx", "fp8_e5m2"), 2, HEADS, HEAD_DIM, torch.bfloat16, torch.uint8, BLOCK, True),
    "mla-amx": (mla_writer("amx"), 1, 1, 576, torch.bfloat16, torch.bfloat16, BLOCK, True),
    "mla-reference": (mla_writer("reference"), 1, 1, 576, torch.bfloat16, torch.bfloat16, 16, False),
}


def empty_cache(components: int, heads: int, head_dim: int, block: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    if components == 1:
        return torch.zeros(n, block, head_dim, dtype=dtype)  # MLA: [blocks, block, kv_lora_rank + rope]
    return torch.zeros(n, heads, block, 2 * head_dim, dtype=dtype)


@pytest.mark.parametrize("name", list(CASES))
def test_learned_map_moves_the_writers_bits_through_pages_and_back(name: str) -> None:
    write, c, h, d, dtype, cache_dtype, block, amx = CASES[name]
    if amx and not has_amx():
        pytest.skip("needs a CPU with AMX")
    cache = empty_cache(c, h, d, block, cache_dtype, 6)
    bmap = learn_block_map(write, cache, c, h, d, dtype)
    assert bmap.block_size == block and bmap.components == c

    # A sequence of 2.5 blocks written by vLLM's writer into blocks 4, 1, 5 (random symbols: exact in FP8 too).
    num_tokens = 2 * block + block // 2
    gen = torch.Generator().manual_seed(1)
    values = torch.tensor(SYMBOLS)[torch.randint(len(SYMBOLS), (c, num_tokens, h, d), generator=gen)]
    values *= torch.rand((c, num_tokens, h, d), generator=gen).lt(0.5) + 1.0  # more than 16 values
    src_blocks = [4, 1, 5]
    slots = torch.tensor([src_blocks[t // block] * block + t % block for t in range(num_tokens)])
    write(values.to(dtype), cache, slots)

    pool_dtype = FP8[name.split("-")[1]] if cache_dtype == torch.uint8 else dtype
    num_pages = 12
    pool = torch.randn(num_pages + 1, c, 1, PAGE, h, d).to(pool_dtype)  # poisoned: random bits everywhere
    pages = [9, 2, 7, 0, 11][: -(-num_tokens // PAGE)]
    copier = LearnedCopier({0: cache}, bmap)
    copier.save(pool, None, src_blocks, pages, 0, num_tokens)
    # The pages hold token-major K/V ([page, H, D] per component): what kvpool's own kernels read.
    stored = torch.stack([pool[pages[t // PAGE], :, 0, t % PAGE] for t in range(num_tokens)], dim=1)
    expected = values.to(pool_dtype) if pool_dtype != dtype else values.to(dtype)
    assert torch.equal(raw_bits(stored), raw_bits(expected.contiguous()))

    # Loaded into another cache (poisoned) at other blocks: the bits of every token are the writer's.
    other = empty_cache(c, h, d, block, cache_dtype, 6)
    raw_bits(other).copy_(torch.randint(0, 100, raw_bits(other).shape, generator=gen))
    before = other.clone()
    dst_blocks = [2, 0, 3]
    assert LearnedCopier({0: other}, bmap).load(pool, None, pages, dst_blocks, 0, num_tokens)
    flat_src, flat_dst = raw_bits(cache).reshape(6, -1), raw_bits(other).reshape(6, -1)
    for t in range(num_tokens):
        where = bmap.where[:, t % block].reshape(-1)
        assert torch.equal(flat_dst[dst_blocks[t // block], where], flat_src[src_blocks[t // block], where]), t
    # Nothing else changed: untouched blocks, and the slots past the sequence in its last block.
    untouched = [b for b in range(6) if b not in dst_blocks]
    assert torch.equal(raw_bits(other)[untouched], raw_bits(before)[untouched])
    tail = bmap.where[:, num_tokens % block :].reshape(-1)
    assert torch.equal(flat_dst[dst_blocks[-1], tail], raw_bits(before).reshape(6, -1)[dst_blocks[-1], tail])


def test_the_cpu_vec_map_is_the_known_view_layout() -> None:
    """The probe finds for vLLM's 'vec' blocks what vllm_layout's views read (K transposed, then V)."""
    write, c, h, d, dtype, cache_dtype, block, _ = CASES["vec-float32"]
    cache = empty_cache(c, h, d, block, cache_dtype, 1)
    bmap = learn_block_map(write, cache, c, h, d, dtype)
    positions = torch.arange(cache.numel()).view(cache.shape).float()
    k, v = kv_views(positions, Layout.CPU_VEC)  # [1, H, block, D] each
    for i, view in enumerate((k, v)):
        assert torch.equal(bmap.where[i].view(block, h, d), view[0].transpose(0, 1).long())


def test_fp8_scales_are_written_and_checked() -> None:
    write, c, h, d, dtype, cache_dtype, block, _ = CASES["vec-fp8_e5m2"]
    cache = empty_cache(c, h, d, block, cache_dtype, 2)
    bmap = learn_block_map(write, cache, c, h, d, dtype)
    raw_bits(cache).copy_(torch.randint(1, 100, cache.shape, dtype=torch.uint8))
    pool = torch.zeros(4, 2, 1, PAGE, h, d, dtype=torch.float8_e5m2)
    scales = torch.full((4, 2, 1, PAGE, h, 2), 7.0)  # poisoned
    LearnedCopier({0: cache}, bmap, {0: (1.0, 0.5)}).save(pool, scales, [1], [2, 0], 0, block)
    assert torch.equal(scales[[2, 0], 0], torch.ones(2, 1, PAGE, h, 2))
    assert torch.equal(scales[[2, 0], 1], torch.full((2, 1, PAGE, h, 2), 0.5))
    assert bool((scales[[1, 3]] == 7.0).all())
    other = torch.zeros_like(cache)
    assert LearnedCopier({0: other}, bmap, {0: (1.0, 0.5)}).load(pool, scales, [2, 0], [0], 0, block)
    assert torch.equal(other[0], cache[1])
    # Pages quantized under other scales are not loaded (nothing is copied).
    other.zero_()
    assert not LearnedCopier({0: other}, bmap, {0: (2.0, 0.5)}).load(pool, scales, [2, 0], [0], 0, block)
    assert not LearnedCopier({0: other}, bmap, {0: (1.0, 0.5)}).load(pool, None, [2, 0], [0], 0, block)
    assert not bool(other.any())


@pytest.mark.parametrize(
    "broken",
    ["drops V", "leaks into another block", "sums channels"],
)
def test_a_writer_that_is_no_permutation_is_refused(broken: str) -> None:
    write = attention_writer("vec", "auto")

    def bad(values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        if broken == "drops V":
            values = torch.stack([values[0], values[0]])
        elif broken == "sums channels":
            values = values + values.roll(1, dims=-1)
        write(values, cache, slots)
        if broken == "leaks into another block":
            cache[0, 0, 0, 0] = 1.0

    cache = torch.zeros(2, HEADS, BLOCK, 2 * HEAD_DIM)
    with pytest.raises(UnknownLayout):
        learn_block_map(bad, cache, 2, HEADS, HEAD_DIM, torch.float32)


def test_amx_blocks_are_no_view_layout_and_are_learned() -> None:
    """bf16 on an AMX CPU: vLLM's blocks are tiles; the views' probe refuses them, the learned map reads them."""
    from types import SimpleNamespace

    from service.integrations.vllm_layout import check_layout

    if not has_amx():
        pytest.skip("needs a CPU with AMX")
    write = attention_writer("amx", "auto")
    impl = SimpleNamespace(
        do_kv_cache_update=lambda layer, k, v, cache, slots: write(torch.stack([k, v]), cache, slots)
    )
    cache = empty_cache(2, HEADS, HEAD_DIM, BLOCK, torch.bfloat16, 2)
    with pytest.raises(ValueError, match="does not know the KV block layout"):
        check_layout(SimpleNamespace(impl=impl), cache)
    bmap = learn_block_map(write, cache, 2, HEADS, HEAD_DIM, torch.bfloat16)
    vec = learn_block_map(attention_writer("vec", "auto"), cache, 2, HEADS, HEAD_DIM, torch.bfloat16)
    assert not torch.equal(bmap.where, vec.where)
