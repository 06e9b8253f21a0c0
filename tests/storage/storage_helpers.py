"""Shared helpers of the storage tests (records, child processes)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

from recoverable.records import OperationRecord
from recoverable.types import AccountBinding, RetryPolicy

ACCOUNT = AccountBinding("acct-1", "api-key")
OTHER = AccountBinding("acct-2", "api-key")
CHILD = str(Path(__file__).with_name("storage_child.py"))


def make_op(op_id: str, **changes: Any) -> OperationRecord:
    fields: dict[str, Any] = {
        "operation_id": op_id,
        "account": ACCOUNT,
        "endpoint_id": "fixture",
        "created_at": 1_700_000_000.25,
        "maximum_attempts": 3,
        "model": "gpt-test",
        "format_name": "Answer",
        "format_hash": "sha256:abc",
        "body_hash": "sha256:def",
        "root_operation_id": op_id,
        "retry_policy": RetryPolicy(retryable_provider_codes=frozenset({"a", "b", "c", "zz"})),
    }
    fields.update(changes)
    return OperationRecord(**fields)


def spawn_child(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, CHILD, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def read_line(proc: subprocess.Popen[str], timeout: float = 60.0) -> str:
    """The child's next stdout line; fails the test if it dies or stays silent."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        raise AssertionError(f"child said nothing within {timeout}s")
    line = proc.stdout.readline()
    if not line:
        _, err = proc.communicate(timeout=timeout)
        raise AssertionError(f"child exited with {proc.returncode}: {err}")
    return line.strip()
