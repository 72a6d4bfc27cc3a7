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
lookup waits on them) pipeline GETEX over service.tiers.resp, which receives each value straight into
its row of one array: one connection on redis://, rediss:// (TLS) and unix:// URLs, one per node on
redis[s]+cluster:// (service.tiers.cluster: routing by slot, why no hash tags, redirects). rediss:// with
TLS options the reader does not handle (resp.TLS_OPTIONS) reads through redis-py's pipelines instead
(slower: its parser copies each value). Each command
is bounded by KVPOOL_REMOTE_TIMEOUT_S, no retries: a failure is counted, the tier skipped for a second,
and the next call reconnects. Needs Redis >= 6.2 (GETEX) or any Valkey.
"""

import hashlib
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
from service.tiers.cluster import ClusterReader, cluster_client, is_cluster_url
from service.tiers.resp import REDIRECTED, RespConnection
from service.tiers.stats import TierStats

MAGIC = b"kvpool-remote-v2"  # v2: XXH3-64 instead of zlib's CRC-32 (6.8 GB/s here: a fifth of a restore)
Page = np.ndarray
READ_BATCH = 32  # keys per pipelined batch: a lookup stops at the first batch that comes back short
FREE_BUFFER_BYTES = 96 << 20  # receive buffers kept for reuse (a 4,096-token prefix of an 8-layer model: 8 x 8.4 MB)
CHECKSUM = struct.Struct("<Q")  # xxhash's XXH3-64, at memory speed


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


def decode_value(value: bytes | np.ndarray | None, prefix: bytes, page_nbytes: int) -> np.ndarray | None:
    """The page bytes of `value` (bytes, or a contiguous uint8 row) if it is the entry `prefix`
    describes, intact; else None."""
    if value is None or len(value) != len(prefix) + page_nbytes + CHECKSUM.size:
        return None
    view = value.data.cast("B") if isinstance(value, np.ndarray) else memoryview(value)
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
        self._free: list[np.ndarray] = []  # receive buffers for reuse (release())
        self._lock = threading.Lock()  # the free buffers
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

    def get(
        self, parent: bytes, data: bytes, page_nbytes: int, skip: int, limit: int
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The pages of `data` (token bytes chained after the page hashed `parent`) from page `skip` on,
        up to `limit` pages, as long as the store holds them intact, and the buffers they lie in (for
        release() once copied). Pipelined GETEXs in batches of READ_BATCH keys, the next batch sent
        before the replies to the current one are read (two in flight), stopping at the first batch that
        comes back short; on the caller's thread, not the loop. Each read refreshes the TTL of what it
        finds. Raises the client's errors (OSError, redis or RESP errors)."""
        hashes: list[bytes] = []
        tokens: list[bytes] = []
        for i in range(min(limit, len(data) // page_nbytes)):
            page = data[i * page_nbytes : (i + 1) * page_nbytes]
            parent = hashlib.sha256(parent + page).digest()
            if i >= skip:
                hashes.append(parent)
                tokens.append(page)
        batches = [(hashes[s : s + READ_BATCH], tokens[s : s + READ_BATCH]) for s in range(0, len(hashes), READ_BATCH)]
        found: list[np.ndarray] = []
        if self.reader is None or not batches:
            for batch_hashes, batch_tokens in batches:
                pipe = self.client().pipeline(transaction=False)
                for key in self._keys(batch_hashes):
                    pipe.getex(key, ex=self.ttl_s)
                values: list[bytes | None] = pipe.execute()
                got = self._check(values, batch_hashes, batch_tokens)
                found += got
                if len(got) < len(batch_hashes):
                    break
            return found, []
        return self._get_pipelined(batches)

    def _get_pipelined(self, batches: list[tuple[list[bytes], list[bytes]]]) -> tuple[list[Page], list[Page]]:
        reader = self.reader
        assert reader is not None
        first = value_prefix(self.geometry, batches[0][0][0], batches[0][1][0])
        value_nbytes = len(first) + self.page_nbytes + CHECKSUM.size
        found: list[np.ndarray] = []
        buffers: list[np.ndarray] = []
        sent = 0
        try:
            for k, (batch_hashes, batch_tokens) in enumerate(batches):
                while sent < min(k + 2, len(batches)):
                    reader.send_getex([key.encode() for key in self._keys(batches[sent][0])], self.ttl_s)
                    sent += 1
                rows = self._buffer(value_nbytes)
                buffers.append(rows)
                intact, redirected = True, False
                for i in range(len(batch_hashes)):
                    n = reader.read_value(rows[i])
                    redirected |= n == REDIRECTED  # the slot moved (a resharding or failover): not loaded
                    if intact:  # checked as it arrives, while it is in the cache (after the batch, it was not)
                        # (a value of the wrong size was not kept: b"" stands for it, which decode_value rejects)
                        value = rows[i] if n == value_nbytes else (None if n < 0 else b"")
                        got = self._check_one(value, batch_hashes[i], batch_tokens[i])
                        intact = got is not None
                        if got is not None:
                            found.append(got)
                self.stats.errors += redirected
                if not intact:
                    break
            for pending in batches[k + 1 : sent]:  # the reply sent ahead and not needed: read it off
                rows = self._buffer(value_nbytes)
                buffers.append(rows)
                for i in range(len(pending[0])):
                    reader.read_value(rows[i])
        except BaseException:
            self.release(buffers)
            raise
        return found, buffers

    def _keys(self, hashes: list[bytes]) -> list[str]:
        return [page_key(self.geometry, h) for h in hashes]

    def _check(
        self, values: Sequence[bytes | np.ndarray | None], hashes: list[bytes], token_bytes: list[bytes]
    ) -> list[np.ndarray]:
        """The leading run of `values` that are the entries of `hashes` intact (counting a wrong one)."""
        found: list[np.ndarray] = []
        for value, page_hash, tokens in zip(values, hashes, token_bytes):
            data = self._check_one(value, page_hash, tokens)
            if data is None:
                break
            found.append(data)
        return found

    def _check_one(self, value: bytes | np.ndarray | None, page_hash: bytes, tokens: bytes) -> np.ndarray | None:
        """The page bytes of `value` if it is the entry of `page_hash` intact, else None (a wrong one counted)."""
        data = decode_value(value, value_prefix(self.geometry, page_hash, tokens), self.page_nbytes)
        if data is None and value is not None:
            self.stats.rejected += 1
        return data

    def _buffer(self, value_nbytes: int) -> np.ndarray:
        """A receive buffer of READ_BATCH values: a released one if any (its pages already faulted in)."""
        with self._lock:
            while self._free:
                rows = self._free.pop()
                if rows.shape[1] == value_nbytes:
                    return rows
        return np.empty((READ_BATCH, value_nbytes), dtype=np.uint8)

    def release(self, buffers: list[np.ndarray]) -> None:
        """Buffers from get() whose pages are no longer needed (copied in, or dropped); kept for reuse up
        to FREE_BUFFER_BYTES."""
        with self._lock:
            for rows in buffers:
                if (len(self._free) + 1) * rows.nbytes <= FREE_BUFFER_BYTES:
                    self._free.append(rows)

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
