"""The bulk form of the single-operation commands: ``retry|cancel|suspend|acknowledge|
abandon --filter KEY=VALUE,... (--dry-run | --yes)`` (docs/cli.md)."""

from __future__ import annotations

import argparse
from typing import Final

__all__ = ["BULK_COMMANDS", "add_bulk_arguments"]

BULK_COMMANDS: Final = frozenset({"retry", "cancel", "suspend", "acknowledge", "abandon"})


def add_bulk_arguments(command: argparse.ArgumentParser, name: str) -> None:
    """``--filter`` (instead of OPERATION_ID), ``--dry-run`` and ``--yes``."""
    command.add_argument(
        "--filter", metavar="KEY=VALUE,...",
        help="act on every operation the filter selects instead of OPERATION_ID; keys: q (id "
        "or job id prefix), state, availability, kind, code, model, owner (prefix), since, "
        "until (ISO 8601 UTC or epoch seconds), time (updated or created: what since/until "
        "bound). Needs --dry-run or --yes",
    )
    choice = command.add_mutually_exclusive_group()
    choice.add_argument("--dry-run", action="store_true",
                        help="with --filter: show how many and which, and what would be "
                        "refused; do nothing")
    choice.add_argument("--yes", action="store_true",
                        help=f"with --filter: {name} every operation it selects (each is "
                        "checked by the same rules as one at a time)")
    if name != "retry":  # retry has its own, required
        command.add_argument(
            "--action-id", metavar="ID",
            help="with --filter: names this bulk action (default: a fresh one)")
