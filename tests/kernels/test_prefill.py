"""paged_prefill (chunked prefill) against its torch reference and a float64 dense attention."""

import pytest
import torch

from kernels.prefill import paged_prefill
from kernels.reference import paged_attention_ref
from tests.kernels.paged_data import DEVICE, assert_close, dense_attention, on_device, place_sequences, random_pool

NUM_KV_HEADS = 2
LAYER = 0

# (GQA group, page size, head_dim, dtype, block_m, block_n, sliding_window, softcap)
CASES = [
    (1, 1, 64, torch.float32, 16, 16, None, None),
    (4, 4, 64, torch.float32, 32, 16, None, None),
    (8, 16, 128, torch.float32, 32, 16, None, None),
    (4, 4, 128, torch.float32, 16, 16, 6, None),
    (4, 16, 64, torch.float32, 32, 16, 13, 5.0),
    (8, 1, 64, torch.float32, 32, 16, None, 3.0),
    (4, 16, 64, torch.bfloat16, None, None, None, None),
    (1, 4, 128, torch.float16, 32, 16, 4, 4.0),
]


def chunks_for(page_size: int) -> list[tuple[int, int]]:
    """(cached prefix, new tokens) per sequence: empty prefix, prefixes and totals at page multiples,
    a sequence with no new tokens, a single new token, and a chunk spanning several tiles."""
    p = page_size
    return [(0, 5), (p, 3), (7, 0), (0, 1), (2 * p - 1, p + 1), (11, 17)]


@pytest.mark.parametrize(("group", "page_size", "head_dim", "dtype", "block_m", "block_n", "window", "softcap"), CASES)
def test_prefill_matches_reference_and_dense(
    group: int,
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
    block_m: int | None,
    block_n: int | None,
    window: int | None,
    softcap: float | None,
) -> None:
    seed = 7 * page_size + head_dim + group
    chunks = chunks_for(page_size)
    totals = [c + n for c, n in chunks]
    num_pages = sum(-(-t // page_size) for t in totals) + 3
    blocks = random_pool(num_pages, 2, page_size, NUM_KV_HEADS, head_dim, dtype, seed)
    data = place_sequences(blocks, LAYER, totals, seed)
    q_lens = [n for _, n in chunks]
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(q_lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    cache_lengths = torch.tensor([c for c, _ in chunks])
    query_start_loc = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    options = {"sliding_window": window, "softcap": softcap}
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    lse = torch.full(q.shape[:2], float("nan"), device=DEVICE)
    d_q, d_blocks, d_lut, d_lengths, d_qsl = on_device(q, blocks, data.lookup_table, cache_lengths, query_start_loc)

    paged_prefill(
        d_q, d_blocks, LAYER, d_lut, d_lengths, d_qsl,
        return_lse=True, out=out, lse=lse, block_m=block_m, block_n=block_n, **options,
    )  # fmt: skip

    out, lse = out.cpu(), lse.cpu()

    ref_out, ref_lse = paged_attention_ref(
        q, blocks, LAYER, data.lookup_table, cache_lengths, query_start_loc, return_lse=True, **options
    )
    assert_close(out, ref_out, dtype, "out vs reference")
    assert_close(lse, ref_lse, dtype, "lse vs reference")
    starts = query_start_loc.tolist()
    for i, (cached, new) in enumerate(chunks):
        lo, hi = starts[i], starts[i + 1]
        positions = torch.arange(cached, cached + new)
        want_out, want_lse = dense_attention(q[lo:hi], positions, data.keys[i], data.values[i], **options)
        assert_close(out[lo:hi], want_out, dtype, f"out vs dense, sequence {i} {cached}+{new}")
        assert_close(lse[lo:hi], want_lse, dtype, f"lse vs dense, sequence {i}")
    assert d_blocks[num_pages].count_nonzero() == 0


def test_prefill_window_wider_than_tiles() -> None:
    """Windows spanning several KV tiles: masked window start, unmasked middle tiles, masked diagonal."""
    chunks, window = [(60, 9), (100, 20), (0, 50)], 40
    totals = [c + n for c, n in chunks]
    blocks = random_pool(sum(-(-t // 4) for t in totals) + 2, 1, 4, 2, 64, torch.float32, seed=21)
    data = place_sequences(blocks, 0, totals, seed=21)
    q = torch.randn(sum(n for _, n in chunks), 8, 64, generator=torch.Generator().manual_seed(22))
    query_start_loc = torch.tensor([0, *(n for _, n in chunks)]).cumsum(0)
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    cache_lengths = torch.tensor([c for c, _ in chunks])
    d_args = on_device(q, blocks, data.lookup_table, cache_lengths, query_start_loc)
    paged_prefill(d_args[0], d_args[1], 0, *d_args[2:], sliding_window=window, out=out, block_m=16, block_n=16)
    out = out.cpu()
    starts = query_start_loc.tolist()
    for i, (cached, new) in enumerate(chunks):
        lo, hi = starts[i], starts[i + 1]
        positions = torch.arange(cached, cached + new)
        want, _ = dense_attention(q[lo:hi], positions, data.keys[i], data.values[i], sliding_window=window)
        assert_close(out[lo:hi], want, torch.float32, f"sequence {i} {cached}+{new}")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 128])
def test_prefill_gpu_bf16_chunks(page_size: int) -> None:
    dev = torch.device("cuda")
    chunks = [(0, 1000), (page_size * 3, 517), (2047, 1), (0, 0), (4000, 300), (130, 2048)]
    totals = [c + n for c, n in chunks]
    num_pages = sum(-(-t // page_size) for t in totals) + 16
    blocks = random_pool(num_pages, 2, page_size, 8, 128, torch.bfloat16, seed=page_size)
    data = place_sequences(blocks, LAYER, totals, seed=page_size)
    blocks = blocks.to(dev)
    q_lens = [n for _, n in chunks]
    q = torch.randn(sum(q_lens), 32, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(dev)
    lut, cache_lengths = data.lookup_table.to(dev), torch.tensor([c for c, _ in chunks], device=dev)
    query_start_loc = torch.tensor([0, *q_lens]).cumsum(0).to(dev)
    for options in ({}, {"sliding_window": 512, "softcap": 30.0}):
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:2], float("nan"), device=dev)
        paged_prefill(q, blocks, LAYER, lut, cache_lengths, query_start_loc, return_lse=True, out=out, lse=lse,
                      **options)  # fmt: skip
        ref_out, ref_lse = paged_attention_ref(
            q, blocks, LAYER, lut, cache_lengths, query_start_loc, return_lse=True, **options
        )
        assert_close(out.cpu(), ref_out.cpu(), torch.bfloat16, f"out {options}")
        assert_close(lse.cpu(), ref_lse.cpu(), torch.bfloat16, f"lse {options}")
        lo, hi = q_lens[0], q_lens[0] + q_lens[1]  # sequence 1, against float64
        positions = torch.arange(chunks[1][0], totals[1])
        want, _ = dense_attention(q[lo:hi].cpu(), positions, data.keys[1], data.values[1], **options)
        assert_close(out[lo:hi].cpu(), want, torch.bfloat16, f"dense {options}")
