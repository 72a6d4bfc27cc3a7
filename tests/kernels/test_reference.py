"""The torch reference splits each sequence's queries into blocks of bounded scores: the split must not
change the answer. Small score budgets force blocks of one or a few queries (edges inside pages, windows
that start inside a block), compared with float64 dense attention over the sequences' own K/V."""

import pytest
import torch

from kernels import reference
from kernels.reference import paged_attention_ref
from tests.kernels.paged_data import assert_close, dense_attention, place_sequences

NUM_KV_HEADS = 2
LAYER = 1


@pytest.mark.parametrize("score_budget", [1, 7 * 4 * 29, 1 << 22])
@pytest.mark.parametrize(
    ("group", "window", "softcap", "scale"),
    [(1, None, None, None), (4, 5, None, 0.3), (2, None, 2.5, None), (4, 3, 4.0, None)],
)
def test_blocked_prefill_matches_dense(
    monkeypatch: pytest.MonkeyPatch,
    score_budget: int,
    group: int,
    window: int | None,
    softcap: float | None,
    scale: float | None,
) -> None:
    monkeypatch.setattr(reference, "SCORE_BLOCK_ELEMENTS", score_budget)
    gen = torch.Generator().manual_seed(group * 10 + (window or 0))
    page_size, head_dim = 4, 16
    lengths = [29, 1, 13, 8]  # total tokens of each sequence
    q_lens = [29, 1, 6, 3]  # its last q_len positions are this step's queries (a chunked prefill for 13 and 8)
    blocks = torch.full((64 + 1, 2, 2, page_size, NUM_KV_HEADS, head_dim), float("nan"))
    seqs = place_sequences(blocks, LAYER, lengths, seed=5)
    q = torch.randn(sum(q_lens), group * NUM_KV_HEADS, head_dim, generator=gen)
    cache_lengths = torch.tensor([n - m for n, m in zip(lengths, q_lens, strict=True)])
    query_start_loc = torch.tensor([0, *q_lens]).cumsum(0)
    options = {"scale": scale, "sliding_window": window, "softcap": softcap}

    out, lse = paged_attention_ref(
        q, blocks, LAYER, seqs.lookup_table, cache_lengths, query_start_loc, return_lse=True, **options
    )
    for i, (n, m) in enumerate(zip(lengths, q_lens, strict=True)):
        lo, hi = int(query_start_loc[i]), int(query_start_loc[i + 1])
        positions = torch.arange(n - m, n)
        want_out, want_lse = dense_attention(q[lo:hi], positions, seqs.keys[i], seqs.values[i], **options)
        assert_close(out[lo:hi], want_out, torch.float32, f"sequence {i} out")
        assert_close(lse[lo:hi], want_lse, torch.float32, f"sequence {i} lse")


def test_bf16_queries_come_back_in_their_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reference, "SCORE_BLOCK_ELEMENTS", 64)
    blocks = torch.zeros(16 + 1, 2, 2, 4, NUM_KV_HEADS, 16, dtype=torch.bfloat16)
    seqs = place_sequences(blocks, LAYER, [11], seed=3)
    q = torch.randn(11, 4, 16, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out = paged_attention_ref(q, blocks, LAYER, seqs.lookup_table, torch.tensor([0]), torch.tensor([0, 11]))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    want, _ = dense_attention(q, torch.arange(11), seqs.keys[0], seqs.values[0])
    assert_close(out, want, torch.bfloat16, "bf16")
