"""`kvpool bench alloc`: allocator throughput and step latency, against the targets of the issue.

(a) page allocations + frees per second, 4096-token prompts, prefix caching off;
(b) the same with prefix caching on (hash, lookup, allocate, commit, free): all misses, all hits;
(c) one step appending a token to each of 256 sequences with 4k-token contexts, LUT included:
    in process, and p50 over loopback HTTP against a `kvpool serve` subprocess.
All on a pool of 65,536 pages of 16 tokens; (a) and (b) print the best of 5 runs, (c) the median step.
"""

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from service.core.allocator import PageAllocator
from service.core.layout import lut_columns
from service.core.sequences import SequenceTable

NUM_PAGES, PAGE_SIZE, PROMPT, BATCH = 65_536, 16, 4096, 256
REPEATS = 5  # (a) and (b): best of this many runs
# Step contexts: ~3.6k tokens, staggered so that 1/16 of the sequences open a new page at each step,
# leaving room in the pool for a few hundred steps.
CONTEXT = 3584


def _context(i: int) -> int:
    return CONTEXT + i % PAGE_SIZE


def _table(prefix_caching: bool) -> SequenceTable:
    return SequenceTable(PageAllocator(NUM_PAGES, prefix_caching), PAGE_SIZE)


def bench_no_caching(rounds: int) -> float:
    """Pages per second: 128 prompts of 256 pages each allocated (one append each), then all freed."""
    table = _table(False)
    ids = [f"s{i}" for i in range(128)]
    pages = 0
    for rnd in range(rounds + 1):  # round 0 is a warm-up: the tables grow to 128 rows of 256 pages
        if rnd == 1:
            start = time.perf_counter()
        for seq_id in ids:
            table.create(seq_id)
            table.append(seq_id, PROMPT)
        for seq_id in ids:
            table.free(seq_id)
        pages += len(ids) * PROMPT // PAGE_SIZE if rnd else 0
    return pages / (time.perf_counter() - start)


def bench_prefix(rounds: int, hits: bool, full_pool: bool = False) -> float:
    """Pages per second through create(token_ids) -> append(token ids, data) -> free.

    full_pool: the pool is first filled with cached pages (untimed), so that every page a miss
    allocates is evicted from the prefix cache first: the steady state of a busy server."""
    table = _table(True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128_000, PROMPT).tolist() for _ in range(rounds + 1)]
    warm = [prompts[0]] if hits else []
    if full_pool:
        warm = [rng.integers(0, 128_000, PROMPT).tolist() for _ in range(NUM_PAGES * PAGE_SIZE // PROMPT)]
    for prompt in warm:  # fill the cache: with the prompt every round will hit, or with others
        table.create("warm")
        table.append("warm", PROMPT, prompt, data_written=True)
        table.free("warm")
    assert not full_pool or table.allocator.num_free == 0
    pages = 0
    start = time.perf_counter()
    for r in range(rounds):
        prompt = prompts[0] if hits else prompts[r + 1]
        seq = table.create("s", prompt)
        rest = prompt[seq.cached_tokens :] if seq.cached_tokens else prompt  # a miss sends the prompt as is
        table.append("s", len(rest), rest, data_written=True)
        table.free("s")
        pages += PROMPT // PAGE_SIZE
    elapsed = time.perf_counter() - start
    if hits:
        assert table.stats.prefix_hit_tokens == rounds * (PROMPT - PAGE_SIZE), "every round must hit"
    return pages / elapsed


def bench_step_in_process(steps: int) -> tuple[float, float]:
    """(median, fastest) seconds of one step: 256 sequences with 4k contexts append one token each,
    LUT built. The fastest is what the step costs when nothing else runs on the machine."""
    table = _table(True)
    ids = [f"seq-{i}" for i in range(BATCH)]
    for i, seq_id in enumerate(ids):
        table.create(seq_id)
        table.append(seq_id, _context(i))
    appends: list[tuple[str, int, list[int] | None]] = [(s, 1, None) for s in ids]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        result = table.step(appends)
        times.append(time.perf_counter() - t0)
    assert result.lookup_table.shape[0] == BATCH
    return statistics.median(times), min(times)


def bench_step_http(steps: int) -> float:
    """p50 seconds of POST /v1/step (256 appends, LUT back) over loopback against a real server."""
    import httpx
    import orjson

    from service.cli import free_port

    port = free_port()
    env = {
        **os.environ,
        "KVPOOL_NUM_PAGES": str(NUM_PAGES),
        "KVPOOL_PAGE_SIZE": str(PAGE_SIZE),
        "KVPOOL_NUM_LAYERS": "1",
        "KVPOOL_NUM_KV_HEADS": "1",
        "KVPOOL_HEAD_DIM": "8",
        "KVPOOL_DEVICE": "cpu",
    }
    cmd = [sys.executable, "-m", "service", "serve", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env)
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
        for _ in range(300):
            try:
                if client.get("/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        ids = [f"seq-{i}" for i in range(BATCH)]
        for i, seq_id in enumerate(ids):
            client.post("/v1/sequences", json={"seq_id": seq_id}).raise_for_status()
            client.post(f"/v1/sequences/{seq_id}/append", json={"num_tokens": _context(i)}).raise_for_status()
        # Encoded once, as a frontend with a fast encoder would: the time is the server's and the wire's.
        body = orjson.dumps({"appends": [{"seq_id": s, "num_tokens": 1} for s in ids]})
        headers = {"content-type": "application/json"}
        times = []
        for i in range(steps + 20):
            t0 = time.perf_counter()
            response = client.post("/v1/step", content=body, headers=headers)
            elapsed = time.perf_counter() - t0
            response.raise_for_status()
            if i >= 20:  # warm-up
                times.append(elapsed)
        max_pages = -(-(_context(PAGE_SIZE - 1) + steps + 20) // PAGE_SIZE)
        assert response.json()["lookup_table"]["shape"] == [BATCH, lut_columns(max_pages)]
        return statistics.median(times)
    finally:
        proc.terminate()
        proc.wait(30)


def best_of(run: Callable[[], float], repeats: int) -> float:
    """The best of `repeats` runs of a throughput benchmark, each on a fresh table (as timeit takes the
    minimum time): this VM's speed drifts by tens of percent within seconds, always downwards from
    what the code does when the machine runs it alone."""
    return max(run() for _ in range(repeats))


def _verdict(value: float, target: float, higher_is_better: bool = True) -> str:
    ok = value >= target if higher_is_better else value <= target
    return "PASS" if ok else "MISS"


def main(args: argparse.Namespace) -> int:
    quick = bool(getattr(args, "quick", False))
    repeats = 1 if quick else REPEATS
    cpu = platform.processor() or platform.machine()
    print(f"machine: {cpu}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"pool: {NUM_PAGES} pages of {PAGE_SIZE} tokens; prompts of {PROMPT} tokens ({PROMPT // PAGE_SIZE} pages)")
    a = best_of(lambda: bench_no_caching(2 if quick else 20), repeats)
    print(f"(a) alloc+free, prefix caching off : {a / 1e6:8.2f} M pages/s   target >= 10   {_verdict(a, 10e6)}")
    miss = best_of(lambda: bench_prefix(5 if quick else 200, hits=False), repeats)
    evicting = best_of(lambda: bench_prefix(5 if quick else 200, hits=False, full_pool=True), repeats)
    hit = best_of(lambda: bench_prefix(5 if quick else 400, hits=True), repeats)
    print(f"(b) prefix caching on, all misses  : {miss / 1e6:8.2f} M pages/s   target >= 1    {_verdict(miss, 1e6)}")
    verdict = _verdict(evicting, 1e6)
    print(f"    the same, pool full (evicting) : {evicting / 1e6:8.2f} M pages/s   target >= 1    {verdict}")
    print(f"(b) prefix caching on, all hits    : {hit / 1e6:8.2f} M pages/s   target >= 1    {_verdict(hit, 1e6)}")
    step, fastest = bench_step_in_process(20 if quick else 300)
    verdict = _verdict(step, 100e-6, False)
    print(f"(c) step, 256 seqs, in process     : {step * 1e6:8.1f} us          target <= 100  {verdict}")
    print(f"    (fastest of the steps          : {fastest * 1e6:8.1f} us)")
    http = bench_step_http(20 if quick else 300)
    verdict = _verdict(http, 5e-3, False)
    print(f"(c) step, 256 seqs, HTTP p50       : {http * 1e3:8.2f} ms          target <= 5    {verdict}")
    return 0
