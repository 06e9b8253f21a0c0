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
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

import trio

from recoverable import errors
from recoverable.actors.runtime import Backend, Runtime, open_runtime
from recoverable.storage.store import RecoveryStore
from recoverable.types import AccountBinding, Attempt, Handle, JsonSchema

__all__ = ["AsyncioRuntime", "BlockingRuntime"]

_T = TypeVar("_T")
_P = ParamSpec("_P")
_R = TypeVar("_R")
_Fn = TypeVar("_Fn", bound=Callable[..., Any])

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


async def _await_future(fut: concurrent.futures.Future[_T]) -> _T:
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


class _Forward(Generic[_P, _R]):
    """One method of :class:`Runtime`, forwarded to the runtime's Trio thread.

    As an attribute of :class:`_RuntimeMethods` it is, on a :class:`BlockingRuntime`, a
    blocking method and, on an :class:`AsyncioRuntime`, a coroutine method, each with the
    runtime method's own parameters (``_P``) and result (``_R``) for type checkers.
    """

    def __init__(self, method: Callable[Concatenate[Runtime, _P], Awaitable[_R]]) -> None:
        self.method = method
        self.name = method.__name__
        self.doc = (
            f"Runs :meth:`Runtime.{self.name}` (same arguments) in the runtime's Trio thread."
        )

    @staticmethod
    def sync(method: Callable[Concatenate[Runtime, _P], _R]) -> _Forward[_P, _R]:
        """A runtime method that is a plain ``def`` (applied in the runtime's thread)."""

        async def call(rt: Runtime, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            return method(rt, *args, **kwargs)

        call.__name__ = method.__name__
        return _Forward(call)

    def submit(
        self, host: BlockingRuntime, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _Call:
        """Start the call in ``host``'s runtime; a handle argument names the operation."""
        handle = args[0] if args else kwargs.get("handle")
        operation_id = handle.operation_id if isinstance(handle, Handle) else None

        async def work(rt: Runtime) -> _R:
            return await self.method(rt, *args, **kwargs)

        return host._submit(work, operation_id=operation_id)

    def named(self, function: _Fn) -> _Fn:
        function.__name__ = function.__qualname__ = self.name
        function.__doc__ = self.doc
        return function

    @overload
    def __get__(self, host: None, owner: type[Any]) -> _Forward[_P, _R]: ...

    @overload
    def __get__(self, host: BlockingRuntime, owner: type[Any]) -> Callable[_P, _R]: ...

    @overload
    def __get__(
        self, host: AsyncioRuntime, owner: type[Any]
    ) -> Callable[_P, Coroutine[Any, Any, _R]]: ...

    def __get__(self, host: BlockingRuntime | AsyncioRuntime | None, owner: type[Any]) -> Any:
        return self if host is None else host._forwarded(self)


class _RuntimeMethods:
    """The runtime's methods that both hosts forward as they are, listed once.

    ``send_recovering`` is written out in each host: its ``authorize`` callback runs where
    the caller is (the calling thread, or the caller's event loop)."""

    prepare = _Forward(Runtime.prepare)
    submit = _Forward(Runtime.submit)  # for workers (docs/workers.md)
    wait = _Forward(Runtime.wait)  # the caller going away stops waiting (nothing suspends)
    retry = _Forward(Runtime.retry)
    acknowledge = _Forward(Runtime.acknowledge)
    abandon = _Forward(Runtime.abandon)
    suspend = _Forward(Runtime.suspend)  # also stops a send running in another thread
    cancel = _Forward(Runtime.cancel)
    status = _Forward(Runtime.status)
    receipt = _Forward(Runtime.receipt)
    inventory = _Forward(Runtime.inventory)
    sign_in = _Forward.sync(Runtime.sign_in)
    sign_out = _Forward.sync(Runtime.sign_out)


class BlockingRuntime(_RuntimeMethods):
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

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def asyncio(self) -> AsyncioRuntime:
        """An asyncio view of this runtime (it does not close it; this object does)."""
        return _AsyncioView(self)

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

    async def _open(self, stack: contextlib.AsyncExitStack) -> Runtime:
        """Open the runtime in this Trio thread (``recoverable.client`` opens a client)."""
        if isinstance(self._backend, contextlib.AbstractAsyncContextManager):
            # Entered here, in the runtime's own Trio run: its connections are
            # pooled there and closed when the runtime closes.
            await stack.enter_async_context(self._backend)
        return await stack.enter_async_context(
            open_runtime(self._store, self._backend, **self._options)
        )

    async def _main(self) -> None:
        async with contextlib.AsyncExitStack() as stack:
            runtime = await self._open(stack)
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
            return [call for call in self._calls if call.suspends]

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

    # --- the runtime's methods, blocking ------------------------------------------------

    def _forwarded(self, forward: _Forward[_P, _R]) -> Callable[_P, _R]:
        """``forward``'s runtime method as a blocking call (see ``_RuntimeMethods``)."""

        def method(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            result: _R = forward.submit(self, args, kwargs).future.result()
            return result

        return forward.named(method)

    def send_recovering(
        self,
        handle: Handle,
        *,
        response: type[_T] | JsonSchema,
        authorize: BlockingAuthorize,
        expected_contract_version: str | None = _UNSET,
    ) -> _T:
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
        inbox: queue.SimpleQueue[_Question | None] = queue.SimpleQueue()

        def invoke(attempt: Attempt) -> concurrent.futures.Future[bool]:
            question = _Question(attempt)
            inbox.put(question)
            return question.reply

        call = self._submit(
            _send_work(handle, response, invoke, expected_contract_version),
            operation_id=handle.operation_id,
            suspends=True,
        )
        call.future.add_done_callback(lambda _: inbox.put(None))
        try:
            while (question := inbox.get()) is not None:
                question.answer(authorize, handle.operation_id)
            result: _T = call.future.result()
            return result
        except BaseException:
            if not call.future.done():
                # The caller goes away: suspend, and return only once that is saved.
                self._request_stop(call)
                concurrent.futures.wait([call.future])
            raise

    def call(self, fn: Callable[[Runtime], Awaitable[_T]]) -> _T:
        """Run ``await fn(runtime)`` in the runtime's Trio thread (for any other method)."""
        result: _T = self._submit(fn).future.result()
        return result


class _Question:
    """One ``authorize`` question the runtime's thread asks the blocked calling thread."""

    def __init__(self, attempt: Attempt) -> None:
        self.attempt = attempt
        self.reply: concurrent.futures.Future[bool] = concurrent.futures.Future()

    def answer(self, authorize: BlockingAuthorize, operation_id: str) -> None:
        """Ask ``authorize`` in this thread; its exception escapes ``send_recovering``."""
        if not self.reply.set_running_or_notify_cancel():
            return  # the runtime stopped waiting for this answer
        try:
            answer = authorize(self.attempt)
            if inspect.isawaitable(answer):
                if inspect.iscoroutine(answer):
                    answer.close()
                raise errors.InvalidRequest(
                    "authorize returned an awaitable; BlockingRuntime needs a plain "
                    "def returning bool (use recoverable.AsyncioRuntime for async def)",
                    operation_id=operation_id,
                )
            self.reply.set_result(bool(answer))
        except Exception as exc:
            self.reply.set_exception(exc)  # escapes send_recovering unchanged


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


class AsyncioRuntime(_RuntimeMethods):
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

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _await(self, call: _Call) -> Any:
        return await await_call(self._blocking, call)

    def _forwarded(self, forward: _Forward[_P, _R]) -> Callable[_P, Coroutine[Any, Any, _R]]:
        """``forward``'s runtime method as a coroutine (see ``_RuntimeMethods``)."""

        async def method(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            result: _R = await self._await(forward.submit(self._blocking, args, kwargs))
            return result

        return forward.named(method)

    async def send_recovering(
        self,
        handle: Handle,
        *,
        response: type[_T] | JsonSchema,
        authorize: AsyncioAuthorize,
        expected_contract_version: str | None = _UNSET,
    ) -> _T:
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
        result: _T = await self._await(call)
        return result

    async def call(self, fn: Callable[[Runtime], Awaitable[_T]]) -> _T:
        """Run ``await fn(runtime)`` in the runtime's Trio thread (for any other method)."""
        result: _T = await self._await(self._blocking._submit(fn))
        return result


class _AsyncioView(AsyncioRuntime):
    """``BlockingRuntime.asyncio()``: an asyncio view of a runtime it does not own."""

    def __init__(self, blocking: BlockingRuntime) -> None:
        self._blocking = blocking
        self._owns = False


async def await_call(blocking: BlockingRuntime, call: _Call) -> Any:
    """Await ``call`` (a task in ``blocking``'s Trio thread) from asyncio. Cancelled: a
    call that suspends is stopped, and awaited until it ended (suspension saved, lease
    released) before the cancellation propagates; a repeated cancel does not cut this
    short."""
    waiter = asyncio.wrap_future(call.future)
    try:
        return await asyncio.shield(waiter)
    except asyncio.CancelledError:
        if call.suspends:
            blocking._request_stop(call)
            while not waiter.done():
                try:
                    await asyncio.wait([waiter])
                except asyncio.CancelledError:
                    continue
            if not waiter.cancelled():
                waiter.exception()  # retrieved: the task is cancelled anyway
        raise
