"""The batch host's acknowledgements (cli/acknowledger.py): jobs committed while a write
runs go in the next one; one write per group, not per job; a refusal is one warning
naming its job, and the rest are acknowledged."""

from __future__ import annotations

import trio

import recoverable
from recoverable.cli.acknowledger import Acknowledger
from recoverable.testing import FixtureProvider

from .conftest import ACCOUNT, REQUEST, Answer, completed_operations, make_backend


async def test_committed_jobs_are_acknowledged_in_groups_and_a_refusal_is_one_warning(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    said: list[str] = []
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        handles = await completed_operations(rt, 8)
        unsent = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        acks = Acknowledger(rt, said.append)
        for number, handle in enumerate(handles):
            acks.add(f"job-{number}", handle)
        acks.add("job-unsent", unsent)
        acks.close()
        with trio.fail_after(30):
            await acks.run()
    assert acks.writes == 1 and acks.acknowledged == 8
    assert said == ["warning: job 'job-unsent': acknowledge failed (completion_unavailable); "
                    "rerun to finish"]
    for handle in handles:
        disposition = store.get_disposition(handle.operation_id)
        assert disposition is not None and disposition.disposition == "acknowledged"
