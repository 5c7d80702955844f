"""One holder process of the fault soak (test_holder_faults.py); run as a script.

Usage: python _soak_worker.py URL POOL OUT SEED END_AT MAX_AMOUNT FAULT_P SHELL [SCHEDULE]

Loops acquire -> hold -> release with random amounts until END_AT (a time.time() instant).
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
  E type message            an unexpected error (the test fails on any)
  B message                 BackendUnavailable while GPULOCK_SOAK_TOLERATE_BACKEND=1 (the
                            failover test: Redis is away for a moment)
SHELL is ``sync`` (Pool) or ``async`` (AsyncPool). GPULOCK_SOAK_SYNC_REPLICAS and
GPULOCK_SOAK_SYNC_TIMEOUT set the pools' sync_replicas and sync_timeout.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time

import redis

from gpulock import AsyncPool, BackendUnavailable, LeaseLost, Pool
from gpulock._protocol import new_id, pool_keys
from gpulock._scripts import scripts

OPTS = {"sync_replicas": int(os.environ.get("GPULOCK_SOAK_SYNC_REPLICAS", "0")),
        "sync_timeout": float(os.environ.get("GPULOCK_SOAK_SYNC_TIMEOUT", "1.0"))}
TOLERATE = os.environ.get("GPULOCK_SOAK_TOLERATE_BACKEND") == "1"


def error_line(e: BaseException) -> str:
    if TOLERATE and isinstance(e, BackendUnavailable):
        return f"B {str(e)[:200]!r}"
    return f"E {type(e).__name__} {str(e)[:200]!r}"

PLANS = ["kill_queued", "stop_queued", "kill_inflight", "stop_inflight", "kill_holding", "stop_holding",
         "kill_release", "stop_release"]
TTL, WAITER_TTL, POLL = 1.0, 1.0, 0.25


def main() -> None:
    url, pool_name, out, seed, end_at, max_amount, fault_p, shell = sys.argv[1:9]
    pending = [p for p in (sys.argv[9] if len(sys.argv) > 9 else "").split(",") if p]
    assert set(pending) <= set(PLANS), pending
    queue_key = pool_keys(pool_name)[3]
    rng = random.Random(int(seed))
    end_at, max_amount, fault_p = float(end_at), int(max_amount), float(fault_p)
    clock = redis.Redis.from_url(url)
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
        return rng.choice((0.0, 0.0, rng.uniform(0, 0.003), rng.uniform(0, 0.03), rng.uniform(0.1, 0.3)))

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

    if shell == "sync":
        pool = Pool.from_url(url, pool_name, capacity=100, default_ttl=TTL, waiter_ttl=WAITER_TTL,
                             poll_interval=POLL, **OPTS)
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
                return conn.read_response()
            finally:
                pool.redis.connection_pool.release(conn)

        pool._eval_once = eval_once
        cycle = 0
        while time.time() < end_at:
            cycle += 1
            plan = pick() if cycle > 1 else None  # the first cycle loads the scripts
            amount = rng.randint(1, max_amount)
            if plan in ("kill_inflight", "stop_inflight"):
                armed["acquire"] = plan
            ticket = new_id()
            try:
                lease = pool.acquire(amount, timeout=30, request_id=ticket, on_queued=queued_fault(plan, ticket))
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
        asyncio.run(_async_main(url, pool_name, rng, end_at, max_amount, pick, fault, queued_fault, log, use,
                                hold_time, armed))
    f.close()
    clock.close()


async def _async_main(url, pool_name, rng, end_at, max_amount, pick, fault, queued_fault, log, use, hold_time,
                      armed) -> None:
    pool = AsyncPool.from_url(url, pool_name, capacity=100, default_ttl=TTL, waiter_ttl=WAITER_TTL,
                              poll_interval=POLL, **OPTS)
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
            return await conn.read_response()
        finally:
            await pool.redis.connection_pool.release(conn)

    pool._eval_once = eval_once
    cycle = 0
    while time.time() < end_at:
        cycle += 1
        plan = pick() if cycle > 1 else None
        amount = rng.randint(1, max_amount)
        if plan in ("kill_inflight", "stop_inflight"):
            armed["acquire"] = plan
        ticket = new_id()
        try:
            lease = await pool.acquire(amount, timeout=30, request_id=ticket, on_queued=queued_fault(plan, ticket))
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


if __name__ == "__main__":
    main()
