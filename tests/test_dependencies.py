"""Every third-party module the package imports is declared in pyproject.toml (issue 19.9)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The package's folders: pyproject.toml's [tool.setuptools.package-dir].
PACKAGE_DIRS = tuple(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"].values()
)
NOT_RUNTIME_EXTRAS = {"dev", "bench"}  # test and benchmark tools, never imported by the package


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match is not None, requirement
    return _normalize(match.group(1))


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {_requirement_name(r) for r in project.get("dependencies", [])}
    for extra, requirements in project.get("optional-dependencies", {}).items():
        if extra not in NOT_RUNTIME_EXTRAS:
            names |= {_requirement_name(r) for r in requirements}
    return names


def _imported_top_level_modules() -> dict[str, str]:
    """Top-level module -> one file importing it (every import, at any depth)."""
    found: dict[str, str] = {}
    for directory in PACKAGE_DIRS:
        for path in sorted((ROOT / directory).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    found.setdefault(module.partition(".")[0], str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_declared() -> None:
    declared = _declared()
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    for module, where in _imported_top_level_modules().items():
        if module in sys.stdlib_module_names or module in ("recoverable", "__future__"):
            continue
        names = {_normalize(d) for d in distributions.get(module, [module])}
        if not names & declared:
            missing[module] = where
    assert missing == {}, f"imported but not declared in pyproject.toml: {missing}"
