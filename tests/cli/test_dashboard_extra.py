"""The dashboard's web dependencies are an extra (``recoverable[dashboard]``): without
them every other command works, and ``recoverable dashboard`` says how to install them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from recoverable import RecoveryStore

# Runs the CLI with one of the dashboard's dependencies made unimportable (as if the extra
# were not installed): ``sys.modules[name] = None`` makes ``import name`` fail.
_WITHOUT = (
    "import sys; sys.modules[sys.argv[1]] = None;"
    " from recoverable.cli.entry import main; sys.exit(main(sys.argv[2:]))"
)


def _run(missing: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT, missing, *argv],
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize("missing", ["starlette", "hypercorn"])
def test_the_dashboard_without_its_extra_says_how_to_install_it(
    missing: str, tmp_path: Path
) -> None:
    done = _run(missing, "dashboard", "--store", str(tmp_path / "store"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"recoverable dashboard: needs {missing}, which is not installed: "
        "pip install 'recoverable[dashboard]'"
    )
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "store").exists()  # nothing opened or created


def test_the_other_commands_never_need_the_dashboard_s_extra(tmp_path: Path) -> None:
    RecoveryStore.open(str(tmp_path / "store")).close()
    done = _run("starlette", "inventory", "--store", str(tmp_path / "store"), "--account", "a",
                "--json")
    assert done.returncode == 0, done.stderr
    assert "starlette" not in done.stderr
