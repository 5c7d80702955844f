"""gpulock-client (sync and async) against a real broker and Redis."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from gpulock_client import (
    PoolClosed,
    AcquireTimeout,
    AsyncPool,
    AuthError,
    BackendUnavailable,
    CapacityExceeded,
    InvalidArgument,
    LeaseLost,
    Pool,
    PoolNotFound,
)

from support.waiting import wait_until

from ._support import USER_TOKEN

GiB = 2**30
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pool(broker_srv, gpu):
    p = Pool(broker_srv.url, gpu, token=USER_TOKEN)
    yield p
    p.close()


def test_context_manager_heartbeat_and_release(pool):
    with pool.lease("4GiB", ttl=1.5, holder={"purpose": "test"}) as lease:
        assert lease.amount == 4 * GiB and lease.token > 0 and not lease.lost
        t_end = time.monotonic() + 4  # well past the ttl: the heartbeat renews
        while time.monotonic() < t_end:
            lease.ensure_valid()
            time.sleep(0.05)
        st = pool.status()
        assert [x["lease_id"] for x in st["leases"]] == [lease.id]
        assert st["leases"][0]["holder"]["purpose"] == "test"
    assert lease.released and pool.status()["used"] == 0
    with pytest.raises(LeaseLost):
        lease.ensure_valid()
    lease.release()  # idempotent


def test_errors(broker_srv, pool):
    with pytest.raises(CapacityExceeded) as e:
        pool.acquire("11GiB")
    assert e.value.capacity == 10 * GiB
    with pytest.raises(PoolNotFound):
        Pool(broker_srv.url, "nope", token=USER_TOKEN).acquire(1)
    with pytest.raises(AuthError):
        Pool(broker_srv.url, "gpu-a", token="bad-token-xxxxxxxxxxxxxxxx").acquire(1)


def test_a_422_is_said_in_users_words(broker_srv, pool, user, gpu):
    """A holder value that is a list was refused naming pydantic's union members
    (``holder.job.str: ...; holder.job.int: ...``): the broker's 422 names the path the
    client sent, ``holder.job``, and the SDK says it in one line."""
    r = user.post(f"/v1/pools/{gpu}/leases", json={"amount": 1, "holder": {"job": [1]}})
    assert r.status_code == 422, r.text
    assert {tuple(e["loc"]) for e in r.json()["detail"]} == {("body", "holder", "job")}, r.text
    with pytest.raises(InvalidArgument) as e:
        pool.acquire(1, holder={"job": [1]})  # type: ignore[dict-item]
    assert str(e.value) == (
        "holder.job: Input should be a valid string, a valid integer, a valid number or a "
        "valid boolean (got [1])"
    ), str(e.value)
    # a ttl under the broker's least: the SDK says so before sending, as the broker would
    r = user.post(f"/v1/pools/{gpu}/leases", json={"amount": 1, "ttl": 0.1})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "ttl"], r.text
    with pytest.raises(InvalidArgument) as e:
        pool.acquire(1, ttl=0.1)
    assert str(e.value) == "ttl must be between 1 and 86400 seconds, got 0.1", str(e.value)
    assert "Value error" not in str(e.value)  # not "body.ttl: Value error, ..."


def test_acquire_timeout_withdraws_the_place(pool):
    held = pool.acquire("10GiB", ttl=10)
    positions = []
    t0 = time.monotonic()
    with pytest.raises(AcquireTimeout) as e:
        pool.acquire("1GiB", timeout=1.5, on_queued=positions.append)
    # not before the timeout, and not a whole long poll (2 s) past it, which would be 3.5 s
    # or more: 3.4 s leaves a descheduled client 1.9 s past the timeout (3 s left 1.5 s).
    assert 1.4 < time.monotonic() - t0 < 3.4
    assert e.value.position == 1 and positions == [1]
    assert pool.status()["waiter_count"] == 0
    held.release()


def test_queued_acquire_is_granted_on_release(broker_srv, pool):
    held = pool.acquire("10GiB")
    out = {}

    def other():
        with Pool(broker_srv.url, "gpu-a", token=USER_TOKEN, max_wait=2) as p2:
            lease = p2.acquire("6GiB", timeout=20)  # several long polls, one request id
            out["t"] = time.monotonic()
            out["acquired_at"] = lease.acquired_at
            lease.release()

    t = threading.Thread(target=other)
    t.start()
    wait_until(lambda: pool.status()["waiter_count"] == 1, 10, "the other acquire queued")
    time.sleep(3)  # more than one long poll of max_wait=2 s (the same request id across them)
    t_rel, t_rel_wall = time.monotonic(), time.time()
    held.release()
    t_released_wall = time.time()
    t.join(10)
    # Granted while the release ran (server clock = this machine's; 10 ms for its rounding),
    # and the waiting client had it well before its long poll's 2 s ran out (slack for a
    # loaded machine's scheduling; it was 0.5 s).
    assert t_rel_wall - 0.01 <= out["acquired_at"] <= t_released_wall + 0.01, out
    assert out["t"] - t_rel < 1.5, out["t"] - t_rel


def test_lost_before_the_server_expiry_when_the_broker_goes(redis_srv, gpu, broker_srv):
    """Stop the broker (Redis stays): the client cannot renew; ensure_valid raises and
    on_lost fires, and no ensure_valid call that began at or after the server's expiry
    succeeded. Asserted on the clocks the lease reports, not on how promptly this thread
    is scheduled (a loaded machine may wake the poll loop late; that is not a lost bound)."""
    p = Pool(broker_srv.url, "gpu-a", token=USER_TOKEN)
    lease = p.acquire("4GiB", ttl=2)
    # the local validity deadline, on the wall clock, ends before the server expiry
    valid_until_wall = lease.valid_until - time.monotonic() + time.time()
    assert valid_until_wall < lease.expires_at
    fired = []
    lease.on_lost(lambda _lease: fired.append(time.time()))
    broker_srv.stop()
    last_ok_started = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        started = time.time()
        try:
            lease.ensure_valid()
        except LeaseLost:
            break
        last_ok_started = started
        time.sleep(0.005)
    else:
        pytest.fail("ensure_valid never raised with the broker gone")
    assert last_ok_started is not None and last_ok_started < lease.expires_at
    deadline = time.monotonic() + 10
    while not fired and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fired, "on_lost did not fire"
    with pytest.raises((LeaseLost, BackendUnavailable)):
        lease.release()
    p.close()


def test_async_pool(broker_srv, gpu):
    async def main():
        async with AsyncPool(broker_srv.url, "gpu-a", token=USER_TOKEN, max_wait=1) as p:
            async with p.lease("6GiB", ttl=1.5) as a:
                waiter = asyncio.create_task(p.acquire("6GiB", timeout=10))
                await asyncio.sleep(3)  # a is renewed meanwhile; the waiter long-polls
                a.ensure_valid()
                assert not waiter.done()
            b = await waiter
            assert b.token > a.token
            c = asyncio.create_task(p.acquire("6GiB", timeout=10))
            await asyncio.sleep(0.5)
            c.cancel()  # leaves the queue
            with pytest.raises(asyncio.CancelledError):
                await c
            st = await p.status()
            assert st["waiter_count"] == 0 and st["used"] == 6 * GiB
            await b.release()
            assert (await p.status())["used"] == 0

    asyncio.run(main())


def test_retry_storm_is_paced(broker_srv, admin):
    """c08: capacity for 2, 50 clients polling (no long poll): every 503 carries Retry-After
    and the clients honour it with jitter, so the broker sees a few requests per client, not a
    storm, and each client keeps one place in the queue."""
    assert admin.put("/v1/pools/storm", json={"capacity": 2}).status_code == 200
    posts = {"n": 0}
    max_waiting = {"n": 0}

    async def count(request):
        if request.method == "POST":
            posts["n"] += 1

    async def main():
        async with httpx.AsyncClient(
            base_url=broker_srv.url, headers={"Authorization": f"Bearer {USER_TOKEN}"}
        ) as c:

            async def watch():
                while True:
                    st = (await c.get("/v1/pools/storm")).json()
                    max_waiting["n"] = max(max_waiting["n"], st["waiter_count"])
                    await asyncio.sleep(0.1)

            w = asyncio.create_task(watch())
            pool = AsyncPool(broker_srv.url, "storm", token=USER_TOKEN, max_wait=0)
            pool._http.event_hooks["request"].append(count)

            async def one():
                try:
                    lease = await pool.acquire(
                        1, ttl=10, timeout=2.5
                    )  # a ttl a loaded broker cannot outwait
                except AcquireTimeout:
                    return 0
                await asyncio.sleep(0.3)
                await lease.release()
                return 1

            granted = sum(await asyncio.gather(*(one() for _ in range(50))))
            w.cancel()
            await pool.aclose()
            return granted

    granted = asyncio.run(main())
    assert granted >= 2
    assert max_waiting["n"] <= 48  # never two places for one client
    # Retry-After >= 1 s and a 2.5 s timeout: at most ~4 POSTs per client (first, two
    # retries, the last try at the deadline), against hundreds for immediate retries.
    assert posts["n"] <= 50 * 4, posts


def test_configure_max_ttl(broker_srv):
    from ._support import ADMIN_TOKEN

    with Pool(broker_srv.url, "gpu-m", token=ADMIN_TOKEN) as p:
        r = p.configure("1GiB", max_ttl=600)
        assert r["created"] and r["max_ttl"] == 600, r
        assert p.configure("2GiB")["max_ttl"] == 600  # kept
        assert p.status()["max_ttl"] == 600

    async def main():
        async with AsyncPool(broker_srv.url, "gpu-m", token=ADMIN_TOKEN) as ap:
            assert (await ap.configure("2GiB", max_ttl=120))["max_ttl"] == 120
            return (await ap.status())["max_ttl"]

    assert asyncio.run(main()) == 120


def _wait_queued_past(pool, seconds):
    """Until the pool's first waiter has waited more than ``seconds`` (observed, not slept)."""
    t_end = time.monotonic() + 30
    while time.monotonic() < t_end:
        w = pool.status().get("waiters") or []
        if w and w[0]["waited"] > seconds:
            return
        time.sleep(0.05)
    raise AssertionError("the waiter never showed queued past its ttl")


def test_grant_after_a_wait_longer_than_the_ttl_is_valid(pool):
    holder = pool.acquire("10GiB", ttl=10)
    got: dict = {}

    def wait():
        try:
            lease = pool.acquire(1, ttl=2, timeout=30)
            lease.ensure_valid()  # right after the grant
            got["lease"] = lease
        except Exception as e:  # noqa: BLE001 - reported below
            got["error"] = e

    t = threading.Thread(target=wait)
    t.start()
    _wait_queued_past(pool, 4.0)
    holder.release()
    t.join(30)
    assert "error" not in got, got.get("error")
    lease = got["lease"]
    lease.release()
    assert lease.released and pool.status()["used"] == 0


def test_async_grant_after_a_wait_longer_than_the_ttl_is_valid(broker_srv, gpu, pool):
    async def main():
        async with AsyncPool(broker_srv.url, gpu, token=USER_TOKEN) as ap:
            holder = await ap.acquire("10GiB", ttl=10)
            task = asyncio.ensure_future(ap.acquire(1, ttl=2, timeout=30))
            await asyncio.get_running_loop().run_in_executor(None, _wait_queued_past, pool, 4.0)
            await holder.release()
            lease = await task
            lease.ensure_valid()
            await lease.release()
            assert lease.released

    asyncio.run(main())
    assert pool.status()["used"] == 0


def _waiting(p, n):
    """The pool's waiters as (purpose, priority), queue order, once there are ``n``."""
    ws = p.status()["waiters"]
    return len(ws) == n and [(w["holder"]["purpose"], w["priority"]) for w in ws]


def test_priority_goes_first(broker_srv, pool):
    """At capacity, a priority-0 acquire queues, then a priority-5 one: the broker lists the
    priority-5 one first, and grants it first at the release."""
    held = pool.acquire("10GiB", ttl=30)
    order: list[str] = []
    errs: list[BaseException] = []

    def take(purpose: str, prio: int) -> None:
        try:
            with Pool(broker_srv.url, "gpu-a", token=USER_TOKEN, max_wait=2) as p2:
                with p2.lease("6GiB", timeout=30, priority=prio, holder={"purpose": purpose}):
                    order.append(purpose)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errs.append(e)

    low = threading.Thread(target=take, args=("low", 0))
    low.start()
    wait_until(lambda: _waiting(pool, 1), timeout=20, what="the low request queued")
    high = threading.Thread(target=take, args=("high", 5))
    high.start()
    assert wait_until(lambda: _waiting(pool, 2), timeout=20, what="both queued") == [
        ("high", 5),
        ("low", 0),
    ]
    held.release()
    high.join(30)
    low.join(30)
    assert not errs and order == ["high", "low"], (errs, order)
    assert pool.status()["used"] == 0


def test_a_bad_priority_is_refused_before_anything_is_sent(pool):
    for bad in (101, -101, True, 2.5, "5"):
        with pytest.raises(InvalidArgument, match=r"priority must be an integer in \[-100, 100\]"):
            pool.acquire(1, priority=bad)  # type: ignore[arg-type]
    st = pool.status()
    assert st["used"] == 0 and st["waiter_count"] == 0 and st["grants"] == 0


def test_async_priority_goes_first(broker_srv, gpu):
    async def main():
        async with AsyncPool(broker_srv.url, gpu, token=USER_TOKEN, max_wait=2) as p:

            async def waiting(n):
                ws = (await p.status())["waiters"]
                return len(ws) == n and [(w["holder"]["purpose"], w["priority"]) for w in ws]

            order: list[str] = []

            async def take(purpose: str, prio: int) -> None:
                async with p.lease("6GiB", timeout=30, priority=prio, holder={"purpose": purpose}):
                    order.append(purpose)

            held = await p.acquire("10GiB", ttl=30)
            low = asyncio.create_task(take("low", 0))
            await _until_async(lambda: waiting(1))
            high = asyncio.create_task(take("high", 5))
            assert await _until_async(lambda: waiting(2)) == [("high", 5), ("low", 0)]
            await held.release()
            await asyncio.wait_for(asyncio.gather(high, low), 30)
            assert order == ["high", "low"]
            with pytest.raises(InvalidArgument, match="got 101"):
                await p.acquire(1, priority=101)

    asyncio.run(main())


async def _until_async(cond, timeout: float = 20.0):
    """Await ``cond()`` (a coroutine) until it is truthy; return that value."""
    deadline = time.monotonic() + timeout
    while True:
        v = await cond()
        if v:
            return v
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_configure_sets_policy_quotas_devices_and_placement(broker_srv):
    """The SDK's configure takes every pool setting the broker's PUT does (what is left out
    keeps its value); a bad one is InvalidArgument naming it, with nothing changed."""
    from gpulock_client import InvalidArgument

    from ._support import ADMIN_TOKEN

    with Pool(broker_srv.url, "gpu-all", token=ADMIN_TOKEN) as p:
        r = p.configure(
            devices=["1GiB", "2GiB"],
            policy="backfill",
            backfill_window=5,
            quotas={"team-a": "1GiB"},
            placement="spread",
            max_waiters=50,
        )
        assert r["created"] and r["capacity"] == 3 * GiB, r
        assert r["devices"] == [GiB, 2 * GiB] and r["placement"] == "spread", r
        assert r["policy"] == "backfill" and r["backfill_window"] == 5, r
        assert r["quotas"] == {"team-a": GiB} and r["max_waiters"] == 50, r
        with pytest.raises(InvalidArgument, match="placement"):
            p.configure(placement="nearest", devices=[GiB, GiB])
        st = p.status()
        assert st["placement"] == "spread" and [d["capacity"] for d in st["devices"]] == [
            GiB,
            2 * GiB,
        ]
        # what is left out keeps its value: the policy alone, on a pool of several devices
        r = p.configure(policy="fifo")
        assert r["policy"] == "fifo" and r["devices"] == [GiB, 2 * GiB], r
        assert r["placement"] == "spread" and r["quotas"] == {"team-a": GiB}, r
        for bad, shown in (
            ({"devices": "4GiB"}, "devices must be a list"),
            ({"max_ttl": float("nan")}, "max_ttl must be a finite"),
            ({"backfill_window": float("inf")}, "backfill_window must be a finite"),
        ):
            with pytest.raises(InvalidArgument, match=shown):
                p.configure(**bad)
        assert p.status()["policy"] == "fifo"
    with Pool(broker_srv.url, "gpu-none", token=ADMIN_TOKEN) as p:
        with pytest.raises(InvalidArgument, match="a new pool needs capacity or devices"):
            p.configure(policy="backfill")

    async def main():
        async with AsyncPool(broker_srv.url, "gpu-all", token=ADMIN_TOKEN) as ap:
            await ap.configure(policy="backfill")  # the pool's own sizes kept
            r = await ap.configure(devices=[GiB, 2 * GiB], policy="fifo", quotas={"team-a": 0})
            return r["policy"], r.get("quotas") or {}, r["placement"]

    assert asyncio.run(main()) == ("fifo", {}, "spread")


def test_close_ends_a_waiting_acquire_with_pool_closed(broker_srv, pool):
    """close() (sync) or aclose() (async) while another thread or task waits in acquire: the
    waiter raises PoolClosed (a GpuLockError), never httpx's own error, and so does every call
    made after it; the sync waiter within its current long poll (max_wait), the async one at
    once."""
    held = pool.acquire("10GiB", ttl=30)
    p2 = Pool(broker_srv.url, "gpu-a", token=USER_TOKEN, max_wait=1)
    got: dict = {}
    queued = threading.Event()

    def waiter():
        try:
            p2.acquire("1GiB", timeout=30, on_queued=lambda _pos: queued.set())
        except BaseException as e:  # noqa: BLE001 - the test looks at what it was
            got["error"] = e

    t = threading.Thread(target=waiter)
    t.start()
    assert queued.wait(10)
    p2.close()
    t.join(10)
    assert not t.is_alive() and isinstance(got.get("error"), PoolClosed), got
    # its place was withdrawn as it ended: the bytes released next go to nobody
    assert pool.status()["waiter_count"] == 0
    with pytest.raises(PoolClosed, match="before this call"):
        p2.acquire(1, timeout=0)
    with pytest.raises(PoolClosed):
        p2.status()

    async def main():
        ap = AsyncPool(broker_srv.url, "gpu-a", token=USER_TOKEN, max_wait=20)
        q = asyncio.Event()
        w = asyncio.ensure_future(ap.acquire("1GiB", timeout=60, on_queued=lambda _p: q.set()))
        await asyncio.wait_for(q.wait(), 10)
        await ap.aclose()
        # within one long poll's 20 s it would still be waiting: it ends at once instead
        with pytest.raises(PoolClosed):
            await asyncio.wait_for(w, 5)
        with pytest.raises(PoolClosed):
            await ap.status()

    asyncio.run(main())
    held.release()
    st = pool.status()
    assert st["used"] == 0 and st["leases"] == [] and st["waiter_count"] == 0, st


def test_configure_sets_keeps_and_turns_preemption_off(broker_srv):
    """The SDK's configure(preemption=...) through the broker: on, kept when left out, off."""
    from gpulock_client import Preemption

    from ._support import ADMIN_TOKEN

    with Pool(broker_srv.url, "gpu-pre", token=ADMIN_TOKEN) as p:
        r = p.configure("1GiB", preemption=Preemption(6, 45))
        assert r["preemption"] == {"gap": 6, "yield_grace_s": 45.0}, r
        assert p.configure("2GiB")["preemption"] == {"gap": 6, "yield_grace_s": 45.0}  # kept
        assert p.status()["preemption"] == {"gap": 6, "yield_grace_s": 45.0}

    async def main():
        async with AsyncPool(broker_srv.url, "gpu-pre", token=ADMIN_TOKEN) as ap:
            assert (await ap.configure(preemption=False))["preemption"] is None
            return (await ap.status())["preemption"]

    assert asyncio.run(main()) is None
