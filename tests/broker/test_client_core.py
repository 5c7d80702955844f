"""gpulock-client's I/O-free core, driven step by step with a fake clock and canned replies
(no network, no sleeping)."""

from __future__ import annotations

import random

import gpulock_client
import httpx
import pytest
from gpulock_client import _core as core
from gpulock_client import _holding as holding
from gpulock_client import _resize
from gpulock_common.driver import drive as common_drive
from gpulock_client.errors import (
    AcquireTimeout,
    BackendUnavailable,
    CapacityExceeded,
    InvalidArgument,
    LeaseLost,
    PoolNotFound,
)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def grant_body(expires_in=30.0, ttl=30.0):
    return {
        "lease_id": "a" * 32,
        "pool": "p",
        "amount": 5,
        "token": 7,
        "ttl": ttl,
        "expires_in": expires_in,
        "expires_at": 1e9 + expires_in,
        "acquired_at": 1e9,
        "request_id": "r",
    }


def queued(clock, pos=3, ra="2"):
    return core.Reply(
        503,
        {"retry-after": ra, "x-queue-position": str(pos)},
        {"detail": {"error": "queued", "message": "m", "position": pos, "queue_length": 9}},
        clock(),
    )


def drive(gen, clock, replies):
    """Run the steps: answer Http steps from `replies` (callables of the step), advance the
    clock on Sleep. Returns (result or exception, steps)."""
    steps = []

    def do_step(step):
        steps.append(step)
        if isinstance(step, core.Sleep):
            clock.t += step.seconds
            return None
        out = replies.pop(0)(step)
        if isinstance(out, core.Reply):
            clock.t += 0.001
        return out

    try:
        return common_drive(gen, do_step, catch=()), steps  # as the SDK's shells drive them
    except Exception as e:
        return e, steps


def cfg(clock, **kw):
    return core.PoolConfig("p", clock=clock, rng=random.Random(1), **kw)


def test_retry_after_is_honoured_with_jitter_and_the_request_id_is_reused():
    clock = Clock()
    got = []
    gen = core.acquire_steps(
        cfg(clock, max_wait=5),
        "4GiB",
        core.AcquireOptions(ttl=None, timeout=None, holder={"k": 1}, request_id=None),
        on_queued=got.append,
    )
    res, steps = drive(
        gen,
        clock,
        [
            lambda s: queued(clock, 3),
            lambda s: queued(clock, 2, "4"),
            lambda s: core.Reply(201, {}, grant_body(), clock()),
        ],
    )
    assert res[0]["lease_id"] == "a" * 32
    posts = [s for s in steps if isinstance(s, core.Http)]
    sleeps = [s.seconds for s in steps if isinstance(s, core.Sleep)]
    assert len({p.json["request_id"] for p in posts}) == 1
    assert all(
        p.json["wait"] == 5 and p.json["holder"]["k"] == 1 and "host" in p.json["holder"]
        for p in posts
    )
    assert 2 <= sleeps[0] <= 2 * 1.3 and 4 <= sleeps[1] <= 4 * 1.3
    assert got == [3, 2]


def _acquire_to(clock, replies):
    """An acquire driven through ``replies``: (result, what on_queued got, what
    on_granted_place got)."""
    told, placed = [], []
    gen = core.acquire_steps(
        cfg(clock, max_wait=5),
        5,
        core.AcquireOptions(ttl=None, timeout=None, holder=None, request_id="r"),
        on_queued=told.append,
        on_granted_place=placed.append,
    )
    res, _ = drive(gen, clock, replies)
    return res, told, placed


def test_a_grant_after_queueing_in_one_long_poll_reports_its_place_to_the_trace_only():
    """The 201's ``queued`` (the broker enqueued it, and the same long poll ended in the grant)
    goes to on_granted_place (the acquire span's), never to on_queued (a request still
    waiting); a 201 without it (granted at once, or an older broker) reports nothing; one
    after a queued answer reports nothing more (that answer placed it)."""
    clock = Clock()
    place = {"position": 2, "queue_length": 3, "estimated_wait_s": 1.5}
    res, told, placed = _acquire_to(
        clock, [lambda s: core.Reply(201, {}, {**grant_body(), "queued": place}, clock())]
    )
    assert res[0]["lease_id"] == "a" * 32
    assert told == [] and placed == [2]
    assert placed[0].estimated_wait == 1.5 and placed[0].queue_length == 3
    # granted at once (null), a broker older than the field (absent): no place
    for body in ({**grant_body(), "queued": None}, grant_body()):
        res, told, placed = _acquire_to(clock, [lambda s, b=body: core.Reply(201, {}, b, clock())])
        assert res[0]["lease_id"] == "a" * 32 and told == [] and placed == []
    # no estimate measured yet: the place without one
    p = core.granted_place({"queued": {"position": 1, "queue_length": 1, "estimated_wait_s": None}})
    assert p == 1 and p.estimated_wait is None and p.queue_length == 1
    # placed by a queued answer first: the 201's place is not reported again
    res, told, placed = _acquire_to(
        clock,
        [
            lambda s: queued(clock, 3),
            lambda s: core.Reply(201, {}, {**grant_body(), "queued": place}, clock()),
        ],
    )
    assert told == [3] and placed == []


def test_jitter_spreads_retries():
    rng = random.Random(5)
    xs = [core.jittered(2, rng) for _ in range(200)]
    assert min(xs) >= 2 and max(xs) <= 2.6 and max(xs) - min(xs) > 0.4


def test_timeout_caps_the_waits_and_withdraws_the_place():
    clock = Clock()
    gen = core.acquire_steps(
        cfg(clock, max_wait=20),
        5,
        core.AcquireOptions(ttl=3, timeout=3.0, holder=None, request_id="rid"),
        on_queued=None,
    )
    res, steps = drive(
        gen,
        clock,
        [
            lambda s: queued(clock, 1, "10"),
            lambda s: queued(clock, 1, "10"),
            lambda s: core.Reply(200, {}, {}, clock()),
        ],
    )
    assert isinstance(res, AcquireTimeout) and res.position == 1 and res.retry_after == 10
    posts = [s for s in steps if isinstance(s, core.Http) and s.method == "POST"]
    assert posts[0].json["wait"] == 3.0 and posts[1].json["wait"] == 0  # last try at the deadline
    assert sum(s.seconds for s in steps if isinstance(s, core.Sleep)) <= 3.0
    assert steps[-1] == core.Http("DELETE", "/v1/pools/p/requests/rid", timeout=2.0)
    assert clock.t - 100 < 3.1


def test_timeout_messages_print_the_timeout_to_the_millisecond():
    """A timeout computed by the caller (a remainder: 0.6995481290000498) prints as 0.7s."""
    t = 0.6995481290000498
    clock = Clock()
    gen = core.acquire_steps(
        cfg(clock, max_wait=20),
        5,
        core.AcquireOptions(ttl=3, timeout=t, holder=None, request_id="rid"),
        on_queued=None,
    )
    res, _ = drive(
        gen,
        clock,
        [lambda s: queued(clock, 1, "10")] * 2 + [lambda s: core.Reply(200, {}, {}, clock())],
    )
    assert isinstance(res, AcquireTimeout) and "no grant of 5 within 0.7s " in str(res), res

    def broker(step):
        if step.json["amount"] == 5:
            return core.Reply(200, {}, resized_body(5), clock())
        clock.t += 0.5
        return queued(clock, pos=1, ra="0")

    out, _ = drive(_resize.resize_steps(cfg(clock, max_wait=1.0), held_lease(clock), 9, t), clock,
                   [broker] * 20)  # fmt: skip
    assert isinstance(out, AcquireTimeout) and "within 0.7s (position 1)" in str(out), out


def test_timeout_zero_tries_once_without_queueing():
    clock = Clock()
    gen = core.acquire_steps(
        cfg(clock),
        5,
        core.AcquireOptions(ttl=None, timeout=0, holder=None, request_id="r"),
        on_queued=None,
    )
    busy = core.Reply(
        503,
        {"retry-after": "1"},
        {"detail": {"error": "busy", "message": "m", "queue_length": 2}},
        0,
    )
    res, steps = drive(gen, clock, [lambda s: busy])
    assert isinstance(res, AcquireTimeout) and res.queue_length == 2
    assert len(steps) == 1 and steps[0].json["queue"] is False and steps[0].json["wait"] == 0


def test_transport_errors_are_retried_then_backend_unavailable():
    clock = Clock()
    gen = core.acquire_steps(
        cfg(clock, backend_timeout=3),
        5,
        core.AcquireOptions(ttl=None, timeout=None, holder=None, request_id="r"),
        on_queued=None,
    )
    err = httpx.ConnectError("refused")

    def fail(step):
        clock.t += 0.2
        return err

    res, steps = drive(gen, clock, [fail] * 200)
    assert isinstance(res, BackendUnavailable)
    assert 3 <= clock.t - 100 < 6
    assert (
        len(
            {s.json["request_id"] for s in steps if isinstance(s, core.Http) and s.method == "POST"}
        )
        == 1
    )


@pytest.mark.parametrize(
    "status, detail, exc",
    [
        (
            413,
            {"error": "capacity_exceeded", "message": "m", "amount": 9, "capacity": 4},
            CapacityExceeded,
        ),
        (404, {"error": "pool_not_found", "message": "m"}, PoolNotFound),
        (401, {"error": "unauthorized", "message": "m"}, gpulock_client.AuthError),
    ],
)
def test_refusals_raise_at_once(status, detail, exc):
    clock = Clock()
    gen = core.acquire_steps(
        cfg(clock),
        9,
        core.AcquireOptions(ttl=None, timeout=None, holder=None, request_id="r"),
        on_queued=None,
    )
    res, steps = drive(gen, clock, [lambda s: core.Reply(status, {}, {"detail": detail}, 0)])
    assert isinstance(res, exc) and len(steps) == 1 and res.status == status
    if exc is CapacityExceeded:
        assert (res.amount, res.capacity) == (9, 4)


def test_422_names_the_field():
    r = core.Reply(422, {}, {"detail": [{"loc": ["body", "amount"], "msg": "bad size"}]}, 0)
    e = core.error_for(r, "p")
    assert isinstance(e, InvalidArgument) and "amount: bad size" in str(e)
    assert "body." not in str(e)  # the field as the caller named it


def test_priority_is_sent_on_every_attempt_and_left_out_at_zero():
    """Sent with each long poll of one request; 0 is not sent (a broker older than priorities
    refuses the field: extra fields are a 422 there)."""
    clock = Clock()
    for prio, sent in ((5, 5), (-100, -100), (0, None)):
        gen = core.acquire_steps(
            cfg(clock),
            5,
            core.AcquireOptions(ttl=None, timeout=None, holder=None, request_id="r", priority=prio),
            on_queued=None,
        )
        res, steps = drive(
            gen,
            clock,
            [lambda s: queued(clock, 2), lambda s: core.Reply(201, {}, grant_body(), clock())],
        )
        posts = [s for s in steps if isinstance(s, core.Http)]
        assert len(posts) == 2 and all(p.json.get("priority") == sent for p in posts), posts
        assert all(("priority" in p.json) == (sent is not None) for p in posts)


@pytest.mark.parametrize("bad", [101, -101, True, 1.5, "5", None])
def test_a_bad_priority_raises_before_anything_is_sent(bad):
    clock = Clock()
    gen = core.acquire_steps(
        cfg(clock, gate=core.Gate(1)),
        5,
        core.AcquireOptions(ttl=None, timeout=None, holder=None, request_id="r", priority=bad),
        on_queued=None,
    )
    res, steps = drive(gen, clock, [])
    assert isinstance(res, InvalidArgument) and steps == [], (res, steps)
    assert f"got {bad!r}" in str(res) and "[-100, 100]" in str(res)


def test_device_is_sent_on_every_attempt_and_left_out_when_none():
    """Sent with each long poll of one request; None (any device) is not sent (a broker older
    than devices refuses the field). The lease's device is the grant's, 0 when it has none."""
    clock = Clock()
    for dev in (1, 0, 63, None):
        gen = core.acquire_steps(
            cfg(clock),
            5,
            core.AcquireOptions(ttl=None, timeout=None, holder=None, request_id="r", device=dev),
            on_queued=None,
        )
        body = {**grant_body(), "device": 0 if dev is None else dev}
        res, steps = drive(
            gen,
            clock,
            [lambda s: queued(clock, 2), lambda s: core.Reply(201, {}, body, clock())],
        )
        posts = [s for s in steps if isinstance(s, core.Http)]
        assert len(posts) == 2 and all(p.json.get("device") == dev for p in posts), posts
        assert all(("device" in p.json) == (dev is not None) for p in posts)
        assert core.LeaseState("p", res[0], res[1], clock).device == (dev or 0)
    assert core.LeaseState("p", grant_body(), 100.0, clock).device == 0  # an older broker


@pytest.mark.parametrize("bad", [-1, 64, True, 1.5, "1", [0]])
def test_a_bad_device_raises_before_anything_is_sent(bad):
    clock = Clock()
    gen = core.acquire_steps(
        cfg(clock, gate=core.Gate(1)),
        5,
        core.AcquireOptions(ttl=None, timeout=None, holder=None, request_id="r", device=bad),
        on_queued=None,
    )
    res, steps = drive(gen, clock, [])
    assert isinstance(res, InvalidArgument) and steps == [], (res, steps)
    assert f"got {bad!r}" in str(res) and "[0, 63]" in str(res)


@pytest.mark.parametrize(
    "options, shown",
    [
        (dict(holder="x"), "holder must be a dict of metadata, got 'x'"),
        (dict(ttl=0.5), "ttl must be between 1 and 86400 seconds, got 0.5"),
        (dict(request_id="r" * 97), "request_id must be 1-96 characters"),
        (dict(request_id="a b"), "request_id must be 1-96 characters"),
        # the timeout, as the core checks it (it was used unchecked: -1 and inf waited
        # forever, "5" was a TypeError, nan a false message about connections)
        (dict(timeout=-1), "timeout must be between 0 and 1e+09 seconds, got -1"),
        (dict(timeout=float("nan")), "timeout must be a finite number of seconds, got nan"),
        (dict(timeout=float("inf")), "timeout must be a finite number of seconds, got inf"),
        (dict(timeout=1e12), "timeout must be between 0 and 1e+09 seconds, got 1000000000000.0"),
        (dict(timeout="soon"), "timeout must be a number of seconds, got 'soon'"),
    ],
)
def test_a_bad_holder_ttl_request_id_or_timeout_raises_before_anything_is_sent(options, shown):
    """The SDK's InvalidArgument (not a ValueError, not the broker's 422) names the value, by
    the broker's bounds (a ttl of at least 1 s, request ids of at most 96 characters) and the
    core's (the timeout)."""
    clock = Clock()
    gen = core.acquire_steps(
        cfg(clock, gate=core.Gate(1)), 5, core.AcquireOptions(**options), on_queued=None
    )
    res, steps = drive(gen, clock, [])
    assert isinstance(res, InvalidArgument) and steps == [], (res, steps)
    assert shown in str(res), res


def test_configure_checks_the_pool_settings_before_anything_is_sent():
    for bad, shown in (
        (dict(policy="lifo"), "policy must be 'fifo' or 'backfill', got 'lifo'"),
        (dict(max_waiters=0), "max_waiters must be an integer in [1, 1000000], got 0"),
        (dict(backfill_window="soon"), "backfill_window must be a number of seconds"),
        (dict(devices="4GiB"), "devices must be a list"),
        (dict(placement="nearest"), "placement must be 'bestfit' or 'spread'"),
    ):
        with pytest.raises(InvalidArgument) as e:
            core.checked_settings(core.PoolSettings(capacity=1, **bad))
        assert shown in str(e.value), e.value
    s = core.checked_settings(core.PoolSettings(backfill_window="2", devices=("1GiB", 5)))
    # devices given: their sum is the capacity (the broker's to add up)
    assert core.configure_body(s, None) == {"backfill_window": 2.0, "devices": ["1GiB", 5]}
    assert core.configure_body(
        core.PoolSettings(policy="fifo"), {"capacity": 9, "devices": [{"capacity": 4}] * 2}
    ) == {"capacity": 9, "policy": "fifo", "devices": [4, 4]}


def test_validity_deadline_counts_from_the_send_time():
    clock = Clock()
    s = core.LeaseState("p", grant_body(expires_in=10.0, ttl=30), sent=90.0, clock=clock)
    assert s.valid_until == pytest.approx(90.0 + 10 * 0.99 - 0.05)
    assert s.next_renew == pytest.approx(90.0 + 10 / 3)  # remaining time, not the full ttl
    fired = []
    s.add_callback(lambda: fired.append(1))
    clock.t = s.valid_until - 0.001
    s.check()
    clock.t = s.valid_until
    with pytest.raises(LeaseLost):
        s.check()
    assert fired == [1]


def test_renew_outcomes():
    clock = Clock()
    s = core.LeaseState("p", grant_body(), sent=100.0, clock=clock)
    ok = core.Reply(200, {}, {"expires_in": 30.0, "expires_at": 2e9, "ttl": 30.0}, 150.0)
    assert drive(holding.renew_steps(cfg(clock), s, 1.0), clock, [lambda st: ok])[0] is True
    assert s.valid_until == pytest.approx(150 + 30 * 0.99 - 0.05)
    assert (
        drive(holding.renew_steps(cfg(clock), s, 1.0), clock, [lambda st: httpx.ReadTimeout("t")])[
            0
        ]
        is None
    )
    assert s.active
    gone = core.Reply(410, {}, {"detail": {"error": "lease_lost", "message": "gone"}}, 0)
    assert drive(holding.renew_steps(cfg(clock), s, 1.0), clock, [lambda st: gone])[0] is False
    assert s.lost_reason and not s.active


def test_release_reports_lost():
    clock = Clock()
    s = core.LeaseState("p", grant_body(), sent=100.0, clock=clock)
    gone = core.Reply(410, {}, {"detail": {"error": "lease_lost", "message": "gone"}}, 0)
    res, _ = drive(holding.release_steps(cfg(clock), s, None), clock, [lambda st: gone])
    assert isinstance(res, LeaseLost)
    ok = core.Reply(200, {}, {}, 0)
    res, _ = drive(holding.release_steps(cfg(clock), s, "was lost"), clock, [lambda st: ok])
    assert isinstance(res, LeaseLost) and res.reason == "was lost"
    res, steps = drive(
        holding.release_steps(cfg(clock), s, None),
        clock,
        [lambda st: core.Reply(503, {"retry-after": "1"}, {}, 0), lambda st: ok],
    )
    assert res is None and isinstance(steps[1], core.Sleep)


def test_heartbeat_request_budget_ends_before_any_deadline():
    clock = Clock()
    a = core.LeaseState("p", grant_body(expires_in=2.0, ttl=6), sent=100.0, clock=clock)
    b = core.LeaseState("p", grant_body(expires_in=30.0), sent=100.0, clock=clock)
    assert holding.request_budget([a, b], 100.0) == pytest.approx(2 * 0.99 - 0.05)
    due, wake = holding.heartbeat_plan([a, b], 100.7)
    assert due == [a] and wake == pytest.approx(a.next_renew)


def test_public_names():
    assert sorted(gpulock_client.__all__) == sorted(
        n for n in dir(gpulock_client) if not n.startswith("_") and n not in ("errors",)
    )


def test_validity_counts_from_the_reply_after_a_long_poll():
    """A grant held ``held_ms`` by the broker: validity from sent + held*(1-drift), not sent."""
    clock = Clock()
    body = {**grant_body(expires_in=2.0, ttl=2.0), "held_ms": 4000}
    s = core.LeaseState("p", body, sent=100.0, clock=clock)
    assert s.valid_until == pytest.approx(100.0 + 4.0 * 0.99 + 2.0 * 0.99 - 0.05)
    assert s.next_renew == pytest.approx(100.0 + 4.0 * 0.99 + 2.0 / 3)
    clock.t = 104.1  # the reply arrives after 4.1 s: still valid
    s.check()
    clock.t = s.valid_until
    with pytest.raises(LeaseLost):
        s.check()
    old = core.LeaseState(
        "p", grant_body(expires_in=2.0, ttl=2.0), sent=100.0, clock=Clock()
    )  # old broker
    assert old.valid_until == pytest.approx(100.0 + 2.0 * 0.99 - 0.05)


# ---- lease.resize --------------------------------------------------------------------------


def resized_body(amount, expires_in=30.0, held_ms=0):
    return {
        "lease_id": "a" * 32,
        "pool": "p",
        "amount": amount,
        "token": 7,
        "ttl": 30.0,
        "expires_in": expires_in,
        "expires_at": 1e9 + expires_in,
        "device": 0,
        "held_ms": held_ms,
    }


def held_lease(clock):
    return core.LeaseState("p", grant_body(), clock(), clock)


@pytest.mark.parametrize(
    "amount,timeout", [(5, None), ("5B", 3.0), ("0", None), (-1, None), (True, None), (9, -1)]
)
def test_resize_sends_nothing_for_the_same_amount_or_a_bad_value(amount, timeout):
    clock = Clock()
    s = held_lease(clock)
    out, steps = drive(_resize.resize_steps(cfg(clock), s, amount, timeout), clock, [])
    assert steps == [] and s.amount == 5
    assert out is None if amount in (5, "5B") else isinstance(out, InvalidArgument), out


def test_resize_of_a_released_or_lost_lease_sends_nothing():
    clock = Clock()
    s = held_lease(clock)
    s.released = True
    out, steps = drive(_resize.resize_steps(cfg(clock), s, 9, None), clock, [])
    assert isinstance(out, LeaseLost) and steps == []
    s = held_lease(clock)
    s.mark_lost("gone")
    out, steps = drive(_resize.resize_steps(cfg(clock), s, 9, None), clock, [])
    assert isinstance(out, LeaseLost) and steps == []


def test_resize_long_polls_then_counts_validity_from_the_answer():
    clock = Clock()
    s = held_lease(clock)
    c = cfg(clock, max_wait=1.0)
    sent = []

    def ok(step):
        sent.append(clock())
        return core.Reply(200, {}, resized_body(9, expires_in=20.0, held_ms=500), clock())

    out, steps = drive(_resize.resize_steps(c, s, "9", 60), clock, [lambda st: queued(clock), ok])
    http = [st for st in steps if isinstance(st, core.Http)]
    assert out is None and s.amount == 9 and len(http) == 2
    assert http[0].path == f"/v1/pools/p/leases/{'a' * 32}/resize" and http[0].lane == core.WAIT
    assert http[0].json["amount"] == 9 and http[0].json["wait"] == 1.0
    assert http[1].json["timeout"] < 60  # what is left of it
    # Chubby's rule from the send of the answering request plus the broker's hold
    assert s.valid_until == core.validity_deadline(sent[0], 20.0, 0.5)


def test_resize_withdraws_a_growth_the_broker_keeps_past_the_timeout():
    """The broker answers its own timeout; when it does not (still queued 2 s after it), the
    client withdraws the growth: a resize back to the amount it holds, never waiting."""
    clock = Clock()
    s = held_lease(clock)
    withdrawn = []

    def broker(step):
        if step.json["amount"] == 5:
            withdrawn.append(step)
            return core.Reply(200, {}, resized_body(5), clock())
        clock.t += 1.0  # a long poll of 1 s
        return queued(clock, pos=1, ra="0")

    c = cfg(clock, max_wait=1.0)
    out, steps = drive(_resize.resize_steps(c, s, 9, 2.0), clock, [broker] * 20)
    assert isinstance(out, AcquireTimeout) and out.position == 1, out
    assert clock.t - 100.0 >= 2.0 + _resize.RESIZE_SLACK_S
    assert [w.json for w in withdrawn] == [{"amount": 5, "timeout": 0, "wait": 0}]
    assert s.amount == 5
