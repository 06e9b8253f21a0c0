"""The transport table (``transport/modes.py``) is the one list of modes: the backend
makes its transport from it, the CLI offers its keys, and an unknown mode is refused
with the typed error it always was."""

from __future__ import annotations

import argparse
from typing import Any, get_args

import attrs
import pytest

import recoverable
from recoverable import errors
from recoverable.cli.arguments import build_parser
from recoverable.cli.config import BatchConfig
from recoverable.cli.worker import WorkerConfig
from recoverable.transport.modes import DEFAULT_MODE, MODES, TRANSPORTS, Mode

CREDENTIALS = recoverable.StaticCredentials("sk-test-secret")


def _mode_action(command: str) -> argparse.Action:
    parser = build_parser()
    commands = next(
        action for action in parser._actions if isinstance(action, argparse._SubParsersAction)
    )
    sub = commands.choices[command]
    return next(action for action in sub._actions if "--mode" in action.option_strings)


@pytest.mark.parametrize("command", ["batch", "worker"])
def test_cli_mode_choices_are_the_transport_table(command: str) -> None:
    action = _mode_action(command)
    assert action.choices is not None
    assert tuple(action.choices) == tuple(TRANSPORTS) == MODES
    assert action.default == DEFAULT_MODE == "websocket"


def test_the_mode_type_names_the_table_rows() -> None:
    # mypy needs the modes as a Literal; this keeps it and the table one list.
    assert get_args(Mode) == MODES
    assert attrs.fields(BatchConfig).mode.default == DEFAULT_MODE
    assert attrs.fields(WorkerConfig).mode.default == DEFAULT_MODE


@pytest.mark.parametrize("mode", MODES)
async def test_the_backend_makes_its_transport_from_the_table(mode: Any) -> None:
    backend = recoverable.ResponsesBackend(
        "http://127.0.0.1:9/v1", credentials=CREDENTIALS, mode=mode
    )
    assert backend.mode == mode
    assert type(backend._transport) is TRANSPORTS[mode]
    async with backend:
        pass


@pytest.mark.parametrize("mode", ["http", "WebSocket", "", None, 3])
def test_an_unknown_mode_is_refused_with_invalid_request(mode: Any) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        recoverable.ResponsesBackend("http://127.0.0.1:9/v1", credentials=CREDENTIALS, mode=mode)
    assert str(caught.value).startswith(f"mode must be 'websocket' or 'sse', got {mode!r}")
