"""How the connector's saves reach kvpool: a step's saves in one call, a request's later saves appended to the
sequence of its earlier ones, the pages decoding fills saved with a call made anyway or in the request's
last step, frees riding on the step calls, and a refused batch split so that one request's refusal leaves the
others saved.

A real vLLM engine (benchmarks/vllm_engine, vLLM's own prefix cache off) against a real `kvpool serve`;
kvpool's calls are counted from its /metrics (kvpool_request_duration_seconds_count by route and method).
"""

import re
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.integrations.test_vllm import Engine, KVPool, alone_tokens, model_dir, tokens

__all__ = ["model_dir"]  # the tiny Llama fixture of test_vllm.py, shared
LABEL = re.compile(r'(\w+)="([^"]*)"')
PAGE = 16


def calls(server: KVPool) -> Counter[str]:
    """kvpool's answered requests so far, by method and route."""
    counts: Counter[str] = Counter()
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith("kvpool_request_duration_seconds_count{"):
            labels = dict(LABEL.findall(line))
            counts[f"{labels['method']} {labels['route']}"] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def test_no_step_waits_for_a_save_and_decoded_pages_are_appended_when_the_request_finishes(
    model_dir: str, tmp_path: Path
) -> None:
    server = KVPool(model_dir, PAGE)
    prompts = [tokens(10 + i, n) for i, n in enumerate((100, 90, 70, 50))]
    try:
        engine = Engine(model_dir, server.url, tmp_path / "engine.log", max_tokens=40)
        try:
            before = calls(server)
            first = engine.generate(*prompts)  # prefilled together: their first saves share one step
            grown = calls(server) - before
            stats = engine.stats
            pool = server.pool()
            # Each prompt with 32 of its generated tokens: every full page of it was saved, the generated ones by
            # the request's last save.
            longer = [p + out["token_ids"][:32] for p, out in zip(prompts, first, strict=True)]
            again = engine.generate(*longer)
        finally:
            engine.close()
    finally:
        server.stop()
    assert not any(k.startswith("faults") for k in stats), stats
    # One create per request (its lookup), which also appends its prompt's full pages (a reservation); its later
    # saves append to that sequence; its free, when it finishes, rides on the connector's next step call (a
    # finished request's reservation, or one of frees and commits alone, neither waited for): no DELETE. Saves:
    # the prompts' pages in the prefill's step (into the reserved pages), then each request's pages its decoding
    # filled (100+40 -> pages at 112, 128; 90 -> 96, 112, 128; 70 -> 80, 96; 50 -> 64, 80), none while it
    # decodes (no other call to ride on), all appended when it finishes (a reservation each: a step call, not
    # waited for) and saved by the step after: no step waits for a call to save.
    assert grown["POST /v1/sequences"] == 4 and grown["DELETE /v1/sequences/{seq_id}"] == 0, grown
    assert stats["frees"] == 4 and stats.get("free_calls", 0) <= 4, stats
    assert stats["saves"] == 4 + 4 and stats["reservations"] == 8 and stats["saves_after_finish"] == 4, stats
    assert "append_batches" not in stats and "append_ns" not in stats and "reservations_refused" not in stats
    assert grown["POST /v1/step"] == 4 + stats.get("free_calls", 0), grown  # the finished requests' reservations
    assert grown["POST /v1/sequences/{seq_id}/append"] == 0, grown
    assert stats["saved_tokens"] == sum((len(p) + 39) // PAGE * PAGE for p in prompts)  # (the last token: no KV)
    assert (pool["pages_used"], pool["num_sequences"]) == (0, 0)  # every pin and save sequence released
    # The same engine (its own prefix cache off) loads them back from kvpool: every token but the last.
    assert [out["num_cached_tokens"] for out in again] == [len(p) // PAGE * PAGE for p in longer]
    assert [out["token_ids"][:8] for out in again] == [out["token_ids"][32:40] for out in first]


@pytest.mark.parametrize("reserve", [False, True], ids=["saved-in-the-step", "reserved-at-lookup"])
def test_a_refused_save_leaves_nothing_of_the_refused_request_and_the_others_saved(
    model_dir: str, tmp_path: Path, reserve: bool
) -> None:
    """24 pages: the long prompt's 25 are refused whatever else is held; the short ones' 3 + 4 fit. Without
    reservations the three saves go in one step call, which kvpool refuses whole and the connector splits; with
    them the long one's reservation is refused (not a fault), its save in the prefill step then too (a call of its
    own, a fault), and the short ones' go into their reserved pages, no call."""
    server = KVPool(model_dir, PAGE, KVPOOL_NUM_PAGES="24")
    long, short, other = tokens(20, 400), tokens(21, 60), tokens(22, 70)
    try:
        options = {"connector": {"reserve_pages": reserve}}
        engine = Engine(model_dir, server.url, tmp_path / "engine.log", max_tokens=2, **options)
        try:
            before = calls(server)
            first = engine.generate(long, short, other)  # one step prefills all three
            grown = calls(server) - before
            stats = engine.stats
            pool = server.pool()
            time.sleep(1.0)  # the out-of-pages incident's retry interval (0.5 s) passes
            again = engine.generate(long, short, other)
        finally:
            engine.close()
        after = server.pool()
    finally:
        server.stop()
    if reserve:
        assert (stats["reservations"], stats["reservations_refused"]) == (3, 1), stats
        assert stats["faults_out_of_pages"] == 1 and stats.get("append_batches", 0) == 0, stats
        assert grown["POST /v1/sequences/{seq_id}/append"] == 1, grown  # the long one's save, after its refusal
        assert grown["POST /v1/step"] == stats.get("free_calls", 0), grown  # (the three reservations: in the creates)
    else:
        assert stats["append_batches_split"] == 1 and stats["faults_out_of_pages"] >= 1, stats
    assert stats["saved_tokens"] == 48 + 64  # the short ones' full pages, none of the long one's
    assert (pool["pages_used"], pool["num_sequences"]) == (0, 0)
    assert [out["num_cached_tokens"] for out in again] == [0, 48, 64]
    assert [out["token_ids"] for out in again] == [out["token_ids"] for out in first]
    assert (after["pages_used"], after["num_sequences"]) == (0, 0)


def test_a_request_that_stops_before_its_max_tokens_has_its_last_pages_saved_after_it_finishes(
    model_dir: str, tmp_path: Path
) -> None:
    prompt = tokens(30, 78)  # 4 full pages, and 14 tokens of a fifth
    full = alone_tokens(model_dir, {"p": prompt}, tmp_path / "alone.log", max_tokens=40)["p"]
    # The last generated token not seen before it, as the stop token: the request stops there, short of its
    # max_tokens (the tiny random model soon repeats itself), so that the connector cannot tell its last step.
    k = max(k for k, t in enumerate(full) if t not in full[:k])
    stop = full[k]
    assert len(prompt) + k >= 5 * PAGE and k + 1 < 40, full  # (its decoding fills the fifth page)
    server = KVPool(model_dir, PAGE)
    try:
        engine = Engine(model_dir, server.url, tmp_path / "engine.log", max_tokens=40, stop_token_ids=[stop])
        try:
            out = engine.generate(prompt)[0]["token_ids"]
            stats = engine.stats
            computed = len(prompt) + len(out) - 1  # (the stop token: sampled, its KV never computed)
            again = engine.generate(prompt + out[:-1])[0]  # everything before the stop token: from kvpool
        finally:
            engine.close()
        pool = server.pool()
    finally:
        server.stop()
    assert out == full[: len(out)] and out[-1] == stop and len(out) < 40
    # Two saves: the prompt's 4 pages in its prefill step; the pages its decoding filled in the step after it
    # finished, vLLM keeping its blocks until they were written.
    assert (stats["saves"], stats["saved_tokens"]) == (2, computed // PAGE * PAGE), stats
    assert stats["saves_after_finish"] == 1
    assert again["num_cached_tokens"] == computed // PAGE * PAGE and again["token_ids"][0] == stop
    assert (pool["pages_used"], pool["num_sequences"]) == (0, 0)
