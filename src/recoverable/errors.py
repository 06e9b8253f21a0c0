"""Typed errors of ``recoverable``.

Every error has a stable ``code`` so hosts branch on types and codes, never on
message strings. Provider failures carry typed fields (``ProviderError``).

``str(error)`` is for people: what happened, to which operation (when the id is
known) and what to do, e.g. ``operation op_1: its attempt budget is spent (last
failure: the connection was lost (connection refused)); ...``. It is built only
from the library's own text and typed fields (bounded codes, statuses, ids), never
from prompts, outputs, credentials or account identifiers. Its wording may change
between versions: hosts never parse it.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AccountChanged",
    "AccountRequired",
    "AdmissionChanged",
    "AlreadyAcknowledged",
    "AttemptNotAuthorized",
    "AttemptsExhausted",
    "AuthenticationRequired",
    "AuthorizationFailed",
    "CompletionUnavailable",
    "ConfigurationUnavailable",
    "CorruptRecord",
    "CostBudgetExhausted",
    "EndpointUnavailable",
    "FenceMismatch",
    "FormatMismatch",
    "InvalidCredentials",
    "InvalidParameter",
    "InvalidRequest",
    "JobConflict",
    "LeaseLost",
    "OperationBusy",
    "OperationCancelled",
    "OperationSuperseded",
    "OperationSuspended",
    "PermanentlyFailed",
    "PriceUnknown",
    "ProviderError",
    "RecoveryError",
    "RequestUnavailable",
    "RetryAlreadyCreated",
    "RetryConfigurationMismatch",
    "RetryNotAllowed",
    "RuntimeClosed",
    "StateExpired",
    "StateUnavailable",
    "StorageLimitExceeded",
    "StorageUnavailable",
    "StoreDamaged",
    "StoreLockReplaced",
    "ThreadTurnActive",
    "TokenBudgetExhausted",
    "TrioRequired",
    "UnsupportedInputItem",
    "UnsupportedOutputType",
    "UnsupportedRecordVersion",
]

from recoverable.error_base import (
    AccountRequired,
    InvalidCredentials,
    InvalidParameter,
    InvalidRequest,
    PriceUnknown,
    RecoveryError,
    RuntimeClosed,
    TrioRequired,
    UnsupportedInputItem,
    UnsupportedOutputType,
    with_detail,
)
from recoverable.failure_text import (
    REASONS,
    bounded,
    reason_todo,
    reason_what,
)
from recoverable.failure_text import describe_interruption as describe_interruption
from recoverable.outcome import Interruption


class OperationBusy(RecoveryError):
    """Another execution (in this or another process) holds the operation's lease."""

    code = "operation_busy"
    _summary = "another execution (in this or another process) holds its lease"
    _action = (
        "wait for that execution to finish, or suspend it (runtime.suspend or `recoverable "
        "suspend`) and call send_recovering again"
    )


class ThreadTurnActive(RecoveryError):
    """A thread never has two turns in flight: its latest turn is not
    committed (or abandoned) yet."""

    code = "thread_turn_active"
    _summary = "the thread's previous turn is not committed yet"
    _action = (
        "send and commit that turn (thread.commit after your own commit), or abandon it, "
        "then start the next one"
    )


class _EndedWithFailure(RecoveryError):
    """An operation that can no longer generate; ``last_failure`` keeps the typed cause."""

    def __init__(
        self,
        message: str = "",
        *,
        operation_id: str | None = None,
        last_failure: Interruption | None = None,
    ) -> None:
        super().__init__(message, operation_id=operation_id)
        self.last_failure = last_failure

    def _last(self) -> str:
        if self.last_failure is None:
            return ""
        return f" (last failure: {describe_interruption(self.last_failure)})"


class AttemptsExhausted(_EndedWithFailure):
    """The saved total attempt budget is spent; only a deliberate manual retry can continue
    — unless ``continuation_pending``: the store's opt-in continuation will
    create one successor after its delay (``docs/continuation.md``)."""

    code = "attempts_exhausted"

    def __init__(
        self,
        message: str = "",
        *,
        operation_id: str | None = None,
        last_failure: Interruption | None = None,
        continuation_pending: bool = False,
    ) -> None:
        super().__init__(message, operation_id=operation_id, last_failure=last_failure)
        self.continuation_pending = continuation_pending

    def _what(self) -> str:
        return f"its whole attempt budget is spent{self._last()}"

    def _todo(self) -> str:
        if self.continuation_pending:
            return (
                "a continuation is pending: a worker creates one successor (the same frozen "
                "request) after the store's delay; runtime.wait(handle) follows it, and "
                "status shows it (continuation_pending); cancel or suspend stops it"
            )
        return (
            "nothing more is sent automatically; if the user decides to try again, create a "
            "manual retry: runtime.retry(handle, retry_action_id=..., maximum_attempts=...)"
        )


class AttemptNotAuthorized(RecoveryError):
    """The host's authorization callback denied the attempt. Nothing was spent."""

    code = "attempt_not_authorized"

    def __init__(
        self, message: str = "", *, operation_id: str | None = None, attempt_id: str | None = None
    ) -> None:
        super().__init__(message, operation_id=operation_id)
        self.attempt_id = attempt_id

    def _what(self) -> str:
        which = f"attempt {self.attempt_id}" if self.attempt_id else "the attempt"
        return with_detail(f"your authorize callback denied {which}; nothing was spent",
                            self._detail)

    def _todo(self) -> str:
        return "call send_recovering again when the attempt may be sent, or abandon the operation"


class AlreadyAcknowledged(RecoveryError):
    """The job (account, scope, job id, input revision) was done before: its operation's
    result was committed by the host and acknowledged (``.operation_id`` is that
    operation). ``prepare`` and ``submit`` raise it instead of generating the job again,
    for as long as the acknowledgement's marker is kept (until ``cleanup_disposed``
    removes it). A new revision of the job is a new job."""

    code = "already_acknowledged"
    _summary = ("this job and revision were done before: their result was committed and "
                "acknowledged; nothing is prepared or generated again")
    _action = ("read the result from your own commit of it; to run the job again, give it "
               "a new input revision")


class AuthorizationFailed(RecoveryError):
    """The host's authorization callback did not answer: it raised, or returned something
    other than ``True`` or ``False``. Only ``True`` authorizes. Nothing was spent.

    ``send_recovering``'s own callback that raises still raises its own exception
    unchanged; this error is raised there for an answer that is not a bool, and the
    operation keeps its pending attempt (call again). A worker's standing policy
    (``run_worker(authorize=)``, ``recoverable worker --authorizer``) has nobody to tell,
    so a failure of it is saved as the operation's terminal failure
    (``failure_reason="authorization_failed"``), which ``wait`` and ``status`` report.
    """

    code = "authorization_failed"

    def __init__(
        self, message: str = "", *, operation_id: str | None = None, attempt_id: str | None = None
    ) -> None:
        super().__init__(message, operation_id=operation_id)
        self.attempt_id = attempt_id

    def _what(self) -> str:
        which = f"attempt {self.attempt_id}" if self.attempt_id else "an attempt"
        return with_detail(
            f"the authorization callback did not answer True or False for {which}; nothing "
            "was spent", self._detail,
        )

    def _todo(self) -> str:
        return ("fix the callback; a worker's failed operation needs a manual retry: "
                "runtime.retry(handle, retry_action_id=..., maximum_attempts=...)")


class PermanentlyFailed(_EndedWithFailure):
    """The operation ended in a failure that no automatic replacement may repair."""

    code = "permanently_failed"

    @property
    def reason(self) -> str:
        """The saved ``failure_reason`` (``rejected``, ``interrupted``, ...)."""
        return self._detail

    def _what(self) -> str:
        reason = self._detail
        if reason in REASONS:
            return reason_what(reason, self.last_failure)
        cause = f"it failed permanently ({bounded(reason)})" if reason else "it failed permanently"
        return f"{cause}{self._last()}"

    def _todo(self) -> str:
        return reason_todo(self._detail)


class OperationCancelled(RecoveryError):
    """The operation was permanently cancelled; no delivery and no generation."""

    code = "operation_cancelled"
    _summary = "it was cancelled permanently: nothing is generated or delivered"
    _action = (
        "prepare a new operation if the work is still wanted; abandon this one to drop its "
        "record"
    )


class OperationSuspended(RecoveryError):
    """The operation was suspended (by ``suspend`` from any runtime); reopen to continue."""

    code = "operation_suspended"
    _summary = "it was suspended; its budget, cooldown and any saved receipt are kept"
    _action = "call send_recovering with the same handle to resume it"


class OperationSuperseded(RecoveryError):
    """Its source changed or was deleted, or a newer revision of its job arrived:
    no result of it may count. ``reason``: source_changed | source_deleted | newer_revision."""

    code = "operation_superseded"
    _summary = "it was superseded: its source changed, so no result of it may count"
    _action = "prepare a new operation bound to the current source digest (docs/sources.md)"

    def __init__(self, message: str = "", *, operation_id: str | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message or (reason or ""), operation_id=operation_id)
        self.reason = reason


class FormatMismatch(RecoveryError):
    """The requested response format or contract version differs from the saved one."""

    code = "format_mismatch"
    _summary = "the requested response format or contract version differs from the saved one"
    _action = (
        "pass the response type and contract version used at prepare, or prepare a new "
        "operation for the new format"
    )


class StateExpired(RecoveryError):
    """``expires_at`` has passed: no new attempt may be authorized."""

    code = "state_expired"
    _summary = "its expires_at has passed, so no new attempt may be authorized"
    _action = (
        "if the work is still wanted, create a manual retry with a new expires_at "
        "(runtime.retry); otherwise abandon it"
    )


class StateUnavailable(RecoveryError):
    """The operation record is missing, acknowledged, abandoned or otherwise not available."""

    code = "state_unavailable"
    _summary = "the operation is not available"
    _action = (
        "it may be missing, acknowledged or abandoned: check the operation id and the store "
        "path; runtime.inventory() or `recoverable inventory` lists what the store holds"
    )


class UnsupportedRecordVersion(RecoveryError):
    """A stored record has a version this library does not interpret (it is left untouched)."""

    code = "unsupported_record_version"
    _summary = "a stored record has a version this library does not read (it was left untouched)"
    _action = "open the store with the recoverable version that wrote it, or upgrade recoverable"


class CorruptRecord(RecoveryError):
    """A stored record failed strict decoding (it is left untouched)."""

    code = "corrupt_record"
    _summary = "a stored record failed strict decoding (it was left untouched)"
    _action = "restore the store from a backup, or abandon the operation; nothing is regenerated"


class StorageLimitExceeded(RecoveryError):
    """A write would pass ``max_record_bytes`` or ``max_bytes``; nothing was changed."""

    code = "storage_limit_exceeded"
    _summary = "a write would pass max_record_bytes or max_bytes; nothing was changed"
    _action = (
        "free space (acknowledge receipts, purge old operations) or open the store with "
        "larger limits, then try again"
    )


class StorageUnavailable(RecoveryError):
    """The store cannot be read or written (closed, I/O error, permissions)."""

    code = "storage_unavailable"
    _summary = "the store cannot be read or written"
    _action = (
        "check that the store is open and its disk and permissions, then try again; nothing "
        "is regenerated meanwhile"
    )


class RequestUnavailable(StorageUnavailable):
    """The operation's frozen request body is missing or unreadable (damaged storage).

    Found before the host is asked and before an attempt is spent; nothing was
    changed. The request cannot be sent again nor cloned by a manual retry:
    restore the store, or abandon the operation and decide on a new request.
    """

    code = "request_unavailable"
    _summary = "the frozen request body is missing or unreadable; nothing was sent or spent"
    _action = "restore the store, or abandon the operation and prepare a new request"


class StoreDamaged(StorageUnavailable):
    """The store's files are damaged (truncated, emptied, corrupted pages): nothing is written.

    Found at open (the data file checked against its own metadata) or by any read or
    write that meets a corrupted page. Restore the store from a copy or move it aside.
    """

    code = "store_damaged"


class StoreLockReplaced(StorageUnavailable):
    """The store's ``lock.mdb`` was removed or replaced while a process had it open.

    Two processes could then write at the same time and destroy the store, so every
    process that notices it refuses to read or write (until all processes that used
    the old lock file have closed the store).
    """

    code = "store_lock_replaced"


class FenceMismatch(RecoveryError):
    """A conditional write found the record's generation fence moved (a newer owner exists)."""

    code = "fence_mismatch"
    _summary = "a newer owner changed the operation's record; this execution stopped"
    _action = "call send_recovering again to reopen it (only one execution may own it)"


class JobConflict(RecoveryError):
    """A job was submitted again under the same (account, scope, job id, input revision)
    with a different request body (``runtime.submit``)."""

    code = "job_conflict"
    _summary = (
        "this job and input revision were already submitted with another request body"
    )
    _action = (
        "wait for the submitted operation, or create new content under a new "
        "input_revision (the submitted operation is unchanged)"
    )


class AdmissionChanged(RecoveryError):
    """A write tried to change an admission field of a saved operation (or its frozen body).

    The admission fields (account, endpoint, model, reasoning effort, body, budget, retry
    policy, expiry, format, contract version, scope, job id, input revision, interruption
    policy) are fixed when the operation is prepared; the store refuses any write that
    changes them, whoever makes it. ``field`` names the first field found changed
    (``"body"`` for the frozen body payload). Nothing was written.
    """

    code = "admission_changed"
    _summary = "a write tried to change what the operation was admitted with; nothing was written"
    _action = (
        "prepare a new operation (or use runtime.retry) to run with other settings; "
        "a saved operation's request, budget and policy never change"
    )

    def __init__(
        self, message: str = "", *, operation_id: str | None = None, field: str | None = None
    ) -> None:
        super().__init__(message, operation_id=operation_id)
        self.field = field


class LeaseLost(RecoveryError):
    """This execution's lease expired or was taken over (a newer owner has a higher fence).

    Raised to the caller of an execution whose lease could not be renewed in time (its
    process was stopped, or the store was unavailable past the lease's safety margin) or
    whose token/fence moved. This owner never retries it: whatever it still had in
    flight is refused by the store (fenced writes), and the new owner, if any, carries
    the operation on.
    """

    code = "lease_lost"
    _summary = "its lease expired or a newer owner took the operation over; this execution stopped"
    _action = (
        "read its status (the new owner may be running or have finished it); call "
        "send_recovering again to reopen it if nobody runs it"
    )


class CompletionUnavailable(RecoveryError):
    """A validated completion could not be saved, or no saved completion exists to read."""

    code = "completion_unavailable"
    _summary = "no validated completion could be saved or read"
    _action = "nothing is regenerated: restore the store (or its space), or abandon the operation"

    def __init__(
        self, message: str = "", *, operation_id: str | None = None, unsaved: bool = False
    ) -> None:
        super().__init__(message, operation_id=operation_id)
        # True: a completion was received and validated but could not be saved. It is
        # lost (never returned), its attempt stays spent, and only an authorized
        # replacement within the remaining budget can generate it again.
        self.unsaved = unsaved

    def _todo(self) -> str:
        if self.unsaved:
            return (
                "this result is lost and its attempt stays spent; fix the store (or its "
                "space), then call send_recovering with the same handle: an authorized "
                "replacement within the remaining budget generates it again"
            )
        return self._action


class AccountChanged(RecoveryError):
    """The runtime's account binding differs from the operation's (or is signed out)."""

    code = "account_changed"
    _summary = "the runtime's account is not the operation's"
    _action = (
        "sign the operation's own account in and call send_recovering with the same handle, "
        "or abandon the operation"
    )


class AuthenticationRequired(RecoveryError):
    """A 401 could not be recovered by renewing the same account's credentials."""

    code = "authentication_required"
    _summary = (
        "the provider rejected the credentials (HTTP 401), even after renewing them for the "
        "same account"
    )
    _action = "sign in to the same account again, then call send_recovering with the same handle"


class ConfigurationUnavailable(RecoveryError):
    """The operation's saved configuration cannot be used here (e.g. a different endpoint)."""

    code = "configuration_unavailable"
    _summary = "the operation's saved configuration cannot be used here"
    _action = (
        "open a runtime with a backend for the operation's endpoint, or create a manual retry"
        " (runtime.retry) if the operation is blocked"
    )


class EndpointUnavailable(RecoveryError):
    """No connection to the endpoint could be established for ``unreachable_after``
    seconds (``open_runtime(unreachable_after=)``): nothing was sent and nothing spent.
    ``kind`` is the typed connect failure (``connect_refused``, ``dns_failure``,
    ``tls_failure``, ``connect_timeout``, ``handshake_failed``, ``connect_failed``). The
    operation keeps its budget and its pending attempt id. ``run_worker`` raises it too
    (without an operation id) when its endpoint stayed unreachable."""

    code = "endpoint_unavailable"
    _action = (
        "check the endpoint (its URL, port, host name, certificate, network), then call "
        "send_recovering with the same handle (or run the worker again): it sends the same "
        "attempt"
    )

    def __init__(
        self, message: str = "", *, operation_id: str | None = None,
        kind: str | None = None, unreachable_after: float | None = None,
    ) -> None:
        super().__init__(message, operation_id=operation_id)
        self.kind = kind
        self.unreachable_after = unreachable_after

    def _what(self) -> str:
        kind = f" ({bounded(self.kind)})" if self.kind else ""
        seconds = self.unreachable_after
        after = f" for {seconds:g} s" if seconds is not None else ""
        return with_detail(
            f"the endpoint could not be connected to{kind}{after}; nothing was sent or spent",
            self._detail,
        )


class RetryNotAllowed(RecoveryError):
    """The source operation's condition does not allow a manual retry."""

    code = "retry_not_allowed"
    _summary = "a manual retry is not allowed for this operation"
    _action = "see 'When a retry is allowed' in docs/manual-retry.md"


class RetryAlreadyCreated(RecoveryError):
    """A different retry action already created a successor for this source."""

    code = "retry_already_created"
    _summary = "a different retry action already created this operation's successor"
    _action = (
        "continue with the existing successor (status().successor_id); further retries go "
        "through it"
    )


class RetryConfigurationMismatch(RecoveryError):
    """The same retry action was repeated with different settings."""

    code = "retry_configuration_mismatch"
    _summary = "this retry action was already used with different settings"
    _action = "repeat it with its original settings, or decide on a new retry from the successor"


class ProviderError(RecoveryError):
    """A provider/transport failure, with typed fields (never parse the message)."""

    code = "provider_error"

    def __init__(
        self, message: str = "", *, operation_id: str | None = None, interruption: Interruption
    ) -> None:
        super().__init__(message or interruption.kind, operation_id=operation_id)
        self.interruption = interruption

    @property
    def kind(self) -> str:
        return self.interruption.kind

    @property
    def http_status(self) -> int | None:
        return self.interruption.http_status

    @property
    def provider_code(self) -> str | None:
        return self.interruption.provider_code

    @property
    def retry_after(self) -> float | None:
        return self.interruption.retry_after

    def _what(self) -> str:
        text = describe_interruption(self.interruption)
        reason = self._detail if self._detail != self.interruption.kind else ""
        if reason in REASONS:
            return reason_what(reason, self.interruption)
        return f"the attempt failed: {text}"

    def _todo(self) -> str:
        reason = self._detail if self._detail != self.interruption.kind else ""
        return reason_todo(reason) if reason else (
            "see the failure table in docs/failures.md for this kind"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # pragma: no cover - pickling support
        return (_rebuild_provider_error, (str(self), self.operation_id, self.interruption))


def _rebuild_provider_error(
    message: str, operation_id: str | None, interruption: Interruption
) -> ProviderError:  # pragma: no cover
    return ProviderError(message, operation_id=operation_id, interruption=interruption)


class TokenBudgetExhausted(AttemptsExhausted):
    """The operation's ``maximum_output_tokens_total`` is spent: the output tokens reported
    across its attempts reached it, so no replacement is authorized. A subclass of
    ``AttemptsExhausted`` (the same remedy: only a deliberate manual retry continues);
    status availability ``exhausted``, failure reason ``token_budget_exhausted``."""

    code = "token_budget_exhausted"

    def _what(self) -> str:
        return f"its output-token budget (maximum_output_tokens_total) is spent{self._last()}"


class CostBudgetExhausted(AttemptsExhausted):
    """The operation's ``maximum_cost_total`` is spent: the usage reported across its
    attempts, at the price it was admitted with, reached it, so no replacement is
    authorized. Like ``TokenBudgetExhausted``: a subclass of ``AttemptsExhausted``, status
    availability ``exhausted``, failure reason ``cost_budget_exhausted``."""

    code = "cost_budget_exhausted"

    def _what(self) -> str:
        return f"its cost budget (maximum_cost_total) is spent{self._last()}"
