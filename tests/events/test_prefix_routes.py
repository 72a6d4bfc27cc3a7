"""POST /v1/prefix/match and POST /v1/prefix_cache/reset against a real `kvpool serve` (small pool:
page 4, 16 pages): the match agrees with what a create then reports and changes nothing; the reset is
for admin tenants only; each tenant's first pages carry their own tag in the KV events."""

from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from service.config import Settings
from service.core.allocator import PageAllocator
from service.core.hashing import root_hash
from service.core.sequences import SequenceTable
from tests.conftest import Server
from tests.e2e.test_auth import ALPHA, BETA, KEYS, assert_error, bearer, occupancy
from tests.events.conftest import events_env, put_prompt

PAGE = 4


def match(server: Server, tokens: list[int], headers: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    r = server.client.post("/v1/prefix/match", json={"token_ids": tokens, **extra}, headers=headers)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def test_match_agrees_with_create_and_changes_nothing(server: Server) -> None:
    c = server.client
    a = list(range(10, 23))  # 3 full pages + 1 token
    put_prompt(server, a)
    put_prompt(server, a[:4] + [99] * 9)  # shares page 0
    cases = [
        (a, ""),
        (a[:12], ""),  # a hit never covers the last prompt token: 2 pages
        ([*a[:13], 5, 6, 7], ""),
        (a[:4] + [99] * 9, ""),
        (a[:4] + [98] * 9, ""),
        (a[:3], ""),
        ([], ""),
        (a, "salt"),
    ]
    for prompt, salt in cases:
        before, cached = occupancy_of(server), c.get("/v1/pool").json()
        got = match(server, prompt, cache_salt=salt) if salt else match(server, prompt)
        assert occupancy_of(server) == before and c.get("/v1/pool").json() == cached
        created = c.post("/v1/sequences", json={"token_ids": prompt, "cache_salt": salt or None})
        assert created.status_code == 201
        body = created.json()
        pages = body["cached_tokens"] // PAGE
        assert got == {
            "cached_tokens": body["cached_tokens"],
            "num_pages": pages,
            "device_pages": pages,
            "tier_pages": 0,
        }
        c.delete(f"/v1/sequences/{body['seq_id']}")
    assert match(server, a) == {"cached_tokens": 12, "num_pages": 3, "device_pages": 3, "tier_pages": 0}
    r = c.post("/v1/prefix/match", json={"token_ids": [-1]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
    assert c.post("/v1/prefix/match", json={"token_ids": [1], "seq_id": "x"}).status_code == 422  # unknown field
    # The metrics count creates' lookups only.
    queried = 2 * len(a) + sum(len(prompt) for prompt, _ in cases)
    assert f"kvpool_prefix_cache_queries_total {queried}.0" in c.get("/metrics").text


def occupancy_of(server: Server) -> tuple[int, int, int]:
    pool = server.client.get("/v1/pool").json()
    return pool["pages_used"], pool["pages_cached"], pool["pages_free"]


def test_match_leaves_the_eviction_order_alone(start_server: Any) -> None:
    """The same script on two servers, one of them asked to match the oldest cached prompt: the
    next eviction takes the same pages on both (a hit would have made that prompt the newest)."""
    tables = []
    for ask in (False, True):
        server = start_server()
        prompts = [[i] * 9 for i in range(5)]  # 2 full pages each: 10 pages cached, 6 free
        for p in prompts:
            put_prompt(server, p)
        if ask:
            assert match(server, prompts[0]) == {"cached_tokens": 8, "num_pages": 2, "device_pages": 2, "tier_pages": 0}
        c = server.client
        seq = c.post("/v1/sequences", json={}).json()["seq_id"]
        tables.append(c.post(f"/v1/sequences/{seq}/append", json={"num_tokens": 4 * 10}).json()["block_table"])
        assert [match(server, p)["num_pages"] for p in prompts] == [0, 0, 2, 2, 2]  # 4 evicted: the oldest
    assert tables[0] == tables[1]


def test_match_in_process_keeps_the_lru_order() -> None:
    table = SequenceTable(PageAllocator(16), PAGE)
    for i in range(3):
        seq = table.create(f"s{i}", [])
        table.append(seq.seq_id, 9, [i] * 9, True)
        table.free(seq.seq_id)
    order, refs = table.allocator.cached_pages(), table.allocator.ref_count.copy()
    assert table.prefixes.num_cached([0] * 9, "") == 2 and table.prefixes.num_cached([0] * 9, "other") == 0
    assert table.allocator.cached_pages() == order and np.array_equal(table.allocator.ref_count, refs)
    assert table.stats.prefix_query_tokens == 0


@pytest.fixture
def keyed_events(start_server: Any, subscribe: Any) -> tuple[Server, Any]:
    env = events_env(**KEYS, KVPOOL_ADMIN_TENANTS="beta")
    return start_server(env), subscribe(env)


def test_match_per_tenant_and_reset_for_admins_only(keyed_events: tuple[Server, Any]) -> None:
    server, sub = keyed_events
    c, prompt = server.client, list(range(9))
    put_prompt(server, prompt, bearer(ALPHA))
    put_prompt(server, prompt, bearer(BETA))
    assert (
        match(server, prompt, bearer(ALPHA))
        == match(server, prompt, bearer(BETA))
        == {"cached_tokens": 8, "num_pages": 2, "device_pages": 2, "tier_pages": 0}
    )
    assert match(server, [*prompt, 1], bearer(ALPHA), cache_salt="s")["cached_tokens"] == 0
    assert c.post("/v1/prefix/match", json={"token_ids": prompt}).status_code == 401
    # Each tenant's chain starts with its own tag; the hashes differ, the tokens do not.
    first = [e for e in sub.events() if e.parent_block_hash is None]
    assert [e.extra_keys[0] for e in first] == [(root_hash(t)[:8].hex(),) for t in ("alpha", "beta")]
    assert first[0].token_ids == first[1].token_ids and first[0].block_hashes != first[1].block_hashes

    before = occupancy(server)
    assert_error(c.post("/v1/prefix_cache/reset", headers=bearer(ALPHA)), 403, "forbidden")
    assert occupancy(server) == before == (0, 4, 12)
    r = c.post("/v1/prefix_cache/reset", headers=bearer(BETA))
    assert r.status_code == 200 and r.json() == {"dropped_pages": 4, "all_cleared": True}
    assert occupancy(server) == (0, 0, 16) and match(server, prompt, bearer(ALPHA))["cached_tokens"] == 0
    assert [type(e).__name__ for e in sub.events()] == ["AllBlocksCleared"]


def test_admin_tenants_need_keys() -> None:
    with pytest.raises(ValidationError, match="KVPOOL_ADMIN_TENANTS names tenants but KVPOOL_API_KEYS is empty"):
        Settings(admin_tenants="ops")
    with pytest.raises(ValidationError, match=r"KVPOOL_ADMIN_TENANTS names \['ops'\], which have no key"):
        Settings(admin_tenants="ops", api_keys=f"alpha:{ALPHA}")
    with pytest.raises(ValidationError, match="KVPOOL_KV_EVENTS_REPLAY_ENDPOINT needs"):
        Settings(kv_events_replay_endpoint="tcp://*:5558")
    with pytest.raises(ValidationError, match="a ZeroMQ endpoint is"):
        Settings(kv_events_endpoint="localhost:5557")
    assert Settings(admin_tenants="alpha", api_keys=f"alpha:{ALPHA}").admin_tenant_names == {"alpha"}
