"""Cross-process cancel latency (target p99 <= 50 ms).

Run:  python bench/cancel_latency.py [--samples 200] [--concurrency 1 --concurrency 16]
                                     [--mode sse --mode websocket] [--quick]

Three processes: the fixture provider (``--faults stall=1.0``: every reply sends
two events and then stalls), process A (``tests/runtime/cancel_child.py``), which
prepares and streams the operations, and process B (this script), which, once
the provider has logged an operation's POST, takes ``t0 = time.time()`` and
calls ``rt.cancel(handle)`` on its own runtime over the same store. A prints the
wall time at which ``send_recovering`` raised ``OperationCancelled``.

latency = A's wall time - t0. Also reported: B's ``cancel()`` call duration (its
durable command commit). Checked afterwards: every operation is ``cancelled``,
has exactly one POST, and A reported no other outcome.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

import recoverable

CHILD = str(_common.ROOT / "tests" / "runtime" / "cancel_child.py")
ACCOUNT = recoverable.AccountBinding("acct-cancel", "api-key")
NUDGE = recoverable.StructuredRequest(model="gpt-test", instructions="nudge", input="nudge")


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


class Lines:
    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = b""

    async def next(self) -> dict[str, Any] | None:
        while b"\n" not in self._buffer:
            chunk = await self._stream.receive_some(65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        event: dict[str, Any] = json.loads(line)
        return event


async def measure(
    info: dict[str, Any], mode: str, samples: int, concurrency: int, workdir: str,
    nudge_after: float, store_location: str | None = None,
) -> dict[str, Any]:
    # ``store_location``: a PostgreSQL URL (bench/pg_cancel.py); default an LMDB directory.
    store_path = store_location or str(Path(workdir) / "store")
    argv = [sys.executable, CHILD, "--store", store_path, "--base-url", info["base_url"],
            "--mode", mode, "--count", str(samples), "--concurrency", str(concurrency)]
    seen: set[str] = set()
    seen_changed = trio.Event()
    started: dict[str, float] = {}
    cancel_call: list[float] = []
    latencies: list[float] = []
    problems: list[dict[str, Any]] = []
    operation_ids: list[str] = []
    finished = trio.Event()
    observed: set[str] = set()
    lost: list[str] = []
    lost_latencies: list[float] = []
    nudges: list[recoverable.Handle] = []
    backend = recoverable.ResponsesBackend(  # never streams: only for the nudge prepares
        info["base_url"], credentials=recoverable.StaticCredentials("sk-b", account=ACCOUNT),
        endpoint_id="fixture",
    )

    store = recoverable.RecoveryStore.open(store_path)
    try:
        async with httpx.AsyncClient(timeout=30) as client, recoverable.open_runtime(
            store, backend, account=ACCOUNT
        ) as rt:

            async def poll_provider() -> None:
                nonlocal seen_changed
                while not finished.is_set():
                    log = (await client.get(info["requests_url"])).json()
                    fresh = {
                        (r.get("attempt_id") or "").rsplit(".", 1)[0] for r in log
                    } - seen
                    if fresh:
                        seen.update(fresh)
                        seen_changed.set()
                        seen_changed = trio.Event()
                    await trio.sleep(0.002)

            async def cancel_when_streaming(operation_id: str) -> None:
                while operation_id not in seen:
                    await seen_changed.wait()
                t0 = time.time()
                started[operation_id] = t0
                await rt.cancel(recoverable.Handle(operation_id))
                cancel_call.append(time.time() - t0)
                # A cancel A has not observed after ``nudge_after`` counts as lost; an
                # unrelated commit (a throwaway prepare) makes A's monitor rescan.
                await trio.sleep(nudge_after)
                if operation_id not in observed:
                    lost.append(operation_id)
                    handle = await rt.prepare(NUDGE, response=Answer, maximum_attempts=1)
                    nudges.append(handle)

            process = await trio.lowlevel.open_process(
                argv, stdout=subprocess.PIPE, env=_common.child_env()
            )
            try:
                assert process.stdout is not None
                lines = Lines(process.stdout)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(poll_provider)
                    with trio.fail_after(max(60.0, samples * 0.5)):
                        while True:
                            event = await lines.next()
                            if event is None or event["event"] == "done":
                                break
                            op = event["operation_id"]
                            if event["event"] == "prepared":
                                operation_ids.append(op)
                                nursery.start_soon(cancel_when_streaming, op)
                            elif event["event"] == "cancelled":
                                observed.add(op)
                                late = event["t"] - started[op]
                                (lost_latencies if op in lost else latencies).append(late)
                            else:
                                problems.append(event)
                    finished.set()
                assert await process.wait() == 0, "process A failed"
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
            for handle in nudges:
                await rt.abandon(handle)
            not_cancelled = [
                op for op in operation_ids
                if (await rt.status(recoverable.Handle(op))).state != "cancelled"
            ]
    finally:
        store.close()
    log = _common.provider_requests(info)
    posts: dict[str, int] = {}
    for r in log:
        op = (r.get("attempt_id") or "").rsplit(".", 1)[0]
        posts[op] = posts.get(op, 0) + 1
    extra_posts = sum(1 for op in operation_ids if posts.get(op, 0) != 1)
    return {
        "latencies": latencies,
        "lost": len(lost),
        "lost_latencies": lost_latencies,
        "cancel_call": cancel_call,
        "problems": problems,
        "not_cancelled": len(not_cancelled),
        "extra_posts": extra_posts,
        "operations": len(operation_ids),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=None, help="200; quick 5")
    parser.add_argument("--concurrency", type=int, action="append",
                        help="operations A streams at once (repeatable; default 1 and 16)")
    parser.add_argument("--mode", action="append", choices=["sse", "websocket"])
    parser.add_argument("--nudge-after", type=float, default=0.25,
                        help="seconds after which an unobserved cancel counts as lost")
    parser.add_argument("--quick", action="store_true",
                        help="a few seconds: 5 samples, sse, concurrency 1")
    args = parser.parse_args()
    samples = args.samples if args.samples is not None else (5 if args.quick else 200)
    modes = args.mode or (["sse"] if args.quick else ["sse", "websocket"])
    concurrencies = args.concurrency or ([1] if args.quick else [1, 16])
    rows = []
    base = tempfile.mkdtemp(prefix="cancel-latency-")
    try:
        with _common.provider_process(faults="stall=1.0") as info:
            for mode in modes:
                for c in concurrencies:
                    workdir = tempfile.mkdtemp(dir=base)
                    r = trio.run(measure, info, mode, samples, c, workdir, args.nudge_after)
                    lat = r["latencies"]
                    call = r["cancel_call"]
                    rows.append([
                        mode, c, len(lat),
                        _common.ms(_common.percentile(lat, 50)),
                        _common.ms(_common.percentile(lat, 99)),
                        _common.ms(max(lat) if lat else float("nan")),
                        _common.ms(_common.percentile(call, 50)),
                        _common.ms(_common.percentile(call, 99)),
                        r["lost"], _common.ms(max(r["lost_latencies"], default=float("nan"))),
                        len(r["problems"]), r["not_cancelled"], r["extra_posts"],
                    ])
                    for p in r["problems"][:5]:
                        print("problem:", p)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("cross-process cancel latency: B calls rt.cancel -> A observes OperationCancelled")
    print(_common.table(
        ["mode", "A streams", "samples", "p50 ms", "p99 ms", "max ms", "B cancel() p50 ms",
         "B cancel() p99 ms", "lost", "lost: max ms", "other outcomes", "not cancelled",
         "ops != 1 POST"],
        rows,
    ))


if __name__ == "__main__":
    main()
