"""The package's shape, checked from the source (issue 13).

The import graph runs one way: values and machine (the core) -> storage and transport ->
actors -> the facade -> batch and CLI. Every import counts: module level, function-local
and under ``TYPE_CHECKING``. The machine and everything it imports use no I/O library.
No library module grows past ~600 lines (split by idea).

Package ``__init__`` modules that only gather names (``recoverable``, ``recoverable.storage``,
``recoverable.transport``, ``recoverable.cli``) are facades: ``from recoverable import errors``
is an import of ``recoverable.errors``; ``from recoverable import Runtime`` is an import of the
facade itself.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import recoverable

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 650

# Where each package's modules live on disk: [tool.setuptools.package-dir], the one place
# that says it (scripts/typecheck reads it too).
PACKAGE_DIRS = {
    package: ROOT / folder
    for package, folder in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
        "setuptools"]["package-dir"].items()
}

CORE = 0
STORAGE_TRANSPORT = 1
ACTORS = 2
FACADE = 3
CLI = 4

# Top-level modules of ``recoverable`` by layer (a module not named here fails the test:
# place it on purpose).
TOP_LEVEL = {
    "_killpoints": CORE,
    "body": CORE,
    "continuation": CORE,
    "contract": CORE,
    "error_base": CORE,
    "endpoint_rules": CORE,
    "errors": CORE,
    "failure_errors": CORE,
    "failure_text": CORE,
    "failure_policy": CORE,
    "lifecycle": CORE,
    "machine": CORE,
    "outcome": CORE,
    "partial": CORE,
    "output_types": CORE,
    "output_roots": CORE,
    "preconditions": CORE,
    "pricing": CORE,
    "reattachment": CORE,
    "records": CORE,
    "schema_graph": CORE,
    "sources_rules": CORE,
    "status": CORE,
    "strict_mode": CORE,
    "transitions": CORE,
    "wire_parameters": CORE,
    "types": CORE,
    "telemetry": STORAGE_TRANSPORT,
    "otel": STORAGE_TRANSPORT,
    "blocking": FACADE,
    "testing": FACADE,
    "__main__": CLI,
    # The one-call client is a batch host (its map draws the CLI's progress line).
    "client": CLI,
    "client_hosts": CLI,
}

IO_LIBRARIES = frozenset(
    {
        "anyio",
        "asyncio",
        "h11",
        "httpx",
        "lmdb",
        "psycopg",
        "selectors",
        "socket",
        "ssl",
        "subprocess",
        "trio",
        "trio_websocket",
        "wsproto",
    }
)


def _discover() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, directory in PACKAGE_DIRS.items():
        for path in sorted(directory.rglob("*.py")):
            if ".venv" in path.parts:
                continue
            relative = path.relative_to(directory).with_suffix("")
            parts = list(relative.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts]) if parts else package
            mapped = {name.rpartition(".")[2] for name in PACKAGE_DIRS if name != "recoverable"}
            if package == "recoverable" and parts and parts[0] in mapped:
                continue
            modules[name] = path
    return modules


MODULES = _discover()
FACADES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def _layer(module: str) -> int:
    parts = module.split(".")
    if module == "recoverable":
        return FACADE
    second = parts[1]
    if second in {"storage", "transport", "fixture"}:
        return STORAGE_TRANSPORT
    if second == "actors":
        return ACTORS
    if second in {"cli", "dashboard"}:
        return CLI
    assert second in TOP_LEVEL, f"place recoverable.{second} in a layer in tests/test_layers.py"
    return TOP_LEVEL[second]


def _imports(module: str) -> Iterator[tuple[str, int]]:
    """(imported name, line) for every import in the module, at any depth."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                yield (candidate if candidate in MODULES else source), node.lineno


def _internal_edges(module: str) -> Iterator[tuple[str, int]]:
    for name, line in _imports(module):
        if name in MODULES:
            yield name, line
        elif name.startswith("recoverable."):
            # ``import recoverable.x.y`` of a name that is not a module: its module.
            head = name
            while head not in MODULES and "." in head:
                head = head.rpartition(".")[0]
            yield head, line


def test_every_module_is_placed_in_a_layer() -> None:
    for module in MODULES:
        _layer(module)


def test_imports_run_one_way_between_layers() -> None:
    wrong = []
    for module in MODULES:
        if module in FACADES and module != "recoverable.cli":
            continue  # a facade gathers names from the layers below it
        layer = _layer(module)
        for target, line in _internal_edges(module):
            if target == module:
                continue
            if _layer(target) > layer:
                wrong.append(f"{module}:{line} imports {target} (a higher layer)")
            elif layer == STORAGE_TRANSPORT and target != "recoverable.telemetry":
                side = module.split(".")[1]
                other = target.split(".")[1]
                if {side, other} == {"storage", "transport"}:
                    wrong.append(f"{module}:{line} imports {target} (storage/transport are peers)")
    assert wrong == []


def test_module_graph_has_no_cycle() -> None:
    graph = {
        module: {
            target
            for target, _ in _internal_edges(module)
            if target != module and target not in FACADES
        }
        for module in MODULES
        if module not in FACADES
    }
    visiting: set[str] = set()
    done: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        if node in done:
            return
        if node in visiting:
            cycles.append([*trail[trail.index(node) :], node])
            return
        visiting.add(node)
        for target in sorted(graph.get(node, ())):
            visit(target, [*trail, node])
        visiting.discard(node)
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    assert cycles == []


def test_the_machine_and_what_it_imports_use_no_io_library() -> None:
    seen: set[str] = set()
    pending = ["recoverable.machine"]
    offenders = []
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.add(module)
        for name, line in _imports(module):
            root = name.split(".")[0]
            if root in IO_LIBRARIES:
                offenders.append(f"{module}:{line} imports {name}")
        for target, _ in _internal_edges(module):
            if target not in FACADES:
                pending.append(target)
    assert offenders == []
    assert "recoverable.records" in seen and "recoverable.outcome" in seen


def test_no_library_module_is_over_the_size_bound() -> None:
    long = {
        name: count
        for name, path in MODULES.items()
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_facade_still_gathers_the_public_names() -> None:
    for name in ("RecoveryStore", "open_runtime", "ResponsesBackend", "Interruption", "Handle"):
        assert hasattr(recoverable, name)


# One-letter names that are part of a public signature (a user may pass them as a keyword):
# renaming them would break callers, so they stay. (module, function, parameter)
PUBLIC_ONE_LETTER = frozenset({("recoverable.fixture.state", "wait_for_requests", "n")})


def _one_letter_bindings(module: str) -> Iterator[tuple[int, str, str]]:
    """(line, enclosing function, name) for every one-letter name the module binds: an
    assignment, loop, ``with``/``except`` or comprehension target, a parameter, a function
    or class name, an import alias. ``_`` is allowed."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    owners: dict[ast.AST, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            owner = getattr(node, "name", "<lambda>")
            for arg in ast.walk(node.args):
                owners[arg] = owner
    for node in ast.walk(tree):
        name: str | None = None
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            name = node.id
        elif isinstance(node, ast.arg):
            name = node.arg
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = node.name
        elif isinstance(node, ast.ExceptHandler):
            name = node.name
        elif isinstance(node, ast.alias):
            name = node.asname
        elif isinstance(node, ast.MatchAs | ast.MatchStar):
            name = node.name
        if name is not None and len(name) == 1 and name != "_":
            yield node.lineno, owners.get(node, ""), name


def test_no_one_letter_names_in_the_library() -> None:
    offenders = sorted(
        f"{module}:{line} {name}"
        for module in MODULES
        for line, owner, name in _one_letter_bindings(module)
        if (module, owner, name) not in PUBLIC_ONE_LETTER
    )
    assert offenders == []


def test_only_the_dashboard_s_server_app_and_security_import_its_web_dependencies() -> None:
    """The dashboard is its own subpackage (``recoverable.dashboard``); its web
    dependencies (the ``dashboard`` extra) are imported by its server, app and security
    modules only, so the CLI's bulk actions, which share its data and actions modules,
    never need them (``tests/cli/test_dashboard_extra.py`` runs them without it)."""
    web = {"starlette", "hypercorn"}
    allowed = {f"recoverable.dashboard.{name}" for name in ("server", "app", "security")}
    dashboard = [module for module in MODULES if module.startswith("recoverable.dashboard.")]
    assert allowed <= set(dashboard)
    offenders = [
        f"{module}:{line} imports {name}"
        for module in dashboard if module not in allowed
        for name, line in _imports(module) if name.split(".")[0] in web
    ]
    assert offenders == []
    outside = [
        f"{module}:{line} imports {name}"
        for module in MODULES if not module.startswith("recoverable.dashboard")
        for name, line in _imports(module) if name.split(".")[0] in web
    ]
    assert outside == []


def test_the_real_transports_never_import_the_fixture_provider() -> None:
    """The fixture provider (a test double of the provider) lives in its own room,
    ``recoverable.fixture``; the real transports and the actors never import it (the
    CLI's ``--endpoint fixture``, the one-call client and ``recoverable.testing`` do)."""
    fixture = [module for module in MODULES if module.startswith("recoverable.fixture.")]
    assert "recoverable.fixture.provider" in fixture
    users = [
        f"{module} imports {name}"
        for module in MODULES
        if module.startswith(("recoverable.transport", "recoverable.actors",
                              "recoverable.storage"))
        for name, _ in _internal_edges(module) if name.startswith("recoverable.fixture")
    ]
    assert users == []
