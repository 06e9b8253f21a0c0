"""Bounded listings: what a store command prints of a list that can be long.

A store holds as many operations as its quota allows, so a listing printed whole can be
hundreds of thousands of lines (``inventory`` of a large store, the ids a ``source set``
superseded). Every such listing is printed a page at a time: at most ``--limit`` items
(``0``: all, an explicit choice), in a stable order (by operation id), with the total
count, and where a listing can be resumed (``inventory``), the cursor of the next page
(``--after ID``: the items after that id).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final, Generic, TypeVar

import attrs

__all__ = ["DEFAULT_LIMIT", "MAX_LIMIT", "Page", "page"]

DEFAULT_LIMIT: Final = 1000  # items printed unless --limit says otherwise
MAX_LIMIT: Final = 1_000_000

Item = TypeVar("Item")


@attrs.frozen
class Page(Generic[Item]):
    items: tuple[Item, ...]
    total: int  # items in the whole listing (after the cursor's filter: no)
    next_after: str | None  # the cursor of the next page; None: this is the last page

    @property
    def more(self) -> int:
        """Items after this page."""
        return self.total - self.skipped - len(self.items)

    skipped: int = 0  # items before the cursor


def page(
    items: Sequence[Item], key: Callable[[Item], str], *, limit: int, after: str | None = None
) -> Page[Item]:
    """The page of ``items`` (ordered by ``key``) after ``after``, at most ``limit`` long
    (``0``: no limit)."""
    ordered = sorted(items, key=key)
    start = 0
    if after is not None:
        start = next(
            (index for index, item in enumerate(ordered) if key(item) > after), len(ordered)
        )
    end = len(ordered) if limit == 0 else min(len(ordered), start + limit)
    shown = tuple(ordered[start:end])
    next_after = key(shown[-1]) if shown and end < len(ordered) else None
    return Page(items=shown, total=len(ordered), next_after=next_after, skipped=start)
