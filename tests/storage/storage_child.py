"""A separate process that uses a store (run by the storage tests, not collected)."""

from __future__ import annotations

import sys

import msgspec
import trio
from recoverable.storage import RecoveryStore, WriteTxn, acquire_lease
from recoverable.storage.codec import encode
from storage_helpers import make_op


def increment(txn: WriteTxn) -> int:
    raw = txn.get_payload("counter", "request")
    value = (int.from_bytes(raw, "big") if raw else 0) + 1
    txn.put_payload("counter", "request", value.to_bytes(8, "big"))
    return value


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
