"""Print the crash table (boundary -> runs -> invariant violations) at the end of the run."""

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
    from recoverable import _killpoints

    terminalreporter.section("crash table: boundary -> runs, invariant violations")
    for point in _killpoints.POINTS:
        runs, bad = summary.get(point, [0, 0])
        terminalreporter.write_line(f"{point:32s} runs={runs:3d} violations={bad}")
