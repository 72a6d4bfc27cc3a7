"""kvpool in a fleet: vLLM replicas under concurrent traffic from real clients, with and without kvpool.

    python -m benchmarks.serving [--quick] [--out DIR]        (or: kvpool bench serving [--quick])

Starts everything on this machine (vLLM OpenAI servers, kvpool servers, redis-server, Dynamo's KV
indexer, routing proxies), drives each configuration with `vllm bench serve` (prefix_repetition, Poisson
arrivals at each rate) and LMCache's multi-round QA, replays 20 sampled requests of each run one at a
time on that configuration and on vLLM alone (greedy: the tokens must be identical), checks that every
kvpool page was released, and writes DIR/serving.json and two plots. The configurations (phases.py):
a) one vLLM alone, b) one vLLM + kvpool, c) two vLLM round robin, d) two vLLM sharing one kvpool,
e) two nodes (kvpool + vLLM each) sharing Redis, f) e routed by prefix through Dynamo's KV indexer
(f-match: by kvpool's POST /v1/prefix/match). Two phases, e and f, then a to d on four engines at once;
within a phase the configurations alternate at every rate, each run starting from emptied caches (vLLM's,
kvpool's, Redis).

It runs in a network namespace of its own (`unshare -n`, loopback only) where it can: Dynamo's indexer
binds every interface, and no port of the fleet can collide with another process's. Without one, it runs
on the host's loopback and leaves Dynamo's indexer (configuration f) out.
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.serving import clients, holders, measure, phases
from benchmarks.serving.clients import Workload
from benchmarks.serving.fleet import EXECUTORS, REPO, Fleet, set_executor, set_realtime
from benchmarks.serving.model import ModelShape, make_model
from benchmarks.serving.phases import Sizes, Target
from benchmarks.serving.targets import BENCH, check_targets, percentile

NETNS_ENV = "KVPOOL_SERVING_NETNS"
# Requests replayed per configuration, one at a time, greedy, then on vLLM alone: half from its bench runs
# (split evenly over the rates), half from its multi-round QA run.
REPLAYS = 20
SEED = 0
WARM_UP = (2, 4)  # prefixes, and requests per prefix, of each configuration's warm-up (at most the workload's)


def profile(quick: bool) -> tuple[ModelShape, Sizes, Workload, list[float]]:
    """The model, the caches' sizes, the load and the request rates: full, or --quick (CI: counts only)."""
    if quick:
        shape = ModelShape(layers=2, hidden=128, kv_heads=2, max_len=1024)
        work = Workload(
            prefix_len=128, suffix_len=32, num_prefixes=2, output_len=4, per_prefix=5, users=2, rounds=2,
            system_prompt=64, user_history=32, answer_len=4, qa_qps=2, qa_time_s=3,
        )  # fmt: skip
        sizes = Sizes(
            kv_cache_bytes=2048 * shape.kv_bytes_per_token, max_len=1024, kvpool_pages=512, redis_bytes=64 << 20
        )
        return shape, sizes, work, [4.0]
    # A prefill of the bench's 544 tokens takes 0.1-0.4 s on one core here (as loaded as the machine is).
    shape = ModelShape(layers=8, hidden=512, kv_heads=2, max_len=1536)
    # The bench: 16 prefixes, each back 4 times (64 prompts, shuffled). vLLM's own cache holds under 3 of its
    # prompts, so vLLM alone finds a prefix only when one of the last two or three prompts shared it: with 8
    # prefixes x 8 (session 12) that was 0.30 of the prompt tokens, and kvpool's ceiling, 7/8 of the prefixes'
    # tokens, only 2.7x as much. The QA's shared system prompt is a small part of each prompt, as in LMCache's
    # own runs of it (1,000 tokens against a user history of 20,000): most of a prompt is the user's own
    # context and history. (Session 12 also ran 12 prefixes x 6 and the QA at 1 request/s:
    # docs/benchmarks-history.md.)
    work = Workload(
        prefix_len=512, suffix_len=32, num_prefixes=16, output_len=16, per_prefix=4, users=8, rounds=4,
        system_prompt=128, user_history=768, answer_len=16, qa_qps=1.5, qa_time_s=25,
    )  # fmt: skip
    # vLLM's own cache: 1,600 tokens (the longest prompt, 1,536, and its null block; under 3 of the bench's
    # 544-token prompts, of 16 prefixes; one of the QA's 8 users' ~1,000-token histories); kvpool's pool:
    # 64,000 tokens (every prefix and history).
    sizes = Sizes(kv_cache_bytes=1600 * shape.kv_bytes_per_token, max_len=1536, kvpool_pages=4000, redis_bytes=1 << 30)
    # 4 req/s: where one engine alone (a) queues, its p50 TTFT over 3x its unloaded one (session 16, on a fast
    # hour: 3 req/s gave 2.9x, as 2.5 had in session 12), on this machine however fast it runs; 2, half of it.
    return shape, sizes, work, [2.0, 4.0]


@dataclass
class Session:
    """What every run of the benchmark shares."""

    bench: clients.BenchRunner
    work: Workload
    run_dir: Path
    model: Path
    runs: list[dict[str, Any]] = field(default_factory=list)


def run_once(
    session: Session, target: Target, client: str, rate: float, replays: int, unloaded: bool = False
) -> dict[str, Any]:
    work, run_dir = session.work, session.run_dir
    measure.wait_idle(target.kvpools)
    measure.reset(target.engines, target.kvpools, target.redis)
    before = measure.snapshot(target.engines, target.kvpools)
    cpu_before = measure.cpu_times(target.kvpool_pids)
    routed_before = measure.router_stats(target.url)
    log_start = len(target.log.read_text().splitlines()) if target.log.exists() else 0
    label = f"{target.name}-{'unloaded' if unloaded else client}-{rate:g}"
    began = time.monotonic()
    if client == "bench":
        result = clients.bench_serve(
            session.bench, target.url, session.model, run_dir / f"{label}.json", work, rate, SEED, unloaded
        )
    else:
        result = clients.multi_round_qa(target.url, run_dir / f"{label}.csv", work)
    pages_left = measure.wait_idle(target.kvpools)
    after = measure.snapshot(target.engines, target.kvpools)
    cpu_after = measure.cpu_times(target.kvpool_pids)
    lines = [json.loads(line) for line in target.log.read_text().splitlines()[log_start:]]
    server = measure.summarize({k: measure.delta(after[k], before[k]) for k in after})
    ttft, itl = result["ttft_s"], result["itl_s"]
    proxy_failures = sum(1 for line in lines if line["status"] != 200 or line["error"])
    run = {
        "config": target.name, "client": result["client"], "rate": rate, "unloaded": unloaded, "label": label,
        "requests": result["requests"], "completed": result["completed"], "proxied": len(lines),
        "prompt_tokens_client": result["prompt_tokens"],
        "failed": result["failed"] + proxy_failures,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p90_ms": 1e3 * percentile(ttft, 90),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft) if ttft else float("nan"),
        "ttft_ms": [round(1e3 * t, 2) for t in ttft],  # per request, in the client's order (the intervals)
        "itl_p50_ms": 1e3 * percentile(itl, 50),
        "output_tok_s": result["output_tokens"] / result["duration_s"] if result["duration_s"] else 0.0,
        "req_s": result["completed"] / result["duration_s"] if result["duration_s"] else 0.0,
        "wall_s": time.monotonic() - began, "server": server, "kvpool_pages_used_after": pages_left,
    }  # fmt: skip
    run["router"] = measure.routing(routed_before, measure.router_stats(target.url))
    run["holders"] = holders.by_holder(lines)  # where each prompt was held when routed, from the proxy's log
    # The servers' counters cover every request the engines served meanwhile, the clients' own warm-ups among them
    # (LMCache's QA client first sends one request of 100 new tokens per user), which the clients leave out of
    # their counts: per request here is per request the proxy passed on.
    served = len(lines)
    if server["kvpool_http_requests"] and served:
        bookkeeping(run, server, served)
        # kvpool's servers (all their threads, the whole run): CPU time, and time runnable waiting for a core.
        run["kvpool_cpu_ms_per_request"] = (cpu_after[0] - cpu_before[0]) / 1e6 / served
        run["kvpool_cpu_wait_ms_per_request"] = (cpu_after[1] - cpu_before[1]) / 1e6 / served
    run["samples"] = replay_here(target, lines, replays)
    print(summary_line(run), flush=True)
    return run


def bookkeeping(run: dict[str, Any], server: dict[str, Any], served: int) -> None:
    """kvpool's own time per request (of the `served` ones) against the mean TTFT: the connector's calls and
    checks (its lookups, the appends of its saves, the loads and saves less their K/V copies, the frees: HTTP
    round trips and waits) as vLLM's side measured them, and kvpool's HTTP handling as the server measured it. A
    lookup's restore from the remote tier is in both, from asking the store what it holds to reading those pages
    into the pool: reported beside as well (kvpool_tier_lookup/restore_ms_per_request), not taken off."""
    c = server["connector"]
    connector_ns = c.get("lookup_ns", 0) + c.get("append_ns", 0) + c.get("load_ns", 0) - c.get("load_copy_ns", 0)
    connector_ns += c.get("save_ns", 0) - c.get("save_copy_ns", 0) + c.get("release_ns", 0)
    run["connector_ms_per_request"] = connector_ns / 1e6 / served
    run["kvpool_http_ms_per_request"] = 1e3 * server["kvpool_http_s"] / served
    run["kvpool_tier_lookup_ms_per_request"] = 1e3 * server.get("kvpool_tier_lookup_s", 0.0) / served
    run["kvpool_restore_ms_per_request"] = 1e3 * server.get("kvpool_tier_load_s", 0.0) / served
    run["kvpool_restore_wait_ms_per_request"] = 1e3 * server.get("kvpool_tier_load_wait_s", 0.0) / served
    worst = max(run["connector_ms_per_request"], run["kvpool_http_ms_per_request"])
    run["kvpool_bookkeeping_fraction"] = worst / run["ttft_mean_ms"]


def replay_here(target: Target, lines: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """`count` of the run's requests, replayed one at a time (greedy) through the configuration."""
    samples = []
    for record in measure.sample_requests(lines, count, SEED):
        ids = measure.prompt_ids(target.engines[0], record)
        max_tokens = min(16, int(record["body"].get("max_tokens") or 16))
        samples.append(
            {"prompt_ids": ids, "max_tokens": max_tokens, "tokens": measure.generate(target.url, ids, max_tokens)}
        )
    return samples


def summary_line(run: dict[str, Any]) -> str:
    s = run["server"]
    return (
        f"{run['label']:<28} {run['completed']:>4}/{run['requests']:<4} failed {run['failed']}  TTFT p50 "
        f"{run['ttft_p50_ms']:8.1f} p99 {run['ttft_p99_ms']:8.1f} mean {run['ttft_mean_ms']:8.1f} ms  ITL p50 "
        f"{run['itl_p50_ms']:6.1f} ms  {run['output_tok_s']:6.1f} tok/s  cached {s['cached_fraction']:.2f} "
        f"(vLLM {s['cached_tokens_vllm']:.0f}, kvpool {s['cached_tokens_kvpool']:.0f} of {s['prompt_tokens']:.0f})  "
        f"kvpool hits {s['kvpool_hit_rate']:.2f}  pages left {run['kvpool_pages_used_after']}"
        + (f"  routing {route:.1f} ms/request" if (route := run["router"]["route_ms_per_request"]) else "")
        + held_line(run["holders"])
    )


def held_line(classes: dict[str, dict[str, Any]]) -> str:
    """Where the prompts were held (holders.py) where some were held elsewhere: counts, and p50 to the first byte."""
    if not classes["restored"]["requests"]:
        return ""
    parts = [f"{n} {c['requests']} ({c['first_byte_p50_ms']:.0f} ms)" for n, c in classes.items() if c["requests"]]
    return "  held: " + ", ".join(parts)


TOP_UP_STEP = 1.5  # each rate a and b run at once more is this times the highest a ran at
TOP_UP_TRIES = 2  # at most this many such rates


def top_up_rate(runs: list[dict[str, Any]]) -> float | None:
    """1.5 times the highest rate a ran the bench at, where its p50 TTFT stayed under 3x its unloaded one at
    every rate; else None (a was loaded enough, or has not run). A step, not a leap: the target is judged at
    the lowest rate where a is loaded 3x, and far past it b queues as well (session 19's first run doubled
    4 req/s to 8, where b took 10.4 s to serve 8 s of arrivals)."""
    idle = [r["ttft_p50_ms"] for r in runs if r["config"] == "a" and r["unloaded"]]
    a_runs = [r for r in runs if r["config"] == "a" and r["client"] == BENCH and not r["unloaded"]]
    if not idle or not a_runs or any(r["ttft_p50_ms"] >= 3 * idle[0] for r in a_runs):
        return None
    return TOP_UP_STEP * max(r["rate"] for r in a_runs)


def warm_up(session: Session, targets: list[Target], rate: float) -> None:
    """A few requests through each configuration before its first measured run, not recorded (as `vllm bench
    serve --num-warmups`): other prompts (another seed) with shared prefixes, so that every engine, kvpool
    server and router has served a prefill, a hit, a save and a load. Each engine's first requests ran
    slower (an idle fleet's first miss took 287 ms, its fourth 186, session 21), and each configuration's
    first run came first on its engines. The measured runs empty the caches before they start."""
    prefixes, per_prefix = WARM_UP
    work = replace(
        session.work,
        num_prefixes=min(prefixes, session.work.num_prefixes),
        per_prefix=min(per_prefix, session.work.per_prefix),
    )
    for target in targets:
        measure.reset(target.engines, target.kvpools, target.redis)
        out = session.run_dir / f"{target.name}-warmup.json"
        clients.bench_serve(session.bench, target.url, session.model, out, work, rate, SEED + 1)
        measure.wait_idle(target.kvpools)


def run_phase(session: Session, targets: list[Target], rates: list[float], unloaded: bool, top_up: bool) -> None:
    """The phase's runs, alternating, after a warm-up of each configuration. unloaded: a's unloaded TTFT first
    (targets[0] is a). top_up: where a's p50 stayed under 3x its unloaded TTFT at every rate (a fast hour: the
    b-vs-a target is judged only where a is loaded that much), a and b once more, alternating, at 1.5 times the
    highest rate (twice at most)."""
    runs = session.runs
    warm_up(session, targets, max(rates))
    if unloaded:
        runs.append(run_once(session, targets[0], "bench", 0.0, 2, unloaded=True))
    samples = max(1, REPLAYS // 2 // len(rates))
    for i, rate in enumerate(rates):
        order = targets if i % 2 == 0 else targets[::-1]  # alternating: the machine's drift falls on each alike
        for target in order:
            runs.append(run_once(session, target, "bench", rate, samples))
    pair = [t for t in targets if t.name in ("a", "b")]
    for tries in range(TOP_UP_TRIES if unloaded and top_up and [t.name for t in pair] == ["a", "b"] else 0):
        extra = top_up_rate(runs)
        if extra is None:
            break
        print(f"a's p50 stayed under 3x its unloaded TTFT at every rate: a and b once more at {extra:g} req/s")
        for target in pair if (len(rates) + tries) % 2 == 0 else pair[::-1]:
            runs.append(run_once(session, target, "bench", extra, samples))
    for target in targets if len(rates) % 2 == 0 else targets[::-1]:
        runs.append(run_once(session, target, "qa", session.work.qa_qps, REPLAYS // 2))


def reference_replays(engine: str, runs: list[dict[str, Any]]) -> None:
    """Each run's samples replayed on vLLM alone (configuration a's engine): identical tokens expected."""
    for run in runs:
        same = 0
        for sample in run["samples"]:
            sample["reference"] = measure.generate(engine, sample["prompt_ids"], sample["max_tokens"])
            same += sample["reference"] == sample["tokens"]
        run["replays"] = len(run["samples"])
        run["replays_identical"] = same


def in_namespace() -> bool:
    """Re-runs this command in a network namespace of its own (loopback only) if it can; False where
    it cannot (then the fleet runs on the host's loopback, without Dynamo's indexer)."""
    if os.environ.get(NETNS_ENV):
        return True
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        return False
    command = " ".join(["exec", sys.executable, "-m", "benchmarks.serving", *map(_quote, sys.argv[1:])])
    env = {**os.environ, NETNS_ENV: "1"}
    child = subprocess.Popen(["unshare", "-n", "sh", "-c", f"ip link set lo up && {command}"], env=env)
    try:
        raise SystemExit(child.wait())
    except KeyboardInterrupt:  # (SIGTERM too: main's handler) the child stops its fleet, then we return
        child.send_signal(signal.SIGINT)
        raise SystemExit(child.wait()) from None


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvpool bench serving", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model and a few requests per configuration (CI)")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "docs" / "fleet",
        help="serving.json and the plots (docs/fleet.md shows them)",
    )
    parser.add_argument(
        "--logs", type=Path, default=Path(tempfile.gettempdir()) / "kvpool-serving-logs",
        help="every process's log and every client's raw output (emptied first)",
    )  # fmt: skip
    parser.add_argument(
        "--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvpool-serving-model",
        help="where the random model is written (once per shape)",
    )  # fmt: skip
    parser.add_argument("--rates", type=float, nargs="*", help="request rates for vllm bench serve (req/s)")
    parser.add_argument(
        "--configs", nargs="*", choices=list(phases.CONFIGS), metavar="CONFIG",
        help=f"only these configurations ({', '.join(phases.CONFIGS)}; default all; a to d's engines always "
        "start: every replay is compared with vLLM alone, on a's)",
    )  # fmt: skip
    parser.add_argument(
        "--no-netns", action="store_true", help="run on the host's loopback (Dynamo's indexer left out)"
    )
    parser.add_argument(
        "--realtime", nargs="?", const="both", default=False, choices=["both", "kvpool", "redis"],
        help="kvpool servers and redis-server (or only those named) under SCHED_FIFO (chrt -f 1; root): a "
        "diagnostic, not the benchmark",
    )  # fmt: skip
    parser.add_argument(
        "--executor", default="uni", choices=EXECUTORS,
        help="uni: each engine's model in its scheduler process, the server pinned to its core (default); mp: "
        "vLLM CPU's own default, a worker process whose threads are bound to the core (its queue spins)",
    )  # fmt: skip
    parser.add_argument(
        "--report-only", action="store_true", help="judge and plot OUT/serving.json again (after a change here)"
    )
    args = parser.parse_args(argv)
    if args.report_only:
        write_report(json.loads((args.out / "serving.json").read_text()), args.out)
        return 0
    # SIGTERM (a timeout, CI) unwinds as Ctrl-C does: the fleet's processes are stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    namespaced = False if args.no_netns else in_namespace()
    set_realtime(args.realtime)
    set_executor(args.executor)
    shape, sizes, work, rates = profile(args.quick)
    rates = args.rates or rates
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = args.logs
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    model = make_model(args.model_dir / ("quick" if args.quick else "full"), shape)
    began = time.monotonic()
    print(f"kvpool in a fleet: model {shape}, {sizes}, {work}, rates {rates}, network namespace: {namespaced}")
    print(f"  under SCHED_FIFO: {args.realtime or 'nothing'}; engines' executor: {args.executor}")
    session = Session(clients.BenchRunner(run_dir / "vllm-bench.log"), work, run_dir, model)
    chosen = set(args.configs or phases.CONFIGS)
    phase_list: list[tuple[tuple[str, ...], Callable[[Fleet], list[Target]]]] = [
        (("e", "f", "f-match"), lambda fleet: phases.two_nodes(fleet, run_dir, model, sizes, dynamo=namespaced)),
        (("a", "b", "c", "d"), lambda fleet: phases.one_host(fleet, run_dir, model, sizes)),  # always: a's engine
    ]
    builders = [build for names, build in phase_list[:-1] if chosen.intersection(names)] + [phase_list[-1][1]]
    # --quick (no timing judged) starts each phase's processes while the phase before runs: the engines'
    # start-up, not the runs, is most of its time. The full run starts a phase once the last one has stopped.
    fleets = [Fleet() for _ in builders]
    starter = ThreadPoolExecutor(1)
    try:
        ahead = starter.submit(builders[0], fleets[0])
        for i, fleet in enumerate(fleets):
            targets = ahead.result()
            last = i + 1 == len(fleets)
            if args.quick and not last:
                ahead = starter.submit(builders[i + 1], fleets[i + 1])
            selected = [t for t in targets if t.name in chosen]
            if selected:
                first_a = last and selected[0].name == "a"
                run_phase(session, selected, rates, unloaded=first_a, top_up=not args.quick)
            if not last:
                fleet.stop()
                if not args.quick:
                    ahead = starter.submit(builders[i + 1], fleets[i + 1])
        reference_replays(targets[0].engines[0], session.runs)
    finally:
        # The processes first: a phase still starting then fails at once (its processes are gone) instead
        # of waiting for its engines; then whatever it started before it saw that.
        for fleet in fleets:
            fleet.stop()
        starter.shutdown(wait=True, cancel_futures=True)
        for fleet in fleets:
            fleet.stop()
        session.bench.close()
    runs = session.runs
    report = {
        "command": " ".join(["python -m benchmarks.serving", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "wall_s": time.monotonic() - began,
        "model": shape.__dict__, "sizes": sizes.__dict__, "workload": work.__dict__, "rates": rates,
        "configs": phases.CONFIGS, "network_namespace": namespaced, "realtime": args.realtime,
        "executor": args.executor, "runs": runs,
    }  # fmt: skip
    for run in runs:
        for sample in run["samples"]:
            del sample["prompt_ids"]  # long; the tokens and the reference stay
    write_report(report, args.out)
    print(f"{report['wall_s']:.0f} s")
    return 0


def write_report(report: dict[str, Any], out: Path) -> None:
    """The targets judged, serving.json and the plots written, the verdicts printed."""
    from benchmarks.serving.plots import hit_plot, ttft_plot
    from benchmarks.serving.targets import results_table

    (out / "serving.json").write_text(json.dumps(report, indent=1))  # the figures first, whatever follows
    report["targets"] = check_targets(report["runs"])
    (out / "serving.json").write_text(json.dumps(report, indent=1))
    ttft_plot(report["runs"], out / "serving_ttft.png")
    hit_plot(report["runs"], out / "serving_hits.png")
    for line in [*results_table(report["runs"]), "", *report["targets"]["lines"]]:
        print(line)
    print(f"wrote {out / 'serving.json'} and the plots")
