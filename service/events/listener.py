"""The allocator's CacheListener for KV events, and the conversion of its calls into vLLM's events.

The listener runs inside the allocator's calls, on the event loop: it only puts a tuple of what the
allocator handed it (arrays it may keep: fancy-indexed copies; immutable bytes) on the publisher's
queue. `EventMaker`, run on the publisher thread, builds the events:

  - a run of pages registered by one commit -> one BlockStored (as vLLM groups a request's newly full
    blocks): block_hashes = the pages' hashes, token_ids = their token ids (page_size each),
    block_size = page_size, medium "GPU" or "CPU" by the pool's device, group_idx 0, lora None;
  - the first page of a sequence has parent_block_hash None (kvpool chains it from a per-tenant root
    hash, not from a page: consumers see a chain start, as vLLM's first block); its extra_keys entry
    is (tenant tag,), where the tag is the first 8 bytes, hex, of that root hash, sha256("kvpool-prefix-v1\\0"
    || tenant [|| "\\0" || cache_salt]): it tells tenants (and cache salts) apart without naming them, as
    vLLM puts cache_salt in its first block's extra keys; every other entry is None;
  - pages evicted, or dropped by a reset -> BlockRemoved of their hashes;
  - a reset that leaves no page registered -> AllBlocksCleared.

Hashes are kvpool's page hashes (service.core.hashing): 32 bytes of SHA-256 (hash_format "bytes"), or
vLLM's integer form of a hash (hash_format "int": its last 8 bytes as a big-endian unsigned int, what
vLLM publishes by default and what Dynamo's router reads).
"""

from typing import Any, Literal

import numpy as np

from service.core.allocator import PageAllocator
from service.events.publisher import EventPublisher
from service.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

HashFormat = Literal["bytes", "int"]
STORED, REMOVED, CLEARED = 0, 1, 2
TAG_BYTES = 8


def tenant_tag(root: bytes) -> str:
    """The tag of a chain root (service.core.hashing.root_hash): what a first page's extra_keys hold."""
    return root[:TAG_BYTES].hex()


class EventListener:
    """A CacheListener that queues what it hears on a publisher (cheap: a tuple and a put)."""

    def __init__(self, put: Any) -> None:
        self.put = put

    def stored(self, pages: np.ndarray, hashes: np.ndarray, parent: bytes, token_bytes: bytes, at_root: bool) -> None:
        self.put((STORED, hashes, parent, token_bytes, at_root))

    def removed(self, pages: np.ndarray, hashes: np.ndarray, keys: np.ndarray) -> None:
        self.put((REMOVED, hashes))

    def cleared(self) -> None:
        self.put((CLEARED,))


class EventMaker:
    """Queued items -> events, on the publisher thread."""

    def __init__(self, page_size: int, medium: str, hash_format: HashFormat = "bytes") -> None:
        self.page_size = page_size
        self.medium = medium
        self.hash_format = hash_format

    def hashes(self, hashes: np.ndarray) -> list[Any]:
        rows = _rows(hashes)
        return [int.from_bytes(h[-8:], "big") for h in rows] if self.hash_format == "int" else list(rows)

    def one_hash(self, h: bytes) -> Any:
        return int.from_bytes(h[-8:], "big") if self.hash_format == "int" else h

    def __call__(self, item: tuple[Any, ...]) -> KVCacheEvent:
        kind = item[0]
        if kind == STORED:
            _, hashes, parent, token_bytes, at_root = item
            n = len(hashes)
            extra: list[tuple[Any, ...] | None] = [None] * n
            if at_root:
                extra[0] = (tenant_tag(parent),)
            return BlockStored(
                block_hashes=self.hashes(hashes),
                parent_block_hash=None if at_root else self.one_hash(parent),
                token_ids=np.frombuffer(token_bytes, dtype="<i8").tolist(),
                block_size=self.page_size,
                lora_id=None,
                medium=self.medium,
                lora_name=None,
                extra_keys=extra,
                group_idx=0,
            )
        if kind == REMOVED:
            return BlockRemoved(block_hashes=self.hashes(item[1]), medium=self.medium, group_idx=0)
        return AllBlocksCleared()


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
    buffer_size: int = 10_000,
    queue_size: int = 100_000,
    hash_format: HashFormat = "bytes",
) -> EventPublisher:
    """A publisher on `endpoint`, told of every change of the allocator's prefix index from now on."""
    publisher = EventPublisher(
        EventMaker(page_size, medium, hash_format), endpoint, replay_endpoint, topic, buffer_size, queue_size
    )
    allocator.listeners.append(EventListener(publisher.put))
    return publisher
