"""The remote tier on a real Redis Cluster (three redis-server primaries joined by redis-cli) and real
kvpool servers: sharing across instances to the bit (also over TLS), pages spread over the nodes, a
poisoned entry rejected, a node killed and restarted mid-workload, a slot moved under a reader
(-MOVED), and a key migrating away mid-resharding (-ASK)."""

import time
from typing import Any

import numpy as np
import redis

from service.config import Settings
from service.core.hashing import root_hash, token_bytes
from service.core.tier_index import chain_hashes
from service.tiers.entries import EntryFormat
from service.tiers.remote import RemoteStore
from tests.conftest import free_port
from tests.tiers.conftest import RedisClusterServers
from tests.tiers.helpers import PAGE, prompt, run_prompt, same_bits
from tests.tiers.test_remote_http import GEOMETRY, PAGE_NBYTES, keys_of
from tests.tiers.test_spill_http import metric


def cluster_env(c: RedisClusterServers) -> dict[str, str]:
    return {"KVPOOL_REMOTE_URL": c.url, "KVPOOL_REMOTE_TIMEOUT_S": "0.2"}


def wait_for(c: RedisClusterServers, keys: list[str], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not set(k.encode() for k in keys) <= set(c.keys()):
        assert time.monotonic() < deadline, f"{len(c.keys())} keys in the cluster, waiting for {keys}"
        time.sleep(0.05)


def test_a_prefix_written_on_a_is_a_hit_on_b_over_the_cluster(
    start_server: Any, redis_cluster: RedisClusterServers
) -> None:
    a, b = start_server(cluster_env(redis_cluster)).client, start_server(cluster_env(redis_cluster)).client
    cached, out_a = run_prompt(a, "x", 1, num_pages=8)
    assert cached == 0
    keys = keys_of("", 1, num_pages=8)
    wait_for(redis_cluster, keys)
    assert sum(1 for p in redis_cluster.ports if redis_cluster.client(p).dbsize()) >= 2  # spread, no hash tag
    cached, out_b = run_prompt(b, "y", 1, num_pages=8)
    assert cached == 8 * PAGE  # every page from the cluster, through each node's connection
    assert same_bits(out_a, out_b)
    assert metric(b, "kvpool_tier_hits_total", "remote") == 8
    assert metric(b, "kvpool_tier_errors_total", "remote") == 0
    # A poisoned entry (right key, another page's token ids) on whichever node holds it: never loaded.
    hashes = chain_hashes(root_hash(""), token_bytes(prompt(3)), PAGE * 8)
    toks = [token_bytes(prompt(3)[j * PAGE : (j + 1) * PAGE]) for j in range(4)]
    data = bytes(PAGE_NBYTES)
    store = redis_cluster.cluster()
    store.set(EntryFormat(GEOMETRY).key(hashes[0]), EntryFormat(GEOMETRY).encode(hashes[0], toks[0], data))
    store.set(EntryFormat(GEOMETRY).key(hashes[1]), EntryFormat(GEOMETRY).encode(hashes[1], toks[2], data))
    r = b.post("/v1/sequences", json={"token_ids": [*prompt(3), 7]})
    assert r.status_code == 201 and r.json()["cached_tokens"] == PAGE  # page 0 only
    assert metric(b, "kvpool_tier_rejected_total", "remote") == 1


def test_a_tls_cluster_shares_to_the_bit(start_server: Any, redis_tls_cluster: RedisClusterServers) -> None:
    """rediss+cluster://: TLS to every node, writes through RedisCluster, reads through kvpool's reader."""
    a, b = start_server(cluster_env(redis_tls_cluster)).client, start_server(cluster_env(redis_tls_cluster)).client
    _, out_a = run_prompt(a, "x", 1, num_pages=8)
    wait_for(redis_tls_cluster, keys_of("", 1, num_pages=8))
    cached, out_b = run_prompt(b, "y", 1, num_pages=8)
    assert cached == 8 * PAGE and same_bits(out_a, out_b)
    assert metric(b, "kvpool_tier_errors_total", "remote") == 0


def test_a_node_killed_mid_workload_and_restarted(start_server: Any, redis_cluster: RedisClusterServers) -> None:
    server_a = start_server(cluster_env(redis_cluster))
    a = server_a.client
    run_prompt(a, "x", 1, num_pages=8)
    wait_for(redis_cluster, keys_of("", 1, num_pages=8))
    victim = next(p for p in redis_cluster.ports if redis_cluster.client(p).dbsize())
    redis_cluster.stop(victim)
    b = start_server(cluster_env(redis_cluster)).client
    assert run_prompt(b, "y", 1, num_pages=8)[0] < 8 * PAGE  # part of it is gone: no 5xx, a shorter hit
    for i in range(2, 6):  # no 5xx: the device pool alone
        assert run_prompt(a, f"s{i}", i)[0] == 0
        time.sleep(0.3)
    assert metric(a, "kvpool_tier_errors_total", "remote") >= 1  # its writes failed
    assert metric(b, "kvpool_tier_errors_total", "remote") >= 1  # its reads failed
    assert not next(t for t in a.get("/v1/pool").json()["tiers"] if t["tier"] == "remote")["up"]
    redis_cluster.start(victim)  # the same node (its cluster config kept), empty
    redis_cluster.wait_ok()
    time.sleep(1.1)  # the tier's back-off after a failure
    for i in range(6, 9):
        run_prompt(a, f"s{i}", i, num_pages=4)
    wait_for(redis_cluster, keys_of("", 8))  # writes resumed by themselves
    c = start_server(cluster_env(redis_cluster)).client
    cached, _ = run_prompt(c, "z", 8)
    assert cached == 4 * PAGE
    assert next(t for t in a.get("/v1/pool").json()["tiers"] if t["tier"] == "remote")["up"]
    server_a.stop()
    assert "remote tier works again" in server_a.output
    assert "service/tiers/" not in server_a.output, server_a.output  # no traceback through the tiers


def store_of(url: str) -> RemoteStore:
    """A store client of 64-byte pages, as a pool of the default geometry would make it."""
    return RemoteStore(url, 0.5, 3600, EntryFormat(Settings().geometry_tag), 64)


def read_pages(store: RemoteStore, hashes: list[bytes], tokens: list[bytes], nbytes: int) -> list[bytes]:
    """What get_into brings in intact for these pages (into rows of an array), from the first."""
    rows = np.zeros((len(hashes), nbytes), dtype=np.uint8)
    got = store.get_into(hashes, tokens, [[row.data] for row in rows])
    return [row.tobytes() for row in rows[:got]]


def test_a_moved_slot_is_not_loaded_counted_and_followed(redis_cluster: RedisClusterServers) -> None:
    """A reader whose slot map is stale gets -MOVED, to EXISTS (counting) or to GETEX (reading): that
    page is not loaded (the count or the read stops short), an error is counted, and the next call
    fetches the map again and finds the page."""
    counter = store_of(redis_cluster.url)
    reader = store_of(redis_cluster.url)
    try:
        tokens = token_bytes(prompt(5, num_pages=2))
        per_page = len(tokens) // 2
        hashes, toks = counter.chain(root_hash(""), tokens, per_page, 0, 2)
        assert hashes == chain_hashes(root_hash(""), tokens, per_page)
        pages = np.arange(128, dtype=np.uint8).reshape(2, 64)
        counter.put(hashes[:1], toks[:1], pages[:1])
        assert counter.count(hashes) == 1 and reader.count(hashes) == 1  # their slot maps fetched
        # Page 1's slot (empty so far) handed to another node, then page 1 written there.
        key = EntryFormat(counter.entries.geometry).key(hashes[1])
        slot = redis.crc.key_slot(key.encode())
        cluster = redis_cluster.cluster()
        owner = cluster.get_node_from_key(key).port
        target = next(p for p in redis_cluster.ports if p != owner)
        target_id = redis_cluster.client(target).execute_command("CLUSTER MYID")
        for port in [target, *(p for p in redis_cluster.ports if p != target)]:
            redis_cluster.client(port).execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
        data = EntryFormat(counter.entries.geometry).encode(hashes[1], toks[1], pages[1].tobytes())
        redis_cluster.client(target).set(key, data)
        assert counter.count(hashes) == 1 and counter.stats.errors == 1  # EXISTS -MOVED
        assert len(read_pages(reader, hashes, toks, 64)) == 1 and reader.stats.errors == 1  # GETEX -MOVED
        assert reader.stats.rejected == 0  # (a redirect is no bad entry)
        assert counter.count(hashes) == 2  # the map fetched again
        assert read_pages(reader, hashes, toks, 64) == [pages[0].tobytes(), pages[1].tobytes()]
    finally:
        counter.close()
        reader.close()


def test_a_cluster_down_at_start_up_costs_nothing_but_errors(start_server: Any) -> None:
    """No seed answers when kvpool starts: it starts, requests go on with the device pool, the
    tier's failures are counted (redis-py's RedisCluster connects when made: it is made at first use)."""
    dead = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    server = start_server({"KVPOOL_REMOTE_URL": dead, "KVPOOL_REMOTE_TIMEOUT_S": "0.2"})
    for i in range(1, 4):
        assert run_prompt(server.client, f"s{i}", i)[0] == 0
        time.sleep(1.1)  # past the back-off: the tier is tried again
    assert metric(server.client, "kvpool_tier_errors_total", "remote") >= 2  # its reads and its writes
    assert not next(t for t in server.client.get("/v1/pool").json()["tiers"] if t["tier"] == "remote")["up"]
    server.stop()
    assert "remote tier failing" in server.output and "service/tiers/" not in server.output


def test_a_key_migrating_away_is_not_loaded_counted_and_found_once_moved(redis_cluster: RedisClusterServers) -> None:
    """A slot in the middle of a resharding: its key already moved to the importing node, the old
    owner answers -ASK, to EXISTS (counting) and to GETEX (reading). The page is not counted or
    loaded (the reader does not follow ASK: the entry is in flight), an error is counted and the
    slot map fetched again; once the slot is handed over, the next call goes to the new owner."""
    counter = store_of(redis_cluster.url)
    reader = store_of(redis_cluster.url)
    try:
        tokens = token_bytes(prompt(6, num_pages=2))
        hashes, toks = counter.chain(root_hash(""), tokens, len(tokens) // 2, 0, 2)
        pages = np.arange(128, dtype=np.uint8).reshape(2, 64) ^ 0x5A
        counter.put(hashes, toks, pages)
        assert counter.count(hashes) == 2 and len(read_pages(reader, hashes, toks, 64)) == 2  # maps fetched
        key = EntryFormat(counter.entries.geometry).key(hashes[1])
        slot = redis.crc.key_slot(key.encode())
        owner = redis_cluster.cluster().get_node_from_key(key).port
        target = next(p for p in redis_cluster.ports if p != owner)
        source, dest = redis_cluster.client(owner), redis_cluster.client(target)
        source_id, target_id = source.execute_command("CLUSTER MYID"), dest.execute_command("CLUSTER MYID")
        dest.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id)
        source.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id)
        source.execute_command("MIGRATE", "127.0.0.1", target, key, 0, 5000)
        asking = dest.pipeline(transaction=False)  # (the importing node serves the key only after ASKING)
        assert asking.execute_command("ASKING").exists(key).execute() == [True, 1]
        assert counter.count(hashes) == 1 and counter.stats.errors == 1  # EXISTS -ASK
        assert read_pages(reader, hashes, toks, 64) == [pages[0].tobytes()] and reader.stats.errors == 1  # GETEX -ASK
        for port in redis_cluster.ports:  # the migration finished: every node names the target
            redis_cluster.client(port).execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
        assert counter.count(hashes) == 2  # on the maps fetched after the -ASK
        assert read_pages(reader, hashes, toks, 64) == [pages[0].tobytes(), pages[1].tobytes()]
        assert counter.stats.errors == reader.stats.errors == 1 and reader.stats.rejected == 0
    finally:
        counter.close()
        reader.close()
