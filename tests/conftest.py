"""Make every property-based test's examples independent of test order and history.

``derandomize=True`` seeds Hypothesis from the test function alone, but two other inputs
change what it generates:

* Hypothesis (6.131 and later) mixes *local constants* into its draws: literals it collects
  from every non-test module of this project that is in ``sys.modules`` when an example is
  drawn. Which ``recoverable`` modules are imported depends on which tests ran before (a
  CLI test imports ``recoverable.cli``, ``pricing``, ...), so the same fuzzer drew different
  examples after ``tests/cli`` than alone. Importing the whole library here, before any test
  module, makes that pool the same for every order and every selection of tests.
* The example database (``.hypothesis/``) replays failures saved by earlier runs first;
  the suite keeps no state between runs (``-p no:cacheprovider``), so it is off by default.
"""

from __future__ import annotations

import atexit
import importlib
import os
import pkgutil
import shutil
import tempfile

from hypothesis import settings

import recoverable


def _cache_bytecode_outside_the_tree() -> None:
    """The suite starts hundreds of Python processes (CLI runs, crash hosts, workers,
    providers, bench scripts), each importing the whole library. Where the environment
    forbids writing bytecode (``PYTHONDONTWRITEBYTECODE``, e.g. a read-only or shared
    checkout), every one of them compiled all of it from source again: about a third of a
    CLI process's CPU. They get a bytecode cache in a temporary directory of this run
    instead (``PYTHONPYCACHEPREFIX``: nothing is written next to the sources), which the
    process that made it removes at exit. Set before pytest-xdist starts its workers, so
    they and every child inherit it; what the children run is unchanged."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or os.environ.get("PYTHONPYCACHEPREFIX"):
        return
    prefix = tempfile.mkdtemp(prefix="recoverable-pycache-")
    atexit.register(shutil.rmtree, prefix, ignore_errors=True)
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    del os.environ["PYTHONDONTWRITEBYTECODE"]


_cache_bytecode_outside_the_tree()


def _import_the_whole_library() -> None:
    for module in pkgutil.walk_packages(recoverable.__path__, "recoverable."):
        if module.name.rsplit(".", 1)[-1] == "__main__":
            continue  # runs the CLI
        importlib.import_module(module.name)


_import_the_whole_library()
# The PostgreSQL store's fixtures (pg_cluster, pg_url: a throwaway server, issue 17) and
# collector_off (tests/collector.py).
pytest_plugins = ["tests.pg.fixtures", "tests.collector"]

settings.register_profile("recoverable", database=None)
settings.load_profile("recoverable")
