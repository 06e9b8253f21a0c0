"""Run in a subprocess by the process tests: one ``ResponsesBackend.stream`` call.

Prints ``progress <seq>`` lines as the stream advances and ``outcome <json>`` at the end.
"""

from __future__ import annotations

import sys

import msgspec
import trio
from transport_helpers import make_body

from recoverable.transport import Progress, ResponsesBackend, StaticCredentials


async def main(url: str, mode: str, attempt_id: str) -> None:
    def progress(p: Progress) -> None:
        print(f"progress {p.sequence_number}", flush=True)

    async with ResponsesBackend(url, credentials=StaticCredentials("k"),
                                mode=mode) as backend:  # type: ignore[arg-type]
        outcome = await backend.stream(make_body(), attempt_id=attempt_id, token="k",
                                       on_progress=progress)
    print("outcome " + msgspec.json.encode(outcome).decode(), flush=True)


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:4])
