"""`kvpool bench alloc --quick` runs end to end (a smoke run: the figures themselves are not judged here)."""

import re
import subprocess
import sys


def test_bench_alloc_quick_prints_every_figure() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "service", "bench", "alloc", "--quick"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for label in ("(a) alloc+free", "all misses", "pool full (evicting)", "all hits", "in process", "HTTP p50"):
        (line,) = [x for x in lines if label in x]
        assert re.search(r":\s+\d+\.\d+ (M pages/s|us|ms)\s+target (>=|<=) \d+\s+(PASS|MISS)$", line), line
