"""A separate process that uses a store (run by the storage tests, not collected)."""

from __future__ import annotations

import sys
import time

import msgspec
import trio
from storage_helpers import make_op

from recoverable.errors import RecoveryError
from recoverable.records import LeaseRecord
from recoverable.storage import (
    RecoveryStore,
    WriteTxn,
    acquire_lease,
    release_lease,
    renew_leases,
)
from recoverable.storage.codec import encode


def increment(txn: WriteTxn) -> int:
    raw = txn.get_payload("counter", "request")
    value = (int.from_bytes(raw, "big") if raw else 0) + 1
    txn.put_payload("counter", "request", value.to_bytes(8, "big"))
    return value


def hold_expiring_lease(
    store: RecoveryStore, operation_id: str, lease_seconds: float, report: str
) -> None:
    """Take an expiring lease, then (once told to go on: after the parent stopped and
    continued this process) try what a stale owner would: renew, checkpoint, finish,
    release. Writes one JSON report of what the store answered, then exits 0."""
    lease = store.write_sync(
        lambda t: acquire_lease(t, operation_id, time.time(), lease_seconds=lease_seconds)
    )
    # The parent waits on the durable lease row (no message needed), then stops us.
    sys.stdin.readline()  # the parent writes here after SIGSTOP, reclaim and SIGCONT
    answers: dict[str, str] = {}

    def attempt(name: str, fn: object) -> None:
        try:
            result = store.write_sync(fn)  # type: ignore[arg-type]
        except RecoveryError as exc:
            answers[name] = exc.code
        else:
            answers[name] = f"ok:{msgspec.json.encode(result).decode()}"

    answers["live_for_itself"] = str(store.lease_is_live(lease, time.time()))
    attempt("renew", lambda t: _lost_ids(renew_leases(t, [lease], time.time(), lease_seconds)))
    checkpoint = make_op(operation_id, phase="authorizing", fence=lease.fence)
    attempt("checkpoint", lambda t: t.put_operation(checkpoint, expect_fence=lease.fence))

    def finish(txn: WriteTxn) -> None:
        txn.put_payload(operation_id, "completion", b'{"answer": 1}')
        done = make_op(operation_id, phase="completed", completed_at=time.time(),
                       fence=lease.fence)
        txn.put_operation(done, expect_fence=lease.fence)

    attempt("finish", finish)
    attempt("release", lambda t: release_lease(t, operation_id, lease.token))
    with open(report, "wb") as out:
        out.write(msgspec.json.encode(answers))


def _lost_ids(result: tuple[list[LeaseRecord], list[LeaseRecord]]) -> dict[str, int]:
    renewed, lost = result
    return {"renewed": len(renewed), "lost": len(lost)}


def main() -> None:
    mode = sys.argv[1]
    if mode == "encode":
        sys.stdout.write(encode(make_op("op-det", scope="s", job_id="j")).hex() + "\n")
        return
    path = sys.argv[2]
    with RecoveryStore.open(path) as store:
        if mode == "hold-lease":
            lease = store.write_sync(lambda t: acquire_lease(t, sys.argv[3], 10.0))
            print("ready", msgspec.json.encode(lease).decode(), flush=True)
            sys.stdin.read()  # block until killed (or stdin closes)
        elif mode == "hold-expiring-lease":
            hold_expiring_lease(store, sys.argv[3], float(sys.argv[4]), sys.argv[5])
        elif mode == "write":
            prefix, count = sys.argv[3], int(sys.argv[4])
            print("ready", flush=True)
            sys.stdin.readline()  # start together with the other writers

            async def writer(i: int) -> None:
                await store.write(lambda t: t.put_operation(make_op(f"{prefix}-{i}")))
                await store.write(increment)

            async def run() -> None:
                async with trio.open_nursery() as nursery:
                    for i in range(count):
                        nursery.start_soon(writer, i)

            trio.run(run)
            print("done", store.stats()["commits"], flush=True)
        else:
            raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
