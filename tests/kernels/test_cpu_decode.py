"""The CPU backend's compiled decode (kernels/_cpu_decode.c via kernels/cpu_decode.py) against the torch
reference and float64 dense attention.

Every page the kernel must not read (the null page, the unwritten tail of a last page, unused pages)
holds NaN, and the output array starts as NaN, so a stray read or an unwritten element shows.
"""

from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from kernels import cpu_decode
from kernels.batched_reference import paged_attention_batched
from kernels.cpu_decode import compiled_decode_applies, paged_attention_cpu, paged_decode_compiled
from kernels.reference import paged_attention_ref
from tests.kernels.paged_data import PagedSequences, assert_close, dense_attention, place_sequences

NUM_KV_HEADS = 2
LAYER = 1

# (GQA group, page size, head_dim, sliding_window, softcap, scale); the dot takes 16 channels at a
# time: head_dim 8 is all scalar tail, 20 one block and a tail
CASES = [
    (2, 4, 8, None, None, None),
    (1, 4, 16, None, None, None),
    (2, 16, 64, None, None, None),
    (4, 4, 32, 5, None, 0.3),
    (2, 8, 20, None, 2.5, None),
    (4, 1, 16, 3, 4.0, None),
    (3, 16, 128, 40, None, 0.05),
]


def test_the_compiled_module_is_built() -> None:
    assert cpu_decode.native is not None, "kernels/_cpu_decode.c is not built: run `pip install -e .`"


def nan_pool(num_pages: int, page_size: int, head_dim: int) -> torch.Tensor:
    return torch.full((num_pages + 1, 2, 2, page_size, NUM_KV_HEADS, head_dim), float("nan"))


def decode_inputs(
    group: int, page_size: int, head_dim: int, seed: int
) -> tuple[list[int], torch.Tensor, PagedSequences, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Ragged: a first token (position 0), page boundaries either side, and a longer random length.
    lengths = [1, page_size, page_size + 1, 2 * page_size + 3, int(torch.randint(30, 90, (1,), generator=gen))]
    blocks = nan_pool(96, page_size, head_dim)
    seqs = place_sequences(blocks, LAYER, lengths, seed=seed + 1)
    q = torch.randn(len(lengths), group * NUM_KV_HEADS, head_dim, generator=gen)
    cache_lengths = torch.tensor([n - 1 for n in lengths])  # each query is the last token of its sequence
    return lengths, blocks, seqs, q, cache_lengths


@pytest.mark.parametrize(("group", "page_size", "head_dim", "window", "softcap", "scale"), CASES)
@pytest.mark.parametrize("lut_dtype", [torch.int64, torch.uint32])
def test_compiled_decode_matches_reference_and_dense(
    group: int,
    page_size: int,
    head_dim: int,
    window: int | None,
    softcap: float | None,
    scale: float | None,
    lut_dtype: torch.dtype,
) -> None:
    lengths, blocks, seqs, q, cache_lengths = decode_inputs(group, page_size, head_dim, seed=page_size + head_dim)
    lut = seqs.lookup_table.to(lut_dtype)
    options = {"sliding_window": window, "softcap": softcap, "scale": scale}
    query_start_loc = torch.arange(len(lengths) + 1)
    assert compiled_decode_applies(q, blocks, query_start_loc)

    got = paged_decode_compiled(q, blocks, LAYER, lut, cache_lengths, **options)
    want = paged_attention_ref(q, blocks, LAYER, lut.to(torch.int64), cache_lengths, query_start_loc, **options)
    assert isinstance(want, torch.Tensor) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    for i, n in enumerate(lengths):
        keys, values = seqs.keys[i], seqs.values[i]
        dense, _ = dense_attention(q[i : i + 1], torch.tensor([n - 1]), keys, values, **options)
        assert_close(got[i : i + 1], dense, torch.float32, f"sequence {i} (length {n})")


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_query_is_computed_in_float32_and_answered_in_its_dtype(q_dtype: torch.dtype) -> None:
    lengths, blocks, seqs, q, cache_lengths = decode_inputs(2, 4, 16, seed=11)
    lut = seqs.lookup_table.to(torch.int64)
    q16 = q.to(q_dtype)
    got = paged_decode_compiled(q16, blocks, LAYER, lut, cache_lengths)
    assert got.dtype == q_dtype
    in_float32 = paged_decode_compiled(q16.float(), blocks, LAYER, lut, cache_lengths)
    torch.testing.assert_close(got, in_float32.to(q_dtype), atol=0, rtol=0)  # the float32 answer, rounded once
    want = paged_attention_ref(q16.float(), blocks, LAYER, lut, cache_lengths, torch.arange(len(lengths) + 1))
    assert isinstance(want, torch.Tensor)
    torch.testing.assert_close(in_float32, want, atol=2e-5, rtol=2e-5)


def test_a_window_longer_than_any_position_is_no_window() -> None:
    """The schema bounds sliding_window below only: 2**63 must answer as the torch path does."""
    lengths, blocks, seqs, q, cache_lengths = decode_inputs(2, 4, 16, seed=12)
    lut = seqs.lookup_table.to(torch.int64)
    query_start_loc = torch.arange(len(lengths) + 1)
    for window in (2**63, 10**30):
        got = paged_attention_cpu(q, blocks, LAYER, lut, cache_lengths, query_start_loc, sliding_window=window)
        want = paged_attention_ref(q, blocks, LAYER, lut, cache_lengths, query_start_loc)
        assert isinstance(want, torch.Tensor)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_scratch_is_sized_by_the_window_and_never_overflows() -> None:
    """A query at position 2**42 - 1 with 2**20 query heads (lut and pool of 2**21 entries): with window
    1 it sees one key (a scratch row of 1 per head); without a window the scratch would need
    2**62 floats, and the call raises MemoryError instead of a size that wraps around."""
    native = cpu_decode.native
    assert native is not None
    q = torch.randn(1, 2**20, 1).numpy()
    blocks = torch.zeros(1, 2, 1, 2**21, 1, 1)
    blocks[0, :, 0, 2**21 - 1] = torch.tensor([[[0.5]], [[3.0]]])  # K, V of the one key seen
    lut = torch.zeros(1, 2**21, dtype=torch.int64).numpy()
    positions = torch.tensor([2**42 - 1]).numpy()
    out = torch.full((1, 2**20, 1), float("nan")).numpy()
    native.decode(q, blocks.numpy(), 0, lut, positions, 1.0, 1, 0.0, out)
    assert (out == 3.0).all()  # one visible key: its value, exactly
    out[:] = float("nan")
    with pytest.raises(MemoryError):
        native.decode(q, blocks.numpy(), 0, lut, positions, 1.0, 0, 0.0, out)
    assert torch.from_numpy(out).isnan().all()


def test_one_position_is_its_value_exactly() -> None:
    """With one visible position the softmax is exactly 1: the output is v itself, bit for bit."""
    blocks = nan_pool(8, 4, 16)
    seqs = place_sequences(blocks, LAYER, [1, 1, 6], seed=3)
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(4))
    lut = seqs.lookup_table.to(torch.int64)
    out = paged_decode_compiled(q, blocks, LAYER, lut, torch.tensor([0, 0, 5]), sliding_window=1)
    for i in range(3):
        want = seqs.values[i][-1].float().repeat_interleave(2, dim=0)  # [Hq, D]: both heads of a group
        torch.testing.assert_close(out[i], want, atol=0, rtol=0)


def test_what_it_does_not_cover_takes_the_torch_reference() -> None:
    """Prefill, 16-bit pools, non-contiguous pools and a softcap <= 0: the torch path's answer, bit for bit
    (the compiled decode sums in another order: its float32 answer differs in the last bits)."""
    blocks = nan_pool(16, 4, 16)
    seqs = place_sequences(blocks, LAYER, [6, 9], seed=5)
    lut = seqs.lookup_table.to(torch.int64)
    q = torch.randn(5, 4, 16, generator=torch.Generator().manual_seed(6))
    prefill = (q, blocks, lut, torch.tensor([4, 6]), torch.tensor([0, 2, 5]))  # 2 and 3 queries
    decode = (q[:2], blocks, lut, torch.tensor([5, 8]), torch.arange(3))
    for what, (qq, bb, tt, cl, qsl), options in [
        ("prefill", prefill, {"softcap": 2.0}),
        ("bf16 pool", (decode[0], blocks.to(torch.bfloat16), *decode[2:]), {}),
        ("strided pool", (decode[0], blocks.transpose(3, 4).contiguous().transpose(3, 4), *decode[2:]), {}),
        ("softcap <= 0", decode, {"softcap": -1.0}),
    ]:
        if what != "softcap <= 0":
            assert not compiled_decode_applies(qq, bb, qsl), what
        got = paged_attention_cpu(qq, bb, LAYER, tt, cl, qsl, **options)
        want = paged_attention_batched(qq, bb, LAYER, tt, cl, qsl, **options)
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True, msg=lambda m, w=what: f"{w}: {m}")


def native_args(**change: object) -> list[object]:
    """Valid arguments of native.decode (2 queries, a 4-page pool), with some replaced."""
    blocks = torch.randn(5, 2, 2, 4, NUM_KV_HEADS, 8, generator=torch.Generator().manual_seed(9))
    args: dict[str, object] = {
        "q": torch.randn(2, 4, 8).numpy(),
        "blocks": blocks.numpy(),
        "layer": 1,
        "lut": torch.tensor([[0, 1, 4, 4], [2, 4, 4, 4]]).numpy(),
        "positions": torch.tensor([5, 3]).numpy(),
        "scale": 0.5,
        "window": 0,
        "softcap": 0.0,
        "out": torch.full((2, 4, 8), float("nan")).numpy(),
    }
    args.update(change)
    return list(args.values())


def test_the_native_call_writes_every_output_element() -> None:
    args = native_args()
    assert cpu_decode.native is not None
    cpu_decode.native.decode(*args)
    assert not torch.from_numpy(args[-1]).isnan().any()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"lut": torch.tensor([[0, 5, 4, 4], [2, 4, 4, 4]]).numpy()}, IndexError, "page 5 of query 0"),
        ({"lut": torch.tensor([[0, -1, 4, 4], [2, 4, 4, 4]]).numpy()}, IndexError, "out of range"),
        ({"positions": torch.tensor([16, 3]).numpy()}, ValueError, "outside its lookup table row"),
        ({"positions": torch.tensor([5, -1]).numpy()}, ValueError, "outside its lookup table row"),
        ({"layer": 2}, ValueError, "layer"),
        ({"window": -1}, ValueError, "window"),
        ({"q": torch.randn(2, 4, 8, dtype=torch.float64).numpy()}, ValueError, "q: not a C-contiguous 3-D"),
        ({"q": torch.randn(2, 3, 8).numpy()}, ValueError, "disagree in shape"),  # 3 heads over 2 KV heads
        ({"q": torch.randn(2, 0, 8).numpy(), "out": torch.randn(2, 0, 8).numpy()}, ValueError, "disagree"),  # no head
        ({"q": torch.randn(2, 8, 4).numpy().transpose(0, 2, 1)}, ValueError, "not C-contiguous"),
        ({"lut": torch.tensor([[0, 1, 4, 4]]).numpy()}, ValueError, "disagree in shape"),
        ({"lut": torch.tensor([[0, 1], [2, 4]], dtype=torch.int32).numpy()}, ValueError, "int64 or uint32"),
        ({"lut": torch.tensor([[0, 1, 4, 4, 4, 4], [2, 4, 4, 4, 4, 4]]).numpy()[:, ::2]}, ValueError, "C-contiguous"),
        ({"positions": torch.tensor([2**63 - 1, 3]).numpy()}, ValueError, "outside its lookup table row"),
        (
            {
                "q": torch.randn(2, 4, 0).numpy(),
                "blocks": torch.randn(5, 2, 2, 4, 2, 0).numpy(),
                "out": torch.randn(2, 4, 0).numpy(),
            },
            ValueError,
            "head_dim out of range",
        ),
        ({"positions": torch.tensor([5, 3], dtype=torch.int32).numpy()}, ValueError, "positions"),
        ({"blocks": torch.randn(5, 3, 2, 4, 2, 8).numpy()}, ValueError, "disagree in shape"),
    ],
)
def test_bad_input_raises_and_writes_nothing(change: dict[str, object], error: type, match: str) -> None:
    args = native_args(**change)
    assert cpu_decode.native is not None
    with pytest.raises(error, match=match):
        cpu_decode.native.decode(*args)
    assert torch.from_numpy(args[-1]).isnan().all()  # type: ignore[arg-type]


@st.composite
def decode_calls(draw: st.DrawFn) -> dict[str, Any]:
    """A small decode call on random data: GQA, pages, windows, softcap and table types, sometimes with a
    page id past the pool or a position past the table."""
    num_kv_heads, page_size, cols = (
        draw(st.integers(1, 3)),
        draw(st.sampled_from([1, 2, 4, 16])),
        draw(st.integers(1, 6)),
    )
    batch, num_pages, head_dim = (
        draw(st.integers(0, 3)),
        draw(st.integers(1, 8)),
        draw(st.sampled_from([1, 3, 16, 17, 33])),
    )
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    bad_page, bad_position = draw(st.booleans()) and draw(st.booleans()), draw(st.booleans()) and draw(st.booleans())
    positions = torch.randint(0, cols * page_size + bad_position, (batch,), generator=gen)
    return {
        "q": torch.randn(batch, num_kv_heads * draw(st.integers(1, 3)), head_dim, generator=gen),
        "blocks": torch.randn(num_pages + 1, 2, 2, page_size, num_kv_heads, head_dim, generator=gen),
        "layer": draw(st.integers(0, 1)),
        "lut": torch.randint(0, num_pages + 1 + bad_page, (batch, cols), generator=gen).to(
            draw(st.sampled_from([torch.int64, torch.uint32]))
        ),
        "positions": positions,
        "scale": draw(st.sampled_from([None, 0.3])),
        "sliding_window": draw(st.sampled_from([None, 1, 2, 5])),
        "softcap": draw(st.sampled_from([None, 1.5])),
    }


@settings(max_examples=150, deadline=None)
@given(decode_calls())
def test_random_calls_match_the_reference_or_raise_and_write_nothing(c: dict[str, Any]) -> None:
    native = cpu_decode.native
    assert native is not None
    out = torch.full_like(c["q"], float("nan"))
    options = {k: c[k] for k in ("scale", "sliding_window", "softcap")}
    scale = c["scale"] if c["scale"] is not None else c["q"].shape[-1] ** -0.5
    args = (c["q"].numpy(), c["blocks"].numpy(), c["layer"], c["lut"].numpy(), c["positions"].numpy(), scale)
    try:
        native.decode(*args, c["sliding_window"] or 0, c["softcap"] or 0.0, out.numpy())
    except (ValueError, IndexError):
        assert out.isnan().all()  # nothing written
        page_past = c["lut"].to(torch.int64).max().item() >= c["blocks"].shape[0] if c["lut"].numel() else False
        position_past = bool((c["positions"] >= c["lut"].shape[1] * c["blocks"].shape[3]).any())
        assert page_past or position_past  # only bad input is refused
        return
    lut = c["lut"].to(torch.int64)
    want = paged_attention_ref(
        c["q"], c["blocks"], c["layer"], lut, c["positions"], torch.arange(len(lut) + 1), **options
    )
    assert isinstance(want, torch.Tensor)
    torch.testing.assert_close(out, want, atol=3e-5, rtol=3e-5)
