"""Adding a store is one engine module: a third engine, registered for its own URL scheme,
runs a durable operation end to end through ``RecoveryStore`` and the runtime.

The engine here keeps its rows in an LMDB engine it owns, but it is reached only through
the members of ``storage.engine.StoreEngine`` (no ``__getattr__``, no private attribute
of the LMDB engine): if ``RecoveryStore`` or an actor needed anything of an engine beyond
the seam, this test would fail with an ``AttributeError``. It also counts the calls, so
the test shows which members the durable path uses.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import recoverable
from recoverable.records import CommandRecord, LeaseRecord
from recoverable.storage.base import Table, Touches
from recoverable.storage.engine import StoreEngine
from recoverable.storage.lmdb_engine import LmdbEngine
from recoverable.storage.queue import QueueEntry
from recoverable.storage.registry import StoreOptions
from recoverable.storage.store import register_url_store, registered_schemes
from recoverable.storage.txn import WriteTxn
from recoverable.testing import FixtureProvider
from recoverable.types import AccountBinding

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, make_backend

SCHEME = "third-engine"
Result = TypeVar("Result")


class ThirdEngine:
    """A ``StoreEngine`` for ``third-engine:///a/directory`` URLs."""

    calls: collections.Counter[str] = collections.Counter()  # every instance's, by member

    def __init__(self, url: str, options: StoreOptions) -> None:
        directory = url.split("://", 1)[1]
        os.makedirs(directory, exist_ok=True)
        self._rows: StoreEngine = LmdbEngine(os.path.realpath(directory), options)
        self.path = url
        self.max_bytes = options.max_bytes
        self.max_record_bytes = options.max_record_bytes
        self.tables = self._rows.tables
        self.advisory_read_seconds = 0.0
        self.read_threads = 0

    def _count(self, name: str) -> StoreEngine:
        self.calls[name] += 1
        return self._rows

    @property
    def owner_id(self) -> str:
        return self._rows.owner_id

    @property
    def closed(self) -> bool:
        return self._rows.closed

    def read(self, fn: Callable[[Any], Result]) -> Result:
        return self._count("read").read(fn)

    def get(self, table: Table, key: bytes) -> bytes | None:
        return self._count("get").get(table, key)

    def get_raw_many(self, table: Table, keys: list[bytes]) -> list[bytes | None]:
        return self._count("get_raw_many").get_raw_many(table, keys)

    def get_raw_rows(self, wanted: list[tuple[Table, bytes]]) -> list[bytes | None]:
        return self._count("get_raw_rows").get_raw_rows(wanted)

    def ids_by_job(
        self, account: AccountBinding, scope: str | None, job_id: str | None
    ) -> list[str]:
        return self._count("ids_by_job").ids_by_job(account, scope, job_id)

    def queued(self, *, after_serial: int, limit: int) -> list[QueueEntry]:
        return self._count("queued").queued(after_serial=after_serial, limit=limit)

    def commands_snapshot(self, *, after_serial: int) -> tuple[int, list[CommandRecord]]:
        return self._count("commands_snapshot").commands_snapshot(after_serial=after_serial)

    def reserve_claims(self, operation_ids: list[str], limit: int) -> list[str]:
        return self._count("reserve_claims").reserve_claims(operation_ids, limit)

    def last_txnid(self) -> int:
        return self._count("last_txnid").last_txnid()

    async def write(self, fn: Callable[[WriteTxn], Result], touches: Touches) -> Result:
        return await self._count("write").write(fn, touches)

    def write_sync(self, fn: Callable[[WriteTxn], Result]) -> Result:
        return self._count("write_sync").write_sync(fn)

    def lease_is_live(self, lease: LeaseRecord, now: float | None) -> bool:
        return self._count("lease_is_live").lease_is_live(lease, now)

    def owner_is_live(self, owner_id: str) -> bool:
        return self._count("owner_is_live").owner_is_live(owner_id)

    def other_live_owners(self) -> list[str]:
        return self._count("other_live_owners").other_live_owners()

    def writer_stats(self) -> dict[str, int]:
        return self._count("writer_stats").writer_stats()

    def close(self) -> None:
        self._count("close").close()


register_url_store([SCHEME], ThirdEngine)


async def test_a_third_engine_registered_for_its_scheme_runs_a_durable_operation(
    tmp_path: Path, provider: FixtureProvider
) -> None:
    assert SCHEME in registered_schemes()
    ThirdEngine.calls.clear()
    url = f"{SCHEME}://{tmp_path / 'rows'}"
    store = recoverable.RecoveryStore.open(url)
    try:
        assert isinstance(store.engine, ThirdEngine)
        assert recoverable.RecoveryStore.open(url) is store  # opened once per process
        store.close()  # the second reference
        async with recoverable.open_runtime(
            store, make_backend(provider), account=ACCOUNT
        ) as rt:
            handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2, job_id="j")
            value = await rt.send_recovering(handle, response=Answer, authorize=Authorizer())
            assert isinstance(value, Answer)
            status = await rt.status(handle)
            assert status.state == "completed" and status.attempts_used == 1
        assert store.ids_by_job(ACCOUNT, None, "j") == [handle.operation_id]
        records, unreadable = store.inventory()
        assert [r.operation_id for r in records] == [handle.operation_id] and unreadable == []
        assert store.check_integrity() == []
        assert store.stats()["commits"] >= 3
    finally:
        store.close()
    assert store.closed
    # The durable path went through the seam: writes, reads, the change feed, leases.
    used = ThirdEngine.calls
    assert used["write"] >= 3 and used["get"] > 0 and used["read"] > 0
    assert used["last_txnid"] + used["commands_snapshot"] > 0  # the lifecycle monitor
    assert used["close"] == 1  # once, by the last reference
    # Its rows are LMDB's bytes: the same directory opens as an LMDB store.
    with recoverable.RecoveryStore.open(tmp_path / "rows") as lmdb_store:
        record = lmdb_store.get_operation(handle.operation_id)
        assert record is not None and record.phase == "completed"
