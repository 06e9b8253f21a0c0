"""The PostgreSQL operations table: typed columns an operator can query, guarded by triggers.

``recoverable_operations`` keeps each operation record as the library reads it (``key``,
``value``: the record's encoded bytes, the same as the LMDB store's) and, since schema
version 3, typed columns projected from that record in the very statement that writes
it: :data:`COLUMNS` (ids, phase, failure, fence, attempts, times, usage totals; no prompt,
output or credential). The frozen body and the receipt stay in ``recoverable_payloads``.
So an operator can ask the database "how many operations failed with
``rate_limit_exceeded`` in the last hour" in SQL (``docs/fleet.md``), and the database
itself refuses, whatever client writes (:data:`GUARD`):

- ``fence`` or ``attempts_used`` going down,
- a finished phase (``completed``, ``failed``, ``cancelled``, ``superseded``) going back to
  a live one, except the way back the machine defines (a ``failed`` operation waiting for
  sign-in, ``failure_reason = 'authentication_required'``, reopens),
- a change to an admission column (``operation_id``, ``account_id``, ``endpoint_id``,
  ``scope``, ``job_id``, ``input_revision``, ``body_hash``, ``maximum_attempts``,
  ``created_at``), and any change to a frozen body's bytes.

Each refusal is a ``check_violation`` (SQLSTATE 23514) naming its rule. They repeat, in the
database, the checks the write transaction makes first (``storage/txn.py``
``_check_progress``, the admission fields): the library never reaches them. A row whose
value does not decode (a damaged or future record) has NULL typed columns, and the rules
that compare them do not apply to it; the columns describe the record as the library
last wrote it (a raw ``UPDATE`` of ``value`` alone does not refresh them).
"""

from __future__ import annotations

from typing import Any, Final

import psycopg

from recoverable.errors import CorruptRecord, UnsupportedRecordVersion
from recoverable.records import OperationRecord
from recoverable.storage import codec

__all__ = ["COLUMNS", "GUARD", "INSERT_MANY", "INSERT_ONE", "columns_of", "step_3"]

TABLE: Final = "recoverable_operations"

# (column, SQL type, unnest array type): the projection of :func:`columns_of`, in order.
COLUMNS: Final[tuple[tuple[str, str, str], ...]] = (
    ("operation_id", "text", "text[]"),
    ("account_id", "text", "text[]"),
    ("endpoint_id", "text", "text[]"),
    ("model", "text", "text[]"),
    ("scope", "text", "text[]"),
    ("job_id", "text", "text[]"),
    ("input_revision", "text", "text[]"),
    ("body_hash", "text", "text[]"),
    ("phase", "text", "text[]"),
    ("failure_reason", "text", "text[]"),
    ("failure_kind", "text", "text[]"),
    ("failure_code", "text", "text[]"),
    ("fence", "bigint", "int8[]"),
    ("attempts_used", "integer", "int4[]"),
    ("maximum_attempts", "integer", "int4[]"),
    ("created_at", "timestamptz", "float8[]"),
    ("next_attempt_at", "timestamptz", "float8[]"),
    ("completed_at", "timestamptz", "float8[]"),
    ("input_tokens", "bigint", "int8[]"),
    ("output_tokens", "bigint", "int8[]"),
)
_NAMES: Final = tuple(name for name, _, _ in COLUMNS)
_TIMES: Final = frozenset(name for name, kind, _ in COLUMNS if kind == "timestamptz")
_EMPTY: Final = (None,) * len(COLUMNS)


def columns_of(value: bytes) -> tuple[Any, ...]:
    """The typed columns of an operations row (all None when its record does not decode)."""
    try:
        record = codec.decode_operation(value)
    except (CorruptRecord, UnsupportedRecordVersion):
        return _EMPTY
    return _project(record)


def _project(record: OperationRecord) -> tuple[Any, ...]:
    failure = record.last_failure
    code: str | None = None
    if failure is not None:
        code = failure.provider_code or failure.transport_code or (
            None if failure.http_status is None else str(failure.http_status)
        )
    input_tokens = output_tokens = 0
    for attempt in record.attempts:
        if attempt.usage is not None:
            input_tokens += attempt.usage.input_tokens
            output_tokens += attempt.usage.output_tokens
    return (
        record.operation_id, record.account.account_id, record.endpoint_id, record.model,
        record.scope, record.job_id, record.input_revision, record.body_hash, record.phase,
        record.failure_reason, None if failure is None else failure.kind, code,
        record.fence, record.attempts_used, record.maximum_attempts, record.created_at,
        record.next_attempt_at, record.completed_at, input_tokens, output_tokens,
    )


def _select(source: str) -> str:
    """The typed expressions of the columns read from ``source`` (times: epoch seconds)."""
    return ", ".join(
        f"to_timestamp({source}.{name})" if name in _TIMES else f"{source}.{name}"
        for name in _NAMES
    )


_SET: Final = ", ".join(
    ["value = EXCLUDED.value"] + [f"{name} = EXCLUDED.{name}" for name in _NAMES]
    + ["updated_at = now()"]
)
# Many rows in one statement (the writer's batch): one array per column.
INSERT_MANY: Final = (
    f"INSERT INTO {TABLE} (key, value, {', '.join(_NAMES)}) "
    f"SELECT r.key, r.value, {_select('r')} FROM unnest(%b::bytea[], %b::bytea[], "
    + ", ".join(f"%b::{array}" for _, _, array in COLUMNS)
    + f") AS r(key, value, {', '.join(_NAMES)}) ON CONFLICT (key) DO UPDATE SET {_SET}"
)
# One row (a write outside the writer's batches).
INSERT_ONE: Final = (
    f"INSERT INTO {TABLE} (key, value, {', '.join(_NAMES)}) "
    f"SELECT r.key, r.value, {_select('r')} FROM (VALUES (%b::bytea, %b::bytea, "
    + ", ".join(f"%b::{array[:-2]}" for _, _, array in COLUMNS)
    + f")) AS r(key, value, {', '.join(_NAMES)}) ON CONFLICT (key) DO UPDATE SET {_SET}"
)

_FINISHED: Final = "('completed', 'failed', 'cancelled', 'superseded')"
_ADMISSION: Final = (
    "operation_id", "account_id", "endpoint_id", "scope", "job_id", "input_revision",
    "body_hash", "maximum_attempts", "created_at",
)
_BODY_SUFFIX: Final = "\\x00626f6479"  # b"\0body": the key of a frozen body ends so


def _refuse(rule: str, message: str, *args: str) -> str:
    return (
        f"RAISE EXCEPTION '{message}', {', '.join(args)} USING ERRCODE = 'check_violation',"
        f" CONSTRAINT = '{rule}';"
    )


GUARD: Final = f"""
CREATE OR REPLACE FUNCTION recoverable_operations_guard() RETURNS trigger
LANGUAGE plpgsql AS $guard$
BEGIN
  IF NEW.fence < OLD.fence THEN
    {_refuse("recoverable_fence_never_falls",
             "recoverable: operation %: its fence may not fall (% to %)",
             "OLD.operation_id", "OLD.fence", "NEW.fence")}
  END IF;
  IF NEW.attempts_used < OLD.attempts_used THEN
    {_refuse("recoverable_attempts_never_fall",
             "recoverable: operation %: its attempts spent may not fall (% to %)",
             "OLD.operation_id", "OLD.attempts_used", "NEW.attempts_used")}
  END IF;
  IF OLD.phase IN {_FINISHED} AND NEW.phase NOT IN {_FINISHED}
     AND NOT (OLD.phase = 'failed' AND OLD.failure_reason = 'authentication_required') THEN
    {_refuse("recoverable_finished_stays_finished",
             "recoverable: operation %: the finished phase % may not go back to %",
             "OLD.operation_id", "OLD.phase", "NEW.phase")}
  END IF;
  IF OLD.operation_id IS NOT NULL AND NEW.operation_id IS NOT NULL
     AND ({', '.join(f'OLD.{column}' for column in _ADMISSION)})
         IS DISTINCT FROM ({', '.join(f'NEW.{column}' for column in _ADMISSION)}) THEN
    {_refuse("recoverable_admission_fixed",
             "recoverable: operation %: its admission columns may not change",
             "OLD.operation_id")}
  END IF;
  RETURN NEW;
END
$guard$;
DROP TRIGGER IF EXISTS recoverable_operations_guard ON {TABLE};
CREATE TRIGGER recoverable_operations_guard BEFORE UPDATE ON {TABLE}
  FOR EACH ROW EXECUTE FUNCTION recoverable_operations_guard();

CREATE OR REPLACE FUNCTION recoverable_body_frozen() RETURNS trigger
LANGUAGE plpgsql AS $frozen$
BEGIN
  IF substring(OLD.key FROM octet_length(OLD.key) - 4) = '{_BODY_SUFFIX}'::bytea
     AND (NEW.key, NEW.value) IS DISTINCT FROM (OLD.key, OLD.value) THEN
    {_refuse("recoverable_body_frozen",
             "recoverable: a frozen request body may not change (payload %)",
             "encode(OLD.key, 'escape')")}
  END IF;
  RETURN NEW;
END
$frozen$;
DROP TRIGGER IF EXISTS recoverable_body_frozen ON recoverable_payloads;
CREATE TRIGGER recoverable_body_frozen BEFORE UPDATE ON recoverable_payloads
  FOR EACH ROW EXECUTE FUNCTION recoverable_body_frozen();
"""

# Indexes on columns that never change once written (admission): an update that changes
# no indexed column can stay a heap-only tuple (HOT: no index entry written), and every
# library write changes phase, fence or updated_at. An index on any of those would make
# every write update every index. Queries by phase scan the table (docs/fleet.md).
_INDEXES: Final = (
    f"CREATE INDEX IF NOT EXISTS recoverable_operations_account ON {TABLE}"
    " (account_id, endpoint_id, created_at)",
    f"CREATE INDEX IF NOT EXISTS recoverable_operations_job ON {TABLE} (scope, job_id)"
    " WHERE job_id IS NOT NULL",
    # Room on each page for the new version of a row (HOT updates stay on their page).
    f"ALTER TABLE {TABLE} SET (fillfactor = 80)",
)
BACKFILL_ROWS: Final = 1000


def step_3(conn: psycopg.Connection[Any]) -> None:
    """Version 3: the typed columns (filled from every existing record, a page at a
    time, in the migration's transaction), their indexes, and the guard triggers."""
    for name, kind, _ in COLUMNS:
        conn.execute(f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS {name} {kind}")
    conn.execute(
        f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS updated_at timestamptz"
        " NOT NULL DEFAULT now()"
    )
    after = b""
    while True:
        rows = conn.execute(
            f"SELECT key, value FROM {TABLE} WHERE key > %b ORDER BY key LIMIT {BACKFILL_ROWS}",
            (after,), binary=True,
        ).fetchall()
        if not rows:
            break
        projected = [columns_of(bytes(value)) for _, value in rows]
        conn.execute(
            f"UPDATE {TABLE} t SET {', '.join(f'{name} = r.{name}' for name in _NAMES)}"
            f" FROM (SELECT r.key, {_select('r')} FROM unnest(%b::bytea[], "
            + ", ".join(f"%b::{array}" for _, _, array in COLUMNS)
            + f") AS r(key, {', '.join(_NAMES)})) AS r({', '.join(('key', *_NAMES))})"
            " WHERE t.key = r.key",
            (
                [bytes(key) for key, _ in rows],
                *([list(column) for column in zip(*projected, strict=True)]),
            ),
            binary=True,
        )
        after = bytes(rows[-1][0])
    for index in _INDEXES:
        conn.execute(index)
    conn.execute(GUARD)
