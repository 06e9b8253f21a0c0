"""The client's promise across a SIGKILL: a child process that calls ``parse`` is killed
right after the job's receipt is saved (kill point ``receipt.saved``, before ``parse``
returns); a rerun in a new process returns the saved value with zero new POSTs.

The fixture provider is served by this test's Trio loop on 127.0.0.1 for both children
(same URL, so the same endpoint identity); its request log counts the POSTs. Barriers: the
children's exits and the log, no sleeps.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import msgspec
import trio

from recoverable.testing import FixtureProvider, Reply

from .conftest import KEY_ENV

CHILD = str(Path(__file__).with_name("parse_child.py"))


async def _child(path: str, provider: FixtureProvider, kill_at: str | None = None,
                 ) -> trio.CompletedProcess[bytes]:
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("RECOVERABLE_KILL")}
    if kill_at is not None:
        env["RECOVERABLE_KILL_AT"] = kill_at
    with trio.fail_after(120):  # a loaded 2-core machine may be slow; never hangs
        return await trio.run_process(
            [sys.executable, CHILD, path, provider.http_url, KEY_ENV], env=env, check=False,
            capture_stdout=True, capture_stderr=True,
        )


async def test_a_parse_killed_after_its_receipt_is_saved_reruns_with_zero_posts(
    provider: FixtureProvider, path: str
) -> None:
    provider.script([Reply.complete({"answer": 42, "note": "six times seven"})])
    killed = await _child(path, provider, kill_at="receipt.saved")
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    assert killed.stdout == b""  # parse never returned
    assert len(provider.requests) == 1
    rerun = await _child(path, provider)
    assert rerun.returncode == 0, rerun.stderr.decode()
    assert msgspec.json.decode(rerun.stdout) == {"answer": 42, "note": "six times seven"}
    assert len(provider.requests) == 1  # the saved receipt: no new POST


async def test_a_parse_killed_before_sending_sends_once_on_the_rerun(
    provider: FixtureProvider, path: str
) -> None:
    killed = await _child(path, provider, kill_at="prepare.saved")
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    assert provider.requests == []
    rerun = await _child(path, provider)
    assert rerun.returncode == 0, rerun.stderr.decode()
    again = await _child(path, provider)
    assert again.stdout == rerun.stdout
    assert len(provider.requests) == 1
