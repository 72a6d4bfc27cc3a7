"""The GPU check's record: checks (pass/fail with their error), figures, targets, written as results.json
beside a log; and the time guard every part consults."""

import json
import math
import time
from pathlib import Path
from typing import Any, TextIO


class Report:
    def __init__(self, outdir: Path, budget_s: float, dry_run: bool) -> None:
        outdir.mkdir(parents=True, exist_ok=True)
        self.path = outdir / "results.json"
        self.log: TextIO = open(outdir / "log.txt", "a")  # closed by close()
        self.budget_s = budget_s
        self.deadline = time.monotonic() + budget_s
        self.dry_run = dry_run
        self.sweep_only: list[str] = []  # --sweep-only (sweep.py)
        self.data: dict[str, Any] = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "dry_run": dry_run,
            "env": {},
            "parts": {},
            "checks": [],
            "figures": [],
            "targets": [],
        }

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def check(self, part: str, name: str, ok: bool, **detail: Any) -> bool:
        self.data["checks"].append({"part": part, "name": name, "ok": bool(ok), **_plain(detail)})
        extra = " ".join(f"{k}={_short(v)}" for k, v in detail.items())
        self.say(f"  {'PASS' if ok else 'FAIL'} {part}: {name} {extra}".rstrip())
        return bool(ok)

    def figure(self, part: str, name: str, value: float | None, unit: str, **detail: Any) -> float | None:
        """A measured value; None (null in the JSON) where nothing was timed (the dry run)."""
        value = None if value is None or not math.isfinite(value) else float(value)
        self.data["figures"].append({"part": part, "name": name, "value": value, "unit": unit, **_plain(detail)})
        shown = "n/a" if value is None else f"{value:.4g}"
        self.say(f"  {part}: {name} = {shown} {unit}")
        return value

    def target(self, name: str, value: float | None, op: str, bound: float, unit: str) -> None:
        """`value op bound` (op '>=' or '<='); n/a where value is None."""
        ok = None if value is None else (value >= bound if op == ">=" else value <= bound)
        self.data["targets"].append({"name": name, "value": value, "op": op, "bound": bound, "unit": unit, "ok": ok})
        verdict = "n/a" if ok is None else ("PASS" if ok else "FAIL")
        shown = "n/a" if value is None else f"{value:.4g}"
        self.say(f"TARGET {verdict}: {name}: {shown} {unit} ({op} {bound:g})")

    def save(self) -> None:
        self.data["failed_checks"] = sum(not c["ok"] for c in self.data["checks"])
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)

    def close(self) -> None:
        self.save()
        self.log.close()


def _plain(detail: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe: NaN and infinities become null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in detail.items()}


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
