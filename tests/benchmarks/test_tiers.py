"""`kvpool bench tiers --quick` as a correctness check: every prefix comes back whole from each tier
(the benchmark asserts it), and the tiers lift the hit rate of a working set 4x the device pool.

No timing is asserted: speed is the benchmark's business, not the test suite's.
"""

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_quick_run_restores_from_every_tier_and_reports_figures() -> None:
    cmd = [sys.executable, "-m", "service", "bench", "tiers", "--quick"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "working set 8 prefixes (x3.9)" in out
    for tier in ("host", "disk", "remote"):
        assert re.search(rf"^{tier}\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+\s+\d+%\s+\d+\.\dx", out, re.M), out
    alone = float(re.search(r"device pool alone: (\d+\.\d)%", out)[1])  # type: ignore[index]
    assert 0 < alone < 50
    for tier in ("host", "disk"):  # the spill tiers hold the whole working set: every prompt hits
        assert f"with the {tier} tier: 100.0%" in out, out
    remote = float(re.search(r"with the remote tier: (\d+\.\d)%", out)[1])  # type: ignore[index]
    assert remote >= 3 * alone, out
