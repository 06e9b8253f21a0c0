"""What a running batch shows: the progress line, messages, and a stdout that may break."""

from __future__ import annotations

import os
import time
from typing import IO, TYPE_CHECKING, Final, Protocol

import trio

from recoverable import errors
from recoverable.cli.formatting import safe_text
from recoverable.pricing import PriceTable, TokenLedger

if TYPE_CHECKING:
    from recoverable.actors.runtime import Runtime
    from recoverable.cli.report import BatchSummary

__all__ = [
    "Messages", "ProgressDisplay", "ProgressHost", "Terminal", "estimated_cost", "fit_width",
]


class _WorkersSetting(Protocol):
    @property
    def workers(self) -> int: ...


class ProgressHost(Protocol):
    """What the progress line reads: the batch host (``cli.host``), or a Python batch
    (``recoverable.client``'s ``map(progress=True)``)."""

    @property
    def summary(self) -> BatchSummary: ...
    @property
    def rt(self) -> Runtime: ...
    @property
    def running(self) -> int: ...
    @property
    def config(self) -> _WorkersSetting: ...
    def attempts_spent(self) -> int: ...

# Why jobs wait for the rate governor, as the progress line says it.
_RATE_REASONS: Final = {
    "requests": "rpm, next at", "tokens": "tpm, next at", "paused": "paused by the provider until",
}


def estimated_cost(ledger: TokenLedger, prices: PriceTable | None) -> float | None:
    """USD for the tokens counted so far; None while any counted model has no price."""
    if prices is None:
        return None
    cost = 0.0
    for (model, tier), tokens in ledger.by_model.items():
        price = prices.for_model(model, tier)
        if price is None:
            if tokens.total.total_tokens == 0:
                continue  # nothing to price (as in the summary's estimate)
            return None
        cost += price.cost(tokens.total)
    return cost


def fit_width(text: str, columns: int | None) -> str:
    """``text`` cut to ``columns - 1`` characters (an ellipsis marks the cut)."""
    if columns is None or columns < 8 or len(text) < columns:
        return text
    return text[: columns - 2] + "…"


class Terminal:
    """The batch's stdout, which may break under it: closed (``>&-``), full
    (``>/dev/full``: ENOSPC) or a pipe whose reader left (``| head -1``: EPIPE).
    Then drawing stops, one message goes to stderr, and the batch goes on; the
    summary is written to stderr instead."""

    def __init__(self, out: IO[str] | None, err: IO[str] | None) -> None:
        self.out = out
        self.err = err
        self.broken: str | None = None if out is not None else "stdout is closed"
        if out is None:
            self.error("recoverable batch: stdout is closed: no progress is shown; the summary "
                       "goes to stderr")

    def isatty(self) -> bool:
        try:
            return self.out is not None and self.out.isatty()
        except (OSError, ValueError):
            return False

    def columns(self) -> int | None:
        """The terminal's width, if stdout is a terminal whose size can be read."""
        try:
            return os.get_terminal_size(self.out.fileno()).columns if self.out else None
        except (OSError, ValueError, AttributeError):
            return None

    def write(self, text: str) -> bool:
        """Write and flush; False (and stdout given up) when it cannot be written."""
        if self.broken is not None or self.out is None:
            return False
        try:
            self.out.write(text)
            self.out.flush()
            return True
        except (OSError, ValueError) as exc:
            reason = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc))
            self.broken = reason
            self._detach()
            self.error(f"recoverable batch: stdout failed ({reason}): no more progress is "
                       "shown; the batch goes on and its summary goes to stderr")
            return False

    def _detach(self) -> None:
        # Point the broken descriptor at /dev/null so that what is still buffered does
        # not fail again at interpreter exit (which would change the exit code).
        try:
            assert self.out is not None
            fd = self.out.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, fd)
            finally:
                os.close(devnull)
        except (OSError, ValueError, AssertionError, AttributeError):
            pass

    def error(self, message: str) -> None:
        """To stderr; a broken stderr is ignored (nothing else is left to tell)."""
        if self.err is None:
            return
        try:
            self.err.write(message + "\n")
            self.err.flush()
        except (OSError, ValueError):
            pass


class Messages:
    """Where messages go: stderr, clearing the live progress line first."""

    def __init__(self, out: Terminal, *, live: bool) -> None:
        self.out = out
        self.live = live

    def say(self, message: str) -> None:
        if self.live and self.out.broken is None:
            self.out.write("\r\x1b[K")
        self.out.error(safe_text(message))  # it may quote a job's or provider's text


class ProgressDisplay:
    """A live status line on a terminal (~5 redraws/s), a plain log line otherwise (1/s):
    per-state counts (done, running, waiting for rate budget, waiting, failed,
    unfinished), attempts, tokens, the estimated cost when every model has a price,
    jobs/s and the ETA.

    Hand-written rather than ``rich``: every write goes through ``Terminal``, which turns
    a closed, full or broken stdout into one stderr message while the batch goes on, and
    a non-terminal gets plain ``[elapsed] key value`` lines (parseable, no escapes)."""

    def __init__(self, host: ProgressHost, out: Terminal, *, live: bool, started: float) -> None:
        self.host = host
        self.out = out
        self.live = live
        self.started = started
        self._last = ""
        self._shared: tuple[tuple[str, float] | None, float] | None = None

    def line(self) -> str:
        summary = self.host.summary
        done = summary.committed + summary.already_committed
        failed = summary.failed_total
        elapsed = time.monotonic() - self.started
        rate = summary.committed / elapsed if elapsed > 0 else 0.0
        remaining = summary.jobs - done - failed - summary.unfinished
        eta = f"{remaining / rate:.0f}s" if rate > 0 and remaining > 0 else "-"
        scheduler = self.host.rt.scheduler
        waiting = scheduler.waiting
        summary.attempts = self.host.attempts_spent()
        running = max(0, self.host.running - waiting)
        until = ""
        wake: float | None = getattr(scheduler, "next_wake_at", None)
        if waiting and wake is not None and wake - time.time() > 5:
            until = f" (waiting until {time.strftime('%H:%M:%S', time.localtime(wake))})"
        rated, budget = self._rate_budget()
        running = max(0, running - rated)
        tokens = summary.tokens.total
        cost = estimated_cost(summary.tokens, summary.prices)
        text = (
            f"done {done}/{summary.jobs}  running {running}  {budget}"
            f"waiting {waiting}{until}  "
            f"failed {failed}  unfinished {summary.unfinished}  attempts {summary.attempts}  "
            f"tokens {tokens.total_tokens} (in {tokens.input_tokens}, out "
            f"{tokens.output_tokens})  cost {'-' if cost is None else f'${cost:.4f}'}  "
            f"{rate:.1f} jobs/s  eta {eta}"
        )
        down = self.host.rt.endpoint_failure()
        if down is not None:
            text += f"  endpoint unavailable ({down})"
        return text

    def _rate_budget(self) -> tuple[int, str]:
        """The jobs that wait for the rate governor (docs/rate-limits.md), and the line's
        segment saying so ("" when none does): ``waiting for rate budget N (rpm, next at
        HH:MM:SS)``. In this process they are the governor's waiting operations (not
        running: nothing is sent for them). With ``--workers`` the workers run the jobs:
        the shared governor row says whether a request would wait now (no count), read
        at most once a second."""
        governor = self.host.rt.governor
        count = 0
        if self.host.config.workers:
            found = self._shared_wait()
        else:
            waiting = list(governor.waiting.values())
            count = len(waiting)
            found = min(waiting, key=lambda entry: entry[1]) if waiting else None
        if found is None:
            return 0, ""
        reason, until = found
        at = time.strftime("%H:%M:%S", time.localtime(until))
        shown = f" {count}" if count else ""
        return count, f"waiting for rate budget{shown} ({_RATE_REASONS[reason]} {at})  "

    def _shared_wait(self) -> tuple[str, float] | None:
        now = time.monotonic()
        if self._shared is not None and now - self._shared[1] < 1.0:
            return self._shared[0]
        rt = self.host.rt
        found: tuple[str, float] | None = None
        if rt.backend is not None and rt.account is not None:
            try:
                found = rt.governor.budget_wait(rt.backend.endpoint_id, rt.account)
            except errors.RecoveryError:
                found = None  # advisory: the display never stops the batch
        self._shared = (found, now)
        return found

    def draw(self, final: bool = False) -> None:
        if self.out.broken is not None:
            return  # stdout is gone: the batch goes on without drawing
        text = self.line()
        if self.live:
            # One terminal row: a wrapped line could not be redrawn in place by "\r".
            text = fit_width(text, self.out.columns())
            self.out.write("\r\x1b[K" + text + ("\n" if final else ""))
        elif text != self._last or final:
            self.out.write(f"[{time.monotonic() - self.started:7.1f}s] {text}\n")
        self._last = text

    async def run(self) -> None:
        interval = 0.2 if self.live else 1.0
        while True:
            await trio.sleep(interval)
            self.draw()
