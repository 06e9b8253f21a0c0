"""The files a batch reads and writes, told apart by what they are, not how they are named.

A batch reads the jobs file and the price table (``--prices``) and writes three things:
the result log (``--out``), the errors file (``--errors``) and the store (``--store``, a
directory unless it is a URL). A user can name one file twice without meaning to: a
symbolic link, a hard link, a relative path, ``--errors STORE/data.mdb``. Comparing the
spelled paths let an errors file empty the result log it was linked to (whose jobs the
next run then generated again), the jobs file, the price table and the store itself.

So, checked before anything is opened for writing (:func:`check_batch_files`):

- two names are the same file when they resolve to the same path (links followed) or,
  both existing, to the same device and inode (hard links);
- no output is an input, or the other output, or inside the store's directory;
- an output that exists must be a regular file; an existing errors file must be one a
  batch wrote (empty, or lines of its shape), because every run replaces it.

And the errors file is never truncated in place: it is written beside its path and
renamed over it when the run ends (``report.ErrorLog``), so a link there is replaced, never
followed into the file it names.
"""

from __future__ import annotations

import os
import stat

import attrs
import msgspec

__all__ = ["ERROR_LINE_KEYS", "BatchFiles", "check_batch_files", "is_error_line"]

# The keys of an ``--errors`` line in each output format (``report.ErrorLog``).
ERROR_LINE_KEYS: dict[str, frozenset[str]] = {
    "recoverable": frozenset(
        {"id", "revision", "line", "code", "reason", "operation_id", "message", "hint"}
    ),
    "openai-batch": frozenset({"id", "custom_id", "response", "error", "recoverable"}),
}
MAX_ERRORS_FILE_BYTES = 256 * 2**20  # an errors file larger than this is not read back


@attrs.frozen
class BatchFiles:
    """What one batch reads and writes (absolute or relative paths; the store may be a
    URL)."""

    jobs: str
    out: str
    store: str
    errors: str | None = None
    prices: str | None = None
    store_is_directory: bool = True


@attrs.frozen
class _Named:
    option: str  # the option that named it: "--out", "JOBS.jsonl", ...
    what: str  # what it is: "the result log (--out)", ...
    path: str
    real: str  # links resolved (the path need not exist)
    identity: tuple[int, int] | None  # (device, inode) when it exists


def _named(option: str, what: str, path: str) -> _Named:
    try:
        found = os.stat(path)  # follows links
        identity: tuple[int, int] | None = (found.st_dev, found.st_ino)
    except OSError:
        identity = None
    return _Named(option, what, path, os.path.realpath(path), identity)


def _same(one: _Named, other: _Named) -> bool:
    if one.real == other.real:
        return True
    return one.identity is not None and one.identity == other.identity


def _inside(path: _Named, directory: _Named) -> bool:
    return path.real == directory.real or path.real.startswith(directory.real.rstrip(os.sep)
                                                                + os.sep)


def is_error_line(line: bytes) -> bool:
    """Whether ``line`` is a line a batch writes to ``--errors`` (either format)."""
    try:
        value = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return False
    return isinstance(value, dict) and frozenset(value) in ERROR_LINE_KEYS.values()


def _out_file_problem(out: _Named) -> str | None:
    """Why an existing ``--out`` path cannot hold the result log, if it cannot."""
    try:
        found = os.stat(out.path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot use {out.path}: {exc.strerror}"
    if not stat.S_ISREG(found.st_mode):
        return (f"--out {out.path} is not a regular file: the results must be kept in a "
                "file (a rerun reads them back)")
    return None


def _errors_file_problem(errors: _Named) -> str | None:
    """Why an existing ``--errors`` path cannot be replaced, if it cannot."""
    try:
        found = os.stat(errors.path)
    except FileNotFoundError:
        return None  # nothing there (or a dangling link, which is replaced)
    except OSError as exc:
        return f"cannot use --errors {errors.path}: {exc.strerror}"
    if not stat.S_ISREG(found.st_mode):
        return f"--errors {errors.path} is not a regular file: use a file path"
    if found.st_size > MAX_ERRORS_FILE_BYTES:
        return (f"--errors {errors.path} is larger than any errors file a batch writes: it "
                "is not one; use another path")
    try:
        with open(errors.path, "rb") as fh:
            for line in fh:
                if line.strip() and not is_error_line(line.rstrip(b"\r\n")):
                    return (f"--errors {errors.path} exists and is not an errors file written "
                            "by recoverable batch (every run replaces it): use another path, "
                            "or remove it")
    except OSError as exc:
        return f"cannot read --errors {errors.path}: {exc.strerror}"
    return None


def check_batch_files(files: BatchFiles) -> str | None:
    """Why the batch's files cannot be used together, if they cannot (checked before
    anything is opened for writing): see the module docstring."""
    jobs = _named("JOBS.jsonl", "the jobs file", files.jobs)
    out = _named("--out", "the result log (--out)", files.out)
    inputs = [jobs]
    if files.prices is not None:
        inputs.append(_named("--prices", "the price table (--prices)", files.prices))
    outputs = [out]
    if files.errors is not None:
        outputs.append(_named("--errors", "the errors file (--errors)", files.errors))
    store = (
        _named("--store", "the store (--store)", files.store) if files.store_is_directory
        else None
    )
    problem = _out_file_problem(out)
    if problem is not None:
        return problem
    for index, output in enumerate(outputs):
        for other in [*inputs, *outputs[:index]]:
            if _same(output, other):
                return (f"{output.option} {output.path} is {other.what} itself "
                        f"({other.path}): use another {output.option} path")
        if store is not None and _inside(output, store):
            return (f"{output.option} {output.path} is inside the store {store.path}: use a "
                    "path outside it")
    if store is not None:
        for named in inputs:
            if _same(store, named):
                return (f"--store {store.path} is {named.what} itself: use a directory of "
                        "its own for the store")
    if len(outputs) > 1:
        return _errors_file_problem(outputs[1])
    return None
