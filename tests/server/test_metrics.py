"""GET /metrics of a real server after a known sequence of calls: exact values of every series.

The pool: 6 pages of 4 tokens, 2 layers, 2 KV heads, head_dim 16. Page ids are deterministic (a fresh
pool hands out 0, 1, 2, ...; freed pages go back on top of the free stack; cached pages are evicted
oldest release first), so every expected value below is worked out by hand in the comments.
"""

import asyncio
import itertools
import random
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from service import __version__
from service.config import Settings
from service.pool import PoolState
from service.server.app import create_app
from service.server.metrics import Metrics, RequestMetricsMiddleware
from tests.conftest import REPO, Server, enc

TINY_POOL = {"KVPOOL_NUM_PAGES": "6"}  # on top of conftest's SMALL_POOL (page_size 4, 2 layers)
NUM_PAGES = 6
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


def scrape(server: Server) -> dict[str, Any]:
    r = server.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"] == TEXT_FORMAT
    return {family.name: family for family in text_string_to_metric_families(r.text)}


def pool_series(families: dict[str, Any]) -> dict[str, float]:
    """Every unlabelled sample: the pool gauges and counters (histograms and kvpool_info carry labels)."""
    return {s.name: s.value for f in families.values() for s in f.samples if not s.labels}


def expected(
    *,
    used: int,
    cached: int,
    free: int,
    occupancy: float,
    sequences: int,
    queries: int = 0,
    hits: int = 0,
    evictions: int = 0,
    failures: int = 0,
    appended: int = 0,
) -> dict[str, float]:
    assert used + cached + free == NUM_PAGES
    return {
        "kvpool_pages_total": NUM_PAGES,
        "kvpool_pages_used": used,
        "kvpool_pages_cached": cached,
        "kvpool_pages_free": free,
        "kvpool_kv_cache_usage_ratio": used / NUM_PAGES,
        "kvpool_token_occupancy_ratio": occupancy,
        "kvpool_sequences": sequences,
        "kvpool_prefix_cache_queries_total": queries,
        "kvpool_prefix_cache_hits_total": hits,
        "kvpool_evictions_total": evictions,
        "kvpool_allocation_failures_total": failures,
        "kvpool_sequences_expired_total": 0,
        "kvpool_tokens_appended_total": appended,
        "kvpool_kv_events_published_total": 0,  # KVPOOL_KV_EVENTS_ENDPOINT unset (tests/events publish)
        "kvpool_kv_events_dropped_total": 0,
    }


def histogram_counts(families: dict[str, Any], name: str, label_names: tuple[str, ...]) -> dict[tuple[str, ...], float]:
    """{label values: count}, after checking each series' buckets are cumulative and end at its count."""
    family = families[name]
    assert family.type == "histogram"
    series: dict[tuple[str, ...], dict[str, Any]] = {}
    for s in family.samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        assert tuple(sorted(labels)) == tuple(sorted(label_names)), s
        entry = series.setdefault(tuple(labels[k] for k in label_names), {"buckets": []})
        if s.name.endswith("_bucket"):
            entry["buckets"].append((float(s.labels["le"]), s.value))
        else:
            entry[s.name.rsplit("_", 1)[1]] = s.value
    counts = {}
    for key, entry in series.items():
        buckets = sorted(entry["buckets"])
        assert buckets[-1] == (float("inf"), entry["count"]), key
        assert all(a[1] <= b[1] for a, b in itertools.pairwise(buckets)), key
        assert (entry["sum"] > 0) == (entry["count"] > 0), key
        counts[key] = entry["count"]
    return counts


def kv(num_layers: int, num_tokens: int, gen: torch.Generator) -> dict[str, Any]:
    return {
        "k": enc(torch.randn(num_layers, num_tokens, 2, 16, generator=gen)),
        "v": enc(torch.randn(num_layers, num_tokens, 2, 16, generator=gen)),
    }


def test_metrics_after_a_known_sequence_of_calls(start_server: Any) -> None:
    server = start_server(TINY_POOL)
    c = server.client
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    prompt = [rng.randrange(1, 50_000) for _ in range(10)]
    other = [rng.randrange(1, 50_000) for _ in range(4)]

    families = scrape(server)
    assert pool_series(families) == expected(used=0, cached=0, free=6, occupancy=0.0, sequences=0)
    info = families["kvpool_info"]
    assert [(s.labels, s.value) for s in info.samples] == [
        (
            {
                "version": __version__,
                "device": "cpu",
                "dtype": "float32",
                "page_size": "4",
                "num_pages": "6",
                "num_layers": "2",
            },
            1.0,
        )
    ]

    # a: a 10-token prompt (a query of 10 tokens, nothing cached yet), written into pages 0, 1, 2;
    # the two full pages are committed to the prefix cache.
    r = c.post("/v1/sequences", json={"seq_id": "a", "token_ids": prompt})
    assert r.status_code == 201 and r.json()["cached_tokens"] == 0
    r = c.post("/v1/sequences/a/append", json={"num_tokens": 10, "token_ids": prompt, **kv(2, 10, gen)})
    assert r.json()["block_table"] == [0, 1, 2]
    # One decode (one query token) and one prefill (q_len 3) attention.
    q1, q3 = torch.randn(1, 4, 16, generator=gen), torch.randn(3, 4, 16, generator=gen)
    assert c.post("/v1/attend", json={"layer": 0, "seq_ids": ["a"], "q": enc(q1)}).status_code == 200
    r = c.post("/v1/attend", json={"layer": 1, "seq_ids": ["a"], "q": enc(q3), "q_lens": [3]})
    assert r.status_code == 200
    # Freeing a: the tail page 2 (never full) goes back free, pages 1 and 0 stay cached.
    assert c.delete("/v1/sequences/a").json()["freed_pages"] == 3
    families = scrape(server)
    assert pool_series(families) == expected(
        used=0, cached=2, free=4, occupancy=0.0, sequences=0, queries=10, hits=0, appended=10
    )

    # b: the same prompt hits pages 0 and 1 (8 tokens; never the last prompt token); 2 more tokens
    # take page 2 back. c forks b: pages 0, 1, 2 shared, the partial page 2 holding 2 tokens.
    r = c.post("/v1/sequences", json={"seq_id": "b", "token_ids": prompt})
    assert r.json()["block_table"] == [0, 1] and r.json()["cached_tokens"] == 8
    r = c.post("/v1/sequences/b/append", json={"num_tokens": 2, "token_ids": prompt[8:]})
    assert r.json()["block_table"] == [0, 1, 2]
    assert c.post("/v1/sequences/b/fork", json={"seq_id": "c"}).json()["block_table"] == [0, 1, 2]
    # 3 used pages hold 8 + 2 distinct tokens: 10 / 12 (shared pages count once, not per sequence).
    families = scrape(server)
    assert pool_series(families) == expected(
        used=3, cached=0, free=3, occupancy=10 / 12, sequences=2, queries=20, hits=8, appended=12
    )

    # 30 more tokens for c need 1 copy-on-write page + 7 new ones; 3 are available: refused, one failure.
    r = c.post("/v1/sequences/c/append", json={"num_tokens": 30})
    assert r.status_code == 507 and r.json()["error"]["code"] == "out_of_pages"
    # d writes one full page (page 3, from the free stack) and frees it: page 3 is cached.
    assert c.post("/v1/sequences", json={"seq_id": "d"}).status_code == 201
    r = c.post("/v1/sequences/d/append", json={"num_tokens": 4, "token_ids": other, **kv(2, 4, gen)})
    assert r.json()["block_table"] == [3]
    assert c.delete("/v1/sequences/d").json()["freed_pages"] == 1
    # 7 tokens for c: a copy of the shared page 2 + 2 new pages = 3 pages from 2 free + 1 cached,
    # so cached page 3 is evicted. c: [0, 1, 3, 4, 5] with 17 tokens; b keeps [0, 1, 2] with 10.
    r = c.post("/v1/sequences/c/append", json={"num_tokens": 7})
    assert r.json()["block_table"] == [0, 1, 3, 4, 5]
    pool = c.get("/v1/pool").json()
    assert (pool["pages_used"], pool["pages_cached"], pool["pages_free"]) == (6, 0, 0)
    # Distinct tokens: 8 (pages 0, 1) + 2 (b's page 2) + 4 + 4 + 1 (c's pages 3, 4, 5) = 19 of 24 slots.
    families = scrape(server)
    assert pool_series(families) == expected(
        used=6, cached=0, free=0, occupancy=19 / 24, sequences=2, queries=20, hits=8, evictions=1, failures=1,
        appended=23,
    )  # fmt: skip

    # Requests the router does not know, or knows under a template, keep the label set bounded.
    for seq_id in ("x1", "x2", "x3"):
        assert c.get(f"/v1/sequences/{seq_id}").status_code == 404
    assert c.get("/no/such/path").status_code == 404
    assert c.get("/v1/sequences/a/b/c/d").status_code == 404
    # PROPFIND: a method both HTTP parsers (h11, httptools) accept and no route serves.
    assert c.request("PROPFIND", "/healthz").status_code == 405
    assert c.post("/v1/sequences", json={"seq_id": "not an id!"}).status_code == 422
    # Freeing b then c: pages 0 and 1 (hashed) end up cached, the rest free.
    assert c.delete("/v1/sequences/b").json()["freed_pages"] == 1
    assert c.delete("/v1/sequences/c").json()["freed_pages"] == 5
    families = scrape(server)
    assert pool_series(families) == expected(
        used=0, cached=2, free=4, occupancy=0.0, sequences=0, queries=20, hits=8, evictions=1, failures=1,
        appended=23,
    )  # fmt: skip

    requests = histogram_counts(families, "kvpool_request_duration_seconds", ("route", "method", "status"))
    # The fixture polled /readyz until its first 200 (connection refusals never reach the app).
    assert requests.pop(("/readyz", "GET", "200")) >= 1
    assert requests == {
        ("/metrics", "GET", "200"): 4,  # this scrape is observed after its answer: 4 before it
        ("/v1/sequences", "POST", "201"): 3,
        ("/v1/sequences", "POST", "422"): 1,
        ("/v1/sequences/{seq_id}/append", "POST", "200"): 4,
        ("/v1/sequences/{seq_id}/append", "POST", "507"): 1,
        ("/v1/sequences/{seq_id}/fork", "POST", "201"): 1,
        ("/v1/sequences/{seq_id}", "DELETE", "200"): 4,
        ("/v1/sequences/{seq_id}", "GET", "404"): 3,
        ("/v1/attend", "POST", "200"): 2,
        ("/v1/pool", "GET", "200"): 1,
        ("unmatched", "GET", "404"): 2,
        ("/healthz", "other", "405"): 1,
    }
    attention = histogram_counts(families, "kvpool_attention_duration_seconds", ("kernel", "backend"))
    assert attention == {("decode", "cpu"): 1, ("prefill", "cpu"): 1}  # auto on a CPU pool: the cpu backend


def test_openmetrics_when_asked(server: Server) -> None:
    r = server.client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert r.text.endswith("# EOF\n")
    families = {f.name: f for f in parse_openmetrics(r.text)}
    assert families["kvpool_pages_free"].samples[0].value == 16
    assert families["kvpool_evictions"].type == "counter"
    assert [s.name for s in families["kvpool_evictions"].samples] == ["kvpool_evictions_total"]
    # The default (Prometheus text) is what any other Accept gets.
    assert server.client.get("/metrics", headers={"Accept": "*/*"}).headers["content-type"] == TEXT_FORMAT


def test_apps_side_by_side_keep_their_own_registries() -> None:
    settings = Settings(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, num_pages=8, device="cpu")
    with TestClient(create_app(settings)) as first, TestClient(create_app(settings)) as second:
        assert first.post("/v1/sequences", json={"seq_id": "s", "token_ids": [7, 8, 9]}).status_code == 201

        def families(client: TestClient) -> dict[str, Any]:
            return {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}

        one, two = families(first), families(second)
        assert pool_series(one)["kvpool_sequences"] == 1 and pool_series(two)["kvpool_sequences"] == 0
        assert pool_series(one)["kvpool_prefix_cache_queries_total"] == 3
        assert pool_series(two)["kvpool_prefix_cache_queries_total"] == 0
        requests_one = histogram_counts(one, "kvpool_request_duration_seconds", ("route", "method", "status"))
        requests_two = histogram_counts(two, "kvpool_request_duration_seconds", ("route", "method", "status"))
        assert requests_one == {("/v1/sequences", "POST", "201"): 1}
        assert requests_two == {}


def test_core_stays_free_of_prometheus() -> None:
    for path in sorted((REPO / "service" / "core").glob("*.py")):
        assert "prometheus" not in path.read_text(), path


def test_middleware_labels_answers_given_before_routing_and_crashes() -> None:
    """Answers that never reach the router (another middleware's 401, an exception) keep bounded labels."""
    settings = Settings(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, num_pages=8, device="cpu")
    app = create_app(settings)
    metrics = Metrics(PoolState(settings))

    async def refuse(scope: Any, receive: Any, send: Any) -> None:  # answers like an auth middleware
        await send({"type": "http.response.start", "status": 401, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def crash(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("boom")

    async def call(inner: Any, method: str, path: str) -> None:
        scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": [], "query_string": b""}

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            pass

        await RequestMetricsMiddleware(inner, metrics, app.router.routes)(scope, receive, send)

    asyncio.run(call(refuse, "DELETE", "/v1/sequences/abc"))
    asyncio.run(call(refuse, "GET", "/v1/sequences/abc/append"))  # a POST-only route: still its template
    asyncio.run(call(refuse, "GET", "/nowhere"))
    with pytest.raises(RuntimeError, match="boom"):  # the middleware records, then lets it through
        asyncio.run(call(crash, "POST", "/v1/step"))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    assert histogram_counts(families, "kvpool_request_duration_seconds", ("route", "method", "status")) == {
        ("/v1/sequences/{seq_id}", "DELETE", "401"): 1,
        ("/v1/sequences/{seq_id}/append", "GET", "401"): 1,
        ("unmatched", "GET", "401"): 1,
        ("/v1/step", "POST", "500"): 1,
    }
