"""Status shows who runs an operation: the live lease's owner and expiry, and the fence
(issue 14, w-lease). Pure: ``derive_status`` over a record and the lease row read."""

from __future__ import annotations

import datetime as dt

from recoverable import machine as m
from recoverable.records import LeaseRecord

from .test_machine import ALICE, T0, record, transmitting

BOB_VIEW = None  # a signed-out viewer sees a redacted status


def lease(**changes: object) -> LeaseRecord:
    fields: dict[str, object] = {
        "operation_id": "op", "owner_id": "a" * 32, "token": "t", "fence": 4,
        "acquired_at": T0, "expires_at": T0 + 30.0,
    }
    fields.update(changes)
    return LeaseRecord(**fields)  # type: ignore[arg-type]


def test_a_live_lease_shows_its_owner_expiry_and_the_fence() -> None:
    rec = transmitting(1, fence=4)
    s = m.derive_status(rec, now=T0, lease_live=True, viewer=ALICE, lease=lease())
    assert s.state == "running"
    assert s.lease_owner == "a" * 32
    assert s.lease_expires_at == dt.datetime.fromtimestamp(T0 + 30.0, tz=dt.UTC)
    assert s.fence == 4


def test_a_dead_or_absent_lease_shows_no_owner() -> None:
    rec = transmitting(1)
    dead = m.derive_status(rec, now=T0, lease_live=False, viewer=ALICE, lease=lease())
    assert dead.lease_owner is None and dead.lease_expires_at is None
    idle = m.derive_status(record(), now=T0, lease_live=False, viewer=ALICE)
    assert idle.lease_owner is None and idle.fence == 0
    forever = m.derive_status(rec, now=T0, lease_live=True, viewer=ALICE,
                              lease=lease(expires_at=None))
    assert forever.lease_owner == "a" * 32 and forever.lease_expires_at is None


def test_a_redacted_status_shows_no_lease() -> None:
    s = m.derive_status(transmitting(1), now=T0, lease_live=True, viewer=BOB_VIEW,
                        lease=lease())
    assert s.redacted and s.lease_owner is None and s.fence == 0


def test_the_cli_shows_owner_lease_expiry_and_fence() -> None:
    from recoverable.cli.formatting import format_inventory, format_status
    from recoverable.types import Inventory

    s = m.derive_status(transmitting(1, fence=3), now=T0, lease_live=True, viewer=ALICE,
                        lease=lease())
    text = format_status(s)
    assert f"owner             {'a' * 32}" in text
    expiry = dt.datetime.fromtimestamp(T0 + 30.0, tz=dt.UTC).isoformat()
    assert f"lease expires at  {expiry}" in text
    assert "fence             3" in text
    table = format_inventory(Inventory(operations=(s,), unreadable=()))
    assert table.splitlines()[0].split()[-1] == "OWNER" and "a" * 12 in table
    idle = format_status(m.derive_status(record(), now=T0, lease_live=False, viewer=ALICE))
    assert "owner" not in idle and "fence" not in idle
