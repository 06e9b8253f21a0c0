"""``recoverable config get|set KEY [VALUE] --store DIR [--json]``: the store-wide
preferences (not ``cli/config.py``, the batch's option record).

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
from recoverable.cli.arguments import ascii_decimal, ascii_int
from recoverable.cli.exits import EXIT_FAILED, EXIT_OK, UsageError
from recoverable.cli.formatting import encode_json, safe_text
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
    # ASCII only: float() and int() alone also take other scripts' digits (U+0663,
    # fullwidth U+FF13), underscores, spaces, "nan" and exponents.
    if field == "delay_seconds":
        seconds = ascii_decimal(text)
        if seconds is None:
            raise UsageError(
                f"{key}: not a plain decimal number of seconds in ASCII digits (such as 120 "
                f"or 1.5): {text!r}"
            )
        return {field: seconds}
    count = ascii_int(text)
    if count is None:
        raise UsageError(f"{key}: not an integer in ASCII digits: {text!r}")
    return {field: count}


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
            err.write(f"recoverable config: {exc.code}: {safe_text(exc)}\n")
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
