"""Prometheus metrics on a per-app registry, named after vLLM's where one exists.

The core keeps plain counts (allocator, SequenceTable.stats); `PoolCollector` turns them into
gauges and counters at scrape time, so the request path pays nothing for them. Only the two
histograms are observed as requests run: one middleware call per request, one per attention.
"""

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated, Any

import torch
from fastapi import Depends, Request
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import __version__
from service.server.route_match import match_path

if TYPE_CHECKING:
    from service.pool import PoolState

# Request latencies on loopback run from ~100 µs (a probe) to seconds (a large attend on the CPU).
REQUEST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
ATTENTION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)
UNMATCHED_ROUTE = "unmatched"  # the route label of every path no route knows (bounded cardinality)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class PoolCollector(Collector):
    """Reads the pool's counts at scrape time (on the event loop, like every other pool access)."""

    def __init__(self, state: "PoolState") -> None:
        self.state = state

    def collect(self) -> Iterable[Metric]:
        state = self.state
        a, seqs, s = state.allocator, state.sequences, state.settings
        stats, events = seqs.stats, state.events
        used = a.num_used
        gauges = [
            ("kvpool_pages_total", "Pages in the pool (the null page not counted).", a.num_pages),
            ("kvpool_pages_used", "Pages held by at least one sequence.", used),
            ("kvpool_pages_cached", "Unreferenced pages kept for prefix reuse (evictable).", a.num_cached),
            ("kvpool_pages_free", "Empty pages.", a.num_free),
            ("kvpool_kv_cache_usage_ratio", "Used pages / total pages (0-1).", used / a.num_pages),
            (
                "kvpool_token_occupancy_ratio",
                "Token slots filled / slots of the used pages (0 when no page is used): internal fragmentation.",
                state.sequences.tokens_in_used_pages() / (used * s.page_size) if used else 0.0,
            ),
            ("kvpool_sequences", "Live sequences.", len(seqs)),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("kvpool_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_query_tokens),
            ("kvpool_prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_hit_tokens),
            ("kvpool_evictions", "Cached pages evicted to make room.", a.num_evictions),
            ("kvpool_allocation_failures", "Appends refused for lack of pages.", stats.allocation_failures),
            ("kvpool_sequences_expired", "Sequences freed by the lease sweeper.", stats.sequences_expired),
            ("kvpool_tokens_appended", "Tokens appended to sequences.", stats.tokens_appended),
            # KV events (0 while KVPOOL_KV_EVENTS_ENDPOINT is unset): published on the ZeroMQ socket,
            # or dropped because the publisher's queue was full (subscribers then see a sequence gap).
            ("kvpool_kv_events_published", "KV events published.", events.published if events else 0),
            ("kvpool_kv_events_dropped", "KV events dropped: their queue was full.", events.dropped if events else 0),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        if events is not None and (outcomes := events.replay_outcomes()):
            replays = CounterMetricFamily(
                "kvpool_kv_events_replays",
                "KV event replay requests by how they ended: completed; cut_short (the buffer turned over "
                "first: the reply stopped early, consecutive); abandoned (the reader left or took nothing "
                "for 30 s); refused (malformed, or too many queued).",
                labels=["outcome"],
            )
            for outcome, count in outcomes.items():
                replays.add_metric([outcome], count)
            yield replays
        if state.cache.tiers:
            yield from tier_metrics(state.cache.report())
        info = GaugeMetricFamily(
            "kvpool_info",
            "The pool's settings; always 1.",
            labels=["version", "device", "dtype", "page_size", "num_pages", "num_layers"],
        )
        device = str(state.storage.device)
        info.add_metric([__version__, device, s.dtype, str(s.page_size), str(s.num_pages), str(s.num_layers)], 1)
        yield info


TIER_COUNTERS = {
    "hits": "Pages restored from the tier into the device.",
    "misses": "Prefix lookups that reached the tier and found not even the next page there.",
    "bytes_in": "Bytes read back from the tier into the device.",
    "bytes_out": "Bytes written to the tier.",
    "evictions": "Entries the tier dropped to make room (its own LRU).",
    "errors": "Failed reads or writes of the tier (store down or slow, disk full, bad data).",
    "skipped": "Pages not written to the tier: its queue full, or the tier failing.",
    "rejected": "Entries found but not loaded: token ids, geometry or checksum not matching.",
    "lookup_seconds": "Seconds restores spent asking the tier which of a prompt's pages it holds (wall time).",
    "load_seconds": "Seconds restores spent reading pages back from the tier into the device (wall time).",
    "load_wait_seconds": "Of load_seconds, seconds the remote tier's reads waited for bytes not yet arrived "
    "(reads on the event loop: redis:// and unix://; 0 for spill tiers, TLS and clusters).",
}
TIER_GAUGES = {
    "used_bytes": "Bytes the tier holds (spill tiers).",
    "capacity_bytes": "Bytes the tier can hold (spill tiers).",
    "entries": "Pages the tier holds (spill tiers).",
    "up": "1 while the tier works, 0 during an incident.",
    "queued_pages": "Pages waiting to be written to the tier.",
}


def tier_metrics(rows: list[dict[str, Any]]) -> Iterable[Metric]:
    """kvpool_tier_*{tier="host|disk|remote"} from PrefixCache.report()."""
    for key, doc in TIER_COUNTERS.items():
        counter = CounterMetricFamily(f"kvpool_tier_{key}", doc, labels=["tier"])
        for row in rows:
            counter.add_metric([row["tier"]], row[key])
        yield counter
    for key, doc in TIER_GAUGES.items():
        gauge = GaugeMetricFamily(f"kvpool_tier_{key}", doc, labels=["tier"])
        for row in rows:
            if row[key] is not None:
                gauge.add_metric([row["tier"]], float(row[key]))
        yield gauge


class Metrics:
    """The registry of one app: the pool collector and the two latency histograms."""

    def __init__(self, state: "PoolState") -> None:
        self.registry = CollectorRegistry()
        self.registry.register(PoolCollector(state))
        self.device = state.storage.device
        self.request_duration = Histogram(
            "kvpool_request_duration_seconds",
            "HTTP request latency, from the first byte in to the last byte out.",
            ["route", "method", "status"],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.attention_duration = Histogram(
            "kvpool_attention_duration_seconds",
            "Attention over the pool, device time included.",
            ["kernel", "backend"],
            buckets=ATTENTION_BUCKETS,
            registry=self.registry,
        )
        for kernel in ("decode", "prefill"):  # series exist (at 0) before the first attention
            self.attention_duration.labels(kernel, state.engine.backend)
        # labels() validates and locks on every call: keep the children we have already made.
        self._request_children: dict[tuple[str, str, int], Any] = {}

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        key = (route, method, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.request_duration.labels(route, method, str(status))
        child.observe(seconds)

    def observe_attention(self, kernel: str, backend: str, started: float) -> None:
        """Attention time since `started` (perf_counter); on CUDA, waits for the device to finish first."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.attention_duration.labels(kernel, backend).observe(time.perf_counter() - started)

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition the client asked for (Prometheus text 0.0.4 unless Accept says otherwise)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


# async: FastAPI runs a plain `def` dependency in its thread pool; under bench http that hop made
# POST /v1/attend (the one route that uses this) wait 4-6x longer than every other route.
async def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


MetricsDep = Annotated[Metrics, Depends(get_metrics)]


class RequestMetricsMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware: it would buffer every body through a task group).

    Labels each request with its route template (`/v1/sequences/{seq_id}`), never the raw path,
    so the number of series stays bounded whatever clients send.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: list[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the server answers when the app raises before starting a response

        async def send_and_record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record_status)
        finally:
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.observe_request(self.route_of(scope), method, status, time.perf_counter() - start)

    def route_of(self, scope: Scope) -> str:
        route = scope.get("route")  # set by the router when it dispatched the request
        path = getattr(route, "path", None)
        if isinstance(path, str):
            return path
        # Answered before routing (e.g. 401 or 413 by a middleware): the template the router would pick.
        return match_path(self.routes, scope).template or UNMATCHED_ROUTE
