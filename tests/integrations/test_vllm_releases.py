"""What the connector's scheduler gives back to kvpool (vllm_releases), against a real `kvpool serve`: a
sequence released committing and a written save to commit wait, while the engine is busy, up to FREE_WAIT_S
for a call to ride on, then go in a call of their own; a sequence released uncommitted goes at once and its
pages never enter the prefix cache."""

import time
from collections import Counter

import pytest

pytest.importorskip("vllm")

from service.client import KVPoolClient
from service.integrations.vllm_releases import FREE_WAIT_S, Releases
from tests.integrations.test_vllm import model_dir, tokens
from tests.integrations.test_vllm_scheduler import PAGE, connected, exists, settle

__all__ = ["model_dir"]  # the tiny Llama fixture of test_vllm.py, shared


def cached(client: KVPoolClient, token_ids: list[int]) -> int:
    """Tokens of `token_ids` kvpool's prefix cache holds (a probe sequence, freed after)."""
    probe = client.create_sequence(token_ids=[*token_ids, 0])
    client.free(probe.seq_id)
    return probe.cached_tokens


def test_frees_and_commits_wait_for_a_call_while_the_engine_is_busy_and_discards_go_at_once(model_dir: str) -> None:
    with connected(model_dir) as (server, thread, link), KVPoolClient(server.url) as client:
        prompts = {name: tokens(seed, 2 * PAGE) for seed, name in enumerate("abc")}
        for name, prompt in prompts.items():  # appended without K/V: not committed until freed or named again
            client.create_sequence(name)
            client.append(name, token_ids=prompt)
        assert [cached(client, p) for p in prompts.values()] == [0, 0, 0]
        waits: Counter[str] = Counter()
        releases = Releases(link, thread, waits)

        releases.release("a")  # committing: waits for a call to ride on
        releases.flush(busy=True)
        settle(thread, link)
        assert exists(server, "a") and releases.to_free == ["a"]
        time.sleep(FREE_WAIT_S)
        releases.flush(busy=True)  # waited long enough: a call of its own
        settle(thread, link)
        assert not exists(server, "a") and cached(client, prompts["a"]) == 2 * PAGE
        assert releases.to_free == [] and link.stats["free_calls"] == 1

        releases.commit("b")  # a written save: waits as a free does, its sequence still held
        releases.flush(busy=True)
        settle(thread, link)
        assert cached(client, prompts["b"]) == 0 and releases.to_commit == {"b"}
        time.sleep(FREE_WAIT_S)
        releases.flush(busy=True)
        settle(thread, link)
        assert exists(server, "b") and cached(client, prompts["b"]) == 2 * PAGE and link.stats["commits"] == 1
        assert releases.to_commit == set() and link.stats["free_calls"] == 2

        releases.release("c", commit=False)  # uncommitted: at once, its pages released
        settle(thread, link)
        assert not exists(server, "c") and cached(client, prompts["c"]) == 0

        releases.release("b")
        releases.flush(busy=False)  # an idle engine sends its frees at once
        settle(thread, link)
        assert not exists(server, "b") and waits == Counter()


def test_taken_releases_kept_again_go_first_and_a_pin_being_loaded_is_released_after_its_loads(model_dir: str) -> None:
    with connected(model_dir) as (server, thread, link), KVPoolClient(server.url) as client:
        for name in "pqr":
            client.create_sequence(name)
        releases = Releases(link, thread, Counter())
        releases.release("p")
        releases.commit("q")
        commit, frees = releases.take()
        assert (commit, frees) == (["q"], ["p"]) and not (releases.to_commit or releases.to_free)
        releases.release("r")
        releases.keep(commit, frees)  # (a call that was not made)
        assert releases.to_free == ["p", "r"] and releases.to_commit == {"q"}

        releases.loading("q", 2)  # two ranks will report their loads from pin q
        releases.release("q")
        assert releases.to_commit == {"q"} and releases.to_free == ["p", "r"]  # deferred: nothing changed
        releases.loaded("q", 1)
        assert releases.to_free == ["p", "r"]
        releases.loaded("q", 1)  # the last rank's report: released now
        assert releases.to_free == ["p", "r", "q"] and releases.to_commit == set()
        releases.flush(busy=True, now=True)
        settle(thread, link)
        assert not any(exists(server, name) for name in "pqr")
