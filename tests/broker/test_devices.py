"""Devices through the broker (docs/SEMANTICS.md, "Devices and placement"): ``PUT
/v1/pools/{pool}`` sets a pool's devices and placement (422 naming a bad value, nothing
changed; an admin change is in the audit log); a lease request may pin a device (422 naming
one the pool lacks, 413 for an amount above its capacity) and the grant names its device;
``GET`` shows each device's capacity and use, each lease's device and each waiter's; the SDK
sends ``device`` and its lease says where it is."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis
from gpulock_client import AsyncPool, CapacityExceeded, InvalidArgument, Pool

from support.pools import snapshot
from support.waiting import wait_until

from ._support import USER_TOKEN, BrokerServer, client

GiB = 2**30
pytestmark = pytest.mark.timeout(60)


def post(c, pool="gpu-a", **body):
    body.setdefault("ttl", 10)
    return c.post(f"/v1/pools/{pool}/leases", json=body)


def status(c, pool="gpu-a"):
    r = c.get(f"/v1/pools/{pool}")
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def rc(redis_srv):
    c = redis.Redis.from_url(redis_srv.url)
    yield c
    c.close()


@pytest.fixture
def two(admin):
    """Pool gpu-d of two devices of 4 GiB each."""
    r = admin.put("/v1/pools/gpu-d", json={"devices": ["4GiB", "4GiB"]})
    assert r.status_code == 200, r.text
    return "gpu-d"


def _msgs(r) -> str:
    return " | ".join(str(e.get("msg")) for e in r.json()["detail"])


# ---- PUT: devices and placement --------------------------------------------------------------
def test_devices_are_set_shown_and_leases_placed_on_them(admin, user, caplog):
    caplog.set_level(logging.INFO, logger="gpulock.broker")
    r = admin.put("/v1/pools/gpu-x", json={"devices": ["4GiB", 8 * GiB]})
    assert r.status_code == 200, r.text
    d = r.json()
    assert (d["capacity"], d["devices"], d["placement"]) == (
        12 * GiB,
        [4 * GiB, 8 * GiB],
        "bestfit",
    )
    assert f"admin set pool gpu-x capacity={12 * GiB}" in caplog.text
    assert f"devices={4 * GiB},{8 * GiB} placement=bestfit" in caplog.text
    st = status(user, "gpu-x")
    assert st["devices"] == [
        {"index": 0, "capacity": 4 * GiB, "used": 0},
        {"index": 1, "capacity": 8 * GiB, "used": 0},
    ]
    assert st["placement"] == "bestfit" and st["capacity"] == 12 * GiB
    # best fit: the device with the least free bytes that still fits
    a = post(user, "gpu-x", amount="3GiB")
    b = post(user, "gpu-x", amount="6GiB")  # device 0 has 1 GiB free: device 1
    c = post(user, "gpu-x", amount="1GiB")  # fits device 0 exactly
    pinned = post(user, "gpu-x", amount="1GiB", device=1)
    for x in (a, b, c, pinned):
        assert x.status_code == 201, x.text
    assert [x.json()["device"] for x in (a, b, c, pinned)] == [0, 1, 0, 1]
    st = status(user, "gpu-x")
    assert [(x["index"], x["used"]) for x in st["devices"]] == [(0, 4 * GiB), (1, 7 * GiB)]
    by_id = {x["lease_id"]: x["device"] for x in st["leases"]}
    assert by_id == {x.json()["lease_id"]: x.json()["device"] for x in (a, b, c, pinned)}
    # the pools list shows them too
    listed = next(p for p in user.get("/v1/pools").json()["pools"] if p["pool"] == "gpu-x")
    assert listed["devices"] == st["devices"] and listed["placement"] == "bestfit"
    # placement alone (with the pool's capacity): spread; the devices are kept
    r = admin.put("/v1/pools/gpu-x", json={"capacity": "12GiB", "placement": "spread"})
    assert r.status_code == 200, r.text
    assert (r.json()["devices"], r.json()["placement"]) == ([4 * GiB, 8 * GiB], "spread")
    assert "placement=spread" in caplog.text
    for x in (a, b, c, pinned):
        assert user.delete(f"/v1/pools/gpu-x/leases/{x.json()['lease_id']}").status_code == 200
    # spread: the device with the most free bytes
    r = post(user, "gpu-x", amount=1)
    assert r.status_code == 201 and r.json()["device"] == 1, r.text


def test_capacity_given_with_devices_is_their_sum(admin):
    r = admin.put("/v1/pools/gpu-x", json={"capacity": "8GiB", "devices": ["2GiB", "6GiB"]})
    assert r.status_code == 200, r.text
    assert (r.json()["capacity"], r.json()["devices"]) == (8 * GiB, [2 * GiB, 6 * GiB])
    # the same count with other capacities (leases kept), and back to one device when idle
    r = admin.put("/v1/pools/gpu-x", json={"devices": [GiB, 3 * GiB]})
    assert r.status_code == 200 and r.json()["capacity"] == 4 * GiB, r.text
    r = admin.put("/v1/pools/gpu-x", json={"devices": ["5GiB"]})
    assert r.status_code == 200, r.text
    assert (r.json()["capacity"], r.json()["devices"]) == (5 * GiB, [5 * GiB])
    # a pool of one device: capacity alone sets it
    r = admin.put("/v1/pools/gpu-x", json={"capacity": "6GiB"})
    assert r.status_code == 200 and r.json()["devices"] == [6 * GiB], r.text


@pytest.mark.parametrize(
    "body, shown",
    [
        ({"devices": []}, "devices must be a list of 1 to 64 capacities, got []"),
        ({"devices": ["4GiB"] * 65}, "devices must be a list of 1 to 64 capacities"),
        ({"devices": "2"}, "got '2'"),
        ({"devices": 2, "capacity": "4GiB"}, "got 2"),
        ({"devices": ["4GiB", "lots"]}, "capacity of device 1 must be a size"),
        ({"devices": ["4GiB", "0"]}, "capacity of device 1 must be a size"),
        ({"devices": [1, -1]}, "capacity of device 1"),
        ({"devices": [1, 1.5]}, "capacity of device 1"),
        ({"devices": [True]}, "capacity of device 0"),
        ({"devices": [1, None]}, "capacity of device 1"),
        (
            {"devices": ["4GiB", "4GiB"], "capacity": "10GiB"},
            f"capacity {10 * GiB} is not the sum of the devices' capacities ({8 * GiB} bytes",
        ),
        ({"devices": [2**53 - 1, 2]}, "sum to 9007199254740993 bytes"),
        ({"capacity": "10GiB", "placement": "random"}, "'random'"),
        ({"capacity": "10GiB", "placement": None, "devices": None}, None),  # a good one
        ({"placement": "spread"}, "capacity is required (or devices"),
        ({"capacity": None}, "capacity is required (or devices"),
    ],
)
def test_a_bad_device_spec_is_422_naming_it_and_changes_nothing(admin, gpu, rc, body, shown):
    before = snapshot(rc)
    r = admin.put(f"/v1/pools/{gpu}", json=body)
    if shown is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 422, r.text
    assert shown in r.text, r.text
    assert snapshot(rc) == before


def test_the_count_of_devices_changes_only_on_an_idle_pool(admin, user, two, rc):
    held = post(user, two, amount=1)
    assert held.status_code == 201, held.text
    before = snapshot(rc)
    r = admin.put(f"/v1/pools/{two}", json={"devices": ["4GiB"] * 3})
    assert r.status_code == 422 and "changes only when it has none" in r.text, r.text
    r = admin.put(f"/v1/pools/{two}", json={"capacity": "10GiB"})
    assert r.status_code == 422, r.text
    assert "give each one a capacity" in r.text and str(10 * GiB) in r.text, r.text
    assert snapshot(rc) == before
    # the same count, other capacities: allowed with the lease held
    r = admin.put(f"/v1/pools/{two}", json={"devices": ["2GiB", "6GiB"]})
    assert r.status_code == 200 and r.json()["used"] == 1, r.text
    st = status(user, two)
    assert [(x["capacity"], x["used"]) for x in st["devices"]] == [(2 * GiB, 1), (6 * GiB, 0)]


# ---- POST: a pinned device -------------------------------------------------------------------
def test_a_pool_of_one_device_is_device_0(user, gpu, rc):
    st = status(user, gpu)
    assert st["devices"] == [{"index": 0, "capacity": 10 * GiB, "used": 0}], st
    assert st["placement"] == "bestfit"
    a = post(user, gpu, amount="1GiB")
    b = post(user, gpu, amount="1GiB", device=0)
    c = post(user, gpu, amount="1GiB", device=None)
    assert [x.json()["device"] for x in (a, b, c)] == [0, 0, 0], (a.text, b.text, c.text)
    assert [x["device"] for x in status(user, gpu)["leases"]] == [0, 0, 0]
    before = snapshot(rc)
    r = post(user, gpu, amount=1, device=1)
    assert r.status_code == 422, r.text
    assert "device 1 is not a device of the pool: it has 1 (0 .. 0)" in r.text, r.text
    assert snapshot(rc) == before


@pytest.mark.parametrize("bad", [-1, 64, 100, "x", "1", 1.5, True, [0], {"i": 0}])
def test_a_bad_device_is_422_naming_the_value_and_changes_nothing(user, two, rc, bad):
    held = post(user, two, amount="4GiB", device=0)  # a good request would queue or be granted
    assert held.status_code == 201, held.text
    before = snapshot(rc)
    r = post(user, two, amount=GiB, device=bad)
    assert r.status_code == 422, r.text
    (e,) = r.json()["detail"]
    assert e["loc"] == ["body", "device"], e
    assert f"got {bad!r}" in e["msg"] and "[0, 63]" in e["msg"], e
    assert snapshot(rc) == before


def test_a_device_the_pool_lacks_or_too_small_is_refused(user, two, rc):
    before = snapshot(rc)
    r = post(user, two, amount=1, device=2)
    assert r.status_code == 422, r.text
    assert _msgs(r).endswith("device 2 is not a device of the pool: it has 2 (0 .. 1)"), r.text
    r = post(user, two, amount="5GiB", device=1)  # above device 1's capacity
    assert r.status_code == 413, r.text
    d = r.json()["detail"]
    assert (d["error"], d["amount"], d["capacity"]) == ("capacity_exceeded", 5 * GiB, 4 * GiB)
    r = post(user, two, amount="5GiB")  # 8 GiB in all, but no device holds 5
    assert r.status_code == 413 and r.json()["detail"]["capacity"] == 4 * GiB, r.text
    assert snapshot(rc) == before


def test_device_takes_integral_json_numbers(user, two):
    r = post(user, two, amount=1, device=1.0)
    assert r.status_code == 201 and r.json()["device"] == 1, r.text
    r = post(user, two, amount=1, device=63.0)  # the schema's bound; the pool's is 1
    assert r.status_code == 422 and "device 63 is not a device of the pool" in r.text, r.text


def test_a_pinned_request_queues_for_its_device_and_is_handed_it(user, two):
    held = post(user, two, amount="3GiB", device=1)
    assert held.status_code == 201 and held.json()["device"] == 1, held.text
    r = post(user, two, amount="2GiB", device=1, request_id="pinned", wait=0)
    assert r.status_code == 503 and r.json()["detail"]["error"] == "queued", r.text
    # one that names no device queues behind it (FIFO: nothing passes the head)
    r = post(user, two, amount="3GiB", request_id="any", wait=0)
    assert r.status_code == 503 and r.json()["detail"]["position"] == 2, r.text
    ws = status(user, two)["waiters"]
    assert [(w["amount"], w["device"]) for w in ws] == [(2 * GiB, 1), (3 * GiB, None)], ws
    assert user.delete(f"/v1/pools/{two}/leases/{held.json()['lease_id']}").status_code == 200
    # both are handed their grants: the pinned one on device 1, the other where it fits best
    r = post(user, two, amount="2GiB", device=1, request_id="pinned", wait=5)
    assert r.status_code == 201, r.text
    assert (r.json()["device"], r.json()["request_id"]) == (1, "pinned")
    r = post(user, two, amount="3GiB", request_id="any", wait=5)
    assert r.status_code == 201 and r.json()["device"] == 0, r.text
    st = status(user, two)
    assert sorted((x["amount"], x["device"]) for x in st["leases"]) == [
        (2 * GiB, 1),
        (3 * GiB, 0),
    ], st
    assert [(x["index"], x["used"]) for x in st["devices"]] == [(0, 3 * GiB), (1, 2 * GiB)]


def test_a_long_polled_pinned_request_is_handed_its_device(broker_srv, user, two):
    """The hand-off during the long poll names the device in the 201."""
    import threading

    held = post(user, two, amount="4GiB", device=0)
    out: dict = {}
    t = threading.Thread(
        target=lambda: out.update(r=post(user, two, amount="3GiB", device=0, wait=5))
    )
    t.start()
    wait_until(lambda: status(user, two)["waiter_count"] == 1, timeout=10, what="queued")
    assert user.delete(f"/v1/pools/{two}/leases/{held.json()['lease_id']}").status_code == 200
    t.join(10)
    assert out["r"].status_code == 201, out["r"].text
    assert out["r"].json()["device"] == 0


def test_a_renewal_names_the_device_through_any_broker(redis_srv, user, two):
    """The renewal's answer names the lease's device, also from a broker that did not grant it
    (it reads the lease from Redis)."""
    lease = post(user, two, amount=1, device=1).json()
    r = user.put(f"/v1/pools/{two}/leases/{lease['lease_id']}", json={"ttl": 20})
    assert r.status_code == 200 and r.json()["device"] == 1, r.text
    other = BrokerServer(redis_srv.url, max_wait=1.0).start()
    try:
        with client(other.url, USER_TOKEN) as c:
            r = c.put(f"/v1/pools/{two}/leases/{lease['lease_id']}", json={"ttl": 20})
            assert r.status_code == 200 and r.json()["device"] == 1, r.text
    finally:
        other.stop()


def test_openapi_documents_devices(user):
    schemas = user.get("/openapi.json").json()["components"]["schemas"]
    dev = schemas["LeaseRequest"]["properties"]["device"]
    (i,) = [b for b in dev["anyOf"] if b.get("type") == "integer"]
    assert (i["minimum"], i["maximum"]) == (0, 63) and {"type": "null"} in dev["anyOf"], dev
    cfg = schemas["PoolConfigRequest"]
    assert [b["required"] for b in cfg["anyOf"]] == [["capacity"], ["devices"]], cfg
    assert "capacity" not in cfg.get("required", []), cfg
    (arr,) = [b for b in cfg["properties"]["devices"]["anyOf"] if b.get("type") == "array"]
    assert (arr["minItems"], arr["maxItems"]) == (1, 64), arr
    (pl,) = [b for b in cfg["properties"]["placement"]["anyOf"] if "enum" in b]
    assert pl["enum"] == ["bestfit", "spread"], pl
    assert "device" in schemas["LeaseGrant"]["properties"]
    assert "device" in schemas["WaiterInfoOut"]["properties"]
    assert "device" in schemas["LeaseInfoOut"]["properties"]
    assert set(schemas["DeviceUseOut"]["properties"]) == {"index", "capacity", "used"}


# ---- the SDK ---------------------------------------------------------------------------------
def test_the_sdk_pins_a_device_and_its_lease_says_where(broker_srv, two, rc):
    with Pool(broker_srv.url, two, token=USER_TOKEN) as p:
        with p.lease("3GiB", device=1) as a, p.lease("3GiB") as b:
            assert (a.device, b.device) == (1, 0)
            st = p.status()
            assert [(x["index"], x["used"]) for x in st["devices"]] == [(0, 3 * GiB), (1, 3 * GiB)]
        before = snapshot(rc)
        with pytest.raises(InvalidArgument, match="device 2 is not a device of the pool: it has 2"):
            p.acquire(1, device=2, timeout=5)
        with pytest.raises(CapacityExceeded):
            p.acquire("5GiB", device=0, timeout=5)
        for bad in (-1, 64, "1", 1.5, True):
            with pytest.raises(
                InvalidArgument, match=r"device must be a device index in \[0, 63\]"
            ):
                p.acquire(1, device=bad, timeout=5)  # type: ignore[arg-type]
        assert snapshot(rc) == before


def test_the_async_sdk_pins_a_device_too(broker_srv, two):
    async def main():
        async with AsyncPool(broker_srv.url, two, token=USER_TOKEN, max_wait=2) as p:
            held = await p.acquire("4GiB", device=1)
            assert held.device == 1
            task = asyncio.ensure_future(p.acquire("1GiB", device=1, timeout=30))
            for _ in range(200):
                if [w["device"] for w in (await p.status())["waiters"]] == [1]:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the pinned request never queued")
            await held.release()
            lease = await asyncio.wait_for(task, 30)
            assert lease.device == 1
            async with p.lease(1, device=0) as x:
                assert x.device == 0
            await lease.release()
            with pytest.raises(InvalidArgument, match="got 64"):
                await p.acquire(1, device=64)

    asyncio.run(main())


def test_a_request_id_reused_for_another_device_is_422_naming_the_id_as_sent(user, two):
    """The pool knows a request id scoped to the token; the 422 names it as the client sent
    it, and the lease it holds is untouched."""
    r = post(user, two, amount="1GiB", device=0, request_id="job-7")
    assert r.status_code == 201, r.text
    r = post(user, two, amount="1GiB", device=1, request_id="job-7")
    assert r.status_code == 422, r.text
    assert "request id job-7 holds a lease of another" in r.text and ":job-7" not in r.text, r.text
    assert [(x["amount"], x["device"]) for x in status(user, two)["leases"]] == [(GiB, 0)]
