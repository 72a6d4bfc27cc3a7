"""Tensor parallel shards of kvpool's pages: which KV heads each rank holds, and two ranks' saves into their
parts of the same pages read back whole by one rank holding every head (and the reverse), exact."""

import pytest
import torch

pytest.importorskip("vllm")

from service.integrations.vllm_copy import KVCopier
from service.integrations.vllm_worker import Shard, head_shard
from tests.integrations.test_vllm_layout import cpu_writer


@pytest.mark.parametrize(
    ("heads", "tp", "expected"),
    [
        (2, 1, [(0, 2, True)]),
        (2, 2, [(0, 1, True), (1, 1, True)]),
        (8, 4, [(0, 2, True), (2, 2, True), (4, 2, True), (6, 2, True)]),
        # More ranks than KV heads: vLLM replicates each head on tp / H ranks; the first of them writes it.
        (1, 2, [(0, 1, True), (0, 1, False)]),
        (2, 4, [(0, 1, True), (0, 1, False), (1, 1, True), (1, 1, False)]),
    ],
)
def test_each_rank_holds_the_heads_vllm_gives_it(heads: int, tp: int, expected: list[tuple[int, int, bool]]) -> None:
    assert [head_shard(heads, tp, rank) for rank in range(tp)] == expected


def test_heads_that_do_not_split_are_refused() -> None:
    with pytest.raises(ValueError, match="3 KV heads do not split over 2 ranks"):
        head_shard(3, 2, 0)


def copier(cache: torch.Tensor, native: bool) -> KVCopier:
    """A one-layer copier of `cache` [blocks, H, 32, 2 * D] (vLLM's CPU layout), loading with vLLM's writer."""
    return KVCopier({0: cache}, {0: cpu_writer(cache)}, 32, native=native)


def test_two_ranks_save_their_heads_into_pages_one_rank_loads_whole_and_back() -> None:
    torch.manual_seed(0)
    heads, d, page, num_pages = 2, 32, 16, 12
    pool = torch.randn(num_pages + 1, 2, 1, page, heads, d)  # [P + 1, 2, L, page, H, D], random: poison
    pages = [7, 2, 9, 4, 11, 0]  # 96 tokens: 6 pages of 16, 3 blocks of 32
    ranks = [torch.randn(4, 1, 32, 2 * d) for _ in range(2)]  # each rank's cache: one KV head
    blocks = [1, 3, 2]
    for rank, cache in enumerate(ranks):
        shard = Shard(*head_shard(heads, 2, rank))
        copier(cache, native=False).save(shard.of(pool), blocks, pages, 0, 96)
    whole = torch.zeros(5, heads, 32, 2 * d)  # a TP=1 engine's cache: both heads
    copier(whole, native=True).load(pool, pages, [4, 0, 3], 0, 96)
    for rank, cache in enumerate(ranks):
        assert torch.equal(whole[[4, 0, 3], rank : rank + 1], cache[blocks])
    # The reverse: saved whole (the compiled copy), loaded per rank (its heads' part of the same pages).
    other = [5, 8, 1, 3, 10, 6]
    copier(whole, native=True).save(pool, [4, 0, 3], other, 0, 96)
    for rank, cache in enumerate(ranks):
        shard = Shard(*head_shard(heads, 2, rank))
        cache.zero_()
        copier(cache, native=False).load(shard.of(pool), other, [0, 2, 1], 0, 96)
        assert torch.equal(cache[[0, 2, 1]], whole[[4, 0, 3], rank : rank + 1])
