"""Issue 29, item 17: the store commands say what really happened, and check the account
before anything else. In-process (``run_ops`` over a real LMDB store made with the
fixture provider): no subprocess needed to read what a command printed."""

from __future__ import annotations

import io
from pathlib import Path

import msgspec
import trio

import recoverable
from recoverable.actors.continuation import dispatch_continuation
from recoverable.cli.arguments import build_parser
from recoverable.cli.ops import run_ops
from recoverable.testing import FixtureProvider, Reply

ACCOUNT = recoverable.AccountBinding("acct", "api-key")  # what --account acct means


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


REQUEST = recoverable.StructuredRequest(model="gpt-test", input="q")
DROPS = [Reply.disconnect(after_events=2), Reply.disconnect(after_events=2)]


async def _authorize(attempt: recoverable.Attempt) -> bool:
    return True


def _store(tmp_path: Path, replies: list[Reply], *, continued: bool = False) -> tuple[str, str]:
    """(store, operation id): one operation run to its end (``continued``: it exhausted
    its attempts on drops and a worker dispatched its continuation successor)."""
    path = str(tmp_path / "store")

    async def make() -> str:
        async with FixtureProvider.serve() as provider:
            provider.script(replies)
            backend = recoverable.ResponsesBackend(
                provider.http_url, credentials=recoverable.StaticCredentials(
                    "sk-test", account=ACCOUNT), endpoint_id="fixture")
            with recoverable.RecoveryStore.open(path) as store:
                if continued:
                    await recoverable.set_continuation_preference(store, enabled=True,
                                                                  delay_seconds=0)
                async with recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
                    handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                                              retry_policy=recoverable.RetryPolicy(
                                                  initial_backoff=0.0))
                    try:
                        await rt.send_recovering(handle, response=Answer, authorize=_authorize)
                    except recoverable.RecoveryError:
                        pass
                    if continued:
                        result = await dispatch_continuation(
                            store, rt.telemetry, handle.operation_id, account=ACCOUNT,
                            endpoint_id=backend.endpoint_id, now=rt.now())
                        assert result.outcome == "dispatched"
                    return handle.operation_id

    return path, trio.run(make)


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_ops(build_parser().parse_args(list(argv)), out, err)
    return code, out.getvalue(), err.getvalue()


def test_suspend_of_a_completed_idle_operation_says_nothing_was_recorded(
    tmp_path: Path,
) -> None:
    store, op_id = _store(tmp_path, [Reply.complete({"answer": 1, "note": "n"})])
    code, out, _err = _run("suspend", "--store", store, "--account", "acct", op_id)
    assert code == 0
    assert out == f"suspend: nothing to suspend: {op_id} is completed; nothing was recorded\n"
    with recoverable.RecoveryStore.open(store) as opened:
        assert opened.get_command(op_id) is None
        found = opened.get_operation(op_id)
        assert found is not None and found.phase == "completed"


def test_suspend_of_a_continued_source_names_its_stopped_successor(tmp_path: Path) -> None:
    store, op_id = _store(tmp_path, DROPS, continued=True)
    with recoverable.RecoveryStore.open(store) as opened:
        source = opened.get_operation(op_id)
        assert source is not None and source.continuation is not None
        successor_id = source.continuation.successor_id
    code, out, _err = _run("suspend", "--store", store, "--account", "acct", op_id)
    assert code == 0
    assert out == (
        f"suspend: nothing to suspend: {op_id} is failed; nothing was recorded\n"
        f"suspend: its continuation successor {successor_id} is suspended\n"
    )


def test_retry_with_another_account_is_account_changed_first(tmp_path: Path) -> None:
    store, op_id = _store(tmp_path, DROPS)
    code, _out, err = _run("retry", "--store", store, "--account", "someone-else", op_id,
                           "--action-id", "click-1")
    assert code == 1
    assert err.startswith("recoverable retry: account_changed:"), err
    with recoverable.RecoveryStore.open(store) as opened:
        assert len(opened.inventory(ACCOUNT)[0]) == 1  # nothing was created
