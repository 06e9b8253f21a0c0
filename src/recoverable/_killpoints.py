"""Named crash points for the crash test harness (zero cost unless enabled).

Set ``RECOVERABLE_KILL_AT=<name>`` (optionally ``<name>@<n>`` for the n-th hit)
in a test process's environment and the process SIGKILLs itself when the code
path reaches that point. With ``RECOVERABLE_KILL_SIGNAL=STOP`` it SIGSTOPs itself
there instead (a hung owner: it goes on where it stopped once sent SIGCONT). Nothing
else reads these variables.
"""

from __future__ import annotations

import os
import signal

_spec = os.environ.get("RECOVERABLE_KILL_AT")
_TARGET: str | None
_NTH = 1
if _spec:
    _name, _, _count = _spec.partition("@")
    _TARGET = _name
    _NTH = int(_count) if _count.isdigit() else 1
else:
    _TARGET = None
_hits = 0
_SIGNAL = signal.SIGSTOP if os.environ.get("RECOVERABLE_KILL_SIGNAL") == "STOP" else signal.SIGKILL

# The boundaries of the crash table (specification, "Exactly where durability begins").
POINTS = (
    "prepare.before_save",  # 1: before the SDK record is saved
    "prepare.saved",  # 2: record saved, before the host stores the handle
    "host.handle_saved",  # 3: handle saved, before authorization (host side)
    "attempt.pending_saved",  # 4: pending attempt id saved, during authorization
    "attempt.consumed_saved",  # 5: consumed attempt saved, before/while sending
    "stream.completed_unreceived",  # 6: the server completed, response not yet received
    "receipt.before_save",  # 7: validated completion received, receipt not saved
    "receipt.saved",  # 8: receipt saved, before the host commit
    "host.committed",  # 9: host commit done, before acknowledge (host side)
    "acknowledge.marker_saved",  # 10: acknowledgement marker saved, before payload removal
)
# Reattachment (reattach=True; not rows of the seed's table): a reattachment checkpoint was
# committed (actors/send.py), and the reattachment of an attempt is counted and saved,
# its resume GET not sent yet (actors/reattach.py).
REATTACH_POINTS = ("reattach.checkpoint_saved", "reattach.saved")


def hit(name: str) -> None:
    """SIGKILL (or SIGSTOP) this process if ``name`` is the enabled point (and its hit)."""
    global _hits
    if _TARGET is None or name != _TARGET:
        return
    _hits += 1
    if _hits == _NTH or (_hits > _NTH and _SIGNAL == signal.SIGKILL):
        os.kill(os.getpid(), _SIGNAL)
