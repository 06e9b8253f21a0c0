"""Issue 15 in the CLI: ``recoverable status`` (the human format) says that an operation
was prepared with ``reattach=True``, how many resume GETs it used and whether its result
came by reattachment, as ``Status`` does (docs/reattach.md)."""

from __future__ import annotations

from recoverable.cli.formatting import format_status
from recoverable.types import AttemptSummary, Status


def test_the_status_shows_reattachment() -> None:
    shown = format_status(Status(operation_id="op_1", state="completed",
                                 availability="completion_saved", reattach=True,
                                 reattachments=2, reattached=True))
    assert "reattach      yes: 2 resume GET(s), the result came by reattachment" in shown
    waiting = format_status(Status(operation_id="op_2", state="interrupted",
                                   availability="replacement_eligible", reattach=True))
    assert "reattach      yes: 0 resume GET(s)\n" in waiting
    plain = format_status(Status(operation_id="op_3", state="prepared", availability="ready"))
    assert "reattach" not in plain


def test_the_status_says_why_the_last_attempt_cannot_be_resumed() -> None:
    ignored = AttemptSummary(attempt_id="op_4.1", number=1, reason="initial",
                             outcome="failed", response_id="resp_4",
                             not_resumable="background_ignored")
    shown = format_status(Status(operation_id="op_4", state="interrupted",
                                 availability="replacement_eligible", reattach=True,
                                 attempts=(ignored,)))
    assert "its last attempt cannot be resumed (background_ignored)" in shown
