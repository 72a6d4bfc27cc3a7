"""`pytest -m gpu` (every test marked gpu), then the rest of the suite that runs on the GPU machine, in what
the time guard leaves. Counts from pytest's JUnit XML; the tails of the runs go to the log.

tests/kernels' small tests run their kernels compiled on the GPU where there is one (tests/kernels/paged_data.py);
the other directories run with TRITON_INTERPRET=1 set here, as tests/conftest.py sets it where CUDA is absent
(their CPU pools run the kernels on CPU tensors). Directories whose tests need what does not travel (vLLM,
deploy tooling) are left out. The dry run only collects the gpu tests (here they would all skip).
"""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from benchmarks.gpu.report import Report

PART = "pytest"
TEST_TIMEOUT_S = 60
VERDICTS = (" PASSED", " FAILED", " ERROR", " SKIPPED", " XFAIL", " XPASS")
DRY_COLLECT = ["tests/tiers/test_tiers_cuda.py"]  # quick to collect, with gpu tests
NOT_CARRIED = ["--ignore=tests/deploy"]
CPU_SUITE = ["tests/core", "tests/engine", "tests/ipc", "tests/tiers", "tests/server", "tests/client"]


def pytest_run(report: Report, name: str, args: list[str], env: dict[str, str], timeout_s: float) -> None:
    xml = report.path.parent / f"pytest_{name}.xml"
    # (pytest-benchmark, in the GPU image, turns xdist's presence into a warning that -W error makes fatal.)
    # -v: each test's name and verdict as it ends, so a run the timeout cuts still says which failed;
    # --timeout: one hung test fails alone (pytest-timeout) instead of taking the run's time with it.
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "--tb=short", "-p", "no:cacheprovider", "-p", "no:benchmark"]
    cmd += [f"--timeout={TEST_TIMEOUT_S}", f"--junitxml={xml}", *args]
    report.say(f"  $ {' '.join(cmd[2:])} (timeout {timeout_s:.0f} s)")
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        output, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output, rc = _text(exc.stdout) + _text(exc.stderr), -1
    lines = output.splitlines()
    # Every verdict line (the names), then the end: the failures' short tracebacks and the summary.
    verdicts = [line for line in lines if "::" in line and any(v in line for v in VERDICTS)]
    report.say("\n".join([*verdicts, "...", *lines[-60:]])[-12000:])
    counts = junit_counts(xml)
    ok = (
        rc in (0, 5 if "--collect-only" in args else 0)
        and counts.get("failures", 0) == 0
        and counts.get("errors", 0) == 0
    )
    report.check(PART, f"{name}: pytest exit {rc}", ok, **counts)


def _text(out: bytes | str | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def junit_counts(xml: Path) -> dict[str, int]:
    if not xml.exists():
        return {}
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def run(report: Report, device: torch.device) -> None:
    env = {**os.environ}
    if report.dry_run:
        pytest_run(report, "gpu_collect", ["-m", "gpu", "--collect-only", *DRY_COLLECT], env, 120)
        return
    env.pop("TRITON_INTERPRET", None)  # the gpu tests compile their kernels for the device
    # tests/deploy needs the deploy tooling, which does not travel (their collection fails without it).
    pytest_run(report, "gpu", ["-m", "gpu", "tests", *NOT_CARRIED], env, max(30.0, report.left_s() - 60))
    left = report.left_s() - 15
    if left < 30:
        report.say(f"  the CPU suite: not run, {left:.0f} s left")
        return
    xdist = ["-n", "12"] if _has("xdist") else []
    pytest_run(report, "kernels_compiled", ["-m", "not gpu", *xdist, "tests/kernels"], env, left / 2)
    left = report.left_s() - 15
    if left < 30:
        report.say(f"  the CPU suite: not run, {left:.0f} s left")
        return
    env["TRITON_INTERPRET"] = "1"
    pytest_run(report, "cpu_suite", ["-m", "not gpu", *xdist, *CPU_SUITE], env, left)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
