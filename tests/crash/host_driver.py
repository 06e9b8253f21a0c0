"""A realistic host process for crash tests (run as a script, killed with SIGKILL).

The host loop of the specification, with the host's own durable store (SQLite):
prepare -> persist the handle in a host transaction -> send_recovering -> commit
the result in a host transaction keyed by (job, revision) -> acknowledge.
On restart it reconciles: a saved handle is reopened; an orphaned SDK record
(saved before the host stored its handle) is found through inventory by its job
metadata and adopted; a committed job is acknowledged without applying it again.

Kill points: the library's (RECOVERABLE_KILL_AT) plus the host's own
``host.handle_saved`` and ``host.committed``.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys

import msgspec
import trio

import recoverable
from recoverable import _killpoints

ACCOUNT = recoverable.AccountBinding("acct-crash", "api-key")


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


def open_host_db(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute(
        "CREATE TABLE IF NOT EXISTS handles (job TEXT, revision TEXT, handle BLOB,"
        " PRIMARY KEY (job, revision))"
    )
    db.execute(
        "CREATE TABLE IF NOT EXISTS commits (job TEXT, revision TEXT, result TEXT,"
        " operation_id TEXT, PRIMARY KEY (job, revision))"
    )
    db.execute("CREATE TABLE IF NOT EXISTS commit_log (job TEXT, revision TEXT, operation_id TEXT)")
    return db


async def run(args: argparse.Namespace) -> int:
    db = open_host_db(args.host_db)
    store = recoverable.RecoveryStore.open(args.store)
    backend = recoverable.ResponsesBackend(
        args.base_url,
        credentials=recoverable.StaticCredentials("sk-crash", account=ACCOUNT),
        mode=args.mode,
        endpoint_id="fixture",
    )
    policy = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
    request = recoverable.StructuredRequest(
        model="gpt-test", instructions="crash test", input=f"job {args.job}"
    )
    async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
        row = db.execute(
            "SELECT handle FROM handles WHERE job=? AND revision=?", (args.job, args.revision)
        ).fetchone()
        if row is not None:
            handle = msgspec.json.decode(row[0], type=recoverable.Handle)
        else:
            # Reconcile an orphan: an SDK record saved before the host stored its handle.
            inventory = await rt.inventory()
            orphans = [
                s for s in inventory.operations
                if s.job_id == args.job and s.input_revision == args.revision
                and s.state not in ("acknowledged", "abandoned")
            ]
            if orphans:
                handle = recoverable.Handle(orphans[0].operation_id)
            else:
                handle = await rt.prepare(
                    request, response=Answer, maximum_attempts=args.max_attempts,
                    retry_policy=policy, job_id=args.job, input_revision=args.revision,
                    reattach=args.reattach,
                )
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "INSERT INTO handles VALUES (?, ?, ?)",
                (args.job, args.revision, msgspec.json.encode(handle)),
            )
            db.execute("COMMIT")
        _killpoints.hit("host.handle_saved")
        committed = db.execute(
            "SELECT operation_id FROM commits WHERE job=? AND revision=?",
            (args.job, args.revision),
        ).fetchone()
        if committed is None:

            async def authorize(attempt: recoverable.Attempt) -> bool:
                return True

            value = await rt.send_recovering(handle, response=Answer, authorize=authorize)
            db.execute("BEGIN IMMEDIATE")
            again = db.execute(
                "SELECT 1 FROM commits WHERE job=? AND revision=?", (args.job, args.revision)
            ).fetchone()
            if again is None:
                db.execute(
                    "INSERT INTO commits VALUES (?, ?, ?, ?)",
                    (args.job, args.revision, json.dumps(msgspec.to_builtins(value)),
                     handle.operation_id),
                )
                db.execute(
                    "INSERT INTO commit_log VALUES (?, ?, ?)",
                    (args.job, args.revision, handle.operation_id),
                )
            db.execute("COMMIT")
        _killpoints.hit("host.committed")
        try:
            await rt.acknowledge(handle)
        except recoverable.StateUnavailable:
            pass  # already acknowledged by an earlier run
    store.close()
    print(json.dumps({"job": args.job, "operation_id": handle.operation_id}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--host-db", required=True)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--mode", default="sse")
    parser.add_argument("--job", default="job-1")
    parser.add_argument("--revision", default="r1")
    parser.add_argument("--max-attempts", type=int, default=3)
    parser.add_argument("--reattach", action="store_true", help="prepare(..., reattach=True)")
    args = parser.parse_args(argv)
    return trio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
