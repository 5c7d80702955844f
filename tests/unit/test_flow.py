"""The step machines of gpulock/protocol/flow.py, driven by hand: each test answers the steps a flow
yields (as a driver would, with canned replies or errors) and checks what the flow decides.
No Redis, no event loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pytest

from gpulock_common.driver import drive as common_drive
from gpulock_common.options import PoolSettings

from gpulock.protocol import flow
from gpulock.protocol.keys import pool_keys
from gpulock.protocol.lease import LeaseState
from gpulock.protocol.request import AcquireOptions, AcquireRequest
from gpulock.protocol.replies import Grant, QueueConfig
from gpulock.runtime.runtime import Runtime
from gpulock.errors import (
    AcquireTimeout,
    BackendUnavailable,
    InvalidArgument,
    LeaseLost,
    PoolNotFound,
)


@dataclass
class FakePool:
    name: str = "p"
    capacity: int | None = 100
    max_waiters: int = 10
    max_ttl: float = 60.0
    backend_timeout: float = 5.0
    sync_replicas: int = 0
    sync_timeout: float = 1.0
    clock: Callable[[], float] = field(default=lambda: 0.0)


def _runtime(pool: FakePool) -> Runtime:
    return Runtime(None, pool.name, pool_keys(pool.name), pool.clock)


def drive(steps, answer: Callable[[flow.Step], Any]) -> tuple[Any, list[flow.Step]]:
    """Run a flow to its end; ``answer(step)`` returns the reply or raises. Returns (result,
    the steps seen)."""
    seen: list[flow.Step] = []

    def do_step(step: flow.Step) -> Any:
        seen.append(step)
        return answer(step)  # what it raises goes into the flow, as in the shells

    return common_drive(steps, do_step), seen


def _req(timeout: float | None) -> AcquireRequest:
    return AcquireRequest.build(
        "p",
        10,
        AcquireOptions(timeout=timeout, request_id="t1"),
        waiter_ttl=5.0,
        default_ttl=30.0,
    )


GRANT = [1, "lease", 7, 31_000, 10, 1_000, 3, 100]  # acquire.lua: granted
QUEUED = [0, 2, 500, 2, 1_000, 3, 100, 90]  # queued at position 2 of 2, next expiry in 0.5 s
REFUSED = [2, 0, -1, 1, 1_000, 3, 100, 95]  # timeout=0 and it does not fit


def test_a_grant_makes_a_lease_and_withdraws_nothing():
    pool = FakePool()
    rt = _runtime(pool)

    def answer(step):
        if isinstance(step, flow.Eval):
            assert step.script == "acquire" and step.bound == 1.0  # retry_bound(5, 0) is 1 s
            return GRANT
        if isinstance(step, flow.MakeLease):
            return ("lease", step.grant), "its state"  # (the lease object, its LeaseState)
        return None

    lease, seen = drive(flow.acquire(pool, rt, _req(0), 0.0, None), answer)
    assert lease[1].lease_id == "lease" and lease[1].token == 7
    assert not any(isinstance(s, flow.Withdraw) for s in seen)
    # a try queues nothing, so it needs no hand-off subscription; its lease may be asked to
    # yield, so the flow listens for that before the acquire is sent
    assert [s for s in seen if isinstance(s, flow.Subscribe)] == [flow.LISTEN]
    assert seen.index(flow.LISTEN) < next(i for i, s in enumerate(seen) if isinstance(s, flow.Eval))
    assert rt.recovery.known_epoch == 3


def test_not_available_now_says_why_and_withdraws_nothing():
    pool = FakePool()
    with pytest.raises(AcquireTimeout) as ei:
        drive(
            flow.acquire(pool, _runtime(pool), _req(0), 0.0, None),
            lambda s: REFUSED if isinstance(s, flow.Eval) else None,
        )
    assert str(ei.value) == (
        "pool 'p': 10 bytes not available now (timeout=0; 1 waiting, 95/100 bytes used)"
    )


@pytest.mark.parametrize(
    "capacity, devices",
    [(100, None), (None, None), (None, "30 50")],
    ids=["own-capacity", "no-capacity", "no-capacity-devices"],
)
def test_a_lost_pool_is_made_again_with_grace_then_the_acquire_retried(capacity, devices):
    """An object that saw the pool makes it again as last seen on the server, with a grace
    period, then retries the acquire: with a capacity of its own, and without one (a worker
    relying on an operator's ``pool set``, the broker's), which it keeps not having."""
    pool = FakePool(capacity=capacity)
    rt = _runtime(pool)
    rec = rt.recovery  # what the pool object saw of the pool
    rec.known_epoch = 3  # this object had seen the pool: Redis lost it
    rec.capacity_seen, rec.max_waiters_seen, rec.max_ttl_seen_ms = 80, 7, 20_000
    if devices is not None:
        rec.policy_seen = QueueConfig("fifo", 0, "", devices, "bestfit")
    calls: list[tuple[str, list]] = []

    def answer(step):
        if isinstance(step, flow.Eval):
            calls.append((step.script, step.args))
            if step.script == "acquire" and len(calls) == 1:
                raise PoolNotFound("p")
            if step.script == "configure":
                return [1, 80, 4, 0, 7, 20_000, 20_000]
            return GRANT
        if isinstance(step, flow.MakeLease):
            return "lease", "its state"
        return None

    lease, _ = drive(flow.acquire(pool, rt, _req(0), 0.0, None), answer)
    assert lease == "lease"
    assert [c[0] for c in calls] == ["acquire", "configure", "acquire"]
    # made again as last seen on the server, with a grace period
    assert calls[1][1][:5] == ["80", "7", "create", "20000", "1"]
    if devices is None:
        assert len(calls[1][1]) == 5
    if capacity is None:
        assert pool.capacity is None  # the object keeps having none


def test_a_lost_pool_never_seen_by_an_object_without_capacity_is_not_found():
    pool = FakePool(capacity=None)
    rt = _runtime(pool)
    scripts: list[str] = []

    def answer(step):
        if isinstance(step, flow.Eval):
            scripts.append(step.script)
            raise PoolNotFound("p")
        return None

    with pytest.raises(PoolNotFound):
        drive(flow.acquire(pool, rt, _req(0), 0.0, None), answer)
    assert scripts == ["acquire"] and rt.remake_capacity() is None


def test_a_lost_pool_is_made_again_with_the_queue_policy_last_seen():
    pool = FakePool()
    rt = _runtime(pool)
    rec = rt.recovery
    rec.known_epoch = 3
    rec.capacity_seen, rec.max_waiters_seen, rec.max_ttl_seen_ms = 80, 7, 20_000
    rec.policy_seen = QueueConfig("backfill", 1500, "team-a=4096", "40 40", "spread", "3 5000")
    assert rt.configure_argv(10, 5, 1000, True) == [
        "80",
        "7",
        "create",
        "20000",
        "1",
        "backfill",
        "1500",
        "team-a=4096",
        "40 40",
        "spread",
        "3 5000",  # preemption kept
    ]
    # a set by this object says what it says
    fifo = QueueConfig("fifo", None, None, None, None)
    assert rt.configure_argv(10, 5, 1000, False, policy=fifo) == [
        "10",
        "5",
        "set",
        "1000",
        "0",
        "fifo",
        "",
        "",
        "",
        "",
        "",
    ]


@pytest.mark.parametrize(
    "error, withdraw",
    [
        (PoolNotFound("p"), None),  # the script refused before writing: nothing to withdraw
        (BackendUnavailable("Redis unavailable"), flow.Withdraw("t1", background=True)),
    ],
    ids=["refused", "unreachable"],
)
def test_what_a_failed_acquire_call_withdraws(error, withdraw):
    pool = FakePool(capacity=None)
    seen: list[flow.Step] = []

    def answer(step):
        seen.append(step)
        if isinstance(step, flow.Eval):
            raise error
        return None

    with pytest.raises(type(error)):
        drive(flow.acquire(pool, _runtime(pool), _req(0), 0.0, None), answer)
    assert [s for s in seen if isinstance(s, flow.Withdraw)] == ([withdraw] if withdraw else [])


@pytest.mark.parametrize("known", [3, None], ids=["position-now", "position-when-queued"])
def test_a_timeout_leaves_the_queue_and_withdraws(known):
    pool = FakePool()
    rt = _runtime(pool)
    queued_at: list[int] = []

    def answer(step):
        if isinstance(step, flow.Eval):
            return QUEUED
        if isinstance(step, flow.Join):
            return "handle"
        if isinstance(step, flow.Wait):
            assert step.handle == "handle" and step.timeout == 2.0
            return flow.TimedOut(known)
        if isinstance(step, flow.Leave):
            assert step.withdrawing
            return False  # nobody else here uses the ticket
        return None

    with pytest.raises(AcquireTimeout) as ei:
        _, seen = drive(flow.acquire(pool, rt, _req(2.0), 0.0, queued_at.append), answer)
    where = "position 3 of 2+" if known else "position 2 of 2+ when queued"
    assert str(ei.value) == f"pool 'p': no grant of 10 bytes within 2.0s ({where})"
    assert queued_at == [2]


def test_a_cancellation_during_the_wait_withdraws_unless_the_ticket_is_in_use():
    class Cancelled(BaseException):
        pass

    for in_use in (False, True):
        pool = FakePool()
        seen: list[flow.Step] = []

        def answer(step):
            seen.append(step)
            if isinstance(step, flow.Eval):
                return QUEUED
            if isinstance(step, flow.Join):
                return "handle"
            if isinstance(step, flow.Wait):
                raise Cancelled()
            if isinstance(step, flow.Leave):
                return in_use
            return None

        with pytest.raises(Cancelled):
            drive(flow.acquire(pool, _runtime(pool), _req(None), 0.0, None), answer)
        withdrew = any(isinstance(s, flow.Withdraw) for s in seen)
        assert withdrew is not in_use
        assert isinstance(seen[0], flow.Subscribe)


@pytest.mark.parametrize("shared", [False, True], ids=["alone", "shared"])
def test_an_interrupt_in_the_join_after_it_registered_leaves_the_waiter(shared):
    """The Join step raises (an interrupt) after the runtime registered the acquire on the
    waiter, so no handle came back: the flow leaves that waiter itself, and withdraws unless
    another acquire with the same request id still uses the ticket."""
    pool = FakePool()
    rt = OnlyTheView()
    rt.ticket_in_use = lambda ticket: shared  # type: ignore[method-assign]
    seen: list[flow.Step] = []

    def answer(step):
        seen.append(step)
        if isinstance(step, flow.Eval):
            return QUEUED
        if isinstance(step, flow.Join):
            step.waiter = "the waiter"
            raise KeyboardInterrupt
        return None

    with pytest.raises(KeyboardInterrupt):
        drive(flow.acquire(pool, rt, _req(None), 0.0, None), answer)
    assert rt.calls.count("leave_waiter") == 1
    assert not any(isinstance(s, flow.Leave) for s in seen)
    assert any(isinstance(s, flow.Withdraw) for s in seen) is not shared


def test_a_release_retried_after_a_connection_error_counts_as_released():
    def answer(step):
        assert isinstance(step, flow.Eval) and step.script == "release"
        if step.bound == 0:  # the driver's word for a try that got no answer
            raise flow.Unanswered("Redis unavailable for pool 'p': reset")
        return [0, 1_000, 0, 0]  # the retry finds no lease: the first try ran

    (released, now_ms), seen = drive(flow.release("p", "lease", 7), answer)
    assert released and now_ms == 1_000
    assert [s.bound for s in seen] == [0, None]  # the retry: for the default bound


def test_a_release_refused_on_its_first_try_is_not_retried():
    def answer(step):
        raise InvalidArgument("bad token")  # answered: the script refused

    seen: list[flow.Step] = []
    with pytest.raises(InvalidArgument, match="bad token"):
        drive(flow.release("p", "lease", 7), lambda s: seen.append(s) or answer(s))
    assert len(seen) == 1


def test_releasing_a_lease_the_server_lost_raises_lease_lost():
    pool = FakePool()
    rt = _runtime(pool)
    g = Grant("t1", "lease", 7, 31_000, 10, 1_000, 3, 100)
    state, _ = rt.state_for(g, 30.0, 10.0)
    with pytest.raises(LeaseLost, match="no longer had it"):
        drive(flow.release_lease(state, rt), lambda s: [0, 1_000, 0, 0])
    assert state.released
    assert drive(flow.release_lease(state, rt), lambda s: pytest.fail("sent again"))[0] is None


def test_sync_replicas_gives_back_a_grant_the_replicas_did_not_acknowledge():
    pool = FakePool(sync_replicas=1)
    rt = _runtime(pool)
    g = Grant("t1", "lease", 7, 31_000, 10, 1_000, 3, 100)
    state, _ = rt.state_for(g, 30.0, 10.0)
    seen: list[flow.Step] = []

    def answer(step):
        seen.append(step)
        if isinstance(step, flow.SyncedRenew):
            assert step.args == [1, "lease", 7, 30_000, 0]
            return [1_000, 3, [31_000], []], 0  # renewed, acknowledged by no replica
        return None

    with pytest.raises(BackendUnavailable, match=r"not acknowledged by 1 replica\(s\) within 1.0s"):
        drive(flow.sync_grant(pool, state, "the lease"), answer)
    assert seen[-1] == flow.GiveBack("the lease")


def test_sync_replicas_counts_the_validity_from_an_acknowledged_renewal():
    pool = FakePool(sync_replicas=1, clock=lambda: 5.0)
    rt = _runtime(pool)
    state, _ = rt.state_for(Grant("t1", "lease", 7, 31_000, 10, 1_000, 3, 100), 30.0, 10.0)

    def answer(step):
        assert isinstance(step, flow.SyncedRenew)
        return [2_000, 3, [32_000], []], 1  # renewed at server time 2 s, acknowledged by one

    assert drive(flow.sync_grant(pool, state, "the lease"), answer)[0] is None
    assert state.expires_ms == 32_000 and 5.0 + 29.0 < state.valid_until < 5.0 + 30.0


# queued at position 2 of 2 in a grace period with 30 s left (retry_after_ms: to its end)
QUEUED_IN_GRACE = [0, 2, 30_000, 2, 1_000, 3, 100, 0, 0, 30_000]


def _joins(timeout: float | None) -> tuple[BaseException | None, list[flow.Step]]:
    """Drive an acquire answered QUEUED_IN_GRACE (a wait, if it comes to one, is ended by an
    AcquireTimeout "waited"): its error and the steps it yielded."""
    pool = FakePool()
    seen: list[flow.Step] = []

    def answer(step):
        seen.append(step)
        if isinstance(step, flow.Eval):
            return QUEUED_IN_GRACE
        if isinstance(step, flow.Wait):
            raise AcquireTimeout("waited")
        return None

    try:
        drive(flow.acquire(pool, _runtime(pool), _req(timeout), 0.0, None), answer)
    except AcquireTimeout as e:
        return e, seen
    raise AssertionError("no AcquireTimeout")


def test_a_timeout_before_the_grace_end_leaves_the_queue_at_once():
    """Nothing is granted for 30 s, and the timeout is 5 s: no wait, the place is withdrawn,
    and the error says when to come back."""
    err, seen = _joins(5.0)
    assert isinstance(err, AcquireTimeout), seen
    assert not any(isinstance(s, flow.Join) for s in seen)
    assert [s.ticket for s in seen if isinstance(s, flow.Withdraw)] == ["t1"]
    assert (err.grace_left, err.retry_after, err.position) == (30.0, 30.0, 2)
    assert "grace period" in str(err) and "left the queue at once" in str(err), str(err)


@pytest.mark.parametrize("timeout", [None, 31.0])
def test_a_timeout_past_the_grace_end_waits(timeout):
    err, seen = _joins(timeout)
    assert str(err) == "waited" and any(isinstance(s, flow.Join) for s in seen)


def test_grace_outlasts():
    from gpulock_common.grace import grace_outlasts

    assert grace_outlasts(30.0, 5.0)
    assert not grace_outlasts(30.0, 30.0)  # granted, if at all, right at its deadline
    assert not grace_outlasts(30.0, None)  # no deadline: it waits for the grace end
    assert not grace_outlasts(0.0, 5.0)  # no grace period


class OnlyTheView:
    """A runtime with nothing but :class:`gpulock.protocol.steps.RuntimeView`: the flows need no
    more of the runtime (a member they used beyond it would raise AttributeError here)."""

    channel_id = "chan"
    subscribed = True
    listening = True

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _note(name):  # a decorator of the class body: a method that records its call
        def method(self, *args, **kw):
            self.calls.append(name)
            return {"grace_left": 0.0, "unreachable": None, "ticket_in_use": False}.get(name)

        return method

    use_settings = _note("use_settings")
    seen = _note("seen")
    note_grace = _note("note_grace")
    observe = _note("observe")
    grace_left = _note("grace_left")
    unreachable = _note("unreachable")
    ticket_in_use = _note("ticket_in_use")
    remove_waiter = _note("remove_waiter")
    leave_waiter = _note("leave_waiter")
    untrack = _note("untrack")
    deadline_for = _note("deadline_for")
    remake_capacity = _note("remake_capacity")

    def configure_argv(
        self, capacity, max_waiters, max_ttl_ms, create_only, grace=False, policy=None
    ):
        self.calls.append("configure_argv")
        return flow.configure_args(capacity, max_waiters, max_ttl_ms, create_only, grace, policy)


def test_the_flows_need_of_the_runtime_only_its_view():
    view = {n for n in dir(flow.RuntimeView) if not n.startswith("_")}
    assert view == {n for n in dir(OnlyTheView) if not n.startswith("_")}
    pool = FakePool()
    rt = OnlyTheView()

    def answer(step):
        if isinstance(step, flow.Eval):
            return {
                "acquire": QUEUED,
                "configure": [0, 100, 3, 0, 10, 60_000, 0, "fifo", 2000, "", "", "bestfit"],
                "cancel": [1, 1_000],
            }[step.script]
        if isinstance(step, flow.Wait):
            return flow.TimedOut(1)
        return None

    with pytest.raises(AcquireTimeout):
        drive(flow.acquire(pool, rt, _req(2.0), 0.0, None), answer)

    def interrupted(step):
        if isinstance(step, flow.Join):
            step.waiter = "the waiter"  # the runtime registered it, then the interrupt
            raise KeyboardInterrupt
        return answer(step)

    with pytest.raises(KeyboardInterrupt):
        drive(flow.acquire(pool, rt, _req(2.0), 0.0, None), interrupted)
    out, _ = drive(
        flow.configure(pool, rt, PoolSettings(100), create_only=False, grace=False),
        answer,
    )
    assert out["policy"] == "fifo" and out["devices"] == [100]
    assert drive(flow.cancel(rt, "t1"), answer)[0] == 1
    g = Grant("t1", "lease", 7, 31_000, 10, 1_000, 3, 100)

    def granted(step):
        if isinstance(step, flow.Wait):
            return g  # the waiter's grant
        if isinstance(step, flow.MakeLease):
            return "the lease", LeaseState("p", step.grant, 30.0, 10.0, pool.clock)
        return answer(step)

    lease, _ = drive(flow.acquire(pool, rt, _req(2.0), 0.0, None), granted)
    gone = [PoolNotFound("p")]  # the first acquire finds the pool gone: made again

    def lost_once(step):
        if isinstance(step, flow.Eval) and step.script == "acquire" and gone:
            raise gone.pop()
        return granted(step)

    drive(flow.acquire(pool, rt, _req(2.0), 0.0, None), lost_once)
    assert not gone
    state = LeaseState("p", g, 30.0, 10.0, pool.clock)
    drive(flow.release_lease(state, rt), lambda s: [1, 1_000, 0, 0])
    assert lease == "the lease" and state.released
    assert set(rt.calls) == view - {"channel_id", "subscribed", "listening"}  # those are read
