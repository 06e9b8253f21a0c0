"""Helpers for tests that show what a path leaves to the cyclic garbage collector.

With the collector off (the ``collector_off`` fixture), objects freed by reference
counting are gone at once; what remains unreachable is exactly what only a collection
would free, and ``unreachable`` counts it by type name.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def unreachable(*type_names: str) -> int:
    """How many objects of these types only a collection would free."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    found = sum(1 for obj in gc.garbage if type(obj).__name__ in type_names)
    gc.set_debug(0)
    gc.garbage.clear()
    return found
