"""The fleet's processes: kvpool servers, vLLM OpenAI servers, redis-server, Dynamo's KV indexer, routers.

Each runs in its own session (process group) with its log in the run's directory, is started by this
module and stopped by it (SIGINT, then SIGKILL of its group after a grace period), also when the
benchmark fails: `Fleet` is a context manager. Every address is 127.0.0.1 (the benchmark runs in a
network namespace of its own where it can: `__main__.py`).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.processes import stop
from benchmarks.vllm_engine import FIXED_MALLOC  # glibc's malloc thresholds fixed, as in every vLLM benchmark

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "serving-llama"
BLOCK_SIZE = 32  # vLLM's CPU attention: a multiple of 32
PAGE_SIZE = 16  # kvpool's page: its default; the indexer's block_size
# --realtime: the kvpool servers and redis-server (or one of the two) run under SCHED_FIFO (`chrt -f 1`, root),
# ahead of the engines' forward passes, which on this machine take the cores a GPU node leaves to the CPU: a
# diagnostic of how much of kvpool's time is waiting for a core (docs/fleet.md, "What the load found"); Redis
# alone ahead stands for a store on a host of its own.
PRIORITY: dict[str, list[str]] = {"kvpool": [], "redis": []}
REALTIME = ["chrt", "-f", "1"]


# --executor: how each engine runs its model. "uni" (the default since session 24): the model runs in vLLM's
# scheduler process (its UniProcExecutor, as vLLM runs a single GPU), the whole server pinned to the engine's core.
# "mp", vLLM CPU's own default: the model in a worker process of its own, its threads bound to the core; the worker
# and the scheduler wait for each other's messages on a shared-memory queue by spinning (sched_yield) for a second
# after each one, so under load an engine takes a core and a half (docs/fleet.md, "What the load found").
EXECUTORS = ("uni", "mp")
ENGINE = {"executor": "uni"}


def set_executor(name: str) -> None:
    ENGINE["executor"] = name


def set_realtime(which: str | bool) -> None:
    """--realtime: the services `which` names ("both", "kvpool" or "redis"; False: none) start under SCHED_FIFO."""
    for name in PRIORITY:
        PRIORITY[name] = list(REALTIME) if which in ("both", name) else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    name: str
    cmd: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    health: str | None = None  # a URL answering 200 once the service is ready
    cores: frozenset[int] | None = None  # the CPUs it (and every process it starts) may run on; None: any
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "Service":
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **self.env}
        cores = self.cores
        pin = None if cores is None else lambda: os.sched_setaffinity(0, cores)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=pin,
            )  # fmt: skip
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.proc
            if proc is None:  # stopped meanwhile (the benchmark is stopping)
                raise RuntimeError(f"{self.name} was stopped before it was ready")
            if proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({proc.returncode}) before it was ready: see {self.log}")
            if self.health is None:
                return
            try:
                if httpx.get(self.health, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s: see {self.log}")

    def stop(self, grace_s: float = 20) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:  # its own process group: the server and the children it started
            stop(proc, signal.SIGINT, grace_s, group=True)


def kvpool_service(
    run_dir: Path, name: str, model: Path, num_pages: int, remote_url: str = "", events_port: int = 0
) -> Service:
    port = free_port()
    env: dict[str, str] = {}
    if remote_url:
        env["KVPOOL_REMOTE_URL"] = remote_url
    if events_port:
        # Bound (a wildcard): the indexer connects. Only loopback exists in the benchmark's network namespace.
        # Dynamo's indexer reads 64-bit block hashes only (README: Cache-aware routing).
        env |= {"KVPOOL_KV_EVENTS_ENDPOINT": f"tcp://*:{events_port}", "KVPOOL_KV_EVENTS_HASH_FORMAT": "int"}
    cmd = [*PRIORITY["kvpool"], sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--model", str(model), "--num-pages", str(num_pages), "--page-size", str(PAGE_SIZE)]
    return Service(name, cmd, run_dir / f"{name}.log", env, f"http://127.0.0.1:{port}/healthz")


def vllm_service(
    run_dir: Path, name: str, model: Path, kv_cache_bytes: int, max_len: int, kvpool_url: str, core: int
) -> Service:
    """A vLLM OpenAI server computing on one core (`core`, an index into the CPUs this process may use): two
    replicas on two cores are two devices, rather than two sets of spinning OpenMP threads taking turns on both.
    Its executor is ENGINE's (--executor): "uni" pins the whole server to the core, "mp" binds the worker's threads."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--seed", "0"]
    cmd += ["--block-size", str(BLOCK_SIZE), "--max-model-len", str(max_len), "--dtype", "float32"]
    cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes), "--enforce-eager", "--enable-prefix-caching"]
    cmd += ["--uvicorn-log-level", "warning"]
    if kvpool_url:
        transfer = {
            "kv_connector": "KVPoolConnector", "kv_connector_module_path": "service.integrations.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"kvpool_url": kvpool_url},
        }  # fmt: skip
        cmd += ["--kv-transfer-config", json.dumps(transfer)]
    # VLLM_SERVER_DEV_MODE: POST /reset_prefix_cache between runs.
    env = {"VLLM_SERVER_DEV_MODE": "1", **FIXED_MALLOC}
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[core % len(cpus)]  # (one CPU: every engine on it)
    cores = None
    if ENGINE["executor"] == "mp":
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    else:
        # vLLM CPU runs the UniProcExecutor only with VLLM_ENABLE_V1_MULTIPROCESSING=0 (which the API server, always
        # apart from its scheduler process, does not otherwise read); its OpenMP threads are then not bound: one
        # thread, and the process pinned.
        cmd += ["--distributed-executor-backend", "uni"]
        env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
        cores = frozenset({cpu})
    return Service(name, cmd, run_dir / f"{name}.log", env, f"http://127.0.0.1:{port}/health", cores)


def redis_service(run_dir: Path, maxmemory: int) -> Service:
    port = free_port()
    cmd = [*PRIORITY["redis"], "redis-server", "--port", str(port), "--bind", "127.0.0.1"]
    cmd += ["--save", "", "--appendonly", "no"]
    cmd += ["--maxmemory", str(maxmemory), "--maxmemory-policy", "allkeys-lru"]
    return Service("redis", cmd, run_dir / "redis.log")


def indexer_service(run_dir: Path) -> Service:
    port = free_port()
    cmd = [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"]
    return Service("indexer", cmd, run_dir / "indexer.log", {}, f"http://127.0.0.1:{port}/health")


def router_service(run_dir: Path, name: str, backends: list[str], policy: str, **options: Any) -> Service:
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.serving.router", "--port", str(port), "--policy", policy]
    cmd += ["--backends", ",".join(backends), "--log", str(run_dir / f"{name}.requests.jsonl")]
    for key, value in options.items():
        cmd += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])  # True: a flag
    return Service(name, cmd, run_dir / f"{name}.log", {}, f"http://127.0.0.1:{port}/router/health")


def pid_of(service: Service) -> int:
    assert service.proc is not None, f"{service.name} is not running"
    return service.proc.pid


def url_of(service: Service) -> str:
    """The service's base URL, from its --port."""
    return f"http://127.0.0.1:{service.cmd[service.cmd.index('--port') + 1]}"


class Fleet:
    """Services started together and stopped together, in reverse order (also when the body raises)."""

    def __init__(self) -> None:
        self.services: list[Service] = []

    def start(self, services: list[Service], timeout_s: float) -> None:
        for service in services:
            self.services.append(service.start())
        for service in services:
            service.wait_ready(timeout_s)

    def stop(self, services: list[Service] | None = None) -> None:
        for service in reversed(services if services is not None else list(self.services)):
            service.stop()
            self.services.remove(service)

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
