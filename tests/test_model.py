"""Model-based test: random interleavings of the public API against the REAL system.

Two runtimes share one real LMDB store (same process) and talk over real sockets to
an in-process fixture provider. Hypothesis draws each next action: prepare, send (in a
background task, on either runtime, with a drawn plan of host answers: approve, deny,
or *hold* the authorization until a later step releases it), release a held send
(approving or denying), cancel the task of a held send (suspends), suspend, cancel,
acknowledge, abandon, manual retry, sign out / sign in (the same or another account),
status, receipt, scripted provider replies, and restarting a runtime.

Deterministic where it claims to be: no outcome depends on timing. The provider never
stalls, cooldowns are zero, and after every step the model waits until every running
send is *quiet*: finished, or parked in a held authorization (the only place a send
waits on the model). So each example replays exactly and Hypothesis can shrink it.
The only clocks are a hang guard per step and an idle timeout that no reply reaches.

Invariants, checked from durable state after every step:

- ``attempts_used <= maximum_attempts`` and it never decreases (no refund);
- POSTs per operation (the provider's log) never exceed its budget, nor the attempts
  durably spent; none after its receipt was saved; none after acknowledgement;
- a permanently cancelled operation never delivers to a send started after the cancel
  returned, and its receipt is refused; an acknowledged one never delivers again;
- a signed-out runtime makes no POST (the provider tells runtimes apart by their
  token) and delivers no value; a value is delivered only while the runtime is signed
  in to the operation's account;
- manual retry creates one linked successor that has not generated, leaves the
  source's spent budget as it was, returns the same successor for the same action and
  settings, and refuses another action with ``RetryAlreadyCreated``;
- every record decodes (no unreadable id, ``check_integrity`` clean);
- every send ends with a value, a typed ``RecoveryError`` or the Cancelled we caused,
  and nothing hangs.

Sign-out: today ``sign_out`` only clears the account, so a send parked in a held
authorization stays parked and, released while signed out, ends with
``AccountChanged``; a change under way makes sign-out stop running work and record an
interruption instead. The oracle accepts both: a send parked at sign-out may end at the
sign-out or later with a typed error, or deliver only if released after signing in again
to its own account; in no case may the signed-out runtime POST.

The budget: ``RECOVERABLE_MODEL_EXAMPLES`` (default 100) examples of up to
``RECOVERABLE_MODEL_STEPS`` (default 30) steps; ``docs/testing.md`` gives a nightly
size. The test asserts floors on how many interesting steps the run executed.
"""

from __future__ import annotations

import inspect
import os
import random
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import recoverable
from recoverable.testing import FixtureProvider, Reply
from recoverable.transport.base import token_fingerprint
from tests.pg.cluster import Cluster
from tests.pg.fixtures import new_database

ACCOUNT = recoverable.AccountBinding("acct-model", "api-key")
OTHER = recoverable.AccountBinding("acct-other", "api-key")
REQUEST = recoverable.StructuredRequest(model="m", instructions="model test", input="x")
POLICY = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.0)
# No reply stalls, so neither timeout is ever reached: they only bound a real hang.
LIMITS = recoverable.StreamLimits(idle_timeout=60.0, connect_timeout=30.0)
STEP_GUARD = 30.0  # no single step may take this long: that would be a hang
EXAMPLES = int(os.environ.get("RECOVERABLE_MODEL_EXAMPLES", "100"))
PG_EXAMPLES = int(os.environ.get("RECOVERABLE_MODEL_PG_EXAMPLES", "15"))
pytestmark = pytest.mark.both_stores
_PG_CLUSTER: list[Cluster | None] = [None]
STEPS = int(os.environ.get("RECOVERABLE_MODEL_STEPS", "30"))


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


FAULTS: list[Callable[[], Reply]] = [
    lambda: Reply.disconnect(after_events=2),
    lambda: Reply.disconnect(after_events=0),
    lambda: Reply.rate_limited(retry_after=0.0),
    lambda: Reply.http_error(500),
    lambda: Reply.failed("server_error"),
    lambda: Reply.unauthorized(),
    lambda: Reply.invalid_json(),
    lambda: Reply.quota_exceeded(),
    lambda: Reply.tool_call(),
    lambda: Reply.complete({"answer": 7, "note": "scripted"}),
    lambda: Reply.synthesize(),
]

ACTIONS = [
    "prepare", "prepare", "script", "script", "script", "restart", "release", "release", "release",
    "release", "cancel_task", "release_all", "send", "send", "send", "send", "send", "send",
    "send", "send", "send", "send", "suspend", "suspend", "cancel", "acknowledge",
    "acknowledge", "abandon", "status", "receipt", "receipt", "retry", "retry", "retry",
    "sign_out", "sign_out", "sign_in", "sign_in", "sign_in",
]
OP_ACTIONS = frozenset({"send", "suspend", "cancel", "acknowledge", "abandon", "status",
                        "receipt", "retry"})
DECISIONS = ["approve", "approve", "approve", "hold", "hold", "deny"]

# Floors for the default budget, about 60 % of what it measured (the run is
# deterministic: the same counts every time; the margin absorbs intended behaviour
# changes). A change that makes the model stop reaching these paths fails here.
FLOORS = {
    "examples": 100, "steps": 1500, "sends": 330, "values": 120, "posts": 95,
    "replaced": 12, "holds": 35, "released": 18, "suspend_ok": 45, "cancel_ok": 25,
    "held_suspended": 7, "ack_ok": 18, "abandon_ok": 20, "retry_created": 4,
    "retry_refused": 95, "retry_same_child": 2, "sign_out": 70, "sign_in": 110,
    "signed_out_refused": 40, "held_at_sign_out": 3, "restarts": 50, "receipt_ok": 13,
    "cancel_task": 3,
}


@dataclass
class ModelOp:
    handle: recoverable.Handle
    maximum: int
    account: recoverable.AccountBinding
    attempts_seen: int = 0
    posts_at_receipt: int | None = None  # POSTs counted when the receipt was first seen
    cancelled_at: int | None = None  # clock value when a cancel() returned
    acknowledged_at: int | None = None
    posts_at_ack: int | None = None
    disposed: bool = False  # acknowledged or abandoned
    children: dict[tuple[str, int], str] = field(default_factory=dict)  # (action, max)


@dataclass
class SendTask:
    op: str
    slot: int
    started_at: int
    decisions: list[str]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)
    quiet: trio.Event = field(default_factory=trio.Event)  # parked or done
    release: trio.Event = field(default_factory=trio.Event)
    answer: bool = True
    held: bool = False
    calls: int = 0
    held_at_sign_out: bool = False
    outcome: str = "running"


class RuntimeSlot:
    """One runtime, opened in its own task so that it can be closed and reopened."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.token = f"sk-model-{index}"
        self.rt: recoverable.Runtime | None = None
        self.nursery: trio.Nursery | None = None
        self.account: recoverable.AccountBinding | None = ACCOUNT  # as the model knows it
        self.posts_at_sign_out: int | None = None
        self.stop = trio.Event()
        self.stopped = trio.Event()

    async def hold(
        self,
        store: recoverable.RecoveryStore,
        provider: FixtureProvider,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        backend = recoverable.ResponsesBackend(
            provider.http_url, mode="sse", endpoint_id="fixture", limits=LIMITS,
            credentials=recoverable.StaticCredentials(self.token, account=ACCOUNT),
        )
        try:
            async with backend, recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
                async with trio.open_nursery() as nursery:
                    self.rt, self.nursery = rt, nursery
                    task_status.started()
                    await self.stop.wait()
                    nursery.cancel_scope.cancel()  # running sends are suspended
        finally:
            self.rt = self.nursery = None
            self.stopped.set()


class Model:
    def __init__(
        self, store: recoverable.RecoveryStore, provider: FixtureProvider, stats: Counter[str]
    ) -> None:
        self.store = store
        self.provider = provider
        self.stats = stats
        self.ops: dict[str, ModelOp] = {}
        self.sends: list[SendTask] = []
        self.slots: list[RuntimeSlot] = []
        self.clock = 0  # a logical clock: bumped at every observable event
        self.violations: list[str] = []
        self.log: list[str] = []  # the actions drawn, for the failure report

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def posts(self, op: str) -> int:
        return sum(1 for r in self.provider.requests if (r.attempt_id or "").startswith(op + "."))

    def posts_by(self, slot: RuntimeSlot) -> int:
        tag = "Bearer " + token_fingerprint(slot.token)
        return sum(1 for r in self.provider.requests if r.headers.get("authorization") == tag)

    async def send(self, slot: RuntimeSlot, task: SendTask) -> None:
        rt = slot.rt
        assert rt is not None
        self.stats["sends"] += 1

        async def authorize(attempt: recoverable.Attempt) -> bool:
            decision = task.decisions[task.calls] if task.calls < len(task.decisions) else (
                "approve")
            task.calls += 1
            if decision != "hold":
                return decision == "approve"
            self.stats["holds"] += 1
            task.held = True
            task.quiet.set()
            try:
                await task.release.wait()
            finally:
                task.held = False
                task.quiet = trio.Event()
                task.release = trio.Event()
            return task.answer

        try:
            with task.scope:
                try:
                    value = await rt.send_recovering(
                        self.ops[task.op].handle, response=Answer, authorize=authorize
                    )
                except recoverable.RecoveryError as exc:
                    task.outcome = exc.code
                else:
                    assert isinstance(value, Answer)
                    task.outcome = "value"
                    self.stats["values"] += 1
                    self.delivered(task, slot)
            if task.scope.cancelled_caught:
                task.outcome = "cancelled"
        except trio.Cancelled:
            task.outcome = "cancelled"  # the runtime was closed under it
            raise
        except Exception as exc:  # an untyped error is a violation, not a crash of the test
            task.outcome = f"untyped:{type(exc).__name__}"
            self.violations.append(f"send of {task.op} raised {exc!r}")
        finally:
            self.stats[f"send:{task.outcome}"] += 1
            task.done.set()
            task.quiet.set()

    def delivered(self, task: SendTask, slot: RuntimeSlot) -> None:
        m = self.ops[task.op]
        if m.cancelled_at is not None and task.started_at > m.cancelled_at:
            self.violations.append(f"{task.op}: delivered after a permanent cancel")
        if m.acknowledged_at is not None and task.started_at > m.acknowledged_at:
            self.violations.append(f"{task.op}: delivered after acknowledgement")
        if slot.account != m.account:
            self.violations.append(f"{task.op}: delivered while signed in as {slot.account}")

    async def quiesce(self) -> None:
        """Wait until every send has finished or is parked in a held authorization."""
        while True:
            # Let every runnable task run (a cancelled parked send unparks here); tasks
            # waiting on the store's writer thread look blocked, hence the flags below.
            await trio.testing.wait_all_tasks_blocked()
            busy = [t for t in self.sends if not t.done.is_set() and not t.held]
            if not busy:
                return
            for task in busy:
                await task.quiet.wait()

    async def call(self, what: str, fn: Callable[[], Any]) -> str:
        try:
            await fn()
        except recoverable.RecoveryError as exc:
            return exc.code
        except Exception as exc:
            self.violations.append(f"{what} raised {exc!r}")
            return "untyped"
        return "ok"

    def check(self) -> None:
        """The invariants, read from durable state after every step."""
        records, unreadable = self.store.inventory()
        if unreadable:
            self.violations.append(f"unreadable records: {unreadable}")
        problems = self.store.check_integrity()
        if problems:
            self.violations.append(f"integrity: {problems[:3]}")
        by_id = {r.operation_id: r for r in records}
        for op, m in self.ops.items():
            posts = self.posts(op)
            record = by_id.get(op)
            if record is not None:
                used, maximum = record.attempts_used, record.maximum_attempts
                if record.has_completion and m.posts_at_receipt is None:
                    m.posts_at_receipt = posts
                if record.phase == "cancelled" and m.cancelled_at is None:
                    m.cancelled_at = self.clock
            else:
                disposition = self.store.get_disposition(op)
                if disposition is None:
                    self.violations.append(f"{op}: record vanished without a disposition")
                    continue
                used, maximum = disposition.attempts_used, disposition.maximum_attempts
            if maximum != m.maximum:
                self.violations.append(f"{op}: maximum changed {m.maximum} -> {maximum}")
            if used > maximum:
                self.violations.append(f"{op}: attempts_used {used} > maximum {maximum}")
            if used < m.attempts_seen:
                self.violations.append(f"{op}: attempts_used went back {m.attempts_seen}->{used}")
            m.attempts_seen = max(m.attempts_seen, used)
            if posts > maximum:
                self.violations.append(f"{op}: {posts} POSTs > budget {maximum}")
            if posts > used:
                self.violations.append(f"{op}: {posts} POSTs > attempts spent {used}")
            if m.posts_at_receipt is not None and posts > m.posts_at_receipt:
                self.violations.append(f"{op}: POST after its receipt was saved")
            if m.posts_at_ack is not None and posts > m.posts_at_ack:
                self.violations.append(f"{op}: POST after acknowledgement")
        for slot in self.slots:
            if slot.posts_at_sign_out is not None and self.posts_by(slot) > slot.posts_at_sign_out:
                self.violations.append(f"runtime {slot.index} POSTed while signed out")


async def run_example(data: st.DataObject, workdir: str, stats: Counter[str]) -> Model:
    cluster = _PG_CLUSTER[0]  # the PostgreSQL run: a fresh database per example
    location = cluster.url(new_database(cluster)) if cluster else os.path.join(workdir, "store")
    store = recoverable.RecoveryStore.open(location)
    try:
        async with FixtureProvider.serve() as provider, trio.open_nursery() as nursery:
            model = Model(store, provider, stats)
            model.slots = [RuntimeSlot(0), RuntimeSlot(1)]
            for slot in model.slots:
                await nursery.start(slot.hold, store, provider)
            rng = data.draw(st.randoms(use_true_random=True), label="actions")
            steps = rng.randint(max(8, STEPS // 2), max(8, STEPS))
            for _ in range(steps):
                with trio.move_on_after(STEP_GUARD) as guard:
                    await step(rng, model, nursery, store, provider)
                    await model.quiesce()
                if guard.cancelled_caught:
                    model.violations.append("a step hung")
                    break
                model.check()
                stats["steps"] += 1
                if model.violations:
                    break
            # Settle: release every parked send (approving), every send ends (typed).
            with trio.move_on_after(STEP_GUARD) as guard:
                while any(not t.done.is_set() for t in model.sends):
                    for task in model.sends:
                        if task.held:  # one at a time (see the release step)
                            task.answer = True
                            task.release.set()
                            await model.quiesce()
                    await model.quiesce()
            if guard.cancelled_caught:
                model.violations.append(
                    f"sends never finished: {[t.op for t in model.sends if not t.done.is_set()]}"
                )
            model.check()
            for slot in model.slots:
                slot.stop.set()
            for slot in model.slots:
                await slot.stopped.wait()
            model.check()
            stats["posts"] += len(provider.requests)
            stats["replaced"] += sum(1 for op in model.ops if model.posts(op) >= 2)
            return model
    finally:
        store.close()


async def step(
    rng: random.Random,
    model: Model,
    nursery: trio.Nursery,
    store: recoverable.RecoveryStore,
    provider: FixtureProvider,
) -> None:
    # Every parameter is drawn up front, whatever the action: the draws never depend on
    # what exists, so an example is one fixed sequence of draws. They come from the
    # example's seeded generator (uniform over the weighted tables; Hypothesis's own
    # draws lean to the first entries and starve most actions).
    d: dict[str, Any] = {
        "action": rng.choice(ACTIONS),
        "runtime": rng.randint(0, 1),
        "maximum": rng.randint(1, 4),
        "replies": [rng.randrange(len(FAULTS)) for _ in range(rng.randint(1, 4))],
        "index": rng.randint(0, 15),
        "decisions": [rng.choice(DECISIONS) for _ in range(rng.randint(1, 3))],
        "answer": rng.choice([True, True, True, False]),
        "action_id": rng.choice(["a", "a", "b"]),
        "account": rng.choice([ACCOUNT, ACCOUNT, ACCOUNT, OTHER]),
    }
    action: str = d["action"]
    model.log.append(f"{action}@{d['runtime']}#{d['index']}")
    slots = model.slots
    slot = slots[d["runtime"]]
    held = [t for t in model.sends if t.held and not t.done.is_set()]
    # Mostly the newest operations that can still run; sometimes any (disposed, cancelled).
    ops = list(model.ops)  # in preparation order: deterministic
    live = [o for o in reversed(ops)
            if not model.ops[o].disposed and model.ops[o].cancelled_at is None]
    if (action in OP_ACTIONS and not model.ops) or (action == "send" and not live):
        action = "prepare"
    if action in ("release", "cancel_task") and not held:
        action = "status" if model.ops else "prepare"
    if slot.rt is None and action not in ("script", "release", "release_all", "cancel_task"):
        action = "restart"
    if action == "prepare":
        assert slot.rt is not None
        maximum = d["maximum"]
        account = slot.account
        result: list[recoverable.Handle] = []

        async def prepare() -> None:
            assert slot.rt is not None
            result.append(await slot.rt.prepare(
                REQUEST, response=Answer, maximum_attempts=maximum, retry_policy=POLICY,
                job_id=f"job-{len(model.ops)}", input_revision="r1",
            ))

        code = await model.call("prepare", prepare)
        if code == "ok" and account is not None:
            model.ops[result[0].operation_id] = ModelOp(result[0], maximum, account)
        elif code == "ok":
            model.violations.append("prepare succeeded while signed out")
        return
    if action == "script":
        provider.script([FAULTS[i]() for i in d["replies"]])
        return
    if action == "restart":
        if slot.rt is not None:
            slot.stop.set()
            await slot.stopped.wait()
        fresh = RuntimeSlot(slot.index)
        await nursery.start(fresh.hold, store, provider)
        slots[slot.index] = fresh
        model.stats["restarts"] += 1
        return
    if action in ("release", "release_all"):
        # One at a time, each until quiet: two sends running at once would take the
        # scripted replies in an order that depends on timing.
        for task in held if action == "release_all" else [held[d["index"] % len(held)]]:
            if task.held:
                task.answer = d["answer"]
                task.release.set()
                model.stats["released"] += 1
                await model.quiesce()
        return
    if action == "cancel_task":
        task = held[d["index"] % len(held)]
        task.scope.cancel()
        await task.done.wait()
        model.stats["cancel_task"] += 1
        return
    rt = slot.rt
    assert rt is not None and slot.nursery is not None
    if action == "sign_out":
        await maybe_await(rt.sign_out())
        slot.account = None
        if slot.posts_at_sign_out is None:
            slot.posts_at_sign_out = model.posts_by(slot)
        for task in model.sends:
            if task.slot == slot.index and task.held:
                task.held_at_sign_out = True
                model.stats["held_at_sign_out"] += 1
        model.stats["sign_out"] += 1
        return
    if action == "sign_in":
        await maybe_await(rt.sign_in(d["account"]))
        slot.account = d["account"]
        slot.posts_at_sign_out = None
        model.stats["sign_in"] += 1
        return
    pool = live if live and d["index"] < 12 else ops
    if action == "retry" and d["index"] < 12:
        # A retry is mostly asked where one can be allowed: failed or out of budget.
        ended = [o for o in live if (r := store.get_operation(o)) is not None
                 and (r.phase == "failed" or r.attempts_remaining == 0)]
        pool = ended or pool
    op = pool[d["index"] % len(pool)]
    m = model.ops[op]
    if action == "send":
        task = SendTask(op, slot.index, model.tick(), list(d["decisions"]))
        model.sends.append(task)
        signed_out = slot.account is None
        slot.nursery.start_soon(model.send, slot, task)
        if signed_out:
            await task.done.wait()
            if task.outcome == "account_changed":
                model.stats["signed_out_refused"] += 1
    elif action == "suspend":
        running = [t for t in model.sends if t.op == op and t.held]
        if await model.call("suspend", lambda: rt.suspend(m.handle)) == "ok":
            model.stats["suspend_ok"] += 1
            model.stats["held_suspended"] += len(running)
    elif action == "cancel":
        if await model.call("cancel", lambda: rt.cancel(m.handle)) == "ok":
            m.cancelled_at = m.cancelled_at or model.tick()
            model.stats["cancel_ok"] += 1
    elif action == "acknowledge":
        if await model.call("acknowledge", lambda: rt.acknowledge(m.handle)) == "ok":
            if m.acknowledged_at is None:
                m.acknowledged_at = model.tick()
                m.posts_at_ack = model.posts(op)
            m.disposed = True
            model.stats["ack_ok"] += 1
    elif action == "abandon":
        if await model.call("abandon", lambda: rt.abandon(m.handle)) == "ok":
            m.posts_at_ack = m.posts_at_ack if m.posts_at_ack is not None else model.posts(op)
            m.disposed = True
            model.stats["abandon_ok"] += 1
    elif action == "status":
        await model.call("status", lambda: rt.status(m.handle))
    elif action == "receipt":
        receipts: list[recoverable.Receipt] = []

        async def read() -> None:
            receipts.append(await rt.receipt(m.handle))

        code = await model.call("receipt", read)
        if m.cancelled_at is not None and code == "ok":
            model.violations.append(f"{op}: receipt delivered after a permanent cancel")
        if code == "ok":
            msgspec.json.decode(receipts[0].payload, type=Answer)
            model.stats["receipt_ok"] += 1
    elif action == "retry":
        # Budgets 1-2 and two action ids: the same (action, settings) comes back often.
        await retry_step(model, rt, op, d["action_id"], 1 + d["index"] % 2)


async def maybe_await(result: object) -> None:
    """``sign_in``/``sign_out`` are plain calls today; accept them becoming coroutines."""
    if inspect.isawaitable(result):
        await result


async def retry_step(
    model: Model, rt: recoverable.Runtime, op: str, action_id: str, maximum: int
) -> None:
    m = model.ops[op]
    before = model.store.get_operation(op)
    children: list[recoverable.Handle] = []

    async def retry() -> None:
        children.append(await rt.retry(m.handle, retry_action_id=action_id,
                                       maximum_attempts=maximum))

    code = await model.call("retry", retry)
    key = (action_id, maximum)
    if code != "ok":
        model.stats["retry_refused"] += 1
        model.stats[f"retry:{code}"] += 1
        if key in m.children and code not in ("account_changed", "state_unavailable"):
            model.violations.append(f"{op}: the same retry action was refused with {code}")
        if m.children and key not in m.children and code not in (
            "retry_already_created", "retry_configuration_mismatch", "account_changed",
            "state_unavailable",
        ):
            model.violations.append(f"{op}: a second retry action answered {code}")
        return
    child = children[0].operation_id
    if key in m.children:
        model.stats["retry_same_child"] += 1
        if m.children[key] != child:
            model.violations.append(f"{op}: the same retry action made another successor")
        return
    if m.children:
        model.violations.append(f"{op}: a second successor {child}")
    m.children[key] = child
    model.stats["retry_created"] += 1
    after = model.store.get_operation(op)
    if before is not None and after is not None and after.attempts_used != before.attempts_used:
        model.violations.append(f"{op}: retry changed the source's spent budget")
    if model.posts(child) != 0:
        model.violations.append(f"{child}: a new successor already generated")
    status = await rt.status(children[0])
    if status.previous_operation_id != op or status.maximum_attempts != maximum:
        model.violations.append(f"{child}: successor not linked to {op} with its budget")
    model.ops[child] = ModelOp(children[0], maximum, m.account)


@pytest.fixture
def model_store(store_kind: str, request: pytest.FixtureRequest) -> Iterator[None]:
    """One suite, two stores (issue 17): the PostgreSQL run gives each example a fresh
    database (a third of a second each: PG_EXAMPLES examples). The example function's
    source stays as it was (Hypothesis seeds ``derandomize`` from it): the store and the
    count are switched through module state."""
    global EXAMPLES
    if store_kind != "postgresql":
        yield
        return
    saved = EXAMPLES
    _PG_CLUSTER[0] = request.getfixturevalue("pg_cluster")
    EXAMPLES = PG_EXAMPLES
    try:
        yield
    finally:
        _PG_CLUSTER[0] = None
        EXAMPLES = saved


@pytest.mark.usefixtures("model_store")
def test_random_interleavings_keep_every_invariant() -> None:
    stats: Counter[str] = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def example(data: st.DataObject) -> None:
        workdir = tempfile.mkdtemp(prefix="model-")
        try:
            model = trio.run(run_example, data, workdir, stats)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        stats["examples"] += 1
        assert model.violations == [], (model.violations, model.log)

    try:
        example()
    finally:
        print(f"\nmodel test: {dict(sorted(stats.items()))}")
    if EXAMPLES >= FLOORS["examples"] and STEPS >= 30:
        short = {k: (stats[k], floor) for k, floor in FLOORS.items() if stats[k] < floor}
        assert not short, f"interesting steps below their floors (got, floor): {short}"
