"""Preemption's ask (docs/SEMANTICS.md, "Preemption"; lua/lib.lua ask_yield) decided by the
scripts as by a pure-Python model (tests/support/preempt_model.py) on random histories, both
script forms, one device, two devices and a tenant quota; and an asked lease renewed past its
deadline is capped at it and taken back there."""

from __future__ import annotations

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import preempt_raw as pr
from support.pools import RAW_FORMS, _s, check_consistent, raw, server_ms
from support.preempt_model import PreemptModel, Request
from support.priority_model import end_one

from gpulock.protocol.args import new_id
from gpulock.protocol.keys import pool_keys

pytestmark = pytest.mark.timeout(300)

TTL = 600_000  # ms: nothing expires during a history

_spec = st.tuples(st.sampled_from([1, 1, 2, 3]), st.sampled_from([100, 1000, 600_000, 900_000]))
_acq = st.tuples(
    st.just("acq"),
    st.sampled_from([1, 1, 2, 2, 3, 4, 5, 6]),  # amount
    st.integers(-4, 4),  # priority
    st.sampled_from(["wait", "wait", "wait", "wait", "try"]),
    st.sampled_from(["", "a", "b"]),  # tenant
    st.sampled_from(["", "", "0", "1"]),  # device pin (two-device pools)
    st.sampled_from(["", "1", "1", "0"]),  # preemptible
)
_op = st.one_of(
    _acq,
    _acq,
    _acq,
    _acq,
    st.tuples(st.just("rel"), st.integers(0, 60)),
    st.tuples(st.just("cancel"), st.integers(0, 60)),
    st.tuples(st.just("refresh"), st.integers(0, 60)),
    st.tuples(
        st.just("renew"),
        st.lists(st.integers(0, 60), max_size=3),
        st.sampled_from([TTL, 900_000]),
    ),
    st.tuples(st.just("resize"), st.integers(0, 60), st.sampled_from([-2, -1, 1, 2, 4])),
    st.tuples(st.just("pre"), st.one_of(_spec, st.none())),
)

_RESIZE_ERRORS = {
    "GPULOCK_LOST": "lost",
    "GPULOCK_CAPACITY": "capacity",
    "GPULOCK_QUOTA": "quota",
    "GPULOCK_CONFLICT": "conflict",
    "GPULOCK_RESIZE_REFUSED": "deadlock",
    "GPULOCK_BADARG": "asked",  # the growth of a lease asked to yield (the only BADARG here)
}

#: (capacity, devices ARGV, per-device capacities, quotas ARGV)
_POOLS = {
    "one": (10, "", [], ""),
    "two-devices": (10, "6 4", [6, 4], ""),
    "quota": (10, "", [], "a=5"),
}


class _History:
    """One history: the pool, the model, and what the checks remember across steps."""

    def __init__(self, c: redis.Redis, pool: str, call, kind: str, spec):
        cap, devs, dcap, quotas = _POOLS[kind]
        self.c, self.pool, self.call, self.kind = c, pool, call, kind
        wire = f"{spec[0]} {spec[1]}" if spec else ""
        raw(c, pool, "configure", cap, 1000, "set", 0, 0, "", "", quotas, devs, "", wire)
        self.m = PreemptModel(cap, dcap=list(dcap))
        self.m.spec = spec
        for item in quotas.split():
            self.m.quotas[item.split("=")[0]] = int(item.split("=")[1])
        self.args: dict[str, list] = {}  # ticket -> its acquire's ARGV
        self.known: list[str] = []
        self.seen: dict[str, tuple[int, int]] = {}  # lease id -> its y: value, once written

    def lid(self, t: str) -> str:
        return self.m.requests[t].lid

    def token(self, t: str) -> int:
        h = pr.holder(self.c, self.pool, self.lid(t))
        assert h is not None
        return h[0]

    def acquire(self, op) -> None:
        _, amount, prio, mode, tenant, pin, pre = op
        if not self.m.dcap:
            pin = ""
        t, lid = new_id(), new_id()
        args = [t, lid, amount, TTL, TTL, mode, "{}", "m", prio, tenant, pin, "", pre]
        req = Request(lid, prio, TTL, pre != "0")
        pinned = int(pin) if pin else None
        if amount > self.m.largest(pinned):
            return
        try:
            r = self.call(self.c, self.pool, "acquire", *args)
        except redis.ResponseError as e:
            assert str(e).startswith("GPULOCK_QUOTA"), e
            got = self.m.take(t, req, amount, int(server_ms(self.c)), mode, tenant, pinned)
            assert got == "quota"
            return
        now = int(r[5]) if r[0] == 1 else int(r[4])
        want = self.m.take(t, req, amount, now, mode, tenant, pinned)
        assert {1: "granted", 0: "queued", 2: "refused"}[int(r[0])] == want, (op, r)
        if want == "queued":
            assert int(r[1]) == self.m.order().index(t) + 1
        if want != "refused":
            self.args[t] = args
            self.known.append(t)

    def refresh(self, i: int) -> None:
        queued = [t for t in self.known if t in self.m.queue]
        if not queued:
            return
        t = queued[i % len(queued)]
        r = self.call(self.c, self.pool, "acquire", *self.args[t])
        assert int(r[0]) == 0, r
        assert int(r[1]) == self.m.refresh(t, int(r[4]))

    def renew(self, idx: list[int], ttl: int) -> None:
        held = [t for t in self.known if t in self.m.held]
        ts = list(dict.fromkeys(held[i % len(held)] for i in idx)) if held else []
        r = pr.renew(
            self.c, self.pool, [(self.lid(t), self.token(t), ttl) for t in ts], call=self.call
        )
        want = self.m.renew([(t, ttl) for t in ts], int(r[0]))
        assert [(int(a), int(b)) for a, b in zip(r[2], r[5])] == want, (r, want)

    def resize(self, i: int, change: int) -> None:
        held = [t for t in self.known if t in self.m.held]
        if not held:
            return
        t = held[i % len(held)]
        amount = max(1, self.m.held[t] + change)
        g, prio = f"grow:{self.lid(t)}", self.m.requests[t].priority
        args = [g, self.lid(t), amount, "", TTL, "wait", "", "m", prio]
        try:
            r = self.call(self.c, self.pool, "resize", *args)
        except redis.ResponseError as e:
            got = _RESIZE_ERRORS[str(e).split(" ", 1)[0]]
            want = self.m.resize(t, g, amount, prio, int(server_ms(self.c)), "wait")
            assert want == got, (t, amount, e)
            return
        now = int(r[5]) if r[0] == 1 else int(r[4])
        want = self.m.resize(t, g, amount, prio, now, "wait")
        assert {1: "granted", 0: "queued"}[int(r[0])] == want, (t, amount, r)

    def configure(self, spec) -> None:
        """configure.lua with a new setting; its `now` (which the reply does not give) is read
        back from what it wrote: the asked_ms of a new yield mark or the acquired_ms of a new
        grant, within the server clock's readings around the call."""
        before = int(server_ms(self.c))
        wire = "off" if spec is None else f"{spec[0]} {spec[1]}"
        cap = self.m.capacity
        raw(self.c, self.pool, "configure", cap, 1000, "set", 0, 0, "", "", "", "", "", wire)
        after = server_ms(self.c)
        nows = {a for lid, (a, _) in pr.asked(self.c, self.pool).items() if lid not in self.seen}
        for v in self.c.hvals(pool_keys(self.pool)[2]):
            acq = int(_s(v).split("|")[2])
            if acq >= before:
                nows.add(acq)
        assert len(nows) <= 1, nows
        now = nows.pop() if nows else int(after)
        assert before <= now <= after, (before, now, after)
        self.m.configure(now, spec)

    def check(self) -> None:
        """After every step: the asked leases, their marks, the queue, the grants and the
        counters are the model's; a mark never changes; only preemptible leases are asked."""
        got = pr.asked(self.c, self.pool)
        want = {self.lid(t): v for t, v in self.m.asked.items()}
        assert got == want, (got, want)
        for lid, v in got.items():
            assert self.seen.setdefault(lid, v) == v, (lid, self.seen[lid], v)
        by_lid = {self.lid(t): t for t in self.m.held}
        for lid in got:
            assert self.m.requests[by_lid[lid]].preemptible
            assert self.c.hexists(pool_keys(self.pool)[6], f"pr:{lid}")
        q = [_s(t) for t in self.c.zrange(pool_keys(self.pool)[3], 0, -1)]
        assert q == self.m.order()
        held = {t: self.m.held[t] for t in self.m.held}
        assert {
            t: int(_s(self.c.hget(pool_keys(self.pool)[2], self.lid(t))).split("|")[0])
            for t in held
        } == held
        n = pr.counters(self.c, self.pool)
        assert n["y_asked"] == len(self.seen) == self.m.asked_total, (n, len(self.seen))
        assert check_consistent(self.c, self.pool)["used"] == self.m.used


@pytest.mark.parametrize("form", list(RAW_FORMS))
@pytest.mark.parametrize("kind", list(_POOLS))
def test_scripts_ask_as_the_model_on_random_histories(redis_proc, form, kind):
    """Random mixes of acquires (amounts 1-6 of 10 bytes, priorities -3..3, wait or try,
    tenants, pinned devices, preemptible or not), releases, cancels, refreshes of queued
    requests, renewals (some past a deadline), resizes (a growth at the head never asks) and
    changes of the setting (gap 1-3, grace 0.1 s to 900 s, or off): after every call the
    leases asked and their (asked_ms, deadline_ms) marks equal the model's, a mark never
    changes once written, only preemptible leases are asked, y_asked counts the marks ever
    written, and the queue, the grants and the pool's structures agree."""
    c = redis.Redis.from_url(redis_proc.url)
    call = RAW_FORMS[form]
    n = 0

    @settings(
        max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(
        st.one_of(_spec, _spec, _spec, st.none()),
        st.lists(_acq, min_size=4, max_size=12),
        st.lists(_op, min_size=10, max_size=50),
    )
    def run(spec, fill, ops):
        nonlocal n
        n += 1
        h = _History(c, f"pp{n}", call, kind, spec)
        for op in fill + ops:
            if op[0] == "acq":
                h.acquire(op)
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
        c.delete(*pool_keys(h.pool)[:7])

    try:
        run()
    finally:
        c.close()


@pytest.mark.parametrize("form", list(RAW_FORMS))
def test_an_asked_lease_is_renewed_only_to_its_deadline_and_taken_back_there(
    rclient, pool_name, form
):
    """Grace 300 ms; holder H (priority 0, all 10 bytes) is asked by W (priority 5). Renewed
    with a 600 s ttl it comes back capped at its deadline (max(ask + grace, its expiry then)),
    reply's yields naming it; every renewal before the deadline says the same and W waits; the
    first call at or after it finds H reaped (lost) and W granted; y_taken 1, y_done 0. H's
    ttl doubles until the ask finds it still held (a slow machine only takes more tries)."""
    call = RAW_FORMS[form]
    ttl, k = 1000, 0
    while True:
        pool = f"{pool_name}x{k}"
        raw(rclient, pool, "configure", 10, 1000, "set", 0, 0, "", "", "", "", "", "1 300")
        hr = pr.acquire(rclient, pool, 10, 0, ttl_ms=ttl, call=call)
        assert hr[0] == 1
        w = new_id()
        wr = pr.acquire(rclient, pool, 10, 5, ticket=w, call=call)
        if wr[0] == 0:
            break
        ttl, k = ttl * 2, k + 1  # H had expired before W came: try again, longer
    h_lid, h_tok, h_exp = _s(hr[1]), int(hr[2]), int(hr[3])
    ask_ms = int(wr[4])
    assert pr.asked(rclient, pool) == {h_lid: (ask_ms, max(ask_ms + 300, h_exp))}
    dl = max(ask_ms + 300, h_exp)
    while True:
        r = pr.renew(rclient, pool, [(h_lid, h_tok, 600_000)], [(w, 600_000)], call=call)
        now, lres, tres, yres = int(r[0]), int(r[2][0]), r[3][0], int(r[5][0])
        if now < dl:
            assert (lres, yres, _s(tres[0])) == (dl, dl, "q"), r
            continue
        assert lres == 0 and yres == 0, r
        assert _s(tres[0]) == "g", r
        break
    assert pr.counters(rclient, pool) == {"y_asked": 1, "y_done": 0, "y_done_ms": 0, "y_taken": 1}
    assert pr.asked(rclient, pool) == {}
    check_consistent(rclient, pool)
