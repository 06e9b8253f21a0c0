"""A separate process for the damaged-store tests (run by them, not collected).

Every outcome is printed as one line: ``ok ...``, ``error <code>`` (a typed
``RecoveryError``) or ``crash <type>`` (anything else), so the test can tell a
typed failure from a crash without parsing tracebacks.
"""

from __future__ import annotations

import os
import resource
import signal
import sys

from storage_helpers import make_op

from recoverable.errors import RecoveryError
from recoverable.storage import RecoveryStore


def attempt(what: str, fn: object) -> None:
    try:
        result = fn()  # type: ignore[operator]
    except RecoveryError as exc:
        print("error", exc.code, what, flush=True)
    except Exception as exc:  # the test fails on this line
        print("crash", type(exc).__name__, what, exc, flush=True)
    else:
        print("ok", what, result, flush=True)


def serve(store: RecoveryStore) -> None:
    """Obey stdin commands until EOF: ``write NAME``, ``read NAME``, ``size BYTES``."""
    print("ready", store.owner_id, flush=True)
    for line in sys.stdin:
        verb, _, arg = line.strip().partition(" ")
        if verb == "write":
            attempt(line.strip(), lambda a=arg: store.write_sync(
                lambda t: t.put_operation(make_op(a))
            ))
        elif verb == "read":
            attempt(line.strip(), lambda a=arg: store.get_operation(a) is not None)
        elif verb == "payload":  # write a payload of that many bytes (grows the map)
            name, size = arg.split()
            attempt(line.strip(), lambda n=name, s=int(size): store.write_sync(
                lambda t: t.put_payload(n, "body", b"x" * s)
            ))
        elif verb == "mapsize":
            attempt(line.strip(), lambda: store.stats()["map_size"])
        else:
            print("crash unknown", line.strip(), flush=True)


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "serve":
        initial = int(sys.argv[3]) if len(sys.argv) > 3 else None
        try:
            store = RecoveryStore.open(path, initial_map_size=initial)
        except RecoveryError as exc:
            print("error", exc.code, "open", flush=True)
            return
        with store:
            serve(store)
    elif mode == "open-write":  # open, write one record, close
        def open_write() -> str:
            with RecoveryStore.open(path) as store:
                store.write_sync(lambda t: t.put_operation(make_op(sys.argv[3])))
                return "written"

        attempt("open-write", open_write)
    elif mode == "file-size-limit":  # commits fail with EFBIG past RLIMIT_FSIZE
        with RecoveryStore.open(path) as store:
            store.write_sync(lambda t: t.put_payload("small-0", "body", b"s"))
            limit = os.path.getsize(os.path.join(path, "data.mdb")) + 64 * 1024
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
            attempt("big", lambda: store.write_sync(
                lambda t: t.put_payload("big", "body", os.urandom(1024 * 1024))
            ))
            attempt("small-1", lambda: store.write_sync(
                lambda t: t.put_payload("small-1", "body", b"s")
            ))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
