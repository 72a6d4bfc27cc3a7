"""The two clients, run as their authors ship them, and what their outputs say per request.

- `vllm bench serve` (vLLM's own; `vllm_bench.py` says why it is started as a module): the
  `prefix_repetition` dataset (num_prefixes shared prefixes, a random suffix per request, shuffled),
  Poisson arrivals at a set rate, `--save-result --save-detailed`: per-request TTFT and inter-token gaps.
- LMCache's multi-round QA (benchmarks/third_party/multi_round_qa, unchanged): users join over time, each
  asks `rounds` questions after a shared system prompt and a user-specific context, its history (the
  answers included) growing every round; its CSV has one row per finished request (TTFT, generation time).
"""

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.processes import stop
from benchmarks.serving.fleet import MODEL_NAME, REPO

QA_DIR = REPO / "benchmarks" / "third_party" / "multi_round_qa"


@dataclass(frozen=True)
class Workload:
    prefix_len: int  # bench: tokens of each shared prefix
    suffix_len: int  # bench: tokens after it, per request
    num_prefixes: int
    output_len: int
    per_prefix: int  # bench: requests per prefix (the same requests at every rate)
    users: int  # QA: users in the system at once
    rounds: int
    system_prompt: int  # QA: "hi" words of the shared system prompt
    user_history: int  # QA: "hi" words of each user's own context
    answer_len: int
    qa_qps: float
    qa_time_s: int  # QA: how long it launches requests (it then waits for those in flight)

    @property
    def num_prompts(self) -> int:
        return self.num_prefixes * self.per_prefix


def run(cmd: list[str], log: Path, timeout_s: float, cwd: Path = REPO) -> None:
    with open(log, "ab") as out:
        done = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[2] if len(cmd) > 2 else cmd[0]} failed ({done.returncode}): see {log}")


class BenchRunner:
    """One `python -m benchmarks.serving.vllm_bench --runs-from-stdin` process for the whole benchmark
    (vLLM imported once); each run's output goes to its own log."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen[str] | None = None

    def run(self, argv: list[str], log: Path, timeout_s: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            with open(self.log, "ab") as out:
                cmd = [sys.executable, "-u", "-m", "benchmarks.serving.vllm_bench", "--runs-from-stdin"]
                self.proc = subprocess.Popen(
                    cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, text=True
                )
        assert self.proc.stdin is not None
        done = log.with_suffix(".done")
        done.unlink(missing_ok=True)
        start = self.log.stat().st_size
        self.proc.stdin.write(json.dumps({"argv": argv, "done": str(done)}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while not done.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"vllm bench serve died or timed out: see {self.log}")
            time.sleep(0.2)
        with open(self.log, "rb") as f:
            f.seek(start)
            log.write_bytes(f.read())
        if done.read_text() != "0":
            raise RuntimeError(f"vllm bench serve failed: see {log}")

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop(proc, None)  # its stdin closed: it leaves


def bench_serve(
    runner: BenchRunner, base_url: str, tokenizer: Path, out: Path, work: Workload, rate: float, seed: int,
    unloaded: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """One `vllm bench serve` run; its per-request results. `unloaded`: one request at a time, fresh
    random prompts as long as the workload's (no shared prefix): the TTFT of a miss on an idle fleet."""
    cmd = ["--backend", "openai", "--base-url", base_url]
    cmd += ["--endpoint", "/v1/completions", "--model", MODEL_NAME, "--tokenizer", str(tokenizer)]
    cmd += [
        "--seed",
        str(seed),
        "--ignore-eos",
        "--temperature",
        "0",
        "--disable-tqdm",
        "--ready-check-timeout-sec",
        "0",
    ]
    cmd += ["--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
    if unloaded:
        cmd += ["--dataset-name", "random", "--random-input-len", str(work.prefix_len + work.suffix_len)]
        cmd += ["--random-output-len", str(work.output_len), "--random-prefix-len", "0", "--random-range-ratio", "0"]
        cmd += ["--num-prompts", "4", "--max-concurrency", "1", "--request-rate", "inf"]
    else:
        cmd += ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(work.prefix_len)]
        cmd += ["--prefix-repetition-suffix-len", str(work.suffix_len)]
        cmd += ["--prefix-repetition-num-prefixes", str(work.num_prefixes)]
        cmd += ["--prefix-repetition-output-len", str(work.output_len)]
        cmd += ["--num-prompts", str(work.num_prompts), "--request-rate", str(rate), "--burstiness", "1"]
    runner.run(cmd, out.with_suffix(".log"), timeout_s=900)
    result = json.loads(out.read_text())
    ok = [not e for e in result["errors"]]
    return {
        "client": "vllm bench serve",
        "requests": len(result["errors"]),
        "completed": result["completed"],
        "failed": result["failed"],
        "duration_s": result["duration"],
        "ttft_s": [t for t, good in zip(result["ttfts"], ok) if good],
        "itl_s": [gap for gaps, good in zip(result["itls"], ok) if good for gap in gaps],
        "output_tokens": result["total_output_tokens"],
        "prompt_tokens": result["total_input_tokens"],
    }


def multi_round_qa(base_url: str, out: Path, work: Workload) -> dict[str, Any]:
    """One run of LMCache's multi-round QA; its per-request results (the CSV's rows)."""
    import csv

    cmd = [sys.executable, "multi-round-qa.py", "--num-users", str(work.users), "--num-rounds", str(work.rounds)]
    cmd += ["--shared-system-prompt", str(work.system_prompt), "--user-history-prompt", str(work.user_history)]
    cmd += ["--answer-len", str(work.answer_len), "--qps", str(work.qa_qps), "--model", MODEL_NAME]
    cmd += ["--base-url", f"{base_url}/v1", "--time", str(work.qa_time_s), "--output", str(out)]
    cmd += ["--log-interval", "3600"]
    run(cmd, out.with_suffix(".log"), timeout_s=work.qa_time_s + 600, cwd=QA_DIR)
    with open(out) as f:
        rows = list(csv.DictReader(f))
    launched = [float(r["launch_time"]) for r in rows]
    finished = [float(r["finish_time"]) for r in rows]
    generated = [int(float(r["generation_tokens"])) for r in rows]  # (pandas writes them as floats)
    itl = [float(r["generation_time"]) / (n - 1) for r, n in zip(rows, generated) if n > 1]
    return {
        "client": "LMCache multi-round QA",
        "requests": len(rows),
        "completed": len(rows),
        "failed": 0,  # it records finished requests only: the router's log counts the failures
        "duration_s": (max(finished) - min(launched)) if rows else 0.0,
        "ttft_s": [float(r["ttft"]) for r in rows],
        "itl_s": itl,  # per request: its mean gap (the CSV has no per-token times)
        "output_tokens": sum(generated),
        "prompt_tokens": None,  # its warm-up requests are not in the CSV
    }
