"""A batch whose store fails for every job (issue 11.9): one clear message, nothing lost.

Real process, real LMDB, a real provider on 127.0.0.1: the batch (``python -m
recoverable``) runs against an in-process ``FixtureProvider`` that holds the reply to the
third request. While it is held (two jobs committed, the third one's attempt on the wire),
the test removes the store's ``lock.mdb``; from then on the batch's store refuses every read
and write (``store_lock_replaced``) so every remaining job fails the same way. The batch
must say so once (not once per job), exit with code 1, keep the committed lines, send
nothing more, and a rerun (its process gone, the store opens with a new lock file) must
complete the rest.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import trio

from recoverable.testing import FixtureProvider

from .cli_helpers import (
    assert_exactly_once,
    committed_lines,
    job_line,
    read_results,
    run_cli,
    write_jobs,
)

JOBS = 12
HELD = 2  # the index of the request whose reply waits for the gate (the third job)
# Far above what 12 tiny jobs take even on a loaded machine: only a batch that hangs
# reaches it.
HANG_GUARD = 120.0


class GatedProvider(FixtureProvider):
    """A fixture provider that holds the reply to request ``HELD`` until ``gate`` is set."""

    gate: trio.Event

    async def _replying(self) -> int:
        index = await super()._replying()
        if index == HELD:
            await self.gate.wait()
        return index


def _batch(jobs: Path, out: Path, store: Path, url: str) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "batch", str(jobs), "--out", str(out), "--store", str(store), "--endpoint", url,
        "--mode", "sse", "--concurrency", "1", "--backoff", "0.05",
        timeout=HANG_GUARD, env={"OPENAI_API_KEY": "sk-test-key"},
    )


async def test_a_store_failing_for_every_job_gives_one_message_and_loses_nothing(
    tmp_path: Path,
) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(JOBS)])
    out = tmp_path / "results.jsonl"
    store = tmp_path / "store"
    runs: dict[str, subprocess.CompletedProcess[str]] = {}

    async def run(name: str, url: str) -> None:
        runs[name] = await trio.to_thread.run_sync(
            functools.partial(_batch, jobs, out, store, url)
        )

    with trio.fail_after(2 * HANG_GUARD):
        async with GatedProvider.serve() as provider:
            provider.gate = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "first", provider.http_url)
                await provider.wait_for_requests(HELD + 1)
                # Concurrency 1: the first two jobs are committed (fsynced lines) before the
                # third one is prepared, and the third one's attempt is on the wire now.
                assert committed_lines(out) == HELD
                kept = out.read_bytes()
                (store / "lock.mdb").unlink()
                provider.gate.set()
            sent_by_first = len(provider.requests)

            first = runs["first"]
            assert first.returncode == 1, (first.returncode, first.stderr)
            assert "Traceback" not in first.stderr, first.stderr
            # Nothing lost: the committed lines are intact, nothing more was written or sent.
            assert out.read_bytes() == kept
            assert sent_by_first == HELD + 1
            # The held job's validated result could not be saved (its own message); every
            # later job meets the refusing store. One clear message for those: one job line
            # naming the lock file, one line saying the store is unusable, one count of the
            # others (and the summary's count); not one line per job.
            lines = first.stderr.splitlines()
            held = [ln for ln in lines if f"gen-{HELD:04d}" in ln]
            assert len(held) == 1 and "failed: completion_unavailable" in held[0], first.stderr
            job_lines = [ln for ln in lines if "failed: store_lock_replaced" in ln]
            assert len(job_lines) == 1, first.stderr
            assert "lock.mdb" in job_lines[0], job_lines  # says what happened to the store
            unusable = [ln for ln in lines if "the store is not usable" in ln]
            assert len(unusable) == 1, first.stderr
            others = JOBS - HELD - 2  # neither the held job nor the one shown
            assert sum(
                f"... and {others} more job(s) failed with store_lock_replaced" in ln
                for ln in lines
            ) == 1, first.stderr
            assert not any(f"gen-{i:04d}" in first.stderr for i in range(HELD + 2, JOBS))

            # The batch process is gone: the store opens again (a new lock file) and a rerun
            # completes the rest, the two committed jobs untouched.
            await run("rerun", provider.http_url)
            rerun = runs["rerun"]
            assert rerun.returncode == 0, (rerun.returncode, rerun.stderr)
            assert "store_lock_replaced" not in rerun.stderr, rerun.stderr
            assert out.read_bytes().startswith(kept)
            assert_exactly_once(read_results(out), {(f"gen-{i:04d}", "r1") for i in range(JOBS)})
            # The third job's first attempt reached the provider but its result was never
            # saved: it is replaced once; every other remaining job is sent once.
            assert len(provider.requests) == sent_by_first + (JOBS - HELD - 1) + 1
