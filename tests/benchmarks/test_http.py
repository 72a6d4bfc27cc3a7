"""`kvpool bench http` as a correctness check: a short run leaks nothing and reports its figures.

No timing is asserted: speed is the benchmark's business, not the test suite's.
"""

import os
import re
import subprocess
import sys

import pytest

from benchmarks.http import leak_checks, percentile
from tests.conftest import REPO

ROUTES = [
    "POST /v1/sequences",
    "POST /v1/sequences/{seq_id}/append",
    "POST /v1/step",
    "DELETE /v1/sequences/{seq_id}",
]
FIGURES = re.compile(r"^(?P<route>\S+(?: \S+)?)\s+(?P<n>\d+)\s+(?P<p50>\d+\.\d+)\s+(?P<p99>\d+\.\d+)$", re.M)


@pytest.mark.slow
def test_short_run_leaks_nothing_and_reports_figures() -> None:
    cmd = [sys.executable, "-m", "service", "bench", "http", "--seconds", "3", "--warmup", "1", "--clients", "4"]
    cmd += ["--num-pages", "128"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVPOOL_DEVICE": "cpu"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "server: a separate process (`python -m service serve`" in out
    for check in ("pages_used 0 == 0", "used + cached + free = 128 == num_pages 128", "num_sequences 0 == 0"):
        assert f"check PASS: {check}" in out, out
    assert "check PASS: no 5xx (0)" in out and "check PASS: no transport errors (0)" in out, out
    assert "FAIL" not in out, out

    rows = {m["route"]: m for m in FIGURES.finditer(out)}
    for route in [*ROUTES, "all"]:
        assert route in rows, f"{route} missing from\n{out}"
        assert float(rows[route]["p50"]) <= float(rows[route]["p99"]), out
    total = int(rows["all"]["n"])
    assert total == sum(int(m["n"]) for r, m in rows.items() if r != "all"), out
    throughput = re.search(r"throughput: (\d+) requests in [\d.]+ s = (\d+) requests/s", out)
    assert throughput and int(throughput.group(1)) == total, out
    assert re.search(r"server CPU: \d+ us/request", out), out
    assert re.search(r"target (PASS|MISS): \d+ requests/s >= 2000", out), out
    assert re.search(r"target (PASS|MISS): p99 [\d.]+ ms < 50 ms", out), out


def test_leak_checks_catch_a_leak() -> None:
    before = {"pages_used": 0, "num_sequences": 0}
    clean = {"pages_used": 0, "pages_cached": 5, "pages_free": 123, "num_pages": 128, "num_sequences": 0}
    assert all(ok for _, ok in leak_checks(before, clean, own_server=True))
    leaked = {**clean, "pages_used": 2, "pages_free": 121, "num_sequences": 1}
    assert [ok for _, ok in leak_checks(before, leaked, own_server=True)] == [False, True, False]
    lost = {**clean, "pages_free": 122}  # a page in no state at all
    assert [ok for _, ok in leak_checks(before, lost, own_server=True)] == [True, False, True]
    # A server named by --url may hold others' sequences: the baseline is what it held at the start.
    shared_before = {"pages_used": 2, "num_sequences": 1}
    assert all(ok for _, ok in leak_checks(shared_before, leaked, own_server=False))


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50.0, 99.0, 100.0)
    assert percentile([7.0], 99) == 7.0
