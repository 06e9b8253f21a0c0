"""How the store commands print: status, inventory and receipts, as text or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import msgspec

from recoverable.pricing import attempts_usage_text, usage_text
from recoverable.types import Inventory, Receipt, Status

__all__ = [
    "encode_json",
    "format_inventory",
    "format_receipt",
    "format_status",
    "printable_inventory",
    "receipt_json",
    "safe_text",
]


def encode_json(value: Any) -> str:
    """One JSON line (an inventory's ids made printable first)."""
    if isinstance(value, Inventory):
        value = printable_inventory(value)
    return msgspec.json.encode(value).decode() + "\n"


def safe_text(text: str) -> str:
    """``text`` with what cannot be encoded (lone surrogates) as backslash escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _printable_status(status: Status) -> Status:
    return msgspec.structs.replace(
        status,
        operation_id=safe_text(status.operation_id),
        job_id=None if status.job_id is None else safe_text(status.job_id),
        input_revision=(
            None if status.input_revision is None else safe_text(status.input_revision)
        ),
        scope=None if status.scope is None else safe_text(status.scope),
    )


def printable_inventory(inventory: Inventory) -> Inventory:
    """Ids read back from a damaged store may not be text (lone surrogates): escaped,
    so that printing or encoding them never crashes."""
    return Inventory(
        operations=tuple(_printable_status(status) for status in inventory.operations),
        unreadable=tuple(safe_text(op_id) for op_id in inventory.unreadable),
    )


def receipt_json(receipt: Receipt) -> str:
    """The Receipt as msgspec encodes it (payload base64), plus the decoded ``result``."""
    data = msgspec.to_builtins(receipt)
    try:
        data["result"] = msgspec.json.decode(receipt.payload)
    except msgspec.DecodeError:
        data["result"] = None
    return msgspec.json.encode(data).decode() + "\n"


def _rows(rows: Sequence[tuple[str, object]]) -> str:
    shown = [(name, value) for name, value in rows if value not in (None, "", (), frozenset())]
    width = max(len(name) for name, _ in shown)
    return "".join(f"{name.ljust(width)}  {value}\n" for name, value in shown)


def _failure(failure: Any) -> str:
    parts = [failure.kind]
    if failure.http_status is not None:
        parts.append(f"http {failure.http_status}")
    if failure.provider_code:
        parts.append(failure.provider_code)
    return " / ".join(parts)


def _continuation(status: Status) -> str | None:
    """Issue 18: the continuation decided for a failed operation, in one line."""
    decided = status.continuation
    if decided is None:
        return None
    text = f"{decided.state} ({decided.reason}), budget left {decided.budget_left}"
    if decided.due_at is not None:
        text += f", due at {decided.due_at.isoformat()}"
    if decided.successor_id is not None:
        text += f", successor {safe_text(decided.successor_id)}"
    return text


def _reattach(status: Status) -> str | None:
    """Issue 15: prepared with ``reattach=True``; its resume GETs; a result by reattachment."""
    if not status.reattach:
        return None
    text = f"yes: {status.reattachments} resume GET(s)"
    if status.reattached:
        text += ", the result came by reattachment"
    return text


def format_status(status: Status) -> str:
    failure = status.last_failure
    rows: list[tuple[str, object]] = [
        ("operation", status.operation_id),
        ("state", status.state),
        ("availability", status.availability),
        ("blockers", ", ".join(sorted(status.blockers))),
        (
            "attempts",
            f"{status.attempts_used} of {status.maximum_attempts} used, "
            f"{status.attempts_remaining} remaining",
        ),
        ("saved result", "yes" if status.has_saved_completion else "no"),
        ("job", status.job_id),
        ("revision", status.input_revision),
        ("scope", status.scope),
        ("source", (  # issue 16: the source it derives from, at its digest
            f"{status.source.key} @ {status.source.digest}" if status.source else None
        )),
        ("superseded", status.superseded_reason),  # why (issue 16)
        ("reattach", _reattach(status)),  # issue 15
        ("model", status.model),
        ("next attempt at", status.next_attempt_at.isoformat() if status.next_attempt_at else None),
        ("expires at", status.expires_at.isoformat() if status.expires_at else None),
        ("rate limited", (
            f"{status.rate_limited} until {status.rate_limited_until.isoformat()}"
            if status.rate_limited and status.rate_limited_until else status.rate_limited
        )),
        ("queue", status.queue),
        ("last failure", _failure(failure) if failure is not None else None),
        ("tokens", usage_text(status.usage)),
        ("tokens per attempt", attempts_usage_text(
            (attempt.number, attempt.usage) for attempt in status.attempts
        )),
        ("output token budget", status.maximum_output_tokens_total),
        ("response id", status.response_id),
        ("owner", status.lease_owner),  # the store opener holding its live lease
        ("lease expires at", (
            status.lease_expires_at.isoformat() if status.lease_expires_at else None
        )),
        ("fence", status.fence or None),  # claims so far (0: never run)
        ("continuation", _continuation(status)),
        ("suggested", ", ".join(status.suggested_actions)),
        ("redacted", "yes (another account)" if status.redacted else None),
    ]
    return _rows(rows)


def format_inventory(inventory: Inventory) -> str:
    header = ("OPERATION", "STATE", "AVAILABILITY", "ATTEMPTS", "JOB", "REVISION", "OWNER")
    rows = [
        (
            status.operation_id,
            status.state,
            status.availability,
            f"{status.attempts_used}/{status.maximum_attempts}",
            status.job_id or "-",
            status.input_revision or "-",
            (status.lease_owner or "-")[:12],  # the live lease's owner id, shortened
        )
        for status in inventory.operations
    ]
    table = [header, *rows]
    widths = [max(len(row[column]) for row in table) for column in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in table
    ]
    text = "\n".join(lines) + "\n"
    text += f"{len(rows)} operation(s)\n"
    for op_id in inventory.unreadable:
        text += f"unreadable record: {op_id}\n"
    return safe_text(text)


def format_receipt(receipt: Receipt) -> str:
    try:
        result = json.dumps(msgspec.json.decode(receipt.payload), indent=2, ensure_ascii=False)
    except msgspec.DecodeError:
        result = "<not JSON>"
    rows: list[tuple[str, object]] = [
        ("operation", receipt.operation_id),
        ("job", receipt.job_id),
        ("revision", receipt.input_revision),
        ("scope", receipt.scope),
        ("format", receipt.format_name),
        ("completed at", receipt.completed_at.isoformat()),
        ("response id", receipt.response_id),
        ("tokens", usage_text(receipt.usage)),
    ]
    return _rows(rows) + "result:\n" + result + "\n"
