"""Resizing a lease through the broker (``POST /v1/pools/{pool}/leases/{lease_id}/resize``) and
the SDK's ``lease.resize``, sync and async, against a real broker and Redis
(docs/SEMANTICS.md, "Resizing a lease"; docs/MULTIHOST.md)."""

from __future__ import annotations

import asyncio
import math
import threading

import httpx
import pytest
from gpulock_client import (
    AcquireTimeout,
    AsyncPool,
    InvalidArgument,
    LeaseLost,
    Pool,
    ResizeRefused,
)

from support.waiting import async_wait_until, wait_until

from ._support import USER_TOKEN

GiB = 2**30
pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def pool(broker_srv, gpu):
    p = Pool(broker_srv.url, gpu, token=USER_TOKEN, max_wait=1)
    yield p
    p.close()


@pytest.fixture
def pool2(broker_srv, gpu):
    p = Pool(broker_srv.url, gpu, token=USER_TOKEN, max_wait=1)
    yield p
    p.close()


def amounts(c: httpx.Client, pool: str = "gpu-a") -> dict[str, int]:
    """Each lease's amount in the pool's status (the broker's GET), by lease id."""
    r = c.get(f"/v1/pools/{pool}")
    assert r.status_code == 200, r.text
    return {x["lease_id"]: x["amount"] for x in r.json()["leases"]}


def waiters(c: httpx.Client, pool: str = "gpu-a") -> list[dict]:
    r = c.get(f"/v1/pools/{pool}")
    assert r.status_code == 200, r.text
    return r.json()["waiters"]


def in_thread(fn, *args, **kw):
    """Run ``fn`` in a thread; returns (thread, out): out["v"] its value or out["e"] its error."""
    out: dict = {}

    def run():
        try:
            out["v"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["e"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


# ---- sync SDK ------------------------------------------------------------------------------


def test_shrink_hands_the_bytes_to_a_waiter(pool, pool2, user, broker_srv):
    a = pool.acquire("10GiB")
    t, out = in_thread(pool2.acquire, "4GiB", timeout=30)
    wait_until(lambda: len(waiters(user)) == 1, 10, "the acquire to queue")
    a.resize("6GiB")
    t.join(10)
    b = out["v"]
    assert a.amount == 6 * GiB and b.amount == 4 * GiB
    assert amounts(user) == {a.id: 6 * GiB, b.id: 4 * GiB}
    rec = broker_srv.broker._leases._leases[a.id]  # the broker's own record follows
    assert rec.amount == 6 * GiB
    a.release()
    b.release()


def test_grow_now_renews_and_keeps_id_and_token(pool, user, broker_srv):
    a = pool.acquire("4GiB", ttl=30)
    lid, token, valid = a.id, a.token, a.valid_until
    a.resize(8 * GiB)
    assert (a.id, a.token, a.amount) == (lid, token, 8 * GiB)
    assert a.valid_until > valid  # the answer renewed it, and its validity counts from it
    assert amounts(user) == {lid: 8 * GiB}
    assert broker_srv.broker._leases._leases[lid].amount == 8 * GiB
    r = user.get("/v1/pools/gpu-a")
    assert r.json()["used"] == 8 * GiB
    a.resize("8GiB")  # the same amount: nothing to do
    a.release()


def test_dashboard_shows_the_new_amount(pool, admin):
    a = pool.acquire("2GiB")
    a.resize("3GiB")
    r = admin.get("/dashboard/data")
    assert r.status_code == 200, r.text
    (p,) = r.json()["pools"]
    assert [x["amount"] for x in p["leases"]] == [3 * GiB] and p["used"] == 3 * GiB, p
    a.release()


def test_grow_waits_then_is_granted_when_another_holder_releases(pool, pool2, user):
    a = pool.acquire("6GiB")
    b = pool2.acquire("4GiB")
    t, out = in_thread(a.resize, "8GiB", timeout=30)  # several long polls of 1 s
    w = wait_until(lambda: waiters(user), 10, "the growth to queue")
    assert w[0]["amount"] == 2 * GiB  # the difference waits
    assert a.amount == 6 * GiB and amounts(user)[a.id] == 6 * GiB
    b.release()
    t.join(10)
    assert "e" not in out, out
    assert a.amount == 8 * GiB and amounts(user) == {a.id: 8 * GiB}
    a.ensure_valid()
    a.release()


def test_grow_timeout_keeps_the_old_size(pool, pool2, user, broker_srv):
    a = pool.acquire("6GiB")
    b = pool2.acquire("4GiB")
    with pytest.raises(AcquireTimeout) as e:
        a.resize("8GiB", timeout=1.5)
    assert "keeps its amount" in str(e.value), str(e.value)
    assert a.amount == 6 * GiB and amounts(user) == {a.id: 6 * GiB, b.id: 4 * GiB}
    assert broker_srv.broker._leases._leases[a.id].amount == 6 * GiB
    wait_until(lambda: not waiters(user), 5, "the growth to leave the queue")
    with pytest.raises(AcquireTimeout):
        a.resize("8GiB", timeout=0)  # never waits
    assert amounts(user) == {a.id: 6 * GiB, b.id: 4 * GiB} and not waiters(user)
    a.release()
    b.release()


def test_deadlock_rule_refuses_the_second_growth(pool, pool2, user):
    """Two holders of half the pool each both grow: the second would wait on the first,
    which waits on it; it is refused (409 resize_refused), keeps its amount, and when it
    releases the first is granted."""
    a = pool.acquire("5GiB")
    b = pool2.acquire("5GiB")
    t, out = in_thread(a.resize, "7GiB", timeout=30)
    wait_until(lambda: waiters(user), 10, "the first growth to queue")
    with pytest.raises(ResizeRefused) as e:
        b.resize("7GiB", timeout=30)
    assert (e.value.lease_id, e.value.amount, e.value.current) == (b.id, 7 * GiB, 5 * GiB)
    assert e.value.status == 409
    assert b.amount == 5 * GiB and amounts(user)[b.id] == 5 * GiB
    b.release()
    t.join(10)
    assert "e" not in out, out
    assert a.amount == 7 * GiB
    a.release()


def test_another_principal_cannot_resize_a_lease(pool, user, other):
    a = pool.acquire("2GiB")
    r = other.post(f"/v1/pools/gpu-a/leases/{a.id}/resize", json={"amount": "4GiB"})
    assert r.status_code == 404 and r.json()["detail"]["error"] == "not_found", r.text
    assert amounts(user) == {a.id: 2 * GiB}
    a.release()


@pytest.mark.parametrize(
    "amount,named",
    [("0", "'0'"), (0, "0"), (-1, "-1"), ("1.5", "'1.5'"), ("4XB", "'4XB'"), (True, "True")],
)
def test_a_bad_amount_is_refused_naming_it_and_changes_nothing(pool, user, amount, named):
    a = pool.acquire("2GiB")
    with pytest.raises(InvalidArgument) as e:
        a.resize(amount)
    assert named in str(e.value) and "amount" in str(e.value), str(e.value)
    assert a.amount == 2 * GiB and amounts(user) == {a.id: 2 * GiB}
    a.release()


@pytest.mark.parametrize("timeout", [-1, math.nan, math.inf, "soon"])
def test_a_bad_timeout_is_refused_naming_it(pool, user, timeout):
    a = pool.acquire("2GiB")
    with pytest.raises(InvalidArgument) as e:
        a.resize("4GiB", timeout=timeout)
    assert "timeout" in str(e.value) and repr(timeout) in str(e.value), str(e.value)
    assert a.amount == 2 * GiB and amounts(user) == {a.id: 2 * GiB}
    a.release()


def test_a_resize_of_a_lease_the_broker_lost_is_lease_lost(pool, admin):
    a = pool.acquire("2GiB")
    r = admin.delete("/v1/pools/gpu-a", params={"force": "true"})
    assert r.status_code == 200, r.text
    r = admin.put("/v1/pools/gpu-a", json={"capacity": "10GiB"})
    assert r.status_code == 200, r.text
    with pytest.raises(LeaseLost):
        a.resize("4GiB")
    assert a.lost
    with pytest.raises(LeaseLost):  # lost here: nothing is sent
        a.resize("1GiB")


def test_a_released_lease_is_lease_lost_without_a_request(pool, user):
    a = pool.acquire("2GiB")
    a.release()
    with pytest.raises(LeaseLost, match="released"):
        a.resize("4GiB")
    assert amounts(user) == {}


# ---- the endpoint, raw ---------------------------------------------------------------------


def test_the_endpoints_422_names_the_bad_value_and_changes_nothing(pool, user):
    a = pool.acquire("2GiB")
    url = f"/v1/pools/gpu-a/leases/{a.id}/resize"
    for body, field, named in [
        ({"amount": "0"}, "amount", "'0'"),
        ({"amount": "lots"}, "amount", "'lots'"),
        ({"amount": "4GiB", "timeout": -1}, "timeout", "0"),
        ({"amount": "4GiB", "wait": "x"}, "wait", "number"),
        ({"amount": "4GiB", "extra": 1}, "extra", "Extra"),
        ({}, "amount", "required"),
    ]:
        r = user.post(url, json=body)
        assert r.status_code == 422, (body, r.text)
        d = r.json()["detail"]
        assert d[0]["loc"] == ["body", field] and named in d[0]["msg"], (body, d)
    r = user.post(url, json={"amount": "11GiB"})
    assert r.status_code == 413 and r.json()["detail"]["error"] == "capacity_exceeded", r.text
    r = user.post(f"/v1/pools/gpu-a/leases/{'0' * 32}/resize", json={"amount": 1})
    assert r.status_code == 410 and r.json()["detail"]["error"] == "lease_lost", r.text
    assert amounts(user) == {a.id: 2 * GiB} and not waiters(user)
    a.release()


def test_the_endpoints_409_and_503_wording(pool, pool2, user):
    a = pool.acquire("5GiB")
    b = pool2.acquire("5GiB")
    url_a = f"/v1/pools/gpu-a/leases/{a.id}/resize"
    r = user.post(url_a, json={"amount": "7GiB", "timeout": 30, "wait": 0})
    assert r.status_code == 503, r.text
    d = r.json()["detail"]
    assert d["error"] == "queued" and d["lease_id"] == a.id and d["amount"] == 7 * GiB, d
    assert d["position"] == 1 and r.headers["x-queue-position"] == "1", r.headers
    assert int(r.headers["retry-after"]) >= 1 and d["hold_place_for"] >= 5, r.headers
    assert "send the same resize again" in d["message"], d
    r = user.post(f"/v1/pools/gpu-a/leases/{b.id}/resize", json={"amount": "7GiB"})
    assert r.status_code == 409, r.text
    d = r.json()["detail"]
    assert (d["error"], d["lease_id"], d["amount"], d["current"]) == (
        "resize_refused",
        b.id,
        7 * GiB,
        5 * GiB,
    ), d
    assert "deadlock" in d["message"] and "keeps" in d["message"], d
    # the same resize again joins the growth that waits; back to its amount withdraws it
    r = user.post(url_a, json={"amount": "7GiB", "timeout": 30, "wait": 0.2})
    assert r.status_code == 503 and r.json()["detail"]["position"] == 1, r.text
    r = user.post(url_a, json={"amount": "5GiB"})
    assert r.status_code == 200 and r.json()["amount"] == 5 * GiB, r.text
    assert not waiters(user) and amounts(user) == {a.id: 5 * GiB, b.id: 5 * GiB}
    r = user.post(url_a, json={"amount": "7GiB", "timeout": 0})
    assert r.status_code == 503 and r.json()["detail"]["error"] == "queue_timeout", r.text
    a.release()
    b.release()


def test_a_client_that_hangs_up_withdraws_its_growth(pool, pool2, user, broker_srv):
    a = pool.acquire("6GiB")
    b = pool2.acquire("4GiB")
    url = f"{broker_srv.url}/v1/pools/gpu-a/leases/{a.id}/resize"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            url,
            json={"amount": "8GiB", "wait": 4},
            headers={"Authorization": f"Bearer {USER_TOKEN}"},
            timeout=httpx.Timeout(5, read=1.0),
        )
    wait_until(lambda: not waiters(user), 10, "the growth to be withdrawn")
    b.release()  # nothing waits for its bytes now
    assert amounts(user) == {a.id: 6 * GiB}
    a.release()


def test_a_growth_nobody_comes_back_for_is_withdrawn(pool, pool2, user):
    a = pool.acquire("6GiB")
    b = pool2.acquire("4GiB")
    r = user.post(f"/v1/pools/gpu-a/leases/{a.id}/resize", json={"amount": "8GiB", "timeout": 60})
    assert r.status_code == 503 and r.json()["detail"]["error"] == "queued", r.text
    hold = r.json()["detail"]["hold_place_for"]
    wait_until(lambda: not waiters(user), hold + 10, "the growth to be withdrawn")
    b.release()
    assert amounts(user) == {a.id: 6 * GiB}
    a.release()


# ---- async SDK -----------------------------------------------------------------------------


def test_async_resize(broker_srv, gpu, user):
    async def main():
        async with AsyncPool(broker_srv.url, gpu, token=USER_TOKEN, max_wait=1) as p:
            a = await p.acquire("10GiB")
            w = asyncio.create_task(p.acquire("4GiB", timeout=30))
            await async_wait_until(lambda: waiters(user), 10, "the acquire to queue")
            await a.resize("6GiB")  # shrink: the waiter is granted
            b = await asyncio.wait_for(w, 10)
            assert a.amount == 6 * GiB and amounts(user) == {a.id: 6 * GiB, b.id: 4 * GiB}

            with pytest.raises(AcquireTimeout):  # grow: times out, keeps its size
                await a.resize("8GiB", timeout=1.5)
            assert a.amount == 6 * GiB and amounts(user)[a.id] == 6 * GiB

            g = asyncio.create_task(a.resize("8GiB", timeout=30))  # grow: waits
            await async_wait_until(lambda: waiters(user), 10, "the growth to queue")
            with pytest.raises(ResizeRefused):  # the deadlock rule
                await b.resize("6GiB", timeout=30)
            await b.release()
            await asyncio.wait_for(g, 10)
            assert a.amount == 8 * GiB and amounts(user) == {a.id: 8 * GiB}

            b = await p.acquire("2GiB")
            g = asyncio.create_task(a.resize("9GiB", timeout=30))
            await async_wait_until(lambda: waiters(user), 10, "the growth to queue")
            g.cancel()  # withdraws the growth
            with pytest.raises(asyncio.CancelledError):
                await g
            assert not waiters(user) and a.amount == 8 * GiB
            assert amounts(user) == {a.id: 8 * GiB, b.id: 2 * GiB}

            with pytest.raises(InvalidArgument, match="'0'"):
                await a.resize("0")
            await a.resize("8GiB")  # same amount
            await b.release()
            await a.release()
            with pytest.raises(LeaseLost):
                await a.resize("1GiB")

    asyncio.run(main())


# ---- RemoteHolders.resize, which the endpoint runs -----------------------------------------


def test_remote_holders_resize_on_a_lease_granted_through_the_broker(pool, user, redis_srv):
    """The core's ``RemoteHolders.resize`` (what the broker runs on its clients' behalf), on
    a pool object of its own: by lease id, a growth at the given priority, the errors."""
    import redis.asyncio as aioredis

    from gpulock import AsyncPool as CorePool
    from gpulock.runtime.remote import RemoteHolders

    a = pool.acquire("4GiB")
    b = pool.acquire("6GiB")

    async def main():
        r = aioredis.Redis.from_url(redis_srv.url)
        holders = RemoteHolders(CorePool(r, "gpu-a"))
        try:
            g = await holders.resize(a.id, "2GiB", None)  # shrink
            assert (g.lease_id, g.amount, g.token) == (a.id, 2 * GiB, a.token)
            g = await holders.resize(a.id, 3 * GiB, 0)  # grow now
            assert g.amount == 3 * GiB
            with pytest.raises(AcquireTimeout):
                await holders.resize(a.id, "5GiB", 0)
            grow = asyncio.create_task(holders.resize(a.id, "5GiB", 30, priority=7))
            w = await async_wait_until(lambda: waiters(user), 10, "the growth to queue")
            assert (w[0]["amount"], w[0]["priority"]) == (2 * GiB, 7)
            with pytest.raises(ResizeRefused):
                await holders.resize(b.id, "8GiB", 30)
            b.release()
            assert (await asyncio.wait_for(grow, 10)).amount == 5 * GiB
            with pytest.raises(LeaseLost):
                await holders.resize("0" * 32, "1GiB", 0)
            with pytest.raises(InvalidArgument, match="priority"):
                await holders.resize(a.id, "1GiB", 0, priority=101)
        finally:
            await holders.pool.aclose()
            await r.aclose()

    asyncio.run(main())
    assert amounts(user) == {a.id: 5 * GiB}
    a.resize("1GiB")  # the SDK's lease goes on from the server's amount
    assert amounts(user) == {a.id: GiB}
    a.release()
