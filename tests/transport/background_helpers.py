"""Helpers of the background-response tests (a module, not a conftest, so tests import it):
raw HTTP calls of the four background routes and a step-by-step mock clock."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
import trio
import trio.testing
from transport_helpers import make_body

from recoverable.testing import FixtureProvider

BACKGROUND = {"background": True, "store": True, "stream": True}


def background_body(**extra: Any) -> bytes:
    body = msgspec.json.decode(make_body())
    body.update(BACKGROUND, **extra)
    return msgspec.json.encode(body)


async def read_events(response: httpx.Response) -> tuple[list[dict[str, Any]], bool]:
    """The events of an SSE answer, and whether it ended cleanly (False: cut)."""
    events: list[dict[str, Any]] = []
    try:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return events, False
    return events, True


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=None, headers={"authorization": "Bearer k"}) as c:
        yield c


async def post(
    client: httpx.AsyncClient, provider: FixtureProvider, body: bytes,
) -> tuple[int, list[dict[str, Any]], bool]:
    async with client.stream("POST", provider.http_url + "/responses", content=body,
                             headers={"content-type": "application/json"}) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, [response.json()], True
        events, clean = await read_events(response)
        return 200, events, clean


async def resume(
    client: httpx.AsyncClient, provider: FixtureProvider, rid: str, after: int | None,
) -> tuple[int, list[dict[str, Any]], bool]:
    params: dict[str, Any] = {"stream": "true"}
    if after is not None:
        params["starting_after"] = after
    async with client.stream("GET", f"{provider.http_url}/responses/{rid}",
                             params=params) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, [response.json()], True
        events, clean = await read_events(response)
        return 200, events, clean


async def retrieve(
    client: httpx.AsyncClient, provider: FixtureProvider, rid: str,
) -> tuple[int, dict[str, Any]]:
    answer = await client.get(f"{provider.http_url}/responses/{rid}")
    return answer.status_code, answer.json()


async def cancel(
    client: httpx.AsyncClient, provider: FixtureProvider, rid: str,
) -> tuple[int, dict[str, Any]]:
    answer = await client.post(f"{provider.http_url}/responses/{rid}/cancel")
    return answer.status_code, answer.json()


async def step_until(clock: trio.testing.MockClock, done: Any) -> None:
    """Advance the mock clock one event delay at a time until ``done()`` (each step lets
    every task, the generation and the readers, run before the next)."""
    await trio.testing.wait_all_tasks_blocked()
    while not done():
        clock.jump(1.0)
        await trio.testing.wait_all_tasks_blocked()

