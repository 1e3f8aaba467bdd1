"""The chaos suite's result lines, repeated in the terminal summary so ``make test`` shows them."""

from __future__ import annotations

from typing import Any

from tests.chaos.harness import RESULTS, line


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if RESULTS:
        terminalreporter.write_sep("=", "chaos scenarios")
        for rec in RESULTS:
            terminalreporter.write_line(line(rec))
