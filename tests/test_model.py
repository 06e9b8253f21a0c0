"""Model-based test: random interleavings of the public API against the REAL system.

Two runtimes share one real LMDB store (same process) and talk over real
sockets to an in-process fixture provider. Hypothesis draws each next action:
prepare, send (in a background task, on either runtime, approving or denying),
cancel the task of a send (suspends), suspend, cancel, acknowledge, abandon,
status, receipt, scripted provider faults, restarting a runtime (close and
reopen), and letting time pass. After every step the invariants are checked:

- ``attempts_used <= maximum_attempts`` and it never decreases;
- POSTs per operation (the provider's log) never exceed its budget, nor the
  attempts durably spent;
- no POST for an operation after its receipt was saved;
- a permanently cancelled operation never delivers to a send started after the
  cancel returned, and its receipt is refused;
- an acknowledged operation never generates again and never delivers again;
- every record decodes (inventory has no unreadable id, ``check_integrity`` is clean);
- every send ends with a value, a typed ``RecoveryError`` or the Cancelled we caused,
  and nothing hangs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import recoverable
from recoverable.testing import FixtureProvider, Reply

ACCOUNT = recoverable.AccountBinding("acct-model", "api-key")
REQUEST = recoverable.StructuredRequest(model="m", instructions="model test", input="x")
POLICY = recoverable.RetryPolicy(initial_backoff=0.0, maximum_backoff=0.02)
LIMITS = recoverable.StreamLimits(idle_timeout=0.3, connect_timeout=2.0)
STEP_GUARD = 15.0  # no single step may take this long: that would be a hang
EXAMPLES = int(os.environ.get("RECOVERABLE_MODEL_EXAMPLES", "20"))
STEPS = int(os.environ.get("RECOVERABLE_MODEL_STEPS", "18"))
STATS = {"examples": 0, "steps": 0, "sends": 0, "values": 0, "posts": 0}


class Answer(msgspec.Struct, frozen=True):
    answer: int
    note: str


FAULTS: list[Callable[[], Reply]] = [
    lambda: Reply.disconnect(after_events=2),
    lambda: Reply.disconnect(after_events=0),
    lambda: Reply.rate_limited(retry_after=0.05),
    lambda: Reply.http_error(500),
    lambda: Reply.failed("server_error"),
    lambda: Reply.stall(after_events=1),
    lambda: Reply.invalid_json(),
    lambda: Reply.quota_exceeded(),
    lambda: Reply.complete({"answer": 7, "note": "scripted"}),
    lambda: Reply.synthesize(),
]


ACTIONS = [
    "prepare", "prepare", "script", "restart", "wait", "settle", "cancel_task",
    "send", "send", "send", "send", "suspend", "cancel", "acknowledge", "abandon", "status",
    "receipt",
]
OP_ACTIONS = frozenset({"send", "suspend", "cancel", "acknowledge", "abandon", "status",
                        "receipt"})


@dataclass
class ModelOp:
    handle: recoverable.Handle
    maximum: int
    attempts_seen: int = 0
    posts_at_receipt: int | None = None  # POSTs counted when the receipt was first seen
    cancelled_at: int | None = None  # clock value when a cancel() returned
    acknowledged_at: int | None = None
    posts_at_ack: int | None = None
    disposed: bool = False


@dataclass
class SendTask:
    op: str
    started_at: int
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)
    outcome: str = "running"
    finished_at: int | None = None


class RuntimeSlot:
    """One runtime, opened in its own task so that it can be closed and reopened."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.rt: recoverable.Runtime | None = None
        self.nursery: trio.Nursery | None = None
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
            credentials=recoverable.StaticCredentials("sk-model", account=ACCOUNT),
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
    def __init__(self, store: recoverable.RecoveryStore, provider: FixtureProvider) -> None:
        self.store = store
        self.provider = provider
        self.ops: dict[str, ModelOp] = {}
        self.sends: list[SendTask] = []
        self.clock = 0  # a logical clock: bumped at every observable event
        self.violations: list[str] = []

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def posts(self, op: str) -> int:
        return sum(1 for r in self.provider.requests if (r.attempt_id or "").startswith(op + "."))

    async def send(self, slot: RuntimeSlot, op: str, approve: bool) -> None:
        rt = slot.rt
        assert rt is not None
        task = SendTask(op, self.tick())
        self.sends.append(task)
        STATS["sends"] += 1

        async def authorize(attempt: recoverable.Attempt) -> bool:
            return approve

        try:
            with task.scope:
                try:
                    value = await rt.send_recovering(
                        self.ops[op].handle, response=Answer, authorize=authorize
                    )
                except recoverable.RecoveryError as exc:
                    task.outcome = exc.code
                else:
                    assert isinstance(value, Answer)
                    task.outcome = "value"
                    STATS["values"] += 1
                    self.delivered(task)
            if task.scope.cancelled_caught:
                task.outcome = "cancelled"
        except trio.Cancelled:
            task.outcome = "cancelled"  # the runtime was closed under it
            raise
        except Exception as exc:  # an untyped error is a violation, not a crash of the test
            task.outcome = f"untyped:{type(exc).__name__}"
            self.violations.append(f"send of {op} raised {exc!r}")
        finally:
            task.finished_at = self.tick()
            task.done.set()

    def delivered(self, task: SendTask) -> None:
        m = self.ops[task.op]
        if m.cancelled_at is not None and task.started_at > m.cancelled_at:
            self.violations.append(f"{task.op}: delivered after a permanent cancel")
        if m.acknowledged_at is not None and task.started_at > m.acknowledged_at:
            self.violations.append(f"{task.op}: delivered after acknowledgement")

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


async def run_example(data: st.DataObject, workdir: str) -> Model:
    store = recoverable.RecoveryStore.open(os.path.join(workdir, "store"))
    try:
        async with FixtureProvider.serve() as provider, trio.open_nursery() as nursery:
            model = Model(store, provider)
            slots = [RuntimeSlot(0), RuntimeSlot(1)]
            for slot in slots:
                await nursery.start(slot.hold, store, provider)
            steps = data.draw(st.integers(4, STEPS), label="steps")
            for _ in range(steps):
                with trio.move_on_after(STEP_GUARD) as guard:
                    await step(data, model, slots, nursery, store, provider)
                if guard.cancelled_caught:
                    model.violations.append("a step hung")
                    break
                await trio.sleep(0.01)  # let background sends make progress
                model.check()
                STATS["steps"] += 1
                if model.violations:
                    break
            # Settle: every send ends (typed), then a final check.
            with trio.move_on_after(STEP_GUARD) as guard:
                for task in model.sends:
                    await task.done.wait()
            if guard.cancelled_caught:
                model.violations.append(
                    f"sends never finished: {[t.op for t in model.sends if not t.done.is_set()]}"
                )
            model.check()
            for slot in slots:
                slot.stop.set()
            for slot in slots:
                await slot.stopped.wait()
            model.check()
            STATS["posts"] += len(provider.requests)
            return model
    finally:
        store.close()


async def step(
    data: st.DataObject,
    model: Model,
    slots: list[RuntimeSlot],
    nursery: trio.Nursery,
    store: recoverable.RecoveryStore,
    provider: FixtureProvider,
) -> None:
    # Every parameter is drawn up front, whatever the action: the draws never depend on
    # timing (which operations or sends happen to exist), so examples replay exactly.
    d: dict[str, Any] = data.draw(st.fixed_dictionaries({
        "action": st.sampled_from(ACTIONS),
        "runtime": st.integers(0, 1),
        "maximum": st.integers(1, 4),
        "replies": st.lists(st.integers(0, len(FAULTS) - 1), min_size=1, max_size=4),
        "seconds": st.sampled_from([0.0, 0.05, 0.2]),
        "index": st.integers(0, 15),
        "approve": st.sampled_from([True, True, True, False]),
    }), label="step")
    action: str = d["action"]
    slot = slots[d["runtime"]]
    running = [t for t in model.sends if not t.done.is_set()]
    if action in OP_ACTIONS and not model.ops:
        action = "prepare"
    if action == "cancel_task" and not running:
        action = "wait"
    if slot.rt is None and action not in ("script", "wait", "settle", "cancel_task"):
        action = "restart"
    if action == "prepare":
        assert slot.rt is not None
        maximum = d["maximum"]
        handle = await slot.rt.prepare(
            REQUEST, response=Answer, maximum_attempts=maximum, retry_policy=POLICY,
            job_id=f"job-{len(model.ops)}", input_revision="r1",
        )
        model.ops[handle.operation_id] = ModelOp(handle, maximum)
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
        return
    if action == "wait":
        await trio.sleep(d["seconds"])
        return
    if action == "settle":
        for task in model.sends:
            await task.done.wait()
        return
    if action == "cancel_task":
        task = running[d["index"] % len(running)]
        task.scope.cancel()
        await task.done.wait()
        return
    ops = list(model.ops)  # in preparation order: deterministic
    op = ops[d["index"] % len(ops)]
    m = model.ops[op]
    rt = slot.rt
    assert rt is not None and slot.nursery is not None
    if action == "send":
        approve = d["approve"]
        slot.nursery.start_soon(model.send, slot, op, approve)
    elif action == "suspend":
        await model.call("suspend", lambda: rt.suspend(m.handle))
    elif action == "cancel":
        if await model.call("cancel", lambda: rt.cancel(m.handle)) == "ok":
            m.cancelled_at = m.cancelled_at or model.tick()
    elif action == "acknowledge":
        if await model.call("acknowledge", lambda: rt.acknowledge(m.handle)) == "ok":
            if m.acknowledged_at is None:
                m.acknowledged_at = model.tick()
                m.posts_at_ack = model.posts(op)
            m.disposed = True
    elif action == "abandon":
        if await model.call("abandon", lambda: rt.abandon(m.handle)) == "ok":
            m.disposed = True
            m.posts_at_ack = m.posts_at_ack if m.posts_at_ack is not None else model.posts(op)
    elif action == "status":
        await model.call("status", lambda: rt.status(m.handle))
    elif action == "receipt":
        result: list[recoverable.Receipt] = []

        async def read() -> None:
            result.append(await rt.receipt(m.handle))

        code = await model.call("receipt", read)
        if m.cancelled_at is not None and code == "ok":
            model.violations.append(f"{op}: receipt delivered after a permanent cancel")
        if code == "ok":
            msgspec.json.decode(result[0].payload, type=Answer)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_interleavings_keep_every_invariant(data: st.DataObject) -> None:
    workdir = tempfile.mkdtemp(prefix="model-")
    try:
        model = trio.run(run_example, data, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    STATS["examples"] += 1
    assert model.violations == [], model.violations


def teardown_module() -> None:
    print(f"\nmodel test: {STATS}")
