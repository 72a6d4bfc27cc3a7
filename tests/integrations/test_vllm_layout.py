"""The CPU block layout the vLLM connector reads, against what vLLM's own CPU kernel writes (the GPU backends'
layout: test_vllm_gpu_layout.py)."""

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from service.integrations.vllm_layout import check_layout, kv_views


class VFirstLayout:
    """A backend that stores V then K per block, head and token (the GPU backends' layout has K first)."""

    def do_kv_cache_update(
        self, layer: Any, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        blocks, offsets = slots // cache.shape[2], slots % cache.shape[2]
        d = cache.shape[3] // 2
        cache[blocks, :, offsets, :d] = value
        cache[blocks, :, offsets, d:] = key


def vec_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The ISA vLLM's CPU attention picks, but "vec" where it picks "amx" (bf16 on an AMX CPU): AMX blocks are
    tiles, which no view reads (the connector learns them: test_vllm_blockmap.py); these tests are the views'."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim)
    return "vec" if isa == "amx" else isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [32, 64])
def test_views_read_what_vllms_cpu_kernel_writes(dtype: torch.dtype, block_size: int) -> None:
    ops = pytest.importorskip("vllm._custom_ops")
    num_blocks, heads, d, n = 5, 2, 32, 3 * block_size - 7
    cache = torch.zeros(num_blocks, heads, block_size, 2 * d, dtype=dtype)
    key, value = torch.randn(n, heads, d).to(dtype), torch.randn(n, heads, d).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:n]  # scattered over blocks and offsets
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, vec_isa(dtype, block_size, d))
    k, v = kv_views(cache)
    blocks, offsets = slots // block_size, slots % block_size
    assert torch.equal(k[blocks, :, offsets], key) and torch.equal(v[blocks, :, offsets], value)


def test_a_layout_it_does_not_know_is_refused() -> None:
    layer = SimpleNamespace(impl=VFirstLayout())
    with pytest.raises(ValueError, match="does not know the KV block layout of VFirstLayout"):
        check_layout(layer, torch.zeros(4, 2, 32, 64))
    with pytest.raises(ValueError, match=r"cache shape \(2, 4, 32, 2, 32\)"):
        check_layout(layer, torch.zeros(2, 4, 32, 2, 32))  # a GPU-style [2, blocks, block_size, heads, d]


def cpu_writer(cache: torch.Tensor) -> Any:
    """vLLM's CPU cache writer for `cache` (what the connector's loads store K/V with)."""
    ops = pytest.importorskip("vllm._custom_ops")
    num_blocks, heads, block_size, twice_d = cache.shape
    isa = vec_isa(cache.dtype, block_size, twice_d // 2)

    def write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, twice_d // 2).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    return write


Where = tuple[torch.Tensor, torch.Tensor]  # (block or page id, offset in it) of each token


def placement(
    gen: torch.Generator, start: int, end: int, blocks: tuple[int, int], pages: tuple[int, int], consecutive: bool
) -> tuple[list[int], list[int], Where, Where]:
    """A sequence's vLLM block ids and kvpool page ids (blocks, pages: (size, how many there are)), consecutive
    or drawn at random, and where each token of [start, end) lies in each."""
    (block, num_blocks), (page_size, num_pages) = blocks, pages
    n_blocks, n_pages = -(-end // block), -(-end // page_size)
    if consecutive:
        block_ids, page_ids = list(range(2, 2 + n_blocks)), list(range(1, 1 + n_pages))
    else:
        block_ids = torch.randperm(num_blocks, generator=gen)[:n_blocks].tolist()
        page_ids = (torch.randperm(num_pages, generator=gen) + 1)[:n_pages].tolist()
    tokens = torch.arange(start, end)
    in_blocks = torch.tensor(block_ids)[tokens // block], tokens % block
    in_pages = torch.tensor(page_ids)[tokens // page_size], tokens % page_size
    return block_ids, page_ids, in_blocks, in_pages


BUILDS = ["narrow", "avx2", "avx512"]  # narrowest first
POISON = -3072.0  # what the load tests fill caches with first: exact in float32 and bf16, never drawn by randn


def expected_build(widest: str, suits_wide: bool, two_bytes: bool = False) -> str:
    """The compiled build a copy takes: the widest up to `widest` that this CPU runs (AVX2 at most for 2-byte
    items), if the copy suits one."""
    from service.integrations.vllm_copy import NATIVE

    assert NATIVE is not None
    cap = BUILDS.index("avx2" if two_bytes else "avx512")
    return BUILDS[min(BUILDS.index(widest), BUILDS.index(NATIVE.CPU_BUILD), cap)] if suits_wide else "narrow"


@pytest.mark.parametrize("build", ["avx512", "avx2", "narrow", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 32, 64, 48, 8])  # runs of 16 or 32 tokens, and of 8
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize(("first", "last"), [(0, 3), (1, 4), (2, 3), (0, 1)])
def test_save_and_load_match_a_token_by_token_copy(
    build: str, dtype: torch.dtype, page_size: int, consecutive: bool, first: int, last: int
) -> None:
    """The tokens of pages [first, last) of a sequence go from vLLM blocks (32) into pool pages and back,
    exactly, and nothing else in the pool or the blocks changes; ids scattered or consecutive. Each build of
    the compiled copy (a wide one where the CPU has it and the shapes suit it: runs of 16 or 32; bf16 loads
    in runs of 16 pair the runs that fill a line of K, or write half a line where a range starts or ends
    mid-line)."""
    from service.integrations.vllm_copy import NATIVE, KVCopier

    native = build != "torch"
    start, end = first * page_size, last * page_size  # the connector saves and loads whole pages
    if native and NATIVE is None:
        pytest.fail("service/integrations/_vllm_copy.c is not built (python setup.py build_ext --inplace)")
    gen = torch.Generator().manual_seed(start * 1000 + end + page_size)
    layers, num_blocks, num_pages, heads, d, block = 2, 12, 13, 2, 32, 32
    caches = [torch.randn(num_blocks, heads, block, 2 * d, generator=gen).to(dtype) for _ in range(layers)]
    pool = torch.randn(num_pages + 1, 2, layers, page_size, heads, d, generator=gen).to(dtype)
    block_ids, pages, in_blocks, in_pages = placement(
        gen, start, end, (block, num_blocks), (page_size, num_pages), consecutive
    )
    expected = pool.clone()
    for layer, cache in enumerate(caches):
        k, v = kv_views(cache)
        expected[in_pages[0], 0, layer, in_pages[1]] = k[in_blocks[0], :, in_blocks[1]]
        expected[in_pages[0], 1, layer, in_pages[1]] = v[in_blocks[0], :, in_blocks[1]]
    widest = build if native else "avx512"
    copier = KVCopier(dict(enumerate(caches)), {}, block, native=native, widest=widest)
    assert copier.native == native
    two_bytes = dtype == torch.bfloat16
    taken = expected_build(widest, page_size % 16 == 0, two_bytes) if native else ""
    for _ in range(2):  # the second time through reused buffers
        copier.save(pool, block_ids, pages, start, end)
        assert torch.equal(pool, expected)
        assert copier.build == taken
    # Loaded into caches poisoned with a value randn never draws (exact in bf16 too): the tokens
    # loaded must come back exactly, and every other element must still hold the poison.
    loaded = [torch.full_like(cache, POISON) for cache in caches]
    writers = {layer: cpu_writer(cache) for layer, cache in enumerate(loaded)}
    loader = KVCopier(dict(enumerate(loaded)), writers, block, native=native, widest=widest)
    loader.load(pool, pages, block_ids, start, end)
    assert loader.build == taken
    for cache, original in zip(loaded, caches, strict=True):
        want = torch.full_like(original, POISON)
        (k, v), (k0, v0) = kv_views(want), kv_views(original)
        k[in_blocks[0], :, in_blocks[1]] = k0[in_blocks[0], :, in_blocks[1]]
        v[in_blocks[0], :, in_blocks[1]] = v0[in_blocks[0], :, in_blocks[1]]
        assert torch.equal(cache, want)


def test_buffers_off_64_byte_lines_take_the_narrow_build_exactly() -> None:
    """A pool and caches that start 4 bytes into a line (views into larger buffers): the wide builds'
    stores need whole lines, so the narrow build copies them, to the same result."""
    from service.integrations.vllm_copy import NATIVE, KVCopier

    if NATIVE is None:
        pytest.fail("service/integrations/_vllm_copy.c is not built (python setup.py build_ext --inplace)")
    gen = torch.Generator().manual_seed(7)
    layers, heads, d, block, page_size = 2, 2, 32, 32, 16
    sources = [torch.randn(6, heads, block, 2 * d, generator=gen) for _ in range(layers)]

    def placed(tensor: torch.Tensor, shifted: bool) -> torch.Tensor:
        """A copy of `tensor`, 4 bytes past torch's 64-byte aligned start if shifted."""
        flat = torch.empty(1 + tensor.numel())
        return flat[int(shifted) : int(shifted) + tensor.numel()].view(tensor.shape).copy_(tensor)

    pools = []
    for shifted in (False, True):
        pool = placed(torch.zeros(9, 2, layers, page_size, heads, d), shifted)
        copier = KVCopier({i: placed(c, shifted) for i, c in enumerate(sources)}, {}, block)
        copier.save(pool, [3, 1, 4], [2, 7, 1, 8, 5, 6], 0, 96)
        assert copier.build == expected_build("avx512", suits_wide=not shifted)
        pools.append(pool)
    assert torch.equal(pools[0], pools[1]) and int(pools[0].count_nonzero()) == 96 * layers * 2 * heads * d


def test_the_compiled_copy_checks_every_run_before_it_writes() -> None:
    from service.integrations.vllm_copy import NATIVE, raw

    if NATIVE is None:
        pytest.fail("service/integrations/_vllm_copy.c is not built (python setup.py build_ext --inplace)")
    caches = [torch.zeros(4, 2, 32, 16) for _ in range(2)]
    pool = torch.ones(5, 2, 2, 16, 2, 8)
    good, bad = [1, 0, 1, 0], [3, 16, 4, 8]  # the second run ends past its page and block
    runs = torch.tensor([good, bad], dtype=torch.int64).numpy()
    with pytest.raises(ValueError, match=r"run 1 \(block 3 \+ 16, page 4 \+ 8\) is outside"):
        NATIVE.copy(raw(pool), [raw(c) for c in caches], runs, 16, False)
    assert all(int(c.count_nonzero()) == 0 for c in caches)  # not even the good run was copied
    with pytest.raises(ValueError, match="widest: expected 'avx512', 'avx2' or 'narrow', not 'avx3'"):
        NATIVE.copy(raw(pool), [raw(c) for c in caches], runs[:1], 16, False, "avx3")
    with pytest.raises(ValueError, match="one layer per cache"):
        NATIVE.copy(raw(pool), [raw(caches[0])], runs[:1], 16, False)
    with pytest.raises(ValueError, match="expected \\[blocks, H, block_size, 2 \\* D\\]"):
        NATIVE.copy(raw(pool), [raw(caches[0]), raw(torch.zeros(4, 3, 32, 16))], runs[:1], 16, False)


def test_a_save_of_tokens_that_are_not_whole_runs_is_refused() -> None:
    from service.integrations.vllm_copy import run_table, save_plan

    with pytest.raises(ValueError, match=r"tokens \[8, 32\) are not runs of 16"):
        save_plan([0], 32, [1, 2], 16, 8, 32)
    with pytest.raises(ValueError, match=r"tokens \[8, 32\) are not runs of 16"):
        run_table([0], 32, [1, 2], 16, 8, 32)
