"""(d) One JSON file per operation record: the reference SDK's storage design.

Every state save writes the WHOLE record to a temporary file, fsyncs it,
renames it over ``<operation id>.json`` and fsyncs the directory — the
"synchronized temporary files and atomic replacement" of seed 000. A job makes
the same durable saves as ``recoverable``: prepare (with the frozen body),
attempt reserved (before the POST), attempt consumed (its outcome), receipt
(the validated payload), then — after the host commit — acknowledged (payload
dropped). Replacements are decided by the library's own rule. The blocking
file work runs in Trio worker threads (Trio's default limit of 40), so several
saves can be in flight at once, as an async host using such a store would do.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path
from typing import Any

import msgspec
import trio

import recoverable
from recoverable.body import freeze_body
from recoverable.contract import OutputInvalid, contract_for

from . import (
    MAX_ATTEMPTS,
    TOKEN,
    Answer,
    TrioHostLog,
    commit_line,
    fsync_dir,
    make_backend,
    replacement_delay,
    request_for,
    result_record,
    run_pool,
)


class JsonFileStore:
    """``save(record)``: temp file + fsync + atomic rename + directory fsync."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        self.saves = 0
        self.fsyncs = 0

    def save(self, record: dict[str, Any]) -> None:
        name = f"{record['operation_id']}.json"
        tmp = os.path.join(self.dir, f".{name}.{uuid.uuid4().hex}.tmp")
        data = msgspec.json.encode(record)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(self.dir, name))
        fsync_dir(self.dir)
        with self._lock:
            self.saves += 1
            self.fsyncs += 2

    def load(self, operation_id: str) -> dict[str, Any]:
        data = Path(self.dir, f"{operation_id}.json").read_bytes()
        record: dict[str, Any] = msgspec.json.decode(data)
        return record

    async def asave(self, record: dict[str, Any]) -> None:
        # Copy: the caller keeps mutating its record while the thread encodes it.
        await trio.to_thread.run_sync(self.save, dict(record))


async def run_job(
    store: JsonFileStore, backend: recoverable.ResponsesBackend, host: TrioHostLog, i: int
) -> bool:
    """One job through the file store; False if it ended without a value."""
    contract = contract_for(Answer)
    operation_id = f"op-{i}-{uuid.uuid4().hex[:12]}"
    body = freeze_body(request_for(i), contract)
    record: dict[str, Any] = {
        "version": 1, "operation_id": operation_id, "job_id": f"job-{i}", "revision": "r1",
        "account": "acct-bench", "body": body.decode(), "maximum_attempts": MAX_ATTEMPTS,
        "attempts_used": 0, "attempts": [], "state": "prepared",
    }
    await store.asave(record)  # prepare
    payload: bytes | None = None
    for number in range(1, MAX_ATTEMPTS + 1):
        attempt_id = f"{operation_id}.{number}"
        record["attempts_used"] = number
        record["pending_attempt"] = attempt_id
        record["state"] = "transmitting"
        await store.asave(record)  # attempt reserved (spent even if the POST never lands)
        outcome = await backend.stream(body, attempt_id=attempt_id, token=TOKEN)
        record["pending_attempt"] = None
        if isinstance(outcome, recoverable.Completed):
            record["attempts"].append({"id": attempt_id, "outcome": "completed"})
            record["state"] = "validating"
            await store.asave(record)  # attempt consumed
            try:
                payload = contract.validate(outcome.text)
            except OutputInvalid:
                record["state"] = "failed"
                await store.asave(record)
                return False
            record["state"] = "completed"
            record["receipt"] = payload.decode()
            await store.asave(record)  # receipt, before the value is returned
            break
        record["attempts"].append({"id": attempt_id, "outcome": outcome.kind})
        delay = replacement_delay(outcome, number)
        record["state"] = "waiting" if delay is not None else "failed"
        await store.asave(record)  # attempt consumed
        if delay is None:
            return False
        if delay > 0:
            await trio.sleep(delay)
    if payload is None:
        return False
    value = contract.decode(payload)
    assert isinstance(value, Answer)
    await host.commit(commit_line(i, value, operation_id))
    record["state"] = "acknowledged"
    record.pop("receipt", None)
    await store.asave(record)  # acknowledge (payload removed)
    return True


async def phase(
    *, base_url: str, mode: str, n: int, concurrency: int, warmup: int, workdir: str,
    cpu_seconds: Any, rss_mib: Any, posts: Any,
) -> dict[str, Any]:
    store = JsonFileStore(os.path.join(workdir, "records"))
    host = TrioHostLog(os.path.join(workdir, "host.log"))
    backend = make_backend(base_url, mode)
    failed = 0
    try:
        async with backend, trio.open_nursery() as nursery:
            await nursery.start(host.run)

            async def job(i: int) -> None:
                nonlocal failed
                if not await run_job(store, backend, host, i):
                    failed += 1

            await run_pool(warmup, concurrency, job, offset=n)
            failed = 0
            saves0, fsyncs0, host0 = store.saves, store.fsyncs, host.file.fsyncs
            posts0 = posts()
            cpu0 = cpu_seconds()
            elapsed, latencies = await run_pool(n, concurrency, job)
            cpu = cpu_seconds() - cpu0
            post_count = posts() - posts0
            nursery.cancel_scope.cancel()
    finally:
        host.file.close()
    return result_record(
        elapsed, latencies, cpu, rss_mib(), posts=post_count, failed=failed,
        saves=store.saves - saves0, fsyncs=store.fsyncs - fsyncs0,
        host_fsyncs=host.file.fsyncs - host0,
    )
