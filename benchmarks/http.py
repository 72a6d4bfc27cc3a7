"""`kvpool bench http`: concurrent clients against one server, then a leak check.

The server runs as its own process (`python -m service serve` on a free loopback port) unless
--url names one; the clients are asyncio tasks in this process, on uvloop when it is installed.
On a 2-core machine the two processes share the cores, so the figures are a floor for the server.
"""

import argparse
import asyncio
import math
import os
import random
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from benchmarks import report as results
from benchmarks.http_client import make_transport
from benchmarks.http_workload import Client, Geometry, Recorder
from benchmarks.processes import stop
from service.cli import free_port

TARGET_RPS = 2000.0
TARGET_P99_MS = 50.0
REPO = Path(__file__).resolve().parent.parent


def start_server(num_pages: int, extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m service serve` on a free loopback port; returns once /readyz answers 200."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "service", "serve", "--port", str(port), "--log-level", "warning"]
    cmd += ["--num-pages", str(num_pages)]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    with httpx.Client(base_url=url, timeout=5) as client:
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"kvpool serve exited with {proc.returncode}:\n{err}")
            try:
                if client.get("/readyz").status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                stop_server(proc)
                raise RuntimeError("kvpool serve did not become ready in 120 s")
            time.sleep(0.1)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    stop(proc, close=[proc.stderr])


def percentile(sorted_ms: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_ms:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_ms)))
    return sorted_ms[rank - 1]


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class Run:
    recorder: Recorder
    elapsed_s: float
    client_cpu_s: float
    server_cpu_s: float | None
    before: dict[str, Any]
    after: dict[str, Any]


async def run_clients(url: str, args: argparse.Namespace, num_clients: int, server_pid: int | None) -> Run:
    """Drive the clients for the time (or request) budget; then each frees what it holds."""
    # One connection per client, as one frontend process would hold.
    transports = [make_transport(args.client, url) for _ in range(num_clients)]
    try:
        status, body = await transports[0].send("GET", "/v1/pool")
        if status != 200:
            raise SystemExit(f"GET /v1/pool answered {status}: {body[:200]!r}")
        before = orjson.loads(body)
        geometry = Geometry.from_pool(before, num_clients)
        recorder = Recorder()
        per_client = max(1, args.max_requests // num_clients)
        tag = uuid.uuid4().hex[:8]
        clients = [
            Client(i, t, geometry, recorder, random.Random(args.seed * 1000 + i), tag) for i, t in enumerate(transports)
        ]
        start = time.perf_counter()
        recorder.timed_from = start + args.warmup
        deadline = recorder.timed_from + args.seconds
        runs = asyncio.gather(*(c.run(deadline, per_client) for c in clients))
        # The raw client has no per-request timeout (it would cost a task per request): one for the run.
        runs_done = asyncio.ensure_future(asyncio.wait_for(runs, args.warmup + args.seconds + 300))
        await asyncio.sleep(args.warmup)
        server_cpu0 = process_cpu_s(server_pid) if server_pid else None
        client_cpu0 = time.process_time()
        await runs_done
        elapsed, client_cpu = time.perf_counter() - recorder.timed_from, time.process_time() - client_cpu0
        server_cpu1 = process_cpu_s(server_pid) if server_pid else None
        server_cpu = server_cpu1 - server_cpu0 if server_cpu0 is not None and server_cpu1 is not None else None
        await asyncio.wait_for(asyncio.gather(*(c.free_all() for c in clients)), 300)
        after = orjson.loads((await transports[0].send("GET", "/v1/pool"))[1])
    finally:
        await asyncio.gather(*(t.close() for t in transports))
    return Run(recorder, elapsed, client_cpu, server_cpu, before, after)


def leak_checks(before: dict[str, Any], after: dict[str, Any], own_server: bool) -> list[tuple[str, bool]]:
    used, cached, free, total = (after[k] for k in ("pages_used", "pages_cached", "pages_free", "num_pages"))
    # A server of our own starts empty; one named by --url may hold others' sequences: compare to the start.
    want_used = 0 if own_server else before["pages_used"]
    want_seqs = 0 if own_server else before["num_sequences"]
    return [
        (f"pages_used {used} == {want_used}", used == want_used),
        (f"used + cached + free = {used + cached + free} == num_pages {total}", used + cached + free == total),
        (f"num_sequences {after['num_sequences']} == {want_seqs}", after["num_sequences"] == want_seqs),
    ]


def figures(run: Run, num_clients: int) -> dict[str, Any]:
    """Requests/s and p50/p99 of the run, overall and per route (what the JSON keeps)."""
    rec = run.recorder
    total = sum(len(v) for v in rec.latencies_ms.values())
    all_ms = sorted(ms for v in rec.latencies_ms.values() for ms in v)
    routes = {}
    for route in sorted(rec.latencies_ms):
        ms = sorted(rec.latencies_ms[route])
        routes[route] = {"requests": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)}
    return {
        "clients": num_clients,
        "requests": total,
        "seconds": run.elapsed_s,
        "requests_per_s": total / run.elapsed_s if run.elapsed_s > 0 else 0.0,
        "p50_ms": percentile(all_ms, 50),
        "p99_ms": percentile(all_ms, 99),
        "routes": routes,
    }


def report(run: Run, checks: list[tuple[str, bool]], num_clients: int) -> tuple[bool, dict[str, Any]]:
    """Print the figures and the verdicts; True when nothing leaked and nothing failed, and the figures."""
    rec, shown = run.recorder, figures(run, num_clients)
    total, rps, p50, p99 = shown["requests"], shown["requests_per_s"], shown["p50_ms"], shown["p99_ms"]
    print(f"{'route':<40} {'requests':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for route, row in shown["routes"].items():
        print(f"{route:<40} {row['requests']:>9} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f}")
    print(f"{'all':<40} {total:>9} {p50:>8.2f} {p99:>8.2f}")
    print(f"throughput: {total} requests in {run.elapsed_s:.2f} s = {rps:.0f} requests/s")
    if total:
        # CPU per request is what the contended wall clock hides: what one dedicated core would give.
        print(f"client CPU: {run.client_cpu_s / total * 1e6:.0f} us/request ({run.client_cpu_s:.1f} s)")
        if run.server_cpu_s is not None:
            per_request = run.server_cpu_s / total
            capacity = f", {1 / per_request:.0f} requests/s per core" if per_request > 0 else ""
            print(f"server CPU: {per_request * 1e6:.0f} us/request ({run.server_cpu_s:.1f} s){capacity}")
    print("status counts: " + ", ".join(f"{s}: {n}" for s, n in sorted(rec.statuses.items())))
    num_5xx = sum(n for s, n in rec.statuses.items() if s >= 500)
    num_4xx = sum(n for s, n in rec.statuses.items() if 400 <= s < 500)
    checks = [
        *checks,
        (f"no 5xx ({num_5xx})", num_5xx == 0),
        (f"no 4xx: every request of the workload is valid ({num_4xx})", num_4xx == 0),
        (f"no transport errors ({rec.transport_errors})", rec.transport_errors == 0),
    ]
    for line, ok in checks:
        print(f"check {'PASS' if ok else 'FAIL'}: {line}")
    for example in rec.error_examples[:5]:
        print(f"  error: {example}")
    print(f"target {'PASS' if rps >= TARGET_RPS else 'MISS'}: {rps:.0f} requests/s >= {TARGET_RPS:.0f}")
    print(f"target {'PASS' if p99 < TARGET_P99_MS else 'MISS'}: p99 {p99:.2f} ms < {TARGET_P99_MS:.0f} ms (all routes)")
    ok = all(ok for _, ok in checks)
    return ok, {**shown, "checks_passed": ok}


def _client_loop() -> str:
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


def main(args: argparse.Namespace) -> int:
    """One run per count of --clients (1,8,32: latency against load), all on the same server."""
    loop_name = _client_loop()
    counts: list[int] = args.clients if isinstance(args.clients, list) else [args.clients]
    proc = None
    if args.url:
        url, where = args.url.rstrip("/"), f"the server at {args.url}"
    else:
        proc, url = start_server(args.num_pages)
        where = f"a separate process (`python -m service serve`, pid {proc.pid}) on {url}"
    result = results.new_result("http", getattr(args, "argv", ["kvpool", "bench", "http"]))
    result["runs"] = []
    ok = True
    try:
        for i, num_clients in enumerate(counts):
            if i:
                print()
            budget = f"{args.seconds:g} s after {args.warmup:g} s of warm-up (at most {args.max_requests} requests)"
            print(f"kvpool bench http: {num_clients} clients for {budget}")
            print(f"server: {where}")
            kind = f"{args.client} HTTP/1.1"
            print(f"clients: {num_clients} asyncio tasks on {loop_name}, {kind}, in this process (pid {os.getpid()})")
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            cores = f"{os.cpu_count()} cores shared by server and clients"
            print(f"machine: {results.cpu_model()}, {cores}, load average {load}")
            run = asyncio.run(run_clients(url, args, num_clients, proc.pid if proc else None))
            passed, shown = report(run, leak_checks(run.before, run.after, own_server=proc is not None), num_clients)
            ok = ok and passed
            result["runs"].append(shown)
    finally:
        if proc is not None:
            stop_server(proc)
    result["targets"] = {"requests_per_s": TARGET_RPS, "p99_ms": TARGET_P99_MS}
    results.save(result, getattr(args, "json", None), getattr(args, "plot", None))
    return 0 if ok else 1
