"""What runs on each "host" of the multi-host tests (started with ``ip netns exec``). Each
subcommand writes JSON lines of events, with wall-clock times (``time.time()``: all namespaces
share the kernel's clock, which is also the Redis server's clock here) to ``--out``.

    share     hold leases of random sizes for --duration seconds (sdk | sdk-async | core)
    hold      hold one lease; log when it is found lost locally; after --resume appears, try a
              late renew and release and log what they report
    wait      acquire (queued), log the grant, hold until --until appears, check the pool, release
    pingpong  acquire the whole pool --n times, hold --hold seconds, release (hand-off latency)
    probe     one acquire with a bound; log the outcome and how long it took
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time

_lock = threading.Lock()
OUT = None


def log(**ev):
    ev.setdefault("t", time.time())
    with _lock:
        OUT.write(json.dumps(ev) + "\n")
        OUT.flush()


def sdk_pool(a, cls_name="Pool"):
    import gpulock_client

    cls = getattr(gpulock_client, cls_name)
    return cls(
        a.broker, a.pool, token=a.token, backend_timeout=a.backend_timeout, max_wait=a.max_wait
    )


def hold_for(lease, seconds):
    """Use the lease like a GPU job: ensure_valid() before each step. Returns the time of the
    last successful check (the end of this holder's use of the memory)."""
    end = time.monotonic() + seconds
    last = time.time()
    while True:
        lease.ensure_valid()
        last = time.time()
        if time.monotonic() >= end:
            return last
        time.sleep(0.002)


def cmd_share(a):
    rng = random.Random(os.getpid())
    stop_at = time.monotonic() + a.duration
    amounts = [int(x) for x in a.amounts.split(",")]

    def record(lease, t0, t1, outcome):
        log(
            kind="hold",
            host=a.host,
            api=a.api,
            lease_id=lease.id,
            token=lease.token,
            amount=lease.amount,
            t0=t0,
            t1=t1,
            acquired_at=acq[lease.id],
            outcome=outcome,
        )

    acq = {}
    if a.api == "sdk":
        pool = sdk_pool(a)

        def worker():
            while time.monotonic() < stop_at:
                lease = pool.acquire(rng.choice(amounts), ttl=a.ttl, timeout=30)
                acq[lease.id] = lease.acquired_at
                t0 = time.time()
                t1 = hold_for(lease, rng.uniform(0, a.hold_max))
                try:
                    lease.release()
                    record(lease, t0, t1, "released")
                except Exception as e:
                    record(lease, t0, t1, type(e).__name__)

        ts = [threading.Thread(target=worker) for _ in range(a.tasks)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        pool.close()
        return

    async def amain():
        if a.api == "core":
            import gpulock

            pool = gpulock.AsyncPool.from_url(a.redis, a.pool)
        else:
            pool = sdk_pool(a, "AsyncPool")

        async def worker():
            while time.monotonic() < stop_at:
                lease = await pool.acquire(rng.choice(amounts), ttl=a.ttl, timeout=30)
                acq[lease.id] = (
                    lease.expires_at - lease.ttl if a.api == "core" else lease.acquired_at
                )
                t0 = time.time()
                end = time.monotonic() + rng.uniform(0, a.hold_max)
                t1 = time.time()
                while True:
                    lease.ensure_valid()
                    t1 = time.time()
                    if time.monotonic() >= end:
                        break
                    await asyncio.sleep(0.002)
                try:
                    await lease.release()
                    record(lease, t0, t1, "released")
                except Exception as e:
                    record(lease, t0, t1, type(e).__name__)

        await asyncio.gather(*(worker() for _ in range(a.tasks)))
        await pool.aclose()

    asyncio.run(amain())


def cmd_hold(a):
    pool = sdk_pool(a)
    lease = pool.acquire(int(a.amounts), ttl=a.ttl, timeout=30)
    lost_cb = []
    lease.on_lost(lambda _l: lost_cb.append(time.time()))
    log(
        kind="acquired",
        host=a.host,
        lease_id=lease.id,
        token=lease.token,
        amount=lease.amount,
        expires_at=lease.expires_at,
        acquired_at=lease.acquired_at,
    )
    while not os.path.exists(a.resume):
        try:
            lease.ensure_valid()
        except Exception as e:
            log(
                kind="lost_local",
                host=a.host,
                lease_id=lease.id,
                error=type(e).__name__,
                last_expires_at=lease.expires_at,
                on_lost_at=lost_cb[0] if lost_cb else None,
            )
            while not os.path.exists(a.resume):
                time.sleep(0.02)
            break
        time.sleep(0.005)
    import httpx

    outcomes = {}
    r = httpx.put(
        f"{a.broker}/v1/pools/{a.pool}/leases/{lease.id}",
        json={},
        headers={"Authorization": f"Bearer {a.token}"},
        timeout=10,
    )  # raw: the status code
    outcomes["raw_renew_status"] = r.status_code
    for name in ("renew", "release"):
        try:
            getattr(lease, name)()
            outcomes[name] = "ok"
        except Exception as e:
            outcomes[name] = type(e).__name__
    log(kind="late", host=a.host, lease_id=lease.id, **outcomes)
    pool.close()


def cmd_wait(a):
    pool = sdk_pool(a)
    t_sent = time.time()
    lease = pool.acquire(int(a.amounts), ttl=a.ttl, timeout=a.timeout)
    log(
        kind="granted",
        host=a.host,
        lease_id=lease.id,
        token=lease.token,
        amount=lease.amount,
        sent=t_sent,
        acquired_at=lease.acquired_at,
    )
    while not os.path.exists(a.until):
        lease.ensure_valid()
        time.sleep(0.01)
    st = pool.status()
    lease.ensure_valid()
    log(kind="check", host=a.host, used=st["used"], ids=[x["lease_id"] for x in st["leases"]])
    lease.release()
    log(kind="released", host=a.host, lease_id=lease.id)
    pool.close()


def cmd_pingpong(a):
    amount = int(a.amounts)

    async def amain():
        if a.api == "core":
            import gpulock

            pool = gpulock.AsyncPool.from_url(a.redis, a.pool)
        else:
            pool = sdk_pool(a, "AsyncPool")
        log(kind="ready", host=a.host)  # imports done: the test starts both together
        while not os.path.exists(a.until):  # start together
            await asyncio.sleep(0.01)
        for _ in range(a.n):
            sent = time.time()
            lease = await pool.acquire(amount, ttl=a.ttl, timeout=30)
            granted = time.time()
            await asyncio.sleep(a.hold)
            rel_start = time.time()
            await lease.release()
            log(
                kind="pp",
                host=a.host,
                sent=sent,
                granted=granted,
                rel_start=rel_start,
                released=time.time(),
                token=lease.token,
            )
        await pool.aclose()

    asyncio.run(amain())


def cmd_probe(a):
    pool = sdk_pool(a)
    t0 = time.monotonic()
    try:
        lease = pool.acquire(int(a.amounts), ttl=a.ttl, timeout=a.timeout)
        outcome = "granted"
        lease.release()
    except Exception as e:
        outcome = type(e).__name__
    log(kind="probe", host=a.host, outcome=outcome, elapsed=time.monotonic() - t0)
    import httpx

    t0 = time.monotonic()
    try:
        r = httpx.post(
            f"{a.broker}/v1/pools/{a.pool}/leases",
            json={"amount": int(a.amounts), "wait": 0, "ttl": a.ttl},
            headers={"Authorization": f"Bearer {a.token}"},
            timeout=30,
        )
        status, err = (
            r.status_code,
            (r.json().get("detail") or {}).get("error") if r.status_code >= 300 else None,
        )
        if r.status_code == 201:
            httpx.delete(
                f"{a.broker}/v1/pools/{a.pool}/leases/{r.json()['lease_id']}",
                headers={"Authorization": f"Bearer {a.token}"},
                timeout=30,
            )
    except Exception as e:
        status, err = 0, type(e).__name__
    log(kind="raw", host=a.host, status=status, error=err, elapsed=time.monotonic() - t0)
    pool.close()


def main(argv=None):
    global OUT
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["share", "hold", "wait", "pingpong", "probe"])
    p.add_argument("--out", required=True)
    p.add_argument("--host", default=os.uname().nodename)
    p.add_argument("--api", default="sdk", choices=["sdk", "sdk-async", "core"])
    p.add_argument("--broker")
    p.add_argument("--redis")
    p.add_argument("--pool", required=True)
    p.add_argument("--token", default=os.environ.get("GPULOCK_TOKEN"))
    p.add_argument("--amounts", default="1")
    p.add_argument("--ttl", type=float, default=5.0)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--hold-max", type=float, default=0.05)
    p.add_argument("--hold", type=float, default=0.002)
    p.add_argument("--tasks", type=int, default=3)
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--backend-timeout", type=float, default=30.0)
    p.add_argument("--max-wait", type=float, default=20.0)
    p.add_argument("--resume", default="")
    p.add_argument("--until", default="")
    a = p.parse_args(argv)
    OUT = open(a.out, "a")
    try:
        {
            "share": cmd_share,
            "hold": cmd_hold,
            "wait": cmd_wait,
            "pingpong": cmd_pingpong,
            "probe": cmd_probe,
        }[a.cmd](a)
    except Exception as e:
        log(kind="error", host=a.host, error=f"{type(e).__name__}: {e}")
        raise
    finally:
        OUT.close()


if __name__ == "__main__":
    sys.exit(main())
