"""The typed error each way an operation ends in ``failed`` stands for.

Two moments raise one: the execution that fails the record (:func:`ended_error`: the
provider's answer raises ``ProviderError`` with that attempt's failure the first time),
and every later look at the failed record (:func:`terminal_error`: reopening it, ``wait``,
a status read that needs the error). Both are decided by ``failure_reason`` alone, here,
so the same record always raises the same error.
"""

from __future__ import annotations

from recoverable import errors
from recoverable.failure_policy import CLASSIFIED_REASONS
from recoverable.records import OperationRecord

__all__ = ["ended_error", "failure_label", "terminal_error"]


def terminal_error(rec: OperationRecord) -> errors.RecoveryError:
    """The typed error a failed record stands for (what reopening it raises)."""
    operation_id = rec.operation_id
    match rec.failure_reason:
        case "exhausted":
            decided = rec.continuation
            return errors.AttemptsExhausted(
                operation_id=operation_id, last_failure=rec.last_failure,
                continuation_pending=decided is not None and decided.state == "pending",
            )
        case "authentication_required":
            return errors.AuthenticationRequired(operation_id=operation_id)
        case "expired":
            return errors.StateExpired(operation_id=operation_id)
        case "token_budget_exhausted":
            return errors.TokenBudgetExhausted(
                f"{rec.usage.output_tokens} output tokens reported, "
                f"maximum_output_tokens_total {rec.maximum_output_tokens_total}",
                operation_id=operation_id,
                last_failure=rec.last_failure,
            )
        case "cost_budget_exhausted":
            return errors.CostBudgetExhausted(
                f"${rec.cost or 0.0:.6f} of reported usage at the admitted price, "
                f"maximum_cost_total ${rec.maximum_cost_total}",
                operation_id=operation_id,
                last_failure=rec.last_failure,
            )
        case "authorization_failed":
            return errors.AuthorizationFailed(operation_id=operation_id)
        case reason:
            return errors.PermanentlyFailed(
                str(reason), operation_id=operation_id, last_failure=rec.last_failure
            )


def ended_error(rec: OperationRecord) -> errors.RecoveryError:
    """What the execution that failed ``rec`` raised: a ``ProviderError`` when the provider's
    answer decided it (``CLASSIFIED_REASONS``), else what reopening raises (a host told
    later, through ``wait``, reports it as ``send_recovering``'s caller would have)."""
    if rec.failure_reason in CLASSIFIED_REASONS and rec.last_failure is not None:
        return errors.ProviderError(rec.failure_reason, operation_id=rec.operation_id,
                                    interruption=rec.last_failure)
    return terminal_error(rec)


def failure_label(error: errors.RecoveryError) -> str:
    """A job's failure as a short, non-private label: the error code, the failure's kind
    and, for invalid output, the provider code (``provider_error:http_rejected``,
    ``attempts_exhausted:disconnected``, ``provider_error:invalid_output:schema_violation``).

    Stable across runs of the same job: a failure the provider's answer decided
    (``CLASSIFIED_REASONS``) raises ``ProviderError`` on the run that saw it and
    ``PermanentlyFailed`` on every later read of the saved record (:func:`terminal_error`);
    both are labelled ``provider_error:<kind>``, as :func:`ended_error` reports it.
    """
    last = getattr(error, "last_failure", None) or getattr(error, "interruption", None)
    code = error.code
    if (isinstance(error, errors.PermanentlyFailed) and last is not None
            and error.reason in CLASSIFIED_REASONS):
        code = errors.ProviderError.code
    if last is None:
        return code
    detail = last.provider_code if last.kind == "invalid_output" else None
    return f"{code}:{last.kind}" + (f":{detail}" if detail else "")
