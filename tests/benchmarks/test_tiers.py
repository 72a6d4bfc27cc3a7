"""`kvpool bench tiers --quick` as a correctness check: every prefix comes back whole from each tier
(the benchmark asserts it), and the tiers lift the hit rate of a working set 4x the device pool.

No timing is asserted: speed is the benchmark's business, not the test suite's.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.pictures import assert_png
from tests.conftest import REPO


@pytest.mark.slow
def test_quick_run_restores_from_every_tier_and_reports_figures(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "service", "bench", "tiers", "--quick"]
    cmd += ["--json", str(tmp_path / "tiers.json"), "--plot", str(tmp_path / "tiers.png")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "working set 8 prefixes (x3.9)" in out
    result = json.loads((tmp_path / "tiers.json").read_text())
    assert result["kind"] == "tiers" and result["command"] == "kvpool bench tiers --quick", result
    assert [row["name"] for row in result["tiers"]] == ["host", "disk", "remote", "remote-mac"], result
    # The keyed MAC's cost, on restores paired with the checksum's (a figure, no target asserted here).
    assert re.search(
        r"restores paired .*\n  alternating\): wall time [+-]\d+%, this process's CPU time [+-]\d+%", out
    ), out
    # The writes' two paths, side by side (figures printed as saved, no speed asserted).
    writes = result["writes"]
    for name, label in (("own", "kvpool's connection"), ("redis-py", "redis-py's pipeline")):
        wall, cpu = writes[f"{name}_wall_ms_per_page"], writes[f"{name}_cpu_ms_per_page"]
        assert wall > 0 and cpu > 0, writes
        assert f"  {label:20} {wall:.3f} ms wall, {cpu:.3f} ms CPU of the writing thread" in out, out
    for tier, row in zip(("host", "disk", "remote"), result["tiers"]):
        pattern = rf"^{tier}\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+)%\s+(\d+\.\d)x"
        printed = re.search(pattern, out, re.M)
        assert printed, out
        saved = (row["restore_ms"], row["restore_gbs"], row["ceiling_ms"], 100 * row["of_ceiling"], row["vs_recompute"])
        assert printed.groups() == tuple(f"{x:.{d}f}" for x, d in zip(saved, (1, 2, 1, 0, 1))), (printed[0], row)
    alone = float(re.search(r"device pool alone: (\d+\.\d)%", out)[1])  # type: ignore[index]
    assert 0 < alone < 50
    for tier in ("host", "disk"):  # the spill tiers hold the whole working set: every prompt hits
        assert f"with the {tier} tier: 100.0%" in out, out
    remote = float(re.search(r"with the remote tier: (\d+\.\d)%", out)[1])  # type: ignore[index]
    assert remote >= 3 * alone, out
    assert {k: f"{100 * v:.1f}" for k, v in result["hit_rate"].items()} == {
        "device alone": f"{alone:.1f}",
        "host": "100.0",
        "disk": "100.0",
        "remote": f"{remote:.1f}",
    }
    assert_png(tmp_path / "tiers.png")
