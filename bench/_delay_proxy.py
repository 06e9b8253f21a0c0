"""A TCP proxy on 127.0.0.1 that adds a fixed latency to every byte, each way.

Run:  python bench/_delay_proxy.py --target HOST:PORT --delay-ms 1 [--port 0]

Prints one JSON line ``{"port": N}`` once it listens, then forwards every connection to
``--target``. Each chunk read from one side is written to the other ``--delay-ms`` after
it arrived (order kept; a chunk is not held up by the one before it beyond that), so a
request/response round trip costs ``2 x --delay-ms`` more, like a database in another
rack. Bandwidth is not limited. Only for benchmarks (``bench/fleet.py``): it stops with
its parent (SIGTERM) and never listens beyond loopback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import trio


async def _pipe(source: trio.SocketStream, sink: trio.SocketStream, delay: float) -> None:
    """Copy ``source`` to ``sink``, each chunk ``delay`` seconds after it arrived."""
    send, receive = trio.open_memory_channel[tuple[float, bytes]](math.inf)

    async def read() -> None:
        async with send:
            while True:
                try:
                    data = await source.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                if not data:
                    return
                send.send_nowait((trio.current_time() + delay, data))

    async def write() -> None:
        async with receive:
            async for due, data in receive:
                await trio.sleep_until(due)
                try:
                    await sink.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
        try:
            await sink.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        nursery.start_soon(write)


async def _serve(target: tuple[str, int], delay: float, port: int) -> None:
    async def handle(client: trio.SocketStream) -> None:
        try:
            upstream = await trio.open_tcp_stream(*target)
        except OSError:
            await client.aclose()
            return
        async with client, upstream:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pipe, client, upstream, delay)
                nursery.start_soon(_pipe, upstream, client, delay)

    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    print(json.dumps({"port": listeners[0].socket.getsockname()[1]}), flush=True)
    await trio.serve_listeners(handle, listeners)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HOST:PORT")
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    host, _, port = args.target.rpartition(":")
    trio.run(_serve, (host, int(port)), args.delay_ms / 1000.0, args.port)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(0)
