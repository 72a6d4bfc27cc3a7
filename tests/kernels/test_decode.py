"""paged_decode against its torch reference and a float64 dense attention (TRITON_INTERPRET on the CPU)."""

import pytest
import torch

from kernels.decode import paged_decode, pick_num_splits
from kernels.reference import paged_decode_ref
from tests.kernels.paged_data import DEVICE, assert_close, dense_attention, on_device, place_sequences, random_pool

NUM_KV_HEADS = 2
LAYER = 1

# (GQA group, page size, head_dim, dtype, num_splits, block_n, sliding_window, softcap): a covering
# selection rather than the cross product, which the interpreter would take minutes over.
CASES = [
    (1, 1, 64, torch.float32, 1, 16, None, None),
    (4, 4, 64, torch.float32, 4, 16, None, None),
    (8, 16, 128, torch.float32, 2, 16, None, None),
    (4, 4, 128, torch.float32, 1, 16, 5, None),
    (4, 16, 64, torch.float32, 8, 16, 20, 5.0),
    (8, 1, 64, torch.float32, 4, 16, None, 3.0),
    (4, 16, 128, torch.bfloat16, 4, 16, None, None),
    (1, 4, 64, torch.float16, 2, None, 3, 4.0),
    (4, 256, 64, torch.float32, 2, 64, None, 2.0),  # the largest page size
]


def cache_lengths_for(page_size: int, seed: int) -> list[int]:
    """Ragged: 0, page multiples for the context and for the context + the new token, and a random one."""
    gen = torch.Generator().manual_seed(seed)
    return [0, page_size - 1, page_size, 2 * page_size + 3, int(torch.randint(1, 40, (1,), generator=gen))]


@pytest.mark.parametrize(("group", "page_size", "head_dim", "dtype", "splits", "block_n", "window", "softcap"), CASES)
def test_decode_matches_reference_and_dense(
    group: int,
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
    splits: int,
    block_n: int | None,
    window: int | None,
    softcap: float | None,
) -> None:
    seed = page_size * 1000 + head_dim + group
    lengths = cache_lengths_for(page_size, seed)
    num_pages = sum(-(-(n + 1) // page_size) for n in lengths) + 3
    blocks = random_pool(num_pages, 2, page_size, NUM_KV_HEADS, head_dim, dtype, seed)
    data = place_sequences(blocks, LAYER, [n + 1 for n in lengths], seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lengths), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    cache_lengths = torch.tensor(lengths, dtype=torch.int32)
    options = {"sliding_window": window, "softcap": softcap}
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    lse = torch.full(q.shape[:2], float("nan"), device=DEVICE)
    d_q, d_blocks, d_lut, d_lengths = on_device(q, blocks, data.lookup_table, cache_lengths)

    paged_decode(
        d_q, d_blocks, LAYER, d_lut, d_lengths,
        return_lse=True, out=out, lse=lse, num_splits=splits, block_n=block_n, **options,
    )  # fmt: skip

    out, lse = out.cpu(), lse.cpu()

    ref_out, ref_lse = paged_decode_ref(q, blocks, LAYER, data.lookup_table, cache_lengths, return_lse=True, **options)
    assert_close(out, ref_out, dtype, "out vs reference")
    assert_close(lse, ref_lse, dtype, "lse vs reference")
    for i, n in enumerate(lengths):
        want_out, want_lse = dense_attention(q[i : i + 1], torch.tensor([n]), data.keys[i], data.values[i], **options)
        assert_close(out[i : i + 1], want_out, dtype, f"out vs dense, sequence {i} (cache length {n})")
        assert_close(lse[i : i + 1], want_lse, dtype, f"lse vs dense, sequence {i}")
    assert d_blocks[num_pages].count_nonzero() == 0


def test_decode_without_lse_and_explicit_scale() -> None:
    blocks = random_pool(12, 1, 4, 2, 64, torch.float32, seed=7)
    lengths = [9, 0, 15]
    data = place_sequences(blocks, 0, [n + 1 for n in lengths], seed=7)
    q = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(8))
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    d_q, d_blocks, d_lut, d_lengths = on_device(q, blocks, data.lookup_table, torch.tensor(lengths))
    result = paged_decode(d_q, d_blocks, 0, d_lut, d_lengths, scale=0.3, out=out, num_splits=2)
    assert result is out
    out = out.cpu()
    for i, n in enumerate(lengths):
        want, _ = dense_attention(q[i : i + 1], torch.tensor([n]), data.keys[i], data.values[i], scale=0.3)
        assert_close(out[i : i + 1], want, torch.float32, f"sequence {i}")


def test_split_choice_depends_on_shapes_only() -> None:
    cpu = torch.device("cpu")
    assert pick_num_splits(1, 8, cpu) == 1  # the interpreter gains nothing from splitting


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 128])
def test_decode_gpu_bf16_long_contexts(page_size: int) -> None:
    dev = torch.device("cuda")
    lengths = [0, 1, page_size - 1, page_size, 511, 4095, 3000, 17, 8191, 1024]
    num_pages = sum(-(-(n + 1) // page_size) for n in lengths) + 16
    blocks = random_pool(num_pages, 2, page_size, 8, 128, torch.bfloat16, seed=page_size)
    data = place_sequences(blocks, LAYER, [n + 1 for n in lengths], seed=page_size)
    blocks = blocks.to(dev)
    q = torch.randn(len(lengths), 32, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(dev)
    lut, cache_lengths = data.lookup_table.to(dev), torch.tensor(lengths, device=dev)
    for splits in (None, 1, 16):
        for options in ({}, {"sliding_window": 700, "softcap": 30.0}):
            out = torch.full_like(q, float("nan"))
            lse = torch.full(q.shape[:2], float("nan"), device=dev)
            paged_decode(q, blocks, LAYER, lut, cache_lengths, return_lse=True, out=out, lse=lse, num_splits=splits,
                         **options)  # fmt: skip
            ref_out, ref_lse = paged_decode_ref(q, blocks, LAYER, lut, cache_lengths, return_lse=True, **options)
            assert_close(out.cpu(), ref_out.cpu(), torch.bfloat16, f"splits={splits} {options}")
            assert_close(lse.cpu(), ref_lse.cpu(), torch.bfloat16, f"lse splits={splits} {options}")
            i = 5  # the 4095-token context, against float64
            want, _ = dense_attention(q[i : i + 1].cpu(), torch.tensor([lengths[i]]), data.keys[i], data.values[i],
                                      **options)  # fmt: skip
            assert_close(out[i : i + 1].cpu(), want, torch.bfloat16, "dense")
