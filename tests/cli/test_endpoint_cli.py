"""Issue 11.7 as a user meets it: ``recoverable batch`` against a closed port, then a rerun.

Real processes and real sockets: the batch is bounded by SIGTERM once it reports the
endpoint unavailable; then the fixture provider (its own process) listens on that very
port and a rerun completes every job with its first attempt.
"""

from __future__ import annotations

import json
import queue
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from .cli_helpers import (
    TIMEOUT,
    child_env,
    cli_command,
    job_line,
    read_results,
    run_cli,
    write_jobs,
)

KEY_ENV = {"OPENAI_API_KEY": "sk-test-key"}


def closed_port() -> int:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    sock.close()
    return port


def inventory(store: Path) -> list[dict[str, Any]]:
    if not store.exists():
        return []
    result = run_cli("inventory", "--store", str(store), "--account", "default", "--json")
    assert result.returncode == 0, result.stderr
    ops: list[dict[str, Any]] = json.loads(result.stdout)["operations"]
    return ops if len(ops) == 3 else []


def summary_of(stdout: str) -> dict[str, str]:
    """The final summary table (``key  value`` rows; progress lines start with ``[``)."""
    rows = [line.split("  ", 1) for line in stdout.splitlines()
            if "  " in line and not line.startswith("[")]
    return {k.strip(): v.strip() for k, v in rows}


def _lines(stream: object, into: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        into.put(line)


def _wait_for(lines: queue.Queue[str], needle: str, seen: list[str]) -> None:
    while True:
        try:
            # Generous per line: the batch writes something every second; CI may be loaded.
            line = lines.get(timeout=TIMEOUT)
        except queue.Empty:
            raise AssertionError(f"never saw {needle!r}; got {seen}") from None
        seen.append(line)
        if needle in line:
            return


@pytest.mark.parametrize("mode", ["websocket", "sse"])
def test_closed_port_spends_nothing_and_a_rerun_completes_every_job(
    tmp_path: Path, mode: str
) -> None:
    port = closed_port()
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(3)])
    out = tmp_path / "results.jsonl"
    store = tmp_path / "store"
    args = ["batch", str(jobs), "--out", str(out), "--store", str(store),
            "--endpoint", f"http://127.0.0.1:{port}/v1", "--mode", mode]
    proc = subprocess.Popen(
        cli_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**child_env(), **KEY_ENV},
    )
    errors: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stderr, errors), daemon=True).start()
    seen: list[str] = []
    try:
        _wait_for(errors, "endpoint unavailable (connect_refused)", seen)
        # Every job has reached the endpoint and is waiting on it (durable state, read by
        # another process while the batch runs).
        end = time.monotonic() + TIMEOUT
        while not all(op["availability"] == "endpoint_unavailable" for op in inventory(store)):
            assert time.monotonic() < end, inventory(store)
            time.sleep(0.1)  # polling durable state, not a correctness sleep
    finally:
        proc.send_signal(signal.SIGTERM)  # the host's bound on this run
    stdout, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 130, (stdout, seen)
    summary = summary_of(stdout)
    assert summary["POSTs (attempts spent)"] == "0"
    assert summary["failed"] == "0"
    assert summary["unfinished"] == "3"
    assert summary["endpoint unavailable"].startswith("connect_refused")
    assert read_results(out) == []

    ops = inventory(store)
    assert len(ops) == 3
    for op in ops:
        assert op["availability"] == "endpoint_unavailable"
        assert op["attempts_used"] == 0
        assert op["pending_attempt_id"] == op["operation_id"] + ".1"

    provider = subprocess.Popen(
        cli_command("fixture-provider", "--port", str(port)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=child_env(),
    )
    try:
        assert provider.stdout is not None
        ready = json.loads(provider.stdout.readline())
        assert ready["http_url"] == f"http://127.0.0.1:{port}/v1"
        rerun = run_cli(*args, env=KEY_ENV)
    finally:
        provider.send_signal(signal.SIGTERM)
        provider.communicate(timeout=TIMEOUT)
    assert rerun.returncode == 0, (rerun.stdout, rerun.stderr)
    results = read_results(out)
    assert sorted(r["id"] for r in results) == ["gen-0000", "gen-0001", "gen-0002"]
    assert {r["operation_id"] for r in results} == {op["operation_id"] for op in ops}
    assert summary_of(rerun.stdout)["POSTs (attempts spent)"] == "3"
    status = run_cli("status", "--store", str(store), "--account", "default", "--json",
                     ops[0]["operation_id"])
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["attempts_used"] == 1


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("sk-caf\u00e9", "non-ASCII"),
        ("sk-abc\n", "line break"),
        ("sk-abc\r", "line break"),
        ("sk abc", "whitespace"),
    ],
)
def test_a_key_that_cannot_be_sent_is_a_usage_error(
    tmp_path: Path, key: str, problem: str
) -> None:
    port = closed_port()
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0)])
    out = tmp_path / "results.jsonl"
    store = tmp_path / "store"
    result = run_cli(
        "batch", str(jobs), "--out", str(out), "--store", str(store),
        "--endpoint", f"http://127.0.0.1:{port}/v1", env={"OPENAI_API_KEY": key},
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "OPENAI_API_KEY" in result.stderr and problem in result.stderr
    assert key.strip() not in result.stderr  # the key itself is never printed
    assert "Traceback" not in result.stderr
    assert not out.exists() and not store.exists()  # nothing touched
