"""The fixture provider as its own process, counting a client that dies by SIGKILL."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

HERE = Path(__file__).parent
PROVIDER = [sys.executable, "-c", "import sys; from recoverable.fixture.provider import "
            "fixture_main; sys.exit(fixture_main(sys.argv[1:]))"]
DEADLINE = 30.0


class LineReader:
    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buf = b""

    async def line(self) -> str:
        while b"\n" not in self._buf:
            chunk = await self._stream.receive_some(4096)
            if not chunk:
                raise EOFError(self._buf)
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()


async def get_requests(url: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient() as client:
        response = await client.get(url)
        response.raise_for_status()
        listing: list[dict[str, Any]] = response.json()
        return listing


@pytest.mark.parametrize("mode", ["sse", "websocket"])
async def test_killed_client_is_counted_exactly_once(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"kind": "stall", "after_events": 4},
                                  {"kind": "complete", "payload": {"answer": 42}}]))
    provider = await trio.lowlevel.open_process(
        [*PROVIDER, "--port", "0", "--script", str(script)], stdout=-1
    )
    try:
        with trio.fail_after(DEADLINE):
            assert provider.stdout is not None
            info = json.loads(await LineReader(provider.stdout).line())
            assert info["pid"] == provider.pid
            assert info["http_url"].startswith("http://127.0.0.1:")
            assert info["websocket_url"] == (
                info["http_url"].replace("http://", "ws://", 1) + "/responses")

            client = await trio.lowlevel.open_process(
                [sys.executable, str(HERE / "stream_client.py"), info["http_url"], mode,
                 "killed-attempt"], stdout=-1, cwd=str(HERE),
            )
            assert client.stdout is not None
            reader = LineReader(client.stdout)
            # the client is mid-stream: it has seen events (progress) and no outcome
            first = await reader.line()
            assert first.startswith("progress"), first
            client.send_signal(signal.SIGKILL)
            assert await client.wait() == -signal.SIGKILL

            listing = await get_requests(info["requests_url"])
            assert [(r["attempt_id"], r["reply_kind"], r["transport"]) for r in listing] == [
                ("killed-attempt", "stall", mode)]

            # the next client gets the next scripted reply; the count is exact
            done = await trio.run_process(
                [sys.executable, str(HERE / "stream_client.py"), info["http_url"], mode,
                 "second-attempt"], capture_stdout=True, cwd=str(HERE),
            )
            outcome_line = done.stdout.decode().strip().splitlines()[-1]
            # The outcome carries the fixture's reported usage (issue 19.3).
            assert outcome_line == 'outcome {"text":"{\\"answer\\":42}","response_id":' \
                '"resp_fixture000000000002","sequence_number":11,"usage":{"input_tokens":134,' \
                '"cached_input_tokens":0,"output_tokens":3,"reasoning_tokens":0},' \
                '"usage_malformed":false,"rate_limits":null}'  # no x-ratelimit-* headers here
            listing = await get_requests(info["requests_url"])
            assert [r["attempt_id"] for r in listing] == ["killed-attempt", "second-attempt"]
            assert listing[0]["body"] == listing[1]["body"]
            assert listing[0]["headers"]["authorization"].startswith("Bearer sha256:")
    finally:
        provider.send_signal(signal.SIGTERM)
        with trio.fail_after(DEADLINE):
            code = await provider.wait()
    assert code == 0


async def test_remote_script_and_bad_arguments(tmp_path: Path) -> None:
    bad = await trio.run_process([*PROVIDER, "--faults", "boom=2"], capture_stderr=True,
                                 check=False)
    assert bad.returncode == 2 and b"unknown fault" in bad.stderr
    provider = await trio.lowlevel.open_process([*PROVIDER, "--port", "0"], stdout=-1)
    try:
        with trio.fail_after(DEADLINE):
            assert provider.stdout is not None
            info = json.loads(await LineReader(provider.stdout).line())
            base = info["http_url"].rsplit("/v1", 1)[0]
            async with httpx.AsyncClient() as client:
                r = await client.post(base + "/_fixture/script",
                                      json=[{"kind": "rate_limited", "retry_after": 3}])
                assert r.status_code == 200
                r = await client.post(base + "/_fixture/script", json=[{"kind": "nope"}])
                assert r.status_code == 400
                assert r.json()["error"]["code"] == "invalid_script"
                r = await client.post(info["http_url"] + "/responses",
                                      json={"model": "m", "input": "x", "stream": True},
                                      headers={"x-client-request-id": "remote"})
                assert r.status_code == 429 and r.headers["retry-after"] == "3"
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
                r = await client.post(info["http_url"] + "/responses", json={"model": "m"})
                assert r.status_code == 200  # the script is used up: synthesized
                assert "response.completed" in r.text and "[DONE]" not in r.text
                r = await client.get(base + "/nowhere")
                assert r.status_code == 404
            listing = await get_requests(info["requests_url"])
            assert [r["reply_kind"] for r in listing] == ["rate_limited", "synthesize"]
            assert listing[0]["body"] == '{"input":"x","model":"m"}'
    finally:
        provider.send_signal(signal.SIGINT)
        with trio.fail_after(DEADLINE):
            assert await provider.wait() == 0
