"""A job is prepared once per revision, and deduplication does not end at acknowledge.

The probe: preparing or submitting the same (account, scope, job, revision) after its
result was acknowledged created a new operation and POSTed again. Now the job index keeps
naming an acknowledged operation while its marker is kept (until ``cleanup_disposed``), so
a duplicate delivery raises ``AlreadyAcknowledged`` with the original operation id; and
``prepare`` has the job idempotency ``submit`` has (the same handle again; another body is
``JobConflict``).
"""

from __future__ import annotations

import time

import pytest

import recoverable
from recoverable.testing import FixtureProvider

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests, make_backend

pytestmark = pytest.mark.both_stores  # the job index is the store's: both stores
OTHER_REQUEST = recoverable.StructuredRequest(model="gpt-test", input="another question")


async def test_prepare_is_idempotent_by_job_and_revision(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with make_backend(provider) as backend, recoverable.open_runtime(
        store, backend, account=ACCOUNT
    ) as rt:
        first = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                                 job_id="job-1", input_revision="r1")
        again = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                                 job_id="job-1", input_revision="r1")
        assert again == first
        with pytest.raises(recoverable.JobConflict) as conflict:
            await rt.prepare(OTHER_REQUEST, response=Answer, maximum_attempts=2,
                             job_id="job-1", input_revision="r1")
        assert conflict.value.operation_id == first.operation_id
        newer = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                                 job_id="job-1", input_revision="r2")
        assert newer.operation_id != first.operation_id
        unkeyed = [await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
                   for _ in range(2)]
        assert unkeyed[0] != unkeyed[1]  # without a job id, every prepare is new


async def test_an_acknowledged_job_is_never_prepared_or_submitted_again(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with make_backend(provider) as backend, recoverable.open_runtime(
        store, backend, account=ACCOUNT
    ) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                                  job_id="job-1", input_revision="r1")
        await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        await rt.acknowledge(handle)
        for again in (rt.prepare, rt.submit):
            with pytest.raises(recoverable.AlreadyAcknowledged) as done:
                await again(REQUEST, response=Answer, maximum_attempts=2,
                            job_id="job-1", input_revision="r1")
            assert done.value.operation_id == handle.operation_id
        assert len(generation_requests(provider, handle.operation_id)) == 1
        assert len(provider.requests) == 1  # nothing else was sent
        assert store.check_integrity() == []  # the kept index entry is a valid one
        # A new revision is a new job; an abandoned job may be prepared anew.
        newer = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                                 job_id="job-1", input_revision="r2")
        await rt.abandon(newer)
        anew = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                                job_id="job-1", input_revision="r2")
        assert anew.operation_id != newer.operation_id
        # The tombstone lasts as long as the marker: cleanup_disposed ends it.
        removed = store.cleanup_disposed(before=time.time() + 60, account=ACCOUNT)
        assert handle.operation_id in removed.removed
        assert store.check_integrity() == []
        fresh = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                                 job_id="job-1", input_revision="r1")
        assert fresh.operation_id != handle.operation_id
