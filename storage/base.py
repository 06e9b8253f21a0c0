"""The storage contract: what the actors need from a recovery store.

Three ``typing.Protocol`` classes name every read, write and query the actors make
(directly, or through the storage functions they call: ``leases.acquire_lease`` /
``release_lease``, ``migration.saved_completion`` / ``upgrade_operation``,
``retention.remove_content``). The LMDB store (``RecoveryStore`` and its ``WriteTxn``)
implements them; a second store (PostgreSQL) implements the same three and the actors
run on it unchanged. The actors import these names only, never the LMDB classes.

- :class:`RecordReader`: the reads a store and a write transaction share. Inside a
  transaction they see the transaction's own earlier writes. A missing row is ``None``;
  a row that no longer decodes raises its typed error (``CorruptRecord`` /
  ``UnsupportedRecordVersion``), never guessed about.
- :class:`WriteTransaction`: one mutation's view. Writes are all or nothing per mutation
  (a mutation that raises changes nothing); every write counts against the store's
  quotas (``StorageLimitExceeded``, nothing evicted); a write over an unreadable row is
  refused. ``put_operation(..., expect_fence=)`` is the fence of the lease protocol.
- :class:`Store`: an opened store. ``write(fn)`` runs ``fn`` in a transaction and returns
  its result once durable (``fn`` may run more than once: no side effects outside the
  transaction, except through ``on_abort``-style hooks of the implementation).

Protocols add no runtime cost: a call goes straight to the implementation's method.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Final, Literal, Protocol, TypeVar, get_args

from recoverable.records import (
    CommandKind,
    CommandRecord,
    DispositionRecord,
    LeaseRecord,
    OperationRecord,
    PayloadKind,
)
from recoverable.types import AccountBinding

if TYPE_CHECKING:
    from recoverable.storage.queue import QueueEntry, ServedRow, WorkerRow

__all__ = ["TABLES", "RecordReader", "Store", "Table", "Touches", "WriteTransaction"]

Result = TypeVar("Result")
Touches = Iterable[str | OperationRecord]  # see Store.write

# The named tables of a store. ``get_raw``/``put_raw`` reach the rows that are not typed
# records (the governor's advisory rows, a version-1 operation's bytes). ``schedule`` is
# retired (nothing writes it; an older store's rows are dropped at open).
Table = Literal[
    "operations", "payloads", "commands", "leases", "schedule", "hosts", "dispositions",
    "governor", "meta", "queue", "sources",
]
TABLES: Final[tuple[Table, ...]] = get_args(Table)


class RecordReader(Protocol):
    """Reads by operation id (or raw key), shared by a store and a write transaction."""

    def get_operation(self, operation_id: str) -> OperationRecord | None: ...

    def get_payload(self, operation_id: str, kind: PayloadKind) -> bytes | None: ...

    def get_command(self, operation_id: str) -> CommandRecord | None: ...

    def get_lease(self, operation_id: str) -> LeaseRecord | None: ...

    def get_disposition(self, operation_id: str) -> DispositionRecord | None: ...

    def get_raw(self, table: Table, key: bytes) -> bytes | None: ...

    def get_source(self, key: str) -> str | None:
        """The source manifest's current digest of ``key``; None: no such source."""
        ...

    def lease_is_live(self, lease: LeaseRecord, now: float | None = None) -> bool:
        """Not expired at ``now`` (wall-clock seconds; None: ``time.time()``, the clock every
        process shares — a runtime on an injected clock passes its own ``now``), and held
        by an active acquisition of this store's owner or by a living other owner."""
        ...


class WriteTransaction(RecordReader, Protocol):
    """One mutation's typed writes (see the module docstring for the guarantees)."""

    @property
    def owner_id(self) -> str:
        """This store opener's owner id (the one a lease taken here names)."""
        ...

    def put_operation(
        self, record: OperationRecord, *, expect_fence: int | None = None
    ) -> None: ...

    def delete_operation(self, operation_id: str, *, expect_fence: int | None = None) -> bool: ...

    def put_payload(self, operation_id: str, kind: PayloadKind, data: bytes) -> None: ...

    def delete_payload(self, operation_id: str, kind: PayloadKind) -> bool: ...

    def put_command(self, operation_id: str, kind: CommandKind, now: float) -> CommandRecord:
        """Write a command with the next store-wide serial; the command that stands follows
        ``machine.merge_command`` (a stored cancel is returned unchanged)."""
        ...

    def delete_command(self, operation_id: str) -> bool: ...

    def put_lease(self, lease: LeaseRecord) -> None: ...

    def delete_lease(self, operation_id: str, *, unreadable: bool = False) -> bool:
        """Remove the lease row; ``unreadable``: also one that does not decode."""
        ...

    def register_token(self, token: str) -> None:
        """Mark a lease token of this owner active (forgotten if the mutation is discarded)."""
        ...

    def unregister_token(self, token: str) -> None: ...

    def put_disposition(self, record: DispositionRecord) -> None: ...

    def put_raw(self, table: Table, key: bytes, value: bytes) -> None: ...

    # -- the source manifest (storage/sources.py) --
    # ``put_operation`` of a NEW record with ``source`` also indexes it under its source
    # key, and ``delete_operation`` removes that index entry; the rules that run on a
    # manifest change are ``storage.sources.change_source`` (over these four methods).

    def put_source(self, key: str, digest: str) -> None:
        """Set the manifest's current digest of ``key``."""
        ...

    def delete_source(self, key: str) -> bool:
        """Remove ``key`` from the manifest (False: it was not there)."""
        ...

    def source_bound(self, key: str) -> list[str]:
        """The ids of operations indexed under source ``key`` (this transaction's view)."""
        ...

    def unbind_source(self, key: str, operation_id: str) -> bool:
        """Drop one index entry (a superseded operation leaves the index)."""
        ...

    def put_preference(self, name: str, value: bytes) -> None:
        """Save the store-wide preference ``name`` (``storage/preferences.py``);
        read back with ``get_raw("meta", b"preference." + name)``. Small, not counted
        against the quotas."""
        ...

    def operation_ids_by_job(
        self, account: AccountBinding, scope: str | None, job_id: str | None
    ) -> list[str]:
        """Operation ids with exactly this account, scope and job id (this transaction's
        view, its own writes included)."""
        ...

    def index_disposed(self, marker: DispositionRecord) -> None:
        """Keep the job index entry of a disposed operation while its marker is kept
        (``AlreadyAcknowledged`` finds it); removed with the marker."""
        ...

    def remove_unreadable_operation(self, operation_id: str, account: AccountBinding) -> bool:
        """Remove a record that no longer decodes and the index entries naming it, when
        ``account``'s job index names it (False, nothing changed, when it does not): the
        operator's abandon of a damaged record, whose own account cannot be read."""
        ...

    def enqueue(self, operation_id: str, *, resume: bool | None = None) -> int:
        """Queue the operation for workers (``storage/queue.py``); an operation already
        queued keeps its serial. ``resume`` sets its resume flag (a stopping worker's mark:
        the next worker resumes it); ``None`` keeps the flag it has (False for a new row):
        submitting a job again must not strand what a stopped worker marked. Returns the
        serial."""
        ...

    def spend_resume_mark(self, operation_id: str) -> bool:
        """An execution opens the operation: clear a stopped worker's resume mark (True if
        there was one); an operation that is not queued stays unqueued."""
        ...

    def dequeue(self, operation_id: str) -> bool: ...

    def register_worker(self, token: str, row: WorkerRow) -> None: ...

    def unregister_worker(self, owner_id: str, token: str) -> bool: ...

    def mark_served(self, row: ServedRow) -> None:
        """Its account and endpoint were served until ``row.until`` (``storage/queue.py``;
        never moved back)."""
        ...


class Store(RecordReader, Protocol):
    """An opened recovery store: durable writes, and the queries of the runtime's monitor
    and inventory."""

    async def write(
        self, fn: Callable[[WriteTransaction], Result], *, touches: Touches = ()
    ) -> Result:
        """Run ``fn`` in the next group commit. ``touches``: the operations ``fn`` will
        read (ids, or records about to be created): a hint a store may use to fetch their
        rows ahead, together (the PostgreSQL store: one round trip per batch); never
        needed for correctness."""
        ...

    def get_raw_many(self, table: Table, keys: list[bytes]) -> list[bytes | None]:
        """``get_raw`` of every key, from one snapshot (one round trip on PostgreSQL)."""
        ...

    def get_raw_rows(self, wanted: list[tuple[Table, bytes]]) -> list[bytes | None]:
        """``get_raw`` of every ``(table, key)``, from one snapshot (one round trip on
        PostgreSQL): the rows of several tables a caller needs together."""
        ...

    def commands_snapshot(self, *, after_serial: int = 0) -> tuple[int, list[CommandRecord]]:
        """``(snapshot id, commands with serial > after_serial)`` from one snapshot."""
        ...

    def last_txnid(self) -> int:
        """An id that moves on every commit by any process (the monitor's cheap poll)."""
        ...

    async def read_off_loop(self, reads: Callable[[], Result]) -> Result:
        """``reads()`` inline where reads are memory reads, in a worker thread where each
        is a round trip (``storage/store.py``)."""
        ...

    def inventory(
        self, account: AccountBinding | None = None, scope: str | None = None
    ) -> tuple[list[OperationRecord], list[str]]:
        """Readable records matching ``account``/``scope``, and the unreadable ids."""
        ...

    def control_rows(self) -> tuple[dict[str, LeaseRecord], dict[str, CommandRecord]]:
        """Every readable lease and command by operation id, from one snapshot."""
        ...

    def dispositions(
        self, account: AccountBinding | None = None, scope: str | None = None
    ) -> list[DispositionRecord]:
        """Readable disposition markers matching ``account``/``scope`` (None: any)."""
        ...

    def payload_kinds(self, operation_ids: Iterable[str]) -> dict[str, frozenset[str]]:
        """Which payloads each operation has, from one snapshot."""
        ...

    def queued(self, *, after_serial: int = 0, limit: int = 1024) -> list[QueueEntry]:
        """Queued operations with a serial above ``after_serial``, in order (one snapshot)."""
        ...

    def reserve_claims(self, operation_ids: list[str], *, limit: int) -> list[str]:
        """Of a claim round's candidates (in queue order), the first ``limit`` this owner
        may start without racing another owner's workers: reserved for it (a hint; the
        lease's fence decides)."""
        ...

    def workers(self) -> list[tuple[str, str, WorkerRow]]:
        """Every worker row ``(owner id, token, row)``, live or not."""
        ...

    @property
    def owner_id(self) -> str:
        """This store opener's owner id (the one a lease taken here names)."""
        ...

    def owner_is_live(self, owner_id: str) -> bool:
        """This store's own owner, or another whose lock a living process holds."""
        ...
