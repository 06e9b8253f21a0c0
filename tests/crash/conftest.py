"""Print the crash table (scenario/transport/boundary -> runs, violations) at the end."""

from __future__ import annotations

import sys

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    module = next(
        (m for name, m in list(sys.modules.items()) if name.endswith("test_kill_points")), None
    )
    summary: dict[str, list[int]] = getattr(module, "SUMMARY", {}) if module else {}
    if not summary:
        return
    terminalreporter.section("crash table: scenario/transport/boundary -> runs, violations")
    for key, (runs, bad) in summary.items():
        terminalreporter.write_line(f"{key:55s} runs={runs:3d} violations={bad}")
