"""Job lines: this tool's own JSONL job lines and OpenAI Batch API request lines.

A jobs file holds one job per line, in one of two formats told apart by ``custom_id``:
this tool's ``{"id", "revision", "model", "input", "schema", ...}`` or an OpenAI Batch API
line ``{"custom_id", "method": "POST", "url": "/v1/responses", "body": {...}}``. Each valid
line becomes a :class:`Job` (the request, its response contract and the hash of its frozen
body); a bad line is a :class:`JobLineError`, reported while the other jobs run.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from typing import IO, Any, Final, NamedTuple, TypeVar

import attrs
import msgspec

from recoverable import errors, machine
from recoverable.body import body_hash, freeze_body, parameters_from_wire
from recoverable.cli.formatting import safe_text, unsafe_character
from recoverable.contract import contract_for
from recoverable.types import JsonSchema, RetryPolicy, StructuredRequest

__all__ = [
    "BATCH_REVISION_PREFIX",
    "BATCH_SCOPE",
    "MAX_LINE_BYTES",
    "Job",
    "JobLineError",
    "JobsFile",
    "LinePair",
    "batch_revision",
    "id_problem",
    "line_format",
    "parse_batch_api_line",
    "parse_job_line",
    "read_jobs",
]

BATCH_SCOPE: Final = "batch"
MAX_LINE_BYTES: Final = 2**20  # one job line (input + schema) at most 1 MiB
MAX_ID_CHARS: Final = 256
BATCH_URL: Final = "/v1/responses"
BATCH_REVISION_PREFIX: Final = "body-sha256:"
FORMAT_NAMES: Final = {
    "recoverable": "a recoverable job line", "openai-batch": "an OpenAI Batch API line"
}


class JobLineError(Exception):
    """A job line that cannot be run; the batch reports it and goes on."""

    def __init__(self, lineno: int, reason: str, *, job_id: str | None = None) -> None:
        reason = safe_text(reason)  # it may quote the line (a field name, a value)
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
        # The typed decode stops at the first field it cannot place, which may come
        # before what makes the line no JSON at all (``NaN``, ``1e999``): name that.
        raise JobLineError(lineno, _json_problem(line) or f"{invalid}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise JobLineError(lineno, _json_problem(line) or f"not a JSON object: {exc}") from None
    except RecursionError:
        raise JobLineError(lineno, "the JSON is nested too deeply") from None


_AT_BYTE: Final = re.compile(r"\(byte (\d+)\)")
_NOT_NUMBERS: Final = (b"NaN", b"-Infinity", b"Infinity", b"-NaN")


def _json_problem(line: str) -> str | None:
    """Why ``line`` is not valid JSON, naming a number that is not finite (``NaN``,
    ``Infinity``: not JSON) or out of range (``1e999``: not a finite number), as the API
    would refuse it; None when it is valid JSON (the problem is its shape)."""
    try:
        msgspec.json.decode(line)
    except msgspec.ValidationError as exc:  # "Number out of range"
        if "out of range" in str(exc):
            return ("not valid JSON for the API: a number is out of range (such as 1e999: "
                    "every number must be finite)")
        return f"not valid JSON: {exc}"
    except msgspec.DecodeError as exc:
        at = _AT_BYTE.search(str(exc))
        if at is not None:
            data = line.encode("utf-8", "surrogatepass")
            start = int(at.group(1))
            if start > 0 and data[start - 1:start] == b"-":
                start -= 1
            word = next((bad for bad in _NOT_NUMBERS if data.startswith(bad, start)), None)
            if word is not None:
                return (f"not valid JSON for the API: {word.decode()} (byte {start}) is not a "
                        "JSON number (every number must be finite)")
        return f"not a JSON object: {exc}"
    except RecursionError:
        return "the JSON is nested too deeply"
    return None


def id_problem(value: str) -> str | None:
    """Why ``value`` cannot be a job id or revision (None: it can): 1..256 characters
    without control characters, DEL or bidirectional formatting characters (the one rule
    for ids: a job line's ``id``/``revision``, a Batch line's ``custom_id``,
    ``--revision``; see ``formatting.UNSAFE_CHARACTERS``)."""
    rule = (f"must be 1..{MAX_ID_CHARS} characters without control characters, DEL or "
            "bidirectional formatting characters (U+202A..U+202E, U+2066..U+2069, ...)")
    if not value or len(value) > MAX_ID_CHARS:
        return f"{rule}; it has {len(value)} characters"
    found = unsafe_character(value)
    return None if found is None else f"{rule}; it has {found}"


def _check_id(lineno: int, name: str, value: str) -> None:
    problem = id_problem(value)
    if problem is not None:
        raise JobLineError(lineno, f"{name} {problem}")


def _frozen_hash(
    lineno: int,
    request: StructuredRequest,
    response: JsonSchema,
    *,
    job_id: str,
    revision: str,
    maximum_attempts: int,
    prefix: str = "",
    refused: tuple[type[Exception], ...] = (errors.InvalidRequest,),
) -> str:
    """The hash of the job's frozen body, once the preparation it will get is known to be
    valid; every ``refused`` error a :class:`JobLineError` (its message after ``prefix``)."""
    try:
        machine.validate_preparation(
            maximum_attempts=maximum_attempts,
            retry_policy=RetryPolicy(),
            scope=BATCH_SCOPE,
            job_id=job_id,
            input_revision=revision,
            contract_version=None,
        )
        return body_hash(freeze_body(request, contract_for(response)))
    except refused as exc:
        raise JobLineError(lineno, f"{prefix}{exc}") from None
    except RecursionError:
        raise JobLineError(lineno, "the job is nested too deeply") from None


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
    except errors.InvalidRequest as exc:
        raise JobLineError(lineno, str(exc)) from None
    except RecursionError:
        raise JobLineError(lineno, "the job is nested too deeply") from None
    frozen_hash = _frozen_hash(
        lineno, request, response, job_id=raw.id, revision=raw.revision,
        maximum_attempts=raw.max_attempts or 1,
    )
    return Job(
        id=raw.id,
        revision=raw.revision,
        lineno=lineno,
        request=request,
        response=response,
        max_attempts=raw.max_attempts,
        body_hash=frozen_hash,
    )


# -- OpenAI Batch API lines ----------------------------------------------------------------


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


def _text_format(body: dict[str, Any], lineno: int) -> _TextFormat:
    """The body's strict ``json_schema`` output format; ``body.text`` keeps the rest."""
    text = body.get("text")
    if not isinstance(text, dict) or "format" not in text:
        raise JobLineError(
            lineno, "body.text.format is missing: a job needs a json_schema output format"
        )
    try:
        text_format = msgspec.convert(text["format"], type=_TextFormat)
    except msgspec.ValidationError as exc:
        raise JobLineError(lineno, f"body.text.format: {exc}") from None
    if text_format.type != "json_schema":
        raise JobLineError(
            lineno,
            f"body.text.format.type {text_format.type[:32]!r}: only json_schema is supported",
        )
    if text_format.strict is not True:
        raise JobLineError(
            lineno, "body.text.format.strict must be true (results are validated against the "
            "schema in strict mode)"
        )
    rest = {key: value for key, value in text.items() if key != "format"}
    if rest:
        body["text"] = rest
    else:
        del body["text"]
    return text_format


# TypeError: a required field (model) is missing from the body
_BODY_REFUSED: Final = (errors.InvalidRequest, TypeError)


def _batch_api_job(raw: _BatchApiLine, lineno: int, revision: str | None) -> Job:
    if raw.method != "POST":
        raise JobLineError(lineno, f"method {raw.method[:16]!r}: only POST is supported")
    if raw.url != BATCH_URL:
        raise JobLineError(
            lineno, f"url {raw.url[:80]!r}: only {BATCH_URL} (the Responses API) is supported"
        )
    body = dict(raw.body)
    if "input" not in body:  # StructuredRequest's default ("") would send an empty prompt
        raise JobLineError(
            lineno, "body.input is missing: a job needs input (a string or a list of input "
            "items)"
        )
    text_format = _text_format(body, lineno)
    job_revision = revision if revision is not None else batch_revision(raw.body)
    response = JsonSchema(text_format.name, text_format.schema)
    try:
        request = StructuredRequest.from_params(body)
    except _BODY_REFUSED as exc:
        raise JobLineError(lineno, f"body: {exc}") from None
    except RecursionError:
        raise JobLineError(lineno, "the job is nested too deeply") from None
    frozen_hash = _frozen_hash(
        lineno, request, response, job_id=raw.custom_id, revision=job_revision,
        maximum_attempts=1, prefix="body: ", refused=_BODY_REFUSED,
    )
    return Job(
        id=raw.custom_id,
        revision=job_revision,
        lineno=lineno,
        request=request,
        response=response,
        max_attempts=None,
        body_hash=frozen_hash,
        source="openai-batch",
    )


# -- a jobs file --------------------------------------------------------------------------------


class LinePair(NamedTuple):
    """A line of the jobs file and the earlier line it repeats (same id and revision)."""

    line: int
    first: int


@attrs.frozen
class JobsFile:
    jobs: list[Job]
    bad_lines: list[JobLineError]
    duplicates: list[LinePair]  # same id, revision and content as an earlier line
    # same id and revision as an earlier line, different content
    conflicts: list[LinePair] = attrs.field(factory=list)
    # An earlier line of an id that a later line names with another revision:
    # ``line`` is the superseded earlier line, ``first`` the newer line; not run
    superseded: list[LinePair] = attrs.field(factory=list)
    # "recoverable" or "openai-batch": the format of the file's first valid job (None: none)
    format: str | None = None


class _FileFormat(NamedTuple):
    """The format of a jobs file and the line (its first valid job) that decided it."""

    name: str
    lineno: int


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


class _JobsReader:
    """Reads a jobs file line by line into a :class:`JobsFile` (see ``read_jobs``)."""

    def __init__(self, revision: str | None) -> None:
        self.revision = revision
        self.jobs: list[Job] = []
        self.bad: list[JobLineError] = []
        self.duplicates: list[LinePair] = []
        self.conflicts: list[LinePair] = []
        self.superseded: list[LinePair] = []
        self.latest: dict[str, Job] = {}  # the job each id runs (its latest revision)
        self.first: dict[tuple[str, str], Job] = {}
        self.by_custom_id: dict[str, Job] = {}
        self.file_format: _FileFormat | None = None

    def result(self) -> JobsFile:
        return JobsFile(
            [job for job in self.jobs if self.latest.get(job.id) is job],
            self.bad, self.duplicates, self.conflicts, self.superseded,
            format=None if self.file_format is None else self.file_format.name,
        )

    def add(self, lineno: int, data: bytes | None) -> None:
        line = self._text(lineno, data)
        if line is None:
            return
        kind = line_format(line)
        decided = self.file_format
        if decided is not None and kind != decided.name and _is_object(line):
            self.bad.append(JobLineError(
                lineno, f"{FORMAT_NAMES[kind]}, but the file's first valid job (line "
                f"{decided.lineno}) is {FORMAT_NAMES[decided.name]}: a file may not mix "
                "the two formats"))
            return
        try:
            job = parse_job_line(line, lineno, revision=self.revision)
        except JobLineError as exc:
            self.bad.append(exc)
            return
        except Exception as exc:  # one line never ends the batch, even by a defect
            self.bad.append(JobLineError(
                lineno, f"internal_error:{type(exc).__name__} while reading the job"))
            return
        if decided is None:  # the first valid job decides (not a garbled line)
            self.file_format = _FileFormat(kind, lineno)
        self._keep(job, lineno)

    def _text(self, lineno: int, data: bytes | None) -> str | None:
        """The line as text, or None (a blank line, or a bad one: recorded)."""
        if data is None:
            self.bad.append(JobLineError(lineno, f"the line is longer than {MAX_LINE_BYTES} bytes"))
            return None
        if lineno == 1 and data.startswith(b"\xef\xbb\xbf"):
            self.bad.append(JobLineError(
                lineno, "the line starts with a byte order mark (BOM, EF BB BF): "
                "save the file as UTF-8 without BOM"))
            return None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            self.bad.append(JobLineError(lineno, "the line is not valid UTF-8"))
            return None
        if not text.strip():
            return None
        return text.rstrip("\r\n")

    def _keep(self, job: Job, lineno: int) -> None:
        """A valid job: run it, unless an earlier line already names it."""
        if job.source == "openai-batch":
            same_id = self.by_custom_id.get(job.id)
            # A Batch file's custom_id names one request: another body under the same
            # custom_id is a bad line (with --revision it is the revision conflict below).
            if (
                same_id is not None
                and same_id.body_hash != job.body_hash
                and same_id.revision != job.revision
            ):
                self.bad.append(JobLineError(
                    lineno, f"custom_id {job.id[:64]!r} is used by line {same_id.lineno} "
                    "with another body: custom_id must be unique in a Batch file"))
                return
            self.by_custom_id.setdefault(job.id, job)
        earlier = self.first.get(job.key)
        if earlier is None:
            self.first[job.key] = job
            self.jobs.append(job)
            older = self.latest.get(job.id)
            if older is not None:  # a newer revision of the same id supersedes the older
                self.superseded.append(LinePair(older.lineno, lineno))
            self.latest[job.id] = job
        elif earlier.body_hash == job.body_hash:
            self.duplicates.append(LinePair(lineno, earlier.lineno))
        else:
            self.conflicts.append(LinePair(lineno, earlier.lineno))


def read_jobs(path: str, *, revision: str | None = None) -> JobsFile:
    """Read a JSONL jobs file; bad lines and duplicates are collected, not raised.

    The first valid job line decides the file's format (this tool's job lines, or OpenAI
    Batch API lines: those with ``custom_id``); a line of the other format is a bad
    line (a file may not mix them). ``revision``: see ``parse_job_line``.
    Raises ``OSError`` when the file itself cannot be read.
    """
    reader = _JobsReader(revision)
    with open(path, "rb") as fh:
        for lineno, data in _bounded_lines(fh, MAX_LINE_BYTES + 2):
            reader.add(lineno, data)
    return reader.result()
