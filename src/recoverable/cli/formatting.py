"""How the store commands print: status, inventory and receipts, as text or JSON."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec

from recoverable.pricing import attempts_usage_text, usage_text
from recoverable.types import Inventory, Receipt, Status

__all__ = [
    "UNSAFE_CHARACTERS",
    "encode_json",
    "format_inventory",
    "format_receipt",
    "format_status",
    "printable_inventory",
    "receipt_json",
    "safe_text",
    "unsafe_character",
]

# The characters never shown raw on a terminal and never accepted in an id (a job line's
# ``id``/``revision``/``custom_id``, ``--revision``): C0 control characters (escape
# sequences start with ESC), DEL, C1 control characters (U+0080..U+009F: CSI is one),
# the bidirectional formatting characters (marks U+061C, U+200E, U+200F; embeddings and
# overrides U+202A..U+202E; isolates U+2066..U+2069: they make text read in another order
# than it is stored), the line and paragraph separators U+2028/U+2029, and lone
# surrogates (not text: a damaged store's bytes read back with ``surrogateescape``).
_ABOVE_C0: Final = (
    "\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
)
UNSAFE_CHARACTERS: Final = re.compile(f"[\x00-\x1f{_ABOVE_C0}]")
# In ``json.dumps`` output, whose strings already escape C0 (its newlines are layout).
_UNSAFE_IN_JSON: Final = re.compile(f"[{_ABOVE_C0}]")


def encode_json(value: Any) -> str:
    """One JSON line (an inventory's ids made printable first)."""
    if isinstance(value, Inventory):
        value = printable_inventory(value)
    return msgspec.json.encode(value).decode() + "\n"


def unsafe_character(text: str) -> str | None:
    """The first character of ``text`` that :data:`UNSAFE_CHARACTERS` refuses, as
    ``U+XXXX`` (None: there is none)."""
    found = UNSAFE_CHARACTERS.search(text)
    return None if found is None else f"U+{ord(found.group()):04X}"


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def safe_text(text: object) -> str:
    """Untrusted text (read back from a store, or from a user's file) as it may be shown
    on a terminal: every :data:`UNSAFE_CHARACTERS` character as a backslash escape
    (``\\x1b``, ``\\u202e``, ``\\udcff``), so that no control character, terminal
    escape sequence or bidirectional override reaches the terminal. The one helper for
    showing stored or user-given text; JSON output (``--json``) is encoded instead."""
    return UNSAFE_CHARACTERS.sub(_escape, text if isinstance(text, str) else str(text))


def _encodable(text: str) -> str:
    """``text`` with what cannot be encoded (lone surrogates) as backslash escapes: for
    JSON output, which escapes control characters itself."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _printable_status(status: Status) -> Status:
    return msgspec.structs.replace(
        status,
        operation_id=_encodable(status.operation_id),
        job_id=None if status.job_id is None else _encodable(status.job_id),
        input_revision=(
            None if status.input_revision is None else _encodable(status.input_revision)
        ),
        scope=None if status.scope is None else _encodable(status.scope),
    )


def printable_inventory(inventory: Inventory) -> Inventory:
    """Ids read back from a damaged store may not be text (lone surrogates): escaped,
    so that encoding them as JSON never crashes."""
    return Inventory(
        operations=tuple(_printable_status(status) for status in inventory.operations),
        unreadable=tuple(_encodable(op_id) for op_id in inventory.unreadable),
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
    return "".join(f"{name.ljust(width)}  {safe_text(value)}\n" for name, value in shown)


def _failure(failure: Any) -> str:
    parts = [failure.kind]
    if failure.http_status is not None:
        parts.append(f"http {failure.http_status}")
    if failure.provider_code:
        parts.append(failure.provider_code)
    return " / ".join(parts)


def _continuation(status: Status) -> str | None:
    """The continuation decided for a failed operation, in one line."""
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
    """Reattachment: prepared with ``reattach=True``; its resume GETs; a result by reattachment."""
    if not status.reattach:
        return None
    text = f"yes: {status.reattachments} resume GET(s)"
    if status.reattached:
        text += ", the result came by reattachment"
    last = status.attempts[-1] if status.attempts else None
    if last is not None and last.not_resumable is not None:
        # Why an interruption of it is replaced, not resumed (a stable code).
        text += f"; its last attempt cannot be resumed ({safe_text(last.not_resumable)})"
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
        ("source", (  # source-bound: the source it derives from, at its digest
            f"{status.source.key} @ {status.source.digest}" if status.source else None
        )),
        ("superseded", status.superseded_reason),  # why it stopped counting
        ("reattach", _reattach(status)),  # background responses
        ("model", status.model),
        ("next attempt at", status.next_attempt_at.isoformat() if status.next_attempt_at else None),
        ("expires at", status.expires_at.isoformat() if status.expires_at else None),
        ("rate limited", (
            f"{status.rate_limited} until {status.rate_limited_until.isoformat()}"
            if status.rate_limited and status.rate_limited_until else status.rate_limited
        )),
        ("queue", _queue(status)),
        ("last failure", _failure(failure) if failure is not None else None),
        ("tokens", usage_text(status.usage)),
        ("tokens per attempt", attempts_usage_text(
            (attempt.number, attempt.usage) for attempt in status.attempts
        )),
        ("output token budget", status.maximum_output_tokens_total),
        ("cost budget", None if status.maximum_cost_total is None else (
            f"${status.cost or 0.0:.6f} of ${status.maximum_cost_total:g} spent "
            "(reported usage at the admitted price)"
        )),
        ("response id", status.response_id),
        ("owner", status.lease_owner),  # the store opener holding its live lease
        ("lease expires at", (
            status.lease_expires_at.isoformat() if status.lease_expires_at else None
        )),
        ("fence", status.fence or None),  # claims so far (0: never run)
        ("continuation", _continuation(status)),
        ("suggested", ", ".join(
            f"use_successor {status.successor_id}" if action == "use_successor"
            else action for action in status.suggested_actions
        )),
        ("redacted", "yes (another account)" if status.redacted else None),
    ]
    return _rows(rows)


def _queue(status: Status) -> str | None:
    """The queue state, and why (no worker of its account or endpoint, and when it ends
    no_worker; or which row is damaged)."""
    why: list[str] = [status.queue_reason] if status.queue_reason else []
    if status.no_worker_at is not None:
        why.append(f"no_worker at {status.no_worker_at.isoformat()}")
    text = " ".join(filter(None, [status.queue, f"({'; '.join(why)})" if why else None]))
    return text or None


def format_inventory(
    inventory: Inventory,
    *,
    total: int | None = None,
    next_after: str | None = None,
    unreadable_total: int | None = None,
    removed: Mapping[str, int] | None = None,
) -> str:
    """An inventory, or one page of it (``cli/paging.py``: ``total`` operations in all,
    ``next_after`` the cursor of the next page, ``unreadable_total`` unreadable records in
    all): a row per operation, the counts, and the unreadable records' ids. ``removed``:
    the disposition markers by kind (acknowledged, abandoned), told when nothing is kept."""
    header = ("OPERATION", "STATE", "AVAILABILITY", "ATTEMPTS", "JOB", "REVISION", "OWNER")
    rows = [
        tuple(safe_text(cell) for cell in (
            status.operation_id,
            status.state,
            status.availability,
            f"{status.attempts_used}/{status.maximum_attempts}",
            status.job_id or "-",
            status.input_revision or "-",
            (status.lease_owner or "-")[:12],  # the live lease's owner id, shortened
        ))
        for status in inventory.operations
    ]
    table = [header, *rows]
    widths = [max(len(row[column]) for row in table) for column in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in table
    ]
    text = "\n".join(lines) + "\n"
    if not rows and not total and removed and any(removed.values()):
        # Right after a batch the store keeps nothing: its results were acknowledged.
        gone = " and ".join(f"{count} {kind}" for kind, count in sorted(removed.items())
                            if count)
        text += (f"0 operation(s) kept; {gone} operation(s) were removed (an acknowledged "
                 "result was delivered, e.g. to a batch's --out; only a small marker is "
                 "left: recoverable status <operation id> reads it)\n")
    elif total is None or total == len(rows):
        text += f"{len(rows)} operation(s)\n"
    else:
        text += f"{len(rows)} of {total} operation(s) shown"
        text += (f"; next page: --after {safe_text(next_after)}\n"
                 if next_after is not None else "\n")
    for op_id in inventory.unreadable:
        text += f"unreadable record: {safe_text(op_id)}\n"
    hidden = (unreadable_total or 0) - len(inventory.unreadable)
    if hidden > 0:
        text += f"... and {hidden} more unreadable record(s) (--limit 0 shows all)\n"
    return text


def format_receipt(receipt: Receipt) -> str:
    try:
        result = json.dumps(msgspec.json.decode(receipt.payload), indent=2, ensure_ascii=False)
        # The model's text: inside JSON strings, so a JSON escape keeps it valid JSON.
        result = _UNSAFE_IN_JSON.sub(lambda found: f"\\u{ord(found.group()):04x}", result)
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
