"""Names from the domain, not from history: no library module points to a tracker issue
("issue 15", "Issue 36:"). The tracker is not part of the repository; a comment says
the idea it is about (reattachment, the hard timeout, ...), and why."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("src/recoverable", "actors", "storage", "transport")
TRACKER_REFERENCE = re.compile(r"\bissues?[ -]?#?\d+", re.IGNORECASE)


def test_no_library_module_names_a_tracker_issue() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for folder in LIBRARY
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text("utf-8").splitlines(), 1)
        if TRACKER_REFERENCE.search(line)
    ]
    assert found == [], "\n".join(found)
