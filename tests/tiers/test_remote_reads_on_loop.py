"""The remote tier's page reads on the event loop (RemoteStore.get_into_on_loop over resp_async's
LoopSocket), against real redis-servers: on the same store contents it reads what the threaded path
(get_into on the read thread) reads, counts what it counts and refreshes the TTLs of the same keys, a
bad entry anywhere in a batch (a wrong size, a missing key, a key of another type, another page's
entry) included; over a unix socket too, not over TLS; and a store that stops answering times the read
out (counted by the tier), after which the next read opens a fresh socket and reads fresh replies."""

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from service.tiers.entries import EntryFormat
from service.tiers.remote import RemoteStore, read_batch
from service.tiers.resp_async import MAX_CONNECTIONS
from tests.tiers.conftest import RedisServer, RedisTLSServer
from tests.tiers.test_remote_count_on_loop import stopped, timing_out_tier, until_usable

ENTRIES = "L2.H2.D16.P4.float32"
PAGE = 1024
NUM = 2 * read_batch(PAGE) + 9  # three batches: two in flight, then one more


def store_of(url: str) -> RemoteStore:
    return RemoteStore(url, 2.0, 60, EntryFormat(ENTRIES), PAGE)


def hashes_tokens() -> tuple[list[bytes], list[bytes]]:
    return [i.to_bytes(32, "big") for i in range(1, NUM + 1)], [i.to_bytes(4, "big") * 4 for i in range(NUM)]


def page_bytes(i: int) -> bytes:
    return bytes((i + j) % 251 for j in range(PAGE))


def write(client: "redis.Redis[bytes]", store: RemoteStore, bad: int | None, kind: str) -> None:
    """NUM valid entries (no TTL), entry `bad` made bad as `kind` says."""
    client.flushdb()
    hashes, tokens = hashes_tokens()
    values = {
        store.entries.key(h): store.entries.encode(h, t, page_bytes(i)) for i, (h, t) in enumerate(zip(hashes, tokens))
    }
    if bad is not None:
        key = store.entries.key(hashes[bad])
        if kind == "size":
            values[key] = values[key][:-1]
        elif kind == "missing":
            del values[key]
        elif kind == "poisoned":  # another page's entry under this key
            values[key] = store.entries.encode(hashes[bad], tokens[bad - 1], page_bytes(bad))
        elif kind == "empty":
            values[key] = b""
    client.mset(values)
    if bad is not None and kind == "type":
        client.delete(store.entries.key(hashes[bad]))
        client.rpush(store.entries.key(hashes[bad]), b"a list")


def outcome(store: RemoteStore, client: "redis.Redis[bytes]", pages: list[list[memoryview]], num: int) -> Any:
    hashes, _ = hashes_tokens()
    ttls = [client.ttl(store.entries.key(h)) > 0 for h in hashes]  # the keys whose GETEX was sent
    data = [b"".join(bytes(p) for p in page) for page in pages[:num]]
    return num, store.stats.rejected, store.stats.errors, ttls, data


def fresh_pages() -> list[list[memoryview]]:
    """Each page in two parts (as a pool page's K/V and scales are)."""
    return [[memoryview(bytearray(PAGE - 100)), memoryview(bytearray(100))] for _ in range(NUM)]


CASES = [(None, "")] + [
    (bad, kind)
    for bad in (0, 5, read_batch(PAGE) - 1, read_batch(PAGE), NUM - 1)
    for kind in ("size", "missing", "type", "poisoned", "empty")
]


def test_on_the_loop_as_on_the_read_thread_a_bad_entry_anywhere(redis_server: RedisServer) -> None:
    client = redis_server.client()
    hashes, tokens = hashes_tokens()

    async def scenario() -> None:
        threaded, looped = store_of(redis_server.url), store_of(redis_server.url)
        assert looped.reads_on_loop
        try:
            for bad, kind in CASES:
                write(client, threaded, bad, kind)
                threaded.stats.rejected = threaded.stats.errors = 0
                pages = fresh_pages()
                num = await asyncio.get_running_loop().run_in_executor(None, threaded.get_into, hashes, tokens, pages)
                expected = outcome(threaded, client, pages, num)
                write(client, looped, bad, kind)
                looped.stats.rejected = looped.stats.errors = 0
                pages = fresh_pages()
                got = outcome(looped, client, pages, await looped.get_into_on_loop(hashes, tokens, pages))
                assert got == expected, (bad, kind)
                assert got[0] == (NUM if bad is None else bad), (bad, kind)
                assert got[1] == (bad is not None and kind != "missing"), (bad, kind)
                assert got[4] == [page_bytes(i) for i in range(got[0])]
                if bad is not None and bad < read_batch(PAGE):  # the third batch never sent: no TTL set
                    assert not any(got[3][2 * read_batch(PAGE) :]), (bad, kind)
            # Every socket left clean for the next read (values after a bad one read off): reused.
            write(client, looped, None, "")
            pages = fresh_pages()
            runs = await asyncio.gather(*(looped.get_into_on_loop(hashes, tokens, fresh_pages()) for _ in range(6)))
            assert runs == [NUM] * 6 and await looped.get_into_on_loop(hashes, tokens, pages) == NUM
            assert looped.loop_reader is not None and len(looped.loop_reader._open_socks) <= MAX_CONNECTIONS
            assert await looped.get_into_on_loop([], [], []) == 0
            assert looped.stats.errors == 0
        finally:
            threaded.close()
            looped.close()

    asyncio.run(scenario())


def test_a_unix_socket(redis_unix: Path) -> None:
    url = f"unix://{redis_unix}?db=2"
    client = redis.Redis(unix_socket_path=str(redis_unix), db=2)
    hashes, tokens = hashes_tokens()

    async def scenario() -> None:
        store = store_of(url)
        assert store.reads_on_loop
        try:
            write(client, store, 7, "missing")
            pages = fresh_pages()
            assert await store.get_into_on_loop(hashes, tokens, pages) == 7
            assert [b"".join(bytes(p) for p in page) for page in pages[:7]] == [page_bytes(i) for i in range(7)]
            write(client, store, None, "")
            assert await store.get_into_on_loop(hashes, tokens, fresh_pages()) == NUM
        finally:
            store.close()

    asyncio.run(scenario())


def test_tls_reads_stay_on_the_read_thread(redis_tls_server: RedisTLSServer) -> None:
    store = store_of(redis_tls_server.url)
    try:
        assert store.counts_on_loop and not store.reads_on_loop
    finally:
        store.close()


def test_a_store_that_stops_answering_times_the_read_out_and_the_next_reads_fresh_replies(
    redis_server: RedisServer,
) -> None:
    async def scenario() -> None:
        with timing_out_tier(redis_server) as (tier, chain, proc):
            assert tier.codec.on_host and tier.store.reads_on_loop
            entries, size = tier.store.entries, tier.codec.page_nbytes
            hashes = chain.hashes(4)
            keys = [entries.key(h) for h in hashes]
            values = [entries.encode(h, chain.tokens(i), bytes([i + 1]) * size) for i, h in enumerate(hashes)]
            redis_server.client().mset(dict(zip(keys, values)))
            found = await tier.lookup(chain, 0, 4)
            assert len(found) == 4
            assert await tier.load_into(found, [0, 1, 2, 3]) == 4  # (a socket opened and kept)
            with stopped(proc):
                began = time.monotonic()
                assert await tier.load_into(found, [0, 1, 2, 3]) == 0  # its GETEXs sent, no reply in time
                assert 0.25 < time.monotonic() - began < 2
                assert tier.stats.errors == 1 and tier.incident.down
                assert tier.store.loop_reader is not None and not tier.store.loop_reader._open_socks  # closed
            redis_server.client().delete(keys[1])  # (the late replies to the timed-out read held all 4)
            await until_usable(tier)
            assert await tier.load_into(found, [0, 1, 2, 3]) == 1
            assert tier.stats.errors == 1 and not tier.incident.down and tier.stats.hits == 5
            assert bytes(tier.codec.host_views(0)[0][:4]) == bytes([1]) * 4

    asyncio.run(scenario())


@pytest.mark.parametrize("cut", ["closed", "killed"])
def test_a_store_gone_mid_read_fails_it_and_a_later_read_reconnects(redis_server: RedisServer, cut: str) -> None:
    hashes, tokens = hashes_tokens()

    async def scenario() -> None:
        store = store_of(redis_server.url)
        try:
            write(redis_server.client(), store, None, "")
            assert await store.get_into_on_loop(hashes, tokens, fresh_pages()) == NUM
            began = time.monotonic()
            if cut == "closed":  # the reader closed under a read in progress: it fails, nothing reused
                assert store.loop_reader is not None and redis_server.proc is not None
                redis_server.proc.send_signal(signal.SIGSTOP)  # (the read waits for its replies)
                try:
                    reading = asyncio.ensure_future(store.get_into_on_loop(hashes, tokens, fresh_pages()))
                    await asyncio.sleep(0.05)
                    store.loop_reader.close()
                    with pytest.raises(ConnectionError):
                        await reading
                    assert time.monotonic() < began + 1  # cut at once, not timed out
                finally:
                    redis_server.proc.send_signal(signal.SIGCONT)
            else:
                redis_server.stop()
                with pytest.raises(OSError):
                    await store.get_into_on_loop(hashes, tokens, fresh_pages())
                redis_server.start()
                write(redis_server.client(), store, 3, "missing")
            assert await store.get_into_on_loop(hashes, tokens, fresh_pages()) == (NUM if cut == "closed" else 3)
        finally:
            store.close()

    asyncio.run(scenario())


def test_the_time_a_read_waits_for_the_stores_bytes_is_counted_apart(redis_server: RedisServer) -> None:
    """load_wait_seconds: of a read's time, what it spent waiting for replies not there yet (here the store paused
    for 0.15 s after the GETEXs were sent), within the tier's load_seconds; a read whose replies keep coming waits
    far less."""

    async def scenario() -> None:
        with timing_out_tier(redis_server) as (tier, chain, proc):
            entries, size = tier.store.entries, tier.codec.page_nbytes
            hashes = chain.hashes(4)
            values = [entries.encode(h, chain.tokens(i), bytes([i + 1]) * size) for i, h in enumerate(hashes)]
            redis_server.client().mset({entries.key(h): v for h, v in zip(hashes, values)})
            found = await tier.lookup(chain, 0, 4)
            assert await tier.load_into(found, [0, 1, 2, 3]) == 4
            assert 0 <= tier.stats.load_wait_seconds < 0.05
            before = tier.stats.load_wait_seconds
            proc.send_signal(signal.SIGSTOP)
            asyncio.get_running_loop().call_later(0.15, proc.send_signal, signal.SIGCONT)  # (the timeout: 0.3 s)
            began = time.perf_counter()
            assert await tier.load_into(found, [0, 1, 2, 3]) == 4 and tier.stats.errors == 0
            took = time.perf_counter() - began
            waited = tier.stats.load_wait_seconds - before
            assert 0.1 < waited <= took
            assert tier.report()["load_wait_seconds"] == tier.stats.load_wait_seconds  # (GET /v1/pool's tier row)

    asyncio.run(scenario())
