"""Soak under fire: a multi-job host process, SIGKILLed at random moments and restarted.

Run as a script this is the *host*: the host loop of ``host_driver.py`` (prepare ->
persist the handle -> send_recovering -> commit keyed by (job, revision) ->
acknowledge after the commit) for N jobs at concurrency C in ONE process, with
the host's own durable state in SQLite. On every start it reconciles: saved
handles are reopened, orphaned SDK records (saved before their handle) are adopted
through inventory, committed jobs are acknowledged without being applied again,
and jobs whose operation ended in a typed terminal failure are recorded as
``failed`` (reported, never lost).

Imported, :func:`run_soak` is the orchestrator used by ``test_soak.py`` and
``bench/soak.py``: it starts the fixture provider as a separate process with
random faults, starts the host, SIGKILLs it K times at random moments (after
observed progress, plus random jitter, so kills land at every kind of boundary),
lets a last host finish, and checks the invariants against the host database,
the recovery store and the provider's request log.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import msgspec
import trio

import recoverable

ACCOUNT = recoverable.AccountBinding("acct-soak", "api-key")
DRIVER = str(Path(__file__).resolve())
# Typed terminal outcomes a host records as "failed" (budget spent, or not replaceable).
FAILED_CODES = frozenset({"attempts_exhausted", "permanently_failed"})
DEFAULT_FAULTS = "disconnect=0.08,rate_limited=0.05,server_error=0.04,stall=0.02,failed=0.03"


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


def job_name(i: int) -> str:
    return f"job-{i:05d}"


def open_host_db(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute(
        "CREATE TABLE IF NOT EXISTS handles (job TEXT, revision TEXT, handle BLOB,"
        " PRIMARY KEY (job, revision))"
    )
    db.execute(
        "CREATE TABLE IF NOT EXISTS commits (job TEXT, revision TEXT, result TEXT,"
        " operation_id TEXT, PRIMARY KEY (job, revision))"
    )
    # Not keyed: a second application of the same job would show up here as a duplicate.
    db.execute("CREATE TABLE IF NOT EXISTS commit_log (job TEXT, revision TEXT, operation_id TEXT)")
    db.execute(
        "CREATE TABLE IF NOT EXISTS failures (job TEXT, revision TEXT, operation_id TEXT,"
        " code TEXT, PRIMARY KEY (job, revision))"
    )
    db.execute("CREATE TABLE IF NOT EXISTS starts (at REAL, orphans_adopted INTEGER)")
    return db


# -- the host process -------------------------------------------------------------


class Host:
    def __init__(self, args: argparse.Namespace, db: sqlite3.Connection) -> None:
        self.args = args
        self.db = db
        self.revision = "r1"
        # The host opts in to replacing response.failed server_error explicitly (issue
        # 10.5: the library default replaces no provider code).
        self.policy = recoverable.RetryPolicy(
            initial_backoff=args.backoff, maximum_backoff=args.backoff * 4,
            retryable_provider_codes=frozenset({"server_error"}),
        )

    def _row(self, sql: str, job: str) -> Any:
        return self.db.execute(sql, (job, self.revision)).fetchone()

    def _transaction(self, *statements: tuple[str, tuple[Any, ...]]) -> None:
        # No await between BEGIN and COMMIT: other tasks never interleave with it.
        self.db.execute("BEGIN IMMEDIATE")
        try:
            for sql, params in statements:
                self.db.execute(sql, params)
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    async def run_job(
        self, rt: recoverable.Runtime, job: str, orphans: dict[str, list[str]]
    ) -> str:
        if self._row("SELECT 1 FROM failures WHERE job=? AND revision=?", job) is not None:
            return "failed"
        row = self._row("SELECT handle FROM handles WHERE job=? AND revision=?", job)
        if row is not None:
            handle = msgspec.json.decode(row[0], type=recoverable.Handle)
        else:
            adopted = orphans.get(job)
            if adopted:
                handle = recoverable.Handle(adopted[0])
            else:
                request = recoverable.StructuredRequest(
                    model="gpt-test", instructions="soak", input=f"{job} please"
                )
                handle = await rt.prepare(
                    request, response=Answer, maximum_attempts=self.args.max_attempts,
                    retry_policy=self.policy, job_id=job, input_revision=self.revision,
                )
            self._transaction((
                "INSERT INTO handles VALUES (?, ?, ?)",
                (job, self.revision, msgspec.json.encode(handle)),
            ))
        if self._row("SELECT 1 FROM commits WHERE job=? AND revision=?", job) is None:

            async def authorize(attempt: recoverable.Attempt) -> bool:
                return True

            try:
                value = await rt.send_recovering(handle, response=Answer, authorize=authorize)
            except recoverable.RecoveryError as exc:
                if exc.code not in FAILED_CODES:
                    raise
                self._transaction((
                    "INSERT OR IGNORE INTO failures VALUES (?, ?, ?, ?)",
                    (job, self.revision, handle.operation_id, exc.code),
                ))
                return "failed"
            if self._row("SELECT 1 FROM commits WHERE job=? AND revision=?", job) is None:
                result = json.dumps(msgspec.to_builtins(value))
                self._transaction(
                    ("INSERT INTO commits VALUES (?, ?, ?, ?)",
                     (job, self.revision, result, handle.operation_id)),
                    ("INSERT INTO commit_log VALUES (?, ?, ?)",
                     (job, self.revision, handle.operation_id)),
                )
        try:
            await rt.acknowledge(handle)
        except recoverable.StateUnavailable:
            pass  # acknowledged by an earlier run
        return "committed"

    async def run(self) -> dict[str, Any]:
        args = self.args
        store = recoverable.RecoveryStore.open(args.store)
        backend = recoverable.ResponsesBackend(
            args.base_url,
            credentials=recoverable.StaticCredentials("sk-soak", account=ACCOUNT),
            mode=args.mode,
            endpoint_id="fixture",
            limits=recoverable.StreamLimits(idle_timeout=args.idle_timeout, connect_timeout=10.0),
        )
        outcomes: Counter[str] = Counter()
        try:
            async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
                handled = {
                    r[0] for r in self.db.execute(
                        "SELECT job FROM handles WHERE revision=?", (self.revision,)
                    )
                }
                orphans: dict[str, list[str]] = {}
                for status in (await rt.inventory()).operations:
                    if (
                        status.job_id is not None
                        and status.job_id not in handled
                        and status.input_revision == self.revision
                        and status.state not in ("acknowledged", "abandoned")
                    ):
                        orphans.setdefault(status.job_id, []).append(status.operation_id)
                self._transaction((
                    "INSERT INTO starts VALUES (?, ?)", (time.time(), len(orphans))
                ))
                limiter = trio.CapacityLimiter(args.concurrency)

                async def one(job: str) -> None:
                    async with limiter:
                        outcomes[await self.run_job(rt, job, orphans)] += 1

                async with trio.open_nursery() as nursery:
                    for i in range(args.jobs):
                        nursery.start_soon(one, job_name(i))
        finally:
            store.close()
        return {"jobs": args.jobs, **outcomes}


def host_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="soak host: N jobs at concurrency C")
    parser.add_argument("--store", required=True)
    parser.add_argument("--host-db", required=True)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--mode", default="sse", choices=("sse", "websocket"))
    parser.add_argument("--jobs", type=int, default=150)
    parser.add_argument("--concurrency", type=int, default=30)
    parser.add_argument("--max-attempts", type=int, default=8)
    parser.add_argument("--backoff", type=float, default=0.02)
    parser.add_argument("--idle-timeout", type=float, default=1.0)
    args = parser.parse_args(argv)
    db = open_host_db(args.host_db)
    summary = trio.run(Host(args, db).run)
    db.close()
    print(json.dumps(summary), flush=True)
    return 0


# -- the orchestrator ---------------------------------------------------------------


@attrs.frozen
class SoakResult:
    jobs: int
    kills: int
    host_starts: int
    committed: int
    failed: int
    duplicates: int  # jobs applied more than once by the host
    lost: int  # jobs neither committed nor recorded as failed
    posts: int
    over_budget: list[str]  # operations with more POSTs than maximum_attempts
    posts_beyond_spent: list[str]  # operations with more POSTs than attempts recorded as spent
    foreign_posts: int  # POSTs whose operation the store does not know
    extra_operations: list[str]  # jobs with more than one SDK operation
    unacknowledged: list[str]  # committed jobs whose operation is not acknowledged
    failure_codes: dict[str, int]
    failed_attempts: dict[str, int]  # how the attempts of failed jobs' operations ended
    problems: list[str]  # store.check_integrity() and unreadable ids
    reply_kinds: dict[str, int]
    seconds: float
    adopted_orphans: int

    @property
    def violations(self) -> list[str]:
        found = []
        for name in ("over_budget", "posts_beyond_spent", "extra_operations", "unacknowledged",
                     "problems"):
            if getattr(self, name):
                found.append(f"{name}: {getattr(self, name)[:5]}")
        if self.duplicates:
            found.append(f"duplicates: {self.duplicates}")
        if self.lost:
            found.append(f"lost: {self.lost}")
        if self.foreign_posts:
            found.append(f"foreign_posts: {self.foreign_posts}")
        if set(self.failure_codes) - FAILED_CODES:
            found.append(f"unexpected failure codes: {self.failure_codes}")
        return found

    def summary(self) -> str:
        return (
            f"kills={self.kills} host_starts={self.host_starts} jobs={self.jobs} "
            f"committed={self.committed} failed={self.failed} duplicates={self.duplicates} "
            f"losses={self.lost} POSTs={self.posts} adopted_orphans={self.adopted_orphans} "
            f"seconds={self.seconds:.1f} replies={dict(sorted(self.reply_kinds.items()))}"
        )


class ProviderProcess:
    """The fixture provider in its own process (it keeps counting while hosts die)."""

    def __init__(self, faults: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c",
             "import sys; from recoverable.fixture.provider import fixture_main;"
             " sys.exit(fixture_main(sys.argv[1:]))", "--port", "0", "--faults", faults],
            stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError("the fixture provider did not start")
        info: dict[str, Any] = json.loads(line)
        self.http_url: str = info["http_url"]
        self.requests_url: str = info["requests_url"]

    def requests(self) -> list[dict[str, Any]]:
        import httpx

        log: list[dict[str, Any]] = httpx.get(self.requests_url, timeout=60).json()
        return log

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _committed_count(host_db: Path) -> int:
    if not host_db.exists():
        return 0
    try:
        db = sqlite3.connect(f"file:{host_db}?mode=ro", uri=True, timeout=5)
        try:
            (count,) = db.execute(
                "SELECT (SELECT COUNT(*) FROM commits) + (SELECT COUNT(*) FROM failures)"
            ).fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        return 0  # tables not created yet
    return int(count)


def run_soak(
    workdir: Path,
    *,
    jobs: int,
    concurrency: int,
    kills: int,
    max_attempts: int = 8,
    faults: str = DEFAULT_FAULTS,
    seed: int = 1,
    idle_timeout: float = 1.0,
    deadline: float = 600.0,
    log: Any = None,
    store: str | None = None,
    kill_backends: Any = None,
) -> SoakResult:
    """Run the whole soak in ``workdir`` and return what the checks found.

    ``store``: the store's location (default ``workdir/store``, LMDB; a PostgreSQL URL
    runs the same soak on that database). ``kill_backends``: called before each SIGKILL
    of the host (a PostgreSQL store: it terminates the backends serving the host's
    connections); the host must go on until the next progress before it is killed."""
    rng = random.Random(seed)
    started = time.monotonic()
    store_path = store or str(workdir / "store")
    host_db = workdir / "host.db"
    provider = ProviderProcess(f"{faults},seed={seed}" if faults else f"seed={seed}")
    try:
        command = [
            sys.executable, DRIVER, "--store", str(store_path), "--host-db", str(host_db),
            "--base-url", provider.http_url, "--jobs", str(jobs),
            "--concurrency", str(concurrency), "--max-attempts", str(max_attempts),
            "--idle-timeout", str(idle_timeout),
        ]
        done_kills = 0
        starts = 0
        finished = False
        while done_kills < kills and not finished:
            host = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
            starts += 1
            # Kill after observed progress (durable state, polled) plus random jitter.
            progress = _committed_count(host_db)
            # Spread the kills over the remaining work, so that all K happen before the end.
            step = max(1, (jobs - progress) // (kills - done_kills + 2))
            target = progress + rng.randint(0, 2 * step - 1)
            while host.poll() is None and _committed_count(host_db) < target:
                if time.monotonic() - started > deadline:
                    host.kill()
                    raise TimeoutError("the soak made no progress before its deadline")
                time.sleep(0.01)
            if kill_backends is not None and host.poll() is None:
                kill_backends()
                # The host survives losing its connections: it must make progress again.
                after = _committed_count(host_db) + 1
                while host.poll() is None and _committed_count(host_db) < after:
                    if time.monotonic() - started > deadline:
                        host.kill()
                        raise TimeoutError("no progress after the backends were killed")
                    time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.03))
            if host.poll() is None:
                host.send_signal(signal.SIGKILL)
                done_kills += 1
            _out, err = host.communicate()
            if host.returncode not in (0, -signal.SIGKILL):
                raise RuntimeError(f"host failed ({host.returncode}): {err[-3000:]}")
            if host.returncode == 0:
                finished = True
            if log is not None:
                log(f"host start {starts}: rc={host.returncode} "
                    f"progress={_committed_count(host_db)}/{jobs}")
        if not finished:
            final = subprocess.run(command, capture_output=True, text=True,
                                   timeout=max(60.0, deadline - (time.monotonic() - started)))
            starts += 1
            if final.returncode != 0:
                raise RuntimeError(f"final host failed ({final.returncode}): "
                                   f"{final.stderr[-3000:]}")
        return _check(workdir, provider.requests(), jobs=jobs, max_attempts=max_attempts,
                      kills=done_kills, starts=starts, seconds=time.monotonic() - started,
                      location=store_path)
    finally:
        provider.close()


def _check(
    workdir: Path,
    requests: list[dict[str, Any]],
    *,
    jobs: int,
    max_attempts: int,
    kills: int,
    starts: int,
    seconds: float,
    location: str,
) -> SoakResult:
    db = sqlite3.connect(workdir / "host.db")
    try:
        applied = Counter(j for (j,) in db.execute("SELECT job FROM commit_log"))
        committed = {j: op for j, op in db.execute("SELECT job, operation_id FROM commits")}
        failed = {j: code for j, code in db.execute("SELECT job, code FROM failures")}
        failed_op = {j: op for j, op in db.execute("SELECT job, operation_id FROM failures")}
        (adopted,) = db.execute("SELECT COALESCE(SUM(orphans_adopted), 0) FROM starts").fetchone()
    finally:
        db.close()
    store = recoverable.RecoveryStore.open(location)
    try:
        records, unreadable = store.inventory()
        problems = store.check_integrity() + [f"unreadable: {u}" for u in unreadable]
        # Every operation the store knows (live records and disposition markers).
        spent: dict[str, int] = {r.operation_id: r.attempts_used for r in records}
        failed_ops = set(failed_op.values())
        failed_attempts = Counter(
            (a.failure.kind + (f"/{a.failure.transport_code}" if a.failure.transport_code
                               else "")) if a.failure is not None else a.outcome
            for r in records if r.operation_id in failed_ops for a in r.attempts
        )
        job_of: dict[str, str | None] = {r.operation_id: r.job_id for r in records}
        budget: dict[str, int] = {r.operation_id: r.maximum_attempts for r in records}
        post_ops = {
            (r.get("attempt_id") or "").rsplit(".", 1)[0] for r in requests
        }
        dispositions: dict[str, Any] = {}
        for op in post_ops | set(committed.values()):
            if op in spent or not op:
                continue
            d = store.get_disposition(op)
            if d is not None:
                dispositions[op] = d
                spent[op] = d.attempts_used
                job_of[op] = d.job_id
                budget[op] = d.maximum_attempts
        for op in committed.values():
            if op not in dispositions:
                d = store.get_disposition(op)
                if d is not None:
                    dispositions[op] = d
    finally:
        store.close()
    posts_per_op = Counter((r.get("attempt_id") or "").rsplit(".", 1)[0] for r in requests)
    ops_per_job: dict[str, set[str]] = {}
    for op, job in job_of.items():
        if job is not None:
            ops_per_job.setdefault(job, set()).add(op)
    names = {job_name(i) for i in range(jobs)}
    return SoakResult(
        jobs=jobs,
        kills=kills,
        host_starts=starts,
        committed=len(committed),
        failed=len(failed),
        duplicates=sum(1 for n in applied.values() if n > 1) + len(set(committed) & set(failed)),
        lost=len(names - set(committed) - set(failed)),
        posts=len(requests),
        over_budget=sorted(
            op for op, n in posts_per_op.items() if n > budget.get(op, max_attempts)
            or n > max_attempts
        ),
        posts_beyond_spent=sorted(
            op for op, n in posts_per_op.items() if op in spent and n > spent[op]
        ),
        foreign_posts=sum(n for op, n in posts_per_op.items() if op not in spent),
        extra_operations=sorted(job for job, ops in ops_per_job.items() if len(ops) > 1),
        unacknowledged=sorted(
            job for job, op in committed.items()
            if op not in dispositions or dispositions[op].disposition != "acknowledged"
            or not dispositions[op].removal_complete
        ),
        failure_codes=dict(Counter(failed.values())),
        failed_attempts=dict(failed_attempts),
        problems=problems,
        reply_kinds=dict(Counter(str(r.get("reply_kind")) for r in requests)),
        seconds=seconds,
        adopted_orphans=int(adopted),
    )


if __name__ == "__main__":
    sys.exit(host_main())


__all__ = ["ACCOUNT", "DEFAULT_FAULTS", "Answer", "SoakResult", "host_main", "run_soak"]
