"""The CPU serving path (kernels/batched_reference.py) against the per-sequence references and float64.

Batched decode pads every sequence to the longest one: the pages behind the padding (the null page,
the unwritten tail of a last page, other sequences' pages) are filled with NaN, so a padding position
that leaked into a softmax or a weighted sum would show.
"""

import pytest
import torch

from kernels.batched_reference import paged_attention_batched, store_kv_direct
from kernels.reference import paged_attention_ref, store_kv_ref
from tests.kernels.paged_data import assert_close, dense_attention, place_sequences

NUM_KV_HEADS = 2
LAYER = 1

# (GQA group, page size, head_dim, dtype, sliding_window, softcap, scale)
CASES = [
    (1, 4, 16, torch.float32, None, None, None),
    (2, 16, 64, torch.float32, None, None, None),
    (4, 4, 32, torch.float32, 5, None, 0.3),
    (2, 8, 16, torch.float32, None, 2.5, None),
    (4, 1, 16, torch.float32, 3, 4.0, None),
    (2, 16, 64, torch.bfloat16, None, None, None),
    (1, 4, 32, torch.float16, 6, 3.0, None),
]


def nan_pool(num_pages: int, page_size: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((num_pages + 1, 2, 2, page_size, NUM_KV_HEADS, head_dim), float("nan"), dtype=dtype)


@pytest.mark.parametrize(("group", "page_size", "head_dim", "dtype", "window", "softcap", "scale"), CASES)
def test_batched_decode_matches_reference_and_dense(
    group: int,
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
    window: int | None,
    softcap: float | None,
    scale: float | None,
) -> None:
    gen = torch.Generator().manual_seed(page_size * 100 + head_dim + group)
    # Ragged: a first token (position 0), page boundaries either side, and a random length.
    lengths = [1, page_size, page_size + 1, 2 * page_size + 3, int(torch.randint(2, 40, (1,), generator=gen))]
    blocks = nan_pool(64, page_size, head_dim, dtype)
    seqs = place_sequences(blocks, LAYER, lengths, seed=7)
    q = torch.randn(len(lengths), group * NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    lut = seqs.lookup_table.to(torch.int64)
    cache_lengths = torch.tensor([n - 1 for n in lengths])  # each query is the last token of its sequence
    query_start_loc = torch.arange(len(lengths) + 1)
    options = {"sliding_window": window, "softcap": softcap, "scale": scale}

    got = paged_attention_batched(q, blocks, LAYER, lut, cache_lengths, query_start_loc, **options)
    want = paged_attention_ref(q, blocks, LAYER, lut, cache_lengths, query_start_loc, **options)
    assert isinstance(want, torch.Tensor) and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want.double(), atol=tolerance, rtol=tolerance)
    for i, n in enumerate(lengths):
        dense, _ = dense_attention(q[i : i + 1], torch.tensor([n - 1]), seqs.keys[i], seqs.values[i], **options)
        assert_close(got[i : i + 1], dense, dtype, f"sequence {i} (length {n})")


def test_one_position_is_its_value_exactly() -> None:
    """With one visible position the softmax is exactly 1: the output is v itself, bit for bit."""
    blocks = nan_pool(8, 4, 16, torch.bfloat16)
    seqs = place_sequences(blocks, LAYER, [1, 1, 6], seed=3)
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    cache_lengths = torch.tensor([0, 0, 5])
    out = paged_attention_batched(
        q, blocks, LAYER, seqs.lookup_table.to(torch.int64), cache_lengths, torch.arange(4), sliding_window=1
    )
    for i in range(3):
        want = seqs.values[i][-1].to(torch.bfloat16).repeat_interleave(2, dim=0)  # [Hq, D]: both heads of a group
        torch.testing.assert_close(out[i], want, atol=0, rtol=0)


def test_prefill_and_empty_batches_take_the_reference() -> None:
    blocks = nan_pool(16, 4, 16, torch.float32)
    seqs = place_sequences(blocks, LAYER, [6, 9], seed=5)
    lut = seqs.lookup_table.to(torch.int64)
    q = torch.randn(5, 4, 16, generator=torch.Generator().manual_seed(6))
    query_start_loc = torch.tensor([0, 2, 5])  # 2 and 3 queries: a chunked prefill
    cache_lengths = torch.tensor([4, 6])
    got = paged_attention_batched(q, blocks, LAYER, lut, cache_lengths, query_start_loc, softcap=2.0)
    want = paged_attention_ref(q, blocks, LAYER, lut, cache_lengths, query_start_loc, softcap=2.0)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    empty = torch.empty(0, 4, 16)
    out = paged_attention_batched(empty, blocks, LAYER, lut[:0], cache_lengths[:0], torch.zeros(1, dtype=torch.int64))
    assert out.shape == (0, 4, 16)


@pytest.mark.parametrize("layer", [None, 0, 1])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_direct_store_writes_what_the_reference_writes(layer: int | None, pool_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(21)
    num_pages, page_size = 8, 4
    start = torch.randn(num_pages + 1, 2, 2, page_size, NUM_KV_HEADS, 16, generator=gen).to(pool_dtype)
    leading = [5] if layer is not None else [2, 5]
    k, v = (torch.randn(*leading, NUM_KV_HEADS, 16, generator=gen) for _ in range(2))  # float32 into the pool
    cases = {
        "scattered": torch.tensor([13, 0, 31, 6, 7]),  # the last slot of the last real page included
        "out of range": torch.tensor([3, -1, 32, 35, 9]),  # negative and null-page slots are skipped
        "int32": torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32),
    }
    for what, slots in cases.items():
        got, want = start.clone(), start.clone()
        store_kv_direct(got, k, v, slots, layer)
        store_kv_ref(want, k, v, slots, layer)
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=lambda m, w=what: f"{w}: {m}")
        assert not torch.equal(got, start), what
    got = start.clone()
    store_kv_direct(got, k[..., :0, :, :], v[..., :0, :, :], torch.empty(0, dtype=torch.int64), layer)
    torch.testing.assert_close(got, start, atol=0, rtol=0)
