"""Helpers for the CLI tests: run ``python -m recoverable`` as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "jobs.jsonl"
TIMEOUT = 60.0

SMALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["a", "b"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["label", "score"],
    "additionalProperties": False,
}


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "recoverable", *args]


def run_cli(
    *args: str, timeout: float = TIMEOUT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli_command(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO,
        env={**child_env(), **(env or {})},
    )


def start_cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cli_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=REPO, env=child_env(),
    )


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("OPENAI_API_KEY", None)
    env.pop("RECOVERABLE_KILL_AT", None)
    return env


def job_line(i: int, revision: str = "r1", **extra: Any) -> dict[str, Any]:
    line: dict[str, Any] = {
        "id": f"gen-{i:04d}",
        "revision": revision,
        "model": "gpt-test",
        "instructions": "Label the text.",
        "input": f"text number {i}",
        "schema": SMALL_SCHEMA,
        "schema_name": "label",
    }
    line.update(extra)
    return line


def write_jobs(path: Path, lines: list[Any]) -> Path:
    with path.open("w") as fh:
        for line in lines:
            fh.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def read_results(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def committed_lines(path: Path) -> int:
    """Whole lines in the output so far (a torn tail is not counted)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen[str], deadline: float = 30.0) -> None:
    end = time.monotonic() + deadline
    while committed_lines(path) < n:
        if proc.poll() is not None:
            raise AssertionError(f"the batch exited early: {proc.returncode} {proc.communicate()}")
        if time.monotonic() > end:
            raise AssertionError(f"fewer than {n} lines after {deadline} s")
        time.sleep(0.02)  # polling durable state, not a correctness sleep


def assert_exactly_once(results: list[dict[str, Any]], keys: set[tuple[str, str]]) -> None:
    counts = Counter((r["id"], r["revision"]) for r in results)
    duplicated = [k for k, n in counts.items() if n > 1]
    assert not duplicated, f"written more than once: {duplicated[:5]}"
    assert set(counts) == keys
