"""Evidence helpers of the live tests (issue 16): no partial view is ever in the store.

The store's files (LMDB data and lock files, owner files) are read as bytes, stale pages
included: a view's text may appear there only as the beginning of the saved receipt."""

from __future__ import annotations

from pathlib import Path


def store_bytes(path: Path) -> dict[str, bytes]:
    files = {str(file): file.read_bytes() for file in sorted(path.rglob("*")) if file.is_file()}
    assert files, f"no files under {path}"
    return files


def assert_views_never_stored(
    path: Path, views: list[str], *, control: str, receipt: bytes | None = None
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
