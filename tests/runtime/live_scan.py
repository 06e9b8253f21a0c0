"""Evidence helpers of the live tests (issue 16): no partial view is ever in the store.

LMDB: the store's files (data and lock files, owner files) are read as bytes, stale pages
included. PostgreSQL (issue 17): every row of every table of the database, each column's
bytes (a ``SELECT`` sees live rows only: dead tuples and the WAL are the server's, not the
contract's). Either way a view's text may appear only as the beginning of the saved
receipt."""

from __future__ import annotations

from pathlib import Path

import psycopg
from psycopg import sql


def _database_bytes(url: str) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    with psycopg.connect(url) as conn:
        tables = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
        ).fetchall()
        for (table,) in tables:
            rows = conn.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier(table)))
            found[table] = b"\x00".join(
                value if isinstance(value, bytes) else str(value).encode()
                for row in rows.fetchall() for value in row
            )
    return found


def store_bytes(path: Path | str) -> dict[str, bytes]:
    if isinstance(path, str) and path.startswith(("postgresql://", "postgres://")):
        rows = _database_bytes(path)
        assert rows, f"no tables in {path}"
        return rows
    root = Path(path)
    files = {str(file): file.read_bytes() for file in sorted(root.rglob("*")) if file.is_file()}
    assert files, f"no files under {root}"
    return files


def assert_views_never_stored(
    path: Path | str, views: list[str], *, control: str, receipt: bytes | None = None
) -> None:
    """No view's text is in the store, except as the start of the receipt's bytes.

    ``control``: a text the store does hold (the request's input): it proves the scan
    reads the files as they are.
    """
    files = store_bytes(path)
    assert any(control.encode() in data for data in files.values()), "the scan sees nothing"
    for text in views:
        needle = text.encode()
        if not needle or (receipt is not None and needle == receipt):
            continue
        for name, data in files.items():
            start = data.find(needle)
            while start != -1:
                assert receipt is not None and data.startswith(receipt, start), (
                    f"a partial view ({text!r}) is stored in {name} at {start}: "
                    f"{data[max(0, start - 40) : start + len(needle) + 40]!r}"
                )
                start = data.find(needle, start + 1)
