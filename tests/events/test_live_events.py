"""KV events of a real `kvpool serve`, read by a real ZeroMQ subscriber: exact events after a scripted
series of commits, evictions and resets; sequence numbers; replay; the index they build."""

import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from service.core.hashing import root_hash
from tests.conftest import Server
from tests.events.conftest import (
    DECODER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    as_int,
    block_stored,
    chain,
    events_env,
    put_prompt,
)

PAGE = 4  # SMALL_POOL: 16 pages of 4 tokens
TAG = root_hash("")[:8].hex()


def stored(hashes: list[Any], parent: Any, tokens: list[int]) -> Any:
    return block_stored(hashes, parent, tokens, "GPU", PAGE, TAG)


def apply(index: set[Any], events: list[Any]) -> None:
    """What a router's indexer does with the events of one pod."""
    for e in events:
        if isinstance(e, BlockStored):
            index.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            index.difference_update(e.block_hashes)
        else:
            assert isinstance(e, AllBlocksCleared)
            index.clear()


def counters(server: Server) -> dict[str, float]:
    text = server.client.get("/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def metric_samples(server: Server, name: str) -> list[Any]:
    text = server.client.get("/metrics").text
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def test_scripted_commits_evictions_and_resets(start_server: Any, subscribe: Any) -> None:
    env = events_env()
    server = start_server(env)
    sub = subscribe(env)
    c, index = server.client, set()
    print(f"decoding with {DECODER}'s KVEventBatch")
    a = list(range(100, 114))  # 3 full pages and 2 tokens
    b = a[:8] + list(range(200, 208))  # A's first 2 pages, then 2 pages of its own
    ha, hb = chain(a, PAGE), chain(b, PAGE)
    assert ha[:2] == hb[:2]

    assert put_prompt(server, a)["cached_tokens"] == 0
    assert put_prompt(server, b)["cached_tokens"] == 8
    batches = sub.batches()
    events = [e for _, batch in batches for e in batch.events]
    assert events == [stored(ha[:3], None, a[:12]), stored(hb[2:], ha[1], b[8:16])]
    apply(index, events)
    assert index == {*ha[:3], *hb[2:]} and c.get("/v1/pool").json()["pages_cached"] == 5

    # 14 pages without token ids: 11 free + the 3 oldest cached (LRU: A2, then B's tail first).
    big = c.post("/v1/sequences", json={}).json()["seq_id"]
    assert c.post(f"/v1/sequences/{big}/append", json={"num_tokens": 14 * PAGE}).status_code == 200
    c.delete(f"/v1/sequences/{big}")
    batches += sub.batches()
    events = [e for _, batch in batches[-1:] for e in batch.events]
    assert events == [BlockRemoved(block_hashes=[ha[2], hb[3], hb[2]], medium="GPU", group_idx=0)]
    apply(index, events)
    assert index == set(ha[:2])

    # A reset with a registered page in use: BlockRemoved of what went; then, nothing left: cleared.
    held = c.post("/v1/sequences", json={"token_ids": a[:5]}).json()
    assert held["cached_tokens"] == PAGE
    r = c.post("/v1/prefix_cache/reset")
    assert r.status_code == 200 and r.json() == {"dropped_pages": 1, "all_cleared": False}
    c.delete(f"/v1/sequences/{held['seq_id']}")
    r = c.post("/v1/prefix_cache/reset")
    assert r.json() == {"dropped_pages": 1, "all_cleared": True}
    assert c.post("/v1/prefix_cache/reset").json() == {"dropped_pages": 0, "all_cleared": True}  # no event
    tail = sub.batches()
    batches += tail
    events = [e for _, batch in tail for e in batch.events]
    assert events == [BlockRemoved(block_hashes=[ha[1]], medium="GPU", group_idx=0), AllBlocksCleared()]
    apply(index, events)
    assert index == set()
    pool = c.get("/v1/pool").json()
    assert (pool["pages_used"], pool["pages_cached"], pool["pages_free"]) == (0, 0, 16)

    # Sequence numbers: every batch, from 0, without a gap; the replay socket returns them all again.
    seqs = [seq for seq, _ in batches]
    assert seqs == list(range(len(seqs)))
    replayed = sub.replay(0)
    assert [(seq, batch.events) for seq, batch in replayed] == [(seq, batch.events) for seq, batch in batches]
    assert sub.replay(seqs[-1]) == replayed[-1:]
    assert sub.replay(seqs[-1] + 1) == []
    assert all(batch.data_parallel_rank == 0 and batch.ts > 0 for _, batch in batches)
    m = counters(server)
    assert m["kvpool_kv_events_published_total"] == len(events_seen(batches)) == 5
    assert m["kvpool_kv_events_dropped_total"] == 0
    replays = {s.labels["outcome"]: s.value for s in metric_samples(server, "kvpool_kv_events_replays_total")}
    assert replays == {"completed": 3, "cut_short": 0, "abandoned": 0, "refused": 0}


def test_replay_returns_what_a_late_subscriber_missed(start_server: Any, subscribe: Any) -> None:
    env = events_env(KVPOOL_KV_EVENTS_BUFFER="2")
    server = start_server(env)
    for i in range(3):  # three batches before anyone listens
        put_prompt(server, [i] * 9)
        time.sleep(0.3)  # the publisher thread sends the prompt's event alone
    late = subscribe(env)
    replayed = late.replay(0)  # the buffer keeps the last 2 batches
    assert [seq for seq, _ in replayed] == [1, 2]
    assert [batch.events[0].token_ids for _, batch in replayed] == [[1] * 8, [2] * 8]


def events_seen(batches: list[tuple[int, Any]]) -> list[Any]:
    return [e for _, batch in batches for e in batch.events]


def test_hashes_as_32_bytes_when_asked(start_server: Any, subscribe: Any) -> None:
    """The default (the scripted test above) is vLLM's integer form; "bytes" keeps kvpool's whole hash."""
    env = events_env(KVPOOL_KV_EVENTS_HASH_FORMAT="bytes")
    server = start_server(env)
    sub = subscribe(env)
    a, b = list(range(9)), [*range(8), 50, 51, 52, 53, 54]
    put_prompt(server, a)
    put_prompt(server, b)
    ha, hb = chain(a, PAGE, hash_format="bytes"), chain(b, PAGE, hash_format="bytes")
    first, second = sub.events()
    assert first.block_hashes == ha and first.parent_block_hash is None and len(ha[0]) == 32
    assert second.block_hashes == [hb[2]] and second.parent_block_hash == ha[1]
    assert [as_int(h) for h in ha] == chain(a, PAGE)
