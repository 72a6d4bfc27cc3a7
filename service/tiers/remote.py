"""The remote tier's store: committed pages in Redis or Valkey, for every kvpool with the same URL and geometry.

Entries: one page per key, its value checked by a checksum or a keyed MAC (service.tiers.entries).
Size:  every write sets a TTL (KVPOOL_REMOTE_TTL_S), and every read that finds an entry sets it again
       (GETEX ... EX in the read itself, no extra round trip), so a prefix in use never ages out and
       the store's size is bounded by the rate of new pages times the TTL even when it is shared with
       other users and has no maxmemory policy; deploy/ also gives Valkey a maxmemory with
       allkeys-lru, the hard bound. A TTL rather than only LRU, because a hash names a prefix forever:
       a stale entry is never wrong, only useless, and the TTL lets unused geometries and tenants age out.

Writes (a background batch, pipelined SETs) go over a connection of our own (service.tiers.resp, each value
sent from the gathered page as it lies) wherever one node is read by our reader; else through redis-py
(RedisCluster on a cluster). Reads (a lookup
waits on them) go in two steps: count() asks which pages the store holds (pipelined EXISTS, one round trip for
most prompts; count_on_loop() asks the same on the event loop, over service.tiers.resp_async, wherever one
node is read by our reader), the restore allocates pool pages for those, and get_into() pipelines GETEX over
service.tiers.resp, which receives each value's page bytes straight into its pool page (on a CPU pool; a host
buffer otherwise), its header and checksum into small buffers beside, checked as it arrives; the pages are
committed only once checked. get_into_on_loop() does the same on the event loop (one node over redis:// or
unix://: resp_async.LoopSocket, loop.sock_recv_into straight into the pages); both follow one plan
(_getting: the batches, what is in flight, what a bad entry stops), as count() and count_on_loop() follow
_counting. Counting first is what lets the pages be allocated before the values come
(receiving into them saves a copy of every byte) without allocating, and evicting device pages for, what the
store does not hold. One connection for the blocking reads on redis://, rediss:// (TLS) and unix:// URLs
(and up to resp_async.MAX_CONNECTIONS each for the counts and the reads on the loop), one per node on
redis[s]+cluster:// (service.tiers.cluster: routing by slot, why no hash tags, redirects). rediss:// with TLS
options the reader does not handle (service.remote_url.TLS_OPTIONS) reads through redis-py's pipelines instead
(slower: its parser copies each value). Each command is bounded by KVPOOL_REMOTE_TIMEOUT_S, no retries: a
failure is counted, the tier skipped for a second, and the next call reconnects. Needs Redis >= 6.2 (GETEX) or
any Valkey.
"""

import asyncio
import threading
from collections.abc import Generator, Sequence
from typing import NamedTuple

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from service.core.tier_index import chain_hashes
from service.remote_url import is_cluster_url
from service.tiers.cluster import ClusterReader, cluster_client
from service.tiers.entries import EntryFormat
from service.tiers.resp import REDIRECTED, WRONG_TYPE, RespConnection, RespError
from service.tiers.resp_async import LoopReader
from service.tiers.stats import TierStats

Chain = tuple[list[bytes], list[bytes]]  # page hashes, token bytes
# Values per pipelined GETEX batch (two batches in flight; none sent after the first bad entry): about
# READ_BATCH_BYTES of them, at most READ_BATCH. Small batches keep what the store has in flight (its
# reply buffers, the socket's) in the caches, which cost redis-server less CPU per prefix and the restore
# less time (kvpool bench tiers, side by side: docs/benchmarks.md, "Figures behind the code").
READ_BATCH, READ_BATCH_BYTES = 32, 2 << 20
IN_FLIGHT = 2  # batches sent ahead of the replies being read
# Keys in the first pipelined EXISTS batch, twice as many in each next: the whole rest of a prompt of up to 2,048
# tokens (page size 16) in one round trip. Each EXISTS costs the store microseconds; each round trip, under load,
# a wait for a core on both sides (a QA history of ~60 pages took two at 32).
COUNT_BATCH = 128


class Send(NamedTuple):
    """A step of RemoteStore._getting: send GETEX key EX ttl for each of `keys`, in one write."""

    keys: list[bytes]


def read_batch(page_nbytes: int) -> int:
    return max(1, min(READ_BATCH, READ_BATCH_BYTES // page_nbytes))


class RemoteStore:
    name = "remote"

    def __init__(self, url: str, timeout_s: float, ttl_s: int, entries: EntryFormat, page_nbytes: int) -> None:
        self.entries, self.page_nbytes, self.ttl_s = entries, page_nbytes, ttl_s
        self.url, self.timeout = url, timeout_s
        self.cluster = is_cluster_url(self.url)
        self._client: redis.Redis | RedisCluster | None = None  # redis-py, made at first use (client())
        self.reader: RespConnection | ClusterReader | None = None  # None: reads through redis-py
        if self.cluster:
            self.reader = ClusterReader(self.url, self.timeout)
        elif RespConnection.supports(self.url):
            self.reader = RespConnection.from_url(self.url, self.timeout)
        # count() and reads on the loop (one node): connections of its own, opened as the reader's are; and
        # the writes' connection (put, on the write thread).
        self.loop_reader: LoopReader | None = None
        self.writer: RespConnection | None = None
        if isinstance(self.reader, RespConnection):
            self.loop_reader = LoopReader(self.reader)
            self.writer = RespConnection.from_url(self.url, self.timeout)
        self._client_lock = threading.Lock()  # the client's creation (both threads use it)
        self.stats = TierStats()

    def client(self) -> "redis.Redis | RedisCluster":
        """redis-py's client, made at the first call: a RedisCluster connects when it is made, and the
        store may be down when kvpool starts (then this raises, and the next call tries again)."""
        with self._client_lock:
            if self._client is None:
                if self.cluster:
                    self._client = cluster_client(self.url, self.timeout)
                else:
                    self._client = redis.Redis.from_url(
                        self.url,
                        socket_timeout=self.timeout,
                        socket_connect_timeout=self.timeout,
                        retry=Retry(NoBackoff(), 0),
                        health_check_interval=0,
                    )
            return self._client

    def chain(self, parent: bytes, data: bytes, page_nbytes: int, skip: int, limit: int) -> Chain:
        """The page hashes and token bytes of `data` (token bytes chained after the page hashed
        `parent`) from page `skip` on, up to page `limit`."""
        hashes = chain_hashes(parent, data, page_nbytes, limit)[skip:]
        tokens = [data[i * page_nbytes : (i + 1) * page_nbytes] for i in range(skip, skip + len(hashes))]
        return hashes, tokens

    @property
    def counts_on_loop(self) -> bool:
        """Whether count_on_loop can count (one node, read by our reader); else count(), blocking."""
        return self.loop_reader is not None

    def count(self, hashes: list[bytes]) -> int:
        """How many of the pages `hashes`, from the first, the store holds (pipelined EXISTS in batches
        of COUNT_BATCH keys, then twice that, ..., stopping at the first short one; nothing refreshed,
        nothing checked: a restore allocates pages for these, then get_into reads them). Blocking, on
        the caller's thread. Raises the client's errors."""
        plan = self._counting(hashes)
        try:
            keys = next(plan)
            while True:
                keys = plan.send(self._exists(keys))
        except StopIteration as done:
            return int(done.value)

    async def count_on_loop(self, hashes: list[bytes]) -> int:
        """count() on the running loop, over service.tiers.resp_async (counts_on_loop: one node)."""
        assert self.loop_reader is not None
        plan = self._counting(hashes)
        try:
            keys = next(plan)
            while True:
                keys = plan.send(await self.loop_reader.exists(keys))
        except StopIteration as done:
            return int(done.value)

    def _counting(self, hashes: list[bytes]) -> Generator[list[bytes], list[int], int]:
        """count()'s batches and what their replies mean, once for both ways of asking: yields each
        batch's keys, is sent their EXISTS replies, returns the count."""
        num, start, size = 0, 0, COUNT_BATCH
        while start < len(hashes):
            replies = yield [key.encode() for key in self._keys(hashes[start : start + size])]
            start, size = start + size, 2 * size
            self.stats.errors += REDIRECTED in replies  # the slot moved (a resharding or failover)
            held = next((i for i, reply in enumerate(replies) if reply != 1), len(replies))
            num += held
            if held < len(replies):
                break
        return num

    def _exists(self, keys: list[bytes]) -> list[int]:
        if self.reader is None:
            pipe = self.client().pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            replies: list[int] = pipe.execute()
            return replies
        self.reader.send_keyed(b"EXISTS", keys)
        return [self.reader.read_int() for _ in keys]

    @property
    def reads_on_loop(self) -> bool:
        """Whether get_into_on_loop can read (one node over plain TCP or a unix socket, read by our
        reader); else get_into(), blocking, on the read thread (TLS, a cluster, redis-py)."""
        return self.loop_reader is not None and self.loop_reader.reads_on_loop

    def get_into(self, hashes: list[bytes], tokens: list[bytes], pages: Sequence[Sequence[memoryview]]) -> int:
        """The entries of `hashes` (token bytes `tokens`), each page's bytes received into `pages[i]`
        (its parts in turn: a pool page's K/V then its scales), each checked as it arrives; returns how
        many, from the first, are intact. What lies in the pages after those is garbage: never to be
        used. Pipelined GETEXs in batches (read_batch()), the next batch sent before the replies to
        the current one are read (two in flight), no batch sent after the first bad entry (_getting);
        blocking, on the caller's thread (the read thread), not the loop. Each read refreshes the TTL
        of what it finds. Raises the client's errors (OSError, redis or RESP errors)."""
        hashes = hashes[: len(pages)]
        if not hashes:
            return 0
        if self.reader is None:
            return self._get_into_redispy(hashes, tokens, pages)
        reader = self.reader
        plan = self._getting(hashes, tokens, pages)
        try:
            step = next(plan)
            while True:
                if isinstance(step, Send):
                    reader.send_getex(step.keys, self.ttl_s)
                    step = plan.send(0)
                else:
                    step = plan.send(reader.read_value(step))
        except StopIteration as done:
            return int(done.value)

    async def get_into_on_loop(
        self, hashes: list[bytes], tokens: list[bytes], pages: Sequence[Sequence[memoryview]]
    ) -> int:
        """get_into() on the running loop (reads_on_loop), over a non-blocking socket of
        service.tiers.resp_async's LoopReader: each value received straight into its page with
        loop.sock_recv_into, each op bounded by the timeout; any failure closes that socket and raises."""
        assert self.loop_reader is not None and self.loop_reader.reads_on_loop
        hashes = hashes[: len(pages)]
        if not hashes:
            return 0
        plan = self._getting(hashes, tokens, pages)
        async with self.loop_reader.socket() as conn:
            waited = conn.waited_s
            try:
                step = next(plan)
                while True:
                    if isinstance(step, Send):
                        await conn.send_getex(step.keys, self.ttl_s)
                        # A turn for the loop's other work: while the store keeps the bytes coming, receiving
                        # and checking values never yields, so a long restore holds the loop a batch at a time.
                        await asyncio.sleep(0)
                        step = plan.send(0)
                    else:
                        step = plan.send(await conn.read_value(step))
            except StopIteration as done:
                return int(done.value)
            finally:
                self.stats.load_wait_seconds += conn.waited_s - waited

    def _getting(
        self, hashes: list[bytes], tokens: list[bytes], pages: Sequence[Sequence[memoryview]]
    ) -> Generator["Send | list[memoryview]", int, int]:
        """get_into's batches and what their replies mean, once for both drivers: yields Send(keys) for
        each batch of GETEXs to send (sent back 0), and the buffers each next value is to be received
        into (sent back its size, or MISSING, REDIRECTED, WRONG_TYPE); returns how many are intact.
        Values after a bad one are read off into scratch (the stream left clean); counts rejected
        entries and redirects in stats."""
        header = bytearray(self.entries.header_nbytes(hashes[0], tokens[0]))
        checksum = bytearray(self.entries.seal.tag_nbytes)
        value_nbytes = len(header) + self.page_nbytes + len(checksum)
        scratch = [memoryview(bytearray(value_nbytes))]  # values after a bad one: read off, not kept
        batch = read_batch(self.page_nbytes)
        batches = range(0, len(hashes), batch)
        sent = num = 0
        intact = True
        for k, start in enumerate(batches):
            while intact and sent < min(k + IN_FLIGHT, len(batches)):
                keys = self._keys(hashes[batches[sent] : batches[sent] + batch])
                yield Send([key.encode() for key in keys])
                sent += 1
            if k >= sent:
                break
            redirected = False
            for i in range(start, min(start + batch, len(hashes))):
                parts = [memoryview(header), *pages[i], memoryview(checksum)] if intact else scratch
                n = yield parts
                redirected |= n == REDIRECTED
                if intact:  # checked as it arrives, while it is in the cache
                    intact = n == value_nbytes and self.entries.intact(header, pages[i], checksum, hashes[i], tokens[i])
                    if not intact and (n >= 0 or n == WRONG_TYPE):
                        self.stats.rejected += 1  # (a wrong size was not kept: read into a scratch buffer)
                    num += intact
            self.stats.errors += redirected
        return num

    def _get_into_redispy(self, hashes: list[bytes], tokens: list[bytes], pages: Sequence[Sequence[memoryview]]) -> int:
        """get_into through redis-py (a cluster or TLS options the reader does not handle): its values
        are bytes, checked, then copied into the pages."""
        num, batch = 0, read_batch(self.page_nbytes)
        for start in range(0, len(hashes), batch):
            pipe = self.client().pipeline(transaction=False)
            for key in self._keys(hashes[start : start + batch]):
                pipe.getex(key, ex=self.ttl_s)
            # A key of another type answers -WRONGTYPE: an error object among the values, a bad entry.
            values: list[bytes | redis.ResponseError | None] = pipe.execute(raise_on_error=False)
            for i, value in enumerate(values, start):
                if isinstance(value, redis.ResponseError) and not str(value).startswith("WRONGTYPE"):
                    raise value
                entry = value if isinstance(value, bytes) else None
                data = self.entries.decode(entry, hashes[i], tokens[i], self.page_nbytes)
                if data is None:
                    self.stats.rejected += value is not None
                    return num
                offset = 0
                for part in pages[i]:
                    part[:] = data.data[offset : offset + len(part)]
                    offset += len(part)
                num += 1
        return num

    def _keys(self, hashes: list[bytes]) -> list[str]:
        return [self.entries.key(h) for h in hashes]

    def put(self, hashes: list[bytes], token_bytes: list[bytes], data: np.ndarray) -> int:
        """SET each page (a row of `data`) with the TTL, pipelined (one round trip); returns bytes sent.
        Blocking, on the caller's thread (the write thread). One node read by our reader: over a
        connection of its own (self.writer), each value sent from its row as it lies (no value built:
        ~30 % less CPU than redis-py's pipeline); a cluster or redis-py's reads: redis-py. Raises the
        client's errors, or RespError for a SET the store refused (the others are written)."""
        values = [self.entries.parts(h, t, data[i].data) for i, (h, t) in enumerate(zip(hashes, token_bytes))]
        sent = sum(memoryview(part).nbytes for value in values for part in value)
        if self.writer is None:
            pipe = self.client().pipeline(transaction=False)
            for page_hash, value in zip(hashes, values):
                pipe.set(self.entries.key(page_hash), b"".join(value), ex=self.ttl_s)
            pipe.execute()
            return sent
        ex = [b"EX"], [str(self.ttl_s).encode()]
        keys = [key.encode() for key in self._keys(hashes)]
        self.writer.drop_if_closed()  # (idle since the last batch: the store may have restarted)
        self.writer.send_parts([([b"SET"], [key], value, *ex) for key, value in zip(keys, values)])
        refused = [line for line in [self.writer.read_status() for _ in keys] if line is not None]
        if refused:
            raise RespError(f"SET: {refused[0][:200]!r} ({len(refused)} of {len(keys)} refused)")
        return sent

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        if self.loop_reader is not None:
            self.loop_reader.close()
        if self.writer is not None:
            self.writer.close()
        if self._client is not None:
            self._client.close()
