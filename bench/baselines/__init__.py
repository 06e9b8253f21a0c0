"""Shared pieces of the comparative harness (``bench/harness.py``).

Every system runs the SAME workload: job ``i`` asks "Question i" with the
``Answer`` contract, its body frozen by ``recoverable.body.freeze_body`` (so the
bytes on the wire are identical), streamed through ``ResponsesBackend`` to the
fixture provider running in a separate process. Failed attempts are replaced by
the same rule everywhere: ``recoverable.machine.classify`` decides whether an
interruption may be replaced, ``recoverable.machine.backoff_delay`` how long to
wait (``FAST``: no backoff, the provider's Retry-After honoured), at most
``MAX_ATTEMPTS`` attempts per job.

The durable systems (recoverable, DBOS, the JSON-file store) also make the same
host commit after each result: one line in an append-only, fsynced JSON-lines
log, group-committed (one ``fsync`` for every line queued while the last one
was syncing) — the cheapest honest "host transaction" there is, so what is
compared is the recovery layer, not the host database.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import msgspec
import trio

import recoverable
from recoverable.machine import backoff_delay, classify

ACCOUNT = recoverable.AccountBinding("acct-bench", "api-key")
FAST = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
MAX_ATTEMPTS = 8
TOKEN = "sk-bench-secret"


# The realistic scenario of the harness: answers of about 1,400 characters (a few hundred
# tokens), which the provider (``--deltas 200:500``) streams in 200-500 delta events. The
# worker processes of that scenario get this variable; the contract differs only in its
# ``minLength``, the workload in nothing else.
ANSWER_CHARS = int(os.environ.get("RECOVERABLE_BENCH_ANSWER_CHARS", "0") or 0)

if ANSWER_CHARS:

    class Answer(msgspec.Struct, frozen=True):
        answer: int
        note: Annotated[str, msgspec.Meta(min_length=ANSWER_CHARS)]

else:

    class Answer(msgspec.Struct, frozen=True):  # type: ignore[no-redef]
        answer: int
        note: str


class JobFailed(Exception):
    """A job ended without a value (budget spent or a terminal failure)."""


def request_for(i: int) -> recoverable.StructuredRequest:
    return recoverable.StructuredRequest(
        model="gpt-bench", instructions="Answer briefly.", input=f"Question {i}"
    )


def replacement_delay(failure: recoverable.Interruption, attempts_used: int) -> float | None:
    """``None`` if the library's rules would not replace this failure, else the delay."""
    if failure.kind == "http_rejected" and failure.http_status == 401:
        return None  # no credential renewal in the baselines
    if classify(failure, FAST) is not None:
        return None
    return backoff_delay(FAST, attempts_used, failure.retry_after)


def make_backend(base_url: str, mode: str) -> recoverable.ResponsesBackend:
    return recoverable.ResponsesBackend(
        base_url,
        credentials=recoverable.StaticCredentials(TOKEN, account=ACCOUNT),
        mode="sse" if mode == "sse" else "websocket",
        endpoint_id="fixture",
    )


async def run_pool(
    n: int, concurrency: int, job: Callable[[int], Awaitable[None]], offset: int = 0
) -> tuple[float, list[float]]:
    """Run jobs ``offset..offset+n-1`` on Trio with at most ``concurrency`` at once."""
    latencies: list[float] = []
    counter = iter(range(offset, offset + n))

    async def worker() -> None:
        for i in counter:
            t0 = time.perf_counter()
            await job(i)
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(min(concurrency, n)):
            nursery.start_soon(worker)
    return time.perf_counter() - start, latencies


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HostLogFile:
    """An append-only JSON-lines file; ``append_batch`` writes and fsyncs (thread-safe)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._lock = threading.Lock()
        self.fsyncs = 0
        self.lines = 0

    def append_batch(self, lines: list[bytes]) -> None:
        data = b"".join(lines)
        with self._lock:
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
            os.fsync(self._fd)
            self.fsyncs += 1
            self.lines += len(lines)

    def close(self) -> None:
        os.close(self._fd)


def commit_line(job: int, value: Answer, operation_id: str) -> bytes:
    return msgspec.json.encode({"job": job, "revision": "r1", "op": operation_id,
                                "result": value}) + b"\n"


class TrioHostLog:
    """Group commit of host lines on Trio: one thread-side fsync per batch."""

    def __init__(self, path: str) -> None:
        self.file = HostLogFile(path)
        self._pending: list[tuple[bytes, trio.Event]] = []
        self._wakeup = trio.Event()

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            batch, self._pending = self._pending, []
            if not batch:
                continue
            await trio.to_thread.run_sync(self.file.append_batch, [line for line, _ in batch])
            for _, done in batch:
                done.set()

    async def commit(self, line: bytes) -> None:
        done = trio.Event()
        self._pending.append((line, done))
        self._wakeup.set()
        await done.wait()


def result_record(
    elapsed: float, latencies: list[float], cpu: float, rss_mib: float, **extra: Any
) -> dict[str, Any]:
    return {"elapsed": elapsed, "latencies": latencies, "cpu": cpu, "rss_mib": rss_mib, **extra}


__all__ = [
    "ACCOUNT", "FAST", "MAX_ATTEMPTS", "TOKEN", "Answer", "HostLogFile", "JobFailed",
    "TrioHostLog", "commit_line", "fsync_dir", "make_backend", "replacement_delay",
    "request_for", "result_record", "run_pool",
]
