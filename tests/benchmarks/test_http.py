"""`kvpool bench http` as a correctness check: a short run leaks nothing and reports its figures.

No timing is asserted: speed is the benchmark's business, not the test suite's.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.http import leak_checks, percentile
from tests.benchmarks.pictures import assert_png
from tests.conftest import REPO

ROUTES = [
    "POST /v1/sequences",
    "POST /v1/sequences/{seq_id}/append",
    "POST /v1/step",
    "DELETE /v1/sequences/{seq_id}",
]
FIGURES = re.compile(r"^(?P<route>\S+(?: \S+)?)\s+(?P<n>\d+)\s+(?P<p50>\d+\.\d+)\s+(?P<p99>\d+\.\d+)$", re.M)


@pytest.mark.slow
def test_short_runs_leak_nothing_and_report_figures(tmp_path: Path) -> None:
    """Two client counts on one server (latency against load); the JSON and the plot hold what was printed."""
    cmd = [sys.executable, "-m", "service", "bench", "http", "--seconds", "2", "--warmup", "0.5", "--clients", "2,4"]
    cmd += ["--num-pages", "128", "--json", str(tmp_path / "http.json"), "--plot", str(tmp_path / "http.png")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVPOOL_DEVICE": "cpu"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "FAIL" not in out, out
    runs = out.split("kvpool bench http: ")[1:]
    assert [run.split(" ", 1)[0] for run in runs] == ["2", "4"], out
    result = json.loads((tmp_path / "http.json").read_text())
    assert result["kind"] == "http" and result["command"].startswith("kvpool bench http --seconds 2 "), result
    assert "--json" not in result["command"] and len(result["runs"]) == 2, result
    for run, saved in zip(runs, result["runs"]):
        assert "server: a separate process (`python -m service serve`" in run
        for check in ("pages_used 0 == 0", "used + cached + free = 128 == num_pages 128", "num_sequences 0 == 0"):
            assert f"check PASS: {check}" in run, run
        assert "check PASS: no 5xx (0)" in run and "check PASS: no transport errors (0)" in run, run

        rows = {m["route"]: m for m in FIGURES.finditer(run)}
        for route in [*ROUTES, "all"]:
            assert route in rows, f"{route} missing from\n{run}"
            assert float(rows[route]["p50"]) <= float(rows[route]["p99"]), run
        total = int(rows["all"]["n"])
        assert total == sum(int(m["n"]) for r, m in rows.items() if r != "all"), run
        throughput = re.search(r"throughput: (\d+) requests in [\d.]+ s = (\d+) requests/s", run)
        assert throughput and int(throughput.group(1)) == total, run
        assert re.search(r"server CPU: \d+ us/request", run), run
        assert re.search(r"target (PASS|MISS): \d+ requests/s >= 2000", run), run
        assert re.search(r"target (PASS|MISS): p99 [\d.]+ ms < 50 ms", run), run
        # the JSON keeps the printed figures
        assert saved["requests"] == total and saved["checks_passed"] is True
        assert f"{saved['requests_per_s']:.0f}" == throughput.group(2)
        assert (f"{saved['p50_ms']:.2f}", f"{saved['p99_ms']:.2f}") == (rows["all"]["p50"], rows["all"]["p99"])
        assert {r: s["requests"] for r, s in saved["routes"].items()} == {
            r: int(m["n"]) for r, m in rows.items() if r != "all"
        }
    assert_png(tmp_path / "http.png")


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
