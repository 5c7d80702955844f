"""The pool history ring (gpulock/admin/samples.py, issue 15 item 2) against a real server: one
sampler per pool whatever the number of processes (the SET NX PX lease), bounded, on the
server's clock, kept across a sampler's restart; and the view built from it."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis

from gpulock.dashboard.view import dashboard_view
from gpulock.protocol.keys import pool_key
from gpulock.admin.samples import (
    SAMPLE_LIMIT,
    SAMPLER_LEASE_MS,
    Sampler,
    claim_sampler,
    count_event,
    read_samples,
    record_sample,
)
from support.pools import GiB

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def ar(redis_proc):
    c = aioredis.Redis.from_url(redis_proc.url)
    yield c
    await c.aclose()


async def _next_server_ms(ar) -> None:
    """Return once the Redis server's clock (what samples are dated by) shows a new ms."""
    sec, usec = await ar.time()
    start = sec * 1000 + usec // 1000
    while True:
        sec, usec = await ar.time()
        if sec * 1000 + usec // 1000 > start:
            return


def sampler_for(ar, pool):
    async def names():
        return [pool.name]

    async def status(name, limit):
        return await pool.status(limit=limit)

    return Sampler(ar, names, status)


async def test_one_sampler_writes_per_pool_and_another_takes_over(ar, make_apool):
    pool = make_apool(capacity=4 * GiB)
    lease = await pool.acquire(GiB, holder={"purpose": "resident:m"}, resident=True)
    a, b = sampler_for(ar, pool), sampler_for(ar, pool)
    assert await a.run_once() == {pool.name: True}
    assert await b.run_once() == {pool.name: False}  # a holds the sampler lease
    assert await a.run_once() == {pool.name: True}
    key = pool_key(pool.name, "sampler")
    assert (await ar.get(key)).decode() == a.id
    assert 0 < await ar.pttl(key) <= SAMPLER_LEASE_MS
    assert await ar.llen(pool_key(pool.name, "samples")) == 2
    # a's process goes away: its lease runs out, and b takes over at its next round
    await ar.pexpire(key, 1)
    for _ in range(1000):
        if not await ar.exists(key):
            break
        await asyncio.sleep(0.005)
    assert await b.run_once() == {pool.name: True}
    assert (await ar.get(key)).decode() == b.id
    assert await a.run_once() == {pool.name: False}
    samples = await read_samples(ar, pool.name)
    assert len(samples) == 3
    assert [s.t for s in samples] == sorted(s.t for s in samples)  # oldest first, server clock
    assert all(s.capacity == 4 * GiB and s.used == GiB and s.resident == GiB for s in samples)
    await lease.release()


async def test_the_ring_is_bounded_newest_first(ar, make_apool):
    pool = make_apool()
    await pool.configure(4 * GiB)
    assert await claim_sampler(ar, pool.name, "me")
    assert not await record_sample(ar, await pool.status(), "not-me")  # not the holder
    for i in range(8):
        await count_event(ar, pool.name, "rejected")
        assert await record_sample(ar, await pool.status(), "me", limit=5)
    raw = await ar.lrange(pool_key(pool.name, "samples"), 0, -1)
    assert len(raw) == 5
    assert [json.loads(x)["rejected"] for x in raw] == [8, 7, 6, 5, 4]
    assert SAMPLE_LIMIT == 900  # 15 minutes at one a second


async def test_count_event_refuses_unknown_names(ar):
    with pytest.raises(ValueError):
        await count_event(ar, "p", "teapot")


async def test_the_view_survives_a_new_sampler_and_hides_token_identities(ar, make_apool):
    pool = make_apool(capacity=4 * GiB)
    lease = await pool.acquire(
        GiB, holder={"principal": "ops", "owner": "0123456789abcdef", "job": "j"}
    )
    first = sampler_for(ar, pool)
    for _ in range(3):
        await _next_server_ms(ar)  # samples a millisecond apart: a rate needs a time span
        await first.run_once()
    await count_event(ar, pool.name, "oom")

    pools = {pool.name: pool, "missing-pool": make_apool("missing-pool")}

    async def status(name, limit):
        return await pools[name].status(limit=limit)

    # a restarted worker: a new sampler, a new reader; the history is Redis's
    v = await dashboard_view(ar, [pool.name, "missing-pool"], status)
    (p,) = v["pools"]
    assert len(p["history"]["t"]) == 3 and p["history"]["used"] == [GiB] * 3
    assert p["oom"] == 1 and p["rejected"] == 0
    assert p["grant_rate"] == 0.0  # one grant, before the first sample
    (lz,) = p["leases"]
    assert lz["holder"] == {k: v for k, v in lz["holder"].items() if k != "owner"}
    assert lz["holder"]["principal"] == "ops" and lz["token"] == lease.token
    assert "0123456789abcdef" not in json.dumps(v)
    assert set(v["errors"]) == {"missing-pool"}
    await lease.release()


async def test_a_pool_that_does_not_exist_gets_no_keys(ar, make_apool):
    from gpulock.admin.pools import adelete_pool

    assert not await claim_sampler(ar, "never-made", "me")
    assert not await count_event(ar, "never-made", "rejected")
    assert await ar.keys("gpulock:{never-made}:*") == []
    # deleted while a sampler held it: its next claim and push make nothing again
    pool = make_apool()
    await pool.configure(4 * GiB)
    st = await pool.status()
    assert await claim_sampler(ar, pool.name, "me") and await record_sample(ar, st, "me")
    assert (await adelete_pool(ar, pool.name)).state == "deleted"
    assert not await claim_sampler(ar, pool.name, "me")
    assert not await record_sample(ar, st, "me")
    assert not await count_event(ar, pool.name, "oom")
    assert await ar.keys(f"gpulock:{{{pool.name}}}:*") == []
