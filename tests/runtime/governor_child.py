"""One process of the two-process rate governor test (run as a script).

It prepares ``--count`` operations on the shared store, prints
``{"event": "ready", "operation_ids": [...]}``, waits for a line on stdin (so both
processes start sending together), sends them all concurrently through a runtime
with ``requests_per_minute``, and prints ``{"event": "done", "completed": n}``.
"""

from __future__ import annotations

import argparse
import json
import sys

import msgspec
import trio

import recoverable

ACCOUNT = recoverable.AccountBinding("acct-governor", "api-key")


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


async def main(args: argparse.Namespace) -> None:
    with recoverable.RecoveryStore.open(args.store) as store:
        backend = recoverable.ResponsesBackend(
            args.url, credentials=recoverable.StaticCredentials("sk-child", account=ACCOUNT),
            mode="sse", endpoint_id="fixture",
        )
        async with recoverable.open_runtime(
            store, backend, account=ACCOUNT, requests_per_minute=args.rpm,
            rate_burst_seconds=args.burst,
        ) as rt:
            request = recoverable.StructuredRequest(
                model="gpt-test", instructions="Answer.", input="Six times seven?"
            )
            handles = [
                await rt.prepare(request, response=Answer, maximum_attempts=1)
                for _ in range(args.count)
            ]
            sys.stdout.write(json.dumps(
                {"event": "ready", "operation_ids": [h.operation_id for h in handles]}
            ) + "\n")
            sys.stdout.flush()
            await trio.to_thread.run_sync(sys.stdin.readline)
            completed = 0

            async def one(handle: recoverable.Handle) -> None:
                nonlocal completed

                async def approve(attempt: recoverable.Attempt) -> bool:
                    return True

                await rt.send_recovering(handle, response=Answer, authorize=approve)
                completed += 1

            async with trio.open_nursery() as nursery:
                for handle in handles:
                    nursery.start_soon(one, handle)
    sys.stdout.write(json.dumps({"event": "done", "completed": completed}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--rpm", type=float, required=True)
    parser.add_argument("--burst", type=float, required=True)
    parser.add_argument("--count", type=int, required=True)
    trio.run(main, parser.parse_args())
