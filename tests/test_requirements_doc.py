"""docs/requirements.md names the test that proves each requirement: every name must exist,
so the traceability table cannot silently point at a renamed or deleted test."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "requirements.md"


@functools.cache
def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    }


def test_every_test_named_in_the_requirements_exists() -> None:
    text = DOC.read_text(encoding="utf-8")
    named = re.findall(r"`([A-Za-z0-9_/]+\.py)(?:::([A-Za-z0-9_]+))?`", text)
    assert len(named) > 150, "the table should name the tests that prove each row"
    missing: list[str] = []
    for file, function in named:
        if not Path(file).name.startswith("test_"):
            continue  # a library module named in the text (``writer.py``), not a test file
        path = ROOT / "tests" / file
        if not path.exists():
            missing.append(file)
            continue
        if function and function not in _tests_in(path):
            missing.append(f"{file}::{function}")
    assert not missing, f"docs/requirements.md names tests that do not exist: {missing}"
