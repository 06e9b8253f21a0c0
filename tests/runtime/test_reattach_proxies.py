"""Reattachment behind servers that bend the background contract (what the LiteLLM proxy
showed), in process against the real fixture provider over real sockets:

- a resume GET answered with the response object (``200 application/json``: ``stream``
  and ``starting_after`` dropped) is read as a retrieve: completed → the receipt with no
  POST; still running → polled to its end; failed → the honest ending of the table;
- a resume GET that cannot connect (the server restarting) spends no resume try: it waits
  on the endpoint's shared connect backoff and is sent again once the port answers;
- resume tries after a lost resume stream are spaced (0.5 s, then 1 s);
- a background POST whose response does not say ``background: true`` (the flag ignored)
  is saved as not resumable: no resume GET is spent on it, seed 000 replaces it.
"""

from __future__ import annotations

import itertools

import trio

import recoverable
from recoverable.reattachment import BACKGROUND_IGNORED
from recoverable.testing import FixtureProvider, Reply, ResumeFault

from .conftest import Answer, Authorizer
from .reattach_helpers import (
    EXPECTED,
    LONG,
    Events,
    cut,
    fixture_runtime,
    posts,
    prepare,
    resumes,
)


async def _send_through(
    store: recoverable.RecoveryStore, provider: FixtureProvider, events: Events | None = None,
    **options: object,
) -> tuple[recoverable.Handle, Answer, recoverable.Status]:
    async with fixture_runtime(store, provider, events) as rt:
        handle = await prepare(rt, **options)
        value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        return handle, value, await rt.status(handle)


async def test_a_resume_answered_with_the_finished_object_is_the_receipt_with_no_post(
    store: recoverable.RecoveryStore,
) -> None:
    # event_delay 0: the response is finished on the server when the stream drops.
    async with FixtureProvider.serve(deltas=(200, 200)) as provider:
        provider.script([cut(5)])
        provider.script_resumes([ResumeFault.as_object()])
        handle, value, status = await _send_through(store, provider)
    assert value == EXPECTED
    assert posts(provider, handle.operation_id) == 1  # read, not generated again
    gets = resumes(provider)
    assert [get.answer for get in gets] == ["object"]
    assert status.reattached and status.attempts_used == 1


async def test_a_resume_answered_with_a_running_object_is_polled_to_its_end(
    store: recoverable.RecoveryStore,
) -> None:
    # About 3 s of generation left when the stream drops: the object says in_progress,
    # then plain retrieves (0.5 s, 1 s apart) read it once it completed. (With 1 s left, a
    # loaded machine's slow resume could find it completed already: no poll to see.)
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.015) as provider:
        provider.script([cut(5)])
        provider.resumes_as_objects = True
        handle, value, status = await _send_through(store, provider)
    assert value == EXPECTED
    assert posts(provider, handle.operation_id) == 1
    assert [get.answer for get in resumes(provider)] == ["object"]
    polls = resumes(provider, "retrieve")
    assert polls and all(poll.answer == "object" for poll in polls)
    assert status.attempts[0].reattachments == 1  # one try, however many polls


async def test_a_resume_answered_with_a_failed_object_ends_as_the_table_says(
    store: recoverable.RecoveryStore,
) -> None:
    policy = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0,
                                     retryable_provider_codes=frozenset({"server_error"}))
    async with FixtureProvider.serve(deltas=(20, 20)) as provider:
        provider.script([Reply.failed("server_error", after_events=10, disconnect_after=4),
                         Reply.complete(LONG)])
        provider.resumes_as_objects = True
        handle, value, status = await _send_through(store, provider, retry_policy=policy)
    assert value == EXPECTED
    assert posts(provider, handle.operation_id) == 2  # the failure, then its replacement
    first = status.attempts[0]
    assert first.failure is not None and first.failure.kind == "provider_failed"
    assert first.failure.provider_code == "server_error"
    assert [get.answer for get in resumes(provider)] == ["object"]


async def test_a_restart_between_resume_gets_spends_no_try_and_regenerates_nothing(
    store: recoverable.RecoveryStore,
) -> None:
    events = Events()
    # About 2 s of generation: the restart lands while the response still generates.
    async with FixtureProvider.serve(deltas=(200, 200), event_delay=0.01) as provider:
        provider.script([Reply.complete(LONG)])
        async with fixture_runtime(store, provider, events) as rt:
            handle = await prepare(rt)
            async with trio.open_nursery() as nursery:
                outcome: list[Answer] = []

                async def send() -> None:
                    outcome.append(await rt.send_recovering(
                        handle, response=Answer, authorize=Authorizer()))

                nursery.start_soon(send)
                await events.wait_for("attempt.checkpointed")  # the response id is saved
                await provider.stop_listening()  # the stream drops; connects are refused
                # Two refused resume GETs (the endpoint's backoff between them), then back.
                await events.wait_for("endpoint.unavailable", 2)
                await provider.listen_again()
            status = await rt.status(handle)
    assert outcome == [EXPECTED]
    assert posts(provider, handle.operation_id) == 1  # nothing generated twice
    assert len(resumes(provider)) == 1  # the refused GETs never reached the server
    assert status.attempts[0].reattachments == 1  # and spent no try of the three
    assert status.reattached


async def test_resume_tries_after_a_lost_resume_stream_are_spaced(
    store: recoverable.RecoveryStore,
) -> None:
    async with FixtureProvider.serve(deltas=(50, 50), event_delay=0.02) as provider:
        provider.script([cut(3)])
        provider.script_resumes([ResumeFault.disconnect(after_events=1)] * 2)
        handle, value, status = await _send_through(store, provider)
    assert value == EXPECTED
    assert posts(provider, handle.operation_id) == 1  # the third try read it to its end
    gets = resumes(provider)
    assert len(gets) == 3 and status.attempts[0].reattachments == 3
    gaps = [
        later.received_at - (earlier.finished_at or earlier.received_at)
        for earlier, later in itertools.pairwise(gets)
    ]
    # ConnectBackoff's default: 0.5 s before the second try, 1 s before the third.
    assert gaps[0] >= 0.45 and gaps[1] >= 0.95, gaps


async def test_a_background_flag_the_server_ignored_is_never_resumed(
    store: recoverable.RecoveryStore,
) -> None:
    async with FixtureProvider.serve(deltas=(20, 20)) as provider:
        provider.ignore_background = True
        provider.script([Reply.disconnect(after_events=5), Reply.complete(LONG)])
        handle, value, status = await _send_through(store, provider)
    assert value == EXPECTED
    assert posts(provider, handle.operation_id) == 2  # seed 000: one replacement
    assert provider.retrievals == []  # no resume GET spent on a response nobody stored
    first = status.attempts[0]
    assert first.not_resumable == BACKGROUND_IGNORED
    assert first.response_id is not None and first.reattachments == 0
    assert first.failure is not None and first.failure.kind == "disconnected"
