"""The I/O-free core: validation, encoding, reply decoding, error translation and the lease's
local validity clock (with an injected fake clock). No Redis."""

from __future__ import annotations

import json
import math

import pytest
import redis.exceptions as rex
from hypothesis import given, settings
from hypothesis import strategies as st

from dataclasses import replace

from gpulock_common.options import PoolSettings, Preemption

from gpulock.protocol import args as _args
from gpulock.protocol import lease as _lease
from gpulock.protocol import replies as _replies
from gpulock.transport import translate as _translate
from gpulock.protocol import request as P
from gpulock.protocol.keys import pool_keys
from gpulock.errors import (
    AcquireTimeout,
    BackendUnavailable,
    CapacityExceeded,
    GpuLockError,
    InvalidArgument,
    LeaseLost,
    PoolNotFound,
    QueueFull,
    QuotaExceeded,
    RoomExceeded,
)


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


# ---- names and ids ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpu0", "GPU-1", "a", "x" * 64, "GPU-8f0c2a1e.b_3"])
def test_pool_name_ok(name):
    assert _args.validate_pool_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "a{b",
        "a}b",
        "{gpu0}",
        "a:b",
        "a b",
        " gpu0",
        "gpu0\n",
        "x" * 65,
        "gpü",
        None,
        3,
        b"gpu0",
        "a*b",
        "a/b",
    ],
)
def test_pool_name_rejected(name):
    with pytest.raises(InvalidArgument) as ei:
        _args.validate_pool_name(name)
    assert repr(name) in str(ei.value)


@pytest.mark.parametrize("rid", ["r1", "job:42", "a.b-c_d", "x" * 128])
def test_request_id_ok(rid):
    assert _args.validate_request_id(rid) == rid


@pytest.mark.parametrize("rid", ["", "a b", "a\tb", "x" * 129, "a{b}", "ü", 5, None, "a|b", "a\nb"])
def test_request_id_rejected(rid):
    with pytest.raises(InvalidArgument) as ei:
        _args.validate_request_id(rid)
    assert repr(rid) in str(ei.value)


def test_pool_keys_share_one_hash_tag():
    keys = pool_keys("gpu0")
    assert len(keys) == 8
    assert all(k.startswith("gpulock:{gpu0}:") for k in keys)
    assert [k.rsplit(":", 1)[1] for k in keys] == [
        "cfg",
        "leases",
        "holders",
        "queue",
        "waiters",
        "wexp",
        "tickets",
        "events",
    ]


def test_new_id_is_128_bit_hex():
    ids = {_args.new_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


# ---- metadata -----------------------------------------------------------------------------


def test_meta_roundtrip_adds_host_and_pid():
    s = _args.encode_meta({"purpose": "embed", "n": 3})
    d = _args.decode_meta(s)
    assert d["purpose"] == "embed" and d["n"] == 3 and "host" in d and "pid" in d
    assert _args.decode_meta(s.encode()) == d
    assert _args.decode_meta("") == {}
    assert _args.decode_meta("not json") == {"raw": "not json"}
    assert _args.decode_meta("[1]") == {"value": [1]}


def test_meta_too_large_or_wrong_type():
    with pytest.raises(InvalidArgument, match="512"):
        _args.encode_meta({"blob": "x" * 600})
    with pytest.raises(InvalidArgument, match="dict"):
        _args.encode_meta(["not", "a", "dict"])  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), [float("nan")]])
def test_meta_with_nan_or_infinity_is_refused(value):
    """JSON has no NaN or infinity: a holder record with one would make every reader's JSON
    (``gpulock status --json``) invalid for strict parsers. A fresh user's finding."""
    with pytest.raises(InvalidArgument, match="NaN|JSON"):
        _args.encode_meta({"purpose": value})


# ---- AcquireRequest ---------------------------------------------------------------------


def _build(amount="1GiB", **kw):
    """``AcquireRequest.build`` with the acquire's keywords ``kw`` (AcquireOptions' fields)."""
    return P.AcquireRequest.build(
        "gpu0", amount, P.AcquireOptions(**kw), waiter_ttl=5.0, default_ttl=30.0
    )


def test_acquire_request_argv():
    r = _build("2GiB", ttl=0.6, timeout=0, request_id="req-1", holder={"purpose": "t"})
    argv = r.argv("try", "chan1")
    assert argv[0] == "req-1"
    assert len(argv[1]) == 32
    assert argv[2:6] == [str(2 << 30), "600", "5000", "try"]
    assert json.loads(argv[6])["purpose"] == "t"
    assert r.timeout_s == 0.0
    assert _build(ttl=None).ttl_s == 30.0
    assert _build(timeout=None).timeout_s is None
    # a resident request ends with the kind, its tenant and device as given or empty
    assert _build(resident=True).argv("wait", "c")[9:] == ["", "", "resident"]
    assert _build(resident=True, device=2, tenant="a").argv("wait", "c")[9:] == [
        "a",
        "2",
        "resident",
    ]
    assert len(_build().argv("wait", "c")) == 9


def test_translate_room_and_quota_with_resident():
    e = _translate.translate(rex.ResponseError("GPULOCK_ROOM 45 40 100 60"), "gpu0")
    assert isinstance(e, RoomExceeded) and isinstance(e, CapacityExceeded)
    assert (e.amount, e.room, e.capacity, e.resident, e.device) == (45, 40, 100, 60, None)
    e = _translate.translate(rex.ResponseError("GPULOCK_ROOM 20 10 50 40 device any"), "gpu0")
    assert isinstance(e, RoomExceeded) and e.device == -1 and "most room" in str(e)
    e = _translate.translate(rex.ResponseError("GPULOCK_ROOM 15 10 50 40 device 1"), "gpu0")
    assert isinstance(e, RoomExceeded) and e.device == 1 and "device 1" in str(e)
    e = _translate.translate(rex.ResponseError("GPULOCK_QUOTA 25 50 a 30"), "gpu0")
    assert isinstance(e, QuotaExceeded) and (e.quota, e.tenant, e.resident) == (50, "a", 30)
    e = _translate.translate(rex.ResponseError("GPULOCK_QUOTA 25 20 a"), "gpu0")
    assert isinstance(e, QuotaExceeded) and e.resident == 0 and "quota of tenant 'a'" in str(e)


@pytest.mark.parametrize(
    "kw,word",
    [
        (dict(amount=0), "amount"),
        (dict(amount=-1), "amount"),
        (dict(amount=float("nan")), "amount"),
        (dict(amount="abc"), "amount"),
        (dict(amount=True), "amount"),
        (dict(amount="4XB"), "amount"),
        (dict(ttl=0), "ttl"),
        (dict(ttl=-1), "ttl"),
        (dict(ttl=float("nan")), "ttl"),
        (dict(ttl=86401), "ttl"),
        (dict(ttl=0.01), "ttl"),
        (dict(timeout=-1), "timeout"),
        (dict(timeout=float("nan")), "timeout"),
        (dict(request_id="a b"), "request_id"),
        (dict(request_id=""), "request_id"),
        (dict(holder={"x": "y" * 1000}), "metadata"),
    ],
)
def test_acquire_request_rejects(kw, word):
    amount = kw.pop("amount", "1GiB")
    with pytest.raises(InvalidArgument, match=word):
        _build(amount, **kw)


# ---- reply decoding ----------------------------------------------------------------------


def test_decode_acquire_granted_and_queued():
    g = _replies.decode_acquire("t1", [1, b"ab" * 16, 17, 5000, 1024, 4000, 99, 4096, 1024])
    assert isinstance(g, _replies.Grant)
    assert (
        g.ticket,
        g.lease_id,
        g.token,
        g.expires_ms,
        g.amount,
        g.now_ms,
        g.epoch,
        g.capacity,
    ) == ("t1", "ab" * 16, 17, 5000, 1024, 4000, 99, 4096)
    q = _replies.decode_acquire("t1", [0, 3, 250, 5, 4000, 99, 4096, 4096])
    assert (
        isinstance(q, _replies.NotGranted)
        and q.queued
        and q.position == 3
        and q.retry_after_ms == 250
    )
    assert q.queue_length == 5 and q.used == 4096
    n = _replies.decode_acquire("t1", [2, 0, -1, 0, 4000, 99, 4096, 4096])
    assert not n.queued and n.position == 0 and n.retry_after_ms == -1


def test_decode_events():
    msg = b"g 1000\nt1 " + b"a" * 32 + b" 7 2000 512\nt2 " + b"b" * 32 + b" 8 2500 256"
    gs = _replies.decode_events(msg)
    assert [(g.ticket, g.lease_id, g.token, g.expires_ms, g.amount, g.now_ms) for g in gs] == [
        ("t1", "a" * 32, 7, 2000, 512, 1000),
        ("t2", "b" * 32, 8, 2500, 256, 1000),
    ]
    assert _replies.decode_events("x 1000\nwhatever") == []
    assert _replies.decode_events("g 5\nmalformed line") == []


def test_decode_configure():
    r = [1, 80, 4, 10, 7, 20_000, 15_000, b"backfill", 1500, b"a=4096", b"40 40", b"spread"]
    c = _replies.decode_configure(r)
    assert (c.created, c.capacity, c.epoch, c.used, c.max_waiters) == (1, 80, 4, 10, 7)
    assert (c.max_ttl_ms, c.grace_left_ms) == (20_000, 15_000)
    assert c.queue == _replies.QueueConfig("backfill", 1500, "a=4096", "40 40", "spread")
    # the queue's settings are in the reply as configure.lua takes them back
    from gpulock.protocol.flow import configure_args

    assert configure_args(80, 7, 20_000, True, True, c.queue)[5:] == [
        "backfill",
        "1500",
        "a=4096",
        "40 40",
        "spread",
        "",  # preemption: not in this reply, so unchanged
    ]
    short = _replies.decode_configure([0, 80, 4, 10, 7])  # fields not in a reply
    assert (short.max_ttl_ms, short.grace_left_ms, short.queue) == (0, None, None)


def test_decode_configure_preemption():
    """Reply element 13 is the preemption setting now ("" off), kept as ARGV 11 takes it:
    a pool made again from a reply keeps it."""
    from gpulock.protocol.flow import configure_args

    r = [1, 80, 4, 10, 7, 20_000, 0, b"fifo", 2000, b"", b"", b"bestfit"]
    on = _replies.decode_configure([*r, b"5 30000"])
    assert on.queue is not None and on.queue.preempt == "5 30000"
    assert on.queue.shown(80)["preemption"] == {"gap": 5, "yield_grace_s": 30.0}
    assert configure_args(80, 7, 20_000, True, True, on.queue)[10] == "5 30000"
    off = _replies.decode_configure([*r, b""])
    assert off.queue is not None and off.queue.preempt == "off"
    assert off.queue.shown(80)["preemption"] is None
    assert configure_args(80, 7, 20_000, True, True, off.queue)[10] == "off"
    older = _replies.decode_configure(r)  # a reply without it: a remake leaves it unchanged
    assert older.queue is not None and older.queue.preempt is None
    assert configure_args(80, 7, 20_000, True, True, older.queue)[10] == ""


@pytest.mark.parametrize(
    "given, argv",
    [(None, ""), (False, "off"), (Preemption(3), "3 30000"), (Preemption(200, 0.1), "200 100")],
)
def test_configure_asks_the_preemption_given(given, argv):
    q = _replies.QueueConfig.asked(PoolSettings(preemption=given).checked(), None)
    assert (q.argv()[5] if q is not None else "") == argv


def test_decode_renew():
    lid = b"c" * 32
    r = [9_000, 4, [12_000, 0], [[b"q", 2], [b"g", lid, 17, 39_000, 512, 1], [b"x"]]]
    rep = _replies.decode_renew(r, ["t1", "t2", "t3"])
    assert (rep.now_ms, rep.epoch, rep.expiries) == (9_000, 4, [12_000, 0])
    queued, granted, unknown = rep.waiters
    assert queued == _replies.Queued(2) and unknown is None
    assert granted == _replies.Grant("t2", "c" * 32, 17, 39_000, 512, 9_000, 4, device=1)
    gone = _replies.decode_renew(["9000", "0", ["0"], []])  # the pool is gone
    assert (gone.epoch, gone.expiries, gone.waiters) == (0, [0], [])


def test_decode_the_other_replies():
    assert _replies.decode_release([1, 5_000, 256, 2]) == _replies.ReleaseReply(True, 5_000, 256, 2)
    assert not _replies.decode_release([0, 5_000, 0, 0]).released
    assert _replies.decode_cancel([2, 5_000]) == _replies.CancelReply(2, 5_000)
    assert _replies.decode_reap([1, 0, 3, -1, 5_000]) == _replies.ReapReply(1, 0, 3, -1, 5_000)
    rea = _replies.decode_reassert([5_000, 4, 30_000, [35_000, -2]])
    assert rea == _replies.ReassertReply(5_000, 4, 30_000, [35_000, -2])
    assert _replies.REASSERT_REFUSED[rea.results[1]].startswith(
        "Redis lost the pool, and the lease does"
    )
    dev = _replies.decode_device([1, 1, 5_000, 100, 40, 10, 9_000, 0])
    assert (dev.holder, dev.written, dev.external, dev.external_until_ms) == (1, 1, 10, 9_000)


def test_status_queue_config_is_what_configure_takes():
    st_ = _replies.PoolStatus("p", 80, 0, 4, 0, 7, 0, 0, 0, 0, 0, policy="backfill")
    st_.tenants["a"] = _replies.TenantUse(0, 4096)
    st_.devices.extend([_replies.DeviceUse(0, 40, 0), _replies.DeviceUse(1, 40, 0)])
    assert st_.queue_config() == _replies.QueueConfig(
        "backfill", 2000, "a=4096", "40 40", "bestfit", "off"
    )
    on = replace(st_, preemption=Preemption(5, 2.5))
    assert on.queue_config().preempt == "5 2500"


def test_status_refusal_is_the_error_acquire_answers_for_what_never_fits():
    """PoolStatus.refusal reads acquire.lua's at-once refusals off a snapshot: the same error,
    with the same message, as the pool's reply translates to."""
    st_ = _replies.PoolStatus("p", 100, 0, 4, 0, 7, 0, 0, 0, 0, 0, resident=50, resident_queued=10)
    st_.tenants["t"] = _replies.TenantUse(0, 30)
    assert st_.room == 40
    assert st_.refusal(40) is None and st_.refusal(30, "t") is None
    assert st_.refusal(40, "other") is None  # a tenant without a quota
    for amount, tenant, reply in (
        (101, None, "GPULOCK_CAPACITY 101 100"),
        (41, None, "GPULOCK_ROOM 41 40 100 60"),
        (31, "t", "GPULOCK_QUOTA 31 30 t 0"),
    ):
        got = st_.refusal(amount, tenant)
        want = _translate.translate(rex.ResponseError(reply), "p")
        assert type(got) is type(want) and str(got) == str(want), (got, want)
    assert isinstance(st_.refusal(41), RoomExceeded) and st_.refusal(41).room == 40


def test_decode_status():
    now = 10_000
    r = [
        1,
        now,
        4096,
        1536,
        77,
        12,
        100,
        1,
        1,
        3,
        0,
        0,
        [
            [
                b"c" * 32,
                1536,
                12,
                now + 2500,
                now - 1000,
                3000,
                b"t1",
                b'{"host":"h","pid":1,"purpose":"x"}',
            ]
        ],
        [[b"t2", 4096, now - 750, now + 4000, b'{"host":"h","pid":2}']],
    ]
    st_ = _replies.decode_status("gpu0", r)
    assert (st_.capacity, st_.used, st_.epoch, st_.fence, st_.max_waiters) == (
        4096,
        1536,
        77,
        12,
        100,
    )
    assert (st_.lease_count, st_.waiter_count, st_.grants) == (1, 1, 3)
    assert st_.free == 2560
    (l,) = st_.leases
    assert (l.lease_id, l.amount, l.token, l.request_id) == ("c" * 32, 1536, 12, "t1")
    assert (
        math.isclose(l.expires_in, 2.5)
        and math.isclose(l.held_for, 1.0)
        and math.isclose(l.ttl, 3.0)
    )
    assert l.holder["purpose"] == "x"
    (w,) = st_.waiters
    assert (w.position, w.request_id, w.amount) == (1, "t2", 4096)
    assert math.isclose(w.waited, 0.75) and math.isclose(w.expires_in, 4.0)
    assert st_.to_dict()["leases"][0]["amount"] == 1536
    assert _replies.decode_status("gpu0", [0, now]) is None
    # a reply without preemption's fields: off, no counters, nothing asked
    assert (st_.preemption, st_.yields, l.yield_in, l.priority) == (
        None,
        _replies.YieldCounts(),
        None,
        None,
    )


def test_decode_status_preemption():
    """status.lua's fields after out_of_order_pm: preempt, y_asked, y_done, y_done_ms,
    y_taken; per lease 11 yield_deadline_ms (0: not asked) and 12 priority ('': never asked)."""
    now = 10_000
    lease = [b"c" * 32, 10, 12, now + 2500, now - 1000, 3000, b"t1", b"{}", b"", 0]
    r: list = [1, now, 10, 10, 77, 12, 100, 2, 1, 3, 0, 0]
    r += [
        [[*lease, now + 1500, b"-10"], [b"d" * 32, *lease[1:], 0, b""]],
        [[b"t2", 4096, now - 750, now + 4000, b"{}", 10]],
    ]
    r += [0, 60_000, 0, 0, 0, b"", b"fifo", 2000, [], [], b"bestfit", 0, 0, 0, 0, 0]
    r += [b"5 30000", 4, 2, 3000, 1]
    st_ = _replies.decode_status("gpu0", r)
    assert st_.preemption == Preemption(5, 30.0)
    assert st_.yields == _replies.YieldCounts(4, 2, 3.0, 1)
    assert st_.yields.mean_time_to_yield == 1.5 and st_.yields.outstanding == 1
    asked, other = st_.leases
    assert math.isclose(asked.yield_in, 1.5) and asked.priority == -10 and asked.yield_requested
    assert (other.yield_in, other.priority, other.yield_requested) == (None, None, False)
    assert st_.yielding == [asked]
    d = st_.to_dict()
    assert d["preemption"] == {"gap": 5, "yield_grace_s": 30.0}
    assert d["yields"] == {"asked": 4, "done": 2, "done_seconds": 3.0, "taken": 1}
    assert st_.queue_config().preempt == "5 30000"
    r[30] = b""
    assert _replies.decode_status("gpu0", r).queue_config().preempt == "off"


def test_decode_status_kept_bytes():
    """status.lua's fields after y_taken: kept_bytes, kept_count, k_kept, k_told; per lease
    13 kept (1/0). A reply without them (an older server): nothing kept, counters 0."""
    now = 10_000
    lease = [b"c" * 32, 10, 12, now + 2500, now - 1000, 3000, b"t1", b"{}", b"", 0, 0, b""]
    r: list = [1, now, 100, 30, 77, 12, 100, 2, 0, 3, 0, 0]
    r += [[[*lease, 1], [b"d" * 32, 20, *lease[2:], 0]], []]
    r += [0, 60_000, 0, 0, 0, b"", b"fifo", 2000, [], [], b"bestfit", 0, 0, 0, 0, 0]
    r += [b"", 0, 0, 0, 0]
    old = _replies.decode_status("gpu0", r)
    assert (old.kept_bytes, old.kept_leases, old.releases_kept, old.kept_asked_back) == (0,) * 4
    assert old.kept == [old.leases[0]]  # a lease's own field decodes on its own
    old12 = _replies.decode_status("gpu0", [*r[:12], [lease], *r[13:]])
    assert [li.kept for li in old12.leases] == [False]  # a 12-element lease: not kept
    r += [10, 1, 7, 2]
    st_ = _replies.decode_status("gpu0", r)
    kept, other = st_.leases
    assert (kept.kept, other.kept) == (True, False) and st_.kept == [kept]
    assert (st_.kept_bytes, st_.kept_leases, st_.releases_kept, st_.kept_asked_back) == (
        10,
        1,
        7,
        2,
    )
    assert st_.used == 30 and st_.free == 70  # kept bytes are held bytes
    d = st_.to_dict()
    assert [x["kept"] for x in d["leases"]] == [True, False]
    assert (d["kept_bytes"], d["kept_leases"], d["releases_kept"], d["kept_asked_back"]) == (
        10,
        1,
        7,
        2,
    )


# ---- error translation ------------------------------------------------------------------


@pytest.mark.parametrize(
    "msg,cls",
    [
        ("GPULOCK_BADARG amount must be a decimal integer, got 'x'", InvalidArgument),
        ("GPULOCK_CONFLICT request id r holds a lease of another amount", InvalidArgument),
        ("GPULOCK_NOPOOL", PoolNotFound),
        ("GPULOCK_CAPACITY 10 5", CapacityExceeded),
        ("GPULOCK_QUEUEFULL 3 3", QueueFull),
        ("ERR something else", BackendUnavailable),
    ],
)
def test_translate_response_errors(msg, cls):
    e = _translate.translate(rex.ResponseError(msg), "gpu0")
    assert isinstance(e, cls) and isinstance(e, GpuLockError)
    if cls is CapacityExceeded:
        assert (e.amount, e.capacity) == (10, 5)
    if cls is QueueFull:
        assert (e.queue_length, e.max_waiters) == (3, 3)
    if cls is InvalidArgument and "BADARG" in msg:
        assert "'x'" in str(e)


def test_translate_connection_errors_and_passthrough():
    assert isinstance(_translate.translate(rex.ConnectionError("down"), "p"), BackendUnavailable)
    assert isinstance(_translate.translate(rex.TimeoutError("slow"), "p"), BackendUnavailable)
    assert isinstance(_translate.translate(OSError("x"), "p"), BackendUnavailable)
    lost = LeaseLost("a" * 32, "why")
    assert _translate.translate(lost, "p") is lost
    other = KeyError("k")
    assert _translate.translate(other, "p") is other


def test_translated_is_what_a_driver_sends_into_a_flow():
    import asyncio

    down = rex.ConnectionError("down")
    err = _translate.translated(down, "p")
    assert type(err) is BackendUnavailable and err.__cause__ is down and "pool 'p'" in str(err)
    refused = _translate.translated(rex.ResponseError("GPULOCK_NOPOOL"), "p")
    assert isinstance(refused, PoolNotFound)
    for as_is in (LeaseLost("a" * 32, "why"), asyncio.CancelledError(), KeyboardInterrupt()):
        assert _translate.translated(as_is, "p") is as_is and as_is.__cause__ is None


def test_exception_tree():
    assert issubclass(InvalidArgument, ValueError)
    assert issubclass(AcquireTimeout, TimeoutError)
    for cls in (
        InvalidArgument,
        PoolNotFound,
        CapacityExceeded,
        AcquireTimeout,
        QueueFull,
        LeaseLost,
        BackendUnavailable,
    ):
        assert issubclass(cls, GpuLockError)


# ---- local validity clock -----------------------------------------------------------------


def _grant(now_ms=50_000, ttl_ms=3000, token=5):
    return _replies.Grant("t", "d" * 32, token, now_ms + ttl_ms, 100, now_ms, 1, 1000)


def test_validity_deadline_is_before_server_expiry():
    # Sent at local 10.0, server said now=50s, expiry 53s: the local deadline must end
    # strictly before 10.0 + 3.0 (we cannot know how long the request took to arrive).
    d = _lease.validity_deadline(10.0, 50_000, 53_000)
    assert d < 13.0
    assert math.isclose(d, 10.0 + 3.0 * (1 - _lease.CLOCK_DRIFT) - _lease.SAFETY_MARGIN_S)
    assert _lease.validity_deadline(10.0, 60_000, 53_000) < 10.0  # already expired on the server


@settings(max_examples=100, deadline=None)
@given(
    st.floats(min_value=0, max_value=1e6),
    st.integers(min_value=0, max_value=2**40),
    st.integers(min_value=0, max_value=86_400_000),
)
def test_validity_deadline_never_after_server_expiry(sent, now_ms, remaining_ms):
    assert (
        _lease.validity_deadline(sent, now_ms, now_ms + remaining_ms) < sent + remaining_ms / 1000.0
    )


def test_lease_state_expires_on_local_deadline_and_fires_once():
    clock = FakeClock(100.0)
    g = _grant()
    s = _lease.LeaseState(
        "gpu0", g, 3.0, _lease.validity_deadline(clock(), g.now_ms, g.expires_ms), clock
    )
    assert s.next_renew == pytest.approx(101.0)
    fired = []
    s.add_callback(lambda lease: fired.append(lease), owner="L")
    s.check()  # valid
    clock.advance(2.8)  # past 3 * 0.99 - 0.05 = 2.92? not yet
    s.check()
    clock.advance(0.2)  # 3.0 > 2.92
    with pytest.raises(LeaseLost):
        s.check()
    with pytest.raises(LeaseLost):
        s.check()
    assert fired == ["L"]
    assert s.mark_lost("again") is False
    late = []
    s.add_callback(lambda lease: late.append(lease), owner="L2")  # already lost: runs at once
    assert late == ["L2"] and fired == ["L"]


def test_lease_state_renewal_moves_deadline():
    clock = FakeClock(0.0)
    g = _grant(now_ms=1_000, ttl_ms=600)
    s = _lease.LeaseState("gpu0", g, 0.6, _lease.validity_deadline(0.0, 1_000, 1_600), clock)
    for i in range(1, 20):  # renew every 0.2 s for 3.8 s: stays valid
        clock.advance(0.2)
        sent = clock()
        s.renewed(sent, 1_000 + int(sent * 1000), 1_000 + int(sent * 1000) + 600)
        assert s.expires_ms == 1_600 + int(sent * 1000)
        assert s.next_renew == pytest.approx(sent + 0.2)
        s.check()
    clock.advance(0.6)
    with pytest.raises(LeaseLost):
        s.check()


def test_lease_state_released_is_not_lost_but_check_raises():
    clock = FakeClock()
    g = _grant()
    s = _lease.LeaseState("gpu0", g, 3.0, clock() + 2.0, clock)
    fired = []
    s.add_callback(lambda _: fired.append(1), owner=None)
    s.released = True
    clock.advance(10)
    with pytest.raises(LeaseLost, match="released"):
        s.check()
    assert s.mark_lost("late") is False
    assert fired == []


def test_lease_state_callback_exception_does_not_propagate():
    clock = FakeClock()
    s = _lease.LeaseState("gpu0", _grant(), 3.0, clock() + 1.0, clock)
    calls = []

    def bad(_):
        raise RuntimeError("boom")

    s.add_callback(bad, owner=None)
    s.add_callback(lambda _: calls.append(1), owner=None)
    assert s.mark_lost("test") is True
    assert calls == [1]


def test_lease_base_properties():
    clock = FakeClock(5.0)
    g = _grant(token=42)
    s = _lease.LeaseState("gpu0", g, 3.0, 7.0, clock)
    lease = _lease.LeaseBase(s, pool=None)
    assert (lease.id, lease.amount, lease.token, lease.ttl, lease.request_id, lease.pool) == (
        "d" * 32,
        100,
        42,
        3.0,
        "t",
        "gpu0",
    )
    assert lease.expires_at == g.expires_ms / 1000
    assert lease.valid_until == 7.0
    assert not lease.lost and not lease.released
    lease.ensure_valid()
    clock.advance(2.0)
    assert lease.lost
    with pytest.raises(LeaseLost):
        lease.ensure_valid()
    assert "lost" in repr(lease)


def test_retry_bound_follows_the_callers_timeout():
    from gpulock.protocol.retry import retry_bound

    assert retry_bound(5.0, None) == 5.0  # waits forever: the backend bound
    assert retry_bound(5.0, 30.0) == 30.0  # time left means keep trying (a failover)
    assert retry_bound(0.5, 30.0) == 30.0
    assert retry_bound(5.0, 2.5) == 2.5  # a caller that waits 2.5 s is not kept 5 s by retries
    assert retry_bound(5.0, 0.0) == 1.0  # try-once still rides out one dropped connection
    assert retry_bound(5.0, -3.0) == 1.0  # (its deadline passed while it was subscribing)
    assert retry_bound(0.5, 0.0) == 0.5


def test_a_ttl_over_the_pools_max_is_said_in_seconds():
    """acquire.lua refuses in milliseconds (its unit); the API's error says seconds, and the
    CLI's reading of it (TTL_OVER_MAX) finds both numbers."""
    e = _translate.translate(
        rex.ResponseError("GPULOCK_BADARG ttl_ms 1500 exceeds the pool's max_ttl_ms 1250"), "p"
    )
    assert isinstance(e, InvalidArgument) and "ttl_ms" not in str(e)
    assert "ttl 1.5 s is longer than the pool's max ttl of 1.25 s" in str(e), str(e)
    m = _translate.TTL_OVER_MAX.search(str(e))
    assert m is not None and (float(m.group(1)), float(m.group(2))) == (1.5, 1.25)
