"""The runtime process that the recovery-sweep tests kill (run as a script).

It prepares one operation per ``--op`` (a JSON object: ``job``, ``maximum_attempts``,
``on_interruption``, ``expires_at``), prints ``{"event": "prepared", "job": ...,
"operation_id": ...}`` for each, then streams them all at once against ``--base-url``
(the test's provider stalls them mid-stream) and waits. The test kills it with SIGKILL
once the provider has received every POST: by then each operation's consumed attempt is
durable (it is saved before the POST is sent).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any

import msgspec
import trio

import recoverable

ACCOUNT = recoverable.AccountBinding("acct-sweep", "api-key")


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


def emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _when(timestamp: float | None) -> datetime.datetime | None:
    if timestamp is None:
        return None
    return datetime.datetime.fromtimestamp(timestamp, tz=datetime.UTC)


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


async def run(args: argparse.Namespace) -> int:
    store = recoverable.RecoveryStore.open(args.store)
    backend = recoverable.ResponsesBackend(
        args.base_url,
        credentials=recoverable.StaticCredentials("sk-sweep-child", account=ACCOUNT),
        mode=args.mode,
        endpoint_id="fixture",
    )
    policy = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
    async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
        handles: list[recoverable.Handle] = []
        for spec in (json.loads(raw) for raw in args.op):
            handle = await rt.prepare(
                recoverable.StructuredRequest(
                    model="gpt-test", instructions="sweep me", input=f"job {spec['job']}"
                ),
                response=Answer,
                maximum_attempts=spec.get("maximum_attempts", 3),
                retry_policy=policy,
                expires_at=_when(spec.get("expires_at")),
                job_id=spec["job"],
                input_revision="r1",
                on_interruption=spec.get("on_interruption", "replace"),
            )
            handles.append(handle)
            emit(event="prepared", job=spec["job"], operation_id=handle.operation_id)

        async def send(handle: recoverable.Handle) -> None:
            try:
                await rt.send_recovering(handle, response=Answer, authorize=approve)
            except recoverable.RecoveryError as exc:
                emit(event="ended", operation_id=handle.operation_id, code=exc.code)
            else:
                emit(event="ended", operation_id=handle.operation_id, code="completed")

        async with trio.open_nursery() as nursery:
            for handle in handles:
                nursery.start_soon(send, handle)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--mode", default="sse", choices=["sse", "websocket"])
    parser.add_argument("--op", action="append", default=[])
    args = parser.parse_args(argv)
    return trio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
