"""The remote tier over HTTP, against a real redis-server and real kvpool servers: (a) sharing across
instances, (c) the store killed and restarted, (d) poisoned entries, (e) tenants kept apart."""

import os
import signal
import time
from typing import Any

import torch

from service.core.hashing import root_hash, token_bytes
from service.core.tier_index import chain_hashes
from service.tiers.entries import EntryFormat
from tests.tiers.conftest import RedisServer
from tests.tiers.helpers import PAGE, prompt, run_prompt, same_bits
from tests.tiers.test_spill_http import metric

GEOMETRY = "L2.H2.D16.P4.float32"  # tests.conftest.SMALL_POOL
PAGE_NBYTES = 2 * 2 * PAGE * 2 * 16 * 4
KEY_A, KEY_B = "alice-key-0123456789", "bob-key-0123456789ab"


def remote_env(r: RedisServer) -> dict[str, str]:
    return {"KVPOOL_REMOTE_URL": r.url, "KVPOOL_REMOTE_TIMEOUT_S": "0.2"}


def wait_for_keys(r: RedisServer, num: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while r.client().dbsize() < num:
        assert time.monotonic() < deadline, f"{r.client().dbsize()} keys, expected {num}"
        time.sleep(0.05)


def keys_of(tenant: str, i: int, num_pages: int = 4) -> list[str]:
    hashes = chain_hashes(root_hash(tenant), token_bytes(prompt(i, num_pages)), PAGE * 8)
    return [EntryFormat(GEOMETRY).key(h) for h in hashes]


def test_a_prefix_written_on_a_is_a_hit_on_b_bit_for_bit(start_server: Any, redis_server: RedisServer) -> None:
    a, b = start_server(remote_env(redis_server)).client, start_server(remote_env(redis_server)).client
    cached, out_a = run_prompt(a, "x", 1)
    assert cached == 0
    wait_for_keys(redis_server, 4)
    assert sorted(k.decode() for k in redis_server.client().keys()) == sorted(keys_of("", 1))
    cached, out_b = run_prompt(b, "y", 1)
    assert cached == 16  # all four pages from the store
    assert same_bits(out_a, out_b)
    assert metric(b, "kvpool_tier_hits_total", "remote") == 4
    assert metric(b, "kvpool_tier_bytes_in_total", "remote") == 4 * PAGE_NBYTES
    # The restores' time on the tier: a asked it (a miss) and read nothing; b asked, then read four pages.
    assert metric(a, "kvpool_tier_lookup_seconds_total", "remote") > 0
    assert metric(a, "kvpool_tier_load_seconds_total", "remote") == 0
    assert metric(b, "kvpool_tier_load_seconds_total", "remote") > 0
    row = next(t for t in b.get("/v1/pool").json()["tiers"] if t["tier"] == "remote")
    assert row["lookup_seconds"] > 0 and row["load_seconds"] > 0
    # (of which waiting for the store's bytes: a part, the same in the tier row and the metric)
    assert 0 <= row["load_wait_seconds"] <= row["load_seconds"]
    assert metric(b, "kvpool_tier_load_wait_seconds_total", "remote") <= metric(
        b, "kvpool_tier_load_seconds_total", "remote"
    )
    ttl = redis_server.client().ttl(keys_of("", 1)[0])
    assert 3500 < ttl <= 3600
    # A different geometry shares nothing: same tokens, other keys.
    other = start_server({**remote_env(redis_server), "KVPOOL_HEAD_DIM": "32"}).client
    assert other.post("/v1/sequences", json={"token_ids": [*prompt(1), 7]}).json()["cached_tokens"] == 0


def test_store_killed_and_restarted_mid_workload(start_server: Any, redis_server: RedisServer) -> None:
    server_a = start_server(remote_env(redis_server))
    a = server_a.client
    run_prompt(a, "x", 1)
    wait_for_keys(redis_server, 4)
    redis_server.stop()
    for i in range(2, 6):  # no 5xx, nothing wrong: the device pool alone
        cached, _ = run_prompt(a, f"s{i}", i)
        assert cached == 0
    assert run_prompt(a, "again", 5)[0] == 16  # the device still holds it
    pool = a.get("/v1/pool").json()
    remote = next(t for t in pool["tiers"] if t["tier"] == "remote")
    assert remote["errors"] >= 1 and not remote["up"]
    redis_server.start()  # empty, on the same port
    time.sleep(1.1)  # the tier's back-off after a failure
    b = start_server(remote_env(redis_server)).client
    for i in range(6, 9):
        run_prompt(a, f"s{i}", i)
    wait_for_keys(redis_server, 4)  # writes resumed by themselves
    cached, _ = run_prompt(b, "y", 8)
    assert cached == 16
    assert a.get("/v1/pool").json()["tiers"][0]["up"] is True
    assert metric(a, "kvpool_tier_errors_total", "remote") >= 1
    server_a.stop()
    # One incident, logged once when it began and once when it ended; no traceback.
    assert server_a.output.count("remote tier failing") == 1, server_a.output
    assert server_a.output.count("remote tier works again") == 1
    assert "Traceback" not in server_a.output


def test_poisoned_entries_are_never_loaded(start_server: Any, redis_server: RedisServer) -> None:
    store = redis_server.client()
    hashes = chain_hashes(root_hash(""), token_bytes(prompt(3)), PAGE * 8)
    toks = [token_bytes(prompt(3)[j * PAGE : (j + 1) * PAGE]) for j in range(4)]
    data = torch.ones(PAGE_NBYTES, dtype=torch.uint8).numpy().tobytes()
    # Page 0 right; page 1 under its key but with another page's token ids.
    store.set(EntryFormat(GEOMETRY).key(hashes[0]), EntryFormat(GEOMETRY).encode(hashes[0], toks[0], data))
    store.set(EntryFormat(GEOMETRY).key(hashes[1]), EntryFormat(GEOMETRY).encode(hashes[1], toks[2], data))
    b = start_server(remote_env(redis_server)).client
    r = b.post("/v1/sequences", json={"seq_id": "p", "token_ids": [*prompt(3), 7]})
    assert r.json()["cached_tokens"] == PAGE  # page 0 only
    assert metric(b, "kvpool_tier_rejected_total", "remote") == 1
    b.delete("/v1/sequences/p")
    # Page 1 right but one byte flipped after the checksum was taken.
    good = bytearray(EntryFormat(GEOMETRY).encode(hashes[1], toks[1], data))
    good[-10] ^= 1
    store.set(EntryFormat(GEOMETRY).key(hashes[1]), bytes(good))
    c = start_server(remote_env(redis_server)).client
    assert c.post("/v1/sequences", json={"token_ids": [*prompt(3), 7]}).json()["cached_tokens"] == PAGE
    assert metric(c, "kvpool_tier_rejected_total", "remote") == 1
    # Page 1 under its key, intact, but from a pool of another geometry (a value of the same size).
    other = "L2.H2.D16.P4.float3X"
    store.set(EntryFormat(GEOMETRY).key(hashes[1]), EntryFormat(other).encode(hashes[1], toks[1], data))
    c.post("/v1/sequences", json={"seq_id": "q", "token_ids": [*prompt(3), 7]})
    assert c.get("/v1/sequences/q").json()["cached_tokens"] == PAGE
    assert metric(c, "kvpool_tier_rejected_total", "remote") == 2


def test_tenants_never_share_through_the_store(start_server: Any, redis_server: RedisServer) -> None:
    env = {**remote_env(redis_server), "KVPOOL_API_KEYS": f"alice:{KEY_A},bob:{KEY_B}"}
    a, b = start_server(env).client, start_server(env).client
    alice, bob = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
    _, out = run_prompt(a, "x", 4, headers=alice)
    wait_for_keys(redis_server, 4)
    assert sorted(k.decode() for k in redis_server.client().keys()) == sorted(keys_of("alice", 4))
    assert run_prompt(b, "y", 4, headers=bob)[0] == 0
    cached, out_b = run_prompt(b, "z", 4, headers=alice)
    assert cached == 16 and same_bits(out, out_b)


def test_a_hung_store_costs_requests_one_timeout_then_nothing(start_server: Any, redis_server: RedisServer) -> None:
    a = start_server(remote_env(redis_server)).client
    run_prompt(a, "x", 1)
    wait_for_keys(redis_server, 4)
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
    try:
        took = []
        for i in range(2, 8):
            start = time.monotonic()
            assert run_prompt(a, f"s{i}", i)[0] == 0
            took.append(time.monotonic() - start)
        assert max(took) < 2.0  # one timeout (0.2 s) at most, never a hang (margin: a shared machine)
        assert metric(a, "kvpool_tier_errors_total", "remote") >= 1
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    time.sleep(1.1)
    run_prompt(a, "y", 9)
    wait_for_keys(redis_server, 8)  # the store answers again: writes resume


def test_a_full_write_queue_skips_and_counts(start_server: Any, redis_server: RedisServer) -> None:
    a = start_server({**remote_env(redis_server), "KVPOOL_REMOTE_QUEUE_PAGES": "3"}).client
    run_prompt(a, "x", 1)  # one commit of 4 pages: more than the queue holds
    run_prompt(a, "y", 2, num_pages=2)  # 2 pages: queued and written
    wait_for_keys(redis_server, 2)
    assert metric(a, "kvpool_tier_skipped_total", "remote") == 4
    assert sorted(k.decode() for k in redis_server.client().keys()) == sorted(keys_of("", 2)[:2])


def test_a_hit_refreshes_the_ttl_so_hot_prefixes_stay(start_server: Any, redis_server: RedisServer) -> None:
    env = {**remote_env(redis_server), "KVPOOL_REMOTE_TTL_S": "4"}
    a, b, c = (start_server(env).client for _ in range(3))
    run_prompt(a, "x", 1)
    wait_for_keys(redis_server, 4)
    time.sleep(2.2)
    store = redis_server.client()
    assert all(store.ttl(k) <= 2 for k in keys_of("", 1))
    assert run_prompt(b, "y", 1)[0] == 16  # a hit on another instance...
    assert all(store.ttl(k) > 2 for k in keys_of("", 1))  # ...set every page's TTL again
    time.sleep(2.2)  # past the first TTL: still there
    assert run_prompt(c, "z", 1)[0] == 16
