"""``PrepareOptions``: what a host asks of a new operation, as one value.

``Runtime.prepare`` and ``submit`` take these as keyword arguments (their public form);
they carry them here as one frozen value, whose defaults are ``prepare``'s and whose
:meth:`PrepareOptions.checked` is the one place they are validated, in the order the
typed errors have always come in. ``actors/prepare.py`` turns checked options into a
new record.
"""

from __future__ import annotations

from typing import Any

import attrs

from recoverable import errors, machine
from recoverable.actors.checks import check_expires_at
from recoverable.actors.host import Backend, reattach_client
from recoverable.preconditions import check_unclaimed_after
from recoverable.pricing import PriceTable
from recoverable.records import OnInterruption
from recoverable.sources_rules import check_attempt_timeout, check_source
from recoverable.types import RetryPolicy, SourceRef

__all__ = [
    "POLICY_UNSET",
    "CheckedOptions",
    "PrepareOptions",
    "check_reattach",
    "interruption_policy",
]

# ``on_interruption`` not given at prepare: "replace", or "fail" for a live operation.
POLICY_UNSET: Any = object()


def interruption_policy(live: object, on_interruption: object) -> OnInterruption:
    """The interruption policy saved with a new operation (live or not).

    ``live=True`` fixes it to ``"fail"``: a person may have seen the partial output of
    an attempt, so an interruption is never silently replaced. Asking for ``"replace"``
    explicitly with ``live=True`` is an ``InvalidRequest``; without ``live`` the default
    is ``"replace"``.
    """
    if not isinstance(live, bool):
        raise errors.InvalidRequest("live must be True or False")
    if on_interruption is POLICY_UNSET:
        return "fail" if live else "replace"
    if live and on_interruption != "fail":
        raise errors.InvalidRequest(
            'live=True fixes on_interruption="fail": an interrupted attempt whose partial '
            "output may have been shown is never replaced (docs/live.md)"
        )
    return on_interruption  # type: ignore[return-value]  # checked by validate_preparation


def check_reattach(reattach: object, backend: Backend) -> None:
    """Reattachment: ``reattach`` is a bool, and ``True`` needs a backend that can resume a
    background response (``ResponsesBackend`` can, in both modes: over WebSocket its
    reattachable attempts use the HTTP SSE transport of the same base URL)."""
    if not isinstance(reattach, bool):
        raise errors.InvalidParameter("reattach must be True or False", parameter="reattach")
    if reattach and reattach_client(backend) is None:
        raise errors.InvalidParameter(
            "reattach=True needs a backend that can resume background responses "
            "(ResponsesBackend); this backend cannot",
            parameter="reattach", reason="refused",
        )


@attrs.frozen(kw_only=True)
class CheckedOptions:
    """What :meth:`PrepareOptions.checked` derives: the values a record is built from."""

    expires_at: float | None  # a timestamp
    unclaimed_after: float | None
    source: SourceRef | None
    attempt_timeout: float | None  # the hard timeout saved with the operation
    retry_policy: RetryPolicy
    on_interruption: OnInterruption
    backend: Backend  # the preparing runtime's (its endpoint is saved with the operation)


@attrs.frozen(kw_only=True)
class PrepareOptions:
    """The options of ``prepare`` (and ``submit``), with ``prepare``'s defaults; see
    ``Runtime.prepare`` for what each means. Nothing is checked on construction:
    :meth:`checked` does it once the runtime's own preconditions (signed in) hold, so the
    first typed error a caller sees is the one it always was."""

    maximum_attempts: int
    retry_policy: RetryPolicy | None = None
    expires_at: Any = None
    scope: str | None = None
    job_id: str | None = None
    input_revision: str | None = None
    contract_version: str | None = None
    previous_operation_id: str | None = None
    maximum_output_tokens_total: int | None = None
    on_interruption: OnInterruption = POLICY_UNSET
    source: SourceRef | None = None
    attempt_timeout: float | None = None
    live: bool = False
    reattach: bool = False
    maximum_cost_total: float | None = None
    prices: PriceTable | None = None
    # ``submit``'s bound on unclaimed work (seconds); None for ``prepare``.
    unclaimed_after: float | None = None

    def checked(self, *, lease_seconds: float, backend: Backend | None) -> CheckedOptions:
        """Validate every option (``InvalidRequest``/``InvalidParameter``, as documented
        at ``prepare``) and derive the saved values. ``lease_seconds`` is the preparing
        runtime's lease: a hard ``attempt_timeout`` must be shorter. A missing backend
        (``ConfigurationUnavailable``) is found after the options' own checks and before
        the ones that need it (``reattach``)."""
        expiry = check_expires_at(self.expires_at)
        unclaimed_after = self.unclaimed_after
        if unclaimed_after is not None:
            unclaimed_after = check_unclaimed_after(unclaimed_after)
        bound = check_source(self.source)
        hard_timeout = check_attempt_timeout(
            self.attempt_timeout, lease_seconds=lease_seconds, source=bound
        )
        policy = self.retry_policy or RetryPolicy()
        on_interruption = interruption_policy(self.live, self.on_interruption)
        machine.validate_preparation(
            maximum_attempts=self.maximum_attempts,
            retry_policy=policy,
            scope=self.scope,
            job_id=self.job_id,
            input_revision=self.input_revision,
            contract_version=self.contract_version,
            maximum_output_tokens_total=self.maximum_output_tokens_total,
            on_interruption=on_interruption,
            maximum_cost_total=self.maximum_cost_total,
        )
        machine.validate_metadata("previous_operation_id", self.previous_operation_id)
        if backend is None:
            raise errors.ConfigurationUnavailable("no backend: cannot prepare generation")
        check_reattach(self.reattach, backend)
        if self.live and self.reattach:
            # A live attempt that showed output is never continued, and a resumed
            # stream would hand views from the middle of an answer: not combined (yet).
            raise errors.InvalidParameter(
                "live=True cannot be combined with reattach=True (docs/live.md, "
                "docs/reattach.md)",
                parameter="reattach", reason="refused",
            )
        return CheckedOptions(
            expires_at=expiry,
            unclaimed_after=unclaimed_after,
            source=bound,
            attempt_timeout=hard_timeout,
            retry_policy=policy,
            on_interruption=on_interruption,
            backend=backend,
        )
