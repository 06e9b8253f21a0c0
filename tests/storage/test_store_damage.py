"""Stores damaged on purpose (issue 11.2-11.4): every damage fails closed, typed, never a crash.

Real files, real LMDB, real processes: the lock file removed or replaced under a
running writer, a truncated or emptied data file, a tampered frozen body, seeded
bit flips. Each outcome is checked in the process that meets it (a child prints
``error <code>``; the CLI exits 2 with a message), never a traceback or a signal.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import msgspec
import pytest
from storage_helpers import make_op, read_line

import recoverable
from recoverable.errors import CorruptRecord, StoreDamaged, StoreLockReplaced
from recoverable.storage import RecoveryStore
from recoverable.storage.keys import payload_key
from recoverable.testing import FixtureProvider, Reply

DAMAGE_CHILD = str(Path(__file__).with_name("damage_child.py"))
REPO = Path(__file__).resolve().parents[2]
ACCOUNT = recoverable.AccountBinding("acct-1", "api-key")


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RECOVERABLE_KILL_AT", None)
    env.pop("OPENAI_API_KEY", None)
    return env


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, DAMAGE_CHILD, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=child_env(),
    )


def ask(proc: subprocess.Popen[str], command: str) -> str:
    assert proc.stdin is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return read_line(proc)


def run_child(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, DAMAGE_CHILD, *args], capture_output=True, text=True, timeout=120,
        env=child_env(),
    )


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recoverable", *args], capture_output=True, text=True,
        timeout=180, cwd=REPO, env={**child_env(), **(env or {})}, errors="replace",
    )


def assert_no_crash(done: subprocess.CompletedProcess[str]) -> None:
    """Exited by itself (no signal: no Bus error, no abort) and without a traceback."""
    assert done.returncode >= 0, (done.returncode, done.stderr[-2000:])
    assert done.returncode in (0, 1, 2), (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    assert "Traceback" not in done.stdout, done.stdout[-4000:]


# -- 11.2: the lock file removed or replaced under a running writer -------------------------


def test_removed_lock_file_fails_closed_in_the_writer_and_in_a_second_process(
    store_path: str,
) -> None:
    writer = spawn("serve", store_path)
    try:
        assert read_line(writer).startswith("ready")
        assert ask(writer, "write a-0").startswith("ok")
        lock = Path(store_path, "lock.mdb")
        lock.unlink()
        second = run_child("open-write", store_path, "b-0")
        assert second.stdout.split()[:2] == ["error", "store_lock_replaced"], second
        assert not lock.exists()  # the refusing process did not create a new lock file
        assert ask(writer, "write a-1").split()[:2] == ["error", "store_lock_replaced"]
        assert ask(writer, "read a-0").split()[:2] == ["error", "store_lock_replaced"]
        assert ask(writer, "write a-2").split()[:2] == ["error", "store_lock_replaced"]
    finally:
        assert writer.stdin is not None
        writer.stdin.close()
        assert writer.wait(timeout=60) == 0
    # Once every process of the old lock file is gone, the store opens (a new lock file)
    # with exactly what was committed before the removal: nothing overwritten.
    with RecoveryStore.open(store_path) as store:
        assert store.get_operation("a-0") == make_op("a-0")
        assert store.get_operation("a-1") is None
        assert store.get_operation("a-2") is None
        assert store.get_operation("b-0") is None
        assert store.check_integrity() == []


def test_replaced_lock_file_fails_closed_in_the_writer_and_in_a_second_process(
    store_path: str,
) -> None:
    writer = spawn("serve", store_path)
    try:
        assert read_line(writer).startswith("ready")
        assert ask(writer, "write a-0").startswith("ok")
        lock = Path(store_path, "lock.mdb")
        shutil.copyfile(lock, Path(store_path, "lock.copy"))
        os.replace(Path(store_path, "lock.copy"), lock)  # same bytes, another file
        second = run_child("open-write", store_path, "b-0")
        assert second.stdout.split()[:2] == ["error", "store_lock_replaced"], second
        assert ask(writer, "write a-1").split()[:2] == ["error", "store_lock_replaced"]
    finally:
        assert writer.stdin is not None
        writer.stdin.close()
        assert writer.wait(timeout=60) == 0
    with RecoveryStore.open(store_path) as store:
        assert store.get_operation("a-0") == make_op("a-0")
        assert store.get_operation("a-1") is None and store.get_operation("b-0") is None
        assert store.check_integrity() == []


def test_removed_lock_file_in_this_process_is_a_typed_error(store_path: str) -> None:
    store = RecoveryStore.open(store_path)
    try:
        store.write_sync(lambda t: t.put_operation(make_op("a-0")))
        os.unlink(os.path.join(store_path, "lock.mdb"))
        with pytest.raises(StoreLockReplaced) as raised:
            store.write_sync(lambda t: t.put_operation(make_op("a-1")))
        assert raised.value.code == "store_lock_replaced"
        assert isinstance(raised.value, recoverable.errors.StorageUnavailable)
        with pytest.raises(StoreLockReplaced):
            store.inventory()
    finally:
        store.close()


def test_a_lock_file_left_by_nobody_is_recreated(store_path: str) -> None:
    """No living owner: the lock file can be recreated safely (nobody uses the old one)."""
    with RecoveryStore.open(store_path) as store:
        store.write_sync(lambda t: t.put_operation(make_op("a-0")))
    os.unlink(os.path.join(store_path, "lock.mdb"))
    with RecoveryStore.open(store_path) as store:
        assert store.get_operation("a-0") == make_op("a-0")
        store.write_sync(lambda t: t.put_operation(make_op("a-1")))


# -- 11.3: damaged data files -------------------------------------------------------------


def build_store(path: str, count: int = 120) -> None:
    with RecoveryStore.open(path) as store:
        for start in range(0, count, 40):
            def fill(t: recoverable.storage.WriteTxn, start: int = start) -> None:
                for i in range(start, min(count, start + 40)):
                    t.put_operation(make_op(f"op-{i:04d}"))
                    t.put_payload(f"op-{i:04d}", "body", os.urandom(3000))

            store.write_sync(fill)


def test_half_truncated_data_file_is_typed_damage_in_every_process(
    store_path: str, tmp_path: Path
) -> None:
    build_store(store_path)
    data = Path(store_path, "data.mdb")
    size = data.stat().st_size
    os.truncate(data, size // 2)

    # Other processes first: before the fix, opening this store ended in a Bus error.
    child = run_child("open-write", store_path, "x")
    assert child.stdout.split()[:2] == ["error", "store_damaged"], child
    for args in (
        ("inventory", "--store", store_path, "--account", "batch"),
        ("status", "--store", store_path, "--account", "batch", "op-0001"),
        ("batch", str(REPO / "examples" / "jobs.jsonl"), "--out", str(tmp_path / "out.jsonl"),
         "--store", store_path),
    ):
        done = run_cli(*args)
        assert_no_crash(done)
        assert done.returncode == 2, (args, done.stderr)
        assert "damaged" in done.stderr, (args, done.stderr)
    assert data.stat().st_size == size // 2  # nothing written over the damage
    with pytest.raises(StoreDamaged, match="truncated"):
        RecoveryStore.open(store_path)


@pytest.mark.parametrize("neighbour", ["lock.mdb", "owners"])
def test_zero_length_data_file_next_to_a_used_store_is_damage_not_a_new_store(
    store_path: str, tmp_path: Path, neighbour: str
) -> None:
    build_store(store_path, count=10)
    data = Path(store_path, "data.mdb")
    os.truncate(data, 0)
    if neighbour == "lock.mdb":
        shutil.rmtree(Path(store_path, "owners"))
    else:
        Path(store_path, "lock.mdb").unlink()
    with pytest.raises(StoreDamaged, match="empty"):
        RecoveryStore.open(store_path)
    done = run_cli("inventory", "--store", store_path, "--account", "batch")
    assert_no_crash(done)
    assert done.returncode == 2 and "damaged" in done.stderr, done.stderr
    done = run_cli(
        "batch", str(REPO / "examples" / "jobs.jsonl"), "--out", str(tmp_path / "out.jsonl"),
        "--store", store_path,
    )
    assert_no_crash(done)
    assert done.returncode == 2 and "damaged" in done.stderr, done.stderr
    assert data.stat().st_size == 0  # never initialized as a new store
    assert not (tmp_path / "out.jsonl").exists() or (tmp_path / "out.jsonl").read_text() == ""


def test_missing_data_file_of_a_used_store_is_damage(store_path: str) -> None:
    build_store(store_path, count=5)
    Path(store_path, "data.mdb").unlink()
    with pytest.raises(StoreDamaged, match="missing"):
        RecoveryStore.open(store_path)
    assert not Path(store_path, "data.mdb").exists()


def test_a_file_that_is_not_an_lmdb_data_file_is_damage(store_path: str) -> None:
    build_store(store_path, count=5)
    data = Path(store_path, "data.mdb")
    data.write_bytes(b"\0" * data.stat().st_size)
    with pytest.raises(StoreDamaged):
        RecoveryStore.open(store_path)


def leaf_node_of(data: bytes, marker: bytes, page_size: int = 4096) -> tuple[int, int]:
    """(page offset, node offset in the page) of the leaf node whose value holds ``marker``."""
    for offset in range(2 * page_size, len(data), page_size):
        flags, lower = struct.unpack_from("=HH", data, offset + 10)
        if flags & 0x02 == 0:
            continue
        for i in range((lower - 16) // 2):
            ptr = struct.unpack_from("=H", data, offset + 16 + 2 * i)[0]
            if marker in data[offset + ptr : offset + ptr + 200]:
                return offset, ptr
    raise AssertionError("marker not found")


@pytest.mark.parametrize("damage", ["value size", "page number"])
def test_a_damaged_page_is_found_at_open_before_lmdb_writes_through_it(
    store_path: str, damage: str
) -> None:
    """LMDB trusts node sizes and page numbers (copying such a page at the next write
    corrupts memory or writes it to the wrong place): the walk at open refuses them."""
    with RecoveryStore.open(store_path) as store:
        store.write_sync(lambda t: t.put_payload("marked", "body", b"MARKER" * 20))
    path = Path(store_path, "data.mdb")
    data = bytearray(path.read_bytes())
    page, node = leaf_node_of(bytes(data), b"MARKER")
    if damage == "value size":
        struct.pack_into("=H", data, page + node + 2, 0x7FFF)  # mn_hi: a value of ~2 GiB
    else:
        struct.pack_into("=Q", data, page, 7777)  # the page header names another page
    path.write_bytes(bytes(data))
    with pytest.raises(StoreDamaged):
        RecoveryStore.open(store_path)
    child = run_child("open-write", store_path, "x")
    assert child.stdout.split()[:2] == ["error", "store_damaged"], child


def test_a_free_list_key_newer_than_the_snapshot_is_damage_not_an_abort(
    store_path: str,
) -> None:
    """A flipped bit in a free-page list key (the id of the transaction that freed the
    pages) made LMDB abort the process at the next write (``mdb_freelist_save``: Assertion
    'pglast <= env->me_pglast', seen in a seeded bit-flip run): the walk at open refuses
    a key newer than the snapshot."""
    with RecoveryStore.open(store_path) as store:
        def churn(txn: recoverable.storage.WriteTxn, round_: int) -> None:
            txn.delete_payload(f"p{round_ - 1}", "body")
            txn.put_payload(f"p{round_}", "body", bytes([round_]) * 9000)

        for round_ in range(6):  # frees pages: the free-page list has entries
            store.write_sync(lambda txn, r=round_: churn(txn, r))
    path = Path(store_path, "data.mdb")
    data = bytearray(path.read_bytes())
    psize = 4096
    # The newer of the two meta pages (the fields after each page's 16-byte header).
    metas = [struct.unpack_from("=IIQQI44x48xQQ", data, offset + 16) for offset in (0, psize)]
    meta_offset = max((0, psize), key=lambda offset: metas[offset // psize][-1])
    free_root = struct.unpack_from("=40xQ", data, meta_offset + 16 + 24)[0]
    assert free_root != 2**64 - 1, "the free-page list is empty: nothing to damage"
    page = free_root * psize
    flags, lower = struct.unpack_from("=HH", data, page + 10)
    assert flags & 0x02 and lower > 16  # a leaf with nodes
    ptr = struct.unpack_from("=H", data, page + 16)[0]
    key_at = page + ptr + 8
    (key,) = struct.unpack_from("=Q", data, key_at)
    struct.pack_into("=Q", data, key_at, key | 1 << 40)  # a transaction from the future
    path.write_bytes(bytes(data))
    with pytest.raises(StoreDamaged, match="free-page list"):
        RecoveryStore.open(store_path)
    child = run_child("open-write", store_path, "x")
    assert child.stdout.split()[:2] == ["error", "store_damaged"], child


def test_a_brand_new_directory_is_still_a_new_store(tmp_path: Path) -> None:
    path = tmp_path / "fresh"
    path.mkdir()
    with RecoveryStore.open(path) as store:
        assert store.inventory() == ([], [])


# -- 11.4: a tampered frozen body is never sent ----------------------------------------------


def tamper_payload(store_path: str, operation_id: str, old: bytes, new: bytes) -> None:
    """Edit the stored body bytes in LMDB directly (no library code)."""
    env = lmdb.open(store_path, max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(b"payloads", txn=txn)
            key = operation_id.encode() + b"\0body"
            body = txn.get(key, db=db)
            assert body is not None and old in body
            txn.put(key, body.replace(old, new), db=db)
    finally:
        env.close()


async def test_a_tampered_body_is_refused_before_any_post_and_reported(
    store_path: str,
) -> None:
    request = recoverable.StructuredRequest(
        model="gpt-test", instructions="Describe it.", input="Describe item 175."
    )
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.complete({"answer": 1, "note": "ok"})])

        def backend() -> recoverable.ResponsesBackend:
            creds = recoverable.StaticCredentials("sk-test-secret", account=ACCOUNT)
            return recoverable.ResponsesBackend(
                provider.http_url, credentials=creds, mode="sse", endpoint_id="fixture"
            )

        with RecoveryStore.open(store_path) as store:
            async with recoverable.open_runtime(store, backend(), account=ACCOUNT) as rt:
                handle = await rt.prepare(request, response=Answer, maximum_attempts=3)
            assert store.check_integrity() == []
        tamper_payload(store_path, handle.operation_id, b"item 175", b"item 999")

        with RecoveryStore.open(store_path) as store:
            key = handle.operation_id.encode()
            record_before = store.get_raw("operations", key)
            body_before = store.get_payload(handle.operation_id, "body")
            problems = store.check_integrity()
            assert any("body" in p and "digest" in p for p in problems), problems
            async with recoverable.open_runtime(store, backend(), account=ACCOUNT) as rt:
                calls: list[recoverable.Attempt] = []

                async def authorize(attempt: recoverable.Attempt) -> bool:
                    calls.append(attempt)
                    return True

                with pytest.raises(CorruptRecord, match="digest"):
                    await rt.send_recovering(handle, response=Answer, authorize=authorize)
                with pytest.raises(CorruptRecord):  # every time: nothing was rewritten
                    await rt.send_recovering(handle, response=Answer, authorize=authorize)
            assert calls == []  # nothing authorized, nothing spent
            assert store.get_raw("operations", key) == record_before
            assert store.get_payload(handle.operation_id, "body") == body_before
        assert len(provider.requests) == 0


async def test_a_body_tampered_after_an_interrupted_attempt_is_never_sent_as_its_replacement(
    store_path: str,
) -> None:
    """The digest is checked before EVERY transmission, not only the first (issue 29.1).

    Attempt 1 is dropped mid-stream, the host declines its replacement (nothing spent, the
    pending id kept), and the stored frozen body is then replaced under the record. Reopening
    (the replacement's execution) must refuse it as a corrupt record before asking the host:
    no authorization, no second POST, nothing spent, nothing rewritten."""
    request = recoverable.StructuredRequest(
        model="gpt-test", instructions="Describe it.", input="Describe item 175."
    )
    fast = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
    async with FixtureProvider.serve() as provider:
        provider.script(
            [Reply.disconnect(after_events=2), Reply.complete({"answer": 2, "note": "x"})]
        )
        creds = recoverable.StaticCredentials("sk-test-secret", account=ACCOUNT)
        backend = recoverable.ResponsesBackend(
            provider.http_url, credentials=creds, mode="sse", endpoint_id="fixture"
        )
        calls: list[recoverable.Attempt] = []

        async def first_only(attempt: recoverable.Attempt) -> bool:
            calls.append(attempt)
            return attempt.number == 1

        with RecoveryStore.open(store_path) as store:
            async with recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
                handle = await rt.prepare(
                    request, response=Answer, maximum_attempts=3, retry_policy=fast
                )
                op_id = handle.operation_id
                with pytest.raises(recoverable.AttemptNotAuthorized):
                    await rt.send_recovering(handle, response=Answer, authorize=first_only)
                assert [a.number for a in calls] == [1, 2]
                interrupted = store.get_operation(op_id)
                assert interrupted is not None and interrupted.attempts_used == 1
                assert interrupted.pending is not None  # the replacement is still to come
                assert len(provider.requests) == 1
                body = store.get_payload(op_id, "body")
                assert body is not None and b"item 175" in body
                tampered = body.replace(b"item 175", b"item 999")
                await store.write(
                    lambda txn: txn.put_raw("payloads", payload_key(op_id, "body"), tampered)
                )
                record_before = store.get_raw("operations", op_id.encode())
                asked: list[recoverable.Attempt] = []

                async def approve(attempt: recoverable.Attempt) -> bool:
                    asked.append(attempt)
                    return True

                for _ in range(2):  # every time: nothing was rewritten
                    with pytest.raises(CorruptRecord, match="digest"):
                        await rt.send_recovering(handle, response=Answer, authorize=approve)
                assert asked == []  # the host was never asked: nothing authorized or spent
                assert store.get_raw("operations", op_id.encode()) == record_before
                assert store.get_payload(op_id, "body") == tampered
                status = await rt.status(handle)
                assert status.attempts_used == 1
        assert len(provider.requests) == 1  # the replacement was never sent


async def test_a_manual_retry_never_reuses_a_tampered_body(store_path: str) -> None:
    request = recoverable.StructuredRequest(
        model="gpt-test", instructions="Describe it.", input="Describe item 175."
    )
    fast = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
    async with FixtureProvider.serve() as provider:
        provider.script([Reply.disconnect(after_events=2)])

        def backend() -> recoverable.ResponsesBackend:
            creds = recoverable.StaticCredentials("sk-test-secret", account=ACCOUNT)
            return recoverable.ResponsesBackend(
                provider.http_url, credentials=creds, mode="sse", endpoint_id="fixture"
            )

        async def approve(attempt: recoverable.Attempt) -> bool:
            return True

        with RecoveryStore.open(store_path) as store:
            async with recoverable.open_runtime(store, backend(), account=ACCOUNT) as rt:
                handle = await rt.prepare(
                    request, response=Answer, maximum_attempts=1, retry_policy=fast
                )
                with pytest.raises(recoverable.AttemptsExhausted):
                    await rt.send_recovering(handle, response=Answer, authorize=approve)
        posts = len(provider.requests)
        tamper_payload(store_path, handle.operation_id, b"item 175", b"item 999")
        with RecoveryStore.open(store_path) as store:
            async with recoverable.open_runtime(store, backend(), account=ACCOUNT) as rt:
                with pytest.raises(CorruptRecord, match="digest"):
                    await rt.retry(handle, retry_action_id="click", maximum_attempts=2)
            records, _ = store.inventory()
            assert [r.operation_id for r in records] == [handle.operation_id]  # no successor
        assert len(provider.requests) == posts


# -- 11.3: seeded bit flips -----------------------------------------------------------------


def flip_bits(path: Path, seed: int, flips: int) -> None:
    rng = random.Random(seed)
    data = bytearray(path.read_bytes())
    for _ in range(flips):
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def write_jobs(path: Path, count: int) -> None:
    """``count`` distinct jobs made from the examples with a text input."""
    examples = [json.loads(line) for line in (REPO / "examples" / "jobs.jsonl").open()]
    examples = [job for job in examples if isinstance(job["input"], str)]
    with path.open("w") as out:
        for i in range(count):
            job = dict(examples[i % len(examples)])
            job["id"] = f"job-{i:04d}"
            job["input"] = f"{job['input']} (item {i})"
            out.write(json.dumps(job) + "\n")


@pytest.fixture(scope="module")
def batch_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A store left by a real batch SIGKILLed mid-run (receipts, leases, prepared jobs)."""
    base = tmp_path_factory.mktemp("flips")
    jobs = base / "jobs.jsonl"
    write_jobs(jobs, 200)
    done = run_cli(
        "batch", str(jobs), "--out", str(base / "out.jsonl"), "--store", str(base / "store"),
        "--endpoint", "fixture", env={"RECOVERABLE_KILL_AT": "receipt.saved@100"},
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    with RecoveryStore.open(base / "store") as store:
        assert len(store.inventory()[0]) > 20  # plenty of live records to damage
    return jobs, base / "store"


@pytest.mark.parametrize("seed", range(8))
def test_seeded_bit_flips_give_typed_failures_never_a_crash(
    batch_store: tuple[Path, Path], tmp_path: Path, seed: int
) -> None:
    """100 flipped bits: inventory, status and a batch rerun report typed failures (or
    work), never a signal (Bus error, segfault, abort) or a traceback. Most flips that
    hit LMDB's own pages are found by the page walk at open (``StoreDamaged``), before
    LMDB could write through them; flips in values are unreadable records or a body
    digest mismatch."""
    jobs, original = batch_store
    store = tmp_path / "store"
    shutil.copytree(original, store)
    flip_bits(store / "data.mdb", seed, flips=100)
    assert_no_crash(run_cli("inventory", "--store", str(store), "--account", "batch"))
    # (`inventory --json` with undecodable ids is issue 11.9, fixed in the CLI separately.)
    assert_no_crash(run_cli("status", "--store", str(store), "--account", "batch", "op-unknown"))
    done = run_cli(
        "batch", str(jobs), "--out", str(tmp_path / "again.jsonl"), "--store", str(store),
        "--endpoint", "fixture",
    )
    assert_no_crash(done)
