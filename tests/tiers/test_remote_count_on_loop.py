"""The remote tier's count on the event loop (service.tiers.resp_async), against real redis-servers: the
same leading run as the blocking count across batch boundaries, connections opened as the blocking reader
opens its own (password and database, TLS, a unix socket) and bounded in number, the count and the page
reads on the loop's thread, and a store that dies or stops answering fails the
lookup (counted, nothing found) and is reconnected to on a later call, no stale reply read."""

import asyncio
import concurrent.futures
import contextlib
import gc
import signal
import ssl
import subprocess
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from service.config import Settings
from service.core.hashing import root_hash, token_bytes
from service.pool import PoolState
from service.tiers.entries import EntryFormat
from service.tiers.remote import COUNT_BATCH, RemoteStore
from service.tiers.resp import RespConnection, RespError
from service.tiers.resp_async import MAX_CONNECTIONS, LoopSocket
from service.tiers.tier import PromptChain
from tests.tiers.conftest import RedisServer, RedisTLSServer
from tests.tiers.helpers import prompt, remote_tier
from tests.tiers.test_ordering import SMALL
from tests.tiers.test_remote_restore import make_state, written_then_evicted

ENTRIES = "L2.H2.D16.P4.float32"


def store_of(url: str) -> RemoteStore:
    return RemoteStore(url, 2.0, 60, EntryFormat(ENTRIES), 1024)


def test_count_on_loop_is_the_leading_run_the_store_holds_across_batches(redis_server: RedisServer) -> None:
    """As the blocking count (test_remote_restore): batches of COUNT_BATCH keys, then twice as many, stopping
    at the first key the store lacks, wherever it falls; concurrent counts share at most MAX_CONNECTIONS."""
    store = store_of(redis_server.url)
    assert store.counts_on_loop
    hashes = [i.to_bytes(32, "big") for i in range(1, 2 * COUNT_BATCH + 40)]
    keys = [store.entries.key(h) for h in hashes]
    client = redis_server.client()

    async def scenario() -> None:
        try:
            for hole in (0, COUNT_BATCH - 1, COUNT_BATCH, COUNT_BATCH + 17, len(hashes)):
                client.flushall()
                client.mset({key: b"x" for i, key in enumerate(keys) if i != hole})
                assert await store.count_on_loop(hashes) == hole, hole
                assert store.count(hashes) == hole, hole  # (the blocking count agrees)
            assert await store.count_on_loop([]) == 0
            counts = await asyncio.gather(*(store.count_on_loop(hashes) for _ in range(3 * MAX_CONNECTIONS)))
            assert counts == [len(hashes)] * (3 * MAX_CONNECTIONS)
            # This client, the blocking reader's connection, and the loop's: opened as needed, kept, bounded.
            assert len(client.client_list()) == 2 + MAX_CONNECTIONS
            assert store.stats.errors == 0
        finally:
            store.close()

    asyncio.run(scenario())


def counts(url: str, keys: list[bytes]) -> int:
    """How many of `keys`, from the first, the store at `url` holds: EXISTS on a fresh loop."""
    store = store_of(url)
    assert store.loop_reader is not None
    loop_reader = store.loop_reader

    async def count() -> int:
        try:
            replies = await loop_reader.exists(keys)
            return next((i for i, r in enumerate(replies) if r != 1), len(replies))
        finally:
            store.close()

    return asyncio.run(count())


def test_password_and_database_from_the_url(redis_server: RedisServer) -> None:
    client = redis_server.client()
    client.execute_command("SELECT", 3)
    client.mset({"a": b"1", "b": b"2"})
    client.config_set("requirepass", "s3cret")
    assert counts(f"redis://:s3cret@127.0.0.1:{redis_server.port}/3", [b"a", b"b", b"c"]) == 2
    assert counts(f"redis://:s3cret@127.0.0.1:{redis_server.port}/0", [b"a"]) == 0  # (another database)
    with pytest.raises(RespError, match="AUTH"):
        counts(f"redis://:nope@127.0.0.1:{redis_server.port}/3", [b"a"])


def test_tls_with_the_readers_context(redis_tls_server: RedisTLSServer) -> None:
    redis_tls_server.client().mset({"a": b"1", "b": b"2"})
    assert counts(redis_tls_server.url, [b"a", b"b", b"c"]) == 2
    with pytest.raises(ssl.SSLError):  # without the CA the certificate is refused, as by the blocking reader
        counts(redis_tls_server.url.split("?")[0], [b"a"])


def test_a_tls_connection_closed_as_its_loop_ends_leaves_no_socket_open(redis_tls_server: RedisTLSServer) -> None:
    """close() drops the connection at once: a graceful TLS close waits for the store's close_notify, which a loop
    that ends right after (asyncio.run returning) never reads, and left the socket to the collector."""
    redis_tls_server.client().mset({"a": b"1"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(30):  # (before: the store's close_notify came in time in about four closes of five)
            assert counts(redis_tls_server.url, [b"a", b"b"]) == 1
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_a_unix_socket(redis_unix: Path) -> None:
    redis.Redis(unix_socket_path=str(redis_unix), db=2).mset({"a": b"1"})
    assert counts(f"unix://{redis_unix}?db=2", [b"a", b"b"]) == 1


class RecordingExecutor(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that notes the name of each function it is handed."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.ran: list[str] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.ran.append(fn.__name__)
        return super().submit(fn, *args, **kwargs)


def test_the_count_and_the_page_reads_run_on_the_loop(redis_server: RedisServer, monkeypatch: Any) -> None:
    """Plain TCP: the count and the page reads on the loop's thread; the read thread is not used (and the
    blocking reader never connects: the loop's sockets are its own)."""

    async def scenario() -> None:
        state = make_state(redis_server)
        try:
            await written_then_evicted(state, redis_server)
            tier = remote_tier(state)
            tier._read.shutdown()
            tier._read = read = RecordingExecutor()
            loop_reader = tier.store.loop_reader
            assert loop_reader is not None and tier.store.reads_on_loop
            exists, threads = loop_reader.exists, []

            async def noted(keys: Any) -> list[int]:
                threads.append(threading.get_ident())
                return await exists(keys)

            receive, receives = LoopSocket.receive, []

            async def noted_receive(self: LoopSocket, gen: Any) -> Any:
                receives.append(threading.get_ident())
                return await receive(self, gen)

            loop_reader.exists = noted  # type: ignore[method-assign]
            monkeypatch.setattr(LoopSocket, "receive", noted_receive)
            await state.cache.restore([*prompt(1), 7], "", "")
            assert threads == [threading.get_ident()]  # one batch, asked on the loop's thread
            assert receives == [threading.get_ident()] * 4  # each page's value received on the loop's thread
            assert read.ran == []  # nothing on the read thread
            assert isinstance(tier.store.reader, RespConnection) and tier.store.reader.sock is None
            assert tier.stats.hits == 4 and tier.stats.errors == 0
            assert state.sequences.create("a2", [*prompt(1), 7]).cached_tokens == 16
        finally:
            state.close()

    asyncio.run(scenario())


def chain_of(i: int) -> PromptChain:
    return PromptChain(root_hash(""), token_bytes(prompt(i)), 4 * 8)


@contextlib.contextmanager
def timing_out_tier(redis_server: RedisServer) -> Iterator[tuple[Any, PromptChain, "subprocess.Popen[bytes]"]]:
    """The remote tier of a pool on `redis_server` whose operations time out after 0.3 s, a chain of 4 pages,
    and the store's process (to stop it: stopped())."""
    assert redis_server.proc is not None
    state = PoolState(Settings(**SMALL, remote_url=redis_server.url, remote_timeout_s=0.3))
    try:
        yield remote_tier(state), chain_of(1), redis_server.proc
    finally:
        state.close()


@contextlib.contextmanager
def stopped(proc: "subprocess.Popen[bytes]") -> Iterator[None]:
    """The store stopped (SIGSTOP: connected, never answering) until the block ends."""
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


async def until_usable(tier: Any) -> None:
    deadline = time.monotonic() + 5
    while not tier.incident.usable():  # (a failed tier is skipped for a second)
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


def test_a_store_gone_mid_run_fails_the_lookup_and_a_later_one_reconnects(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        state = make_state(redis_server)
        try:
            tier, chain = remote_tier(state), chain_of(1)
            keys = {tier.store.entries.key(h): b"x" for h in chain.hashes(4)}
            redis_server.client().mset(keys)
            assert len(await tier.lookup(chain, 0, 4)) == 4  # (a connection opened and kept)
            redis_server.stop()
            assert await tier.lookup(chain, 0, 4) == []
            assert tier.stats.errors == 1 and tier.incident.down
            redis_server.start()  # the same port, empty
            redis_server.client().mset(dict(list(keys.items())[:3]))
            await until_usable(tier)
            found = await tier.lookup(chain, 0, 4)
            assert [h for h, _ in found] == chain.hashes(3)
            assert [t for _, t in found] == [chain.tokens(i) for i in range(3)]
            assert tier.stats.errors == 1 and not tier.incident.down
        finally:
            state.close()

    asyncio.run(scenario())


def test_a_store_that_stops_answering_times_the_count_out_and_no_stale_reply_is_read(
    redis_server: RedisServer,
) -> None:
    async def scenario() -> None:
        with timing_out_tier(redis_server) as (tier, chain, proc):
            keys = [tier.store.entries.key(h) for h in chain.hashes(4)]
            redis_server.client().mset(dict.fromkeys(keys, b"x"))
            assert len(await tier.lookup(chain, 0, 4)) == 4
            with stopped(proc):
                began = time.monotonic()
                assert await tier.lookup(chain, 0, 4) == []  # its EXISTS sent, no reply in time
                assert 0.25 < time.monotonic() - began < 2
                assert tier.stats.errors == 1 and tier.incident.down
            redis_server.client().delete(keys[1])  # (the late replies to the timed-out count said 4)
            await until_usable(tier)
            assert len(await tier.lookup(chain, 0, 4)) == 1
            assert tier.stats.errors == 1 and not tier.incident.down

    asyncio.run(scenario())
