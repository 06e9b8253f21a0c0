"""The fixture provider's background responses (issue 15, the server side of reattachment):
stored responses generated whether or not a client reads them, resumed by sequence number,
retrieved, cancelled, expired, and faulted on each of those paths. Real sockets throughout.
(The clients that talk to it: ``test_fixture_background_clients``.)"""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec
import pytest
import trio
import trio.testing
from background_helpers import (
    background_body,
    cancel,
    client,
    post,
    resume,
    retrieve,
    step_until,
)
from transport_helpers import make_body

from recoverable.errors import InvalidRequest
from recoverable.testing import FaultSpec, FixtureProvider, Reply, ResumeFault

__all__ = ["client"]  # the fixture, imported for its tests

# -- item 1: background responses ---------------------------------------------------------
async def test_background_needs_store(client: httpx.AsyncClient) -> None:
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.complete({"answer": 1})])
        status, [error], _ = await post(client, provider, background_body(store=False))
        assert status == 400
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["param"] == "store"
        assert [r.reply_kind for r in provider.requests] == ["bad_request"]
        assert len(provider.pending_script) == 1  # no reply used up, nothing stored
        assert provider.retrievals == []


async def test_store_left_out_defaults_to_true(client: httpx.AsyncClient) -> None:
    body = msgspec.json.decode(background_body())
    del body["store"]  # the API's default for store is true
    async with FixtureProvider.serve() as provider:
        status, events, _ = await post(client, provider, msgspec.json.encode(body))
        assert status == 200 and events[-1]["response"]["store"] is True
        assert (await retrieve(client, provider, events[0]["response"]["id"]))[0] == 200


async def test_background_post_streams_stores_and_resumes(client: httpx.AsyncClient) -> None:
    async with FixtureProvider.serve() as provider:
        status, events, clean = await post(client, provider, background_body())
        assert status == 200 and clean
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] == "response.completed"
        assert all(e["response"]["background"] is True for e in events if "response" in e)
        rid = events[0]["response"]["id"]
        # the final state, one GET
        status, obj = await retrieve(client, provider, rid)
        assert status == 200 and obj["status"] == "completed" and obj["id"] == rid
        assert obj["output"] == events[-1]["response"]["output"]
        assert obj["usage"] == events[-1]["response"]["usage"]
        # resumed after any sequence number: exactly the later events, the same bytes
        for after in (-1, 0, 4, len(events) - 2, len(events) - 1):
            status, rest, clean = await resume(client, provider, rid, after)
            assert status == 200 and clean
            assert rest == events[after + 1:]
        status, whole, _ = await resume(client, provider, rid, None)
        assert whole == events
        # one generation request; every GET recorded apart from it (its end is noted just
        # after its last byte: let the provider's handler get there)
        await trio.testing.wait_all_tasks_blocked()
        assert len(provider.requests) == 1 and provider.requests[0].reply_kind == "synthesize"
        log = provider.retrievals
        assert [(r.kind, r.starting_after, r.answer) for r in log] == [
            ("retrieve", None, "object"), ("resume", -1, "stream"), ("resume", 0, "stream"),
            ("resume", 4, "stream"), ("resume", len(events) - 2, "stream"),
            ("resume", len(events) - 1, "stream"), ("resume", None, "stream")]
        assert [r.events_sent for r in log[1:]] == [len(events), len(events) - 1,
                                                   len(events) - 5, 1, 0, len(events)]
        assert all(r.finished_at is not None and r.response_id == rid for r in log)
        assert log[0].headers["authorization"] != "Bearer k"  # a fingerprint, not the key
        await client.get(f"{provider.http_url}/responses/{rid}",
                         headers={"x-client-request-id": "op.1"})
        assert provider.retrievals[-1].attempt_id == "op.1" and log[0].attempt_id is None


async def test_plain_post_is_not_stored(client: httpx.AsyncClient) -> None:
    async with FixtureProvider.serve() as provider:
        status, events, _ = await post(client, provider, make_body(store=True))
        assert status == 200
        rid = events[0]["response"]["id"]
        assert events[0]["response"]["background"] is False
        status, obj = await retrieve(client, provider, rid)
        assert status == 404 and obj["error"]["type"] == "invalid_request_error"
        assert obj["error"]["code"] is None and rid in obj["error"]["message"]


async def test_disconnect_leaves_the_response_generating(
    client: httpx.AsyncClient, mock_clock: trio.testing.MockClock,
) -> None:
    async with FixtureProvider.serve(event_delay=1.0, deltas=(20, 20)) as provider:
        provider.script([Reply.disconnect(after_events=3)])
        cut = trio.Event()
        posted: list[Any] = []

        async def do_post() -> None:
            posted.append(await post(client, provider, background_body()))
            cut.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(do_post)
            await step_until(mock_clock, cut.is_set)
        status, events, clean = posted[0]
        assert status == 200 and not clean
        assert [e["sequence_number"] for e in events] == [0, 1, 2]
        rid = events[0]["response"]["id"]
        stored = provider.stored_response(rid)
        assert stored is not None and stored.status == "in_progress"
        assert 3 <= stored.produced < len(stored.events)
        status, obj = await retrieve(client, provider, rid)
        assert status == 200 and obj["status"] == "in_progress" and obj["output"] == []
        # a resume while it still generates: the rest, live, to the terminal event
        resumed: list[Any] = []

        async def do_resume() -> None:
            resumed.append(await resume(client, provider, rid, 2))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(do_resume)
            await step_until(mock_clock, lambda: bool(resumed))
        status, rest, clean = resumed[0]
        assert status == 200 and clean
        assert [e["sequence_number"] for e in events + rest] == list(range(len(stored.events)))
        assert rest[-1]["type"] == "response.completed" and events + rest == stored.events
        assert len(provider.requests) == 1  # no second generation


async def test_cancel_stops_the_generation(
    client: httpx.AsyncClient, mock_clock: trio.testing.MockClock,
) -> None:
    async with FixtureProvider.serve(event_delay=1.0, deltas=(20, 20)) as provider:
        provider.script([Reply.disconnect(after_events=2), Reply.synthesize()])
        done: list[Any] = []

        async def do_post() -> None:
            done.append(await post(client, provider, background_body()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(do_post)
            await step_until(mock_clock, lambda: bool(done))
        rid = done[0][1][0]["response"]["id"]
        stored = provider.stored_response(rid)
        assert stored is not None and not stored.finished
        status, obj = await cancel(client, provider, rid)
        assert status == 200 and obj["status"] == "cancelled" and obj["id"] == rid
        produced = stored.produced
        mock_clock.jump(100.0)
        await trio.testing.wait_all_tasks_blocked()
        assert stored.produced == produced  # the generation stopped
        # idempotent; the resume ends after what was generated, no terminal event
        assert (await cancel(client, provider, rid))[1]["status"] == "cancelled"
        status, rest, clean = await resume(client, provider, rid, 1)
        assert status == 200 and clean and rest == stored.events[2:produced]
        assert (await retrieve(client, provider, rid))[1]["status"] == "cancelled"
        # a finished response stays as it is; an unknown one is a 404
        provider.event_delay = 0.0  # generated at once from now on
        finished = await post(client, provider, background_body())
        other = finished[1][0]["response"]["id"]
        await provider.wait_generated(other)
        assert (await cancel(client, provider, other))[1]["status"] == "completed"
        status, error = await cancel(client, provider, "resp_unknown")
        assert status == 404 and error["error"]["type"] == "invalid_request_error"
        assert [(r.kind, r.answer) for r in provider.retrievals if r.kind == "cancel"] == [
            ("cancel", "object"), ("cancel", "object"), ("cancel", "object"),
            ("cancel", "not_found")]


async def test_expiry_after_the_ttl_and_at_once(
    client: httpx.AsyncClient, mock_clock: trio.testing.MockClock,
) -> None:
    async with FixtureProvider.serve(background_ttl=10.0) as provider:
        first = (await post(client, provider, background_body()))[1][0]["response"]["id"]
        assert (await retrieve(client, provider, first))[0] == 200
        mock_clock.jump(10.0)
        status, error = await retrieve(client, provider, first)
        assert status == 404 and first in error["error"]["message"]
        assert (await resume(client, provider, first, 0))[0] == 404
        second = (await post(client, provider, background_body()))[1][0]["response"]["id"]
        assert provider.expire(second) == 1 and provider.expire(second) == 0
        assert (await resume(client, provider, second, 0))[0] == 404
        assert [r.answer for r in provider.retrievals] == [
            "object", "not_found", "not_found", "not_found"]


def test_background_knobs_are_checked() -> None:
    for bad in ({"event_delay": -1.0}, {"event_delay": 61.0}, {"background_ttl": 0.0}):
        with pytest.raises(InvalidRequest):
            FixtureProvider(**bad)
    with pytest.raises(InvalidRequest):
        FixtureProvider().script_resumes([Reply.synthesize()])  # type: ignore[list-item]
    assert FaultSpec.parse("retrieve_404=0.5,expired=0.5").rates  # sums apart from POSTs
    with pytest.raises(InvalidRequest, match="retrieval faults"):
        FaultSpec.parse("retrieve_404=0.6,resume_disconnect=0.6")
    with pytest.raises(InvalidRequest):
        ResumeFault.from_spec({"kind": "not_found", "after_events": 2})
    with pytest.raises(InvalidRequest):
        ResumeFault.from_spec({"kind": "gone"})
    assert ResumeFault.from_spec(ResumeFault.disconnect(4).to_spec()) == ResumeFault.disconnect(4)


# -- item 3: faults -------------------------------------------------------------------------
async def test_scripted_resume_faults(client: httpx.AsyncClient) -> None:
    async with FixtureProvider.serve(deltas=(12, 12)) as provider:
        events = (await post(client, provider, background_body()))[1]
        rid = events[0]["response"]["id"]
        provider.script_resumes([
            ResumeFault.not_found(), ResumeFault.disconnect(after_events=2),
            ResumeFault.disconnect(after_events=50), ResumeFault.disconnect(),
            ResumeFault.expired(),
        ])
        # a GET of an unknown id is a 404 and uses no scripted fault
        assert (await resume(client, provider, "resp_unknown", 0))[0] == 404
        assert provider.retrievals.pop().answer == "not_found"
        # a 404 for this GET only: the response is still there for the next one
        status, [error], _ = await resume(client, provider, rid, 3)
        assert status == 404 and error["error"]["type"] == "invalid_request_error"
        # a resume cut after two events; a cut never lets the terminal event through
        status, cut, clean = await resume(client, provider, rid, 3)
        assert status == 200 and not clean and cut == events[4:6]
        status, cut, clean = await resume(client, provider, rid, 3)
        assert not clean and cut == events[4:-1]
        # a plain retrieve dropped before its answer
        with pytest.raises(httpx.RemoteProtocolError):
            await retrieve(client, provider, rid)
        # expired now: this GET and every later one
        assert (await resume(client, provider, rid, 3))[0] == 404
        assert (await retrieve(client, provider, rid))[0] == 404
        assert provider.stored_response(rid) is None
        assert [(r.kind, r.answer, r.events_sent) for r in provider.retrievals] == [
            ("resume", "not_found", 0), ("resume", "disconnect", 2),
            ("resume", "disconnect", len(events) - 5), ("retrieve", "disconnect", 0),
            ("resume", "expired", 0), ("retrieve", "not_found", 0)]


async def test_resume_stall_goes_silent(
    client: httpx.AsyncClient, autojump_clock: trio.testing.MockClock,
) -> None:
    async with FixtureProvider.serve() as provider:
        events = (await post(client, provider, background_body()))[1]
        rid = events[0]["response"]["id"]
        provider.script_resumes([ResumeFault.stall(after_events=1)])
        got: list[dict[str, Any]] = []
        url = f"{provider.http_url}/responses/{rid}"
        async with client.stream("GET", url, params={"stream": "true",
                                                     "starting_after": 0}) as response:
            with trio.move_on_after(3600.0) as waited:  # mock time: silence, not a sleep
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        got.append(json.loads(line[6:]))
        assert waited.cancelled_caught and got == events[1:2]
        assert provider.retrievals[0].answer == "stall"


async def test_drawn_resume_faults_and_unchanged_generation_draws(
    client: httpx.AsyncClient,
) -> None:
    plain, both = FaultSpec.parse("disconnect=0.3,seed=5"), FaultSpec.parse(
        "disconnect=0.3,retrieve_404=0.5,resume_disconnect=0.5,seed=5")
    rng_plain, rng_both = plain.chooser(), both.chooser()
    assert [plain.pick(rng_plain) for _ in range(50)] == [both.pick(rng_both) for _ in range(50)]
    assert plain.pick_resume(plain.resume_chooser()) is None
    async with FixtureProvider.serve(faults=FaultSpec.parse("retrieve_404=1.0")) as provider:
        rid = (await post(client, provider, background_body()))[1][0]["response"]["id"]
        assert provider.requests[0].reply_kind == "synthesize"  # POSTs draw no GET fault
        assert (await retrieve(client, provider, rid))[0] == 404
        assert (await resume(client, provider, rid, 0))[0] == 404
        assert [r.answer for r in provider.retrievals] == ["not_found", "not_found"]
    spec = FaultSpec.parse("resume_disconnect=1.0,seed=1")
    async with FixtureProvider.serve(faults=spec) as provider:
        events = (await post(client, provider, background_body()))[1]
        status, cut, clean = await resume(client, provider, events[0]["response"]["id"], 0)
        assert status == 200 and not clean and cut == events[1:3]


async def test_disconnect_fault_on_a_background_post_keeps_generating(
    client: httpx.AsyncClient,
) -> None:
    async with FixtureProvider.serve(faults=FaultSpec.parse("disconnect=1.0")) as provider:
        status, events, clean = await post(client, provider, background_body())
        assert status == 200 and not clean and len(events) == 3
        rid = events[0]["response"]["id"]
        assert provider.requests[0].reply_kind == "disconnect"
        status, rest, clean = await resume(client, provider, rid, 2)
        assert clean and rest[-1]["type"] == "response.completed"
        assert [e["sequence_number"] for e in events + rest] == list(range(len(events + rest)))
        assert (await retrieve(client, provider, rid))[1]["status"] == "completed"


@pytest.mark.parametrize("how", ["script", "faults"])
async def test_a_response_that_fails_on_the_server(client: httpx.AsyncClient, how: str) -> None:
    faults = FaultSpec.parse("failed_in_background=1.0") if how == "faults" else None
    async with FixtureProvider.serve(faults=faults) as provider:
        if how == "script":
            provider.script([Reply.failed("server_error", after_events=6, disconnect_after=3)])
        status, events, clean = await post(client, provider, background_body())
        assert status == 200 and not clean and len(events) == 3
        rid = events[0]["response"]["id"]
        status, rest, clean = await resume(client, provider, rid, 2)
        assert clean and [e["sequence_number"] for e in rest] == [3, 4, 5, 6]
        assert any(e["type"] == "response.output_text.delta" for e in rest)
        failed = rest[-1]
        assert failed["type"] == "response.failed"
        assert failed["response"]["error"]["code"] == "server_error"
        status, obj = await retrieve(client, provider, rid)
        assert obj["status"] == "failed" and obj["error"]["code"] == "server_error"
        assert obj["output"] == []  # nothing made up from the partial text
        # the same reply on a plain stream is cut where it says
        status, plain, clean = await post(client, provider, make_body())
        if how == "script":
            assert plain[-1]["type"] == "response.completed"  # the script is used up
        else:
            assert not clean and len(plain) == 3


async def test_error_event_ends_a_background_response_failed(client: httpx.AsyncClient) -> None:
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.error_event("server_error", "server_error", after_events=2)])
        events = (await post(client, provider, background_body()))[1]
        assert events[-1]["type"] == "error"
        obj = (await retrieve(client, provider, events[0]["response"]["id"]))[1]
        assert obj["status"] == "failed" and obj["error"]["code"] == "server_error"


async def test_bad_starting_after_is_a_400(client: httpx.AsyncClient) -> None:
    async with FixtureProvider.serve() as provider:
        rid = (await post(client, provider, background_body()))[1][0]["response"]["id"]
        for bad in ("x", "-2"):
            answer = await client.get(f"{provider.http_url}/responses/{rid}",
                                      params={"stream": "true", "starting_after": bad})
            assert answer.status_code == 400
            assert answer.json()["error"]["param"] == "starting_after"
        assert [r.answer for r in provider.retrievals] == ["bad_request", "bad_request"]
        # a GET on a path that is no response, and a cancel by GET, are plain 404s
        assert (await client.get(f"{provider.http_url}/responses/{rid}/x")).status_code == 404
        assert (await client.get(f"{provider.http_url}/responses/{rid}/cancel")).status_code == 404


async def test_expiry_cuts_a_live_resume(
    client: httpx.AsyncClient, mock_clock: trio.testing.MockClock,
) -> None:
    async with FixtureProvider.serve(event_delay=1.0, deltas=(20, 20)) as provider:
        provider.script([Reply.disconnect(after_events=1)])
        posted: list[Any] = []

        async def do_post() -> None:
            posted.append(await post(client, provider, background_body()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(do_post)
            await step_until(mock_clock, lambda: bool(posted))
        rid = posted[0][1][0]["response"]["id"]
        resumed: list[Any] = []

        async def do_resume() -> None:
            resumed.append(await resume(client, provider, rid, 0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(do_resume)
            await provider.wait_for_retrievals(1)
            await trio.testing.wait_all_tasks_blocked()
            assert provider.expire() == 1
        status, _rest, clean = resumed[0]
        assert status == 200 and not clean
        assert provider.retrievals[0].finished_at is not None


@pytest.mark.parametrize("reply", [Reply.stall(after_events=2), Reply.lenient(),
                                   Reply.keepalive(pause=5.0, every=1.0, after_events=2)])
async def test_other_connection_faults_on_a_background_post(
    client: httpx.AsyncClient, autojump_clock: trio.testing.MockClock, reply: Reply,
) -> None:
    async with FixtureProvider.serve() as provider:
        provider.script([reply])
        url = provider.http_url + "/responses"
        got: list[dict[str, Any]] = []
        lines: list[str] = []
        async with client.stream("POST", url, content=background_body()) as response:
            with trio.move_on_after(600.0):  # mock time (under the TTL): a stall is silence
                async for line in response.aiter_lines():
                    lines.append(line)
                    if line.startswith("data: {"):
                        got.append(json.loads(line[6:]))
        stored = provider.stored_response(got[0]["response"]["id"])
        assert stored is not None and stored.status == "completed"  # generated regardless
        if reply.kind == "stall":
            assert len(got) == 2
        else:
            assert [e["sequence_number"] for e in got] == list(range(len(stored.events)))
        if reply.kind == "lenient":
            assert lines[-2:] == ["data: [DONE]", ""] and "x_trace" in got[0]
        if reply.kind == "keepalive":
            assert lines.count(": ping") >= 4



async def test_at_most_so_many_stored_the_oldest_forgotten(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from recoverable.fixture import background as fixture_background

    monkeypatch.setattr(fixture_background, "MAX_STORED_RESPONSES", 2)
    async with FixtureProvider.serve() as provider:
        ids = [(await post(client, provider, background_body()))[1][0]["response"]["id"]
               for _ in range(3)]
        assert [provider.stored_response(rid) is not None for rid in ids] == [False, True, True]
        assert (await retrieve(client, provider, ids[0]))[0] == 404
