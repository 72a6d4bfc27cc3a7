"""What a run did, read from the servers themselves: vLLM's and kvpool's Prometheus counters (before and
after a run), resets between runs, and the replays that check the tokens.

vLLM (per engine, summed over a configuration's engines): `prompt_tokens_by_source` (local_compute,
local_cache_hit, external_kv_transfer: the prompt tokens computed, found in its own prefix cache, loaded
by the connector), `prefix_cache_queries/hits` (its own cache), `external_prefix_cache_queries/hits` (what
the connector offered), `num_preemptions`, `request_success` by finish reason. kvpool (per pool):
`kvpool_prefix_cache_queries/hits`, the pages used and cached, `kvpool_request_duration_seconds` (its HTTP
time, server side), `kvpool_tier_lookup/load_seconds` and `bytes_in` (its restores from the remote tier).
"""

import random
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serving.fleet import MODEL_NAME

LABELS = (
    "source",
    "finished_reason",
    "counter",
    "route",
    "method",
)  # the labels kept apart; the others (engine, model, status...) are summed

# The benchmark's calls to kvpool (scrape, wait_idle, reset), not the engines' or the routers'.
OWN_CALLS = ("GET /metrics", "GET /v1/pool", "POST /v1/prefix_cache/reset")


def scrape(url: str) -> dict[str, float]:
    """A server's Prometheus samples, flat: name{label=value} for LABELS, summed over the other labels."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    flat: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created") or sample.name.endswith("_bucket"):
                continue
            kept = ",".join(f"{k}={sample.labels[k]}" for k in LABELS if k in sample.labels)
            key = f"{sample.name}{{{kept}}}" if kept else sample.name
            flat[key] = flat.get(key, 0.0) + sample.value
    return flat


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def snapshot(engines: list[str], kvpools: list[str]) -> dict[str, dict[str, float]]:
    """vLLM's samples summed over the engines, kvpool's over the pools."""
    return {"vllm": _summed(engines), "kvpool": _summed(kvpools)}


def _summed(urls: list[str]) -> dict[str, float]:
    total: dict[str, float] = {}
    for url in urls:
        for key, value in scrape(url).items():
            total[key] = total.get(key, 0.0) + value
    return total


def reset(engines: list[str], kvpools: list[str], redis_url: str = "") -> None:
    """Every cache the next run could find warm emptied: vLLM's prefix caches, the pools, the store."""
    for url in engines:
        httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()
    for url in kvpools:
        httpx.post(f"{url}/v1/prefix_cache/reset", timeout=60).raise_for_status()
    if redis_url:
        import redis

        with redis.Redis.from_url(redis_url) as store:
            store.flushall()


def router_stats(url: str) -> dict[str, Any]:
    """The routing proxy's counters (benchmarks/serving/router.py: GET /router/stats)."""
    answer = httpx.get(f"{url}/router/stats", timeout=30)
    answer.raise_for_status()
    return dict(answer.json())


def routing(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the proxy did during a run: requests per backend, and for the prefix policies the time spent
    choosing (tokenizing, asking the index) per routed request, and where the prompts were tokenized."""
    chosen = after["chosen"] - before["chosen"]
    return {
        "routed": [a - b for a, b in zip(after["routed"], before["routed"])],
        "route_ms_per_request": (after["route_ns"] - before["route_ns"]) / 1e6 / chosen if chosen else 0.0,
        "tokenized_here": after["tokenized_here"],
        "tokenizer_checked": after["checked"],  # requests whose ids vLLM's /tokenize confirmed (so far, in all)
        "tokenizer_mismatches": after["mismatches"],
        # After the run: nothing in flight, and no node still counted as prefilling (each request left it once).
        "in_flight_after": after["in_flight"],
        "prefilling_after": after["prefilling"],
    }


def cpu_times(pids: list[int]) -> tuple[int, int]:
    """The CPU time of every thread of these processes so far, and their time runnable but waiting for a
    core (ns; the kernel's /proc/PID/task/TID/schedstat; (0, 0) where it has none): under load the second
    says how much of a server's time per call is the machine's, not the server's."""
    ran = waited = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                on_cpu, on_queue, _ = (task / "schedstat").read_text().split()
            except (OSError, ValueError):  # a thread gone meanwhile, or no schedstat in this kernel
                continue
            ran, waited = ran + int(on_cpu), waited + int(on_queue)
    return ran, waited


def wait_idle(kvpools: list[str], timeout_s: float = 60) -> int:
    """Waits until no kvpool page is used (the connectors' queued saves done, every pin released); the
    used pages left when `timeout_s` ran out (0: all released)."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = sum(httpx.get(f"{url}/v1/pool", timeout=30).json()["pages_used"] for url in kvpools)
        if used == 0 or time.monotonic() > deadline:
            return int(used)
        time.sleep(0.5)


def summarize(counters: dict[str, dict[str, float]]) -> dict[str, Any]:
    v, k = counters["vllm"], counters["kvpool"]
    prompt = v.get("vllm:prompt_tokens_total", 0.0)
    local = v.get("vllm:prompt_tokens_by_source_total{source=local_cache_hit}", 0.0)
    external = v.get("vllm:prompt_tokens_by_source_total{source=external_kv_transfer}", 0.0)
    queries = k.get("kvpool_prefix_cache_queries_total", 0.0)
    http = _by_route(k)
    return {
        "prompt_tokens": prompt,
        "cached_tokens_vllm": local,
        "cached_tokens_kvpool": external,
        "cached_fraction": (local + external) / prompt if prompt else 0.0,
        "vllm_prefix_hit_rate": _ratio(v, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
        "connector_hit_rate": _ratio(
            v, "vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total"
        ),
        "external_queries": v.get("vllm:external_prefix_cache_queries_total", 0.0),
        "external_hits": v.get("vllm:external_prefix_cache_hits_total", 0.0),
        "preemptions": v.get("vllm:num_preemptions_total", 0.0),
        "engine_errors": v.get("vllm:request_success_total{finished_reason=error}", 0.0)
        + v.get("vllm:request_success_total{finished_reason=abort}", 0.0),
        "kvpool_hit_rate": k.get("kvpool_prefix_cache_hits_total", 0.0) / queries if queries else 0.0,
        "kvpool_query_tokens": queries,
        "kvpool_http_requests": sum(n for n, _ in http.values()),
        "kvpool_http_s": sum(s for _, s in http.values()),
        # route -> [calls, seconds] (kvpool's own timing, first byte in to last byte out)
        "kvpool_http_by_route": {route: [n, s] for route, (n, s) in sorted(http.items()) if n},
        "kvpool_evictions": k.get("kvpool_evictions_total", 0.0),
        # Restores from the tiers (the remote tier here), summed over the tiers and pools: the time asking which
        # pages a tier holds, the time reading them back (K/V bytes into the pool), and those bytes.
        "kvpool_tier_lookup_s": k.get("kvpool_tier_lookup_seconds_total", 0.0),
        "kvpool_tier_load_s": k.get("kvpool_tier_load_seconds_total", 0.0),
        "kvpool_tier_load_wait_s": k.get("kvpool_tier_load_wait_seconds_total", 0.0),
        "kvpool_tier_bytes_in": k.get("kvpool_tier_bytes_in_total", 0.0),
        # The connector's own counters (service/integrations/vllm_stats: vllm:kvpool_connector_total).
        "connector": {
            key.split("=", 1)[1].rstrip("}"): value
            for key, value in v.items()
            if key.startswith("vllm:kvpool_connector_total{")
        },
    }


def _by_route(counters: dict[str, float]) -> dict[str, tuple[float, float]]:
    """kvpool's HTTP calls and seconds per "METHOD route", the benchmark's own calls (its scrapes, its polls
    of the pool, its resets) left out."""
    calls: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for key, value in counters.items():
        metric, _, labels = key.rstrip("}").partition("{")
        if metric not in ("kvpool_request_duration_seconds_count", "kvpool_request_duration_seconds_sum"):
            continue
        named = dict(pair.split("=", 1) for pair in labels.split(","))
        name = f"{named.get('method', '')} {named.get('route', '')}".strip()
        if name not in OWN_CALLS:
            into = calls if metric.endswith("_count") else seconds
            into[name] = into.get(name, 0.0) + value
    return {name: (calls[name], seconds.get(name, 0.0)) for name in calls}


def _ratio(counters: dict[str, float], hits: str, queries: str) -> float:
    return counters.get(hits, 0.0) / counters[queries] if counters.get(queries) else 0.0


def sample_requests(log_lines: list[dict[str, Any]], count: int, seed: int) -> list[dict[str, Any]]:
    """`count` of a run's proxied requests that succeeded, drawn with `seed`."""
    good = [line for line in log_lines if line["status"] == 200 and not line["error"]]
    return random.Random(seed).sample(good, min(count, len(good)))


def prompt_ids(engine: str, record: dict[str, Any]) -> list[int]:
    body = record["body"]
    ask: dict[str, Any] = {"model": MODEL_NAME}
    if record["path"] == "v1/chat/completions":
        ask["messages"] = body["messages"]
    elif isinstance(body["prompt"], list):
        return list(body["prompt"])
    else:
        ask["prompt"] = body["prompt"]
    answer = httpx.post(f"{engine}/tokenize", json=ask, timeout=60)
    answer.raise_for_status()
    return list(answer.json()["tokens"])


def generate(base_url: str, token_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens for a prompt given as token ids, one request on its own."""
    body = {
        "model": MODEL_NAME, "prompt": token_ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    answer = httpx.post(f"{base_url}/v1/completions", json=body, timeout=300)
    answer.raise_for_status()
    return list(answer.json()["choices"][0]["token_ids"])
