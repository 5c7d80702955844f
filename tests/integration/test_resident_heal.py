"""The resident counters heal on the refusal path (docs/SEMANTICS.md, "Resident leases"): an
earlier gpulock version sharing the pool (a rolling upgrade) releases a resident lease without
lowering the counters; the next request they would refuse has them recounted from the records
first, repaired, and is refused only if the exact totals still say so."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from support.pools import check_consistent, raw

from gpulock import AcquireTimeout, QuotaExceeded, RoomExceeded
from gpulock.protocol.args import new_id
from gpulock.protocol.keys import pool_keys

pytestmark = pytest.mark.timeout(60)

#: release.lua of gpulock before resident leases (commit 575498b), as one script: see its header.
OLD_RELEASE = (Path(__file__).parent.parent / "fixtures" / "release_575498b.lua").read_text()


def old_release(client: redis.Redis, pool: str, lease_id: str, token: int) -> list:
    """Release a lease with the earlier version's script (it leaves the resident counters)."""
    keys = pool_keys(pool)
    return client.eval(OLD_RELEASE, len(keys), *keys, lease_id, str(token))


def raw_grant(
    client: redis.Redis,
    pool: str,
    amount: int,
    *,
    resident: bool = False,
    tenant: str = "",
    prio: int = 0,
    mode: str = "wait",
) -> list:
    """acquire.lua on the raw keys (no pool object keeps the lease): its reply."""
    return raw(
        client, pool, "acquire", new_id(), new_id(), amount, 60_000, 600_000, mode, "{}",
        "test", prio, tenant, "", "resident" if resident else "",
    )  # fmt: skip


def counters(client: redis.Redis, pool: str) -> dict[str, int]:
    cfg = client.hgetall(pool_keys(pool).cfg)
    names = (b"resident", b"rqueued")
    return {
        k.decode(): int(v)
        for k, v in cfg.items()
        if k in names or k.startswith((b"tres:", b"dres:"))
    }


@pytest.mark.parametrize("resident", [False, True], ids=["ordinary", "resident"])
async def test_a_resident_lease_released_by_an_older_version_no_longer_takes_room(
    resident, make_apool, rclient, pool_name
):
    """Capacity 100, tenant a's quota 80: a model of 60 released by the earlier version leaves
    resident = tres:a = 60 behind. A request of 50 of tenant a fits once the counters are
    right: it is granted at once (ordinary, or resident), and the counters equal the records."""
    pool = make_apool()
    await pool.configure(100, quotas={"a": 80})
    r = raw_grant(rclient, pool_name, 60, resident=True, tenant="a")
    assert int(r[0]) == 1
    assert int(old_release(rclient, pool_name, r[1].decode(), int(r[2]))[0]) == 1
    assert counters(rclient, pool_name) == {"resident": 60, "tres:a": 60}  # the old script's gap
    lease = await pool.acquire(50, tenant="a", resident=resident, timeout=0)
    assert counters(rclient, pool_name) == ({"resident": 50, "tres:a": 50} if resident else {})
    check_consistent(rclient, pool_name)
    await lease.release()
    assert counters(rclient, pool_name) == {}
    check_consistent(rclient, pool_name)


async def test_a_request_still_refused_by_the_exact_totals_is_refused(
    make_apool, rclient, pool_name
):
    """Overcounted counters are repaired, yet a request the exact totals leave no room for is
    still refused, naming the exact room."""
    pool = make_apool()
    await pool.configure(100, quotas={"a": 80})
    gone = raw_grant(rclient, pool_name, 30, resident=True, tenant="a")
    raw_grant(rclient, pool_name, 40, resident=True, tenant="a")
    old_release(rclient, pool_name, gone[1].decode(), int(gone[2]))
    assert counters(rclient, pool_name) == {"resident": 70, "tres:a": 70}
    with pytest.raises(RoomExceeded) as e:
        await pool.acquire(65, timeout=0)
    assert (e.value.room, e.value.resident) == (60, 40)
    assert counters(rclient, pool_name) == {"resident": 40, "tres:a": 40}
    with pytest.raises(QuotaExceeded) as q:
        await pool.acquire(45, tenant="a", timeout=0)
    assert q.value.resident == 40
    with pytest.raises(AcquireTimeout):  # resident: not queued next to the exact totals
        await pool.acquire(61, resident=True, timeout=0)
    check_consistent(rclient, pool_name)


def test_a_hand_off_recounts_before_dropping_a_waiter(rclient, pool_name):
    """A waiter queued while it fitted next to the resident leases (55 next to a model of 40 on
    100) is handed the bytes after the earlier version released the model and another model of
    40 came: the counters say 80 (room 20), the records 40 (room 60). The hand-off recounts
    before it drops a waiter, and grants it."""
    raw(rclient, pool_name, "configure", 100, 1000, "set")
    model = raw_grant(rclient, pool_name, 40, resident=True)
    short = raw_grant(rclient, pool_name, 50)
    waiter = raw_grant(rclient, pool_name, 55)
    assert int(waiter[0]) == 0  # queued
    assert int(old_release(rclient, pool_name, model[1].decode(), int(model[2]))[3]) == 0
    second = raw_grant(rclient, pool_name, 40, resident=True, prio=100)  # ahead of the waiter
    assert int(second[0]) == 1
    assert counters(rclient, pool_name) == {"resident": 80}
    out = raw(rclient, pool_name, "release", short[1].decode(), int(short[2]))
    assert (int(out[0]), int(out[3])) == (1, 1), out  # released; the waiter granted
    assert counters(rclient, pool_name) == {"resident": 40}
    assert rclient.zcard(pool_keys(pool_name).queue) == 0
    check_consistent(rclient, pool_name)


async def test_device_and_queued_counters_heal_too(make_apool, rclient, pool_name):
    """Counters overcounted on a pool of two devices (dres:0, and rqueued with no resident
    request queued): a request pinned to device 0 that fits its true room is granted."""
    pool = make_apool()
    await pool.configure(devices=[50, 50])
    k = pool_keys(pool_name).cfg
    rclient.hset(k, mapping={"resident": 40, "dres:0": 40, "rqueued": 10})
    lease = await pool.acquire(20, device=0, timeout=0)
    assert lease.device == 0
    assert counters(rclient, pool_name) == {}
    check_consistent(rclient, pool_name)
