"""The fleet of each phase and the configurations it serves.

A phase starts the processes its configurations need, runs them alternately, and stops them. Two phases:
e and f (two nodes, each one kvpool and one engine, sharing a Redis tier; f routed by Dynamo's KV indexer
or by kvpool's prefix match), then a, b, c and d together on four engines (each ~1.7 GB here): a and c
vLLM alone, b and d one kvpool shared by two engines. The pairs the targets compare, b with a and d with c,
so take turns within minutes of each other, on the same machine's speed (it swings by 2x within a run
here); an idle engine takes no CPU. Last, because a's engine is also the reference that every run's
sampled requests are replayed on.
"""

from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.serving.fleet import (
    MODEL_NAME,
    PAGE_SIZE,
    Fleet,
    Service,
    free_port,
    indexer_service,
    kvpool_service,
    pid_of,
    redis_service,
    router_service,
    url_of,
    vllm_service,
)

CONFIGS = {
    "a": "one vLLM alone",
    "b": "one vLLM + kvpool",
    "c": "two vLLM, round robin, each alone",
    "d": "two vLLM sharing one kvpool, round robin",
    "e": "two nodes (kvpool + vLLM each) sharing Redis, round robin",
    "f": "the nodes of e, routed by prefix (Dynamo's KV indexer)",
    "f-match": "the nodes of e, routed by prefix (kvpool's POST /v1/prefix/match)",
}


@dataclass(frozen=True)
class Sizes:
    kv_cache_bytes: int  # vLLM's own KV cache (--kv-cache-memory-bytes), per engine
    max_len: int
    kvpool_pages: int
    redis_bytes: int


@dataclass
class Target:
    """One configuration: where the clients send requests, and the servers whose counters it reads."""

    name: str
    router: Service
    engines: list[str]
    kvpools: list[str] = field(default_factory=list)
    redis: str = ""
    kvpool_pids: list[int] = field(default_factory=list)  # its kvpool servers' (their CPU time is read)

    @property
    def url(self) -> str:
        return url_of(self.router)

    @property
    def log(self) -> Path:
        return Path(self.router.cmd[self.router.cmd.index("--log") + 1])


def start_engines(
    fleet: Fleet, run_dir: Path, model: Path, sizes: Sizes, names_pools: list[tuple[str, str]]
) -> list[str]:
    engines = [
        vllm_service(run_dir, name, model, sizes.kv_cache_bytes, sizes.max_len, pool, core)
        for core, (name, pool) in enumerate(names_pools)
    ]
    fleet.start(engines, timeout_s=600)
    return [url_of(e) for e in engines]


def start_routers(fleet: Fleet, routers: list[Service]) -> None:
    fleet.start(routers, timeout_s=60)


def one_host(fleet: Fleet, run_dir: Path, model: Path, sizes: Sizes) -> list[Target]:
    """a, b, c and d: two engines without kvpool (a: the first), and two sharing one kvpool (b: the first)."""
    pool = kvpool_service(run_dir, "kvpool-d", model, sizes.kvpool_pages)
    fleet.start([pool], timeout_s=120)
    k = url_of(pool)
    a1, a2 = start_engines(fleet, run_dir, model, sizes, [("vllm-a1", ""), ("vllm-a2", "")])
    b1, b2 = start_engines(fleet, run_dir, model, sizes, [("vllm-b1", k), ("vllm-b2", k)])
    ra = router_service(run_dir, "router-a", [a1], "rr")
    rb = router_service(run_dir, "router-b", [b1], "rr")
    rc = router_service(run_dir, "router-c", [a1, a2], "rr")
    rd = router_service(run_dir, "router-d", [b1, b2], "rr")
    start_routers(fleet, [ra, rb, rc, rd])
    pids = [pid_of(pool)]
    return [
        Target("a", ra, [a1]), Target("b", rb, [b1], [k], kvpool_pids=pids),
        Target("c", rc, [a1, a2]), Target("d", rd, [b1, b2], [k], kvpool_pids=pids),
    ]  # fmt: skip


def two_nodes(fleet: Fleet, run_dir: Path, model: Path, sizes: Sizes, dynamo: bool) -> list[Target]:
    redis = redis_service(run_dir, sizes.redis_bytes)
    fleet.start([redis], timeout_s=30)
    redis_url = f"redis://127.0.0.1:{redis.cmd[redis.cmd.index('--port') + 1]}/0"
    events = [free_port(), free_port()] if dynamo else [0, 0]
    pools = [
        kvpool_service(run_dir, f"kvpool-e{i + 1}", model, sizes.kvpool_pages, redis_url, events[i]) for i in range(2)
    ]
    fleet.start(pools, timeout_s=120)
    k1, k2 = (url_of(p) for p in pools)
    e1, e2 = start_engines(fleet, run_dir, model, sizes, [("vllm-e1", k1), ("vllm-e2", k2)])
    routers = [
        router_service(run_dir, "router-e", [e1, e2], "rr"),
        router_service(
            run_dir, "router-f-match", [e1, e2], "match", kvpools=f"{k1},{k2}", model=model, shared_tier=True
        ),
    ]
    if dynamo:
        indexer = indexer_service(run_dir)
        fleet.start([indexer], timeout_s=60)
        for instance, port in enumerate(events):
            register = {
                "instance_id": instance, "endpoint": f"tcp://127.0.0.1:{port}", "model_name": MODEL_NAME,
                "block_size": PAGE_SIZE,
            }  # fmt: skip
            httpx.post(f"{url_of(indexer)}/register", json=register, timeout=30).raise_for_status()
        routers.append(
            router_service(
                run_dir, "router-f", [e1, e2], "dynamo", indexer=url_of(indexer), model=model, shared_tier=True
            )
        )
    start_routers(fleet, routers)
    nodes = {"engines": [e1, e2], "kvpools": [k1, k2], "redis": redis_url, "kvpool_pids": [pid_of(p) for p in pools]}
    targets = [Target("e", routers[0], **nodes)]  # type: ignore[arg-type]
    if dynamo:
        targets.append(Target("f", routers[2], **nodes))  # type: ignore[arg-type]
    targets.append(Target("f-match", routers[1], **nodes))  # type: ignore[arg-type]
    return targets
