"""A runtime process that runs one live operation (run by test_live_crash.py).

It opens the store with ``--lease-seconds`` leases, runs ``runtime.live`` on the operation
whose id it is given (approving every attempt), and writes one JSON line to stdout per
partial view (``{"view": text}``), then one final line: ``{"value": ...}`` or
``{"error": code}``. The test kills it (SIGKILL) or stops it (SIGSTOP, or itself at a
crash point: ``RECOVERABLE_KILL_AT`` + ``RECOVERABLE_KILL_SIGNAL=STOP``) mid-stream.
"""

from __future__ import annotations

import argparse
import sys

import msgspec
import trio

import recoverable

ACCOUNT = recoverable.AccountBinding("acct-live", "api-key")
REQUEST = recoverable.StructuredRequest(
    model="gpt-test", instructions="Write a short story.", input="About a lighthouse keeper."
)


class Story(msgspec.Struct, frozen=True):
    """Its synthesized answer is long enough for a partial view to be told apart."""

    headline: str
    opening_paragraph: str
    closing_paragraph: str
    rating: int


async def approve(attempt: recoverable.Attempt) -> bool:
    return True


def say(line: dict[str, object]) -> None:
    sys.stdout.buffer.write(msgspec.json.encode(line) + b"\n")
    sys.stdout.buffer.flush()


async def run(args: argparse.Namespace) -> None:
    with recoverable.RecoveryStore.open(args.store) as store:
        backend = recoverable.ResponsesBackend(
            args.base_url,
            credentials=recoverable.StaticCredentials("sk-live-child", account=ACCOUNT),
            mode=args.mode,
            endpoint_id="fixture",
        )
        async with backend, recoverable.open_runtime(
            store, backend, account=ACCOUNT, lease_seconds=args.lease_seconds
        ) as rt:
            handle = recoverable.Handle(args.operation_id)
            try:
                async with rt.live(handle, response=Story, authorize=approve) as live:
                    async for view in live:
                        say({"view": view.text})
            except recoverable.RecoveryError as exc:
                say({"error": exc.code})
            else:
                say({"value": msgspec.to_builtins(live.value)})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--operation-id", required=True)
    parser.add_argument("--mode", default="sse", choices=["sse", "websocket"])
    parser.add_argument("--lease-seconds", type=float, default=30.0)
    args = parser.parse_args()
    trio.run(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
