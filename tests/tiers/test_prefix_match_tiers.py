"""POST /v1/prefix/match with the spill tier on, against a real `kvpool serve` (page 4, 16 pages):
it counts the pages the tier holds after the device's, agrees with the `cached_tokens` of the create
that follows, and changes nothing (device counts, the tier's entries and LRU order)."""

import time
from typing import Any

import pytest

from tests.events.conftest import put_prompt

PAGE = 4
NO_IDS = {"num_tokens": 16 * PAGE}  # a whole pool of pages without token ids: evicts every cached page


def spill_env(tier: str, entries: int, path: Any) -> dict[str, str]:
    record = 2048 if tier == "host" else 2048 + 64  # the small pool's page (+ the disk slot's header)
    return {"KVPOOL_SPILL": tier, "KVPOOL_SPILL_BYTES": str(entries * record), "KVPOOL_SPILL_PATH": str(path)}


def evict_all(c: Any) -> None:
    """Every cached page out of the device (into the tier), then the pool all free again."""
    seq = c.post("/v1/sequences", json={}).json()["seq_id"]
    assert c.post(f"/v1/sequences/{seq}/append", json=NO_IDS).status_code == 200
    assert c.delete(f"/v1/sequences/{seq}").status_code == 200


def wait_spilled(c: Any, entries: int) -> None:
    deadline = time.monotonic() + 10
    while c.get("/v1/pool").json()["tiers"][0]["entries"] != entries or not landed(c, entries):
        assert time.monotonic() < deadline, c.get("/v1/pool").json()["tiers"]
        time.sleep(0.02)


def landed(c: Any, entries: int) -> bool:
    return bool(c.get("/v1/pool").json()["tiers"][0]["bytes_out"] >= entries * 2048)


def match(c: Any, tokens: list[int]) -> dict[str, Any]:
    r = c.post("/v1/prefix/match", json={"token_ids": tokens})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def state(c: Any) -> tuple[Any, ...]:
    pool = c.get("/v1/pool").json()
    return pool["pages_used"], pool["pages_cached"], pool["pages_free"], pool["tiers"]


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_match_counts_the_tier_after_the_device_and_agrees_with_create(
    start_server: Any, tmp_path: Any, tier: str
) -> None:
    server = start_server(spill_env(tier, 8, tmp_path))
    c = server.client
    p = list(range(100, 117))  # 4 full pages + 1 token: a create may hit all 4
    q = list(range(300, 317))
    put_prompt(server, p)
    assert match(c, p) == {"cached_tokens": 16, "num_pages": 4, "device_pages": 4, "tier_pages": 0}
    evict_all(c)  # p's 4 pages go to the tier
    wait_spilled(c, 4)
    assert match(c, p) == {"cached_tokens": 16, "num_pages": 4, "device_pages": 0, "tier_pages": 4}
    # A create on p's first 2 pages (+1 token) brings those 2 back; the device then has 2, the tier 4.
    created = c.post("/v1/sequences", json={"token_ids": p[:9]}).json()
    assert created["cached_tokens"] == 8
    c.delete(f"/v1/sequences/{created['seq_id']}")
    put_prompt(server, q)  # another prompt, cached on the device only
    assert match(c, q)["device_pages"] == 4

    cases = [  # (prompt, device pages, tier pages), in turn: each create restores what it counts
        (p[:4] + [7] * 13, 1, 0),
        (q, 4, 0),
        ([1, 2, 3, 4, 5], 0, 0),
        (p[:13], 2, 1),  # a hit never covers the last token: 3 pages at most
        ([*p[:12], 5, 5, 5, 5, 5], 3, 0),  # the 4th page differs
        (p, 3, 1),
    ]
    for prompt, device, below in cases:
        before = state(c)
        got = match(c, prompt)
        got_again = match(c, prompt)
        assert state(c) == before  # nothing allocated, pinned or counted; the tier's entries as they were
        want = {"cached_tokens": (device + below) * PAGE, "num_pages": device + below}
        assert got == got_again == want | {"device_pages": device, "tier_pages": below}, prompt
        created = c.post("/v1/sequences", json={"token_ids": prompt})
        assert created.status_code == 201, created.text
        assert created.json()["cached_tokens"] == got["cached_tokens"], prompt
        c.delete(f"/v1/sequences/{created.json()['seq_id']}")
    # Every page of p now back on the device: nothing left to restore.
    assert match(c, p) == {"cached_tokens": 16, "num_pages": 4, "device_pages": 4, "tier_pages": 0}


def test_match_counts_only_the_tier_pages_an_allocation_could_take(start_server: Any, tmp_path: Any) -> None:
    server = start_server(spill_env("host", 8, tmp_path))
    c = server.client
    p = list(range(100, 117))
    put_prompt(server, p)
    evict_all(c)
    wait_spilled(c, 4)
    # 14 pages in use: 2 left to allocate, so a restore brings back 2 of the tier's 4 pages.
    held = c.post("/v1/sequences", json={}).json()["seq_id"]
    assert c.post(f"/v1/sequences/{held}/append", json={"num_tokens": 14 * PAGE}).status_code == 200
    assert match(c, p) == {"cached_tokens": 8, "num_pages": 2, "device_pages": 0, "tier_pages": 2}
    created = c.post("/v1/sequences", json={"token_ids": p})  # (a create takes the cached pages only)
    assert created.status_code == 201, created.text
    assert created.json()["cached_tokens"] == 8
    c.delete(f"/v1/sequences/{created.json()['seq_id']}")
    # The 2 restored pages are cached on the device now; a restore would hold them, leaving no page
    # to bring the other 2 into.
    assert c.get("/v1/pool").json()["pages_cached"] == 2
    assert match(c, p) == {"cached_tokens": 8, "num_pages": 2, "device_pages": 2, "tier_pages": 0}
    c.delete(f"/v1/sequences/{held}")
    assert match(c, p) == {"cached_tokens": 16, "num_pages": 4, "device_pages": 2, "tier_pages": 2}


def test_match_without_a_tier(start_server: Any) -> None:
    server = start_server()
    c = server.client
    p = list(range(100, 117))
    put_prompt(server, p)
    assert match(c, p) == {"cached_tokens": 16, "num_pages": 4, "device_pages": 4, "tier_pages": 0}
