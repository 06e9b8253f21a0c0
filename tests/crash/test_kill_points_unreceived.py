"""Crash-table row: "Server completed, but response never arrived locally".

The kill point ``stream.completed_unreceived`` fires at the client's first progress
report, i.e. while the response is being read: the fixture provider writes the whole
response (``response.created`` ... ``response.completed``) in one write before the
client can see its first event, so at that moment the server has completed and the
client has not read the final frame. A real SIGKILL there loses the response: the
attempt stays spent, no receipt exists, and resuming can only make an authorized
replacement within the remaining budget (seed: "The completion cannot be recovered
by this API").
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

import recoverable
from recoverable import _killpoints
from recoverable.testing import FixtureProvider, Reply

DRIVER = str(Path(__file__).with_name("host_driver.py"))
POINT = "stream.completed_unreceived"
ACCOUNT = recoverable.AccountBinding("acct-crash", "api-key")  # host_driver.py's account
MAX_ATTEMPTS = 3


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


@pytest.fixture(scope="module")
def provider_process() -> Iterator[dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from recoverable.fixture.provider import fixture_main;"
         " sys.exit(fixture_main(sys.argv[1:]))", "--port", "0"],
        stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    info: dict[str, Any] = json.loads(proc.stdout.readline())
    try:
        yield info
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _driver(tmp: Path, base_url: str, job: str, mode: str, kill_at: str | None) -> Any:
    env = dict(os.environ)
    env.pop("RECOVERABLE_KILL_AT", None)
    if kill_at is not None:
        env["RECOVERABLE_KILL_AT"] = kill_at
    return subprocess.run(
        [sys.executable, DRIVER, "--store", str(tmp / "store"), "--host-db", str(tmp / "host.db"),
         "--base-url", base_url, "--job", job, "--mode", mode,
         "--max-attempts", str(MAX_ATTEMPTS)],
        env=env, capture_output=True, text=True, timeout=60,
    )


def _log(requests_url: str, operation_id: str) -> list[dict[str, Any]]:
    log = httpx.get(requests_url, timeout=10).json()
    return [r for r in log if (r.get("attempt_id") or "").rsplit(".", 1)[0] == operation_id]


@pytest.mark.parametrize("mode", ["sse", "websocket"])
def test_sigkill_after_the_server_completed_before_the_client_read_it(
    provider_process: dict[str, Any], tmp_path: Path, mode: str
) -> None:
    job = f"unreceived-{mode}"
    killed = _driver(tmp_path, provider_process["http_url"], job, mode, POINT)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])

    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    try:
        [record] = store.inventory()[0]
        op_id = record.operation_id
        # The server produced a complete response for the one POST ...
        [post] = _log(provider_process["requests_url"], op_id)
        assert post["reply_kind"] == "synthesize" and post["attempt_id"] == f"{op_id}.1"
        # ... and nothing of it was saved: the attempt is spent, still "in flight".
        assert record.attempts_used == 1 and record.attempts[0].outcome == "in_flight"
        assert not record.has_completion and record.completed_at is None
        assert store.get_payload(op_id, "completion") is None

        async def status() -> recoverable.Status:
            async with recoverable.open_runtime(store, None, account=ACCOUNT) as rt:
                return await rt.status(recoverable.Handle(op_id))

        before = trio.run(status)
        assert before.state == "interrupted" and before.availability == "replacement_eligible"
        assert not before.has_saved_completion and before.attempts_remaining == MAX_ATTEMPTS - 1
        assert before.attempts[0].outcome == "interrupted"
    finally:
        store.close()

    finished = _driver(tmp_path, provider_process["http_url"], job, mode, None)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert json.loads(finished.stdout.strip().splitlines()[-1])["operation_id"] == op_id
    # Only an authorized replacement could recover: exactly one more POST.
    posts = _log(provider_process["requests_url"], op_id)
    assert [p["attempt_id"] for p in posts] == [f"{op_id}.1", f"{op_id}.2"]
    db = sqlite3.connect(tmp_path / "host.db")
    try:
        commits = db.execute("SELECT COUNT(*) FROM commit_log WHERE job=?", (job,)).fetchone()[0]
    finally:
        db.close()
    assert commits == 1
    store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
    try:
        disposition = store.get_disposition(op_id)
        assert disposition is not None and disposition.disposition == "acknowledged"
        assert disposition.attempts_used == 2
        assert store.check_integrity() == []
    finally:
        store.close()


async def test_the_kill_point_is_reached_before_the_final_frame_is_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The point is real, not nominal: it is hit while the stream is still being read
    (before the transport returned the completed response), never after it."""
    order: list[str] = []
    monkeypatch.setattr(_killpoints, "hit", order.append)

    class Recording:
        def __init__(self, inner: recoverable.ResponsesBackend) -> None:
            self._inner = inner

        @property
        def endpoint_id(self) -> str:
            return self._inner.endpoint_id

        @property
        def credentials(self) -> Any:
            return self._inner.credentials

        async def stream(self, body: bytes, **kwargs: Any) -> Any:
            outcome = await self._inner.stream(body, **kwargs)
            order.append("transport.returned")
            return outcome

    async with FixtureProvider.serve() as provider:
        provider.script([Reply.complete({"answer": 1, "note": "n"})])
        store = recoverable.RecoveryStore.open(str(tmp_path / "store"))
        try:
            backend = recoverable.ResponsesBackend(
                provider.http_url,
                credentials=recoverable.StaticCredentials("sk-x", account=ACCOUNT),
                mode="sse", endpoint_id="fixture",
            )
            async with recoverable.open_runtime(store, Recording(backend), account=ACCOUNT) as rt:
                handle = await rt.prepare(
                    recoverable.StructuredRequest(model="gpt-test", instructions="i", input="x"),
                    response=Answer, maximum_attempts=1,
                )

                async def approve(attempt: recoverable.Attempt) -> bool:
                    return True

                await rt.send_recovering(handle, response=Answer, authorize=approve)
        finally:
            store.close()
    assert POINT in order and "transport.returned" in order
    assert order.index(POINT) < order.index("transport.returned")
    assert order.index("transport.returned") < order.index("receipt.before_save")
