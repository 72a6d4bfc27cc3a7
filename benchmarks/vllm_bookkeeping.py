"""The connector's bookkeeping per lookup and per save, and kvpool's HTTP calls per request, for one or more
source trees side by side (old code against new), in alternating rounds on the same machine.

    python -m benchmarks.vllm_bookkeeping [--tree /tmp/kvpool-main --tree .] [--rounds 6 --batch 8]

Each tree gets its own `kvpool serve --model` and one vLLM engine (benchmarks/vllm_engine: in-process
engine core, vLLM's prefix cache off, so every prompt is looked up in kvpool), both run from that tree. Every
round sends each engine, in alternating order, a batch of prompts at once (one generate(): several requests
per step): half are fresh (misses, saved), half repeat a prompt of the round before with a new last page
(hits, loaded). Generated tokens fill more pages, so requests also make later saves. Per tree it prints, from
the connector's own counters (summed over the rounds): per lookup its time (lookup_ns, the scheduler waits),
per save the appends' time (append_ns, the step waits), the worker's time beyond the copies (save_ns -
save_copy_ns, on the connector's thread) and the releases (release_ns, on the scheduler's connector thread),
per lookup the loads' time beyond their copies (load_ns - load_copy_ns, the step waits); per request the
bookkeeping as benchmarks.serving counts it and what of the connector's time vLLM's step waits for; and from
kvpool's /metrics its HTTP calls per request and its own time per call, by route.
"""

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from benchmarks.processes import stop
from benchmarks.vllm_connector import make_model
from benchmarks.vllm_engine import REPO, Engine, engine_env

PAGE = 16
LABEL = re.compile(r'(\w+)="([^"]*)"')


class Side:
    """One tree's kvpool server and engine."""

    def __init__(self, tree: Path, model: Path, port: int, config: dict[str, Any]) -> None:
        self.tree, self.url = tree, f"http://127.0.0.1:{port}"
        env = engine_env(fixed_malloc=True, tree=tree)
        self.server = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--model", str(model), "--port", str(port),
             "--device", "cpu", "--num-pages", "8192", "--log-level", "warning"],
            cwd=tree, env=env,
        )  # fmt: skip
        for _ in range(300):
            try:
                if httpx.get(f"{self.url}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            raise RuntimeError(f"kvpool at {self.url} did not start")
        # A tree from before benchmarks/vllm_engine.py has the same engine in tests/integrations.
        new = (tree / "benchmarks" / "vllm_engine.py").exists()
        module = "benchmarks.vllm_engine" if new else "tests.integrations.vllm_engine"
        try:
            self.engine = Engine({**config, "kvpool_url": self.url}, None, env, wait=600, cwd=tree, module=module)
        except BaseException:
            stop(self.server)
            raise
        self.stats: Counter[str] = Counter()
        self.http: Counter[str] = Counter()
        self.requests = 0
        self.walls: list[float] = []

    def http_calls(self) -> Counter[str]:
        """kvpool's answered requests so far by method and route, and ("... ns") the time it took on them."""
        calls: Counter[str] = Counter()
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            for suffix, unit in (("_count{", ""), ("_sum{", " ns")):
                if line.startswith(f"kvpool_request_duration_seconds{suffix}"):
                    labels = dict(LABEL.findall(line))
                    value = float(line.rsplit(" ", 1)[1]) * (1e9 if unit else 1)
                    calls[f"{labels['method']} {labels['route']}{unit}"] += int(value)
        return calls

    def run(self, batch: list[list[int]]) -> None:
        before_http, began = self.http_calls(), time.perf_counter()
        self.engine.generate(*batch, timeout=600)
        self.walls.append(time.perf_counter() - began)
        self.stats = Counter(self.engine.stats)  # the connector's counters since the engine started
        self.http.update(self.http_calls() - before_http)
        self.requests += len(batch)

    def stop(self) -> None:
        self.engine.close()
        stop(self.server)


def report(side: Side, label: str) -> dict[str, Any]:
    s = side.stats
    lookups = max(1, s["lookups"])
    # Every save appends once: a call of its own, or an item of a step's batched call.
    n_saves = max(1, s["saves"] or sum(v for k, v in side.http.items() if k.endswith("/append")))
    per_request = 1e6 * side.requests
    bookkeeping = s["lookup_ns"] + s["load_ns"] - s["load_copy_ns"] + s["save_ns"] - s["save_copy_ns"] + s["release_ns"]
    figures = {
        "lookup_ms": s["lookup_ns"] / 1e6 / lookups,
        "append_ms_per_save": s["append_ns"] / 1e6 / n_saves,
        "save_beyond_copy_ms_per_save": (s["save_ns"] - s["save_copy_ns"]) / 1e6 / n_saves,
        "release_ms_per_save": s["release_ns"] / 1e6 / n_saves,
        "load_beyond_copy_ms_per_lookup": (s["load_ns"] - s["load_copy_ns"]) / 1e6 / lookups,
        # What benchmarks.serving counts as the connector's bookkeeping, and what of it vLLM's step waits for.
        "bookkeeping_ms_per_request": bookkeeping / per_request,
        "step_waits_ms_per_request": (s["lookup_ns"] + s["append_ns"] + s["load_ns"] - s["load_copy_ns"]) / per_request,
        "http_calls_per_request": {
            k: round(v / side.requests, 2) for k, v in sorted(side.http.items()) if not k.endswith(" ns")
        },
        "server_ms_per_call": {
            k: round(side.http[f"{k} ns"] / 1e6 / v, 3) for k, v in sorted(side.http.items()) if f"{k} ns" in side.http
        },
        "batch_wall_s_median": statistics.median(side.walls),
        "lookups": s["lookups"], "saved_tokens": s["saved_tokens"], "loaded_tokens": s["loaded_tokens"],
        "save_calls": n_saves,
    }  # fmt: skip
    print(f"{label}: {json.dumps(figures)}", flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", type=Path, help="a source tree (repeat; default: this one)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8, help="prompts per round (half hits after round 1)")
    parser.add_argument("--prompt", type=int, default=448)
    parser.add_argument("--new", type=int, default=40, help="tokens generated per prompt")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    trees = [t.resolve() for t in (args.tree or [REPO])]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_model(model, args.layers, args.hidden, "float32")
        config = {"model": str(model), "block_size": 32, "max_tokens": args.new, "max_model_len": 2048}
        sides = [Side(tree, model, 18500 + os.getpid() % 500 + 1000 * i, config) for i, tree in enumerate(trees)]
        try:
            previous: list[list[int]] = []
            for round_no in range(args.rounds):
                fresh = [[rng.randrange(3, 1024) for _ in range(args.prompt)] for _ in range(args.batch // 2)]
                hits = [p[:-PAGE] + [rng.randrange(3, 1024) for _ in range(PAGE)] for p in previous]
                batch = fresh + hits or fresh
                batch += [[rng.randrange(3, 1024) for _ in range(args.prompt)] for _ in range(args.batch - len(batch))]
                order = sides if round_no % 2 == 0 else sides[::-1]
                for side in order:
                    side.run(batch)
                previous = fresh
            for i, side in enumerate(sides):
                report(side, f"{i}:{side.tree}")
        finally:
            for side in sides:
                side.stop()


if __name__ == "__main__":
    main()
