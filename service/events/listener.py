"""The allocator's CacheListener for KV events, and the conversion of its calls into vLLM's events.

The listener runs inside the allocator's calls, on the event loop: it only puts a tuple of what the
allocator handed it (arrays it may keep: fancy-indexed copies; immutable bytes) on the publisher's
queue. `EventMaker`, run on the publisher thread, builds the events:

  - a run of pages registered by one commit -> one BlockStored (as vLLM groups a request's newly full
    blocks): block_hashes = the pages' hashes, token_ids = their token ids (page_size each),
    block_size = page_size, medium "GPU" (the pool, on any device: wire.py), group_idx 0, lora None;
  - the first page of a sequence has parent_block_hash None (kvpool chains it from a per-tenant root
    hash, not from a page: consumers see a chain start, as vLLM's first block); its extra_keys entry
    is (tenant tag,), where the tag is the first 8 bytes, hex, of that root hash, sha256("kvpool-prefix-v1\\0"
    || tenant [|| "\\0" || cache_salt]): it tells tenants (and cache salts) apart without naming them, as
    vLLM puts cache_salt in its first block's extra keys; every other entry is None;
  - pages evicted, or dropped by a reset -> BlockRemoved of their hashes;
  - a reset that leaves no page registered -> AllBlocksCleared;
  - the node's tier below the device (service/tiers), as vLLM's offloading connector publishes its
    CPU tier: pages whose copy landed in the tier -> BlockStored with the tier's medium (each chain of
    them one event, with its own parent and token ids, from the tier entry's key), pages the tier
    dropped (its LRU eviction, or an entry found bad) -> BlockRemoved with that medium. A chain that
    starts at a root the device's events named (a first page) gets parent None and the tenant tag, as
    the device's event did; the roots seen are remembered (up to MAX_ROOTS, then forgotten at once).

Hashes are kvpool's page hashes (service.core.hashing), in vLLM's integer form (hash_format "int", the
default, as vLLM's: a hash's last 8 bytes as a big-endian unsigned int, what Dynamo's router reads),
or as the 32 bytes of SHA-256 (hash_format "bytes").
"""

from typing import Any, Literal

import numpy as np

from service.core.allocator import PageAllocator
from service.events.publisher import EventPublisher
from service.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

HashFormat = Literal["bytes", "int"]
STORED, REMOVED, CLEARED, TIER_STORED, TIER_REMOVED = 0, 1, 2, 3, 4
TAG_BYTES = 8
MAX_ROOTS = 1 << 16  # chain roots remembered for the tier's events (a set of 32-byte hashes)


def tenant_tag(root: bytes) -> str:
    """The tag of a chain root (service.core.hashing.root_hash): what a first page's extra_keys hold."""
    return root[:TAG_BYTES].hex()


class EventListener:
    """A CacheListener that queues what it hears on a publisher (cheap: a tuple and a put)."""

    def __init__(self, put: Any) -> None:
        self.put = put

    def stored(
        self, pages: np.ndarray, hashes: np.ndarray, parent: bytes, token_bytes: bytes, at_root: bool, origin: str
    ) -> None:  # (restored pages too: they are in the device now)
        self.put((STORED, hashes, parent, token_bytes, at_root))

    def removed(self, pages: np.ndarray, hashes: np.ndarray, keys: np.ndarray) -> None:
        self.put((REMOVED, hashes))

    def cleared(self) -> None:
        self.put((CLEARED,))

    # The spill tier (service/tiers/spill.py): hashes and keys as bytes, `medium` the tier's.
    def tier_stored(self, medium: str, hashes: list[bytes], keys: list[bytes]) -> None:
        self.put((TIER_STORED, medium, hashes, keys))

    def tier_removed(self, medium: str, hashes: list[bytes]) -> None:
        self.put((TIER_REMOVED, medium, hashes))


class EventMaker:
    """Queued items -> events, on the publisher thread."""

    def __init__(self, page_size: int, medium: str, hash_format: HashFormat = "int") -> None:
        self.page_size = page_size
        self.medium = medium
        self.hash_format = hash_format
        self._roots: set[bytes] = set()  # chain roots the device's events named (publisher thread only)

    def hashes(self, hashes: np.ndarray) -> list[Any]:
        rows = _rows(hashes)
        return [int.from_bytes(h[-8:], "big") for h in rows] if self.hash_format == "int" else list(rows)

    def one_hash(self, h: bytes) -> Any:
        return int.from_bytes(h[-8:], "big") if self.hash_format == "int" else h

    def __call__(self, item: tuple[Any, ...]) -> KVCacheEvent | list[KVCacheEvent]:
        kind = item[0]
        if kind == STORED:
            _, hashes, parent, token_bytes, at_root = item
            if at_root:
                if len(self._roots) >= MAX_ROOTS:
                    self._roots.clear()
                self._roots.add(parent)
            return self.stored(self.hashes(hashes), parent, token_bytes, at_root, self.medium)
        if kind == REMOVED:
            return BlockRemoved(block_hashes=self.hashes(item[1]), medium=self.medium, group_idx=0)
        if kind == TIER_STORED:
            _, medium, hashes, keys = item
            out: list[KVCacheEvent] = []
            for run in chains(hashes, keys):
                parent, tokens = keys[run[0]][:32], b"".join(keys[i][32:] for i in run)
                run_hashes = [self.one_hash(hashes[i]) for i in run]
                out.append(self.stored(run_hashes, parent, tokens, parent in self._roots, medium))
            return out
        if kind == TIER_REMOVED:
            return BlockRemoved(block_hashes=[self.one_hash(h) for h in item[2]], medium=item[1], group_idx=0)
        return AllBlocksCleared()

    def stored(self, hashes: list[Any], parent: bytes, token_bytes: bytes, at_root: bool, medium: str) -> BlockStored:
        extra: list[tuple[Any, ...] | None] = [None] * len(hashes)
        if at_root:
            extra[0] = (tenant_tag(parent),)
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if at_root else self.one_hash(parent),
            token_ids=np.frombuffer(token_bytes, dtype="<i8").tolist(),
            block_size=self.page_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
            extra_keys=extra,
            group_idx=0,
        )


def chains(hashes: list[bytes], keys: list[bytes]) -> list[list[int]]:
    """The pages (hashes, keys: parent hash || token bytes) as chains, each in order from its first
    page: a page follows its parent when both are here (a spill comes tail first, the LRU's order)."""
    child = {k[:32]: i for i, k in enumerate(keys)}
    present, seen, out = set(hashes), set[int](), list[list[int]]()
    for i, key in enumerate(keys):
        if key[:32] in present:
            continue
        run: list[int] = []
        j: int | None = i
        while j is not None and j not in seen:
            seen.add(j)
            run.append(j)
            j = child.get(hashes[j])
        out.append(run)
    out += [[i] for i in range(len(hashes)) if i not in seen]  # (a branch: two children of one parent)
    return out


def _rows(array: np.ndarray) -> list[bytes]:
    """The rows of a C-contiguous uint8 [n, k] array as n bytes objects."""
    raw, k = np.ascontiguousarray(array).tobytes(), array.shape[1]
    return [raw[i : i + k] for i in range(0, len(raw), k)]


def start_publishing(
    allocator: PageAllocator,
    page_size: int,
    medium: str,
    endpoint: str,
    replay_endpoint: str = "",
    topic: str = "",
    buffer_batches: int = 10_000,
    buffer_bytes: int = 64 << 20,
    queue_size: int = 100_000,
    hash_format: HashFormat = "int",
) -> EventPublisher:
    """A publisher on `endpoint`, told of every change of the allocator's prefix index from now on."""
    make = EventMaker(page_size, medium, hash_format)
    publisher = EventPublisher(make, endpoint, replay_endpoint, topic, buffer_batches, buffer_bytes, queue_size)
    allocator.add_listener(EventListener(publisher.put))
    return publisher
