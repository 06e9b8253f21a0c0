"""Shared helpers for the bench scripts: the provider process, percentiles, peak RSS.

The fixture provider always runs as a separate process (``fixture_main``), so the
measured process pays only for its own side of every socket.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
PROVIDER_CODE = (
    "import sys; from recoverable.fixture.provider import fixture_main;"
    " sys.exit(fixture_main(sys.argv[1:]))"
)


@contextmanager
def provider_process(
    faults: str | None = None, extra: Sequence[str] = ()
) -> Iterator[dict[str, Any]]:
    """Start the fixture provider in its own process; yield its URL line (plus ``pid``).
    ``extra``: more ``fixture-provider`` options (e.g. ``--deltas 200:500``).

    ``BENCH_PROVIDER_PYTHON`` (environment): the interpreter of the provider process
    (default: this one). It lets an older checkout's client be measured against this
    checkout's provider (same provider on both sides of a before/after table)."""
    python = os.environ.get("BENCH_PROVIDER_PYTHON") or sys.executable
    argv = [python, "-c", PROVIDER_CODE, "--port", "0", *extra]
    if faults:
        argv += ["--faults", faults]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fixture provider exited with {proc.wait()}")
        info: dict[str, Any] = json.loads(line)
        info["pid"] = proc.pid
        info["base_url"] = info["http_url"]
        yield info
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def script_provider(info: dict[str, Any], specs: Sequence[dict[str, Any]]) -> None:
    """Replace the provider's reply script (``POST /_fixture/script``)."""
    url = info["requests_url"].replace("/_fixture/requests", "/_fixture/script")
    r = httpx.post(url, json=list(specs), timeout=60)
    r.raise_for_status()


def provider_requests(info: dict[str, Any]) -> list[dict[str, Any]]:
    """The provider's request log (``GET /_fixture/requests``)."""
    r = httpx.get(info["requests_url"], timeout=60)
    r.raise_for_status()
    log: list[dict[str, Any]] = r.json()
    return log


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (``p`` in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def peak_rss_mib() -> float:
    """This process's peak resident set size in MiB (Linux reports KiB)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024.0


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command (its state first, its parent
    second), or None once the process is gone (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def child_pids(parent: int) -> list[int]:
    """The living (not zombie) processes whose parent is ``parent``, in pid order."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = proc_stat(int(entry))
            if fields is not None and int(fields[1]) == parent and fields[0] != "Z":
                found.append(int(entry))
    return sorted(found)


def process_cpu_seconds(pid: int, *, children: bool = False) -> float:
    """User + system CPU seconds consumed so far by another process (Linux /proc), with
    its reaped children's when ``children``. ``ProcessLookupError`` once it is gone."""
    fields = proc_stat(pid)
    if fields is None:
        raise ProcessLookupError(pid)
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def self_cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads)."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def thread_cpu_seconds() -> tuple[float, float]:
    """(main thread, all other threads) CPU seconds, user + system, of this process so far
    (``/proc/self/task/*/stat``). In a durable worker the other threads are the store's
    writer thread (and Trio's short-lived worker threads, e.g. for getaddrinfo)."""
    ticks = os.sysconf("SC_CLK_TCK")
    main = other = 0.0
    for task in Path("/proc/self/task").iterdir():
        try:
            with open(task / "stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        seconds = (int(fields[11]) + int(fields[12])) / ticks
        if task.name == str(os.getpid()):
            main += seconds
        else:
            other += seconds
    return main, other


class GcClock:
    """Time spent in Python's cyclic garbage collector (``gc.callbacks``), per generation.

    A collection runs in the thread whose allocation triggered it, so its duration is
    taken with that thread's CPU clock (``time.thread_time``)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._started: dict[int, float] = {}

    def install(self) -> GcClock:
        import gc

        gc.callbacks.append(self._callback)
        return self

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._started[ident] = time.thread_time()
            return
        started = self._started.pop(ident, None)
        if started is not None:
            generation = info["generation"]
            self.seconds[generation] += time.thread_time() - started
            self.collections[generation] += 1

    def total(self) -> float:
        return sum(self.seconds)


def context_switches() -> tuple[int, int]:
    """(voluntary, involuntary) context switches of this process so far (all threads)."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_nvcsw, u.ru_nivcsw


def ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.1f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain fixed-width table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def raise_fd_limit(wanted: int = 16384) -> None:
    """Thousands of concurrent sockets need more than the default 1,024 descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard, max(soft, wanted)) if hard != resource.RLIM_INFINITY else max(soft, wanted)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RECOVERABLE_KILL_AT", None)
    return env
