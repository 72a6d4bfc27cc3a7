"""KV events of the node's tier (KVPOOL_SPILL=host|disk), read by a real ZeroMQ subscriber from a real
`kvpool serve` (page 4, 16 pages; a tier of 4 pages): the exact events when cached pages are evicted
into the tier, when the tier evicts its own, and when a restore brings pages back to the device."""

import time
from typing import Any

import pytest

from service.core.hashing import root_hash
from tests.events.conftest import BlockRemoved, block_stored, chain, events_env, put_prompt

PAGE = 4
TAG = root_hash("")[:8].hex()
MEDIUM = {"host": "CPU", "disk": "STORAGE"}  # below a CPU pool, whose own events say "GPU" as vLLM's CPU build


def stored(hashes: list[Any], parent: Any, tokens: list[int], medium: str) -> Any:
    return block_stored(hashes, parent, tokens, medium, PAGE, TAG)


def removed(hashes: list[Any], medium: str) -> Any:
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=0)


def evict_all(c: Any) -> None:
    seq = c.post("/v1/sequences", json={}).json()["seq_id"]
    assert c.post(f"/v1/sequences/{seq}/append", json={"num_tokens": 16 * PAGE}).status_code == 200
    assert c.delete(f"/v1/sequences/{seq}").status_code == 200


def settle(c: Any, bytes_out: int) -> None:
    """Wait until the tier has written `bytes_out` bytes (the spills' copies have landed)."""
    deadline = time.monotonic() + 10
    while c.get("/v1/pool").json()["tiers"][0]["bytes_out"] < bytes_out:
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_tier_events_on_spill_tier_eviction_and_restore(
    start_server: Any, subscribe: Any, tmp_path: Any, tier: str
) -> None:
    record = 2048 if tier == "host" else 2048 + 64
    env = events_env(KVPOOL_SPILL=tier, KVPOOL_SPILL_BYTES=str(4 * record), KVPOOL_SPILL_PATH=str(tmp_path))
    server = start_server(env)
    sub = subscribe(env)
    c, medium = server.client, MEDIUM[tier]
    a, b = list(range(100, 113)), list(range(200, 213))  # 3 full pages + 1 token each
    ha, hb = chain(a, PAGE), chain(b, PAGE)

    put_prompt(server, a)
    assert sub.events() == [stored(ha, None, a[:12], "GPU")]

    # Evicted from the device (tail first, the LRU order), copied down: the device's BlockRemoved,
    # then, once the copies land, one BlockStored of the tier's medium for the chain, from its root.
    evict_all(c)
    settle(c, 3 * 2048)
    assert sub.events() == [removed(ha[::-1], "GPU"), stored(ha, None, a[:12], medium)]

    # A restore: the pages come back through the device's commit (BlockStored "GPU", at the root);
    # the tier keeps its copies (no event of its own).
    created = c.post("/v1/sequences", json={"token_ids": a}).json()
    assert created["cached_tokens"] == 12
    assert c.delete(f"/v1/sequences/{created['seq_id']}").status_code == 200
    assert sub.events() == [stored(ha, None, a[:12], "GPU")]

    # b's pages spill into a tier of 4 slots holding a's 3: the tier drops its 2 oldest (a's pages
    # evicted by the device again made them the newest in a2, a1, a0 order: a2 and a1 go).
    put_prompt(server, b)
    evict_all(c)
    settle(c, 6 * 2048)
    assert sub.events() == [
        stored(hb, None, b[:12], "GPU"),
        removed([*ha[::-1], *hb[::-1]], "GPU"),
        removed([ha[2], ha[1]], medium),
        stored(hb, None, b[:12], medium),
    ]
    assert c.get("/v1/pool").json()["tiers"][0]["entries"] == 4
    # What the events say the tier holds is what it restores: a0 and b's 3 pages.
    assert c.post("/v1/prefix/match", json={"token_ids": a}).json()["tier_pages"] == 1
    assert c.post("/v1/prefix/match", json={"token_ids": b}).json()["tier_pages"] == 3


def test_a_chain_past_the_root_names_its_parent(start_server: Any, subscribe: Any, tmp_path: Any) -> None:
    env = events_env(KVPOOL_SPILL="host", KVPOOL_SPILL_BYTES=str(8 * 2048))
    server = start_server(env)
    sub = subscribe(env)
    c = server.client
    a = list(range(100, 113))
    ha = chain(a, PAGE)
    put_prompt(server, a)
    # Hold the first page (a sequence on it), so that only pages 1 and 2 are evicted and spilled.
    held = c.post("/v1/sequences", json={"token_ids": a[:5]}).json()
    assert held["cached_tokens"] == 4
    seq = c.post("/v1/sequences", json={}).json()["seq_id"]
    # (the held sequence uses 1 page: its create took the cached one only; 13 free, then 2 evicted)
    assert c.post(f"/v1/sequences/{seq}/append", json={"num_tokens": 15 * PAGE}).status_code == 200
    settle(c, 2 * 2048)
    assert sub.events() == [
        stored(ha, None, a[:12], "GPU"),
        removed([ha[2], ha[1]], "GPU"),
        stored(ha[1:], ha[0], a[4:12], "CPU"),
    ]
