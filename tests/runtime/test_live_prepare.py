"""``prepare(..., live=True)`` fixes a live operation's policy (issue 16): an interruption
of a live operation is never replaced (``on_interruption="fail"``); asking for
``"replace"`` with ``live=True`` is a typed error and saves nothing; a manual retry's
successor is live too; a record written before ``live`` existed reads as not live."""

from __future__ import annotations

import msgspec
import pytest

import recoverable
from recoverable import errors
from recoverable.records import OperationRecord
from recoverable.storage import codec
from recoverable.testing import FixtureProvider, Reply

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, make_backend

pytestmark = pytest.mark.both_stores


async def test_live_fixes_the_fail_policy(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        live = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, live=True)
        explicit = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, live=True,
                                    on_interruption="fail")
        plain = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
        for handle in (live, explicit):
            record = store.get_operation(handle.operation_id)
            assert record is not None and record.live and record.on_interruption == "fail"
        record = store.get_operation(plain.operation_id)
        assert record is not None and not record.live and record.on_interruption == "replace"

        before = len((await rt.inventory()).operations)
        with pytest.raises(errors.InvalidRequest, match="live=True fixes"):
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, live=True,
                             on_interruption="replace")
        with pytest.raises(errors.InvalidParameter, match="cannot be combined") as refused:
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, live=True,
                             reattach=True)
        assert refused.value.parameter == "reattach"
        with pytest.raises(errors.InvalidRequest, match="live must be"):
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                             live="yes")  # type: ignore[arg-type]
        with pytest.raises(errors.InvalidRequest, match="on_interruption"):
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=2,
                             on_interruption="sometimes")  # type: ignore[arg-type]
        assert len((await rt.inventory()).operations) == before  # nothing saved


async def test_a_manual_retry_of_a_live_operation_is_live(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        provider.script([Reply.disconnect(after_events=5)])
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, live=True)
        with pytest.raises(errors.PermanentlyFailed):  # interrupted: never replaced
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
        child = await rt.retry(handle, retry_action_id="again", maximum_attempts=2)
        successor = store.get_operation(child.operation_id)
        assert successor is not None and successor.live
        assert successor.on_interruption == "fail"
        assert successor.previous_operation_id == handle.operation_id


def test_a_record_written_before_live_existed_reads_as_not_live() -> None:
    record = OperationRecord(
        operation_id="op_old", account=ACCOUNT, endpoint_id="fixture", created_at=1.0,
        maximum_attempts=1, model="gpt-test", format_name="Answer", format_hash="h",
        body_hash="b", root_operation_id="op_old",
    )
    fields = msgspec.structs.asdict(record)
    fields.pop("live")
    old = msgspec.msgpack.encode(fields)
    assert codec.decode_operation(old, operation_id="op_old").live is False
