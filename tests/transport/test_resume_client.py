"""Issue 15: ``transport/resume.py`` (``ResponsesBackend.reattachment``) against the real
fixture provider's background responses, and the resumed parser's rules without I/O.

A resumed stream skips the events at or below its cursor (never applied twice) and takes a
completion only from the final response's own output, never from partial deltas; the
retrieve, resume and cancel answers become typed outcomes (404 -> ``reattach_unavailable``,
a refused GET -> ``disconnected``); nothing raises for a provider or transport problem.
"""

from __future__ import annotations

from typing import Any

import attrs
import msgspec
import trio
from background_helpers import step_until
from transport_helpers import make_body

import recoverable
from recoverable.outcome import Completed, Interruption
from recoverable.testing import FixtureProvider, Reply, ResumeFault
from recoverable.transport.events import RESUMED_WITHOUT_OUTPUT, ResponseStream
from recoverable.transport.resume import POLL_FOR_AT_MOST, POLL_MOST, final_state

ANSWER = {"answer": 3, "label": "yes", "note": None, "items": []}
TEXT = msgspec.json.encode(ANSWER).decode()


def _backend(provider: FixtureProvider, mode: str = "sse") -> recoverable.ResponsesBackend:
    return recoverable.ResponsesBackend(
        provider.http_url, mode=mode,  # type: ignore[arg-type]
        credentials=recoverable.StaticCredentials("sk-resume-test"),
    )


def _background() -> bytes:
    return make_body(store=True, background=True)


async def _cut_response(provider: FixtureProvider, backend: recoverable.ResponsesBackend,
                        after_events: int = 4) -> Interruption:
    provider.script([attrs.evolve(Reply.complete(ANSWER), disconnect_after=after_events)])
    outcome = await backend.reattachment.stream(_background(), attempt_id="op_t.1", token="sk-t")
    assert isinstance(outcome, Interruption) and outcome.kind == "disconnected"
    assert outcome.response_id is not None
    return outcome


# --- without I/O: the resumed parser -------------------------------------------------------


def _event(seq: int, etype: str, **fields: Any) -> bytes:
    return msgspec.json.encode({"type": etype, "sequence_number": seq, **fields})


def test_a_resumed_stream_skips_what_was_already_applied_and_never_goes_back() -> None:
    stream = ResponseStream(max_events=100, resume_after=5, response_id="resp_r")
    assert stream.feed(_event(3, "response.output_text.delta", delta="old")) is None
    assert stream.sequence_number is None  # skipped: not applied, the cursor untouched
    assert stream.feed(_event(6, "response.output_text.delta", delta="x")) is None
    assert stream.sequence_number == 6 and stream.response_id == "resp_r"


def test_a_resumed_completion_without_output_is_not_assembled_from_deltas() -> None:
    stream = ResponseStream(max_events=100, resume_after=2, response_id="resp_r")
    stream.feed(_event(3, "response.output_text.delta", delta='{"answer"'))
    outcome = stream.feed(_event(4, "response.completed", response={"id": "resp_r"}))
    assert isinstance(outcome, Interruption) and outcome.kind == "malformed"
    assert outcome.transport_code == RESUMED_WITHOUT_OUTPUT


def test_the_default_stream_still_assembles_its_own_deltas() -> None:
    stream = ResponseStream(max_events=100)
    stream.feed(_event(0, "response.output_text.delta", delta="{}"))
    outcome = stream.feed(_event(1, "response.completed", response={"id": "resp_d"}))
    assert isinstance(outcome, Completed) and outcome.text == "{}"


def test_final_state_reads_each_status() -> None:
    output = [{"type": "message", "content": [{"type": "output_text", "text": TEXT}]}]
    done = final_state("r", {"id": "r", "status": "completed", "output": output}, 100)
    assert isinstance(done, Completed) and done.text == TEXT and done.response_id == "r"
    assert final_state("r", {"id": "r", "status": "in_progress"}, 100) is None
    assert final_state("r", {"id": "r", "status": "queued"}, 100) is None
    cancelled = final_state("r", {"id": "r", "status": "cancelled"}, 100)
    assert isinstance(cancelled, Interruption) and cancelled.kind == "reattach_unavailable"
    assert cancelled.provider_code == "cancelled"
    failed = final_state("r", {"id": "r", "status": "failed",
                               "error": {"code": "server_error"}}, 100)
    assert isinstance(failed, Interruption) and failed.kind == "provider_failed"
    assert failed.provider_code == "server_error"
    empty = final_state("r", {"id": "r", "status": "completed", "output": []}, 100)
    assert isinstance(empty, Interruption) and empty.transport_code == RESUMED_WITHOUT_OUTPUT
    odd = final_state("r", {"id": "r", "status": "thinking"}, 100)
    assert isinstance(odd, Interruption) and odd.kind == "malformed"


# --- against the fixture provider -----------------------------------------------------------


async def test_resume_after_the_cursor_completes_from_the_final_output() -> None:
    async with FixtureProvider.serve(deltas=(10, 10)) as provider:
        async with _backend(provider) as backend:
            cut = await _cut_response(provider, backend)
            assert cut.response_id is not None
            outcome = await backend.reattachment.resume(
                cut.response_id, after=cut.sequence_number, attempt_id="op_t.1", token="sk-t"
            )
    assert isinstance(outcome, Completed) and msgspec.json.decode(outcome.text) == ANSWER
    assert outcome.sequence_number is not None and cut.sequence_number is not None
    assert outcome.sequence_number > cut.sequence_number
    [resume] = provider.retrievals
    assert resume.kind == "resume" and resume.starting_after == cut.sequence_number


async def test_retrieve_reads_the_final_state_and_404_is_reattach_unavailable() -> None:
    async with FixtureProvider.serve(deltas=(10, 10)) as provider:
        async with _backend(provider) as backend:
            cut = await _cut_response(provider, backend)
            assert cut.response_id is not None
            client = backend.reattachment
            done = await client.retrieve(cut.response_id, attempt_id="op_t.1", token="sk-t")
            assert isinstance(done, Completed) and msgspec.json.decode(done.text) == ANSWER
            gone = await client.retrieve("resp_unknown", attempt_id="op_t.1", token="sk-t")
            assert isinstance(gone, Interruption) and gone.kind == "reattach_unavailable"
            assert gone.http_status == 404
            provider.script_resumes([ResumeFault.not_found()])
            missing = await client.resume(cut.response_id, after=2, attempt_id="op_t.1",
                                          token="sk-t")
            assert isinstance(missing, Interruption) and missing.kind == "reattach_unavailable"
            assert missing.transport_code == "response_gone"


async def test_a_dropped_resume_is_a_disconnect_with_the_later_cursor() -> None:
    async with FixtureProvider.serve(deltas=(10, 10)) as provider:
        async with _backend(provider) as backend:
            cut = await _cut_response(provider, backend, after_events=3)
            assert cut.response_id is not None and cut.sequence_number is not None
            provider.script_resumes([ResumeFault.disconnect(after_events=2)])
            dropped = await backend.reattachment.resume(
                cut.response_id, after=cut.sequence_number, attempt_id="op_t.1", token="sk-t"
            )
    assert isinstance(dropped, Interruption) and dropped.kind in ("disconnected",
                                                                    "premature_eof")
    assert dropped.response_id == cut.response_id
    assert dropped.sequence_number == cut.sequence_number + 2


async def test_cancel_answers_are_typed_and_never_raise() -> None:
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.05) as provider:
        async with _backend(provider) as backend:
            cut = await _cut_response(provider, backend, after_events=3)
            assert cut.response_id is not None
            client = backend.reattachment
            assert await client.cancel(cut.response_id, token="sk-t") == "cancelled"
            assert await client.cancel(cut.response_id, token="sk-t") == "cancelled"
            assert await client.cancel("resp_unknown", token="sk-t") == "gone"
    stored = provider.stored_response(cut.response_id)
    assert stored is not None and stored.status == "cancelled"


async def test_a_websocket_backend_streams_background_bodies_over_http() -> None:
    async with FixtureProvider.serve(deltas=(10, 10)) as provider:
        async with _backend(provider, "websocket") as backend:
            provider.script([Reply.complete(ANSWER)])
            outcome = await backend.reattachment.stream(_background(), attempt_id="op_w.1",
                                                        token="sk-t")
    assert isinstance(outcome, Completed)
    assert [request.transport for request in provider.requests] == ["sse"]


async def test_an_unreachable_provider_is_a_typed_interruption() -> None:
    backend = recoverable.ResponsesBackend(
        "http://127.0.0.1:9/v1", mode="sse",
        credentials=recoverable.StaticCredentials("sk-resume-test"),
    )
    with trio.fail_after(60):  # a guard, never a barrier: connect is refused at once
        outcome = await backend.reattachment.retrieve("resp_x", attempt_id="op.1", token="t")
        assert isinstance(outcome, Interruption) and outcome.kind == "disconnected"
        # Typed as a connect failure: the caller knows nothing was asked of the server.
        assert outcome.transport_code == "connect_refused"
        assert await backend.reattachment.cancel("resp_x", token="t") == "failed"
    await backend.aclose()


async def test_a_resume_answered_as_a_running_object_is_polled_for_a_bounded_time(
    mock_clock: trio.testing.MockClock,
) -> None:
    # A response that generates for hours (an event a minute), behind a server that answers
    # every resume GET with the response object: polled, spaced up to POLL_MOST seconds,
    # then given up as a timeout after POLL_FOR_AT_MOST (the caller's tries decide).
    results: list[Any] = []
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=60.0) as provider:
        async with _backend(provider) as backend, trio.open_nursery() as nursery:
            async def resume() -> None:
                cut = await _cut_response(provider, backend)
                assert cut.response_id is not None
                provider.resumes_as_objects = True
                results.append(await backend.reattachment.resume(
                    cut.response_id, after=cut.sequence_number, attempt_id="op_t.1",
                    token="sk-t"))

            nursery.start_soon(resume)
            await step_until(mock_clock, lambda: bool(results))
    [outcome] = results
    assert isinstance(outcome, Interruption) and outcome.kind == "timeout"
    assert outcome.transport_code == "poll_timeout"
    polls = [get for get in provider.retrievals if get.kind == "retrieve"]
    # 0.5 + 1 + 2 + 4 s, then one every POLL_MOST seconds, to the bound.
    assert POLL_FOR_AT_MOST / POLL_MOST - 5 <= len(polls) <= POLL_FOR_AT_MOST / POLL_MOST + 5
