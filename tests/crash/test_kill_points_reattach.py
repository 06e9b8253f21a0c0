"""Issue 15 in the crash suite: the realistic host (``host_driver.py --reattach``) is killed
with SIGKILL once its attempt's reattachment checkpoint (the response id) is durable, in
the middle of a long background generation; the restarted host reattaches — **zero new
POSTs**, one resume GET after the saved cursor — and commits the result exactly once,
over both backend modes (a WebSocket backend sends ``reattach=True`` attempts over HTTP).
The budget is one attempt: without reattachment the restart could not generate at all.
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
import pytest

import recoverable

DRIVER = str(Path(__file__).with_name("host_driver.py"))
POINT = "reattach.checkpoint_saved"
pytestmark = pytest.mark.both_stores


def _provider(*flags: str) -> Iterator[dict[str, Any]]:
    # 100 deltas, 10 ms apart: a generation of about a second, killed early in it.
    proc = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from recoverable.fixture.provider import fixture_main;"
         " sys.exit(fixture_main(sys.argv[1:]))", "--port", "0",
         "--deltas", "100:100", "--event-delay", "0.01", *flags],
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


@pytest.fixture(scope="module")
def provider_process() -> Iterator[dict[str, Any]]:
    yield from _provider()


@pytest.fixture(scope="module")
def object_provider_process() -> Iterator[dict[str, Any]]:
    """A provider that answers every resume GET with the response object (as the LiteLLM
    proxy does: ``stream`` and ``starting_after`` dropped)."""
    yield from _provider("--resumes-as-objects")


def _driver(
    tmp: Path, store: str, base_url: str, job: str, mode: str, kill_at: str | None
) -> Any:
    env = dict(os.environ)
    env.pop("RECOVERABLE_KILL_AT", None)
    if kill_at is not None:
        env["RECOVERABLE_KILL_AT"] = kill_at
    return subprocess.run(
        [sys.executable, DRIVER, "--store", store, "--host-db", str(tmp / "host.db"),
         "--base-url", base_url, "--job", job, "--mode", mode, "--max-attempts", "1",
         "--reattach"],
        env=env, capture_output=True, text=True, timeout=120,
    )


def _log(info: dict[str, Any], which: str, key: str, value: str) -> list[dict[str, Any]]:
    url = info["requests_url"].replace("/_fixture/requests", f"/_fixture/{which}")
    return [r for r in httpx.get(url, timeout=10).json()
            if str(r.get(key) or "").startswith(value)]


def _commits(tmp: Path, job: str) -> int:
    """How many times the host committed the job's result (its own database)."""
    db = sqlite3.connect(tmp / "host.db")
    try:
        count: int = db.execute(
            "SELECT COUNT(*) FROM commit_log WHERE job=?", (job,)).fetchone()[0]
    finally:
        db.close()
    return count


@pytest.mark.parametrize("mode", ["sse", "websocket"])
def test_sigkill_after_the_checkpoint_then_the_restart_reattaches_and_commits_once(
    provider_process: dict[str, Any], tmp_path: Path, store_location: str, mode: str
) -> None:
    job = f"reattach-{mode}"
    killed = _driver(tmp_path, store_location, provider_process["http_url"], job, mode, POINT)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    store = recoverable.RecoveryStore.open(store_location)
    try:
        [record] = store.inventory()[0]
        op_id = record.operation_id
        last = record.attempts[-1]
        assert last.outcome == "in_flight" and last.response_id is not None
        assert not record.has_completion and record.attempts_used == 1
        rid = last.response_id
    finally:
        store.close()
    [post] = _log(provider_process, "requests", "attempt_id", op_id)
    assert post["transport"] == "sse"  # background responses go over HTTP in both modes

    finished = _driver(tmp_path, store_location, provider_process["http_url"], job, mode, None)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert json.loads(finished.stdout.strip().splitlines()[-1])["operation_id"] == op_id
    assert len(_log(provider_process, "requests", "attempt_id", op_id)) == 1  # zero new POSTs
    resumes = _log(provider_process, "retrievals", "response_id", rid)
    assert [r["kind"] for r in resumes] == ["resume"]
    assert resumes[0]["starting_after"] is not None
    assert _commits(tmp_path, job) == 1
    store = recoverable.RecoveryStore.open(store_location)
    try:
        disposition = store.get_disposition(op_id)
        assert disposition is not None and disposition.disposition == "acknowledged"
        assert disposition.attempts_used == 1
        assert store.check_integrity() == []
    finally:
        store.close()


def test_sigkill_after_the_checkpoint_then_a_restart_behind_an_object_answering_proxy(
    object_provider_process: dict[str, Any], tmp_path: Path, store_location: str
) -> None:
    """The same kill, rerun against a server that answers the resume GET with the response
    object: read as a retrieve (polled while still generating), committed once, zero new
    POSTs (before: ``unexpected_content_type``, and with one attempt, no result at all)."""
    info = object_provider_process
    job = "reattach-object"
    killed = _driver(tmp_path, store_location, info["http_url"], job, "sse", POINT)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    finished = _driver(tmp_path, store_location, info["http_url"], job, "sse", None)
    assert finished.returncode == 0, finished.stderr[-3000:]
    op_id = json.loads(finished.stdout.strip().splitlines()[-1])["operation_id"]
    assert len(_log(info, "requests", "attempt_id", op_id)) == 1  # zero new POSTs
    gets = [r for r in httpx.get(info["retrievals_url"], timeout=10).json()
            if str(r.get("attempt_id") or "").startswith(op_id)]
    assert gets and gets[0]["kind"] == "resume" and gets[0]["answer"] == "object"
    assert all(get["answer"] == "object" for get in gets)  # then plain retrieves, if any
    assert _commits(tmp_path, job) == 1
