"""Issue 15 with manual retry: an operation whose spent attempt can still be resumed by its
saved background response (``reattach=True``) can still run — resuming it costs no
budget — so manual retry refuses it ("resume it instead"), as for any operation that can
still run. Otherwise the host would hold two operations of one job that can each save a
receipt: the successor's new generation and the original's resumed one. Real LMDB store,
the fixture provider's background responses on 127.0.0.1."""

from __future__ import annotations

import pytest

import recoverable
from recoverable import errors

from .conftest import ACCOUNT
from .reattach_helpers import suspended_mid_stream


async def test_manual_retry_refuses_an_operation_whose_attempt_can_be_resumed(
    store: recoverable.RecoveryStore,
) -> None:
    async with suspended_mid_stream(store) as (_, rt, handle):
        suspended = await rt.status(handle)
        # Its one attempt is spent, but it can be resumed: not exhausted.
        assert suspended.attempts_remaining == 0
        assert suspended.availability == "suspended"
        assert "manual_retry" not in suspended.suggested_actions
        with pytest.raises(errors.RetryNotAllowed):
            await rt.retry(handle, retry_action_id="user-click", maximum_attempts=1)
        after = store.get_operation(handle.operation_id)
        assert after is not None and after.retry_reservation is None
        assert len(store.inventory(ACCOUNT)[0]) == 1  # no successor
