"""``recoverable config get|set KEY [VALUE] --store DIR [--json]``: the store-wide
preferences (issue 18; not ``cli/config.py``, the batch's option record).

Keys: ``continuation.enabled`` (``true``/``false``; off for every store until set),
``continuation.delay_seconds`` (0..86400) and ``continuation.budget`` (0..10). A change
persists in the store and applies to every account and scope on it, in every process
(workers read it again in each dispatch); ``false`` cancels the pending continuations.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import IO, Any

import trio

from recoverable import errors
from recoverable.actors.continuation import (
    ContinuationPreference,
    continuation_preference,
    set_continuation_preference,
)
from recoverable.cli.exits import EXIT_FAILED, EXIT_OK, UsageError
from recoverable.cli.formatting import encode_json
from recoverable.cli.ops import open_store

__all__ = ["run_config"]

_TRUE = {"true": True, "on": True, "1": True, "yes": True,
         "false": False, "off": False, "0": False, "no": False}


def _parse(key: str, text: str) -> dict[str, Any]:
    """The keyword of ``set_continuation_preference`` for ``key=text`` (a usage error
    for a value that is not one)."""
    field = key.removeprefix("continuation.")
    if field == "enabled":
        if text.lower() not in _TRUE:
            raise UsageError(f"{key} takes true or false, not {text!r}")
        return {"enabled": _TRUE[text.lower()]}
    try:
        value: float = float(text) if field == "delay_seconds" else int(text)
    except ValueError:
        raise UsageError(f"{key}: not a number: {text!r}") from None
    return {field: value}


def _value(preference: ContinuationPreference, key: str) -> object:
    return getattr(preference, key.removeprefix("continuation."))


def run_config(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    """Print (``get``) or change (``set``) one preference; exit 1 on a typed failure."""
    key: str = args.key
    changes = _parse(key, args.value) if args.config_action == "set" else None
    store = open_store(args.store)
    try:
        if changes is None:
            preference = continuation_preference(store)
        else:
            preference = trio.run(functools.partial(
                _set, store, changes, time.time()
            ))
    except errors.InvalidRequest as exc:
        raise UsageError(f"{key}: {exc}") from None
    except errors.RecoveryError as exc:
        if args.json:
            err.write(encode_json({"error": exc.code, "message": str(exc)}))
        else:
            err.write(f"recoverable config: {exc.code}: {exc}\n")
        return EXIT_FAILED
    finally:
        store.close()
    value = _value(preference, key)
    if args.json:
        out.write(encode_json({"key": key, "value": value,
                               "continuation": preference}))
    else:
        out.write(f"{key} = {str(value).lower() if isinstance(value, bool) else value}\n")
    return EXIT_OK


async def _set(store: Any, changes: dict[str, Any], now: float) -> ContinuationPreference:
    return await set_continuation_preference(store, now=now, **changes)
