"""The process's single LMDB writer: one thread, group commit.

Every mutation is a callable ``fn(txn) -> T``. The writer thread takes every
mutation queued while its previous commit was syncing (up to ``batch_limit``),
runs them in one batch transaction — straight in it while none raises, all of them in
one shared mutation context (``MutationContext.next_mutation``); if one does,
the run is discarded and the batch run again with each mutation in a *nested* child
transaction (so a mutation that raises is rolled back alone) —, then commits the batch once
(``sync=True``: one fsync serves the whole batch). Each caller is released only
after that commit is durable.

If the map is full the batch is aborted, the map grown, and the whole batch run
again, so a mutation must be a function of the transaction only (side effects
outside the store go through ``txn.on_abort`` hooks, which run whenever that run
of the mutation is discarded).

Trio callers wait with ``trio.lowlevel.wait_task_rescheduled`` and an abort
function that refuses cancellation: a queued write cannot be taken back, so the
caller always learns its outcome (a commit takes milliseconds). The writer thread
wakes them through their ``TrioToken`` (no thread per call).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import lmdb
import msgspec
import outcome
import trio

from recoverable.errors import StorageLimitExceeded, StorageUnavailable
from recoverable.storage.integrity import storage_error

__all__ = ["BATCH_LIMIT", "MapGuard", "MutationContext", "Writer"]

Result = TypeVar("Result")
Ctx = TypeVar("Ctx", bound="MutationContext")

BATCH_LIMIT = 4096


class MutationContext:
    """What the writer needs from the transaction wrapper handed to a mutation."""

    def __init__(self) -> None:
        self.map_full = False  # set when an LMDB call inside the mutation hit MapFullError
        self.txn_full = False  # set when it hit TxnFullError (too many dirty pages)
        self._abort_hooks: list[Callable[[], None]] = []

    def on_abort(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` (on the writer thread) if this run of the mutation is discarded."""
        self._abort_hooks.append(hook)

    def finish(self) -> None:
        """Called after ``fn`` returned, before the child transaction commits."""

    def next_mutation(self) -> None:
        """The writer hands this context to the next mutation of the same transaction
        (a batch run without child transactions shares one context: one object instead
        of one per write). Reset what belongs to one mutation; caches of what the
        transaction holds may stay."""

    def run_abort_hooks(self, since: int = 0) -> None:
        """Run the hooks registered since ``hooks_mark()`` returned ``since`` (default:
        all of them), newest first, and forget them."""
        hooks = self._abort_hooks[since:]
        del self._abort_hooks[since:]
        for hook in reversed(hooks):
            with contextlib.suppress(Exception):
                hook()

    def hooks_mark(self) -> int:
        """Where the next mutation's abort hooks start (``run_abort_hooks(since=...)``)."""
        return len(self._abort_hooks)


class MapGuard:
    """Readers/writers lock around the memory map.

    ``set_mapsize`` may only run while no transaction of this process is open, so
    every transaction holds the shared side and a resize takes the exclusive side.
    Exclusive waiters are preferred (a resize is rare and short).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._exclusive_waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._exclusive_waiting:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if self._shared == 0:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._exclusive_waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class _Job(msgspec.Struct, gc=False, eq=False):
    """One queued mutation and, once its batch is resolved, its outcome.

    Untracked by the collector (``gc=False``): one is alive per write in flight
    and nothing it holds refers back to it (the queue and the batch list hold it, never
    the reverse). Compared by identity (``eq=False``: ``job in queue``)."""

    fn: Callable[[Any], Any]
    # The operations ``fn`` will read (``store.write(fn, touches=...)``): a prefetch hint
    # the PostgreSQL writer reads for its batch (``pg_batch.Prefetch``); LMDB ignores it.
    touches: Iterable[Any] = ()
    deliver: Callable[[outcome.Outcome[Any]], None] | None = None
    token: trio.lowlevel.TrioToken | None = None  # Trio waiters are woken together, one
    task: trio.lowlevel.Task | None = None  # callback per loop
    result: outcome.Outcome[Any] | None = None
    ctx: MutationContext | None = None


def _reschedule_all(waiters: list[tuple[trio.lowlevel.Task, outcome.Outcome[Any]]]) -> None:
    for task, result in waiters:
        trio.lowlevel.reschedule(task, result)


class _GrowMap(Exception):
    """Internal: the batch hit MapFullError; grow the map and run it again."""


class _SplitBatch(Exception):
    """Internal: the batch dirtied more pages than one LMDB transaction may hold."""


class _Isolate(Exception):
    """Internal: a mutation raised while the batch ran without child transactions; its
    writes (if any) are in the batch transaction. Run the batch again, each mutation in
    its own child transaction."""


def _refuse_cancel(_: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


class Writer(Generic[Ctx]):
    """The single writer thread of one store (see the module docstring)."""

    def __init__(
        self,
        env: lmdb.Environment,
        guard: MapGuard,
        make_context: Callable[[lmdb.Transaction[bytes]], Ctx],
        *,
        max_map_size: int,
        batch_limit: int = BATCH_LIMIT,
        name: str = "recoverable-writer",
        begin_batch: Callable[[], None] | None = None,
        end_batch: Callable[[lmdb.Transaction[bytes]], None] | None = None,
    ) -> None:
        self._env = env
        self._guard = guard
        self._make_context = make_context
        self._max_map_size = max_map_size
        self._batch_limit = batch_limit
        # Batch-level state (e.g. a counter kept in memory across the batch's mutations
        # and written once before the commit).
        self._begin_batch = begin_batch
        self._end_batch = end_batch
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._stopping = False
        self._idle = False  # the writer thread is (about to be) waiting on _cond
        self._exited = False  # the writer thread ended (stop() and nothing queued)
        self.commits = 0  # durable batch commits by this process
        self.writes = 0  # mutations resolved by those commits (succeeded or rolled back alone)
        self.largest_batch = 0
        self.map_growths = 0
        self.map_adoptions = 0  # MapResizedError: another process grew the map
        self.isolated_reruns = 0  # batches run again with a child transaction per mutation
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- submission -------------------------------------------------------------

    async def write(self, fn: Callable[[Ctx], Result], touches: Iterable[Any] = ()) -> Result:
        """Queue ``fn`` and wait (shielded from cancellation) for its durable outcome."""
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()
        self._enqueue(_Job(fn, touches, token=token, task=task))
        value: Result = await trio.lowlevel.wait_task_rescheduled(_refuse_cancel)
        return value

    def write_sync(self, fn: Callable[[Ctx], Result]) -> Result:
        """Blocking variant for threads that are not running Trio (CLI, tests)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("write_sync called from inside a mutation (would deadlock)")
        future: concurrent.futures.Future[Result] = concurrent.futures.Future()

        def deliver(result: outcome.Outcome[Any]) -> None:
            if isinstance(result, outcome.Error):
                future.set_exception(result.error)
            else:
                future.set_result(result.unwrap())

        self._enqueue(_Job(fn, deliver=deliver))
        return future.result()

    def _enqueue(self, job: _Job) -> None:
        # Lock-free while the writer is busy (a commit is syncing): ``deque.append`` is
        # atomic, and the writer takes the queue again before it sleeps. Only a writer
        # that is asleep (or about to be: ``_idle`` is set under the lock *before* it
        # checks the queue a last time) is notified, once: the first caller clears
        # ``_idle``. So at most one Condition round trip per batch, not one per write.
        if self._stopping:
            raise StorageUnavailable("the store is closed")
        self._queue.append(job)
        if self._idle or self._stopping:
            with self._cond:
                if self._exited and job in self._queue:
                    # stop() won the race: the writer drained the queue and ended before
                    # this job was appended. Nothing ran; take it back and refuse.
                    self._queue.remove(job)
                    raise StorageUnavailable("the store is closed")
                self._idle = False
                self._cond.notify()

    def stop(self) -> None:
        """Finish every queued mutation, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    # -- the writer thread --------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._idle = True  # before the last look at the queue (see _enqueue)
                while not self._queue and not self._stopping:
                    self._cond.wait()
                self._idle = False
                if not self._queue:
                    self._exited = True
                    return
                take = min(len(self._queue), self._batch_limit)
                batch = [self._queue.popleft() for _ in range(take)]
            try:
                self._commit_batch(batch)
            except BaseException as exc:  # never lose a caller, whatever happened
                failure = StorageUnavailable(f"the writer failed: {exc!r}")
                failure.__cause__ = exc
                self._fail_batch(batch, failure)
            self._wake(batch)

    @staticmethod
    def _wake(batch: list[_Job]) -> None:
        """Release every caller of a committed batch: one wake-up per Trio loop."""
        waiters: dict[trio.lowlevel.TrioToken, list[tuple[trio.lowlevel.Task, Any]]] = {}
        for job in batch:
            assert job.result is not None
            if job.token is not None and job.task is not None:
                waiters.setdefault(job.token, []).append((job.task, job.result))
            elif job.deliver is not None:
                job.deliver(job.result)
        for token, pairs in waiters.items():
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(_reschedule_all, pairs)

    def _commit_batch(self, batch: list[_Job]) -> None:
        isolated = False
        while True:
            try:
                self._try_batch(batch, isolated)
                return
            except _Isolate:
                self._discard_runs(batch)
                isolated = True
                self.isolated_reruns += 1
            except _GrowMap:
                self._discard_runs(batch)
                if not self._grow():
                    if len(batch) > 1:
                        # At the maximum: each write alone, so that one too large for the
                        # map fails by itself and the others of its batch still commit.
                        for job in batch:
                            self._commit_batch([job])
                        return
                    self._fail_batch(batch, StorageLimitExceeded(
                        "the LMDB map is full and at its maximum size"
                    ))
                    return
            except _SplitBatch:
                self._discard_runs(batch)
                if len(batch) == 1:
                    batch[0].result = outcome.Error(
                        StorageLimitExceeded("the write is too large for one LMDB transaction")
                    )
                    return
                for job in batch:  # each alone: the big one fails, the others commit
                    self._commit_batch([job])
                return
            except lmdb.MapResizedError:
                # Another process grew the map: adopt its size and run again.
                self._discard_runs(batch)
                with self._guard.exclusive():
                    self._env.set_mapsize(0)
                self.map_adoptions += 1
            except lmdb.Error as exc:
                self._fail_batch(batch, storage_error(exc, "committing a write batch"))
                return
            except StorageUnavailable as exc:
                # Refused before any mutation ran (begin_batch: e.g. the lock file was
                # replaced): every caller of the batch gets the typed error, nothing written.
                self._fail_batch(batch, exc)
                return

    def _try_batch(self, batch: list[_Job], isolated: bool) -> None:
        """Run ``batch`` in one write transaction and commit it.

        First every mutation runs straight in the batch transaction (no child transaction:
        a begin and a commit, each releasing and re-taking the GIL, saved per write). If one
        raises, whatever it wrote is in the batch transaction, so the whole run is thrown
        away (``_Isolate``: nothing committed, abort hooks run) and the batch is run again
        ``isolated``: each mutation in its own child transaction, so the failing one is
        rolled back alone. A failing mutation is rare (a refused precondition), and every
        mutation may already run more than once (a map resize reruns its batch).
        """
        with self._guard.shared():
            parent = self._env.begin(write=True)
            committed_any = False
            try:
                if self._begin_batch is not None:
                    self._begin_batch()
                shared: MutationContext | None = None
                for job in batch:
                    job.result = None
                    if isolated:
                        committed_any |= self._run_one(parent, job)
                    else:
                        # One context for the whole run (see MutationContext.next_mutation):
                        # fewer objects per write, so less work for the garbage collector.
                        if shared is None:
                            shared = self._make_context(parent)
                        else:
                            shared.next_mutation()
                        self._run_direct(shared, job)
                        committed_any = True
                if committed_any:
                    if self._end_batch is not None:
                        self._end_batch(parent)
                    parent.commit()
                else:
                    parent.abort()
            except BaseException as exc:
                parent.abort()
                if isinstance(exc, lmdb.MapFullError):
                    raise _GrowMap from exc
                if isinstance(exc, lmdb.TxnFullError):
                    raise _SplitBatch from exc
                raise
        if committed_any:
            self.commits += 1
        self.writes += len(batch)
        self.largest_batch = max(self.largest_batch, len(batch))

    def _run_one(self, parent: lmdb.Transaction[bytes], job: _Job) -> bool:
        child = self._env.begin(write=True, parent=parent)
        ctx = self._make_context(child)
        job.ctx = ctx
        try:
            value = job.fn(ctx)
            ctx.finish()
            if ctx.map_full:
                raise _GrowMap
            if ctx.txn_full:
                raise _SplitBatch
            child.commit()
        except (_GrowMap, _SplitBatch):
            child.abort()
            raise
        except lmdb.MapFullError as exc:
            child.abort()
            raise _GrowMap from exc
        except lmdb.TxnFullError as exc:
            child.abort()
            raise _SplitBatch from exc
        except BaseException as exc:
            child.abort()
            ctx.run_abort_hooks()
            if ctx.map_full:
                raise _GrowMap from exc
            if ctx.txn_full:
                raise _SplitBatch from exc
            job.result = outcome.Error(exc)
            return False
        job.result = outcome.Value(value)
        return True

    def _run_direct(self, ctx: MutationContext, job: _Job) -> None:
        job.ctx = ctx  # shared by the run: its abort hooks run once if the run is discarded
        try:
            value = job.fn(ctx)
            ctx.finish()
        except lmdb.MapFullError as exc:
            raise _GrowMap from exc
        except lmdb.TxnFullError as exc:
            raise _SplitBatch from exc
        except BaseException as exc:
            if ctx.map_full:
                raise _GrowMap from exc
            if ctx.txn_full:
                raise _SplitBatch from exc
            raise _Isolate from exc
        if ctx.map_full:
            raise _GrowMap
        if ctx.txn_full:
            raise _SplitBatch
        job.result = outcome.Value(value)

    def _fail_batch(self, batch: list[_Job], error: BaseException) -> None:
        """Nothing of ``batch`` is written: every caller gets ``error``."""
        self._discard_runs(batch)
        for job in batch:
            job.result = outcome.Error(error)

    def _discard_runs(self, batch: list[_Job]) -> None:
        for job in batch:
            if job.ctx is not None:
                job.ctx.run_abort_hooks()
                job.ctx = None
            job.result = None

    def _grow(self) -> bool:
        current = self._env.info()["map_size"]
        if current >= self._max_map_size:
            return False
        with self._guard.exclusive():
            self._env.set_mapsize(min(self._max_map_size, current * 2))
        self.map_growths += 1
        return True
