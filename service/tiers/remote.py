"""The shared tier: committed pages in Redis or Valkey, for every kvpool with the same URL and geometry.

Key:   kvpool:v2:<geometry>:<page hash hex>. The page hash chains from the tenant's salted root
       (service.core.hashing), so tenants never share a key; the geometry (layers, kv heads,
       head_dim, page size, dtype, FP8 scales / MLA) is in the key, so pools that differ never mix.
Value: magic || geometry || page hash || token ids (int64) || page bytes || XXH3-64 of all before it.
       A lookup knows every part but the page bytes, so it loads an entry only if that whole prefix
       is what it expects and the checksum matches; anything else is counted as rejected and ignored.
Size:  every write sets a TTL (KVPOOL_REMOTE_TTL_S), and every read that finds an entry sets it again
       (GETEX ... EX in the read itself, no extra round trip), so a prefix in use never ages out and
       the store's size is bounded by the rate of new pages times the TTL even when it is shared with
       other users and has no maxmemory policy; deploy/ also gives Valkey a maxmemory with
       allkeys-lru, the hard bound. A TTL rather than only LRU, because a hash names a prefix forever:
       a stale entry is never wrong, only useless, and the TTL lets unused geometries and tenants age out.

Writes go through redis-py (a background batch, pipelined SETs; RedisCluster on a cluster). Reads (a
lookup waits on them) go in two steps: count() asks which pages the store holds (pipelined EXISTS),
the restore allocates pool pages for those, and get_into() pipelines GETEX over service.tiers.resp,
which receives each value's page bytes straight into its pool page (on a CPU pool; a host buffer
otherwise), its header and checksum into small buffers beside, checked as it arrives; the pages are
committed only once checked. Counting first is what lets the pages be allocated before the values
come (receiving into them saves a copy of every byte) without allocating,
and evicting device pages for, what the store does not hold. One connection on redis://, rediss:// (TLS)
and unix:// URLs, one per node on
redis[s]+cluster:// (service.tiers.cluster: routing by slot, why no hash tags, redirects). rediss:// with
TLS options the reader does not handle (resp.TLS_OPTIONS) reads through redis-py's pipelines instead
(slower: its parser copies each value). Each command
is bounded by KVPOOL_REMOTE_TIMEOUT_S, no retries: a failure is counted, the tier skipped for a second,
and the next call reconnects. Needs Redis >= 6.2 (GETEX) or any Valkey.
"""

import struct
import threading
from collections.abc import Sequence

import numpy as np
import redis
import xxhash
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from service.config import Settings
from service.core.tier_index import chain_hashes
from service.tiers.cluster import ClusterReader, cluster_client, is_cluster_url
from service.tiers.resp import REDIRECTED, RespConnection
from service.tiers.stats import TierStats

MAGIC = b"kvpool-remote-v2"  # v2: XXH3-64 instead of zlib's CRC-32 (a fifth of a restore: docs/benchmarks.md)
Chain = tuple[list[bytes], list[bytes]]  # page hashes, token bytes
# Values per pipelined GETEX batch (two batches in flight; none sent after the first bad entry): about
# READ_BATCH_BYTES of them, at most READ_BATCH. Small batches keep what the store has in flight (its
# reply buffers, the socket's) in the caches, which cost redis-server less CPU per prefix and the restore
# less time (kvpool bench tiers, side by side: docs/benchmarks.md, "Figures behind the code").
READ_BATCH, READ_BATCH_BYTES = 32, 2 << 20
IN_FLIGHT = 2  # batches sent ahead of the replies being read
COUNT_BATCH = 32  # keys in the first pipelined EXISTS batch, twice as many in each next (a miss stays cheap)
CHECKSUM = struct.Struct("<Q")  # xxhash's XXH3-64, at memory speed


def read_batch(page_nbytes: int) -> int:
    return max(1, min(READ_BATCH, READ_BATCH_BYTES // page_nbytes))


def geometry(s: Settings) -> str:
    """What must match for two pools to share pages, as a key part (e.g. L4.H2.D64.P16.float32)."""
    tag = f"L{s.num_layers}.H{s.num_kv_heads}.D{s.head_dim}.P{s.page_size}.{s.dtype}"
    if s.dtype == "float8_e4m3fn":
        tag += f".g{s.quant_granularity}.{s.scale_dtype}"
    if s.mla:
        tag += f".mla{s.kv_lora_rank}"
    return tag


def page_key(geometry_tag: str, page_hash: bytes) -> str:
    return f"kvpool:v2:{geometry_tag}:{page_hash.hex()}"


def value_prefix(geometry_tag: str, page_hash: bytes, token_bytes: bytes) -> bytes:
    tag = geometry_tag.encode()
    return MAGIC + struct.pack("<H", len(tag)) + tag + page_hash + struct.pack("<I", len(token_bytes)) + token_bytes


def encode_value(prefix: bytes, data: bytes) -> bytes:
    body = prefix + data
    return body + CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_value(value: bytes | None, prefix: bytes, page_nbytes: int) -> np.ndarray | None:
    """The page bytes of `value` if it is the entry `prefix` describes, intact; else None."""
    if value is None or len(value) != len(prefix) + page_nbytes + CHECKSUM.size:
        return None
    view = memoryview(value)
    if view[: len(prefix)] != prefix:
        return None
    if CHECKSUM.unpack_from(view, len(view) - CHECKSUM.size)[0] != xxhash.xxh3_64_intdigest(view[: -CHECKSUM.size]):
        return None
    return np.frombuffer(view, dtype=np.uint8, count=page_nbytes, offset=len(prefix))


class RemoteStore:
    name = "remote"

    def __init__(self, settings: Settings, page_nbytes: int) -> None:
        self.geometry = geometry(settings)
        self.page_nbytes = page_nbytes
        self.ttl_s = settings.remote_ttl_s
        self.url, self.timeout = settings.remote_url, settings.remote_timeout_s
        self.cluster = is_cluster_url(self.url)
        self._client: redis.Redis | RedisCluster | None = None  # redis-py, made at first use (client())
        self.reader: RespConnection | ClusterReader | None = None  # None: reads through redis-py
        if self.cluster:
            self.reader = ClusterReader(self.url, self.timeout)
        elif RespConnection.supports(self.url):
            self.reader = RespConnection.from_url(self.url, self.timeout)
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

    def count(self, hashes: list[bytes]) -> int:
        """How many of the pages `hashes`, from the first, the store holds (pipelined EXISTS in batches
        of COUNT_BATCH keys, then twice that, ..., stopping at the first short one; nothing refreshed,
        nothing checked: a restore allocates pages for these, then get_into reads them). Raises the
        client's errors."""
        num, start, size = 0, 0, COUNT_BATCH
        while start < len(hashes):
            keys = self._keys(hashes[start : start + size])
            start, size = start + size, 2 * size
            if self.reader is None:
                pipe = self.client().pipeline(transaction=False)
                for key in keys:
                    pipe.exists(key)
                replies: list[int] = pipe.execute()
            else:
                self.reader.send_keyed(b"EXISTS", [key.encode() for key in keys])
                replies = [self.reader.read_int() for _ in keys]
            self.stats.errors += REDIRECTED in replies  # the slot moved (a resharding or failover)
            held = next((i for i, reply in enumerate(replies) if reply != 1), len(replies))
            num += held
            if held < len(replies):
                break
        return num

    def get_into(self, hashes: list[bytes], tokens: list[bytes], pages: Sequence[Sequence[memoryview]]) -> int:
        """The entries of `hashes` (token bytes `tokens`), each page's bytes received into `pages[i]`
        (its parts in turn: a pool page's K/V then its scales), each checked as it arrives; returns how
        many, from the first, are intact. What lies in the pages after those is garbage: never to be
        used. Pipelined GETEXs in batches (read_batch()), the next batch sent before the replies to
        the current one are read (two in flight), no batch sent after the first bad entry; on the
        caller's thread, not the loop. Each read refreshes the TTL of what it finds. Raises the
        client's errors (OSError, redis or RESP errors)."""
        hashes = hashes[: len(pages)]
        if not hashes:
            return 0
        if self.reader is None:
            return self._get_into_redispy(hashes, tokens, pages)
        reader = self.reader
        header = bytearray(len(value_prefix(self.geometry, hashes[0], tokens[0])))
        checksum = bytearray(CHECKSUM.size)
        value_nbytes = len(header) + self.page_nbytes + len(checksum)
        scratch = [memoryview(bytearray(value_nbytes))]  # values after a bad one: read off, not kept
        batch = read_batch(self.page_nbytes)
        batches = range(0, len(hashes), batch)
        sent = num = 0
        intact = True
        for k, start in enumerate(batches):
            while intact and sent < min(k + IN_FLIGHT, len(batches)):
                keys = self._keys(hashes[batches[sent] : batches[sent] + batch])
                reader.send_getex([key.encode() for key in keys], self.ttl_s)
                sent += 1
            if k >= sent:
                break
            redirected = False
            for i in range(start, min(start + batch, len(hashes))):
                parts = [memoryview(header), *pages[i], memoryview(checksum)] if intact else scratch
                n = reader.read_value(parts)
                redirected |= n == REDIRECTED
                if intact:  # checked as it arrives, while it is in the cache
                    intact = n == value_nbytes and self._intact(header, checksum, pages[i], hashes[i], tokens[i])
                    if not intact and n >= 0:
                        self.stats.rejected += 1  # (a wrong size was not kept: read into a scratch buffer)
                    num += intact
            self.stats.errors += redirected
        return num

    def _intact(
        self, header: bytearray, checksum: bytearray, parts: Sequence[memoryview], page_hash: bytes, tokens: bytes
    ) -> bool:
        """Whether a value received as header || parts || checksum is the entry of `page_hash` intact."""
        if header != value_prefix(self.geometry, page_hash, tokens):
            return False
        digest = xxhash.xxh3_64(header)
        for part in parts:
            digest.update(part)
        return bool(CHECKSUM.unpack(checksum)[0] == digest.intdigest())

    def _get_into_redispy(self, hashes: list[bytes], tokens: list[bytes], pages: Sequence[Sequence[memoryview]]) -> int:
        """get_into through redis-py (a cluster or TLS options the reader does not handle): its values
        are bytes, checked, then copied into the pages."""
        num, batch = 0, read_batch(self.page_nbytes)
        for start in range(0, len(hashes), batch):
            pipe = self.client().pipeline(transaction=False)
            for key in self._keys(hashes[start : start + batch]):
                pipe.getex(key, ex=self.ttl_s)
            values: list[bytes | None] = pipe.execute()
            for i, value in enumerate(values, start):
                data = decode_value(value, value_prefix(self.geometry, hashes[i], tokens[i]), self.page_nbytes)
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
        return [page_key(self.geometry, h) for h in hashes]

    def put(self, hashes: list[bytes], token_bytes: list[bytes], data: np.ndarray) -> int:
        """SET each page with the TTL, pipelined (one round trip); returns bytes sent."""
        pipe = self.client().pipeline(transaction=False)
        sent = 0
        for i, (page_hash, tokens) in enumerate(zip(hashes, token_bytes)):
            value = encode_value(value_prefix(self.geometry, page_hash, tokens), data[i].tobytes())
            pipe.set(page_key(self.geometry, page_hash), value, ex=self.ttl_s)
            sent += len(value)
        pipe.execute()
        return sent

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        if self._client is not None:
            self._client.close()
