"""The host process that the reattachment kill test kills (run as a script; issue 15).

It prepares one ``reattach=True`` operation, prints ``{"event": "prepared",
"operation_id": ...}``, streams it against ``--base-url`` and prints one line per saved
reattachment checkpoint (``{"event": "checkpointed", "response_id": ..., "sequence_number":
N}``, read back from its store when the runtime's telemetry reports the committed
write). The test kills it with SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgspec
import trio

import recoverable

ACCOUNT = recoverable.AccountBinding("acct-reattach", "api-key")


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


def emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def checkpoint_reporter(store: recoverable.RecoveryStore) -> recoverable.TelemetrySink:
    def sink(event: recoverable.TelemetryEvent) -> None:
        if event.name == "recovery.attempt.checkpointed":
            record = store.get_operation(event.operation_id)  # what the write saved
            assert record is not None
            emit(event="checkpointed", response_id=record.attempts[-1].response_id,
                 sequence_number=record.attempts[-1].sequence_number)

    return sink


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


async def run(args: argparse.Namespace) -> int:
    store = recoverable.RecoveryStore.open(args.store)
    backend = recoverable.ResponsesBackend(
        args.base_url,
        credentials=recoverable.StaticCredentials("sk-reattach-child", account=ACCOUNT),
        mode="sse",
        endpoint_id="fixture",
    )
    policy = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
    async with backend, recoverable.open_runtime(
        store, backend, account=ACCOUNT, telemetry=checkpoint_reporter(store)
    ) as rt:
        if args.resume:  # run an operation an earlier (killed) process prepared
            handle = recoverable.Handle(args.resume)
        else:
            handle = await rt.prepare(
                recoverable.StructuredRequest(model="gpt-test", instructions="long", input="go"),
                response=Answer, maximum_attempts=args.maximum_attempts, retry_policy=policy,
                reattach=True, job_id="job-1", input_revision="r1",
            )
        emit(event="prepared", operation_id=handle.operation_id)
        await rt.send_recovering(handle, response=Answer, authorize=approve)
        emit(event="ended", operation_id=handle.operation_id)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--maximum-attempts", type=int, default=1)
    parser.add_argument("--resume", help="the operation id to run again (no prepare)")
    args = parser.parse_args(argv)
    return trio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
