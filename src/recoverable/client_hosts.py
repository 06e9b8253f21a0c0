"""The one-call client for threads and asyncio: ``BlockingClient`` and ``AsyncioClient``.

Both run the Trio :class:`recoverable.client.Client` in a Trio thread of its own, exactly
as ``BlockingRuntime``/``AsyncioRuntime`` run the runtime (they are built on the same
thread host, ``recoverable.blocking``): every call is a task in that thread, any number of
threads (or asyncio tasks) may call at once, and a caller that goes away (``KeyboardInterrupt``
in a blocked thread, a cancelled asyncio task, closing the client) suspends the jobs it
was sending; the next ``parse`` of the job resumes them.

The standing authorization policy runs where the caller is: ``BlockingClient``'s plain
``def`` in a worker thread, ``AsyncioClient``'s ``async def`` (or plain ``def``) on the
event loop that started the client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator, Mapping
from typing import IO, Any, TypeVar, cast

import trio

from recoverable import errors
from recoverable.actors.runtime import Runtime
from recoverable.blocking import (
    AsyncioAuthorize,
    BlockingAuthorize,
    BlockingRuntime,
    _ask,
    _await_future,
    _Call,
    _is_async_callable,
    await_call,
)
from recoverable.client import Client, MapResult, open_client
from recoverable.storage.store import RecoveryStore
from recoverable.types import AccountBinding, Attempt

__all__ = ["AsyncioClient", "BlockingClient"]

_T = TypeVar("_T")
_END: Any = object()  # the end of a map's results


class _ClientThread(BlockingRuntime):
    """A :class:`BlockingRuntime` whose Trio thread opens a client (and so its runtime)."""

    def __init__(self, path: str, options: dict[str, Any]) -> None:
        super().__init__(cast(RecoveryStore, None), None, account=None)
        self._path = path
        self._client_options = options
        self.client: Client | None = None  # set in the Trio thread before it is ready

    async def _open(self, stack: contextlib.AsyncExitStack) -> Runtime:
        self.client = await stack.enter_async_context(
            open_client(self._path, **self._client_options)
        )
        return self.client.runtime

    def run(self, work: Callable[[Client], Any]) -> _Call:
        """Start ``await work(client)`` in the Trio thread; stopping it suspends its sends."""

        async def call(rt: Runtime) -> Any:
            assert self.client is not None
            return await work(self.client)

        return self._submit(call, suspends=True)

    def result(self, call: _Call) -> Any:
        """Wait in this thread; an exception here (``KeyboardInterrupt``) stops the call and
        returns only once its sends are suspended."""
        try:
            return call.future.result()
        except BaseException:
            if not call.future.done():
                self._request_stop(call)
                concurrent.futures.wait([call.future])
            raise


def _blocking_policy(policy: BlockingAuthorize | None) -> Any:
    if policy is None:
        return None
    if _is_async_callable(policy):
        raise errors.InvalidRequest(
            "BlockingClient takes a plain def authorize; for an async def use "
            "recoverable.AsyncioClient"
        )

    async def authorize(attempt: Attempt) -> bool:
        return bool(await trio.to_thread.run_sync(policy, attempt))

    return authorize


class BlockingClient:
    """:func:`recoverable.open_client` for threads: the same arguments, blocking methods.

    ``with recoverable.BlockingClient(path, endpoint=..., account=...) as client:
    client.parse(...)``; ``for result in client.map(requests): ...``.
    ``authorize`` is a plain ``def (Attempt) -> bool`` (run in a worker thread).
    """

    def __init__(
        self,
        path: str,
        *,
        endpoint: str,
        account: str | AccountBinding,
        authorize: BlockingAuthorize | None = None,
        **options: Any,
    ) -> None:
        options.update(endpoint=endpoint, account=account, authorize=_blocking_policy(authorize))
        self._host = _ClientThread(path, options)

    @property
    def client(self) -> Client:
        """The Trio client (read its attributes; call it only from its own thread)."""
        if self._host.client is None:
            raise errors.RuntimeClosed("the client is not started")
        return self._host.client

    def start(self) -> BlockingClient:
        self._host.start()
        return self

    def close(self) -> None:
        """Suspend running sends, close the runtime, the store and the backend."""
        self._host.close()

    def __enter__(self) -> BlockingClient:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def parse(self, *, text_format: type[_T], **arguments: Any) -> _T:
        """Blocking :meth:`Client.parse` (same arguments)."""
        call = self._host.run(lambda client: client.parse(text_format=text_format, **arguments))
        result: _T = self._host.result(call)
        return result

    def forget(self, job_id: str, *, input_revision: str | None = None) -> bool:
        """Blocking :meth:`Client.forget`."""
        call = self._host.run(lambda client: client.forget(job_id, input_revision=input_revision))
        return bool(self._host.result(call))

    def map(
        self,
        requests: Iterable[Mapping[str, Any]],
        *,
        text_format: Any = None,
        concurrency: int = 64,
        progress: bool | IO[str] = False,
    ) -> Iterator[MapResult]:
        """:meth:`Client.map` as an iterator; leaving it early suspends the jobs still
        sending (the next run resumes them)."""
        results: queue.SimpleQueue[Any] = queue.SimpleQueue()

        async def work(client: Client) -> None:
            stream = client.map(requests, text_format=text_format, concurrency=concurrency,
                                progress=progress)
            async with contextlib.aclosing(stream):
                async for result in stream:
                    results.put(result)

        call = self._host.run(work)
        call.future.add_done_callback(lambda _: results.put(_END))
        try:
            while (item := results.get()) is not _END:
                yield item
            call.future.result()
        finally:
            if not call.future.done():
                self._host._request_stop(call)
                concurrent.futures.wait([call.future])


class AsyncioClient:
    """:func:`recoverable.open_client` for asyncio: the same arguments, coroutine methods
    that never block the loop. ``authorize`` (``async def`` or plain ``def``) runs on the
    loop that entered the client."""

    def __init__(
        self,
        path: str,
        *,
        endpoint: str,
        account: str | AccountBinding,
        authorize: AsyncioAuthorize | None = None,
        **options: Any,
    ) -> None:
        self._policy = authorize
        self._loop: asyncio.AbstractEventLoop | None = None
        policy = None if authorize is None else self._authorize
        options.update(endpoint=endpoint, account=account, authorize=policy)
        self._host = _ClientThread(path, options)

    async def _authorize(self, attempt: Attempt) -> bool:
        assert self._policy is not None and self._loop is not None
        asked = asyncio.run_coroutine_threadsafe(_ask(self._policy, attempt), self._loop)
        return await _await_future(asked)

    @property
    def client(self) -> Client:
        """The Trio client (read its attributes; call it only from its own thread)."""
        if self._host.client is None:
            raise errors.RuntimeClosed("the client is not started")
        return self._host.client

    async def start(self) -> AsyncioClient:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._host.start)
        return self

    async def aclose(self) -> None:
        await asyncio.to_thread(self._host.close)

    async def __aenter__(self) -> AsyncioClient:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _await(self, call: _Call) -> Any:
        # Cancelled: the job's send is suspended, and ends before the cancellation goes on.
        return await await_call(self._host, call)

    async def parse(self, *, text_format: type[_T], **arguments: Any) -> _T:
        """:meth:`Client.parse` for asyncio (same arguments)."""
        call = self._host.run(lambda client: client.parse(text_format=text_format, **arguments))
        result: _T = await self._await(call)
        return result

    async def forget(self, job_id: str, *, input_revision: str | None = None) -> bool:
        """:meth:`Client.forget` for asyncio."""
        call = self._host.run(lambda client: client.forget(job_id, input_revision=input_revision))
        return bool(await self._await(call))

    async def map(
        self,
        requests: Iterable[Mapping[str, Any]],
        *,
        text_format: Any = None,
        concurrency: int = 64,
        progress: bool | IO[str] = False,
    ) -> AsyncGenerator[MapResult, None]:
        """:meth:`Client.map` as an async iterator on this loop."""
        loop = asyncio.get_running_loop()
        results: asyncio.Queue[Any] = asyncio.Queue()

        def deliver(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(results.put_nowait, item)

        async def work(client: Client) -> None:
            stream = client.map(requests, text_format=text_format, concurrency=concurrency,
                                progress=progress)
            async with contextlib.aclosing(stream):
                async for result in stream:
                    deliver(result)

        call = self._host.run(work)
        call.future.add_done_callback(lambda _: deliver(_END))
        try:
            while (item := await results.get()) is not _END:
                yield item
            call.future.result()
        finally:
            if not call.future.done():
                self._host._request_stop(call)
                with contextlib.suppress(BaseException):
                    await asyncio.wrap_future(call.future)
