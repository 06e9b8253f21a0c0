"""Run by test_transport_openai_sdk in a subprocess: the official SDK against the fixture.

Prints one JSON line: the event class names and the final output text.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import openai
import pydantic
from openai.types.responses import ResponseStreamEvent


async def main(base_url: str, schema: dict[str, Any]) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0)
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    classes: list[str] = []
    strict_errors: list[str] = []
    final_text = None
    stream = await client.responses.create(
        model="fixture-model",
        input="What is the answer?",
        store=False,
        text={"format": {"type": "json_schema", "name": "Answer", "strict": True,
                         "schema": schema}},
        stream=True,
    )
    async for event in stream:
        classes.append(type(event).__name__)
        try:  # the SDK builds events leniently; validate each one strictly as well
            adapter.validate_python(event.to_dict())
        except pydantic.ValidationError as exc:
            strict_errors.append(f"{event.type}: {exc}")
        if event.type == "response.completed":
            final_text = event.response.output_text
    await client.close()
    print(json.dumps({"classes": classes, "strict_errors": strict_errors,
                      "final_text": final_text}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
