"""What a batch reports: the summary table and exit code, and the ``--errors`` file."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from typing import IO, Any

import attrs
import msgspec

from recoverable.cli.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from recoverable.cli.formatting import safe_text
from recoverable.cli.openai_batch import HttpFailure, error_line_fields
from recoverable.failure_errors import failure_label
from recoverable.pricing import PriceTable, TokenLedger

__all__ = ["TEMPORARY_SUFFIX", "BatchSummary", "ErrorLog", "JobError", "failure_reason"]

TEMPORARY_SUFFIX = ".recoverable-tmp"  # an errors file being written (renamed at the end)


failure_reason = failure_label  # the summary's and the errors file's reason label


@attrs.define
class BatchSummary:
    jobs: int = 0
    already_committed: int = 0
    committed: int = 0
    failed: Counter[str] = attrs.field(factory=Counter)
    unfinished: int = 0
    skipped_lines: int = 0
    duplicates: int = 0
    # Older revisions superseded by a newer revision of the same job id: job
    # lines of this file not run, and operations of earlier runs; neither done nor failed
    superseded: int = 0
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
        rows += [(f"  {reason}", str(count)) for reason, count in sorted(self.failed.items())]
        rows += [
            ("unfinished", str(self.unfinished)),
            ("skipped lines", str(self.skipped_lines)),
            ("duplicate lines", str(self.duplicates)),
            ("superseded (newer revision)", str(self.superseded)),
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
        width = max(len(name) for name, _ in rows)
        # A value may quote a job's text (a model name): never raw on a terminal.
        return "\n".join(f"{name.ljust(width)}  {safe_text(value)}" for name, value in rows)


@attrs.frozen
class JobError:
    """One line of the ``--errors`` file: a failed job, or a job line that was skipped."""

    job_id: str | None
    revision: str | None
    lineno: int
    code: str
    reason: str
    message: str
    operation_id: str | None = None
    hint: str | None = None
    # The provider's HTTP rejection that ended the job, if one did (the openai-batch
    # shape writes it as the line's response).
    http_failure: HttpFailure | None = None


class ErrorLog:
    """The ``--errors`` file: one JSON line per failed job (and per skipped job line) of
    this run; replaced by every run. The lines are written to a new file beside the path
    as they happen, and that file is renamed over the path when the run ends
    (:meth:`close`): a file already at the path is never truncated or written through,
    and a link there is replaced, not followed (``cli/output_files.py`` checked that
    whatever is there is an errors file). A write failure is told once and never stops
    the batch; a run refused before it started leaves the path as it was
    (:meth:`discard`)."""

    def __init__(self, path: str, output_format: str, say: Callable[[str], None]) -> None:
        self.path = path
        self.output_format = output_format
        self.say = say
        self.written = 0
        directory, name = os.path.split(os.path.abspath(path))
        _remove_orphans(directory, name)
        fd, temporary = tempfile.mkstemp(
            prefix=f".{name}.{os.getpid()}.", suffix=TEMPORARY_SUFFIX, dir=directory
        )
        self._temporary: str | None = temporary
        mask = os.umask(0)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)  # as open() would have made it
        self._fh: IO[bytes] | None = os.fdopen(fd, "wb")  # closed by close()

    def write(self, error: JobError) -> None:
        if self._fh is None:
            return
        try:
            self._fh.write(msgspec.json.encode(self._record(error)) + b"\n")
            self._fh.flush()
            self.written += 1
        except (OSError, ValueError) as exc:
            self.say(f"warning: cannot write the errors file {self.path} ({exc}); the failures "
                     "are still counted in the summary")
            self._close_quietly()

    def _record(self, error: JobError) -> dict[str, Any]:
        message = error.message or error.reason
        match self.output_format:
            case "openai-batch":
                # The Batch API's failed request line: id, custom_id, then the provider's
                # HTTP rejection as the response, or no response and error {code,
                # message}. The code is the reason's typed error code, which a rerun that
                # reads the saved failure back reports alike (``failure_reason``).
                response, error_object = error_line_fields(
                    error.reason.split(":")[0], message, error.http_failure
                )
                return {
                    "id": None if error.operation_id is None else f"batch_req_{error.operation_id}",
                    "custom_id": error.job_id,
                    "response": response,
                    "error": error_object,
                    "recoverable": {
                        "revision": error.revision, "line": error.lineno, "reason": error.reason,
                        "operation_id": error.operation_id, "hint": error.hint,
                    },
                }
            case _:
                return {
                    "id": error.job_id, "revision": error.revision, "line": error.lineno,
                    "code": error.code, "reason": error.reason,
                    "operation_id": error.operation_id, "message": message, "hint": error.hint,
                }

    def close(self) -> None:
        """Put the lines written at the path (one rename, then the directory synced)."""
        if self._fh is not None:
            try:
                self._fh.flush()
                os.fsync(self._fh.fileno())
            except (OSError, ValueError) as exc:
                self.say(f"warning: cannot sync the errors file {self.path} ({exc})")
            self._close_quietly()
        temporary, self._temporary = self._temporary, None
        if temporary is None:
            return
        try:
            os.replace(temporary, self.path)
            directory = os.open(os.path.dirname(os.path.abspath(self.path)),
                                os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as exc:
            self.say(f"warning: cannot write the errors file {self.path} ({exc.strerror}); "
                     "the failures are still counted in the summary")
            with contextlib.suppress(OSError):
                os.unlink(temporary)

    def discard(self) -> None:
        """Leave the path as it was: the run did not start."""
        self._close_quietly()
        temporary, self._temporary = self._temporary, None
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)

    def _close_quietly(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            with contextlib.suppress(OSError, ValueError):
                fh.close()


def _remove_orphans(directory: str, name: str) -> None:
    """Remove the errors files being written by runs that were killed (their process is
    gone): ``.NAME.PID.XXXXXXXX.recoverable-tmp``, ours by name."""
    prefix = f".{name}."
    with contextlib.suppress(OSError):
        for entry in os.listdir(directory):
            if not (entry.startswith(prefix) and entry.endswith(TEMPORARY_SUFFIX)):
                continue
            pid = entry[len(prefix):].split(".", 1)[0]
            if not (pid.isascii() and pid.isdigit()) or _alive(int(pid)):
                continue
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, entry))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists (another user's): leave its file alone
    return True
