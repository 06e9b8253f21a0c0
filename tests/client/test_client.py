"""The one-call client (Trio): ``open_client``, ``parse``, ``forget``, ``map``.

Real: an LMDB store on disk, the fixture provider on 127.0.0.1 (its request log counts
the POSTs), no mocks and no sleeps: each assertion reads durable state or the log.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import trio

import recoverable
from recoverable import errors
from recoverable.client import DIGEST_PREFIX
from recoverable.failure_errors import failure_label
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, Answer, job_posts, options, posts

pytestmark = pytest.mark.both_stores  # the client on PostgreSQL too: RecoveryStore.open(url)

QUESTION = {"model": "gpt-test", "input": "Six times seven?"}


async def test_parse_returns_the_typed_value_and_again_with_zero_posts(
    provider: FixtureProvider, path: str
) -> None:
    provider.script([Reply.complete({"answer": 42, "note": "six times seven"})])
    async with recoverable.open_client(path, **options(provider)) as client:
        answer = await client.parse(**QUESTION, text_format=Answer, job_id="job-42")
        assert answer == Answer(answer=42, note="six times seven")
        assert posts(provider) == 1
        again = await client.parse(**QUESTION, text_format=Answer, job_id="job-42")
        assert again == answer
        assert posts(provider) == 1  # the saved receipt: nothing sent
        # The receipt is kept as the job's saved result (never acknowledged by parse).
        (operation_id,) = client.store.ids_by_job(client.account, "client", "job-42")
        status = await client.runtime.status(recoverable.Handle(operation_id))
        assert status.state == "completed" and status.has_saved_completion
    # A later process (here: a new client on the same store) returns it too.
    async with recoverable.open_client(path, **options(provider)) as client:
        assert await client.parse(**QUESTION, text_format=Answer, job_id="job-42") == answer
    assert posts(provider) == 1


async def test_without_job_id_the_frozen_requests_digest_keys_the_job(
    provider: FixtureProvider, path: str
) -> None:
    async with recoverable.open_client(path, **options(provider)) as client:
        first = await client.parse(**QUESTION, text_format=Answer)
        assert await client.parse(**QUESTION, text_format=Answer) == first
        assert posts(provider) == 1
        (status,) = (await client.runtime.inventory(scope="client")).operations
        assert status.job_id is not None and status.job_id.startswith(DIGEST_PREFIX)
        # Another input revision is another job: asked again.
        await client.parse(**QUESTION, text_format=Answer, input_revision="2")
        assert posts(provider) == 2
        # Another request (another digest) too.
        await client.parse(model="gpt-test", input="Seven times six?", text_format=Answer)
        assert posts(provider) == 3


async def test_forget_acknowledges_and_removes_then_parse_asks_again(
    provider: FixtureProvider, path: str
) -> None:
    async with recoverable.open_client(path, **options(provider)) as client:
        await client.parse(**QUESTION, text_format=Answer, job_id="job-42")
        (operation_id,) = client.store.ids_by_job(client.account, "client", "job-42")
        assert await client.forget("job-42") is True
        assert client.store.get_operation(operation_id) is None
        assert client.store.get_disposition(operation_id) is None  # no marker is left
        assert await client.forget("job-42") is False  # nothing left to forget
        await client.parse(**QUESTION, text_format=Answer, job_id="job-42")
        assert posts(provider) == 2
        (second,) = client.store.ids_by_job(client.account, "client", "job-42")
        assert second != operation_id


async def test_typed_errors_of_the_runtime_come_through_unchanged(
    provider: FixtureProvider, path: str
) -> None:
    provider.script([Reply.http_error(400, {"error": {"code": "invalid_request_error"}})])
    async with recoverable.open_client(path, **options(provider)) as client:
        with pytest.raises(errors.ProviderError) as caught:
            await client.parse(**QUESTION, text_format=Answer, job_id="bad")
        assert caught.value.kind == "http_rejected" and caught.value.http_status == 400
        assert posts(provider) == 1
        # The failure is the job's saved outcome: asked again, its typed error, no POST.
        with pytest.raises(errors.PermanentlyFailed) as again:
            await client.parse(**QUESTION, text_format=Answer, job_id="bad")
        assert again.value.operation_id == caught.value.operation_id
        # Another class (raised by the provider's answer, then read back from the saved
        # failure), one label: the typed failure kind does not change between runs.
        assert again.value.reason == "rejected"
        assert failure_label(caught.value) == failure_label(again.value) == (
            "provider_error:http_rejected")
        assert posts(provider) == 1
        # The same job id with another request: the runtime's JobConflict.
        with pytest.raises(errors.JobConflict):
            await client.parse(model="gpt-test", input="other", text_format=Answer,
                               job_id="bad")
        # A refused parameter: InvalidParameter, before anything is saved or sent.
        with pytest.raises(errors.InvalidParameter):
            await client.parse(**QUESTION, text_format=Answer, temperature=9.0)
    assert posts(provider) == 1


async def test_the_standing_policy_is_asked_for_every_attempt(
    provider: FixtureProvider, path: str
) -> None:
    asked: list[recoverable.Attempt] = []

    def refuse(attempt: recoverable.Attempt) -> bool:
        asked.append(attempt)
        return False

    async with recoverable.open_client(path, **options(provider, authorize=refuse)) as client:
        with pytest.raises(errors.AttemptNotAuthorized):
            await client.parse(**QUESTION, text_format=Answer, job_id="j")
    assert [attempt.reason for attempt in asked] == ["initial"]
    assert posts(provider) == 0


async def test_the_embedded_fixture_endpoint(path: str) -> None:
    async with recoverable.open_client(path, endpoint="fixture", account=ACCOUNT) as client:
        assert client.fixture is not None
        value = await client.parse(**QUESTION, text_format=Answer, job_id="j")
        assert isinstance(value, Answer)
        assert len(client.fixture.requests) == 1
    # Another run serves the fixture on another port: the job's saved value, no POST.
    async with recoverable.open_client(path, endpoint="fixture", account=ACCOUNT) as client:
        assert client.fixture is not None
        assert await client.parse(**QUESTION, text_format=Answer, job_id="j") == value
        assert client.fixture.requests == []


async def test_the_key_is_read_from_the_environment_and_never_saved(
    provider: FixtureProvider, path: str, api_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with recoverable.open_client(path, **options(provider)) as client:
        await client.parse(**QUESTION, text_format=Answer, job_id="j")
    assert posts(provider) == 1
    assert _files_holding(path, api_key) == []
    monkeypatch.delenv("RECOVERABLE_TEST_CLIENT_KEY")
    with pytest.raises(errors.InvalidParameter) as caught:
        async with recoverable.open_client(path, **options(provider)):
            pass
    assert caught.value.parameter == "api_key_env"


def _files_holding(path: str, secret: str) -> list[Path | str]:
    """The store's files (LMDB) or tables (PostgreSQL: every row as text, bytea as hex)
    that hold ``secret``."""
    if not path.startswith("postgresql"):
        return [stored for stored in Path(path).rglob("*")
                if stored.is_file() and secret.encode() in stored.read_bytes()]
    import psycopg

    holding: list[Path | str] = []
    with psycopg.connect(path) as connection:
        tables = [row[0] for row in connection.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
        assert tables, "no tables: the check would prove nothing"
        for table in tables:
            query = (f'SELECT count(*) FROM "{table}" AS row WHERE position(%s in row::text) > 0'
                     " OR position(%s in row::text) > 0")
            found = connection.execute(query, (secret, secret.encode().hex())).fetchone()
            if found is not None and found[0]:
                holding.append(table)
    return holding


def _jobs(count: int) -> list[dict[str, Any]]:
    return [{"model": "gpt-test", "input": f"question {index}", "job_id": f"m{index}"}
            for index in range(count)]


async def test_map_yields_every_job_once_within_its_concurrency(path: str) -> None:
    # A slow provider: requests overlap, so the bound shows in its log.
    async with FixtureProvider.serve(reply_delay=0.05) as provider:
        async with recoverable.open_client(path, **options(provider)) as client:
            jobs = [*_jobs(9), _jobs(1)[0]]  # a repeated job key is yielded once
            results = [result async for result in client.map(jobs, text_format=Answer,
                                                               concurrency=3)]
            assert sorted(result.job_id for result in results) == [f"m{i}" for i in range(9)]
            assert all(result.ok and isinstance(result.value, Answer) for result in results)
            assert all(result.usage.total_tokens > 0 for result in results)
            assert not any(result.saved for result in results)
            assert 2 <= client.peak_running <= 3  # concurrent, and never more than 3
        assert posts(provider) == 9
        spans = [(request.received_at, request.finished_at or 0.0)
                 for request in provider.requests]
        overlap = max(sum(1 for start, end in spans if start <= moment < end)
                      for moment, _ in spans)
        assert overlap <= 3


async def test_a_rerun_of_map_yields_saved_results_with_zero_posts(
    provider: FixtureProvider, path: str
) -> None:
    provider.script([Reply.http_error(400, {"error": {"code": "bad"}})])
    async with recoverable.open_client(path, **options(provider)) as client:
        first = {result.job_id: result
                 async for result in client.map(_jobs(4), text_format=Answer, concurrency=1)}
        assert [job for job, result in first.items() if not result.ok] == ["m0"]
        assert isinstance(first["m0"].error, errors.ProviderError)
        with pytest.raises(errors.ProviderError):
            first["m0"].unwrap()
    assert posts(provider) == 4
    async with recoverable.open_client(path, **options(provider)) as client:
        second = {result.job_id: result
                  async for result in client.map(_jobs(7), text_format=Answer, concurrency=2)}
        assert sorted(second) == [f"m{i}" for i in range(7)]
        assert {job for job, result in second.items() if result.saved} == {"m1", "m2", "m3"}
        for job in ("m1", "m2", "m3"):
            assert second[job].value == first[job].value
            assert second[job].operation_id is not None
            assert job_posts(provider, second[job].operation_id) == 1
        assert isinstance(second["m0"].error, errors.PermanentlyFailed)  # its saved failure
        assert second["m0"].reason == first["m0"].reason == "provider_error:http_rejected"
    assert posts(provider) == 7  # the three new jobs only


async def test_leaving_map_early_suspends_the_rest_and_a_rerun_finishes_them(
    path: str
) -> None:
    async with FixtureProvider.serve(reply_delay=0.05) as provider:
        async with recoverable.open_client(path, **options(provider)) as client:
            seen: list[str] = []
            stream = client.map(_jobs(6), text_format=Answer, concurrency=2)
            async with contextlib.aclosing(stream):
                async for result in stream:
                    seen.append(result.job_id)
                    break
            assert client.running == 0  # every send stopped before the loop was left
            rerun = [result async for result in client.map(_jobs(6), text_format=Answer)]
        assert sorted(result.job_id for result in rerun) == [f"m{i}" for i in range(6)]
        assert all(result.ok for result in rerun)
        (saved,) = [result for result in rerun if result.job_id == seen[0]]
        assert saved.saved and saved.operation_id is not None
        assert job_posts(provider, saved.operation_id) == 1


async def test_map_progress_draws_the_cli_line(provider: FixtureProvider, path: str) -> None:
    out = io.StringIO()
    async with recoverable.open_client(path, **options(provider)) as client:
        results = [result async for result in client.map(_jobs(3), text_format=Answer,
                                                           progress=out)]
    assert len(results) == 3
    last = out.getvalue().splitlines()[-1]
    assert "done 3/3" in last and "failed 0" in last and "jobs/s" in last
    assert "question" not in out.getvalue()  # never a prompt or an output


async def test_a_bad_request_in_map_is_raised_where_it_is_iterated(
    provider: FixtureProvider, path: str
) -> None:
    async with recoverable.open_client(path, **options(provider)) as client:
        with pytest.raises(errors.InvalidRequest):
            async for _ in client.map([{"model": "gpt-test", "input": "x"}]):
                pass  # no text_format anywhere
        # The client is still usable.
        assert isinstance(await client.parse(**QUESTION, text_format=Answer), Answer)


async def test_closing_the_client_stops_a_running_map(path: str) -> None:
    async with FixtureProvider.serve(reply_delay=0.05) as provider:
        async with recoverable.open_client(path, **options(provider)) as client:
            stream = client.map(_jobs(4), text_format=Answer, concurrency=4)
            first = await stream.__anext__()
            assert first.ok
            await stream.aclose()
        async with recoverable.open_client(path, **options(provider)) as client:
            ok = [result async for result in client.map(_jobs(4), text_format=Answer)]
        assert len(ok) == 4 and all(result.ok for result in ok)


async def test_cancelling_the_consumer_of_a_map_waits_until_its_jobs_are_suspended(
    provider: FixtureProvider, path: str
) -> None:
    provider.script([Reply.stall(), Reply.stall()])  # both attempts hang until stopped
    async with recoverable.open_client(path, **options(provider)) as client:
        scope = trio.CancelScope()

        async def consume() -> None:
            with scope:
                async for _ in client.map(_jobs(2), text_format=Answer, concurrency=2):
                    pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            await provider.wait_for_requests(2)
            scope.cancel()
        assert client.running == 0
        phases = {client.store.get_operation(operation_id).phase  # type: ignore[union-attr]
                  for job in ("m0", "m1")
                  for operation_id in client.store.ids_by_job(client.account, "client", job)}
        assert phases == {"suspended"}
        rerun = [result async for result in client.map(_jobs(2), text_format=Answer)]
        assert all(result.ok for result in rerun) and posts(provider) == 4


async def test_parse_of_a_list_of_models_is_sent_wrapped_and_returned_as_the_list(
    provider: FixtureProvider, path: str
) -> None:
    answers = [{"answer": 42, "note": "a"}, {"answer": 6, "note": "b"}]
    provider.script([Reply.complete({"items": answers})])
    async with recoverable.open_client(path, **options(provider)) as client:
        value = await client.parse(**QUESTION, text_format=list[Answer], job_id="many")
        assert value == [Answer(answer=42, note="a"), Answer(answer=6, note="b")]
        assert await client.parse(**QUESTION, text_format=list[Answer], job_id="many") == value
    assert posts(provider) == 1
    sent = json.loads(provider.requests[0].body)["text"]["format"]["schema"]
    assert sent["required"] == ["items"] and sent["properties"]["items"]["type"] == "array"
