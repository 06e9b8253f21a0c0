"""Typed errors of ``recoverable``.

Every error has a stable ``code`` so hosts branch on types and codes, never on
message strings. Provider failures carry typed fields (``ProviderError``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "AccountChanged",
    "AttemptNotAuthorized",
    "AttemptsExhausted",
    "AuthenticationRequired",
    "CompletionUnavailable",
    "ConfigurationUnavailable",
    "CorruptRecord",
    "FenceMismatch",
    "FormatMismatch",
    "InvalidCredentials",
    "InvalidRequest",
    "OperationBusy",
    "OperationCancelled",
    "OperationSuspended",
    "PermanentlyFailed",
    "ProviderError",
    "RecoveryError",
    "RequestUnavailable",
    "RetryAlreadyCreated",
    "RetryConfigurationMismatch",
    "RetryNotAllowed",
    "StateExpired",
    "StateUnavailable",
    "StorageLimitExceeded",
    "StorageUnavailable",
    "TokenBudgetExhausted",
    "UnsupportedInputItem",
    "UnsupportedRecordVersion",
]

if TYPE_CHECKING:
    from recoverable.transport.outcome import Interruption


class RecoveryError(Exception):
    """Base class of every error raised by ``recoverable``."""

    code: str = "recovery_error"

    def __init__(self, message: str = "", *, operation_id: str | None = None) -> None:
        super().__init__(message or self.code)
        self.operation_id = operation_id


class OperationBusy(RecoveryError):
    """Another execution (in this or another process) holds the operation's lease."""

    code = "operation_busy"


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


class AttemptsExhausted(_EndedWithFailure):
    """The saved total attempt budget is spent; only a deliberate manual retry can continue."""

    code = "attempts_exhausted"


class AttemptNotAuthorized(RecoveryError):
    """The host's authorization callback denied the attempt. Nothing was spent."""

    code = "attempt_not_authorized"

    def __init__(
        self, message: str = "", *, operation_id: str | None = None, attempt_id: str | None = None
    ) -> None:
        super().__init__(message, operation_id=operation_id)
        self.attempt_id = attempt_id


class PermanentlyFailed(_EndedWithFailure):
    """The operation ended in a failure that no automatic replacement may repair."""

    code = "permanently_failed"


class OperationCancelled(RecoveryError):
    """The operation was permanently cancelled; no delivery and no generation."""

    code = "operation_cancelled"


class OperationSuspended(RecoveryError):
    """The operation was suspended (by ``suspend`` from any runtime); reopen to continue."""

    code = "operation_suspended"


class FormatMismatch(RecoveryError):
    """The requested response format or contract version differs from the saved one."""

    code = "format_mismatch"


class StateExpired(RecoveryError):
    """``expires_at`` has passed: no new attempt may be authorized."""

    code = "state_expired"


class StateUnavailable(RecoveryError):
    """The operation record is missing, acknowledged, abandoned or otherwise not available."""

    code = "state_unavailable"


class UnsupportedRecordVersion(RecoveryError):
    """A stored record has a version this library does not interpret (it is left untouched)."""

    code = "unsupported_record_version"


class CorruptRecord(RecoveryError):
    """A stored record failed strict decoding (it is left untouched)."""

    code = "corrupt_record"


class StorageLimitExceeded(RecoveryError):
    """A write would pass ``max_record_bytes`` or ``max_bytes``; nothing was changed."""

    code = "storage_limit_exceeded"


class StorageUnavailable(RecoveryError):
    """The store cannot be read or written (closed, I/O error, permissions)."""

    code = "storage_unavailable"


class RequestUnavailable(StorageUnavailable):
    """The operation's frozen request body is missing or unreadable (damaged storage).

    Found before the host is asked and before an attempt is spent; nothing was
    changed. The request cannot be sent again nor cloned by a manual retry:
    restore the store, or abandon the operation and decide on a new request.
    """

    code = "request_unavailable"


class FenceMismatch(RecoveryError):
    """A conditional write found the record's generation fence moved (a newer owner exists)."""

    code = "fence_mismatch"


class CompletionUnavailable(RecoveryError):
    """A validated completion could not be saved, or no saved completion exists to read."""

    code = "completion_unavailable"


class AccountChanged(RecoveryError):
    """The runtime's account binding differs from the operation's (or is signed out)."""

    code = "account_changed"


class AuthenticationRequired(RecoveryError):
    """A 401 could not be recovered by renewing the same account's credentials."""

    code = "authentication_required"


class ConfigurationUnavailable(RecoveryError):
    """The operation's saved configuration cannot be used here (e.g. a different endpoint)."""

    code = "configuration_unavailable"


class RetryNotAllowed(RecoveryError):
    """The source operation's condition does not allow a manual retry."""

    code = "retry_not_allowed"


class RetryAlreadyCreated(RecoveryError):
    """A different retry action already created a successor for this source."""

    code = "retry_already_created"


class RetryConfigurationMismatch(RecoveryError):
    """The same retry action was repeated with different settings."""

    code = "retry_configuration_mismatch"


class InvalidRequest(RecoveryError, ValueError):
    """The request, schema or option given by the caller is invalid."""

    code = "invalid_request"


class UnsupportedInputItem(InvalidRequest):
    """An input item that continues a stored thread or replays tool history.

    ``item_index`` is its position in ``input`` and ``item_type`` its ``type``
    (``None`` when absent). Recovery sends tool-free, self-contained requests only.
    """

    code = "unsupported_input_item"

    def __init__(self, message: str, *, item_index: int, item_type: str | None) -> None:
        super().__init__(message)
        self.item_index = item_index
        self.item_type = item_type


class InvalidCredentials(InvalidRequest):
    """An API key or token that cannot be sent in an HTTP header (empty, non-ASCII,
    whitespace or control characters). Raised before any attempt is consumed."""

    code = "invalid_credentials"


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
