"""A store for the tests of the operation page's account (what happened, times, lineage)
and of the overview's fleet health, written through the store's own API:

- a lineage of three: ``op-root`` (failed: attempts exhausted, HTTP 500) retried into
  ``op-mid`` (failed: invalid output) retried into ``op-last`` (completed: its attempt
  consumed at ``LATE + 1``, the operation completed at ``LATE + 6.5``);
and, by ``add_orphan_and_worker`` (once the dashboard runs: a runtime opened on the store
sweeps what dead owners left), ``op-orphan``: an attempt in flight under a lease whose
owner is gone (orphaned), and a registered worker whose served mark was renewed at
``BEAT``.
"""

from __future__ import annotations

from typing import Any

import msgspec

import recoverable
from recoverable.records import AttemptRecord, LeaseRecord, RetryReservation
from recoverable.storage.queue import SERVED_GRACE, ServedRow, WorkerRow

from .console_store import LATE, Answer, _record, save
from .helpers import ACCOUNT

DEAD_OWNER = "0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d"  # no process holds it
BEAT = LATE + 30.0  # the worker's last heartbeat
SERVER_ERROR = recoverable.Interruption(kind="http_rejected", http_status=500,
                                        provider_code="server_error")
INVALID = recoverable.Interruption(kind="invalid_output", output_path="/label")


def _reserved(successor: str) -> RetryReservation:
    return RetryReservation(retry_action_id="retry-1", successor_id=successor,
                            settings_hash="0" * 16, created=True)


def fill_explained(spec: str) -> dict[str, Any]:
    """Write the operations above into the store at ``spec``; return their records."""
    members = [
        _record("op-root", ACCOUNT, "gpt-a", LATE - 120, "job-1", phase="failed",
                failure_reason="exhausted", attempts_used=1, last_failure=SERVER_ERROR,
                retry_reservation=_reserved("op-mid"),
                attempts=(AttemptRecord("op-root.1", 1, "initial", LATE - 110, "failed",
                                        failure=SERVER_ERROR),)),
        _record("op-mid", ACCOUNT, "gpt-a", LATE - 60, "job-1", phase="failed",
                failure_reason="invalid_output", attempts_used=1, last_failure=INVALID,
                root_operation_id="op-root", previous_operation_id="op-root",
                retry_reservation=_reserved("op-last"),
                attempts=(AttemptRecord("op-mid.1", 1, "initial", LATE - 50, "failed",
                                        failure=INVALID),)),
        _record("op-last", ACCOUNT, "gpt-a", LATE, "job-1", phase="completed",
                attempts_used=1, completed_at=LATE + 6.5,
                root_operation_id="op-root", previous_operation_id="op-mid",
                completion=msgspec.json.encode(Answer(label="ok")),
                attempts=(AttemptRecord("op-last.1", 1, "initial", LATE + 1, "completed",
                                        response_id="resp_last"),)),
    ]
    save(spec, members)
    return {member[0].operation_id: member[0] for member in members}


def add_orphan_and_worker(spec: str) -> None:
    """``op-orphan`` under a dead owner's lease, and a worker row with its served mark."""
    members = [
        _record("op-orphan", ACCOUNT, "gpt-a", LATE, "job-2", phase="transmitting",
                attempts_used=1, maximum_attempts=3, fence=1,
                attempts=(AttemptRecord("op-orphan.1", 1, "initial", LATE + 2),)),
    ]
    save(spec, members, _orphan_rows)


def _orphan_rows(txn: Any) -> None:
    """``op-orphan``'s lease under a dead owner, and a worker row with its served mark."""
    txn.put_lease(LeaseRecord(operation_id="op-orphan", owner_id=DEAD_OWNER,
                              token="1" * 32, fence=1, acquired_at=LATE + 2,
                              expires_at=LATE + 32))
    txn.register_worker("w" * 16, WorkerRow(
        account_id=ACCOUNT.account_id, source=ACCOUNT.source, endpoint_id="fixture",
        concurrency=4, started_at=LATE))
    txn.mark_served(ServedRow(account_id=ACCOUNT.account_id, source=ACCOUNT.source,
                              endpoint_id="fixture", until=BEAT + SERVED_GRACE))
