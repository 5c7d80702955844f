"""The broker's Retry-After is the server's wait estimate through the one policy
(gpulock.retry_after; docs/MULTIHOST.md, "Waiting"): a queued or busy acquire's 503 and a
growth's say ``ceil(estimated_wait_s)`` within [1, cap], a request whose place is kept at most
``park_max / 2``; while the pool's drain rate is not measured (``estimated_wait_s`` null), the
script's time to the nearest lease expiry, as before. Against a real broker and Redis; the
drain rate is measured by draining a queue (support.drain)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from gpulock_broker.acquire import LONG_POLL_S, retry_after_of

from gpulock import LeaseLost, Pool
from gpulock.retry_after import retry_after
from support.drain import FIRST_HOLD, measure_drain, queue_behind
from support.pools import GiB

from ._support import ADMIN_TOKEN, USER_TOKEN, BrokerServer, client

pytestmark = pytest.mark.timeout(300)

CAP = 5  # the broker's default retry_after_max
PARK_MAX = 30.0  # the broker's default park_max


def _503(r) -> tuple[int, dict]:
    assert r.status_code == 503, r.text
    return int(r.headers["retry-after"]), r.json()["detail"]


#: The ttl of a holder whose expiry is the hint (seconds): below CAP, so the hint is not capped.
HINT_TTL = 4


@contextlib.contextmanager
def _unrenewed_holder(
    core: Pool, amount: int
) -> Iterator[Callable[[int, dict, float, float], None]]:
    """Hold ``amount`` bytes on ``core``'s pool for HINT_TTL seconds, never renewed, and yield a
    check that a Retry-After ``ra`` (503 body ``d``) read between local times ``tr`` and
    ``ts`` is the time to that lease's expiry. Not renewed: a renewal at ttl/3 would move the
    expiry, and a loaded run can take that long to send the request."""
    t0 = time.monotonic()
    holder = core.acquire(amount, ttl=HINT_TTL)
    t1 = time.monotonic()
    core._untrack(holder.id)

    def hint_within(ra: int, d: dict, tr: float, ts: float) -> None:
        # the holder expires HINT_TTL after its grant (made in [t0, t1]), read in [tr, ts]
        assert max(1, math.ceil(t0 + HINT_TTL - ts)) <= ra <= math.ceil(t1 + HINT_TTL - tr), (ra, d)

    yield hint_within
    with contextlib.suppress(LeaseLost):  # not renewed: gone if the test ran past HINT_TTL
        holder.release()


def test_retry_after_of_the_rules_in_order():
    kw = dict(cap=5, grace_left=0.0, held=0.0, keep_place=30.0)
    assert retry_after_of(2.2, 30.0, **kw) == 3  # the estimate, rounded up
    assert retry_after_of(None, 2.2, **kw) == 3  # no estimate: the hint
    assert retry_after_of(None, None, **kw) == 1  # neither: at least 1
    assert retry_after_of(99.0, None, **kw) == 5  # the cap
    assert retry_after_of(99.0, None, **{**kw, "cap": 60}) == 15  # half the kept place
    assert retry_after_of(99.0, None, **{**kw, "cap": 60, "keep_place": None}) == 60  # no place
    assert retry_after_of(2.0, None, **{**kw, "held": LONG_POLL_S}) == 0  # a long poll
    # ... but not in a grace period (at least its time left), nor without a place
    assert retry_after_of(2.0, None, **{**kw, "held": LONG_POLL_S, "grace_left": 3.5}) == 4
    assert retry_after_of(2.0, None, **{**kw, "held": LONG_POLL_S, "keep_place": None}) == 2


def test_with_a_measured_rate_the_503s_say_the_servers_estimate(redis_srv, gpu, user):
    core = Pool.from_url(redis_srv.url, gpu)
    try:
        measure_drain(core, 10 * GiB)
        holder = core.acquire(10 * GiB, ttl=60)  # the old hint: its expiry, 60 s (capped: 5)
        for i in range(1, 5):  # queued (wait 0: answered at once, its place kept)
            ra, d = _503(
                user.post(f"/v1/pools/{gpu}/leases", json={"amount": "1GiB", "request_id": f"q{i}"})
            )
            assert d["error"] == "queued" and d["position"] == i, d
            assert d["estimated_wait_s"] is not None, d
            assert ra == retry_after(d["estimated_wait_s"], cap=CAP, keep_place=PARK_MAX), d
            assert ra == max(1, min(CAP, math.ceil(d["estimated_wait_s"]))), d
            assert d["hold_place_for"] >= 2 * ra, d
        # busy (queue=false): the tail's estimate, no place to keep
        ra, d = _503(user.post(f"/v1/pools/{gpu}/leases", json={"amount": "2GiB", "queue": False}))
        assert d["error"] == "busy" and d["estimated_wait_s"] is not None, d
        assert ra == retry_after(d["estimated_wait_s"], cap=CAP), d
        holder.release()
    finally:
        core.close()


def test_without_a_rate_the_503_says_the_time_to_the_nearest_expiry(redis_srv, gpu, user):
    core = Pool.from_url(redis_srv.url, gpu)
    try:
        with _unrenewed_holder(core, 10 * GiB) as hint_within:  # a new pool: no rate yet
            assert core.status().drain is None
            tr = time.monotonic()
            ra, d = _503(
                user.post(f"/v1/pools/{gpu}/leases", json={"amount": "1GiB", "request_id": "q"})
            )
            ts = time.monotonic()
            assert d["error"] == "queued" and d["estimated_wait_s"] is None, d
            hint_within(ra, d, tr, ts)
    finally:
        core.close()


def test_a_long_estimate_is_held_to_half_the_kept_place(redis_srv):
    """With a cap above it, a queued request is told at most park_max / 2, and its place is
    kept at least twice that."""
    srv = BrokerServer(
        redis_srv.url, max_wait=5.0, backend_timeout=2.0, retry_after_max=60, park_max=6.0
    ).start()
    try:
        with client(srv.url, ADMIN_TOKEN) as admin:
            assert admin.put("/v1/pools/slow", json={"capacity": "10GiB"}).status_code == 200
        core = Pool.from_url(redis_srv.url, "slow")
        try:
            # a slow drain: each waiter keeps its lease at least 1 s (at most ~1 grant/s)
            holder = core.acquire(10 * GiB)
            threads = queue_behind(core, 10 * GiB, 3, hold=1.0)
            time.sleep(FIRST_HOLD)  # a lower bound on the busy time, not a wait for state
            holder.release()
            for t in threads:
                t.join(240)
                assert not t.is_alive()
            assert core.status().drain is not None
            holder = core.acquire(10 * GiB, ttl=60)
            with client(srv.url) as user:
                for i in range(1, 9):
                    body = {"amount": "10GiB", "request_id": f"s{i}"}
                    ra, d = _503(user.post("/v1/pools/slow/leases", json=body))
                    est = d["estimated_wait_s"]
                    assert d["position"] == i and est is not None, d
                    assert ra == retry_after(est, cap=60, keep_place=6.0), d
                    assert d["hold_place_for"] >= 2 * ra, d
                # 8 places at ~1 grant/s: an estimate well past park_max / 2 = 3 s
                assert est > 3.5 and ra == 3, d
            holder.release()
        finally:
            core.close()
    finally:
        srv.stop()


def test_a_growths_503_says_its_own_estimate(redis_srv, gpu, user):
    core = Pool.from_url(redis_srv.url, gpu)
    try:
        measure_drain(core, 10 * GiB)
        holder = core.acquire(5 * GiB, ttl=60)
        r = user.post(f"/v1/pools/{gpu}/leases", json={"amount": "5GiB"})
        assert r.status_code == 201, r.text
        lease = r.json()["lease_id"]
        url = f"/v1/pools/{gpu}/leases/{lease}/resize"
        ra, d = _503(user.post(url, json={"amount": "7GiB", "timeout": 60, "wait": 0}))
        assert d["error"] == "queued" and d["position"] == 1, d
        assert d["estimated_wait_s"] is not None, d
        assert ra == retry_after(d["estimated_wait_s"], cap=CAP, keep_place=PARK_MAX), d
        assert d["hold_place_for"] >= 2 * ra, d
        # back to its amount withdraws the growth
        assert user.post(url, json={"amount": "5GiB"}).status_code == 200
        holder.release()
    finally:
        core.close()


# ---- refusals that know the pool's state: queue full, a growth not granted in time ----------


def _queue_full(user, admin, gpu) -> tuple[int, dict, float | None]:
    """Two queued places (max_waiters 2) and a third request refused: the refusal's Retry-After,
    its body, and the last place's estimate."""
    r = admin.put(f"/v1/pools/{gpu}", json={"capacity": "10GiB", "max_waiters": 2})
    assert r.status_code == 200, r.text
    est = None
    for i in (1, 2):
        _, d = _503(
            user.post(f"/v1/pools/{gpu}/leases", json={"amount": "1GiB", "request_id": f"f{i}"})
        )
        assert d["error"] == "queued" and d["position"] == i, d
        est = d["estimated_wait_s"]
    ra, d = _503(user.post(f"/v1/pools/{gpu}/leases", json={"amount": "1GiB"}))
    assert d["error"] == "queue_full" and d["retry_after"] == ra, d
    return ra, d, est


def test_a_full_queues_503_says_the_tail_estimate(redis_srv, gpu, user, admin):
    core = Pool.from_url(redis_srv.url, gpu)
    try:
        measure_drain(core, 10 * GiB)
        holder = core.acquire(10 * GiB, ttl=60)  # the hint: 60 s; the estimate is shorter
        ra, d, last = _queue_full(user, admin, gpu)
        est = d["estimated_wait_s"]
        # the estimate of a request joining the queue's tail: behind the last place
        assert est is not None and last is not None and est >= last, d
        assert ra == retry_after(est, cap=CAP), d
        holder.release()
    finally:
        core.close()


class _Recording(httpx.HTTPTransport):
    """An HTTP transport that keeps each acquire's answer: ``(status, JSON body)``."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[tuple[int, dict]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        r = super().handle_request(request)
        if request.method == "POST" and request.url.path.endswith("/leases"):
            r.read()
            self.answers.append((r.status_code, r.json()))
        return r


def test_the_sdks_queue_full_carries_what_the_503_says(redis_srv, broker_srv, gpu, admin):
    """The SDK's QueueFull (its acquire retried the full queue until its timeout) has the last
    503's retry_after, estimated_wait_s and max_waiters, as its message says them. The queue
    is full of the core's waiters (kept while their process lives, not for a kept place's
    window)."""
    from gpulock_client import Pool as ClientPool
    from gpulock_client import QueueFull

    core = Pool.from_url(redis_srv.url, gpu)
    rec = _Recording()
    try:
        measure_drain(core, 10 * GiB)
        r = admin.put(f"/v1/pools/{gpu}", json={"capacity": "10GiB", "max_waiters": 2})
        assert r.status_code == 200, r.text
        holder = core.acquire(10 * GiB)
        waiters = queue_behind(core, 10 * GiB, 2)
        with ClientPool(broker_srv.url, gpu, token=USER_TOKEN, transport=rec) as pool:
            with pytest.raises(QueueFull) as got:
                pool.acquire("1GiB", timeout=0.5)
        status, body = rec.answers[-1]
        d = body["detail"]
        assert status == 503 and d["error"] == "queue_full", body
        e = got.value
        assert e.status == 503 and e.pool == gpu and str(e) == d["message"], e
        assert d["max_waiters"] == 2 and "max_waiters=2" in d["message"], d
        assert (e.max_waiters, e.queue_length) == (d["max_waiters"], d["queue_length"]), e
        assert d["retry_after"] >= 1 and e.retry_after == d["retry_after"], (e.retry_after, d)
        assert d["estimated_wait_s"] is not None, d
        assert e.estimated_wait == d["estimated_wait_s"], (e.estimated_wait, d)
        holder.release()
        for t in waiters:
            t.join(240)
            assert not t.is_alive()
    finally:
        rec.close()
        core.close()


def test_a_full_queues_503_without_a_rate_says_the_hint(redis_srv, gpu, user, admin):
    core = Pool.from_url(redis_srv.url, gpu)
    try:
        with _unrenewed_holder(core, 10 * GiB) as hint_within:  # a new pool: no rate yet
            assert core.status().drain is None
            tr = time.monotonic()
            ra, d, _ = _queue_full(user, admin, gpu)
            ts = time.monotonic()
            assert d["estimated_wait_s"] is None, d
            hint_within(ra, d, tr, ts)
    finally:
        core.close()


def _growth(user, gpu) -> str:
    r = user.post(f"/v1/pools/{gpu}/leases", json={"amount": "5GiB"})
    assert r.status_code == 201, r.text
    return f"/v1/pools/{gpu}/leases/{r.json()['lease_id']}/resize"


def test_a_growth_not_possible_now_says_the_tail_estimate(redis_srv, gpu, user):
    """timeout=0: a queue_timeout 503 at once, from the estimate had it joined the tail."""
    core = Pool.from_url(redis_srv.url, gpu)
    try:
        measure_drain(core, 10 * GiB)
        holder = core.acquire(5 * GiB, ttl=60)
        ra, d = _503(user.post(_growth(user, gpu), json={"amount": "7GiB", "timeout": 0}))
        assert d["error"] == "queue_timeout" and d["estimated_wait_s"] is not None, d
        assert ra == d["retry_after"] == retry_after(d["estimated_wait_s"], cap=CAP), d
        holder.release()
    finally:
        core.close()


def test_a_growth_not_possible_now_without_a_rate_says_the_hint(redis_srv, gpu, user):
    core = Pool.from_url(redis_srv.url, gpu)
    try:
        with _unrenewed_holder(core, 5 * GiB) as hint_within:
            url = _growth(user, gpu)
            assert core.status().drain is None
            tr = time.monotonic()
            ra, d = _503(user.post(url, json={"amount": "7GiB", "timeout": 0}))
            ts = time.monotonic()
            assert d["error"] == "queue_timeout" and d["estimated_wait_s"] is None, d
            hint_within(ra, d, tr, ts)
    finally:
        core.close()


def test_a_growth_that_timed_out_in_the_queue_says_its_own_estimate(redis_srv, gpu, user):
    """A growth queued past its timeout: queue_timeout with the Retry-After of its own last
    estimate (it keeps no place), as the SDK reads it back (AcquireTimeout.estimated_wait)."""
    from gpulock_client import AcquireTimeout as ClientTimeout
    from gpulock_common.wire import error_from_reply

    core = Pool.from_url(redis_srv.url, gpu)
    try:
        measure_drain(core, 10 * GiB)
        holder = core.acquire(5 * GiB, ttl=60)
        url = _growth(user, gpu)
        body = {"amount": "7GiB", "timeout": 0.5, "wait": 5}
        r = user.post(url, json=body)
        while r.status_code == 503 and r.json()["detail"]["error"] == "queued":
            r = user.post(url, json=body)  # the same growth: its answer once it ended
        ra, d = _503(r)
        assert d["error"] == "queue_timeout" and d["estimated_wait_s"] is not None, d
        assert ra == d["retry_after"] == retry_after(d["estimated_wait_s"], cap=CAP), d
        err = error_from_reply(r.status_code, r.json(), gpu)
        assert isinstance(err, ClientTimeout), err
        assert err.estimated_wait == d["estimated_wait_s"] and err.retry_after == ra, err
        holder.release()
    finally:
        core.close()


async def test_the_refusals_of_one_pool_share_one_recent_status_read(redis_srv):
    """queue_full reads the pool's status for its Retry-After through Pools.recent_status: the
    callers that come while a read runs share it, and a read is reused for max_age seconds, so
    an overload's storm of refusals costs Redis one read per max_age, not one per refusal."""
    import asyncio

    from gpulock_broker.pools import Pools
    from gpulock_broker.tasks import Tasks

    core = Pool.from_url(redis_srv.url, "gpu-rs", capacity=GiB)
    pools = Pools(
        redis_srv.url,
        Tasks(2.0),
        waiter_ttl=10.0,
        poll_interval=0.5,
        backend_timeout=2.0,
        max_connections=8,
        in_use=lambda _name: False,
        on_retire=lambda _name: None,
        on_deleted=lambda _name: None,
    )
    pools.connect()
    try:
        core.acquire(1).release()  # the pool is made at its first acquire
        many = await asyncio.gather(
            *(pools.recent_status("gpu-rs", limit=32, max_age=60.0) for _ in range(8))
        )
        assert all(st is many[0] for st in many)  # one read, shared while it ran
        assert many[0].used == 0
        lease = core.acquire(GiB // 2)
        kept = await pools.recent_status("gpu-rs", limit=32, max_age=60.0)
        assert kept is many[0] and kept.used == 0  # young enough: not read again
        fresh = await pools.recent_status("gpu-rs", limit=32, max_age=0.0)
        assert fresh is not many[0] and fresh.used == GiB // 2  # too old: read again
        lease.release()
    finally:
        await pools.close_pools()
        await pools.disconnect()
        core.close()
