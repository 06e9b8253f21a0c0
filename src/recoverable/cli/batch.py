"""The batch host behind ``recoverable batch``: a JSONL file of jobs, run durably.

Every job is one recovery operation keyed by ``(id, revision)`` in scope
``"batch"``. The output file is the host's own commit log: one fsynced JSON
line per committed job, and an operation is acknowledged only after its line
is durable. A rerun reads the log back (dropping a torn last line), adopts the
operations it finds in the store for uncommitted jobs instead of preparing
again, and acknowledges committed jobs whose acknowledgement was lost.
Cancellation (Ctrl-C) suspends every running operation; nothing saved is
generated again.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import signal
import stat
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from typing import IO, Any, Final, Literal, TypeVar

import attrs
import msgspec
import trio

from recoverable import _killpoints, errors, machine
from recoverable.actors.runtime import Runtime, open_runtime
from recoverable.body import body_hash, freeze_body, parameters_from_wire
from recoverable.contract import contract_for
from recoverable.pricing import PriceTable, TokenLedger, builtin_prices
from recoverable.records import OperationRecord
from recoverable.storage.store import RecoveryStore
from recoverable.transport.backend import ResponsesBackend
from recoverable.transport.base import StaticCredentials, validate_api_key
from recoverable.transport.connect import EndpointGate
from recoverable.transport.fixture import FaultSpec, FixtureProvider
from recoverable.types import (
    AccountBinding,
    Attempt,
    Handle,
    JsonSchema,
    RetryPolicy,
    StructuredRequest,
)

__all__ = [
    "BATCH_SCOPE",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "MAX_LINE_BYTES",
    "BatchConfig",
    "BatchOutputLine",
    "BatchSummary",
    "ErrorLog",
    "Job",
    "JobLineError",
    "ResultLog",
    "ResultLogError",
    "parse_batch_api_line",
    "parse_job_line",
    "read_jobs",
    "run_batch",
]

BATCH_SCOPE: Final = "batch"
MAX_LINE_BYTES: Final = 2**20  # one job line (input + schema) at most 1 MiB
MAX_ID_CHARS: Final = 256
MESSAGES_PER_REASON: Final = 5  # failure messages shown per reason (all are counted)
# Failures of the whole store (not of one operation's records): the first is shown, then
# one line saying the store is unusable; the others are only counted.
STORE_WIDE_REASONS: Final = frozenset(
    {errors.StorageUnavailable.code, errors.StoreDamaged.code, errors.StoreLockReplaced.code}
)
MAXIMUM_RETRY_AFTER: Final = 600.0  # the batch waits at most this long for a Retry-After
MINIMUM_RPS: Final = 0.01  # --rps below this (one POST per 100 s) is refused
FIXTURE_ACCOUNT: Final = AccountBinding("batch", "api-key")
FIXTURE_NOTICE: Final = (
    "provider: embedded fixture: answers are synthesized test data, not a model's "
    "(use --endpoint URL for a real provider)"
)
FIXTURE_KEY: Final = "sk-fixture-batch"  # the embedded provider accepts any key

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_INTERRUPTED: Final = 130


# -- jobs ---------------------------------------------------------------------------------


class JobLineError(Exception):
    """A job line that cannot be run; the batch reports it and goes on."""

    def __init__(self, lineno: int, reason: str, *, job_id: str | None = None) -> None:
        super().__init__(f"line {lineno}: {reason}")
        self.lineno = lineno
        self.reason = reason
        self.job_id = job_id  # the line's custom_id, when it could be read


class _JobLine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    revision: str
    model: str
    input: str | list[dict[str, Any]]
    schema: dict[str, Any]
    instructions: str | None = None
    schema_name: str = "result"
    max_attempts: int | None = None
    reasoning_effort: str | None = None
    max_output_tokens: int | None = None
    # Optional Responses parameters by wire name (docs/cli.md, docs/parameters.md).
    parameters: dict[str, Any] | None = None


@attrs.frozen
class Job:
    """One validated job line: the request, its response contract and frozen-body hash."""

    id: str
    revision: str
    lineno: int
    request: StructuredRequest
    response: JsonSchema
    max_attempts: int | None
    body_hash: str
    # "recoverable" (this tool's job line) or "openai-batch" (an OpenAI Batch API line)
    source: str = "recoverable"

    @property
    def key(self) -> tuple[str, str]:
        return (self.id, self.revision)


def _job_parameters(raw: _JobLine) -> dict[str, Any]:
    """The job's ``parameters`` object as request keywords (raises ``InvalidRequest``)."""
    if raw.parameters is None:
        return {}
    kwargs = parameters_from_wire(raw.parameters)
    for name in ("model", "input", "instructions", "reasoning_effort", "max_output_tokens"):
        if name in kwargs:
            wire = "reasoning.effort" if name == "reasoning_effort" else name
            raise errors.InvalidParameter(
                f"parameters.{wire}: give {name} as a top-level field of the job line",
                parameter=wire, reason="refused",
            )
    return kwargs


def line_format(line: str) -> str:
    """``"openai-batch"`` for an OpenAI Batch API line (a JSON object with ``custom_id``),
    else ``"recoverable"`` (this tool's own job line; also for a line that is not JSON)."""
    if '"custom_id"' not in line:  # cheap: most lines of the own format never decode twice
        return "recoverable"
    try:
        value = msgspec.json.decode(line)
    except (msgspec.DecodeError, RecursionError):
        return "recoverable"
    return "openai-batch" if isinstance(value, dict) and "custom_id" in value else "recoverable"


def _is_object(line: str) -> bool:
    try:
        return isinstance(msgspec.json.decode(line), dict)
    except (msgspec.DecodeError, RecursionError):
        return False


_LineT = TypeVar("_LineT")


def _decode_line(line: str, lineno: int, kind: type[_LineT], invalid: str) -> _LineT:
    """One JSON line as ``kind``, every decoding failure a :class:`JobLineError`."""
    try:
        return msgspec.json.decode(line, type=kind)
    except msgspec.ValidationError as exc:
        raise JobLineError(lineno, f"{invalid}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise JobLineError(lineno, f"not a JSON object: {exc}") from None
    except RecursionError:
        raise JobLineError(lineno, "the JSON is nested too deeply") from None


def _check_id(lineno: int, name: str, value: str) -> None:
    if not value or len(value) > MAX_ID_CHARS or any(ord(c) < 32 for c in value):
        raise JobLineError(
            lineno, f"{name} must be 1..{MAX_ID_CHARS} characters without control characters"
        )


def parse_job_line(line: str, lineno: int, *, revision: str | None = None) -> Job:
    """Parse and validate one JSONL job line (this tool's format, or an OpenAI Batch API
    line, told apart by ``custom_id``); raise ``JobLineError(lineno, reason)``.

    ``revision`` is the ``--revision`` given for Batch API lines (which carry none); without
    it their revision is derived from the body (see ``batch_revision``)."""
    if len(line) > MAX_LINE_BYTES or len(line.encode("utf-8", "surrogatepass")) > MAX_LINE_BYTES:
        raise JobLineError(lineno, f"the line is longer than {MAX_LINE_BYTES} bytes")
    if line_format(line) == "openai-batch":
        return parse_batch_api_line(line, lineno, revision=revision)
    raw = _decode_line(line, lineno, _JobLine, "invalid job")
    for name, value in (("id", raw.id), ("revision", raw.revision)):
        _check_id(lineno, name, value)
    if raw.max_attempts is not None and not 1 <= raw.max_attempts <= machine.MAX_ATTEMPTS:
        raise JobLineError(lineno, f"max_attempts must be in 1..{machine.MAX_ATTEMPTS}")
    response = JsonSchema(raw.schema_name, raw.schema)
    try:
        request = StructuredRequest(
            model=raw.model,
            instructions=raw.instructions,
            input=raw.input,
            reasoning_effort=raw.reasoning_effort,
            max_output_tokens=raw.max_output_tokens,
            **_job_parameters(raw),
        )
        machine.validate_preparation(
            maximum_attempts=raw.max_attempts or 1,
            retry_policy=RetryPolicy(),
            scope=BATCH_SCOPE,
            job_id=raw.id,
            input_revision=raw.revision,
            contract_version=None,
        )
        body = freeze_body(request, contract_for(response))
    except errors.InvalidRequest as exc:
        raise JobLineError(lineno, str(exc)) from None
    except RecursionError:
        raise JobLineError(lineno, "the job is nested too deeply") from None
    return Job(
        id=raw.id,
        revision=raw.revision,
        lineno=lineno,
        request=request,
        response=response,
        max_attempts=raw.max_attempts,
        body_hash=body_hash(body),
    )


# -- OpenAI Batch API lines (issue 19.5) ---------------------------------------------------

BATCH_URL: Final = "/v1/responses"
BATCH_REVISION_PREFIX: Final = "body-sha256:"


class _BatchApiLine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class _TextFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: str
    name: str
    schema: dict[str, Any]
    strict: bool | None = None


def batch_revision(body: dict[str, Any]) -> str:
    """The revision of a Batch API line without ``--revision``: a digest of its ``body``
    as canonical JSON (keys sorted), so it changes exactly when the body changes."""
    digest = hashlib.sha256(msgspec.json.encode(body, order="sorted")).hexdigest()
    return BATCH_REVISION_PREFIX + digest[:32]


def parse_batch_api_line(line: str, lineno: int, *, revision: str | None = None) -> Job:
    """One OpenAI Batch API request line: ``{"custom_id", "method": "POST", "url":
    "/v1/responses", "body": {...}}`` whose body carries ``text.format`` of type
    ``json_schema`` (strict); the rest of the body is taken by wire name
    (``StructuredRequest.from_params``), unknown names refused."""
    raw = _decode_line(line, lineno, _BatchApiLine, "invalid Batch API line")
    _check_id(lineno, "custom_id", raw.custom_id)
    try:
        return _batch_api_job(raw, lineno, revision)
    except JobLineError as exc:
        raise JobLineError(lineno, exc.reason, job_id=raw.custom_id) from None


def _batch_api_job(raw: _BatchApiLine, lineno: int, revision: str | None) -> Job:
    if raw.method != "POST":
        raise JobLineError(lineno, f"method {raw.method[:16]!r}: only POST is supported")
    if raw.url != BATCH_URL:
        raise JobLineError(
            lineno, f"url {raw.url[:80]!r}: only {BATCH_URL} (the Responses API) is supported"
        )
    body = dict(raw.body)
    text = body.get("text")
    if not isinstance(text, dict) or "format" not in text:
        raise JobLineError(
            lineno, "body.text.format is missing: a job needs a json_schema output format"
        )
    try:
        fmt = msgspec.convert(text["format"], type=_TextFormat)
    except msgspec.ValidationError as exc:
        raise JobLineError(lineno, f"body.text.format: {exc}") from None
    if fmt.type != "json_schema":
        raise JobLineError(
            lineno, f"body.text.format.type {fmt.type[:32]!r}: only json_schema is supported"
        )
    if fmt.strict is not True:
        raise JobLineError(
            lineno, "body.text.format.strict must be true (results are validated against the "
            "schema in strict mode)"
        )
    rest = {k: v for k, v in text.items() if k != "format"}
    if rest:
        body["text"] = rest
    else:
        del body["text"]
    job_revision = revision if revision is not None else batch_revision(raw.body)
    response = JsonSchema(fmt.name, fmt.schema)
    try:
        request = StructuredRequest.from_params(body)
        machine.validate_preparation(
            maximum_attempts=1,
            retry_policy=RetryPolicy(),
            scope=BATCH_SCOPE,
            job_id=raw.custom_id,
            input_revision=job_revision,
            contract_version=None,
        )
        frozen = freeze_body(request, contract_for(response))
    except errors.InvalidRequest as exc:
        raise JobLineError(lineno, f"body: {exc}") from None
    except TypeError as exc:  # a required field (model) is missing from the body
        raise JobLineError(lineno, f"body: {exc}") from None
    except RecursionError:
        raise JobLineError(lineno, "the job is nested too deeply") from None
    return Job(
        id=raw.custom_id,
        revision=job_revision,
        lineno=lineno,
        request=request,
        response=response,
        max_attempts=None,
        body_hash=body_hash(frozen),
        source="openai-batch",
    )


@attrs.frozen
class JobsFile:
    jobs: list[Job]
    bad_lines: list[JobLineError]
    duplicates: list[tuple[int, int]]  # (line, first line with the same id and revision)
    # (line, first line): same id and revision as the first line, different content
    conflicts: list[tuple[int, int]] = attrs.field(factory=list)
    # "recoverable" or "openai-batch": the format of the file's first valid job (None: none)
    format: str | None = None


def _bounded_lines(fh: IO[bytes], limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) per line; ``None`` for a line longer than ``limit`` (skipped
    without ever holding more than ``limit`` bytes of it)."""
    lineno = 0
    while True:
        chunk = fh.readline(limit + 1)
        if not chunk:
            return
        lineno += 1
        if len(chunk) > limit and not chunk.endswith(b"\n"):
            while chunk and not chunk.endswith(b"\n"):
                chunk = fh.readline(limit + 1)
            yield lineno, None
            continue
        yield lineno, chunk


FORMAT_NAMES: Final = {
    "recoverable": "a recoverable job line", "openai-batch": "an OpenAI Batch API line"
}


def read_jobs(path: str, *, revision: str | None = None) -> JobsFile:
    """Read a JSONL jobs file; bad lines and duplicates are collected, not raised.

    The first valid job line decides the file's format (this tool's job lines, or OpenAI
    Batch API lines: those with ``custom_id``); a line of the other format is a bad
    line (a file may not mix them). ``revision``: see ``parse_job_line``.
    Raises ``OSError`` when the file itself cannot be read.
    """
    jobs: list[Job] = []
    bad: list[JobLineError] = []
    duplicates: list[tuple[int, int]] = []
    conflicts: list[tuple[int, int]] = []
    first: dict[tuple[str, str], Job] = {}
    by_custom_id: dict[str, Job] = {}
    file_format: tuple[str, int] | None = None  # (format, the line that decided it)
    with open(path, "rb") as fh:
        for lineno, data in _bounded_lines(fh, MAX_LINE_BYTES + 2):
            if data is None:
                bad.append(JobLineError(lineno, f"the line is longer than {MAX_LINE_BYTES} bytes"))
                continue
            if lineno == 1 and data.startswith(b"\xef\xbb\xbf"):
                bad.append(JobLineError(
                    lineno, "the line starts with a byte order mark (BOM, EF BB BF): "
                    "save the file as UTF-8 without BOM"))
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                bad.append(JobLineError(lineno, "the line is not valid UTF-8"))
                continue
            if not text.strip():
                continue
            line = text.rstrip("\r\n")
            kind = line_format(line)
            if file_format is not None and kind != file_format[0] and _is_object(line):
                bad.append(JobLineError(
                    lineno, f"{FORMAT_NAMES[kind]}, but the file's first valid job (line "
                    f"{file_format[1]}) is {FORMAT_NAMES[file_format[0]]}: a file may not mix "
                    "the two formats"))
                continue
            try:
                job = parse_job_line(line, lineno, revision=revision)
            except JobLineError as exc:
                bad.append(exc)
                continue
            except Exception as exc:  # one line never ends the batch, even by a defect
                bad.append(JobLineError(
                    lineno, f"internal_error:{type(exc).__name__} while reading the job"))
                continue
            if file_format is None:  # the first valid job decides (not a garbled line)
                file_format = (kind, lineno)
            same_id = by_custom_id.get(job.id) if job.source == "openai-batch" else None
            if same_id is not None and same_id.body_hash != job.body_hash:
                # A Batch file's custom_id names one request: another body under the same
                # custom_id is a bad line (with --revision it is the revision conflict below).
                if same_id.revision != job.revision:
                    bad.append(JobLineError(
                        lineno, f"custom_id {job.id[:64]!r} is used by line {same_id.lineno} "
                        "with another body: custom_id must be unique in a Batch file"))
                    continue
            if job.source == "openai-batch":
                by_custom_id.setdefault(job.id, job)
            earlier = first.get(job.key)
            if earlier is not None:
                if earlier.body_hash == job.body_hash:
                    duplicates.append((lineno, earlier.lineno))
                else:
                    conflicts.append((lineno, earlier.lineno))
                continue
            first[job.key] = job
            jobs.append(job)
    return JobsFile(
        jobs, bad, duplicates, conflicts, format=None if file_format is None else file_format[0]
    )


# -- the output file: the host's commit log ---------------------------------------------------


class ResultLogError(Exception):
    """The output file cannot be used as this batch's commit log."""


class ResultLine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    revision: str
    operation_id: str
    result: msgspec.Raw
    # sha256 of the job's frozen request body (lines written before it existed lack it)
    input_sha256: str | None = None


class _BatchMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    revision: str
    operation_id: str
    input_sha256: str | None = None


class BatchOutputLine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A line of ``--output-format openai-batch``: the Batch API's output line
    (``id``, ``custom_id``, ``response``, ``error``) plus what the commit log needs
    (``recoverable``: revision, operation id, input digest)."""

    id: str
    custom_id: str
    recoverable: _BatchMeta
    response: msgspec.Raw
    error: None = None


OUTPUT_FORMATS: Final = ("recoverable", "openai-batch")


class ResultLog:
    """Append-only JSONL commit log, fsynced per group of lines, locked for one writer.

    ``open`` reads back what is committed (a torn last line is cut off) and
    takes an exclusive ``flock`` so two batches never append to the same file.
    ``output_format`` is the shape of its lines (``OUTPUT_FORMATS``); a file written in
    the other shape is refused.
    """

    def __init__(self, path: str, fd: int, committed: dict[tuple[str, str], str]) -> None:
        self.path = path
        self._fd = fd
        self.committed = committed
        self.truncated_bytes = 0
        self.newline_added = False
        self.hashes: dict[tuple[str, str], str] = {}  # committed key -> input_sha256
        self.lines: dict[tuple[str, str], int] = {}  # committed key -> line number
        self._lock = trio.Lock()
        self._pending: list[bytes] = []
        self._queued = 0
        self._synced = 0
        self._broken: OSError | None = None
        self.syncs = 0

    @classmethod
    def open(cls, path: str, output_format: str = "recoverable") -> ResultLog:
        path = os.path.abspath(path)
        directory = os.path.dirname(path)
        created = not os.path.exists(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ResultLogError(f"cannot open the output file {path}: {exc.strerror}") from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ResultLogError(
                    f"another batch is writing to {path} (the file is locked)"
                ) from None
            if created:
                os.fsync(fd)
                _fsync_dir(directory)
            back = _read_back(fd, path, output_format)
            log = cls(path, fd, back.committed)
            log.hashes = back.hashes
            log.lines = back.lines
            if back.unterminated:
                # A complete, valid result line that only lacks its newline (a crash
                # between the line and its newline, or an editor): kept, newline added.
                log._write_sync(b"\n")
                log.newline_added = True
            elif back.good_end < back.size:
                # A torn last line (a crash mid-append): it was never acknowledged.
                os.ftruncate(fd, back.good_end)
                os.fsync(fd)
                log.truncated_bytes = back.size - back.good_end
            return log
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # also releases the flock
            self._fd = -1

    async def append(self, line: bytes) -> None:
        """Append one line and return once it is on disk (group commit; shielded)."""
        if b"\n" in line:
            raise ValueError("a result line must not contain a newline")
        with trio.CancelScope(shield=True):
            if self._broken is not None:
                raise self._broken
            self._pending.append(line + b"\n")
            self._queued += 1
            mine = self._queued
            async with self._lock:
                if self._synced >= mine:
                    return
                if self._broken is not None:
                    raise self._broken
                batch, self._pending = self._pending, []
                upto = self._queued
                try:
                    await trio.to_thread.run_sync(self._write_sync, b"".join(batch))
                except OSError as exc:
                    # A partial write may be on disk: refuse further appends (a rerun cuts
                    # the torn tail) rather than risk a broken line in the middle.
                    self._broken = exc
                    raise
                self._synced = upto
                self.syncs += 1

    def _write_sync(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        os.fsync(self._fd)


def _fsync_dir(directory: str) -> None:
    dfd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


_line_decoder = msgspec.json.Decoder(ResultLine)
_batch_line_decoder = msgspec.json.Decoder(BatchOutputLine)


def _decode_entry(line: bytes, output_format: str) -> tuple[tuple[str, str], str, str | None]:
    """(key, operation id, input digest) of one output line (raises msgspec errors)."""
    if output_format == "openai-batch":
        out = _batch_line_decoder.decode(line)
        meta = out.recoverable
        return (out.custom_id, meta.revision), meta.operation_id, meta.input_sha256
    entry = _line_decoder.decode(line)
    return (entry.id, entry.revision), entry.operation_id, entry.input_sha256


@attrs.define
class _ReadBack:
    committed: dict[tuple[str, str], str] = attrs.field(factory=dict)
    hashes: dict[tuple[str, str], str] = attrs.field(factory=dict)
    lines: dict[tuple[str, str], int] = attrs.field(factory=dict)
    good_end: int = 0  # end of the last whole, valid line
    size: int = 0
    unterminated: bool = False  # the last line is complete and valid but has no newline


def _read_back(fd: int, path: str, output_format: str = "recoverable") -> _ReadBack:
    """What the output file holds: committed (id, revision) -> operation id, and where
    its valid part ends. Refuses (``ResultLogError``) a file that is not a result log
    of ``output_format``: a whole line that is not a result line, or a last line that
    cannot be the torn beginning of one. Never truncates anything itself."""
    back = _ReadBack(size=os.fstat(fd).st_size)
    lineno = 0
    other = "openai-batch" if output_format == "recoverable" else "recoverable"
    with os.fdopen(os.dup(fd), "rb") as fh:
        fh.seek(0)
        for line in fh:
            lineno += 1
            if not line.endswith(b"\n"):
                try:
                    entry = _decode_entry(line, output_format)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    if not _is_torn_result_line(line, output_format):
                        raise ResultLogError(
                            f"{path}:{lineno}: the last line is neither a result line nor the "
                            "torn beginning of one: this is not a file written by "
                            f"recoverable batch --output-format {output_format}; use another "
                            "--out file"
                        ) from None
                    break  # torn tail
                _add(back, entry, lineno)
                back.unterminated = True
                back.good_end += len(line)
                break
            try:
                entry = _decode_entry(line, output_format)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                hint = ""
                with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                    _decode_entry(line, other)
                    hint = f" (it was written with --output-format {other}: use that again)"
                raise ResultLogError(
                    f"{path}:{lineno}: not a line written by recoverable batch "
                    f"--output-format {output_format} ({exc}){hint}; use another --out file"
                ) from None
            _add(back, entry, lineno)
            back.good_end += len(line)
    return back


def _add(
    back: _ReadBack, entry: tuple[tuple[str, str], str, str | None], lineno: int
) -> None:
    key, operation_id, input_sha256 = entry
    if key in back.committed:
        return
    back.committed[key] = operation_id
    back.lines[key] = lineno
    if input_sha256 is not None:
        back.hashes[key] = input_sha256


_STRING = object()
_LINE_SHAPE: Final[tuple[object, ...]] = (
    b'{"id":', _STRING, b',"revision":', _STRING, b',"operation_id":', _STRING,
)


_BATCH_LINE_SHAPE: Final[tuple[object, ...]] = (
    b'{"id":', _STRING, b',"custom_id":', _STRING, b',"recoverable":{"revision":', _STRING,
    b',"operation_id":', _STRING,
)


def _is_torn_result_line(data: bytes, output_format: str = "recoverable") -> bool:
    """Whether ``data`` can be the beginning of a line this tool writes (compact JSON:
    ``{"id":"…","revision":"…","operation_id":"…",`` then the rest, or the
    ``openai-batch`` shape), cut short."""
    pos = 0
    shape = _BATCH_LINE_SHAPE if output_format == "openai-batch" else _LINE_SHAPE
    tails = (b',"input_sha256":"', b',"result":' if shape is _LINE_SHAPE else b'},"response":')
    for part in shape:
        if pos >= len(data):
            return True
        if isinstance(part, bytes):
            chunk = data[pos : pos + len(part)]
            if not part.startswith(chunk):
                return False
            pos += len(part)
            continue
        if data[pos : pos + 1] != b'"':
            return False
        pos += 1
        while pos < len(data):
            c = data[pos : pos + 1]
            if c == b"\\":
                pos += 2
                continue
            if c == b'"':
                break
            if c < b" ":
                return False
            pos += 1
        else:
            return True  # cut inside the string
        pos += 1
    rest = data[pos:]
    return any(tag.startswith(rest[: len(tag)]) for tag in tails)


# -- running ------------------------------------------------------------------------------------


DEFAULT_RETRY_PROVIDER_CODES: frozenset[str] = frozenset(
    {"server_error", "server_is_overloaded", "slow_down", "rate_limit_exceeded"}
)


@attrs.frozen
class BatchConfig:
    jobs_path: str
    out_path: str
    store_path: str
    endpoint: str = "fixture"  # "fixture" or a base URL
    api_key_env: str = "OPENAI_API_KEY"
    account: str | None = None
    mode: Literal["websocket", "sse"] = "websocket"
    concurrency: int = 64
    rps: float | None = None
    rpm: float | None = None  # --rpm / --tpm: the rate governor (docs/rate-limits.md)
    tpm: float | None = None
    rate_burst_seconds: float = 60.0
    faults: FaultSpec | None = None
    max_attempts: int = 8
    initial_backoff: float = 0.5
    maximum_backoff: float = 30.0
    maximum_retry_after: float = MAXIMUM_RETRY_AFTER
    idle_timeout: float = 120.0
    # The batch opts in explicitly to replacing these response.failed codes (the library
    # default replaces none); ``--retry-provider-codes`` overrides, "" disables.
    retry_provider_codes: frozenset[str] = DEFAULT_RETRY_PROVIDER_CODES
    prices: PriceTable | None = None  # --prices FILE (None: the dated built-in estimate)
    # Issue 19.5: the shape of the --out lines ("recoverable" or "openai-batch"), the
    # --errors file, --retry-failed, and the --revision of Batch API lines.
    output_format: str = "recoverable"
    errors_path: str | None = None
    retry_failed: bool = False
    revision: str | None = None


@attrs.define
class BatchSummary:
    jobs: int = 0
    already_committed: int = 0
    committed: int = 0
    failed: Counter[str] = attrs.field(factory=Counter)
    unfinished: int = 0
    skipped_lines: int = 0
    duplicates: int = 0
    prepared: int = 0
    adopted: int = 0
    attempts: int = 0
    acknowledged_late: int = 0
    truncated_bytes: int = 0
    newline_added: bool = False
    maximum_retry_after: float | None = None
    elapsed: float = 0.0
    interrupted: bool = False
    fatal: str | None = None
    retry_provider_codes: tuple[str, ...] = ()  # the opt-in this run used (shown, sorted)
    endpoint_unavailable: str | None = None  # the typed connect failure at the end, if any
    tokens: TokenLedger = attrs.field(factory=TokenLedger)  # usage of the jobs run (19.3)
    prices: PriceTable | None = None
    retried: int = 0  # --retry-failed: successors created (or completed) this run
    errors_written: int = 0  # lines written to --errors
    errors_path: str | None = None

    @property
    def failed_total(self) -> int:
        return sum(self.failed.values())

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        if self.fatal is not None or self.failed_total or self.unfinished or self.skipped_lines:
            return EXIT_FAILED
        return EXIT_OK

    def table(self) -> str:
        rate = self.committed / self.elapsed if self.elapsed > 0 else 0.0
        rows: list[tuple[str, str]] = [
            ("jobs", str(self.jobs)),
            ("committed (this run)", str(self.committed)),
            ("committed (earlier runs)", str(self.already_committed)),
            ("failed", str(self.failed_total)),
        ]
        rows += [(f"  {reason}", str(n)) for reason, n in sorted(self.failed.items())]
        rows += [
            ("unfinished", str(self.unfinished)),
            ("skipped lines", str(self.skipped_lines)),
            ("duplicate lines", str(self.duplicates)),
            ("operations prepared", str(self.prepared)),
            ("operations resumed", str(self.adopted)),
            ("POSTs (attempts spent)", str(self.attempts)),
            ("elapsed", f"{self.elapsed:.2f} s"),
            ("jobs/s", f"{rate:.1f}"),
            ("acknowledged late", str(self.acknowledged_late)),
            ("replaced provider codes", ", ".join(self.retry_provider_codes) or "none"),
        ]
        if self.maximum_retry_after is not None:
            rows.append(("Retry-After honoured up to", f"{self.maximum_retry_after:g} s"))
        if self.retried:
            rows.append(("manual retries created", f"{self.retried} (--retry-failed)"))
        if self.errors_path is not None:
            rows.append(("error lines", f"{self.errors_written} ({self.errors_path})"))
        rows += self.tokens.rows(self.prices)
        if self.truncated_bytes:
            rows.append(("torn output tail cut", f"{self.truncated_bytes} bytes"))
        if self.endpoint_unavailable is not None:
            rows.append((
                "endpoint unavailable",
                f"{self.endpoint_unavailable} (nothing spent; rerun when it is reachable)",
            ))
        if self.newline_added:
            rows.append(("output", "last line kept, its missing newline added"))
        if self.fatal is not None:
            rows.append(("stopped", self.fatal))
        if self.interrupted:
            rows.append(("interrupted", "yes (rerun to resume)"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


class ErrorLog:
    """The ``--errors`` file: one JSON line per failed job (and per skipped job line) of
    this run, written as it happens; rewritten by every run. A write failure is told
    once and never stops the batch."""

    def __init__(self, path: str, output_format: str, say: Callable[[str], None]) -> None:
        self.path = path
        self.output_format = output_format
        self.say = say
        self.written = 0
        self._fh: IO[bytes] | None = open(path, "wb")  # closed by close()

    def write(
        self,
        *,
        job_id: str | None,
        revision: str | None,
        lineno: int,
        code: str,
        reason: str,
        message: str,
        operation_id: str | None = None,
        hint: str | None = None,
    ) -> None:
        if self._fh is None:
            return
        record: dict[str, Any]
        if self.output_format == "openai-batch":
            # The Batch API's error line: id, custom_id, response (null), error {code, message}.
            record = {
                "id": None if operation_id is None else f"batch_req_{operation_id}",
                "custom_id": job_id,
                "response": None,
                "error": {"code": code, "message": message or reason},
                "recoverable": {
                    "revision": revision, "line": lineno, "reason": reason,
                    "operation_id": operation_id, "hint": hint,
                },
            }
        else:
            record = {
                "id": job_id, "revision": revision, "line": lineno, "code": code,
                "reason": reason, "operation_id": operation_id, "message": message or reason,
                "hint": hint,
            }
        try:
            self._fh.write(msgspec.json.encode(record) + b"\n")
            self._fh.flush()
            self.written += 1
        except (OSError, ValueError) as exc:
            self.say(f"warning: cannot write the errors file {self.path} ({exc}); the failures "
                     "are still counted in the summary")
            self._close_quietly()

    def close(self) -> None:
        if self._fh is None:
            return
        try:
            self._fh.flush()
            os.fsync(self._fh.fileno())
        except (OSError, ValueError) as exc:
            self.say(f"warning: cannot sync the errors file {self.path} ({exc})")
        self._close_quietly()

    def _close_quietly(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            with contextlib.suppress(OSError, ValueError):
                fh.close()


class _JobFailed(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


def failure_reason(exc: errors.RecoveryError) -> str:
    """A short, non-private reason for the summary (error code, and the failure kind)."""
    last = getattr(exc, "last_failure", None) or getattr(exc, "interruption", None)
    if last is not None:
        detail = last.provider_code if last.kind == "invalid_output" else None
        return f"{exc.code}:{last.kind}" + (f":{detail}" if detail else "")
    return exc.code


class BatchHost:
    """Runs the jobs of one batch over one runtime; see the module docstring."""

    def __init__(
        self,
        rt: Runtime,
        store: RecoveryStore,
        log: ResultLog,
        jobs: list[Job],
        config: BatchConfig,
        summary: BatchSummary,
        *,
        say: Callable[[str], None],
        work: trio.CancelScope | None = None,
        errors_log: ErrorLog | None = None,
    ) -> None:
        self.rt = rt
        self.errors_log = errors_log
        self.work = work
        self.fatal: str | None = None
        self.store = store
        self.log = log
        self.jobs = jobs
        self.config = config
        self.summary = summary
        self.say = say
        self.running = 0
        self._shown: Counter[str] = Counter()
        self.policy = RetryPolicy(
            initial_backoff=config.initial_backoff,
            maximum_backoff=config.maximum_backoff,
            retryable_provider_codes=config.retry_provider_codes,
            maximum_retry_after=config.maximum_retry_after,
        )

    async def authorize(self, attempt: Attempt) -> bool:
        # The batch is the host: it authorizes every attempt (and logs nothing private).
        # Attempts spent are counted by the runtime when consumed: an approved attempt
        # whose connection was never established spends nothing.
        return True

    @property
    def account(self) -> AccountBinding:
        assert self.rt.account is not None
        return self.rt.account

    async def acknowledge_committed(self) -> None:
        """Acknowledge committed jobs whose acknowledgement was lost (no line is rewritten)."""
        for (job_id, revision), op_id in self.log.committed.items():
            try:
                disposition = self.store.get_disposition(op_id)
                if disposition is not None and disposition.removal_complete:
                    continue
                if disposition is None and self.store.get_operation(op_id) is None:
                    continue  # not in this store (e.g. another --store): nothing to do
                await self.rt.acknowledge(Handle(op_id))
                self.summary.acknowledged_late += 1
            except errors.RecoveryError as exc:
                self.say(
                    f"warning: committed job {job_id!r} revision {revision!r}: could not "
                    f"acknowledge {op_id}: {exc.code}"
                )
            except Exception as exc:  # one job's failure never ends the batch
                self.say(
                    f"warning: committed job {job_id!r} revision {revision!r}: could not "
                    f"acknowledge {op_id}: internal_error:{type(exc).__name__}"
                )

    def find_existing(self, job: Job) -> str | None:
        """The operation a previous run prepared for this job (not disposed), if any."""
        found = []
        for op_id in self.store.ids_by_job(self.account, BATCH_SCOPE, job.id):
            try:
                if self.store.get_disposition(op_id) is not None:
                    continue
                record = self.store.get_operation(op_id)
            except (errors.CorruptRecord, errors.UnsupportedRecordVersion):
                continue
            if record is None or record.input_revision != job.revision:
                continue
            found.append(record)
        if not found:
            return None
        # Follow the lineage: a source whose successor (``recoverable retry``) exists is
        # replaced by that successor, never run again itself.
        ids = {r.operation_id for r in found}
        found = [
            r for r in found
            if r.retry_reservation is None
            or not r.retry_reservation.created
            or r.retry_reservation.successor_id not in ids
        ] or found
        # A saved completion first (never generate again), then the oldest.
        found.sort(key=lambda r: (not r.has_completion, r.created_at, r.operation_id))
        record = found[0]
        if record.body_hash != job.body_hash:
            raise _JobFailed(
                "revision_conflict",
                "the job's content changed but its revision did not (use a new revision)",
            )
        return record.operation_id

    async def run_job(self, job: Job) -> None:
        try:
            op_id = self.find_existing(job)
            if op_id is None:
                handle = await self.rt.prepare(
                    job.request,
                    response=job.response,
                    maximum_attempts=job.max_attempts or self.config.max_attempts,
                    retry_policy=self.policy,
                    scope=BATCH_SCOPE,
                    job_id=job.id,
                    input_revision=job.revision,
                )
                self.summary.prepared += 1
            else:
                handle = Handle(op_id)
                self.summary.adopted += 1
            self.running += 1
            try:
                value: Any = await self.rt.send_recovering(
                    handle, response=job.response, authorize=self.authorize
                )
            finally:
                self.running -= 1
            record = self._count_tokens(handle.operation_id)
        except _JobFailed as failed:
            self._failed(job, failed.reason, failed.detail)
            return
        except errors.OperationSuspended:
            self.summary.unfinished += 1
            self.say(f"job {job.id!r} (line {job.lineno}): suspended from outside; rerun to resume")
            return
        except errors.OperationBusy as exc:
            self.summary.unfinished += 1
            self.say(
                f"job {job.id!r} revision {job.revision!r} (line {job.lineno}): another process "
                f"is running its operation {exc.operation_id} right now; let it finish (or "
                "stop it with `recoverable suspend`), then rerun"
            )
            return
        except errors.RecoveryError as exc:
            self._count_tokens(exc.operation_id)
            message = str(exc) if str(exc) != exc.code else ""
            detail = message
            if exc.operation_id is not None:
                detail = (detail + "; " if detail else "") + self._hint(exc.operation_id)
            self._failed(
                job, failure_reason(exc), detail, code=exc.code, message=message,
                operation_id=exc.operation_id,
                hint=None if exc.operation_id is None else self._suggestion(exc.operation_id),
            )
            return
        except Exception as exc:  # one job's failure never ends the batch
            self._failed(
                job,
                f"internal_error:{type(exc).__name__}",
                "an unexpected error while running this job (a defect: please report it); "
                "the other jobs go on",
            )
            return
        try:
            if self.config.output_format == "openai-batch":
                line = msgspec.json.encode(
                    await self._batch_output_line(job, handle, record)
                )
            else:
                line = msgspec.json.encode(
                    {
                        "id": job.id,
                        "revision": job.revision,
                        "operation_id": handle.operation_id,
                        "input_sha256": job.body_hash,
                        "result": value,
                    }
                )
        except errors.RecoveryError as exc:
            self._failed(job, exc.code, "the result cannot be read back for the output line; it "
                         "stays saved in the store (rerun to write it)", code=exc.code,
                         operation_id=handle.operation_id)
            return
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            self._failed(job, f"internal_error:{type(exc).__name__}",
                         "the result cannot be written as JSON; it stays saved in the store")
            return
        try:
            await self.log.append(line)
        except OSError as exc:
            # The receipt stays saved (unacknowledged); a rerun writes the line.
            if self.fatal is None:
                self.fatal = f"writing {self.log.path} failed: {exc}"
                self.summary.fatal = self.fatal
                self.say(f"error: {self.fatal}; stopping (a rerun resumes)")
            if self.work is not None:
                self.work.cancel()
            return
        self.log.committed[job.key] = handle.operation_id
        self.summary.committed += 1
        _killpoints.hit("host.committed")
        try:
            await self.rt.acknowledge(handle)
        except errors.RecoveryError as exc:
            # The line is durable: a rerun acknowledges it without writing again.
            self.say(f"warning: job {job.id!r}: acknowledge failed ({exc.code}); rerun to finish")

    async def _batch_output_line(
        self, job: Job, handle: Handle, record: OperationRecord | None
    ) -> dict[str, Any]:
        """The Batch API output line of a committed job. Only what we have: the response
        id, the requested model, the validated JSON as the message's ``output_text``, the
        completing attempt's usage; ``request_id`` is null (not kept)."""
        receipt = await self.rt.receipt(handle)
        text = receipt.payload.decode("utf-8")
        usage = None
        if record is not None:
            completed = [a for a in record.attempts if a.outcome == "completed"]
            if completed and completed[-1].usage is not None:
                u = completed[-1].usage
                usage = {
                    "input_tokens": u.input_tokens,
                    "input_tokens_details": {"cached_tokens": u.cached_input_tokens},
                    "output_tokens": u.output_tokens,
                    "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
                    "total_tokens": u.total_tokens,
                }
        body = {
            "id": receipt.response_id,
            "object": "response",
            "status": "completed",
            "completed_at": int(receipt.completed_at.timestamp()),
            "model": job.request.model,
            "output": [{
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }],
            "output_text": text,
            "usage": usage,
        }
        return {
            "id": f"batch_req_{handle.operation_id}",
            "custom_id": job.id,
            "recoverable": {
                "revision": job.revision,
                "operation_id": handle.operation_id,
                "input_sha256": job.body_hash,
            },
            "response": {"status_code": 200, "request_id": None, "body": body},
            "error": None,
        }

    def _suggestion(self, operation_id: str) -> str | None:
        """What to do about a failed operation, as one instruction (or None)."""
        try:
            suggested = self.rt.status_of(operation_id).suggested_actions
        except Exception:  # a hint must never fail the job report
            suggested = ()
        store = self.config.store_path
        account = self.account.account_id
        if "manual_retry" in suggested:
            return (
                "to try again with a new budget linked to the spent one: rerun this batch with "
                f"--retry-failed, or run recoverable retry --store {store} --account {account} "
                f"{operation_id} --action-id retry-1, then rerun this batch"
            )
        if "sign_in" in suggested:
            return "fix the credentials, then rerun to resume it"
        return None

    def _hint(self, operation_id: str) -> str:
        """What the user can do about a failed operation (never "abandon, then rerun",
        which would reset the job's budget)."""
        suggestion = self._suggestion(operation_id)
        if suggestion is None:
            return f"operation {operation_id}"
        return f"operation {operation_id} ({suggestion})"

    def _count_tokens(self, operation_id: str | None) -> OperationRecord | None:
        """Add the operation's per-attempt usage to the summary (before acknowledge
        removes the record): every attempt's tokens, replaced ones included."""
        try:
            record = self.store.get_operation(operation_id) if operation_id else None
        except errors.RecoveryError:
            return None
        if record is not None:
            self.summary.tokens.add(record)
        return record

    def _failed(
        self,
        job: Job,
        reason: str,
        detail: str,
        *,
        code: str | None = None,
        message: str | None = None,
        operation_id: str | None = None,
        hint: str | None = None,
    ) -> None:
        if self.errors_log is not None:
            if hint is None and reason == "revision_conflict":
                hint = "change the revision (or the body back) for new content"
            self.errors_log.write(
                job_id=job.id, revision=job.revision, lineno=job.lineno,
                code=code or reason.split(":")[0], reason=reason,
                message=detail if message is None else message,
                operation_id=operation_id, hint=hint,
            )
        self.summary.failed[reason] += 1
        shown = self._shown[reason]
        store_wide = reason.split(":")[0] in STORE_WIDE_REASONS
        limit = 1 if store_wide else MESSAGES_PER_REASON
        if shown >= limit:
            return  # counted in the summary; announced once by report_suppressed
        self._shown[reason] += 1
        self.say(f"job {job.id!r} revision {job.revision!r} (line {job.lineno}) failed: {reason}"
                 + (f" — {detail}" if detail and detail != reason else ""))
        if store_wide:
            self.say(f"the store is not usable ({reason}): other jobs failing the same way are "
                     "only counted in the summary")

    def report_suppressed(self) -> None:
        for reason, n in sorted(self.summary.failed.items()):
            hidden = n - self._shown[reason]
            if hidden > 0:
                self.say(f"... and {hidden} more job(s) failed with {reason} (not shown)")

    def committed_conflict(self, job: Job) -> str | None:
        """Why a job already committed in the output conflicts with this line, if it does:
        its content changed but its revision did not."""
        committed_hash = self.log.hashes.get(job.key)
        if committed_hash is None:
            # A line written before the output carried the hash: the store's record, if
            # it is still there (committed, acknowledgement pending).
            op_id = self.log.committed[job.key]
            try:
                record = self.store.get_operation(op_id)
            except errors.RecoveryError:
                record = None
            committed_hash = record.body_hash if record is not None else None
        if committed_hash is None or committed_hash == job.body_hash:
            return None
        where = self.log.lines.get(job.key)
        return (
            f"committed earlier with other content ({self.log.path}"
            + (f":{where}" if where is not None else "")
            + "); change the revision for new content"
        )

    async def retry_failed(self) -> None:
        """``--retry-failed``: one manual-retry successor per failed job of this file whose
        operation suggests ``manual_retry`` (exhausted, failed, expired, blocked). The
        action id derives from the job and the source, so a rerun returns the same
        successor (never another budget for the same source); the count is printed."""
        created = 0
        for job in self.jobs:
            if job.key in self.log.committed:
                continue
            try:
                op_id = self.find_existing(job)
                if op_id is None:
                    continue
                status = self.rt.status_of(op_id)
                if "manual_retry" not in status.suggested_actions:
                    continue
                action = "batch-retry-failed-" + hashlib.sha256(
                    f"{job.id}\0{job.revision}\0{op_id}".encode("utf-8", "surrogatepass")
                ).hexdigest()[:32]
                successor = await self.rt.retry(
                    Handle(op_id), retry_action_id=action,
                    maximum_attempts=status.maximum_attempts,
                )
            except _JobFailed:
                continue  # the run reports it (revision_conflict)
            except errors.RecoveryError as exc:
                self.say(f"job {job.id!r} revision {job.revision!r} (line {job.lineno}): "
                         f"--retry-failed: no successor created ({exc.code}: {exc})")
                continue
            created += 1
            self.say(f"job {job.id!r} revision {job.revision!r} (line {job.lineno}): "
                     f"--retry-failed: {successor.operation_id} succeeds {op_id} with a new "
                     f"budget of {status.maximum_attempts} attempt(s)")
        self.summary.retried = created
        self.say(f"--retry-failed: {created} manual retr{'y' if created == 1 else 'ies'} "
                 "created (each a new attempt budget linked to the spent one); running them")

    async def run(self) -> None:
        todo = []
        for job in self.jobs:
            if job.key not in self.log.committed:
                todo.append(job)
                continue
            conflict = self.committed_conflict(job)
            if conflict is not None:
                self._failed(job, "revision_conflict", conflict)
            else:
                self.summary.already_committed += 1
        send, receive = trio.open_memory_channel[Job](0)

        async def worker() -> None:
            async for job in receive:
                try:
                    await self.run_job(job)
                except Exception as exc:  # never end the batch for one job
                    self._failed(job, f"internal_error:{type(exc).__name__}",
                                 "an unexpected error (a defect: please report it)")

        async with trio.open_nursery() as nursery:
            for _ in range(min(self.config.concurrency, len(todo))):
                nursery.start_soon(worker)
            async with send:
                for job in todo:
                    await send.send(job)


# -- progress ---------------------------------------------------------------------------------


def estimated_cost(ledger: TokenLedger, prices: PriceTable | None) -> float | None:
    """USD for the tokens counted so far; None while any counted model has no price."""
    if prices is None:
        return None
    cost = 0.0
    for model, tokens in ledger.by_model.items():
        price = prices.for_model(model)
        if price is None:
            if tokens.total.total_tokens == 0:
                continue  # nothing to price (as in the summary's estimate)
            return None
        cost += price.cost(tokens.total)
    return cost


def fit_width(text: str, columns: int | None) -> str:
    """``text`` cut to ``columns - 1`` characters (an ellipsis marks the cut)."""
    if columns is None or columns < 8 or len(text) < columns:
        return text
    return text[: columns - 2] + "…"


class ProgressDisplay:
    """A live status line on a terminal (~5 redraws/s), a plain log line otherwise (1/s):
    per-state counts (done, running, waiting, failed, unfinished), attempts, tokens, the
    estimated cost when every model has a price, jobs/s and the ETA.

    Hand-written rather than ``rich``: every write goes through ``Terminal``, which turns
    a closed, full or broken stdout into one stderr message while the batch goes on, and
    a non-terminal gets plain ``[elapsed] key value`` lines (parseable, no escapes)."""

    def __init__(self, host: BatchHost, out: Terminal, *, live: bool, started: float) -> None:
        self.host = host
        self.out = out
        self.live = live
        self.started = started
        self._last = ""

    def line(self) -> str:
        s = self.host.summary
        done = s.committed + s.already_committed
        failed = s.failed_total
        elapsed = time.monotonic() - self.started
        rate = s.committed / elapsed if elapsed > 0 else 0.0
        remaining = s.jobs - done - failed - s.unfinished
        eta = f"{remaining / rate:.0f}s" if rate > 0 and remaining > 0 else "-"
        scheduler = self.host.rt.scheduler
        waiting = scheduler.waiting
        s.attempts = self.host.rt.attempts_consumed
        running = max(0, self.host.running - waiting)
        until = ""
        wake: float | None = getattr(scheduler, "next_wake_at", None)
        if waiting and wake is not None and wake - time.time() > 5:
            until = f" (waiting until {time.strftime('%H:%M:%S', time.localtime(wake))})"
        tokens = s.tokens.total
        cost = estimated_cost(s.tokens, s.prices)
        text = (
            f"done {done}/{s.jobs}  running {running}  waiting {waiting}{until}  "
            f"failed {failed}  unfinished {s.unfinished}  attempts {s.attempts}  "
            f"tokens {tokens.total_tokens} (in {tokens.input_tokens}, out "
            f"{tokens.output_tokens})  cost {'-' if cost is None else f'${cost:.4f}'}  "
            f"{rate:.1f} jobs/s  eta {eta}"
        )
        down = self.host.rt.endpoint_failure()
        if down is not None:
            text += f"  endpoint unavailable ({down})"
        return text

    def draw(self, final: bool = False) -> None:
        if self.out.broken is not None:
            return  # stdout is gone: the batch goes on without drawing
        text = self.line()
        if self.live:
            # One terminal row: a wrapped line could not be redrawn in place by "\r".
            text = fit_width(text, self.out.columns())
            self.out.write("\r\x1b[K" + text + ("\n" if final else ""))
        elif text != self._last or final:
            self.out.write(f"[{time.monotonic() - self.started:7.1f}s] {text}\n")
        self._last = text

    async def run(self) -> None:
        interval = 0.2 if self.live else 1.0
        while True:
            await trio.sleep(interval)
            self.draw()


# -- the whole batch --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _backend(
    config: BatchConfig, account: AccountBinding
) -> AsyncIterator[ResponsesBackend]:
    from recoverable.transport.base import StreamLimits

    limits = StreamLimits(idle_timeout=config.idle_timeout)
    if config.endpoint == "fixture":
        async with FixtureProvider.serve(faults=config.faults) as provider:
            backend = ResponsesBackend(
                provider.http_url,
                credentials=StaticCredentials(FIXTURE_KEY, account=account),
                mode=config.mode,
                limits=limits,
                endpoint_id="fixture",  # the port changes per run; the identity must not
            )
            async with backend:
                yield backend
        return
    key = os.environ.get(config.api_key_env, "")
    backend = ResponsesBackend(
        config.endpoint,
        credentials=StaticCredentials(key, account=account),
        mode=config.mode,
        limits=limits,
    )
    async with backend:
        yield backend


def batch_account(config: BatchConfig) -> AccountBinding:
    if config.account is not None:
        return AccountBinding(config.account, "api-key")
    return FIXTURE_ACCOUNT if config.endpoint == "fixture" else AccountBinding("default")


class Terminal:
    """The batch's stdout, which may break under it: closed (``>&-``), full
    (``>/dev/full``: ENOSPC) or a pipe whose reader left (``| head -1``: EPIPE).
    Then drawing stops, one message goes to stderr, and the batch goes on; the
    summary is written to stderr instead."""

    def __init__(self, out: IO[str] | None, err: IO[str] | None) -> None:
        self.out = out
        self.err = err
        self.broken: str | None = None if out is not None else "stdout is closed"
        if out is None:
            self.error("recoverable batch: stdout is closed: no progress is shown; the summary "
                       "goes to stderr")

    def isatty(self) -> bool:
        try:
            return self.out is not None and self.out.isatty()
        except (OSError, ValueError):
            return False

    def columns(self) -> int | None:
        """The terminal's width, if stdout is a terminal whose size can be read."""
        try:
            return os.get_terminal_size(self.out.fileno()).columns if self.out else None
        except (OSError, ValueError, AttributeError):
            return None

    def write(self, text: str) -> bool:
        """Write and flush; False (and stdout given up) when it cannot be written."""
        if self.broken is not None or self.out is None:
            return False
        try:
            self.out.write(text)
            self.out.flush()
            return True
        except (OSError, ValueError) as exc:
            reason = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc))
            self.broken = reason
            self._detach()
            self.error(f"recoverable batch: stdout failed ({reason}): no more progress is "
                       "shown; the batch goes on and its summary goes to stderr")
            return False

    def _detach(self) -> None:
        # Point the broken descriptor at /dev/null so that what is still buffered does
        # not fail again at interpreter exit (which would change the exit code).
        try:
            assert self.out is not None
            fd = self.out.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, fd)
            finally:
                os.close(devnull)
        except (OSError, ValueError, AssertionError, AttributeError):
            pass

    def error(self, message: str) -> None:
        """To stderr; a broken stderr is ignored (nothing else is left to tell)."""
        if self.err is None:
            return
        try:
            self.err.write(message + "\n")
            self.err.flush()
        except (OSError, ValueError):
            pass


class _Output:
    """Where messages go: stderr, clearing the live progress line first."""

    def __init__(self, out: Terminal, *, live: bool) -> None:
        self.out = out
        self.live = live

    def say(self, message: str) -> None:
        if self.live and self.out.broken is None:
            self.out.write("\r\x1b[K")
        self.out.error(message)


async def _run(
    config: BatchConfig,
    jobs: list[Job],
    log: ResultLog,
    store: RecoveryStore,
    summary: BatchSummary,
    output: _Output,
    errors_log: ErrorLog | None = None,
) -> None:
    started = time.monotonic()
    work = trio.CancelScope()
    try:
        async with trio.open_nursery() as top:
            # Installed for the whole run: Ctrl-C is a message here, never an exception
            # raised in the middle of a state change.
            top.start_soon(_watch_interrupts, work, summary, output.say)
            try:
                await _run_host(config, jobs, log, store, summary, output, work, started,
                                errors_log)
            finally:
                top.cancel_scope.cancel()
    finally:
        summary.elapsed = time.monotonic() - started


async def _run_host(
    config: BatchConfig,
    jobs: list[Job],
    log: ResultLog,
    store: RecoveryStore,
    summary: BatchSummary,
    output: _Output,
    work: trio.CancelScope,
    started: float,
    errors_log: ErrorLog | None = None,
) -> None:
    account = batch_account(config)
    async with (
        _backend(config, account) as backend,
        open_runtime(
            store,
            backend,
            account=account,
            max_concurrency=config.concurrency,
            requests_per_second=config.rps,
            requests_per_minute=config.rpm,
            tokens_per_minute=config.tpm,
            rate_burst_seconds=config.rate_burst_seconds,
        ) as rt,
    ):
        host = BatchHost(rt, store, log, jobs, config, summary, say=output.say, work=work,
                         errors_log=errors_log)
        _report_endpoint(rt, backend.endpoint_id, output.say)
        display = ProgressDisplay(host, output.out, live=output.live, started=started)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(display.run)
            with work:
                await host.acknowledge_committed()
                if config.retry_failed:
                    await host.retry_failed()
                await host.run()
            nursery.cancel_scope.cancel()
        summary.endpoint_unavailable = rt.endpoint_failure()
        summary.attempts = rt.attempts_consumed
        host.report_suppressed()
        if summary.interrupted or summary.fatal is not None:
            summary.unfinished = (
                summary.jobs
                - summary.already_committed
                - summary.committed
                - summary.failed_total
            )
        display.draw(final=True)


def _report_endpoint(rt: Runtime, endpoint_id: str, say: Callable[[str], None]) -> None:
    """One message when the endpoint becomes unreachable, one when it is back."""
    gate = rt.endpoint_gate(endpoint_id)
    shown: list[str | None] = [None]

    def changed(g: EndpointGate) -> None:
        if g.failure is not None and shown[0] is None:
            say(f"endpoint unavailable ({g.failure}): jobs wait and spend nothing; retrying "
                "with backoff (Ctrl-C suspends them; a rerun resumes)")
        elif g.failure is None and shown[0] is not None:
            say("endpoint reachable again")
        shown[0] = g.failure

    gate.listeners.append(changed)


async def _watch_interrupts(
    scope: trio.CancelScope, summary: BatchSummary, say: Callable[[str], None]
) -> None:
    """First Ctrl-C (or SIGTERM): cancel the work, which suspends every running operation.
    Second: exit at once (still safe: the store and the output file are crash-consistent)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            if summary.interrupted:
                say("interrupted again: exiting now (a rerun resumes)")
                os._exit(EXIT_INTERRUPTED)
            summary.interrupted = True
            say("interrupted: suspending running operations (Ctrl-C again to exit at once)")
            scope.cancel()


def check_output_path(jobs_path: str, out_path: str) -> str | None:
    """Why ``out_path`` cannot be the batch's commit log, if it cannot (checked before
    anything is sent): not a regular file (``/dev/null``, a directory, a FIFO), or the
    jobs file itself (same inode, also through another name or a link)."""
    try:
        out_stat = os.stat(out_path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot use {out_path}: {exc.strerror}"
    if not stat.S_ISREG(out_stat.st_mode):
        return (f"--out {out_path} is not a regular file: the results must be kept in a "
                "file (a rerun reads them back)")
    try:
        jobs_stat = os.stat(jobs_path)
    except OSError:
        return None
    if (jobs_stat.st_dev, jobs_stat.st_ino) == (out_stat.st_dev, out_stat.st_ino):
        return f"--out {out_path} is the jobs file itself: use another --out file"
    return None


def run_batch(config: BatchConfig, *, out: IO[str] | None, err: IO[str] | None) -> int:
    """Run a whole batch; return the exit code (0 ok, 1 failures, 2 usage, 130 interrupted).

    ``out`` may be ``None`` (a closed stdout) or break during the run: the batch goes on.
    """
    terminal = Terminal(out, err)
    say = terminal.error
    if config.endpoint == "fixture":  # honest default: say so first (and in the summary)
        terminal.write(FIXTURE_NOTICE + "\n")
    try:
        jobs_file = read_jobs(config.jobs_path, revision=config.revision)
    except OSError as exc:
        say(f"recoverable batch: cannot read {config.jobs_path}: {exc.strerror}")
        return EXIT_USAGE
    summary = BatchSummary(
        jobs=len(jobs_file.jobs),
        skipped_lines=len(jobs_file.bad_lines),
        duplicates=len(jobs_file.duplicates),
        retry_provider_codes=tuple(sorted(config.retry_provider_codes)),
        prices=config.prices or builtin_prices(),
    )
    for bad in jobs_file.bad_lines:
        say(f"{config.jobs_path}:{bad.lineno}: skipped: {bad.reason}")
    for lineno, first in jobs_file.duplicates:
        say(f"{config.jobs_path}:{lineno}: duplicate of line {first} (same id and revision); "
            "run once")
    for lineno, first in jobs_file.conflicts:
        summary.failed["revision_conflict"] += 1
        say(f"{config.jobs_path}:{lineno}: revision_conflict: same id and revision as line "
            f"{first} but different content; not run (change the revision for new content)")
    if config.revision is not None and jobs_file.format == "recoverable":
        say("recoverable batch: --revision applies to OpenAI Batch API lines only; the job "
            "lines of this file carry their own revision")
        return EXIT_USAGE
    problem = check_output_path(config.jobs_path, config.out_path)
    if problem is not None:
        say(f"recoverable batch: {problem}")
        return EXIT_USAGE
    if config.endpoint != "fixture" and not os.environ.get(config.api_key_env):
        say(
            f"recoverable batch: the environment variable {config.api_key_env} "
            "(--api-key-env) is not set"
        )
        return EXIT_USAGE
    if config.endpoint != "fixture":
        try:
            validate_api_key(
                os.environ[config.api_key_env], what=f"the key in {config.api_key_env}"
            )
        except errors.InvalidCredentials as exc:
            # Before any store or output is touched: a key that cannot be sent is a usage error.
            say(f"recoverable batch: {exc}")
            return EXIT_USAGE
    for name, path in (("--errors", config.errors_path),):
        if path is not None and os.path.abspath(path) in (
            os.path.abspath(config.out_path), os.path.abspath(config.jobs_path)
        ):
            say(f"recoverable batch: {name} {path} is the jobs or the output file: use another")
            return EXIT_USAGE
    try:
        log = ResultLog.open(config.out_path, config.output_format)
    except ResultLogError as exc:
        say(f"recoverable batch: {exc}")
        return EXIT_USAGE
    except OSError as exc:
        say(f"recoverable batch: cannot use {config.out_path}: {exc}")
        return EXIT_USAGE
    summary.truncated_bytes = log.truncated_bytes
    summary.newline_added = log.newline_added
    summary.maximum_retry_after = config.maximum_retry_after
    errors_log: ErrorLog | None = None
    try:
        if config.errors_path is not None:
            try:
                errors_log = ErrorLog(config.errors_path, config.output_format, say)
            except OSError as exc:
                say(f"recoverable batch: cannot write --errors {config.errors_path}: "
                    f"{exc.strerror or exc}")
                return EXIT_USAGE
            summary.errors_path = config.errors_path
            for bad in jobs_file.bad_lines:
                errors_log.write(job_id=bad.job_id, revision=None, lineno=bad.lineno,
                                 code="invalid_job_line", reason="invalid_job_line",
                                 message=bad.reason,
                                 hint="fix the line (or remove it), then rerun")
            for lineno, first in jobs_file.conflicts:
                errors_log.write(job_id=None, revision=None, lineno=lineno,
                                 code="revision_conflict", reason="revision_conflict",
                                 message=f"same id and revision as line {first} but different "
                                 "content; not run",
                                 hint="change the revision for new content")
        try:
            store = RecoveryStore.open(config.store_path)
        except errors.RecoveryError as exc:
            say(f"recoverable batch: cannot open the store: {exc}")
            return EXIT_USAGE
        output = _Output(terminal, live=terminal.isatty())
        try:
            trio.run(
                functools.partial(
                    _run, config, jobs_file.jobs, log, store, summary, output, errors_log
                ),
                restrict_keyboard_interrupt_to_checkpoints=True,
            )
        except BaseException as exc:
            if not _only(exc, KeyboardInterrupt):
                raise
            summary.interrupted = True  # Ctrl-C before the signal watcher was installed
        finally:
            store.close()
    finally:
        log.close()
        if errors_log is not None:
            errors_log.close()
            summary.errors_written = errors_log.written
    if not terminal.write(summary.table() + "\n"):
        terminal.error(summary.table())
    if config.endpoint == "fixture":
        terminal.write(FIXTURE_NOTICE + "\n")
    return summary.exit_code


def _only(exc: BaseException, kind: type[BaseException]) -> bool:
    """``exc`` is ``kind``, or a (nested) exception group made only of ``kind``."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only(inner, kind) for inner in exc.exceptions)
    return isinstance(exc, kind)
