"""A worker's authorization policy that does not answer True or False fails that job,
visibly and typed, and sends nothing.

The probe: ``recoverable worker --authorizer`` whose callable raised failed silently (the
worker skipped the operation, asked again 30 s later, and the host's ``wait`` never
ended), and one that returned ``"yes"`` authorized a POST. Only ``True`` authorizes; an
exception or any other answer saves the operation's terminal failure
``authorization_failed`` (nothing spent), which ``wait`` raises as ``AuthorizationFailed``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

import recoverable

from .cli_helpers import REPO, child_env, cli_command
from .test_worker_cli import (  # noqa: F401 (the provider fixture)
    ACCOUNT,
    KEY_ENV,
    SCHEMA,
    backend,
    posts,
    provider,
    stop,
    submit_all,
)


@pytest.mark.parametrize("policy", ["raising", "says_yes"])
async def test_a_policy_that_does_not_answer_fails_the_job_typed_and_sends_nothing(
    tmp_path: Path, provider: dict[str, Any], policy: str  # noqa: F811
) -> None:
    path = tmp_path / "store"
    with recoverable.RecoveryStore.open(str(path)) as store:
        async with recoverable.open_runtime(store, backend(provider), account=ACCOUNT) as rt:
            (handle,) = await submit_all(rt, 1)
            proc = subprocess.Popen(  # noqa: ASYNC220 (started, not awaited)
                cli_command(
                    "worker", "--store", str(path), "--endpoint", provider["http_url"],
                    "--mode", "sse", "--api-key-env", "WORKER_TEST_KEY", "--account",
                    ACCOUNT.account_id, "--authorizer", f"tests.cli.worker_authorizers:{policy}",
                ),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                env={**child_env(), **KEY_ENV},
            )
            try:
                with trio.fail_after(30), pytest.raises(recoverable.AuthorizationFailed) as failed:
                    await rt.wait(handle, response=SCHEMA)
            finally:
                stop(proc)
            assert failed.value.operation_id == handle.operation_id
            status = await rt.status(handle)
            assert (status.state, status.attempts_used) == ("failed", 0)
            assert "manual_retry" in status.suggested_actions
        record = store.get_operation(handle.operation_id)
        assert record is not None and record.failure_reason == "authorization_failed"
        assert record.pending is None and store.queued() == []
    assert posts(provider)[handle.operation_id] == 0
    assert proc.stdout is not None
    report = json.loads(proc.stdout.read().splitlines()[-1])
    assert (report["claimed"], report["failed"], report["completed"]) == (1, 1, 0)
