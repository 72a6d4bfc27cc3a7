"""What a benchmark measured, kept as JSON (`--json PATH`) and drawn (`--plot PATH`, benchmarks/plots.py).

Every result is a dict with its `kind` (which drawing it gets), the `command` that made it, the UTC `date`
and the `machine` (CPU, cores, load and CPU pressure at the end of the run: this machine is shared, so a
figure without its load says little), then the figures of that kind.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
from pathlib import Path
from typing import Any

OUTPUT_FLAGS = ("--json", "--plot")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_pressure() -> float | None:
    """`/proc/pressure/cpu` some avg10 (%): the share of the last 10 s that something waited for a CPU."""
    try:
        first = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = dict(part.split("=", 1) for part in first.split()[1:])
    return float(fields["avg10"])


def machine() -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpu_pressure_avg10": cpu_pressure(),
    }


def command_without_outputs(argv: list[str]) -> str:
    """The command as a reader would rerun it: without --json/--plot and their paths."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in OUTPUT_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in OUTPUT_FLAGS)):
            kept.append(arg)
    return shlex.join(kept)


def new_result(kind: str, argv: list[str]) -> dict[str, Any]:
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "kind": kind,
        "command": command_without_outputs(argv),
        "date": now.strftime("%Y-%m-%d %H:%M UTC"),
        "source": "measured",
    }


def save(result: dict[str, Any], json_path: str | None, plot_path: str | None) -> None:
    """Write the result where --json asked and draw it where --plot asked (the machine as it is now)."""
    result.setdefault("machine", machine())
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
    if plot_path:
        from benchmarks.plots import draw

        draw(result, plot_path)
