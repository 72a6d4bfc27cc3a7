"""The chaos suite's session summary: what each area tried and what held (tests/chaos/tally.py)."""

import pytest

from tests.chaos.tally import TALLY


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TALLY.areas:
        terminalreporter.write_sep("=", "chaos: what was tried and what held")
        for line in TALLY.lines():
            terminalreporter.write_line(line)
