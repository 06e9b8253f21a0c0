"""(c) DBOS Transact on its SQLite system database: the durable-execution alternative.

What runs (``pip install dbos`` — the harness was measured with 3.4.0):

- DBOS's async API on asyncio (DBOS has no Trio support): one workflow
  execution per job (``@DBOS.workflow()`` ``job_workflow(i)``) holding ONE step
  (``@DBOS.step()`` ``generate(i)``). The step freezes the same body, streams it
  through the SAME ``ResponsesBackend`` (WebSocket or SSE, as the other
  systems), replaces interrupted attempts by the library's own rule in memory
  (a DBOS step is at-least-once: a crash mid-step reruns the whole step, its
  attempts are not durable), validates the output and returns the payload,
  which DBOS checkpoints. The workflow returns it; the host then makes the same
  group-committed host-log commit as the other durable systems. DBOS has no
  acknowledgement: its workflow rows stay.
- ``ResponsesBackend`` is Trio code, so Trio runs in *guest mode* on top of the
  asyncio loop (``trio.lowlevel.start_guest_run``): one thread, both loops; a
  step hands its stream to a Trio task and awaits an asyncio future. The
  transport is therefore byte-for-byte the one the other systems use.
- SQLite: DBOS's own settings (``isolation_level=IMMEDIATE``, default rollback
  journal, ``synchronous=FULL``); its database calls run in asyncio's thread
  pool, as DBOS does by itself for async workflows.
- Commits are counted with an SQLAlchemy ``commit`` listener on every engine.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import sqlalchemy as sa
import trio
from dbos import DBOS, DBOSConfig

import recoverable
from recoverable.body import freeze_body
from recoverable.contract import OutputInvalid, contract_for

from . import (
    MAX_ATTEMPTS,
    TOKEN,
    Answer,
    HostLogFile,
    JobFailed,
    commit_line,
    make_backend,
    replacement_delay,
    request_for,
    result_record,
)


class TrioBridge:
    """A ``ResponsesBackend`` living in a Trio guest run, callable from asyncio."""

    def __init__(self, base_url: str, mode: str) -> None:
        self.base_url = base_url
        self.mode = mode
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[None] = self._loop.create_future()
        self._done: asyncio.Future[None] = self._loop.create_future()
        self._stop: trio.Event | None = None
        self._nursery: trio.Nursery | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._backend: recoverable.ResponsesBackend | None = None

    async def _main(self) -> None:
        self._stop = trio.Event()
        backend = make_backend(self.base_url, self.mode)
        async with backend, trio.open_nursery() as nursery:
            self._backend = backend
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            self._loop.call_soon_threadsafe(self._ready.set_result, None)
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def _finished(self, outcome: Any) -> None:
        def settle() -> None:
            try:
                outcome.unwrap()
            except BaseException as exc:  # surfaced to whoever awaits start()/stop()
                if not self._ready.done():
                    self._ready.set_exception(exc)
                self._done.set_exception(exc)
            else:
                self._done.set_result(None)

        self._loop.call_soon_threadsafe(settle)

    async def start(self) -> None:
        trio.lowlevel.start_guest_run(
            self._main,
            run_sync_soon_threadsafe=self._loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=self._loop.call_soon,
            done_callback=self._finished,
        )
        await self._ready

    async def stop(self) -> None:
        assert self._token is not None and self._stop is not None
        self._token.run_sync_soon(self._stop.set)
        await self._done

    async def stream(self, body: bytes, attempt_id: str) -> recoverable.Completed | Any:
        assert self._token is not None and self._nursery is not None
        fut: asyncio.Future[Any] = self._loop.create_future()
        loop = self._loop
        backend = self._backend
        assert backend is not None

        def deliver(value: Any, error: BaseException | None) -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)

        async def run() -> None:
            try:
                outcome = await backend.stream(body, attempt_id=attempt_id, token=TOKEN)
            except Exception as exc:
                loop.call_soon_threadsafe(deliver, None, exc)
            else:
                loop.call_soon_threadsafe(deliver, outcome, None)

        nursery = self._nursery
        self._token.run_sync_soon(nursery.start_soon, run)
        return await fut


class AsyncioHostLog:
    """The same group-committed host log as ``TrioHostLog``, on asyncio."""

    def __init__(self, path: str) -> None:
        self.file = HostLogFile(path)
        self._pending: list[tuple[bytes, asyncio.Future[None]]] = []
        self._wakeup = asyncio.Event()

    async def run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            batch, self._pending = self._pending, []
            if not batch:
                continue
            await asyncio.to_thread(self.file.append_batch, [line for line, _ in batch])
            for _, done in batch:
                done.set_result(None)

    async def commit(self, line: bytes) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((line, done))
        self._wakeup.set()
        await done


async def run_pool_asyncio(
    n: int, concurrency: int, job: Callable[[int], Awaitable[None]], offset: int = 0
) -> tuple[float, list[float]]:
    latencies: list[float] = []
    counter = iter(range(offset, offset + n))

    async def worker() -> None:
        for i in counter:
            t0 = time.perf_counter()
            await job(i)
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    return time.perf_counter() - start, latencies


_bridge: TrioBridge | None = None


@DBOS.step()
async def generate(i: int) -> str:
    """One step: every attempt of job ``i`` until a validated completion."""
    assert _bridge is not None
    contract = contract_for(Answer)
    body = freeze_body(request_for(i), contract)
    workflow_id = DBOS.workflow_id or f"job-{i}"
    for number in range(1, MAX_ATTEMPTS + 1):
        outcome = await _bridge.stream(body, f"{workflow_id}.{number}")
        if isinstance(outcome, recoverable.Completed):
            try:
                return contract.validate(outcome.text).decode()
            except OutputInvalid as exc:
                raise JobFailed(f"job {i}: invalid output") from exc
        delay = replacement_delay(outcome, number)
        if delay is None:
            raise JobFailed(f"job {i}: {outcome.kind} not replaceable")
        if delay > 0:
            await asyncio.sleep(delay)
    raise JobFailed(f"job {i}: attempts exhausted")


@DBOS.workflow()
async def job_workflow(i: int) -> str:
    return await generate(i)


class CommitCounter:
    def __init__(self) -> None:
        self.commits = 0

    def __call__(self, conn: Any) -> None:
        self.commits += 1


async def _phase(
    *, base_url: str, mode: str, n: int, concurrency: int, warmup: int, workdir: str,
    cpu_seconds: Any, rss_mib: Any, posts: Any,
) -> dict[str, Any]:
    global _bridge
    counter = CommitCounter()
    sa.event.listen(sa.engine.Engine, "commit", counter)
    db_path = os.path.join(workdir, "dbos.sqlite")
    # BENCH_DBOS_DATABASE_URL: DBOS's system database on PostgreSQL (bench/pg_store.py).
    database_url = os.environ.get("BENCH_DBOS_DATABASE_URL") or f"sqlite:///{db_path}"
    config: DBOSConfig = {
        "name": "recoverable-bench",
        "system_database_url": database_url,
        "log_level": "WARNING",
    }
    DBOS(config=config)
    DBOS.launch()
    bridge = TrioBridge(base_url, mode)
    await bridge.start()
    _bridge = bridge
    host = AsyncioHostLog(os.path.join(workdir, "host.log"))
    host_task = asyncio.create_task(host.run())
    contract = contract_for(Answer)
    failed = 0

    async def job(i: int) -> None:
        nonlocal failed
        try:
            payload = await job_workflow(i)
        except JobFailed:
            failed += 1
            return
        value = contract.decode(payload.encode())
        assert isinstance(value, Answer)
        await host.commit(commit_line(i, value, f"job-{i}"))

    try:
        await run_pool_asyncio(warmup, concurrency, job, offset=n)
        failed = 0
        commits0, host0 = counter.commits, host.file.fsyncs
        posts0 = posts()
        cpu0 = cpu_seconds()
        elapsed, latencies = await run_pool_asyncio(n, concurrency, job)
        cpu = cpu_seconds() - cpu0
        post_count = posts() - posts0
        commits, host_fsyncs = counter.commits - commits0, host.file.fsyncs - host0
    finally:
        host_task.cancel()
        await bridge.stop()
        DBOS.destroy()
        host.file.close()
    journal = "postgresql"
    if database_url.startswith("sqlite"):
        with sa.create_engine(database_url).connect() as conn:
            journal = conn.execute(sa.text("PRAGMA journal_mode")).scalar()
    return result_record(
        elapsed, latencies, cpu, rss_mib(), posts=post_count, failed=failed, sqlite_commits=commits,
        host_fsyncs=host_fsyncs, journal_mode=str(journal),
    )


def run(**kwargs: Any) -> dict[str, Any]:
    """Run the DBOS phase on a fresh asyncio loop (the harness worker calls this)."""
    return asyncio.run(_phase(**kwargs))
