"""One holder process of the fault soak (test_holder_faults.py); run as a script.

Usage: python _soak_worker.py URL POOL OUT SEED END_AT MAX_AMOUNT FAULT_P SHELL [SCHEDULE]

Loops acquire -> hold -> release with random amounts until END_AT: a time.time() instant, or
``@PATH``: the instant the test writes into PATH once it has observed what it waited for (until
PATH exists the worker goes on).
Before a cycle it takes the first plan of SCHEDULE (a comma-separated list of the plans below)
or, once that is done, picks one at random with probability FAULT_P, and injects it into itself
at one step of the protocol — only once the step's precondition was observed:

  kill/stop_queued     in the on_queued callback, once this process read its own ticket in the
                       pool's queue on the raw keys (a grant may race in between the queued
                       reply and the callback: then the plan waits for a later cycle)
  kill/stop_inflight   right after the acquire was written to the socket, before its reply is
                       read (the server may have granted it; the holder cannot know)
  kill/stop_holding    in the middle of the hold, right after an ensure_valid() that passed
  kill/stop_release    right after the release was written, before its reply is read (a lease
                       already known lost locally sends no release: the plan waits)

A scheduled plan stays first in SCHEDULE until it was injected, so every plan of SCHEDULE is
injected in this process unless the process is killed first (the test gives a replacement the
plans nobody injected yet); a random plan whose precondition did not come is dropped.

``kill`` is SIGKILL to itself; ``stop`` is SIGSTOP to itself (the test SIGCONTs it after a
random delay, sometimes longer than the ttl). The test also stops and kills workers from
outside at arbitrary instants.

OUT gets one line per event (line-buffered appends; the times are the Redis server's, in µs,
read on a separate connection):
  G token amount lease_id   a lease came back from acquire
  U token amount t          t was read *before* an ensure_valid() that passed: an instant at
                            which this process surely held the lease (server clock)
  L token why               the lease was found lost (ensure_valid or release)
  F plan [ticket]           about to inject this fault (its precondition was observed)
  E type message at=T       an unexpected error (the test fails on any), at time.time() T
  B message                 BackendUnavailable while GPULOCK_SOAK_TOLERATE_BACKEND=1 (the
                            failover test: Redis is away for a moment)
  S epoch                   the pool object read the pool's status: from here on this process
                            knows the pool (after a Redis restart it re-creates it with a grace
                            period instead of as a new pool)
  Q pending closed          (crowd) the pool object was closed with PENDING acquires waiting, and
                            CLOSED of them ended with PoolClosed
SHELL is ``sync`` (Pool), ``async`` (AsyncPool) or ``crowd``: one AsyncPool with
GPULOCK_SOAK_CROWD (default 300) tasks that each loop acquire (small amounts, no timeout) ->
short hold -> release, so hundreds or thousands of acquires wait at once in one process; it
injects no faults into itself, and with GPULOCK_SOAK_LIFE="LO,HI" it closes its pool object at a
random instant that many seconds after its start, with its acquires waiting (a client that goes
away while waiting), and exits 0.
GPULOCK_SOAK_SYNC_REPLICAS and GPULOCK_SOAK_SYNC_TIMEOUT set the pools' sync_replicas and
sync_timeout; GPULOCK_SOAK_MAX_TTL their max_ttl (the grace period after Redis lost the pool);
GPULOCK_SOAK_MAX_CONNECTIONS their max_connections, where the pool objects have that setting.
GPULOCK_SOAK_CLOCK_URL: the server the TIME reads go to (default URL; a cluster test gives one
node's plain URL: every node of a loopback cluster reads the same clock). GPULOCK_SOAK_TTL: the
leases' ttl (default 1 s; a release is retried while its lease is valid, so a failover test
gives a ttl longer than the election).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable

import redis
import redis.asyncio as aioredis

from gpulock import AsyncPool, BackendUnavailable, LeaseLost, Pool, PoolClosed
from gpulock.protocol.args import new_id
from gpulock.protocol.keys import pool_keys
from gpulock.transport.scripts import scripts

OPTS = {
    "sync_replicas": int(os.environ.get("GPULOCK_SOAK_SYNC_REPLICAS", "0")),
    "sync_timeout": float(os.environ.get("GPULOCK_SOAK_SYNC_TIMEOUT", "1.0")),
}
if os.environ.get("GPULOCK_SOAK_MAX_TTL"):
    OPTS["max_ttl"] = float(os.environ["GPULOCK_SOAK_MAX_TTL"])
if (
    os.environ.get("GPULOCK_SOAK_MAX_CONNECTIONS")
    and "max_connections" in inspect.signature(AsyncPool.from_url).parameters
):
    OPTS["max_connections"] = int(os.environ["GPULOCK_SOAK_MAX_CONNECTIONS"])  # a from_url argument
TOLERATE = os.environ.get("GPULOCK_SOAK_TOLERATE_BACKEND") == "1"
CLOCK_NAME = "soak-clock"  # the workers' own TIME connection (one per process)


def error_line(e: BaseException) -> str:
    if TOLERATE and isinstance(e, BackendUnavailable):
        return f"B {str(e)[:200]!r}"
    return f"E {type(e).__name__} {str(e)[:200]!r} at={time.time():.3f}"


PLANS = [
    "kill_queued",
    "stop_queued",
    "kill_inflight",
    "stop_inflight",
    "kill_holding",
    "stop_holding",
    "kill_release",
    "stop_release",
]
TTL, WAITER_TTL, POLL = float(os.environ.get("GPULOCK_SOAK_TTL", "1.0")), 1.0, 0.25


def end_reader(arg: str) -> Callable[[], float]:
    """END_AT as a function read before each cycle: a fixed instant, or ``@PATH``'s content
    (infinity while PATH does not exist yet; the test renames a complete file into place)."""
    if not arg.startswith("@"):
        fixed = float(arg)
        return lambda: fixed
    path = arg[1:]

    def read() -> float:
        try:
            with open(path) as f:
                return float(f.read())
        except FileNotFoundError:
            return math.inf

    return read


def main() -> None:
    url, pool_name, out, seed, end_at, max_amount, fault_p, shell = sys.argv[1:9]
    pending = [p for p in (sys.argv[9] if len(sys.argv) > 9 else "").split(",") if p]
    assert set(pending) <= set(PLANS), pending
    queue_key = pool_keys(pool_name)[3]
    rng = random.Random(int(seed))
    end_at, max_amount, fault_p = end_reader(end_at), int(max_amount), float(fault_p)
    # One connection for the TIME reads (the test counts it next to gpulock's).
    clock = redis.Redis(
        connection_pool=redis.BlockingConnectionPool.from_url(
            os.environ.get("GPULOCK_SOAK_CLOCK_URL", url),
            max_connections=1,
            timeout=10,
            client_name=CLOCK_NAME,
        )
    )
    f = open(out, "a", buffering=1)

    def log(line: str) -> None:
        f.write(line + "\n")

    def now_us() -> int:
        deadline = time.monotonic() + 10
        while True:  # Redis may be away for a moment (the failover test)
            try:
                s, us = clock.time()
                return int(s) * 1_000_000 + int(us)
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def fault(plan: str, detail: str = "") -> None:
        if pending and pending[0] == plan:
            pending.pop(0)  # before the stop: after SIGCONT this process goes on
        log(f"F {plan} {detail}".rstrip())
        os.kill(os.getpid(), signal.SIGKILL if plan.startswith("kill") else signal.SIGSTOP)

    def pick() -> str | None:
        if pending:
            return pending[0]
        return rng.choice(PLANS) if rng.random() < fault_p else None

    def queued_fault(plan: str | None, ticket: str):
        """The on_queued callback of a cycle with a *_queued plan: inject it (once) when the
        ticket is really in the queue on the server, read on the raw keys."""
        if plan not in ("kill_queued", "stop_queued"):
            return None
        fired = []

        def cb(_pos: int) -> None:
            if not fired:
                fired.append(1)
                try:
                    there = clock.zscore(queue_key, ticket) is not None
                except redis.RedisError:
                    there = False
                if there:
                    fault(plan, ticket)

        return cb

    def hold_time() -> float:
        return rng.choice(
            (0.0, 0.0, rng.uniform(0, 0.003), rng.uniform(0, 0.03), rng.uniform(0.1, 0.3))
        )

    def use(lease) -> bool:
        t = now_us()
        try:
            lease.ensure_valid()
        except LeaseLost as e:
            log(f"L {lease.token} {e.reason[:40].replace(' ', '_')}")
            return False
        log(f"U {lease.token} {lease.amount} {t}")
        return True

    armed: dict[str, str] = {}  # op name -> plan: inject right after that script is sent

    if shell == "crowd":
        asyncio.run(_crowd_main(url, pool_name, rng, end_at, log))
    elif shell == "sync":
        pool = Pool.from_url(
            url,
            pool_name,
            capacity=100,
            default_ttl=TTL,
            waiter_ttl=WAITER_TTL,
            poll_interval=POLL,
            **OPTS,
        )
        log(f"S {pool.status().epoch}")
        orig = pool._eval_once

        def eval_once(name, args):
            plan = armed.pop(name, None)
            if plan is None:
                return orig(name, args)
            sc = scripts()[name]
            conn = pool.redis.connection_pool.get_connection()
            try:
                conn.send_command("EVALSHA", sc.sha, len(pool._keys), *pool._keys, *args)
                fault(plan)  # the request is on the wire; its reply is not read yet
                try:
                    return conn.read_response()
                except redis.exceptions.NoScriptError:
                    pass  # Redis restarted since the scripts were loaded: go the normal way
            finally:
                pool.redis.connection_pool.release(conn)
            return orig(name, args)  # (the fault was injected; this path reloads the script)

        pool._eval_once = eval_once
        cycle = 0
        while time.time() < end_at():
            cycle += 1
            plan = pick() if cycle > 1 else None  # the first cycle loads the scripts
            amount = rng.randint(1, max_amount)
            if plan in ("kill_inflight", "stop_inflight"):
                armed["acquire"] = plan
            ticket = new_id()
            try:
                lease = pool.acquire(
                    amount, timeout=30, request_id=ticket, on_queued=queued_fault(plan, ticket)
                )
            except Exception as e:  # noqa: BLE001 - every unexpected error is logged and fails the test
                log(error_line(e))
                armed.clear()
                continue
            armed.pop("acquire", None)
            log(f"G {lease.token} {lease.amount} {lease.id}")
            ok = use(lease)
            t_end = time.monotonic() + hold_time()
            if plan in ("kill_holding", "stop_holding"):
                time.sleep(rng.uniform(0, 0.05))
                if use(lease):  # surely held right now
                    fault(plan)
            while ok and time.monotonic() < t_end:
                time.sleep(min(0.02, max(0.0, t_end - time.monotonic())))
                ok = use(lease)
            if ok:
                ok = use(lease)
            if plan in ("kill_release", "stop_release"):
                armed["release"] = plan
            try:
                lease.release()
            except LeaseLost as e:
                log(f"L {lease.token} release:{e.reason[:30].replace(' ', '_')}")
            except Exception as e:  # noqa: BLE001
                log(error_line(e))
            armed.clear()
        pool.close()
    else:
        asyncio.run(
            _async_main(
                url,
                pool_name,
                rng,
                end_at,
                max_amount,
                pick,
                fault,
                queued_fault,
                log,
                use,
                hold_time,
                armed,
            )
        )
    f.close()
    clock.close()


async def _async_main(
    url, pool_name, rng, end_at, max_amount, pick, fault, queued_fault, log, use, hold_time, armed
) -> None:
    pool = AsyncPool.from_url(
        url,
        pool_name,
        capacity=100,
        default_ttl=TTL,
        waiter_ttl=WAITER_TTL,
        poll_interval=POLL,
        **OPTS,
    )
    log(f"S {(await pool.status()).epoch}")
    orig = pool._eval_once

    async def eval_once(name, args):
        plan = armed.pop(name, None)
        if plan is None:
            return await orig(name, args)
        sc = scripts()[name]
        conn = await pool.redis.connection_pool.get_connection()
        try:
            await conn.send_command("EVALSHA", sc.sha, len(pool._keys), *pool._keys, *args)
            fault(plan)
            try:
                return await conn.read_response()
            except redis.exceptions.NoScriptError:
                pass  # Redis restarted since the scripts were loaded: go the normal way
        finally:
            await pool.redis.connection_pool.release(conn)
        return await orig(name, args)

    pool._eval_once = eval_once
    cycle = 0
    while time.time() < end_at():
        cycle += 1
        plan = pick() if cycle > 1 else None
        amount = rng.randint(1, max_amount)
        if plan in ("kill_inflight", "stop_inflight"):
            armed["acquire"] = plan
        ticket = new_id()
        try:
            lease = await pool.acquire(
                amount, timeout=30, request_id=ticket, on_queued=queued_fault(plan, ticket)
            )
        except Exception as e:  # noqa: BLE001
            log(error_line(e))
            armed.clear()
            continue
        armed.pop("acquire", None)
        log(f"G {lease.token} {lease.amount} {lease.id}")
        ok = use(lease)
        t_end = time.monotonic() + hold_time()
        if plan in ("kill_holding", "stop_holding"):
            await asyncio.sleep(rng.uniform(0, 0.05))
            if use(lease):
                fault(plan)
        while ok and time.monotonic() < t_end:
            await asyncio.sleep(min(0.02, max(0.0, t_end - time.monotonic())))
            ok = use(lease)
        if ok:
            ok = use(lease)
        if plan in ("kill_release", "stop_release"):
            armed["release"] = plan
        try:
            await lease.release()
        except LeaseLost as e:
            log(f"L {lease.token} release:{e.reason[:30].replace(' ', '_')}")
        except Exception as e:  # noqa: BLE001
            log(error_line(e))
        armed.clear()
    await pool.aclose()


async def _crowd_main(url, pool_name, rng, end_at, log) -> None:
    n = int(os.environ.get("GPULOCK_SOAK_CROWD", "300"))
    life = os.environ.get("GPULOCK_SOAK_LIFE")
    quit_at = time.time() + rng.uniform(*map(float, life.split(","))) if life else math.inf
    clock = aioredis.Redis(
        connection_pool=aioredis.BlockingConnectionPool.from_url(
            os.environ.get("GPULOCK_SOAK_CLOCK_URL", url),
            max_connections=1,
            timeout=10,
            client_name=CLOCK_NAME,
        )
    )
    pool = AsyncPool.from_url(
        url,
        pool_name,
        capacity=100,
        default_ttl=TTL,
        waiter_ttl=WAITER_TTL,
        poll_interval=POLL,
        **OPTS,
    )
    log(f"S {(await pool.status()).epoch}")
    closing = False
    waiting: set[asyncio.Task] = set()  # the tasks inside acquire
    closed_errors = 0

    async def now_us() -> int:
        deadline = time.monotonic() + 10
        while True:
            try:
                s, us = await clock.time()
                return int(s) * 1_000_000 + int(us)
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

    async def use(lease) -> bool:
        t = await now_us()
        try:
            lease.ensure_valid()
        except LeaseLost as e:
            log(f"L {lease.token} {e.reason[:40].replace(' ', '_')}")
            return False
        log(f"U {lease.token} {lease.amount} {t}")
        return True

    async def one(seed: float) -> None:
        nonlocal closed_errors
        r = random.Random(seed)
        me = asyncio.current_task()
        while not closing:
            waiting.add(me)
            try:
                lease = await pool.acquire(r.randint(1, 4), timeout=None)
            except PoolClosed:
                closed_errors += 1
                return
            except Exception as e:  # noqa: BLE001 - every unexpected error is logged and fails the test
                log(error_line(e))
                continue
            finally:
                waiting.discard(me)
            log(f"G {lease.token} {lease.amount} {lease.id}")
            if await use(lease):
                await asyncio.sleep(r.choice((0.0, r.uniform(0, 0.005), r.uniform(0, 0.03))))
                await use(lease)
            try:
                await lease.release()
            except LeaseLost as e:
                log(f"L {lease.token} release:{e.reason[:30].replace(' ', '_')}")
            except PoolClosed:
                pass  # the pool object was closed during the hold (the quit below): the lease expires
            except Exception as e:  # noqa: BLE001
                log(error_line(e))

    tasks = [asyncio.create_task(one(rng.random())) for _ in range(n)]
    while time.time() < min(end_at(), quit_at):
        await asyncio.sleep(0.05)
    closing = True
    if quit_at < end_at():
        # A client that goes away with its acquires waiting: closing the pool object ends
        # each of them with PoolClosed, and their places leave the queue.
        pending = len(waiting)
        await pool.aclose()
        await asyncio.wait(tasks, timeout=30)
        log(f"Q {pending} {closed_errors}")
    else:
        for t in list(waiting):  # the end: the waiting acquires are cancelled (they withdraw),
            t.cancel()  # the holders finish their cycle and release
        await asyncio.wait(tasks, timeout=30)
        await pool.aclose()
    for t in tasks:
        t.cancel()
    # Best effort, as AsyncPool.aclose's own client: redis-py raises TimeoutError when a
    # socket's close is not confirmed within socket_connect_timeout (a loaded machine).
    with contextlib.suppress(redis.RedisError, OSError):
        await clock.aclose()


if __name__ == "__main__":
    main()
