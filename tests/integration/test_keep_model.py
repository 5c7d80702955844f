"""Kept bytes (docs/SEMANTICS.md, "Kept bytes"; lua/lib.lua kept_drop, tell_kept; release.lua's
'keep' mode) decided by the scripts as by a pure-Python model (tests/support/keep_model.py) on
random histories of raw script calls, both script forms, one device, two devices and a tenant
quota, with preemption on or off: after every call the pool's cfg ``kept`` list, the 'k'
messages it published, its counters and status.lua's kept fields are the model's. Then the
cases the random histories do not reach: a grace period, a resident lease, a kept lease that
expires (reaped: dropped from the list)."""

from __future__ import annotations

import time

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from integration.test_preemption_model import _POOLS, TTL, _acq, _History, _spec
from support import preempt_raw as pr
from support.keep_model import KeepModel
from support.pools import RAW_FORMS, _s, check_consistent, raw, server_ms
from support.priority_model import end_one
from support.waiting import wait_until

from gpulock.protocol.args import new_id
from gpulock.protocol.keys import pool_keys

pytestmark = pytest.mark.timeout(300)

CHANNELS = ("ka", "kb")  # two holders' channels

_op = st.one_of(
    _acq,
    _acq,
    _acq,
    st.tuples(st.just("relk"), st.integers(0, 60), st.sampled_from(CHANNELS)),
    st.tuples(st.just("relk"), st.integers(0, 60), st.sampled_from(CHANNELS)),
    st.tuples(st.just("rel"), st.integers(0, 60)),
    st.tuples(st.just("cancel"), st.integers(0, 60)),
    st.tuples(st.just("refresh"), st.integers(0, 60)),
    st.tuples(st.just("renew"), st.lists(st.integers(0, 60), max_size=3), st.just(TTL)),
    st.tuples(st.just("resize"), st.integers(0, 60), st.sampled_from([-2, -1, 1, 2, 4])),
    st.tuples(st.just("pre"), st.one_of(_spec, st.none())),
)


def kept_list(c: redis.Redis, pool: str) -> list[tuple[str, str]]:
    """The pool's cfg field ``kept`` as (lease id, channel) pairs, in order."""
    v = c.hget(pool_keys(pool)[0], "kept")
    if v is None:
        return []
    s = _s(v)
    assert s.startswith(" ") and s == s.rstrip(), repr(s)  # " <lid>|<chan> <lid>|<chan>"
    return [tuple(x.split("|")) for x in s[1:].split(" ")]  # type: ignore[misc]


def kept_status(c: redis.Redis, pool: str, call) -> tuple[dict[str, int], list[int]]:
    """status.lua's view: lease id -> its ``kept`` flag, and [kept_bytes, kept_count, k_kept,
    k_told] (reply indices 35..38)."""
    r = call(c, pool, "status", 1000)
    flags = {_s(e[0]): int(e[12]) for e in r[12]}
    return flags, [int(x) for x in r[35:39]]


class _Messages:
    """The 'k' messages published on the channels of :data:`CHANNELS`, read in order: a PING on the same
    connection answers after every message published before it (no sleep)."""

    def __init__(self, c: redis.Redis, pool: str):
        self.prefix = _s(pool_keys(pool)[7]) + ":"
        self.ps = c.pubsub(ignore_subscribe_messages=True)
        names = [self.prefix + ch for ch in CHANNELS]
        # the scripts SPUBLISH where the server has sharded pub/sub (lua/lib.lua send)
        if int(str(c.info("server")["redis_version"]).split(".")[0]) >= 7:
            self.ps.ssubscribe(*names)
        else:
            self.ps.subscribe(*names)
        self.drain()

    def drain(self) -> dict[str, list[str]]:
        """channel id -> the lease ids named by the 'k' messages since the last drain (a
        channel named twice fails: one message per holder per call)."""
        self.ps.ping()
        out: dict[str, list[str]] = {}
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, "no pong"
            m = self.ps.get_message(timeout=1)  # None: nothing yet, or a subscribe message
            if m is None:
                continue
            if m["type"] == "pong":
                return out
            if m["type"] not in ("message", "smessage"):
                continue
            data = _s(m["data"])
            if not data.startswith("k "):
                continue
            chan = _s(m["channel"])[len(self.prefix) :]
            assert chan not in out, (chan, out)
            out[chan] = [x for x in data.split("\n")[1:] if x]

    def close(self) -> None:
        self.ps.close()


class _KeepHistory(_History):
    """The preemption model's history (tests/integration/test_preemption_model.py) with the
    keep model in place and the kept checks."""

    def __init__(self, c: redis.Redis, pool: str, call, kind: str, spec):
        super().__init__(c, pool, call, kind, spec)
        m = KeepModel(self.m.capacity, dcap=list(self.m.dcap))
        m.spec, m.quotas = self.m.spec, dict(self.m.quotas)
        self.m = m
        self.msgs = _Messages(c, pool)

    def release_keep(self, i: int, chan: str) -> None:
        held = [t for t in self.known if t in self.m.held]
        if not held:
            return
        t = held[i % len(held)]
        r = self.call(self.c, self.pool, "release", self.lid(t), self.token(t), "keep", chan)
        want = self.m.release_keep(t, chan, int(r[1]))
        if want == "kept":
            assert (int(r[0]), int(r[3])) == (2, 0), r
        else:
            assert int(r[0]) == 1, r
            # (the hand-off count: the model's release already ran it)
        assert int(r[2]) == self.m.used, (r, self.m.used)

    def check(self) -> None:
        super().check()
        lid_of = {t: self.lid(t) for t in self.m.held}
        want = [(lid_of[t], chan) for t, chan in self.m.kept]
        assert kept_list(self.c, self.pool) == want
        told = self.msgs.drain()
        assert told == {ch: [lid_of[t] for t in ts] for ch, ts in self.m.told.items()}, told
        flags, nums = kept_status(self.c, self.pool, self.call)
        kept_ids = {lid for lid, _ in want}
        assert flags == {lid: int(lid in kept_ids) for lid in lid_of.values()}, flags
        assert nums == [self.m.kept_bytes(), len(want), self.m.k_kept, self.m.k_told], nums
        cfg = self.c.hmget(pool_keys(self.pool)[0], "k_kept", "k_told")
        assert [int(x or 0) for x in cfg] == nums[2:]


@pytest.mark.parametrize("form", list(RAW_FORMS))
@pytest.mark.parametrize("kind", list(_POOLS))
def test_scripts_keep_and_tell_as_the_model_on_random_histories(redis_proc, form, kind):
    """Random mixes of acquires (wait or try, tenants, devices, priorities), releases in
    'keep' mode by two holders, plain releases, cancels, refreshes of queued requests,
    renewals, resizes and changes of the preemption setting: after every call the kept list
    (order and channels), the 'k' messages published (one per holder's channel, its kept
    leases in list order), k_kept, k_told and status.lua's kept flags, kept_bytes and
    kept_count equal the model's; the preemption model's own checks hold as well."""
    c = redis.Redis.from_url(redis_proc.url)
    call = RAW_FORMS[form]
    n = 0

    @settings(
        max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(
        st.one_of(_spec, st.none(), st.none()),
        st.lists(_acq, min_size=2, max_size=8),
        st.lists(_op, min_size=10, max_size=50),
    )
    def run(spec, fill, ops):
        nonlocal n
        n += 1
        h = _KeepHistory(c, f"kp{n}", call, kind, spec)
        done: list = []
        try:
            for op in fill + ops:
                done.append(op)
                h.m.told = {}
                if op[0] == "acq":
                    h.acquire(op)
                elif op[0] == "relk":
                    h.release_keep(op[1], op[2])
                elif op[0] == "refresh":
                    h.refresh(op[1])
                elif op[0] == "renew":
                    h.renew(op[1], op[2])
                elif op[0] == "resize":
                    h.resize(op[1], op[2])
                elif op[0] == "pre":
                    h.configure(op[1])
                elif h.known:
                    end_one(c, h.pool, call, h.m, op[0], h.known[op[1] % len(h.known)])
                h.check()
        except AssertionError as e:
            raise AssertionError(f"spec {spec}, ops {done}: {e}") from e
        finally:
            h.msgs.close()
        c.delete(*pool_keys(h.pool)[:7])

    try:
        run()
    finally:
        c.close()


def _lease(c, pool, amount, ttl_ms=TTL, **kw):
    r = pr.acquire(c, pool, amount, 0, ttl_ms=ttl_ms, **kw)
    assert int(r[0]) == 1, r
    return _s(r[1]), int(r[2])


def test_no_keeping_in_a_grace_period_nor_for_a_resident_lease(rclient, pool_name):
    """A release in 'keep' mode is an ordinary release during a grace period (the pool made
    again after a loss) and for a resident lease; a bad mode or channel is refused with
    nothing written."""
    c = rclient
    raw(c, pool_name, "configure", 10, 1000, "set", TTL, 1)  # made with a grace period
    # (nothing new is granted in a grace period: end it on the raw key to get a lease, then
    # start it again)
    c.hset(pool_keys(pool_name)[0], "grace_until", 0)
    lid, tok = _lease(c, pool_name, 3)
    c.hset(pool_keys(pool_name)[0], "grace_until", int(server_ms(c)) + 60_000)
    r = raw(c, pool_name, "release", lid, tok, "keep", "ka")
    assert int(r[0]) == 1, r
    assert kept_list(c, pool_name) == []
    c.hset(pool_keys(pool_name)[0], "grace_until", 0)

    rid, rtok = _lease(c, pool_name, 4, kind="resident")
    r = raw(c, pool_name, "release", rid, rtok, "keep", "ka")
    assert int(r[0]) == 1, r
    assert kept_list(c, pool_name) == [] and check_consistent(c, pool_name)["used"] == 0

    lid, tok = _lease(c, pool_name, 3)
    for bad in (("hold", "ka"), ("keep", ""), ("keep", "a|b")):
        with pytest.raises(redis.ResponseError, match="GPULOCK_BADARG"):
            raw(c, pool_name, "release", lid, tok, *bad)
    assert kept_list(c, pool_name) == [] and check_consistent(c, pool_name)["leases"] == 1
    # another token: not ours, nothing kept, nothing freed
    r = raw(c, pool_name, "release", lid, tok + 1, "keep", "ka")
    assert int(r[0]) == 0 and kept_list(c, pool_name) == [], r
    assert int(raw(c, pool_name, "release", lid, tok, "keep", "ka")[0]) == 2
    assert kept_list(c, pool_name) == [(lid, "ka")]


def test_a_kept_lease_that_expires_leaves_the_list_and_is_not_named(rclient, pool_name):
    """A kept lease whose ttl runs out is reaped by the next call: it leaves the kept list,
    status no longer counts it, and a request that does not fit names only the live ones."""
    c = rclient
    raw(c, pool_name, "configure", 10, 1000, "set", 0, 0)
    msgs = _Messages(c, pool_name)
    try:
        live, ltok = _lease(c, pool_name, 4)
        short, stok = _lease(c, pool_name, 3, ttl_ms=300)
        assert int(raw(c, pool_name, "release", live, ltok, "keep", "ka")[0]) == 2
        r = raw(c, pool_name, "release", short, stok, "keep", "kb")
        if int(r[0]) != 2:
            pytest.skip("the 300 ms lease expired before its release (a stalled machine)")
        assert kept_list(c, pool_name) == [(live, "ka"), (short, "kb")]
        exp = pr.holder(c, pool_name, short)
        assert exp is not None
        wait_until(lambda: server_ms(c) > exp[1] + 300, 10, "the short lease's expiry")
        flags, nums = kept_status(c, pool_name, raw)  # status reaps first
        assert flags == {live: 1} and nums == [4, 1, 2, 0], (flags, nums)
        assert kept_list(c, pool_name) == [(live, "ka")]
        r = pr.acquire(c, pool_name, 10, 0, mode="try")
        assert int(r[0]) == 2, r
        assert msgs.drain() == {"ka": [live]}
        assert kept_status(c, pool_name, raw)[1] == [4, 1, 2, 1]
        # a plain release of a kept lease drops it
        assert int(raw(c, pool_name, "release", live, ltok)[0]) == 1
        assert kept_list(c, pool_name) == [] and check_consistent(c, pool_name)["used"] == 0
        assert c.hget(pool_keys(pool_name)[0], "kept") is None
    finally:
        msgs.close()


def test_a_cancel_of_a_kept_lease_drops_it(rclient, pool_name):
    c = rclient
    raw(c, pool_name, "configure", 10, 1000, "set", 0, 0)
    t = new_id()
    lid, tok = _lease(c, pool_name, 5, ticket=t)
    assert int(raw(c, pool_name, "release", lid, tok, "keep", "ka")[0]) == 2
    raw(c, pool_name, "cancel", t)
    assert kept_list(c, pool_name) == [] and check_consistent(c, pool_name)["leases"] == 0
