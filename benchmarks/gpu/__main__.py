"""`python -m benchmarks.gpu OUTDIR [--dry-run] [--budget-s S] [--parts ...]` (see __init__.py)."""

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.gpu.report import Report

if TYPE_CHECKING:  # torch is imported after --dry-run has set TRITON_INTERPRET
    import torch

PARTS = ["env", "kernels", "figures", "service", "probe", "pytest"]
# Seconds a part needs on an H100/H200 for it to start at all (the rest of the budget is the guard's).
NEEDS_S = {"env": 0, "kernels": 60, "figures": 60, "service": 45, "probe": 100, "pytest": 45}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__)
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="the same flow on the CPU: interpreter, tiny shapes")
    parser.add_argument("--budget-s", type=float, default=390, help="stop starting parts after this (default 390)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS)
    parser.add_argument(
        "--sweep-only",
        nargs="+",
        default=[],
        metavar="TEXT",
        help="kernels: only the sweep steps whose names contain one of these (e.g. 'D=256' 'mla')",
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device here; run with --dry-run for the CPU flow", file=sys.stderr)
        return 2
    report = Report(args.outdir, args.budget_s, args.dry_run)
    report.sweep_only = args.sweep_only
    device = torch.device("cpu" if args.dry_run else "cuda")
    report.say(f"benchmarks.gpu on {device} ({'dry run' if args.dry_run else 'GPU run'}), budget {args.budget_s:.0f} s")
    try:
        for name in args.parts:
            run_part(report, name, partial(run_named, name, report, device))
    finally:
        report.close()
    summary(report)
    return 1 if report.data["failed_checks"] else 0


def run_named(name: str, report: Report, device: "torch.device") -> None:
    part_function(name)(report, device)


def part_function(name: str) -> Callable[..., None]:
    """Imported lazily: a part's imports (Triton kernels, the server) must not break another part."""
    if name == "env":
        from benchmarks.gpu.env import run
    elif name == "kernels":
        from benchmarks.gpu.sweep import run
    elif name == "figures":
        from benchmarks.gpu.figures import run
    elif name == "service":
        from benchmarks.gpu.service_checks import run
    elif name == "probe":
        from benchmarks.gpu.probe import run
    else:
        from benchmarks.gpu.pytest_part import run
    return run


def run_part(report: Report, name: str, fn: Callable[[], None]) -> None:
    left = report.left_s()
    if left < (0 if report.dry_run else NEEDS_S[name]):
        report.data["parts"][name] = {"status": "skipped", "why": f"time guard: {left:.0f} s left"}
        report.say(f"== {name}: SKIPPED (time guard: {left:.0f} s left)")
        report.save()
        return
    report.say(f"== {name} ({left:.0f} s left)")
    began = time.monotonic()
    try:
        fn()
        status = "done"
    except Exception as exc:  # a broken part is recorded and the next one still runs
        report.say(traceback.format_exc())
        report.check(name, "part ran to its end", False, error=f"{type(exc).__name__}: {exc}"[:300])
        status = "error"
    report.data["parts"][name] = {"status": status, "seconds": round(time.monotonic() - began, 1)}
    report.save()


def summary(report: Report) -> None:
    data = report.data
    checks = data["checks"]
    report_lines = [f"\nsummary: {len(checks) - data['failed_checks']}/{len(checks)} checks passed"]
    report_lines += [f"  FAILED {c['part']}: {c['name']}" for c in checks if not c["ok"]][:30]
    report_lines += [f"  part {k}: {v}" for k, v in data["parts"].items()]
    for t in data["targets"]:
        verdict = "n/a" if t["ok"] is None else ("PASS" if t["ok"] else "FAIL")
        shown = "n/a" if t["value"] is None else f"{t['value']:.4g}"
        report_lines.append(f"  target {verdict}: {t['name']}: {shown} {t['unit']} ({t['op']} {t['bound']:g})")
    print("\n".join(report_lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
