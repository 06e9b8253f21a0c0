"""Several processes (each with its own writer thread) write one store concurrently."""

from __future__ import annotations

import trio
from storage_helpers import make_op, read_line, spawn_child

from recoverable.storage import RecoveryStore, WriteTxn

PER_PROCESS = 150


def increment(txn: WriteTxn) -> int:
    raw = txn.get_payload("counter", "request")
    value = (int.from_bytes(raw, "big") if raw else 0) + 1
    txn.put_payload("counter", "request", value.to_bytes(8, "big"))
    return value


async def test_concurrent_processes_lose_no_write(store_path: str) -> None:
    with RecoveryStore.open(store_path) as store:
        children = [spawn_child("write", store_path, name, str(PER_PROCESS)) for name in "ab"]
        try:
            for child in children:
                assert read_line(child) == "ready"
            for child in children:  # release both at once, then write from here too
                assert child.stdin is not None
                child.stdin.write("go\n")
                child.stdin.flush()

            async def ours(i: int) -> None:
                await store.write(lambda t: t.put_operation(make_op(f"p-{i}")))
                await store.write(increment)

            async with trio.open_nursery() as nursery:
                for i in range(PER_PROCESS):
                    nursery.start_soon(ours, i)
            for child in children:
                line = await trio.to_thread.run_sync(read_line, child)
                assert line.startswith("done ")
                child.wait(60)
                assert child.returncode == 0
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
    with RecoveryStore.open(store_path) as store:
        ids = {r.operation_id for r in store.inventory()[0]}
        expected = {f"{prefix}-{i}" for prefix in "abp" for i in range(PER_PROCESS)}
        assert ids == expected
        counter = store.get_payload("counter", "request")
        assert counter is not None and int.from_bytes(counter, "big") == 3 * PER_PROCESS
        assert store.check_integrity() == []
