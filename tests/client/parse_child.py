"""A child process for the client's crash test: one ``parse``, its value on stdout.

Run as ``python parse_child.py STORE BASE_URL KEY_ENV``; with ``RECOVERABLE_KILL_AT`` set
it SIGKILLs itself at that point (``recoverable._killpoints``).
"""

from __future__ import annotations

import sys

import msgspec
import trio

import recoverable


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


async def main(path: str, base_url: str, key_env: str) -> None:
    async with recoverable.open_client(path, endpoint=base_url, api_key_env=key_env,
                                       account="acct-1", mode="sse") as client:
        value = await client.parse(model="gpt-test", input="Six times seven?",
                                   text_format=Answer, job_id="job-42")
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:4])
