"""The output file: the batch host's commit log.

One fsynced JSON line per committed job, in one of two shapes (``OUTPUT_FORMATS``): this
tool's result line or the OpenAI Batch API's output line. An operation is acknowledged only
after its line is durable, so the file says which jobs are done. Opening it reads back what
is committed; only a torn last line this tool wrote is cut off, and a file that is not a
result log of the chosen shape is refused, never truncated.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Any, Final

import attrs
import msgspec
import trio

from recoverable.cli.jobs import Job
from recoverable.cli.openai_batch import success_response
from recoverable.records import OperationRecord
from recoverable.types import Receipt

__all__ = [
    "OUTPUT_FORMATS",
    "BatchOutputLine",
    "ResultLine",
    "ResultLog",
    "ResultLogError",
    "encode_batch_output_line",
    "encode_result_line",
]

OUTPUT_FORMATS: Final = ("recoverable", "openai-batch")


class ResultLogError(Exception):
    """The output file cannot be used as this batch's commit log."""


class ResultLine(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A line of ``--output-format recoverable`` (written in this field order)."""

    id: str
    revision: str
    operation_id: str
    # sha256 of the job's frozen request body (lines written before it existed lack it)
    input_sha256: str | None = None
    result: msgspec.Raw


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


def encode_result_line(job: Job, operation_id: str, result: Any) -> bytes:
    """The ``recoverable`` output line of a committed job (raises on a result that
    cannot be JSON)."""
    return msgspec.json.encode(ResultLine(
        id=job.id,
        revision=job.revision,
        operation_id=operation_id,
        input_sha256=job.body_hash,
        result=msgspec.Raw(msgspec.json.encode(result)),
    ))


def encode_batch_output_line(
    job: Job, operation_id: str, receipt: Receipt, record: OperationRecord | None
) -> bytes:
    """The Batch API output line of a committed job: its ``response`` is status 200 with
    a complete Responses object as body (``openai_batch.success_response``)."""
    response = success_response(job, operation_id, receipt, record)
    return msgspec.json.encode(BatchOutputLine(
        id=f"batch_req_{operation_id}",
        custom_id=job.id,
        recoverable=_BatchMeta(job.revision, operation_id, job.body_hash),
        response=msgspec.Raw(msgspec.json.encode(response)),
    ))


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


# -- reading the log back ---------------------------------------------------------------------

_line_decoder = msgspec.json.Decoder(ResultLine)
_batch_line_decoder = msgspec.json.Decoder(BatchOutputLine)


@attrs.frozen
class _Entry:
    """What the commit log needs of one output line."""

    key: tuple[str, str]  # (job id, revision)
    operation_id: str
    input_sha256: str | None


def _decode_entry(line: bytes, output_format: str) -> _Entry:
    """The entry of one output line (raises msgspec errors)."""
    match output_format:
        case "openai-batch":
            batch_line = _batch_line_decoder.decode(line)
            meta = batch_line.recoverable
            return _Entry((batch_line.custom_id, meta.revision), meta.operation_id,
                          meta.input_sha256)
        case _:
            entry = _line_decoder.decode(line)
            return _Entry((entry.id, entry.revision), entry.operation_id, entry.input_sha256)


@attrs.define
class _ReadBack:
    committed: dict[tuple[str, str], str] = attrs.field(factory=dict)
    hashes: dict[tuple[str, str], str] = attrs.field(factory=dict)
    lines: dict[tuple[str, str], int] = attrs.field(factory=dict)
    good_end: int = 0  # end of the last whole, valid line
    size: int = 0
    unterminated: bool = False  # the last line is complete and valid but has no newline

    def add(self, entry: _Entry, lineno: int) -> None:
        if entry.key in self.committed:
            return
        self.committed[entry.key] = entry.operation_id
        self.lines[entry.key] = lineno
        if entry.input_sha256 is not None:
            self.hashes[entry.key] = entry.input_sha256


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
                back.add(entry, lineno)
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
            back.add(entry, lineno)
            back.good_end += len(line)
    return back


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
            char = data[pos : pos + 1]
            if char == b"\\":
                pos += 2
                continue
            if char == b'"':
                break
            if char < b" ":
                return False
            pos += 1
        else:
            return True  # cut inside the string
        pos += 1
    rest = data[pos:]
    return any(tag.startswith(rest[: len(tag)]) for tag in tails)
