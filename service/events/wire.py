"""vLLM's KV event structs (vllm/distributed/kv_events.py, 0.32), declared the same way, so that the
bytes match: msgspec msgpack, the batch array-like, the events tagged by class name, defaults omitted.

Fields and their order are vLLM's; a decoder built from vLLM's own `KVEventBatch` reads what kvpool
publishes (tests/events decode with it where vLLM is installed).
"""

from typing import Any

import msgspec

ExternalBlockHash = bytes | int  # vllm.v1.core.kv_cache_utils.ExternalBlockHash

# The media are vLLM's three, naming tiers as vLLM's engines do: "GPU" for the engine's own KV cache
# (vLLM's CPU build publishes its cache, in host memory, as "GPU" too), "CPU" for the host-memory
# tier below it, "STORAGE" for a file-system tier. So the pool is "GPU" on any device, and the node's
# tier (service/tiers/spill.py, disk.py) "CPU" (host) or "STORAGE" (disk): consumers (Dynamo's indexer keeps
# one index per medium) never take a tier's pages, or their removal, for the pool's.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events; `tag=True`: each is encoded with its class name as the tag."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
