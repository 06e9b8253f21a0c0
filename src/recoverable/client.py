"""One call to a durable answer: ``open_client`` and its ``parse``, ``map`` and ``forget``.

For hosts without a job database of their own (scripts, notebooks, evaluation harnesses,
small services)::

    async with recoverable.open_client(".recovery", endpoint="https://api.openai.com/v1",
                                       api_key_env="OPENAI_API_KEY", account="acct-1") as client:
        answer = await client.parse(model="gpt-4.1-mini", input="Six times seven?",
                                    text_format=Answer, job_id="job-42")

The client is a host of the runtime, nothing more: ``parse`` prepares (or finds) the job's
operation by (account, scope, job id, input revision), sends it with
``send_recovering`` under the client's standing authorization policy, and keeps the
receipt as the job's saved result (it never acknowledges): the same ``parse`` again, in
this process or a later one, after a crash or a SIGKILL, returns the saved value and sends
nothing. ``forget`` acknowledges (or abandons) the job's operation and removes its marker,
so that the next ``parse`` of that job asks again. Without ``job_id`` the job id is the
frozen request's digest. ``map`` runs many jobs concurrently and yields each one's
outcome as it completes. See docs/client.md.

``BlockingClient`` and ``AsyncioClient`` (``recoverable.client_hosts``) run this client in
a Trio thread of its own, as ``BlockingRuntime`` runs the runtime.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sized,
)
from typing import IO, TYPE_CHECKING, Any, Final, TypeVar

import attrs
import trio

from recoverable import errors
from recoverable.actors.runtime import Runtime, open_runtime
from recoverable.body import body_hash, freeze_body
from recoverable.contract import contract_for
from recoverable.failure_errors import failure_label
from recoverable.outcome import Usage
from recoverable.storage.store import RecoveryStore
from recoverable.transport.backend import ResponsesBackend
from recoverable.transport.base import StaticCredentials
from recoverable.types import AccountBinding, Attempt, Handle, RetryPolicy, StructuredRequest

if TYPE_CHECKING:
    from recoverable.fixture.provider import FixtureProvider

__all__ = ["DEFAULT_SCOPE", "FIXTURE_ENDPOINT", "Client", "MapResult", "open_client"]

_T = TypeVar("_T")

#: ``endpoint=`` value that serves the embedded fixture provider on 127.0.0.1 for the
#: client's lifetime (answers are synthesized test data, not a model's).
FIXTURE_ENDPOINT: Final = "fixture"
#: The scope of the client's jobs unless ``scope=`` says otherwise.
DEFAULT_SCOPE: Final = "client"
#: The prefix of a job id made from the frozen request's digest (``parse`` without job_id).
DIGEST_PREFIX: Final = "sha256:"
_FIXTURE_KEY: Final = "sk-fixture-client"  # the embedded provider accepts any key

#: The standing authorization policy: ``async def`` or plain ``def`` (Attempt) -> bool.
Policy = Callable[[Attempt], Awaitable[bool] | bool]


async def approve_every_attempt(attempt: Attempt) -> bool:
    """The default standing policy: every attempt within the budget is authorized."""
    return True


@attrs.frozen
class MapResult:
    """One job's outcome in ``Client.map``: its value or its typed error, and its usage.

    ``usage`` is the sum of what the provider reported for the job's attempts (replaced
    ones included), read from the job's operation. ``saved`` is True when the result
    came from a receipt saved before this call (nothing was sent for it now).
    """

    job_id: str
    input_revision: str | None = None
    value: Any = None
    error: errors.RecoveryError | None = None
    usage: Usage = attrs.field(factory=Usage)
    operation_id: str | None = None
    saved: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def reason(self) -> str | None:
        """The failure's stable label (the CLI's ``reason``: ``provider_error:http_rejected``,
        the same on the run that failed and on a rerun that reads the saved failure)."""
        return None if self.error is None else failure_label(self.error)

    def unwrap(self) -> Any:
        """The value, or raise the job's typed error."""
        if self.error is not None:
            raise self.error
        return self.value


def digest_job_id(request: StructuredRequest, text_format: Any) -> str:
    """The job id of a request asked without one: the digest of its frozen body (the
    request and the output format, as they would be sent)."""
    return DIGEST_PREFIX + body_hash(freeze_body(request, contract_for(text_format)))


class Client:
    """A durable client over one runtime, one store and one account; see the module
    docstring. Open it with :func:`open_client`."""

    def __init__(
        self,
        runtime: Runtime,
        store: RecoveryStore,
        nursery: trio.Nursery,
        *,
        scope: str,
        maximum_attempts: int,
        retry_policy: RetryPolicy | None,
        authorize: Policy | None,
        fixture: FixtureProvider | None = None,
    ) -> None:
        self.runtime = runtime
        self.store = store
        self.scope = scope
        self.maximum_attempts = maximum_attempts
        self.retry_policy = retry_policy
        self.fixture = fixture  # the embedded provider (endpoint="fixture"), else None
        self._policy = authorize or approve_every_attempt
        self._nursery = nursery
        self.running = 0  # jobs sending now (parse and map)
        self.peak_running = 0

    @property
    def account(self) -> AccountBinding:
        assert self.runtime.account is not None
        return self.runtime.account

    async def authorize(self, attempt: Attempt) -> bool:
        """The standing policy's answer for one attempt (its exception escapes the call)."""
        answer = self._policy(attempt)
        if inspect.isawaitable(answer):
            return bool(await answer)
        return bool(answer)

    def request(
        self,
        *,
        model: str,
        input: str | list[dict[str, Any]],
        instructions: str | None = None,
        **parameters: Any,
    ) -> StructuredRequest:
        """The :class:`StructuredRequest` ``parse`` freezes (its optional parameters are
        ``StructuredRequest``'s)."""
        return StructuredRequest(
            model=model, input=input, instructions=instructions, **parameters
        )

    async def prepare(
        self,
        request: StructuredRequest,
        *,
        text_format: Any,
        job_id: str | None = None,
        input_revision: str | None = None,
        maximum_attempts: int | None = None,
    ) -> Handle:
        """The job's operation: prepared now, or the one already saved for its key."""
        if job_id is None:
            job_id = digest_job_id(request, text_format)
        return await self.runtime.prepare(
            request,
            response=text_format,
            maximum_attempts=maximum_attempts or self.maximum_attempts,
            retry_policy=self.retry_policy,
            scope=self.scope,
            job_id=job_id,
            input_revision=input_revision,
        )

    async def send(self, handle: Handle, *, text_format: type[_T] | Any) -> _T:
        """Run the job's operation to its validated value (a saved receipt: no POST)."""
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        try:
            value: _T = await self.runtime.send_recovering(
                handle, response=text_format, authorize=self.authorize
            )
            return value
        finally:
            self.running -= 1

    async def parse(
        self,
        *,
        model: str,
        input: str | list[dict[str, Any]],
        text_format: type[_T],
        job_id: str | None = None,
        input_revision: str | None = None,
        instructions: str | None = None,
        maximum_attempts: int | None = None,
        **parameters: Any,
    ) -> _T:
        """The job's validated value: saved once, returned from its receipt ever after.

        ``text_format`` is the output type (a msgspec ``Struct``, a pydantic model, a
        dataclass, ...) or a ``recoverable.JsonSchema``. The job is keyed by (account,
        scope, ``job_id``, ``input_revision``); without ``job_id`` by the frozen request's
        digest. The same job id with another request raises ``JobConflict`` (use a new
        ``input_revision``). Every typed error of the runtime comes through unchanged.
        """
        request = self.request(model=model, input=input, instructions=instructions,
                               **parameters)
        handle = await self.prepare(request, text_format=text_format, job_id=job_id,
                                    input_revision=input_revision,
                                    maximum_attempts=maximum_attempts)
        return await self.send(handle, text_format=text_format)

    async def forget(self, job_id: str, *, input_revision: str | None = None) -> bool:
        """Acknowledge the job's saved result (abandon an unfinished operation) and remove
        its marker: the next ``parse`` of the job asks the provider again. False when the
        store holds nothing for the job."""
        forgotten: list[str] = []
        for operation_id in self.store.ids_by_job(self.account, self.scope, job_id):
            record = self.store.get_operation(operation_id)
            if record is None:
                marker = self.store.get_disposition(operation_id)
                if marker is not None and marker.input_revision == input_revision:
                    forgotten.append(operation_id)  # disposed elsewhere: only the marker
                continue
            if record.input_revision != input_revision:
                continue
            if record.has_completion:
                await self.runtime.acknowledge(Handle(operation_id))
            else:
                await self.runtime.abandon(Handle(operation_id))
            forgotten.append(operation_id)
        if forgotten:
            self.store.cleanup_disposed(before=math.inf, account=self.account,
                                        operation_ids=forgotten)
        return bool(forgotten)

    def usage_of(self, operation_id: str) -> Usage:
        """What the provider reported for the operation's attempts (zero when unknown)."""
        try:
            record = self.store.get_operation(operation_id)
        except errors.RecoveryError:
            return Usage()
        total = Usage()
        for attempt in record.attempts if record is not None else ():
            if attempt.usage is not None:
                total = total + attempt.usage
        return total

    async def outcome(self, job: Mapping[str, Any], text_format: Any = None) -> MapResult:
        """One ``map`` job (``parse``'s keyword arguments) to its :class:`MapResult`."""
        arguments = dict(job)
        text_format = arguments.pop("text_format", text_format)
        job_id = arguments.pop("job_id", None)
        revision = arguments.pop("input_revision", None)
        attempts = arguments.pop("maximum_attempts", None)
        handle: Handle | None = None
        saved = False
        try:
            request = self.request(**arguments)
            if job_id is None:
                job_id = digest_job_id(request, text_format)
            handle = await self.prepare(request, text_format=text_format, job_id=job_id,
                                        input_revision=revision, maximum_attempts=attempts)
            record = self.store.get_operation(handle.operation_id)
            saved = record is not None and record.has_completion
            value = await self.send(handle, text_format=text_format)
        except errors.RecoveryError as exc:
            operation_id = handle.operation_id if handle else exc.operation_id
            return MapResult(
                job_id=str(job_id), input_revision=revision, error=exc,
                usage=self.usage_of(operation_id) if operation_id else Usage(),
                operation_id=operation_id,
            )
        return MapResult(job_id=job_id, input_revision=revision, value=value,
                         usage=self.usage_of(handle.operation_id),
                         operation_id=handle.operation_id, saved=saved)

    async def map(
        self,
        requests: Iterable[Mapping[str, Any]],
        *,
        text_format: Any = None,
        concurrency: int = 64,
        progress: bool | IO[str] = False,
    ) -> AsyncGenerator[MapResult, None]:
        """Run many jobs, at most ``concurrency`` sending at once; yield each job's
        :class:`MapResult` as it completes, once per job key (a repeated key in
        ``requests`` is skipped). Each request is a mapping of ``parse``'s keyword
        arguments; ``text_format`` here is the default for those that name none.

        A job whose result is saved (and not forgotten) is yielded again from its receipt,
        with nothing sent: a rerun after a crash pays only for the jobs that had no saved
        result. ``progress=True`` draws the CLI's progress line on stderr (or on the
        given text stream). To leave the loop early, iterate inside
        ``contextlib.aclosing(client.map(...))``: closing it stops the jobs still sending
        (their operations are suspended; the next run resumes them) before it returns.
        A request that is not a job (no ``text_format``, a misspelled argument) stops the
        map and is raised where it is iterated.
        """
        if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
            raise errors.InvalidParameter("concurrency must be a positive integer",
                                          parameter="concurrency")
        send, receive = trio.open_memory_channel[MapResult](concurrency)
        jobs = _MapJobs(self, requests, text_format)
        scope: trio.CancelScope = await self._nursery.start(
            jobs.run, send, concurrency, progress
        )
        try:
            async with receive:
                async for result in receive:
                    yield result
        finally:
            scope.cancel()
            with trio.CancelScope(shield=True):  # until every stopped send has suspended
                await jobs.done.wait()
        if jobs.error is not None:
            raise jobs.error


class _MapJobs:
    """The task that runs one ``map``'s jobs in the client's nursery (an async generator
    must not hold a nursery open across ``yield``)."""

    def __init__(self, client: Client, requests: Iterable[Mapping[str, Any]],
                 text_format: Any) -> None:
        self.client = client
        self.requests = requests
        self.text_format = text_format
        self.done = trio.Event()
        self.seen: set[tuple[str | None, str | None]] = set()
        # What the CLI's progress line reads (cli/progress.py, ProgressHost).
        self.summary: Any = None
        self.sized = False  # the summary's job count is known up front
        self.running = 0
        self.workers = 0
        self.error: Exception | None = None  # what stopped the jobs (not a job's outcome)
        self.scope = trio.CancelScope()

    @property
    def rt(self) -> Runtime:
        return self.client.runtime

    @property
    def config(self) -> _MapJobs:
        return self  # the progress line reads config.workers: none here

    def attempts_spent(self) -> int:
        return self.client.runtime.attempts_consumed

    async def run(self, send: trio.MemorySendChannel[MapResult], concurrency: int,
                  progress: bool | IO[str], *,
                  task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        try:
            with self.scope:
                task_status.started(self.scope)
                async with send, trio.open_nursery() as nursery:
                    display = self._display(progress)
                    if display is not None:
                        nursery.start_soon(display.run)
                    limiter = trio.Semaphore(concurrency)
                    async with trio.open_nursery() as jobs:
                        try:
                            for job in self.requests:
                                if not self._first_time(job):
                                    continue
                                await limiter.acquire()
                                jobs.start_soon(self._one, job, limiter, send.clone())
                        except Exception as exc:
                            self._stop(exc)
                    if display is not None:
                        display.draw(final=True)
                    nursery.cancel_scope.cancel()
        finally:
            self.done.set()

    def _first_time(self, job: Mapping[str, Any]) -> bool:
        """Is this the first request of its job key in this map (a job id named)?"""
        if not isinstance(job, Mapping):
            raise errors.InvalidRequest("each map request is a mapping of parse's arguments")
        if job.get("text_format", self.text_format) is None:
            raise errors.InvalidRequest("a map request needs text_format (or map(text_format=))")
        key = (job.get("job_id"), job.get("input_revision"))
        if key[0] is not None and key in self.seen:
            return False
        self.seen.add(key)
        if self.summary is not None and not self.sized:
            self.summary.jobs += 1
        return True

    def _stop(self, exc: Exception) -> None:
        """A bad request (not a job's outcome): stop the map; raised where it is iterated."""
        if self.error is None:
            self.error = exc
        self.scope.cancel()

    async def _one(self, job: Mapping[str, Any], limiter: trio.Semaphore,
                   send: trio.MemorySendChannel[MapResult]) -> None:
        async with send:
            self.running += 1
            try:
                result = await self.client.outcome(job, self.text_format)
            except Exception as exc:
                self._stop(exc)
                return
            finally:
                self.running -= 1
                limiter.release()
            self._count(result)
            await send.send(result)

    def _count(self, result: MapResult) -> None:
        if self.summary is None:
            return
        if result.error is not None:
            self.summary.failed[failure_label(result.error)] += 1
        elif result.saved:
            self.summary.already_committed += 1
        else:
            self.summary.committed += 1
        if result.operation_id is not None:
            record = self.client.store.get_operation(result.operation_id)
            if record is not None:
                self.summary.tokens.add(record)

    def _display(self, progress: bool | IO[str]) -> Any:
        """The CLI's progress display over this map (None: no progress asked)."""
        if progress is False:
            return None
        from recoverable.cli.progress import ProgressDisplay, Terminal
        from recoverable.cli.report import BatchSummary

        self.summary = BatchSummary()
        if isinstance(self.requests, Sized):
            self.summary.jobs = len(self.requests)
            self.sized = True
        stream = sys.stderr if progress is True else progress
        terminal = Terminal(stream, sys.stderr)
        return ProgressDisplay(self, terminal, live=terminal.isatty(), started=time.monotonic())


@contextlib.asynccontextmanager
async def open_client(
    path: str,
    *,
    endpoint: str,
    account: str | AccountBinding,
    api_key_env: str = "OPENAI_API_KEY",
    authorize: Policy | None = None,
    scope: str = DEFAULT_SCOPE,
    maximum_attempts: int = 3,
    retry_policy: RetryPolicy | None = None,
    mode: str | None = None,
    **runtime_options: Any,
) -> AsyncIterator[Client]:
    """Open the store at ``path`` (created if missing), the backend and the runtime, and
    yield a :class:`Client`; close them all on exit. Trio.

    ``endpoint`` is a Responses base URL, or ``"fixture"`` for the embedded fixture
    provider (served on 127.0.0.1 while the client is open). The API key is read from the
    environment variable ``api_key_env`` once, here, and kept in memory only (never
    saved). ``account`` names the account the key belongs to (an id, or an
    ``AccountBinding``). ``authorize`` is the standing authorization policy, asked for
    every attempt (``async def`` or plain ``def`` ``(Attempt) -> bool``; default: approve
    every attempt within ``maximum_attempts``). ``mode`` is the backend's (one of
    ``transport.modes.MODES``: ``"websocket"``, the default, or ``"sse"``);
    ``runtime_options`` are ``open_runtime``'s.
    """
    if not isinstance(account, AccountBinding) and (not isinstance(account, str) or not account):
        raise errors.InvalidParameter("account must be a non-empty string or an "
                                      "AccountBinding", parameter="account")
    binding = account if isinstance(account, AccountBinding) else AccountBinding(
        account, "api-key"
    )
    backend_options: dict[str, Any] = {} if mode is None else {"mode": mode}
    async with contextlib.AsyncExitStack() as stack:
        fixture: FixtureProvider | None = None
        if endpoint == FIXTURE_ENDPOINT:
            from recoverable.fixture.provider import FixtureProvider  # only when asked

            fixture = await stack.enter_async_context(FixtureProvider.serve())
            url, key = fixture.http_url, _FIXTURE_KEY
            # The port changes per run; the endpoint's identity must not.
            backend_options["endpoint_id"] = FIXTURE_ENDPOINT
        else:
            url, key = endpoint, os.environ.get(api_key_env, "")
            if not key:
                raise errors.InvalidParameter(
                    f"no API key: the environment variable {api_key_env} is not set",
                    parameter="api_key_env",
                )
        backend = ResponsesBackend(
            url, credentials=StaticCredentials(key, account=binding), **backend_options
        )
        store = stack.enter_context(RecoveryStore.open(path))
        await stack.enter_async_context(backend)
        runtime = await stack.enter_async_context(
            open_runtime(store, backend, account=binding, **runtime_options)
        )
        nursery = await stack.enter_async_context(trio.open_nursery())
        client = Client(runtime, store, nursery, scope=scope, maximum_attempts=maximum_attempts,
                        retry_policy=retry_policy, authorize=authorize, fixture=fixture)
        try:
            yield client
        finally:
            nursery.cancel_scope.cancel()  # a map still running when the client closes
