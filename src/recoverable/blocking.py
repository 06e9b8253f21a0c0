"""Blocking and asyncio hosts: the Trio runtime in a thread of its own.

``open_runtime`` is Trio-native. Hosts written as blocking code (threads, WSGI,
scripts) or on asyncio (FastAPI, the openai client) use these instead::

    with recoverable.BlockingRuntime(store, backend, account=account) as runtime:
        handle = runtime.prepare(request, response=Output, maximum_attempts=3)
        value = runtime.send_recovering(handle, response=Output, authorize=authorize)
        runtime.acknowledge(handle)

    async with recoverable.AsyncioRuntime(store, backend, account=account) as runtime:
        value = await runtime.send_recovering(handle, response=Output, authorize=authorize)

How it works: ``BlockingRuntime`` starts one thread running ``trio.run`` with
``open_runtime`` inside it. Every call, from any thread, is handed to that Trio
thread with its ``TrioToken`` (``run_sync_soon``, thread-safe) and runs there
as a task of the runtime's own nursery; its result comes back through a
``concurrent.futures.Future``. So any number of threads may call at once, and
``AsyncioRuntime`` awaits the same futures (``asyncio.wrap_future``) without
ever blocking its event loop or holding a worker thread per call.

The host's ``authorize`` callback runs where the caller is: in the calling
thread for ``BlockingRuntime`` (a plain ``def``), on the caller's event loop
for ``AsyncioRuntime`` (``async def`` or a plain ``def``). While it runs, the
runtime keeps streaming other operations.

The seed rule "a caller that goes away suspends" holds across the thread
boundary: cancelling the asyncio task that awaits ``send_recovering``, a
``KeyboardInterrupt`` in the blocked thread, or closing the runtime while a
``send_recovering`` is running cancels that operation's Trio task, which
suspends the operation (as Trio cancellation does); the call returns only after
the suspension is saved and the lease released.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import queue
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

import trio

from recoverable import errors
from recoverable.actors.runtime import Backend, Runtime, open_runtime
from recoverable.storage.store import RecoveryStore
from recoverable.types import (
    AccountBinding,
    Attempt,
    Handle,
    Inventory,
    JsonSchema,
    Receipt,
    Status,
    StructuredRequest,
)

__all__ = ["AsyncioRuntime", "BlockingRuntime"]

T = TypeVar("T")

#: ``BlockingRuntime``'s callback: a plain function, called in the calling thread.
BlockingAuthorize = Callable[[Attempt], bool]
#: ``AsyncioRuntime``'s callback: ``async def`` or a plain function, run on the caller's loop.
AsyncioAuthorize = Callable[[Attempt], Awaitable[bool] | bool]

_Invoke = Callable[[Attempt], "concurrent.futures.Future[bool]"]
_Work = Callable[[Runtime], Awaitable[Any]]
_UNSET: Any = object()


class _Call:
    """One host call, run as a task in the runtime's Trio thread."""

    def __init__(self, work: _Work, *, operation_id: str | None, suspends: bool) -> None:
        self.work = work
        self.operation_id = operation_id
        self.suspends = suspends  # send_recovering: stopping it suspends the operation
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.scope: trio.CancelScope | None = None  # Trio thread only
        self.stop_requested = False  # Trio thread only

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            try:
                self.future.set_exception(exc)
            except concurrent.futures.InvalidStateError:  # pragma: no cover - raced
                pass


async def _await_future(fut: concurrent.futures.Future[T]) -> T:
    """Wait in Trio for a future another thread resolves; cancelling stops waiting for it."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_: object) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:  # pragma: no cover - the runtime already ended
            pass

    fut.add_done_callback(wake)
    try:
        await done.wait()
    finally:
        fut.cancel()  # not yet picked up: the host never runs it (a late answer is ignored)
    return fut.result()


def _is_async_callable(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an instance with ``async def __call__``
    )


class BlockingRuntime:
    """The Trio runtime in its own thread, with blocking methods safe to call from any thread.

    Takes the arguments of :func:`recoverable.open_runtime` (``account`` and the
    keyword options such as ``max_concurrency``, ``requests_per_second``,
    ``telemetry``). Use it as a context manager, or ``start()``/``close()``.
    A backend that is an async context manager (``ResponsesBackend``) is entered
    in the runtime's thread and closed with it: don't enter it yourself.
    Closing suspends every ``send_recovering`` still running (its caller gets
    ``OperationSuspended``), then shuts the runtime down. Calls after closing
    raise ``RuntimeClosed``.
    """

    def __init__(
        self,
        store: RecoveryStore,
        backend: Backend | None,
        *,
        account: AccountBinding | None,
        **options: Any,
    ) -> None:
        self._store = store
        self._backend = backend
        self._options: dict[str, Any] = {"account": account, **options}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._closed = False
        self._calls: set[_Call] = set()  # guarded by _lock
        self._startup_error: BaseException | None = None
        self._close_error: BaseException | None = None
        # Set in the Trio thread before _ready, read-only afterwards:
        self._token: trio.lowlevel.TrioToken | None = None
        self._runtime: Runtime | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._closing = False  # Trio thread only

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> BlockingRuntime:
        """Start the runtime thread and wait until the runtime is open."""
        with self._lock:
            if self._thread is not None or self._closed:
                raise errors.RuntimeClosed("a BlockingRuntime is started once")
            self._thread = threading.Thread(
                target=self._thread_main, name="recoverable-runtime", daemon=True
            )
            self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            self._thread.join()
            with self._lock:
                self._closed = True
            raise self._startup_error
        return self

    def close(self) -> None:
        """Suspend running ``send_recovering`` calls, shut the runtime down, join its thread."""
        with self._lock:
            already = self._closed
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        if threading.current_thread() is thread:
            raise errors.InvalidRequest("close the BlockingRuntime from a host thread")
        if not already and self._token is not None and self._stop is not None:
            try:
                self._token.run_sync_soon(self._stop.set)
            except trio.RunFinishedError:  # pragma: no cover - the thread already ended
                pass
        thread.join()
        if self._close_error is not None and not already:
            raise self._close_error

    def __enter__(self) -> BlockingRuntime:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def asyncio(self) -> AsyncioRuntime:
        """An asyncio view of this runtime (it does not close it; this object does)."""
        return AsyncioRuntime._over(self)

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            if self._ready.is_set():
                self._close_error = exc
            else:
                self._startup_error = exc
        finally:
            with self._lock:
                self._closed = True
                leftover = list(self._calls)
                self._calls.clear()
            for call in leftover:  # never leave a caller waiting on a finished run
                call.fail(errors.RuntimeClosed("the runtime ended", operation_id=call.operation_id))
            self._ready.set()

    async def _main(self) -> None:
        async with contextlib.AsyncExitStack() as stack:
            if isinstance(self._backend, contextlib.AbstractAsyncContextManager):
                # Entered here, in the runtime's own Trio run: its connections are
                # pooled there and closed when the runtime closes.
                await stack.enter_async_context(self._backend)
            runtime = await stack.enter_async_context(
                open_runtime(self._store, self._backend, **self._options)
            )
            nursery = await stack.enter_async_context(trio.open_nursery())
            self._runtime = runtime
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            self._ready.set()
            await self._stop.wait()
            self._closing = True
            for call in self._running_calls():
                self._stop_call(call)
            # Leaving the nursery waits for every call: suspended sends have saved
            # their suspension and released their lease before the runtime closes.

    def _running_calls(self) -> list[_Call]:
        with self._lock:
            return [c for c in self._calls if c.suspends]

    # --- calls (host side) --------------------------------------------------------------

    def _submit(
        self, work: _Work, *, operation_id: str | None = None, suspends: bool = False
    ) -> _Call:
        call = _Call(work, operation_id=operation_id, suspends=suspends)
        with self._lock:
            if self._closed or self._token is None:
                raise errors.RuntimeClosed(
                    "the runtime is closed" if self._closed else "the runtime is not started",
                    operation_id=operation_id,
                )
            if threading.current_thread() is self._thread:
                raise errors.InvalidRequest(
                    "a BlockingRuntime call from its own Trio thread would deadlock"
                )
            self._calls.add(call)
            token = self._token
        call.future.add_done_callback(lambda _: self._forget(call))
        try:
            token.run_sync_soon(self._spawn, call)
        except trio.RunFinishedError:
            call.fail(errors.RuntimeClosed("the runtime ended", operation_id=operation_id))
        return call

    def _forget(self, call: _Call) -> None:
        with self._lock:
            self._calls.discard(call)

    def _request_stop(self, call: _Call) -> None:
        """From any thread: the caller went away; stop the call (a send suspends)."""
        assert self._token is not None
        try:
            self._token.run_sync_soon(self._stop_call, call)
        except trio.RunFinishedError:  # pragma: no cover - already ended, nothing to stop
            pass

    def _run(self, work: _Work, *, operation_id: str | None = None) -> Any:
        return self._submit(work, operation_id=operation_id).future.result()

    # --- calls (Trio side) --------------------------------------------------------------

    def _spawn(self, call: _Call) -> None:
        if self._closing or self._nursery is None:
            closing = errors.RuntimeClosed("the runtime is closing", operation_id=call.operation_id)
            call.fail(closing)
            return
        self._nursery.start_soon(self._run_call, call)

    def _stop_call(self, call: _Call) -> None:
        call.stop_requested = True
        if call.scope is not None:
            call.scope.cancel()

    async def _run_call(self, call: _Call) -> None:
        assert self._runtime is not None
        if not call.future.set_running_or_notify_cancel():  # pragma: no cover - internal only
            return
        call.scope = trio.CancelScope()
        if call.stop_requested:
            call.scope.cancel()
        try:
            with call.scope:
                result = await call.work(self._runtime)
                call.future.set_result(result)
                return
        except Exception as exc:
            call.future.set_exception(exc)
            return
        except BaseException:
            call.fail(errors.RuntimeClosed("the runtime stopped", operation_id=call.operation_id))
            raise
        # The call's own scope caught the cancellation: its caller went away or the
        # runtime closed. A send_recovering has saved the suspension by now.
        if call.suspends:
            call.fail(
                errors.OperationSuspended(
                    "suspended: the caller went away or the runtime closed",
                    operation_id=call.operation_id,
                )
            )
        else:
            call.fail(errors.RuntimeClosed("the runtime closed", operation_id=call.operation_id))

    # --- the runtime's methods, blocking --------------------------------------------------

    def prepare(
        self,
        request: StructuredRequest,
        *,
        response: Any,
        maximum_attempts: int,
        **options: Any,
    ) -> Handle:
        """Blocking :meth:`Runtime.prepare` (same keyword options)."""

        async def work(rt: Runtime) -> Handle:
            return await rt.prepare(
                request, response=response, maximum_attempts=maximum_attempts, **options
            )

        handle: Handle = self._run(work)
        return handle

    def send_recovering(
        self,
        handle: Handle,
        *,
        response: type[T] | JsonSchema,
        authorize: BlockingAuthorize,
        expected_contract_version: str | None = _UNSET,
    ) -> T:
        """Blocking :meth:`Runtime.send_recovering`.

        ``authorize`` is a plain function ``(Attempt) -> bool``, called in this
        thread while the call waits. An exception in the calling thread while it
        waits (``KeyboardInterrupt``) suspends the operation before it propagates.
        """
        if _is_async_callable(authorize):
            raise errors.InvalidRequest(
                "BlockingRuntime.send_recovering takes a plain def authorize; "
                "for an async def use recoverable.AsyncioRuntime",
                operation_id=handle.operation_id,
            )
        inbox: queue.SimpleQueue[tuple[Attempt, concurrent.futures.Future[bool]] | None] = (
            queue.SimpleQueue()
        )

        def invoke(attempt: Attempt) -> concurrent.futures.Future[bool]:
            reply: concurrent.futures.Future[bool] = concurrent.futures.Future()
            inbox.put((attempt, reply))
            return reply

        call = self._submit(
            _send_work(handle, response, invoke, expected_contract_version),
            operation_id=handle.operation_id,
            suspends=True,
        )
        call.future.add_done_callback(lambda _: inbox.put(None))
        try:
            while True:
                item = inbox.get()
                if item is None:
                    result: T = call.future.result()
                    return result
                attempt, reply = item
                if not reply.set_running_or_notify_cancel():
                    continue  # the runtime stopped waiting for this answer
                try:
                    answer = authorize(attempt)
                    if inspect.isawaitable(answer):
                        if inspect.iscoroutine(answer):
                            answer.close()
                        raise errors.InvalidRequest(
                            "authorize returned an awaitable; BlockingRuntime needs a plain "
                            "def returning bool (use recoverable.AsyncioRuntime for async def)",
                            operation_id=handle.operation_id,
                        )
                    reply.set_result(bool(answer))
                except Exception as exc:
                    reply.set_exception(exc)  # escapes send_recovering unchanged
        except BaseException:
            if not call.future.done():
                # The caller goes away: suspend, and return only once that is saved.
                self._request_stop(call)
                concurrent.futures.wait([call.future])
            raise

    def acknowledge(self, handle: Handle) -> None:
        """Blocking :meth:`Runtime.acknowledge`."""
        self._run(lambda rt: rt.acknowledge(handle), operation_id=handle.operation_id)

    def abandon(self, handle: Handle) -> None:
        """Blocking :meth:`Runtime.abandon`."""
        self._run(lambda rt: rt.abandon(handle), operation_id=handle.operation_id)

    def suspend(self, handle: Handle) -> None:
        """Blocking :meth:`Runtime.suspend` (also stops a send running in another thread)."""
        self._run(lambda rt: rt.suspend(handle), operation_id=handle.operation_id)

    def cancel(self, handle: Handle) -> None:
        """Blocking :meth:`Runtime.cancel`."""
        self._run(lambda rt: rt.cancel(handle), operation_id=handle.operation_id)

    def retry(
        self, handle: Handle, *, retry_action_id: str, maximum_attempts: int, **options: Any
    ) -> Handle:
        """Blocking :meth:`Runtime.retry` (same keyword options)."""

        async def work(rt: Runtime) -> Handle:
            return await rt.retry(
                handle, retry_action_id=retry_action_id, maximum_attempts=maximum_attempts,
                **options,
            )

        successor: Handle = self._run(work, operation_id=handle.operation_id)
        return successor

    def status(self, handle: Handle) -> Status:
        """Blocking :meth:`Runtime.status`."""
        status: Status = self._run(lambda rt: rt.status(handle), operation_id=handle.operation_id)
        return status

    def receipt(self, handle: Handle) -> Receipt:
        """Blocking :meth:`Runtime.receipt`."""
        receipt: Receipt = self._run(
            lambda rt: rt.receipt(handle), operation_id=handle.operation_id
        )
        return receipt

    def inventory(self, scope: str | None = None) -> Inventory:
        """Blocking :meth:`Runtime.inventory`."""
        inventory: Inventory = self._run(lambda rt: rt.inventory(scope))
        return inventory

    def sign_in(self, account: AccountBinding) -> None:
        """:meth:`Runtime.sign_in`, applied in the runtime's thread."""

        async def work(rt: Runtime) -> None:
            rt.sign_in(account)

        self._run(work)

    def sign_out(self) -> None:
        """:meth:`Runtime.sign_out`, applied in the runtime's thread."""

        async def work(rt: Runtime) -> None:
            rt.sign_out()

        self._run(work)

    def call(self, fn: Callable[[Runtime], Awaitable[T]]) -> T:
        """Run ``await fn(runtime)`` in the runtime's Trio thread (for any other method)."""
        result: T = self._run(fn)
        return result


def _send_work(
    handle: Handle, response: Any, invoke: _Invoke, expected_contract_version: Any
) -> _Work:
    async def authorize(attempt: Attempt) -> bool:
        return await _await_future(invoke(attempt))

    async def work(rt: Runtime) -> Any:
        options: dict[str, Any] = {}
        if expected_contract_version is not _UNSET:
            options["expected_contract_version"] = expected_contract_version
        return await rt.send_recovering(
            handle, response=response, authorize=authorize, **options
        )

    return work


async def _ask(authorize: AsyncioAuthorize, attempt: Attempt) -> bool:
    reply = authorize(attempt)
    if inspect.isawaitable(reply):
        return bool(await reply)
    return bool(reply)


class AsyncioRuntime:
    """The runtime for asyncio hosts: every method is a coroutine that never blocks the loop.

    ``AsyncioRuntime(store, backend, account=..., **options)`` owns a
    :class:`BlockingRuntime` (``async with`` starts and closes it);
    ``blocking.asyncio()`` gives a view over an existing one. Cancelling the task
    awaiting ``send_recovering`` suspends the operation; the cancellation
    propagates once the suspension is saved.
    """

    def __init__(
        self,
        store: RecoveryStore,
        backend: Backend | None,
        *,
        account: AccountBinding | None,
        **options: Any,
    ) -> None:
        self._blocking = BlockingRuntime(store, backend, account=account, **options)
        self._owns = True

    @classmethod
    def _over(cls, blocking: BlockingRuntime) -> AsyncioRuntime:
        view = cls.__new__(cls)
        view._blocking = blocking
        view._owns = False
        return view

    @property
    def blocking(self) -> BlockingRuntime:
        """The underlying :class:`BlockingRuntime` (for threads of the same host)."""
        return self._blocking

    async def start(self) -> AsyncioRuntime:
        if self._owns:
            await asyncio.to_thread(self._blocking.start)
        return self

    async def aclose(self) -> None:
        """Suspend running sends and shut the runtime down (if this object owns it)."""
        if self._owns:
            await asyncio.to_thread(self._blocking.close)

    async def __aenter__(self) -> AsyncioRuntime:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _await(self, call: _Call) -> Any:
        waiter = asyncio.wrap_future(call.future)
        try:
            return await asyncio.shield(waiter)
        except asyncio.CancelledError:
            if call.suspends:
                self._blocking._request_stop(call)
                # Let the call end (suspension saved, lease released) before the
                # cancellation propagates; a repeated cancel does not cut this short.
                while not waiter.done():
                    try:
                        await asyncio.wait([waiter])
                    except asyncio.CancelledError:
                        continue
                if not waiter.cancelled():
                    waiter.exception()  # retrieved: the task is cancelled anyway
            raise

    async def _run(self, work: _Work, *, operation_id: str | None = None) -> Any:
        return await self._await(self._blocking._submit(work, operation_id=operation_id))

    async def prepare(
        self,
        request: StructuredRequest,
        *,
        response: Any,
        maximum_attempts: int,
        **options: Any,
    ) -> Handle:
        async def work(rt: Runtime) -> Handle:
            return await rt.prepare(
                request, response=response, maximum_attempts=maximum_attempts, **options
            )

        handle: Handle = await self._run(work)
        return handle

    async def send_recovering(
        self,
        handle: Handle,
        *,
        response: type[T] | JsonSchema,
        authorize: AsyncioAuthorize,
        expected_contract_version: str | None = _UNSET,
    ) -> T:
        """:meth:`Runtime.send_recovering` for asyncio.

        ``authorize`` (``async def`` or plain ``def``) runs on this event loop.
        """
        loop = asyncio.get_running_loop()

        def invoke(attempt: Attempt) -> concurrent.futures.Future[bool]:
            return asyncio.run_coroutine_threadsafe(_ask(authorize, attempt), loop)

        call = self._blocking._submit(
            _send_work(handle, response, invoke, expected_contract_version),
            operation_id=handle.operation_id,
            suspends=True,
        )
        result: T = await self._await(call)
        return result

    async def acknowledge(self, handle: Handle) -> None:
        await self._run(lambda rt: rt.acknowledge(handle), operation_id=handle.operation_id)

    async def abandon(self, handle: Handle) -> None:
        await self._run(lambda rt: rt.abandon(handle), operation_id=handle.operation_id)

    async def suspend(self, handle: Handle) -> None:
        await self._run(lambda rt: rt.suspend(handle), operation_id=handle.operation_id)

    async def cancel(self, handle: Handle) -> None:
        await self._run(lambda rt: rt.cancel(handle), operation_id=handle.operation_id)

    async def retry(
        self, handle: Handle, *, retry_action_id: str, maximum_attempts: int, **options: Any
    ) -> Handle:
        async def work(rt: Runtime) -> Handle:
            return await rt.retry(
                handle, retry_action_id=retry_action_id, maximum_attempts=maximum_attempts,
                **options,
            )

        successor: Handle = await self._run(work, operation_id=handle.operation_id)
        return successor

    async def status(self, handle: Handle) -> Status:
        status: Status = await self._run(
            lambda rt: rt.status(handle), operation_id=handle.operation_id
        )
        return status

    async def receipt(self, handle: Handle) -> Receipt:
        receipt: Receipt = await self._run(
            lambda rt: rt.receipt(handle), operation_id=handle.operation_id
        )
        return receipt

    async def inventory(self, scope: str | None = None) -> Inventory:
        inventory: Inventory = await self._run(lambda rt: rt.inventory(scope))
        return inventory

    async def sign_in(self, account: AccountBinding) -> None:
        async def work(rt: Runtime) -> None:
            rt.sign_in(account)

        await self._run(work)

    async def sign_out(self) -> None:
        async def work(rt: Runtime) -> None:
            rt.sign_out()

        await self._run(work)

    async def call(self, fn: Callable[[Runtime], Awaitable[T]]) -> T:
        """Run ``await fn(runtime)`` in the runtime's Trio thread (for any other method)."""
        result: T = await self._run(fn)
        return result
