"""API keys, tenants and quotas against a real `kvpool serve` subprocess (small pool: page 4, 16 pages)."""

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from tests.conftest import REPO, SMALL_POOL, Server, enc

ALPHA, ALPHA_ROTATED, BETA = "alpha-key-7f3c9b2e41d0", "alpha-key-rotated-5d2a", "beta-key-0c8e5a1f93b7"
KEYS = {"KVPOOL_API_KEYS": f"alpha:{ALPHA}, beta:{BETA}, alpha:{ALPHA_ROTATED}"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def occupancy(server: Server) -> tuple[int, int, int]:
    pool = server.client.get("/v1/pool", headers=bearer(ALPHA)).json()
    return pool["pages_used"], pool["pages_cached"], pool["pages_free"]


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    fields = {"code", "message", "details"} if code == "sequence_not_found" else {"code", "message"}
    assert set(response.json()) == {"error"} and set(response.json()["error"]) == fields


@pytest.fixture(scope="module")
def keyed() -> Iterator[Server]:
    server = Server({**SMALL_POOL, **KEYS})
    yield server
    server.stop()


def v1_operations(server: Server) -> list[tuple[str, str]]:
    """Every /v1 operation the server's OpenAPI schema lists, path parameters filled in."""
    schema = server.client.get("/openapi.json").json()
    ops = []
    for path, methods in schema["paths"].items():
        if path.startswith("/v1"):
            ops += [(method.upper(), path.replace("{seq_id}", "s1")) for method in methods]
    return [*ops, ("GET", "/v1/no-such-route")]


def test_every_v1_route_needs_a_valid_bearer_key(keyed: Server) -> None:
    c = keyed.client
    ops = v1_operations(keyed)
    assert len(ops) >= 8  # create, get, append, fork, free, step, attend, pool (+ the unknown route)
    attempts: list[tuple[dict[str, str], str]] = [
        ({}, "missing Authorization"),
        (bearer("alpha-key-7f3c9b2e41d1"), "invalid API key"),  # one character off
        (bearer(ALPHA[:-1]), "invalid API key"),
        ({"Authorization": f"Basic {ALPHA}"}, "Bearer <key>"),
        ({"Authorization": "Bearer"}, "Bearer <key>"),
        ({"X-API-Key": ALPHA}, "missing Authorization"),
    ]
    for method, path in ops:
        for headers, message in attempts:
            body = {"seq_id": "s1"} if method == "POST" else None
            r = c.request(method, path, headers=headers, json=body)
            assert_error(r, 401, "unauthorized")
            assert message in r.json()["error"]["message"], (method, path, r.text)
            assert r.headers["www-authenticate"].startswith('Bearer realm="kvpool"')
            if message == "invalid API key":
                assert 'error="invalid_token"' in r.headers["www-authenticate"]
    # Nothing the rejected requests asked for happened.
    assert_error(c.get("/v1/sequences/s1", headers=bearer(ALPHA)), 404, "sequence_not_found")
    assert occupancy(keyed) == (0, 0, 16)


def test_probes_and_docs_stay_open(keyed: Server) -> None:
    c = keyed.client
    assert c.get("/healthz").status_code == 200
    assert c.get("/readyz").status_code == 200
    assert c.get("/openapi.json").status_code == 200
    assert c.get("/docs").status_code == 200
    assert c.get("/metrics").status_code != 401  # served by the metrics module where it is mounted


def test_the_scheme_is_case_insensitive_and_every_key_of_a_tenant_works(keyed: Server) -> None:
    c = keyed.client
    r = c.post("/v1/sequences", json={"seq_id": "rot"}, headers={"Authorization": f"bearer {ALPHA}"})
    assert r.status_code == 201
    assert c.get("/v1/sequences/rot", headers=bearer(ALPHA_ROTATED)).status_code == 200
    assert_error(c.get("/v1/sequences/rot", headers=bearer(BETA)), 404, "sequence_not_found")
    assert c.delete("/v1/sequences/rot", headers=bearer(ALPHA_ROTATED)).json() == {"seq_id": "rot", "freed_pages": 0}


def test_a_sequence_and_its_prefix_cache_belong_to_its_tenant(start_server: Any) -> None:
    server = start_server(KEYS)
    c = server.client
    a, b = bearer(ALPHA), bearer(BETA)
    torch.manual_seed(3)
    k, v = torch.randn(2, 6, 2, 16), torch.randn(2, 6, 2, 16)
    assert c.post("/v1/sequences", json={"seq_id": "s1"}, headers=a).status_code == 201
    r = c.post("/v1/sequences/s1/append", json={"num_tokens": 6, "k": enc(k), "v": enc(v)}, headers=a)
    assert r.json()["block_table"] == [0, 1]

    q = torch.randn(1, 4, 16)
    beta_calls = [
        ("GET", "/v1/sequences/s1", None),
        ("POST", "/v1/sequences/s1/append", {"num_tokens": 1}),
        ("POST", "/v1/sequences/s1/fork", {"seq_id": "stolen"}),
        ("DELETE", "/v1/sequences/s1", None),
        ("POST", "/v1/step", {"appends": [{"seq_id": "s1", "num_tokens": 1}]}),
        ("POST", "/v1/step", {"seq_ids": ["s1"]}),
        ("POST", "/v1/attend", {"layer": 0, "seq_ids": ["s1"], "q": enc(q)}),
    ]
    for method, path, body in beta_calls:
        r = c.request(method, path, json=body, headers=b)
        assert_error(r, 404, "sequence_not_found")
        assert "'s1'" in r.json()["error"]["message"]
    after = c.get("/v1/sequences/s1", headers=a).json()
    assert (after["length"], after["block_table"]) == (6, [0, 1])
    assert occupancy(server) == (2, 0, 14)

    # Beta's own "s1" is another sequence with its own pages.
    assert c.post("/v1/sequences", json={"seq_id": "s1"}, headers=b).status_code == 201
    r = c.post("/v1/sequences/s1/append", json={"num_tokens": 5}, headers=b)
    assert r.json()["block_table"] == [2, 3]
    assert c.delete("/v1/sequences/s1", headers=b).json() == {"seq_id": "s1", "freed_pages": 2}
    assert c.get("/v1/sequences/s1", headers=a).json()["block_table"] == [0, 1]
    assert c.delete("/v1/sequences/s1", headers=a).json() == {"seq_id": "s1", "freed_pages": 2}
    assert occupancy(server) == (0, 0, 16)
    check_prefix_cache_hits_never_cross_tenants(server)


def check_prefix_cache_hits_never_cross_tenants(server: Server) -> None:
    """On the emptied pool of the test above (to save a server start). Freed pages go back on the
    free stack so that the last freed is the next handed out: 1, 0, 3, 2, 4, 5, ..."""
    c = server.client
    a, b = bearer(ALPHA), bearer(BETA)
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 32_000, (9,), generator=gen).tolist()
    k, v = torch.randn(2, 9, 2, 16, generator=gen), torch.randn(2, 9, 2, 16, generator=gen)

    c.post("/v1/sequences", json={"seq_id": "p"}, headers=a)
    body = {"num_tokens": 9, "token_ids": tokens, "k": enc(k), "v": enc(v)}
    assert c.post("/v1/sequences/p/append", json=body, headers=a).json()["block_table"] == [1, 0, 3]
    c.delete("/v1/sequences/p", headers=a)
    assert occupancy(server) == (0, 2, 14)  # pages 1, 0 (full, written) stay cached

    # Beta asks for the very same tokens: no hit, and its pages are fresh ones (the cached two stay cached).
    r = c.post("/v1/sequences", json={"seq_id": "p", "token_ids": tokens}, headers=b)
    assert (r.json()["cached_tokens"], r.json()["block_table"]) == (0, [])
    r = c.post("/v1/sequences/p/append", json={"num_tokens": 9, "token_ids": tokens}, headers=b)
    assert r.json()["block_table"] == [3, 2, 4]
    assert occupancy(server) == (3, 2, 11)

    # Alpha, under its other key, hits its own two pages.
    r = c.post("/v1/sequences", json={"seq_id": "again", "token_ids": tokens}, headers=bearer(ALPHA_ROTATED))
    assert (r.json()["cached_tokens"], r.json()["block_table"]) == (8, [1, 0])
    assert occupancy(server) == (5, 0, 11)


def test_tenant_page_quota_is_all_or_nothing(start_server: Any) -> None:
    server = start_server({**KEYS, "KVPOOL_TENANT_MAX_PAGES": "4"})
    c = server.client
    a, b = bearer(ALPHA), bearer(BETA)
    for seq_id in ("x", "y"):
        c.post("/v1/sequences", json={"seq_id": seq_id}, headers=a)
    assert c.post("/v1/sequences/x/append", json={"num_tokens": 12}, headers=a).json()["block_table"] == [0, 1, 2]

    # x needs a 4th page and y two: 6 > 4, so neither append happens.
    step = {"appends": [{"seq_id": "x", "num_tokens": 1}, {"seq_id": "y", "num_tokens": 5}]}
    r = c.post("/v1/step", json=step, headers=a)
    assert_error(r, 429, "quota_exceeded")
    assert "quota of 4" in r.json()["error"]["message"]
    assert [c.get(f"/v1/sequences/{s}", headers=a).json()["length"] for s in ("x", "y")] == [12, 0]
    assert occupancy(server) == (3, 0, 13)

    torch.manual_seed(5)
    kv = {"k": enc(torch.randn(2, 5, 2, 16)), "v": enc(torch.randn(2, 5, 2, 16))}
    assert_error(c.post("/v1/sequences/y/append", json={"num_tokens": 5, **kv}, headers=a), 429, "quota_exceeded")
    assert_error(c.post("/v1/sequences/x/fork", json={"seq_id": "z"}, headers=a), 429, "quota_exceeded")
    assert_error(c.get("/v1/sequences/z", headers=a), 404, "sequence_not_found")
    assert occupancy(server) == (3, 0, 13)

    # Up to the cap is fine; the cap is per tenant: beta still gets its four.
    assert c.post("/v1/sequences/y/append", json={"num_tokens": 4}, headers=a).json()["block_table"] == [3]
    assert_error(c.post("/v1/sequences/y/append", json={"num_tokens": 1}, headers=a), 429, "quota_exceeded")
    c.post("/v1/sequences", json={"seq_id": "x"}, headers=b)
    assert c.post("/v1/sequences/x/append", json={"num_tokens": 16}, headers=b).json()["block_table"] == [4, 5, 6, 7]
    assert occupancy(server) == (8, 0, 8)

    # Freeing gives the quota back.
    c.delete("/v1/sequences/x", headers=a)
    assert c.post("/v1/sequences/y/append", json={"num_tokens": 8}, headers=a).json()["block_table"] == [3, 2, 1]


def test_the_server_refuses_to_start_on_bad_keys_without_showing_them() -> None:
    env = {**os.environ, **SMALL_POOL, "PYTHONPATH": str(REPO), "KVPOOL_API_KEYS": f"alpha:{ALPHA},beta:{ALPHA}"}
    run = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--port", "1"], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2
    assert "KVPOOL_API_KEYS: Value error, entry 2 repeats the key of an earlier entry (tenant 'alpha')" in run.stderr
    assert ALPHA not in run.stderr + run.stdout
