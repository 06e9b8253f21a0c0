"""Process A of the cross-process cancel test and bench (run as a script).

It prepares and streams ``--count`` operations (``--concurrency`` at a time)
against a provider whose replies stall, and reports on stdout, one JSON line
each:

- ``{"event": "prepared", "operation_id": ..., "index": i}`` before sending;
- ``{"event": "cancelled", "operation_id": ..., "t": wall}`` the moment
  ``send_recovering`` raised ``OperationCancelled`` (``t`` = ``time.time()``);
- ``{"event": "error", "operation_id": ..., "error": type, "code": ...}`` for any
  other ending (a completion included: it would be a bug here);
- ``{"event": "done"}`` last.

Another process cancels each operation through its own runtime on the same
store (``rt.cancel``); this one only observes it through its lifecycle monitor.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import msgspec
import trio

import recoverable

ACCOUNT = recoverable.AccountBinding("acct-cancel", "api-key")


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


def emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


async def run(args: argparse.Namespace) -> int:
    store = recoverable.RecoveryStore.open(args.store)
    backend = recoverable.ResponsesBackend(
        args.base_url,
        credentials=recoverable.StaticCredentials("sk-cancel-child", account=ACCOUNT),
        mode=args.mode,
        endpoint_id="fixture",
    )
    policy = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
    try:
        async with backend, recoverable.open_runtime(
            store, backend, account=ACCOUNT, monitor_interval=args.monitor_interval
        ) as rt:
            counter = iter(range(args.count))

            async def worker() -> None:
                for i in counter:
                    request = recoverable.StructuredRequest(
                        model="gpt-test", instructions="cancel me", input=f"stalled {i}"
                    )
                    handle = await rt.prepare(
                        request, response=Answer, maximum_attempts=args.max_attempts,
                        retry_policy=policy, job_id=f"cancel-{i}", input_revision="r1",
                    )
                    emit(event="prepared", operation_id=handle.operation_id, index=i)
                    try:
                        await rt.send_recovering(handle, response=Answer, authorize=approve)
                    except recoverable.OperationCancelled:
                        emit(event="cancelled", operation_id=handle.operation_id, t=time.time())
                    except recoverable.RecoveryError as exc:
                        emit(event="error", operation_id=handle.operation_id,
                             error=type(exc).__name__, code=exc.code)
                    else:
                        emit(event="error", operation_id=handle.operation_id,
                             error="completed", code=None)

            async with trio.open_nursery() as nursery:
                for _ in range(max(1, args.concurrency)):
                    nursery.start_soon(worker)
    finally:
        store.close()
    emit(event="done")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--mode", default="sse", choices=["sse", "websocket"])
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-attempts", type=int, default=3)
    parser.add_argument("--monitor-interval", type=float, default=0.002)
    args = parser.parse_args(argv)
    return trio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
