"""The prepared GPU check's dry run: run.sh's whole flow on the CPU (Triton's interpreter, tiny shapes,
a real server, memfd in place of CUDA IPC), so the command still works the day a GPU is there."""

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks.gpu.__main__ import PARTS
from tests.conftest import REPO


@pytest.mark.slow
def test_the_dry_run_does_every_part_and_every_check_passes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", "benchmarks/gpu/run.sh", str(out), "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["dry_run"] is True and results["env"]["device"] == "cpu"
    assert {name: part["status"] for name, part in results["parts"].items()} == dict.fromkeys(PARTS, "done")
    checks = results["checks"]
    assert results["failed_checks"] == 0 and not [c for c in checks if not c["ok"]]
    # Every kernel of the sweep was compared, and every service area checked.
    names = " | ".join(c["name"] for c in checks)
    for kernel in ("store ", "store fp8", "store latent", "decode ", "decode lse", "prefill ", "attention fp8", "mla "):
        assert kernel in names, kernel
    for area in ("plain pool", "fp8 pool", "mla pool", "PoolLost", "host tier", "disk tier", "connector save",
                 "connector load", "gpu_collect"):  # fmt: skip
        assert area in names, area
    # The dry run times nothing: every figure and target is null, never a number standing in for a GPU's.
    assert results["figures"] and all(f["value"] is None for f in results["figures"])
    assert len(results["targets"]) >= 12 and all(t["value"] is None and t["ok"] is None for t in results["targets"])
    log = (out / "log.txt").read_text()
    assert "== service" in log and "gpu_collect: pytest exit 0" in log


def test_without_cuda_and_without_dry_run_it_refuses(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA path")
    from benchmarks.gpu.__main__ import main

    assert main([str(tmp_path)]) == 2
    assert not (tmp_path / "results.json").exists()
