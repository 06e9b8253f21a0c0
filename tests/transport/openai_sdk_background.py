"""Run by test_fixture_background in a subprocess: the official SDK's background calls
(``responses.create(background=True)``, ``responses.retrieve(id, stream=True,
starting_after=N)``, ``responses.retrieve(id)``, ``responses.cancel(id)``) against the fixture.

Prints one JSON line with what the SDK parsed."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import openai
import pydantic
from openai.types.responses import Response, ResponseStreamEvent


async def main(base_url: str, mode: str, schema: dict[str, Any]) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0)
    events: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    responses: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(Response)
    strict_errors: list[str] = []
    report: dict[str, Any] = {}

    def strict(adapter: pydantic.TypeAdapter[Any], value: Any) -> None:
        try:  # the SDK builds its models leniently; validate each one strictly as well
            adapter.validate_python(value.to_dict())
        except pydantic.ValidationError as exc:
            strict_errors.append(str(exc))

    stream = await client.responses.create(
        model="fixture-model", input="What is the answer?", background=True, store=True,
        text={"format": {"type": "json_schema", "name": "Answer", "strict": True,
                         "schema": schema}},
        stream=True,
    )
    first: list[Any] = []
    async for event in stream:
        strict(events, event)
        first.append(event)
        if event.sequence_number == 2:
            break  # the client goes away mid-stream
    await stream.close()
    rid = first[0].response.id
    report["first"] = [type(event).__name__ for event in first]
    if mode == "resume":
        resumed = await client.responses.retrieve(rid, stream=True, starting_after=2)
        rest: list[Any] = []
        async for event in resumed:
            strict(events, event)
            rest.append(event)
        report["rest"] = [type(event).__name__ for event in rest]
        report["rest_sequence"] = [event.sequence_number for event in rest]
        report["final_text"] = rest[-1].response.output_text
        final = await client.responses.retrieve(rid)
        strict(responses, final)
        report["retrieved"] = [final.status, final.output_text, final.background]
        cancelled = await client.responses.cancel(rid)
        strict(responses, cancelled)
        report["cancel_finished"] = cancelled.status
    else:  # still generating: cancel it
        live = await client.responses.retrieve(rid)
        strict(responses, live)
        cancelled = await client.responses.cancel(rid)
        strict(responses, cancelled)
        again = await client.responses.retrieve(rid)
        report["cancel"] = [live.status, cancelled.status, again.status]
    try:
        await client.responses.retrieve("resp_unknown")
        report["unknown"] = "found"
    except openai.NotFoundError as exc:
        report["unknown"] = [exc.status_code, type(exc.body).__name__]
    await client.close()
    report["strict_errors"] = strict_errors
    print(json.dumps(report))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
