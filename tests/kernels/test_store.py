"""store_kv against exact expected pools and store_kv_ref; the null page must stay all zeros."""

import pytest
import torch

from kernels.reference import store_kv_ref
from kernels.store import store_kv
from service.core.layout import sentinel
from tests.kernels.paged_data import on_device, random_pool


def expected_after_store(
    blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: list[int], layer: int | None
) -> torch.Tensor:
    """The pool after the store, one element row at a time (k, v: [L, T, H, D] or [T, H, D])."""
    want = blocks.clone()
    num_pages, page_size = blocks.shape[0] - 1, blocks.shape[3]
    for t, slot in enumerate(slots):
        page, offset = divmod(slot, page_size)
        if slot < 0 or page >= num_pages:
            continue
        if layer is None:
            want[page, 0, :, offset] = k[:, t].to(blocks.dtype)
            want[page, 1, :, offset] = v[:, t].to(blocks.dtype)
        else:
            want[page, 0, layer, offset] = k[t].to(blocks.dtype)
            want[page, 1, layer, offset] = v[t].to(blocks.dtype)
    return want


def mixed_slots(num_pages: int, page_size: int, seed: int) -> list[int]:
    """Real slots on permuted pages, then negatives, slots on the null page and past the pool."""
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(num_pages, generator=gen)[:3].tolist()
    real = [p * page_size + o for p in pages for o in range(page_size)][: 2 * page_size + 1]
    null = sentinel(num_pages) * page_size
    return [*real, -1, null, null + page_size - 1, null + page_size, -(2**40)]


@pytest.mark.parametrize(
    ("page_size", "layer", "pool_dtype", "kv_dtype"),
    [
        (1, None, torch.float32, torch.float32),
        (4, 1, torch.float32, torch.float32),
        (16, None, torch.bfloat16, torch.float32),
        (4, 0, torch.float16, torch.float16),
    ],
)
def test_store_writes_exact_slots_and_skips_the_rest(
    page_size: int, layer: int | None, pool_dtype: torch.dtype, kv_dtype: torch.dtype
) -> None:
    num_pages, num_layers, heads, head_dim = 6, 3, 2, 64
    blocks = random_pool(num_pages, num_layers, page_size, heads, head_dim, pool_dtype, seed=page_size)
    slots = mixed_slots(num_pages, page_size, seed=page_size)
    gen = torch.Generator().manual_seed(1)
    shape = (len(slots), heads, head_dim) if layer is not None else (num_layers, len(slots), heads, head_dim)
    k, v = torch.randn(shape, generator=gen).to(kv_dtype), torch.randn(shape, generator=gen).to(kv_dtype)
    want = expected_after_store(blocks, k, v, slots, layer)
    by_ref = blocks.clone()
    store_kv_ref(by_ref, k, v, torch.tensor(slots), layer)

    d_blocks, d_k, d_v, d_slots = on_device(blocks, k, v, torch.tensor(slots))
    store_kv(d_blocks, d_k, d_v, d_slots, layer)

    blocks = d_blocks.cpu()
    assert torch.equal(blocks, want)
    assert torch.equal(blocks, by_ref)
    assert blocks[num_pages].count_nonzero() == 0


def test_store_through_a_lookup_table_with_sentinel_rows() -> None:
    """Slots derived from a LUT (as the service does): padded columns and an empty row resolve to the
    sentinel, so those tokens are dropped and the null page stays zero."""
    num_pages, page_size = 5, 4
    blocks = random_pool(num_pages, 2, page_size, 2, 128, torch.float32, seed=3)
    lut = torch.full((3, 8), sentinel(num_pages), dtype=torch.uint32)
    lut[0, :2] = torch.tensor([3, 0], dtype=torch.uint32)
    lut[1, :1] = torch.tensor([4], dtype=torch.uint32)  # row 2 stays all sentinel
    rows = torch.tensor([0] * 10 + [1] * 6 + [2] * 3)
    positions = torch.tensor([*range(10), *range(6), *range(3)])
    slots = lut[rows, positions // page_size].to(torch.int64) * page_size + positions % page_size
    k, v = torch.randn(2, len(slots), 2, 128), torch.randn(2, len(slots), 2, 128)
    want = expected_after_store(blocks, k, v, slots.tolist(), None)

    d_blocks, d_k, d_v, d_slots = on_device(blocks, k, v, slots.to(torch.int32))
    store_kv(d_blocks, d_k, d_v, d_slots)

    blocks = d_blocks.cpu()
    assert torch.equal(blocks, want)
    assert blocks[num_pages].count_nonzero() == 0
    # Only positions 0..7 of row 0 and 0..3 of row 1 had real pages.
    assert torch.equal(blocks[3, :, :, :].transpose(0, 1), torch.stack([k[:, :4], v[:, :4]], 1))


def test_store_of_no_tokens_is_a_no_op() -> None:
    blocks = random_pool(3, 1, 4, 2, 64, torch.float32, seed=4)
    before = blocks.clone()
    (d_blocks,) = on_device(blocks)
    empty = torch.empty(0, 2, 64, device=d_blocks.device)
    store_kv(d_blocks, empty, empty, torch.empty(0, dtype=torch.int64, device=d_blocks.device), 0)
    assert torch.equal(d_blocks.cpu(), before)


@pytest.mark.gpu
def test_store_gpu_many_tokens_bf16() -> None:
    dev = torch.device("cuda")
    num_pages, page_size = 2048, 16
    blocks = random_pool(num_pages, 4, page_size, 8, 128, torch.bfloat16, seed=5).to(dev)
    slots = torch.randperm((num_pages + 2) * page_size)[:5000] - 64  # some negative, some null/past the pool
    k, v = torch.randn(4, 5000, 8, 128), torch.randn(4, 5000, 8, 128)
    want = blocks.clone()
    store_kv_ref(want, k.to(dev), v.to(dev), slots.to(dev))
    store_kv(blocks, k.to(dev), v.to(dev), slots.to(dev))
    assert torch.equal(blocks, want)
    assert blocks[num_pages].count_nonzero() == 0
