"""The one-call client for threads and asyncio (``BlockingClient``, ``AsyncioClient``),
and ``submit``/``wait`` on ``AsyncioRuntime``/``BlockingRuntime``.

The hosts run the Trio client in a thread of their own; these tests are plain threads and
a real ``asyncio.run`` app, as a user's code would be. The embedded fixture provider
(``endpoint="fixture"``) counts the POSTs.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

import recoverable
from recoverable import errors
from recoverable.testing import Reply

from ..runtime.conftest import ACCOUNT as RUNTIME_ACCOUNT
from ..runtime.conftest import REQUEST, make_backend
from ..runtime.conftest import Answer as RuntimeAnswer
from ..runtime.test_blocking import provider_thread
from .conftest import ACCOUNT, Answer

QUESTION = {"model": "gpt-test", "input": "Six times seven?"}


def _jobs(count: int) -> list[dict[str, Any]]:
    return [{"model": "gpt-test", "input": f"question {index}", "job_id": f"m{index}"}
            for index in range(count)]


def _posts(client: recoverable.BlockingClient | recoverable.AsyncioClient) -> int:
    assert client.client.fixture is not None
    return len(client.client.fixture.requests)


def test_blocking_client_parse_map_and_forget(tmp_path: Path) -> None:
    path = str(tmp_path / "recovery")
    with recoverable.BlockingClient(path, endpoint="fixture", account=ACCOUNT) as client:
        value = client.parse(**QUESTION, text_format=Answer, job_id="job-42")
        assert isinstance(value, Answer)
        assert client.parse(**QUESTION, text_format=Answer, job_id="job-42") == value
        assert _posts(client) == 1
        results = list(client.map(_jobs(4), text_format=Answer, concurrency=2))
        assert sorted(result.job_id for result in results) == ["m0", "m1", "m2", "m3"]
        assert all(result.ok and not result.saved for result in results)
        assert _posts(client) == 5
        again = list(client.map(_jobs(4), text_format=Answer))
        assert all(result.saved for result in again) and _posts(client) == 5
        assert client.forget("job-42") is True
        assert client.parse(**QUESTION, text_format=Answer, job_id="job-42") == value
        assert _posts(client) == 6
    # Closed: calls are refused with the runtime's typed error.
    with pytest.raises(errors.RuntimeClosed):
        client.parse(**QUESTION, text_format=Answer, job_id="job-42")


def test_blocking_client_policy_runs_off_the_trio_thread(tmp_path: Path) -> None:
    threads: list[int] = []

    def refuse(attempt: recoverable.Attempt) -> bool:
        threads.append(threading.get_ident())
        return False

    path = str(tmp_path / "recovery")
    with recoverable.BlockingClient(path, endpoint="fixture", account=ACCOUNT,
                                    authorize=refuse) as client:
        with pytest.raises(errors.AttemptNotAuthorized):
            client.parse(**QUESTION, text_format=Answer, job_id="j")
        assert _posts(client) == 0
    assert len(threads) == 1 and threads[0] != threading.get_ident()

    async def asynchronous(attempt: recoverable.Attempt) -> bool:
        return True

    with pytest.raises(errors.InvalidRequest):
        recoverable.BlockingClient(path, endpoint="fixture", account=ACCOUNT,
                                   authorize=asynchronous)  # type: ignore[arg-type]


def test_asyncio_client_parse_map_and_forget(tmp_path: Path) -> None:
    path = str(tmp_path / "recovery")

    async def main() -> None:
        loop_thread = threading.get_ident()
        asked: list[int] = []

        async def authorize(attempt: recoverable.Attempt) -> bool:  # on this loop
            asked.append(threading.get_ident())
            await asyncio.sleep(0)
            return True

        async with recoverable.AsyncioClient(path, endpoint="fixture", account=ACCOUNT,
                                             authorize=authorize) as client:
            value = await client.parse(**QUESTION, text_format=Answer, job_id="job-42")
            assert await client.parse(**QUESTION, text_format=Answer, job_id="job-42") == value
            assert _posts(client) == 1 and asked == [loop_thread]
            results = [result async for result in client.map(_jobs(3), text_format=Answer,
                                                               concurrency=2)]
            assert sorted(result.job_id for result in results) == ["m0", "m1", "m2"]
            assert _posts(client) == 4
            rerun = [result async for result in client.map(_jobs(3), text_format=Answer)]
            assert all(result.saved for result in rerun) and _posts(client) == 4
            assert await client.forget("job-42") is True
            await client.parse(**QUESTION, text_format=Answer, job_id="job-42")
            assert _posts(client) == 5
            assert set(asked) == {loop_thread}

    asyncio.run(main())


def test_asyncio_runtime_submit_and_wait(tmp_path: Path) -> None:
    with provider_thread() as served, recoverable.RecoveryStore.open(
        str(tmp_path / "store")
    ) as store:

        async def main() -> None:
            async with recoverable.AsyncioRuntime(
                store, make_backend(served.provider), account=RUNTIME_ACCOUNT
            ) as runtime:
                handle = await runtime.submit(REQUEST, response=RuntimeAnswer, job_id="j",
                                              maximum_attempts=2)
                assert await runtime.submit(REQUEST, response=RuntimeAnswer, job_id="j",
                                            maximum_attempts=2) == handle
                waiter = asyncio.create_task(runtime.wait(handle, response=RuntimeAnswer))
                # Run it here, as a worker would: the waiter sees the saved value.
                value = await runtime.send_recovering(handle, response=RuntimeAnswer,
                                                      authorize=lambda attempt: True)
                assert await waiter == value
                assert await runtime.wait(handle, response=RuntimeAnswer) == value
                assert len(served.requests_of(handle.operation_id)) == 1

        asyncio.run(main())

        with recoverable.BlockingRuntime(
            store, make_backend(served.provider), account=RUNTIME_ACCOUNT
        ) as blocking:
            handle = blocking.submit(REQUEST, response=RuntimeAnswer, job_id="j",
                                     maximum_attempts=2)
            assert isinstance(blocking.wait(handle, response=RuntimeAnswer), RuntimeAnswer)
            assert len(served.requests_of(handle.operation_id)) == 1


def test_cancelling_an_asyncio_parse_suspends_the_job_and_a_parse_resumes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RECOVERABLE_TEST_CLIENT_KEY", "sk-test")
    path = str(tmp_path / "recovery")
    with provider_thread() as served:
        served.script([Reply.stall()])  # the first attempt hangs until it is stopped

        async def main() -> None:
            async with recoverable.AsyncioClient(
                path, endpoint=served.provider.http_url, account=ACCOUNT, mode="sse",
                api_key_env="RECOVERABLE_TEST_CLIENT_KEY",
            ) as client:
                task = asyncio.create_task(
                    client.parse(**QUESTION, text_format=Answer, job_id="j")
                )
                await asyncio.to_thread(served.wait_for_requests, 1)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                # The cancellation returned once the suspension was saved.
                (operation_id,) = client.client.store.ids_by_job(
                    client.client.account, "client", "j"
                )
                assert client.client.store.get_operation(operation_id).phase == "suspended"
                value = await client.parse(**QUESTION, text_format=Answer, job_id="j")
                assert isinstance(value, Answer)
                assert len(served.requests_of(operation_id)) == 2

        asyncio.run(main())
