"""Streamed completions/s and latency, WebSocket vs SSE, at 1 / 100 / 1,000 concurrent streams.

The fixture provider runs in its own process (``fixture_main``); this process
drives ``ResponsesBackend`` under Trio. Usage (``python`` from the project's venv)::

    python bench/transport.py [--requests-per-level 1:200,100:1500,1000:3000] [--quick]

``--quick``: levels 1:10 and 10:50 (a few seconds).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from typing import Any

import msgspec
import trio

from recoverable.transport import Completed, ResponsesBackend, StaticCredentials

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer"},
        "summary": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["answer", "summary", "tags"],
    "additionalProperties": False,
}
BODY = msgspec.json.encode(
    {
        "model": "fixture-model",
        "input": "Summarize.",
        "store": False,
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "S", "strict": True,
                            "schema": SCHEMA}},
    },
    order="sorted",
)


async def start_provider() -> tuple[trio.Process, str]:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", "import sys; from recoverable.fixture.provider import "
         "fixture_main; sys.exit(fixture_main(sys.argv[1:]))", "--port", "0"],
        stdout=-1,
    )
    assert proc.stdout is not None
    buf = b""
    with trio.fail_after(30):
        while b"\n" not in buf:
            chunk = await proc.stdout.receive_some(4096)
            if not chunk:
                raise RuntimeError("provider exited")
            buf += chunk
    info = json.loads(buf.split(b"\n", 1)[0])
    return proc, str(info["http_url"])


async def run_level(url: str, mode: str, concurrency: int, total: int) -> dict[str, Any]:
    latencies: list[float] = []
    failures = 0
    counter = iter(range(total))
    async with ResponsesBackend(url, credentials=StaticCredentials("bench"),
                                mode=mode) as backend:
        # warm-up: open the connections once (not measured)
        async def warm(i: int) -> None:
            await backend.stream(BODY, attempt_id=f"w{i}", token="bench")

        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                nursery.start_soon(warm, i)

        async def worker() -> None:
            nonlocal failures
            for i in counter:
                t0 = time.perf_counter()
                outcome = await backend.stream(BODY, attempt_id=f"a{i}", token="bench")
                latencies.append(time.perf_counter() - t0)
                if not isinstance(outcome, Completed):
                    failures += 1

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "mode": mode,
        "concurrency": concurrency,
        "requests": total,
        "failures": failures,
        "per_s": total / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
    }


async def main(levels: list[tuple[int, int]]) -> None:
    proc, url = await start_provider()
    rows = []
    try:
        for concurrency, total in levels:
            for mode in ("websocket", "sse"):
                rows.append(await run_level(url, mode, concurrency, total))
                print(f"  done {mode:9} c={concurrency}", file=sys.stderr, flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
    print(f"{'mode':10} {'conc':>5} {'requests':>8} {'fail':>5} {'compl/s':>9} "
          f"{'p50 ms':>8} {'p99 ms':>8}")
    for r in rows:
        print(f"{r['mode']:10} {r['concurrency']:>5} {r['requests']:>8} {r['failures']:>5} "
              f"{r['per_s']:>9.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}")


def parse_levels(text: str) -> list[tuple[int, int]]:
    levels = []
    for item in text.split(","):
        conc, _, total = item.partition(":")
        levels.append((int(conc), int(total)))
    return levels


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests-per-level", default=None,
                        help="concurrency:total pairs (default 1:200,100:1500,1000:3000)")
    parser.add_argument("--quick", action="store_true", help="a few seconds: 1:10,10:50")
    args = parser.parse_args()
    levels = args.requests_per_level or ("1:10,10:50" if args.quick
                                         else "1:200,100:1500,1000:3000")
    trio.run(main, parse_levels(levels))
