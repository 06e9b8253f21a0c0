"""A runtime process that streams one prepared operation (run by test_lease_expiry.py).

It opens the store with ``--lease-seconds`` leases, sends the operation whose id it is
given (approving every attempt) and writes one JSON report: ``{"value": ...}`` or
``{"error": code}``. The test stops it (SIGSTOP) mid-stream, or it stops itself at a
crash point (``RECOVERABLE_KILL_AT`` + ``RECOVERABLE_KILL_SIGNAL=STOP``).
"""

from __future__ import annotations

import argparse
import sys

import msgspec
import trio

import recoverable

ACCOUNT = recoverable.AccountBinding("acct-lease", "api-key")


class Answer(msgspec.Struct, frozen=True):
    answer: int


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


async def run(args: argparse.Namespace) -> dict[str, object]:
    report: dict[str, object]
    with recoverable.RecoveryStore.open(args.store) as store:
        backend = recoverable.ResponsesBackend(
            args.base_url,
            credentials=recoverable.StaticCredentials("sk-lease-child", account=ACCOUNT),
            mode="sse",
            endpoint_id="fixture",
        )
        async with backend, recoverable.open_runtime(
            store, backend, account=ACCOUNT, lease_seconds=args.lease_seconds
        ) as rt:
            handle = recoverable.Handle(args.operation_id)
            try:
                value = await rt.send_recovering(handle, response=Answer, authorize=approve)
            except recoverable.RecoveryError as exc:
                report = {"error": exc.code}
            else:
                report = {"value": value.answer}
    return report


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--operation-id", required=True)
    parser.add_argument("--lease-seconds", type=float, required=True)
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    report = trio.run(run, args)
    with open(args.report, "wb") as out:
        out.write(msgspec.json.encode(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
