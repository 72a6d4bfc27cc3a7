"""What the chaos suite tried and what held, per area, summed over the session and printed at its end.

Each chaos test reports into `TALLY` before it asserts (so a failing run still shows its figures):
requests (well-formed calls), malformed inputs, faults injected (kills, slow or held connections, truncation
attempts) and failures (what did not hold: 5xx, crashes, leaks, hangs, wrong answers, slow answers over the
test's bound). tests/chaos/conftest.py prints the table after the run, with or without `-s`; README's
Reliability section quotes it.
"""

from dataclasses import dataclass, field


@dataclass
class Area:
    requests: int = 0
    malformed: int = 0
    faults: int = 0
    failures: int = 0
    held: list[str] = field(default_factory=list)  # one short line per check: what held, with its figures


class Tally:
    def __init__(self) -> None:
        self.areas: dict[str, Area] = {}

    def record(
        self, area: str, *, requests: int = 0, malformed: int = 0, faults: int = 0, failures: int = 0, held: str = ""
    ) -> None:
        row = self.areas.setdefault(area, Area())
        row.requests += requests
        row.malformed += malformed
        row.faults += faults
        row.failures += failures
        if held:
            row.held.append(held)

    def lines(self) -> list[str]:
        out = [f"{'area':<26} {'requests':>9} {'malformed':>9} {'faults':>7} {'failures':>8}"]
        for name, a in self.areas.items():
            out.append(f"{name:<26} {a.requests:>9,} {a.malformed:>9,} {a.faults:>7,} {a.failures:>8,}")
        for name, a in self.areas.items():
            out.extend(f"  {name}: {note}" for note in a.held)
        return out


TALLY = Tally()
