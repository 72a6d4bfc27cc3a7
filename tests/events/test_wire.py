"""kvpool's event structs encode to the same bytes as vLLM's, and each side decodes the other's."""

import time

import msgspec
import numpy as np
import pytest

from service.core.hashing import page_hash, root_hash, token_bytes
from service.events import wire
from service.events.listener import CLEARED, REMOVED, STORED, TIER_STORED, EventMaker, chains, tenant_tag

H = [bytes([i]) * 32 for i in range(1, 4)]


def batch_of(mod: object, hashes: list[bytes | int]) -> object:
    m = mod
    events = [
        m.BlockStored(  # type: ignore[attr-defined]
            block_hashes=hashes[:2],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=2,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[("0123456789abcdef",), None],
            group_idx=0,
        ),
        m.BlockStored(  # type: ignore[attr-defined]
            block_hashes=hashes[2:],
            parent_block_hash=hashes[1],
            token_ids=[5, 2**40],
            block_size=2,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[None],
            group_idx=0,
        ),
        m.BlockRemoved(block_hashes=hashes[:1], medium="GPU", group_idx=0),  # type: ignore[attr-defined]
        m.AllBlocksCleared(),  # type: ignore[attr-defined]
    ]
    return m.KVEventBatch(ts=1700000000.25, events=events, data_parallel_rank=0)  # type: ignore[attr-defined]


@pytest.mark.parametrize("hashes", [H, [int.from_bytes(h[-8:], "big") for h in H]], ids=["bytes", "int"])
def test_same_bytes_as_vllm(hashes: list[bytes | int]) -> None:
    vllm_events = pytest.importorskip("vllm.distributed.kv_events")
    ours = msgspec.msgpack.encode(batch_of(wire, hashes))
    assert ours == msgspec.msgpack.encode(batch_of(vllm_events, hashes))
    decoded = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(ours)
    assert decoded == batch_of(vllm_events, hashes)
    assert msgspec.msgpack.Decoder(wire.KVEventBatch).decode(ours) == batch_of(wire, hashes)
    # Field names, order and defaults are vLLM's, struct by struct.
    for name in ("EventBatch", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch"):
        theirs, mine = getattr(vllm_events, name), getattr(wire, name)
        assert mine.__struct_fields__ == theirs.__struct_fields__, name
        assert mine.__struct_defaults__ == theirs.__struct_defaults__, name
        assert config(mine) == config(theirs), name


def config(struct: type) -> dict[str, object]:
    cfg = struct.__struct_config__  # type: ignore[attr-defined]
    return {k: getattr(cfg, k) for k in dir(cfg) if not k.startswith("_")}


def test_layout_without_vllm() -> None:
    """What the bytes are, decoded as plain msgpack: an array batch of tagged maps, defaults omitted."""
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch_of(wire, H)))
    ts, events, rank = raw
    assert (ts, rank) == (1700000000.25, 0)
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": H[:2],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [["0123456789abcdef"], None],
        "group_idx": 0,
    }
    assert events[2] == {"type": "BlockRemoved", "block_hashes": H[:1], "medium": "GPU", "group_idx": 0}
    assert events[3] == {"type": "AllBlocksCleared"}


def test_event_maker_builds_vllm_shapes() -> None:
    hashes = np.frombuffer(b"".join(H), dtype=np.uint8).reshape(3, 32)
    tokens = np.arange(6, dtype="<i8").tobytes()
    root = root_hash("tenant-a")
    make = EventMaker(page_size=2, medium="CPU", hash_format="bytes")
    first = make((STORED, hashes, root, tokens, True))
    assert first.block_hashes == H and first.parent_block_hash is None and first.token_ids == list(range(6))
    assert first.extra_keys == [(tenant_tag(root),), None, None] and tenant_tag(root) == root[:8].hex()
    later = make((STORED, hashes[1:], H[0], tokens[16:], False))
    assert later.parent_block_hash == H[0] and later.extra_keys == [None, None] and later.token_ids == [2, 3, 4, 5]
    assert make((REMOVED, hashes[:1])) == wire.BlockRemoved(block_hashes=H[:1], medium="CPU", group_idx=0)
    assert make((CLEARED,)) == wire.AllBlocksCleared()
    as_ints = EventMaker(page_size=2, medium="GPU", hash_format="int")
    event = as_ints((STORED, hashes[1:], H[0], tokens[16:], False))
    # vLLM's int form (kv_cache_utils.maybe_convert_block_hash): the low 64 bits of the big-endian hash.
    assert event.block_hashes == [int.from_bytes(h, "big") & (2**64 - 1) for h in H[1:]]
    assert event.parent_block_hash == int.from_bytes(H[0], "big") & (2**64 - 1)
    assert tenant_tag(root_hash("tenant-b")) != tenant_tag(root) != tenant_tag(root_hash("tenant-a", "salt"))
    assert time.time() > 0


def test_tier_pages_make_one_event_per_chain_from_its_first_page() -> None:
    root = root_hash("")
    keys, hashes, parent = [], [], root
    for tokens in ([1, 2], [3, 4], [5, 6]):
        keys.append(parent + token_bytes(tokens))
        parent = page_hash(parent, token_bytes(tokens))
        hashes.append(parent)
    other = root_hash("x")
    keys.append(other + token_bytes([7, 7]))
    hashes.append(page_hash(other, token_bytes([7, 7])))
    # A spill comes tail first: [2, 1, 0], then a page of another chain; a page whose parent is not
    # among them starts a chain of its own.
    order = [3, 2, 1, 0]
    assert chains([hashes[i] for i in order], [keys[i] for i in order]) == [[0], [3, 2, 1]]
    assert chains(hashes[:1] + hashes[2:3], keys[:1] + keys[2:3]) == [[0], [1]]
    maker = EventMaker(2, "CPU", "bytes")
    maker((STORED, np.frombuffer(hashes[0], dtype=np.uint8).reshape(1, 32), root, keys[0][32:], True))
    events = maker((TIER_STORED, "STORAGE", hashes[2::-1], keys[2::-1]))
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids, e.medium) for e in events] == [
        (hashes[:3], None, [1, 2, 3, 4, 5, 6], "STORAGE")  # the root is known: a chain start, tagged
    ]
    assert events[0].extra_keys == [(root[:8].hex(),), None, None]
    (event,) = maker((TIER_STORED, "STORAGE", hashes[1:2], keys[1:2]))
    assert (event.parent_block_hash, event.extra_keys) == (hashes[0], [None])
