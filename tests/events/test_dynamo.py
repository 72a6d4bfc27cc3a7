"""A real router: NVIDIA Dynamo's standalone KV indexer subscribed to two real `kvpool serve`s, with
the events' defaults (vLLM's integer hashes), scores every prompt as `POST /v1/prefix/match` does:
shared prefixes, a running sequence, evictions (one pool spilling into its host tier), a reset, and
a late subscriber that recovers through replay what was published before it came.

The indexer's scores per node, in tokens: `longest_matched` over every medium, `gpu` on the pool's
own pages. kvpool's: `cached_tokens` (device and tier) and `device_pages`. Queries have a partial
last page, so that kvpool's rule (a hit never covers the last prompt token) costs nothing.
Everything runs in a network namespace of the test's own (tests/events/dynamo_indexer.py).
"""

import random
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SMALL_POOL, Server
from tests.events.conftest import events_env, put_prompt
from tests.events.dynamo_indexer import Indexer, available, in_private_network

pytestmark = pytest.mark.skipif(bool(available()), reason=available() or "-")
PAGE, MODEL = 4, "kvpool-test"
PAGE_BYTES = 2048  # SMALL_POOL: 2 layers x K,V x 4 tokens x 2 heads x 16 channels x 4 bytes


def kvpool_scores(server: Server, prompt: list[int]) -> tuple[int, int]:
    match = server.client.post("/v1/prefix/match", json={"token_ids": prompt}).json()
    return match["cached_tokens"], match["device_pages"] * PAGE


def dynamo_scores(indexer: Indexer, prompt: list[int], instance: int) -> tuple[int, int]:
    entry = indexer.query(prompt, MODEL).get(str(instance), {})
    return entry.get("longest_matched", 0), entry.get("gpu", 0)


def agree(indexer: Indexer, nodes: dict[int, Server], prompts: list[list[int]], timeout: float = 15.0) -> None:
    """Wait until the indexer scores every prompt on every node as the node does (events travel)."""
    deadline = time.monotonic() + timeout
    while True:
        want = {(i, n): kvpool_scores(nodes[i], p) for i in nodes for n, p in enumerate(prompts)}
        got = {(i, n): dynamo_scores(indexer, p, i) for i in nodes for n, p in enumerate(prompts)}
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == want, {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert any(score != (0, 0) for score in want.values())  # something was cached to agree on


def fill_device(server: Server, num_pages: int) -> None:
    """Take `num_pages` pages (evicting the least recently used cached ones), then free them."""
    c = server.client
    seq = c.post("/v1/sequences", json={}).json()["seq_id"]
    assert c.post(f"/v1/sequences/{seq}/append", json={"num_tokens": num_pages * PAGE}).status_code == 200
    assert c.delete(f"/v1/sequences/{seq}").status_code == 200


def scenario(tmp_path: Path) -> None:
    rng = random.Random(24)
    tokens = lambda n: [rng.randrange(2**32) for _ in range(n)]  # noqa: E731 (u32: what Dynamo reads)
    env_a, env_b = events_env(), events_env(KVPOOL_SPILL="host", KVPOOL_SPILL_BYTES=str(8 * PAGE_BYTES))
    a, b = Server({**SMALL_POOL, **env_a}), Server({**SMALL_POOL, **env_b})
    indexer = None
    try:
        # Before any router listens: 12 prompts of 2 pages on a 16-page pool (evictions among them).
        early = [tokens(9) for _ in range(12)]
        for prompt in early:
            put_prompt(a, prompt)
        indexer = Indexer(tmp_path / "indexer.log")
        indexer.register(1, env_a, MODEL, PAGE)
        indexer.register(2, env_b, MODEL, PAGE)
        time.sleep(1.0)  # the indexer's subscriptions reach the PUB sockets
        # Shared prefixes: p2 shares p1's first 2 pages, p3 its first; a running sequence on B.
        p1 = tokens(13)
        p2, p3 = p1[:8] + tokens(6), p1[:4] + tokens(9)
        put_prompt(a, p1)  # A's first batch the indexer sees is not seq 0: it asks for a replay from 0
        put_prompt(a, p2)
        put_prompt(b, p1)
        put_prompt(b, p3)
        running = tokens(11)
        seq = b.client.post("/v1/sequences", json={"token_ids": running}).json()["seq_id"]
        append = {"num_tokens": len(running), "token_ids": running}
        assert b.client.post(f"/v1/sequences/{seq}/append", json=append).status_code == 200
        prompts = [p1, p2, p3, p1[:7], running, *early[-4:], early[0], tokens(13)]
        agree(indexer, {1: a, 2: b}, prompts)

        # Evictions: A drops its least recently used pages; B spills them into its host tier
        # (the tier's events say "CPU": the indexer counts them in longest_matched, not in gpu).
        fill_device(a, 12)
        fill_device(b, 10)
        agree(indexer, {1: a, 2: b}, prompts)
        assert kvpool_scores(b, p1)[0] > kvpool_scores(b, p1)[1]  # B holds part of p1 in its tier only

        # A reset drops A's cached pages (AllBlocksCleared: nothing left registered).
        assert a.client.post("/v1/prefix_cache/reset").json()["all_cleared"] is True
        agree(indexer, {1: a, 2: b}, prompts)
        assert all(kvpool_scores(a, p) == (0, 0) for p in prompts)
    finally:
        if indexer is not None:
            indexer.stop()
        a.stop()
        b.stop()


def test_dynamo_indexer_scores_as_prefix_match(tmp_path: Path) -> None:
    start = time.perf_counter()
    in_private_network(lambda: scenario(tmp_path))
    print(f"Dynamo's indexer agreed with POST /v1/prefix/match throughout, in {time.perf_counter() - start:.1f} s")


def test_the_namespace_is_private() -> None:
    """What the indexer binds is out of the machine's reach: a port bound inside is free outside."""
    import socket

    def bind_inside() -> tuple[int, Any]:
        s = socket.socket()
        s.bind(("0.0.0.0", 0))
        s.listen()
        return s.getsockname()[1], s

    port, inside = in_private_network(bind_inside)
    try:
        with socket.socket() as outside:
            assert outside.connect_ex(("127.0.0.1", port)) != 0
    finally:
        inside.close()
