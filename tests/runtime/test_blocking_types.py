"""What ``mypy --strict`` sees in user code of ``BlockingRuntime`` and ``AsyncioRuntime``.

Both hosts forward the runtime's methods through one table (``blocking._RuntimeMethods``);
a user's type checker must still see each method's own parameters and result: blocking
ones on ``BlockingRuntime``, coroutines on ``AsyncioRuntime``. The snippet below is
checked by mypy as a user's module; its ``assert_type`` lines must hold and exactly the
lines marked ``# E`` must be errors.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import mypy  # noqa: F401  (a dev dependency: a missing mypy fails this module, never skips it)

ROOT = Path(__file__).resolve().parents[2]

USER_CODE = '''
from __future__ import annotations

from typing import assert_type

import msgspec

from recoverable import (
    AccountBinding,
    AsyncioRuntime,
    Attempt,
    BlockingRuntime,
    Handle,
    Inventory,
    Receipt,
    RecoveryStore,
    Status,
    StructuredRequest,
)


class Out(msgspec.Struct):
    answer: int


def allow(attempt: Attempt) -> bool:
    return True


def blocking(store: RecoveryStore, request: StructuredRequest) -> None:
    with BlockingRuntime(store, None, account=AccountBinding("a")) as runtime:
        handle = runtime.prepare(request, response=Out, maximum_attempts=3, scope="s")
        assert_type(handle, Handle)
        assert_type(runtime.send_recovering(handle, response=Out, authorize=allow), Out)
        assert_type(runtime.status(handle), Status)
        assert_type(runtime.receipt(handle), Receipt)
        assert_type(runtime.inventory(), Inventory)
        assert_type(runtime.inventory(scope="s"), Inventory)
        assert_type(runtime.acknowledge(handle), None)
        assert_type(runtime.abandon(handle), None)
        assert_type(runtime.suspend(handle), None)
        assert_type(runtime.retry(handle, retry_action_id="x", maximum_attempts=2), Handle)
        assert_type(runtime.sign_in(AccountBinding("b")), None)
        assert_type(runtime.sign_out(), None)
        runtime.prepare(request, response=Out, maximum_attempts="3")  # E
        runtime.prepare(request, response=Out, maximum_attempts=3, colour=1)  # E
        runtime.acknowledge("op")  # E
        runtime.suspend(handle, 1)  # E
        runtime.retry(handle, retry_action_id="x")  # E


async def in_asyncio(store: RecoveryStore, request: StructuredRequest) -> None:
    async with AsyncioRuntime(store, None, account=AccountBinding("a")) as runtime:
        handle = await runtime.prepare(request, response=Out, maximum_attempts=3)
        assert_type(handle, Handle)
        assert_type(await runtime.send_recovering(handle, response=Out, authorize=allow), Out)
        assert_type(await runtime.status(handle), Status)
        assert_type(await runtime.receipt(handle), Receipt)
        assert_type(await runtime.inventory(), Inventory)
        assert_type(await runtime.cancel(handle), None)
        assert_type(await runtime.sign_out(), None)
        view = runtime.blocking.asyncio()
        assert_type(view, AsyncioRuntime)
        assert_type(await view.retry(handle, retry_action_id="x", maximum_attempts=2), Handle)
        await runtime.abandon(handle, 2)  # E
        runtime.status(handle).state  # E
'''


def _link_tree(tree: Path) -> None:
    """The package as installed (as ``scripts/typecheck`` builds it)."""
    package = tree / "recoverable"
    package.mkdir()
    for path in (ROOT / "src" / "recoverable").iterdir():
        (package / path.name).symlink_to(path)
    for name in ("actors", "storage", "transport"):
        (package / name).symlink_to(ROOT / name)


def test_user_code_sees_each_forwarded_methods_own_signature(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    _link_tree(tree)
    user = tmp_path / "user_code.py"
    user.write_text(USER_CODE)
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental",
         "--cache-dir", str(tmp_path / "cache"), str(user)],
        cwd=tmp_path, env={"MYPYPATH": str(tree), "PATH": ""}, capture_output=True,
        text=True, timeout=600,  # generous: mypy on a machine shared by many jobs
    )
    errors = {
        int(match[1]) for match in re.finditer(r"user_code\.py:(\d+): error", run.stdout)
    }
    expected = {
        number for number, line in enumerate(USER_CODE.splitlines(), start=1)
        if line.endswith("# E")
    }
    assert errors == expected, run.stdout + run.stderr
