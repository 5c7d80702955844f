"""Worker processes for ``benchmarks/peers.py`` (run as ``python benchmarks/_peer_workers.py
worker KIND ARGS_JSON``): the Python subjects of the side-by-side benchmark, speaking the line
protocol of ``benchmarks/_util.py`` (the harness writes a command, the worker answers one JSON
line; nothing else goes to stdout). ``benchmarks/node/bench.js`` speaks the same protocol for
redis-semaphore.

Kinds:
    chain        N participants of one subject in a chain of capacity 1: acquire, note the time,
                 hold hold_ms, release (noting the times around release), queue again once
                 another participant took the lock (see Turn). After "stall"
                 the next participant to acquire holds for good, so the others only wait (for
                 the commands-per-second-of-waiting window). "dump": the records, then exit.
    fair         gpulock participants of mixed sizes on a weighted pool, each holding hold_ms.
    holder       acquire once with a short expiry, report, then idle until SIGKILLed.
    waiter       on "q": acquire (queued behind a holder), report the grant time, release.
    kept-holder  (benchmarks/keep.py) on "hold": a gpulock pool object (``shell`` async or
                 sync, ``keep`` seconds) acquires ``amount`` and releases it at once: with
                 keep on the bytes stay kept, idle, in this process; report the token.

Subjects: ``gpulock-async`` (AsyncPool tasks), ``gpulock-sync`` (Pool threads), ``redislock``
(python-redis-lock, threads), ``redispy`` (redis-py's Lock, threads), ``asyncio-sem``
(asyncio.Semaphore, tasks of one process: no Redis at all).

A record is ``[participant, t_call, t_grant, t_release_call, t_release_return, token]`` in
``time.monotonic()`` seconds (CLOCK_MONOTONIC: one clock for every process on Linux); token is
-1 where the subject has none. A holder that stalls records None for its release times.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import _die_with_parent, _emit, mono  # noqa: E402


def _stdin_lines_async(loop: asyncio.AbstractEventLoop):
    return loop.run_in_executor(None, sys.stdin.readline)


class Turn:
    """Who took the lock last: a 4-byte int in a file under /dev/shm that every participant of
    a chain maps (Python here, Node in bench.js). A participant that released queues again
    only once someone else has taken the lock, so a library without a queue cannot hand the
    lock straight back to its releaser (which would otherwise win every race against waiters
    that poll, and the chain would measure re-acquisition instead of hand-offs). No Redis
    command is involved."""

    def __init__(self, path: str):
        import mmap

        self._f = open(path, "r+b")
        self._mm = mmap.mmap(self._f.fileno(), 4)

    def took(self, pi: int) -> None:
        self._mm[0:4] = pi.to_bytes(4, "little", signed=True)

    def last(self) -> int:
        return int.from_bytes(self._mm[0:4], "little", signed=True)


# ---- chains --------------------------------------------------------------------------------


async def _chain_async(a: dict) -> None:
    """gpulock AsyncPool or asyncio.Semaphore participants, all in this process's loop."""
    subject = a["subject"]
    recs: list[list] = []
    delivered: dict[int, float] = {}
    state = {"stall": False}
    hold_forever = asyncio.Event()
    if subject == "gpulock-async":
        from gpulock import AsyncPool

        pool = AsyncPool.from_url(a["url"], a["pool"])
        # Where a hand-off's time goes: note when the pool's listener hands each grant to its
        # waiter (gpulock's WaiterRegistry.deliver), to split "release returns -> acquire
        # returns" into the pub/sub leg and gpulock's own continuation. A dict insert per grant.
        rt = pool._runtime.registry
        inner_deliver = rt.deliver

        def deliver(grant, _inner=inner_deliver):
            delivered[grant.token] = mono()
            return _inner(grant)

        rt.deliver = deliver

        async def take():
            lease = await pool.acquire(1, ttl=a.get("ttl", 30.0))
            return lease, lease.token

        async def give(lease):
            await lease.release()
    else:  # asyncio-sem
        sem = asyncio.Semaphore(1)

        async def take():
            await sem.acquire()
            return None, -1

        async def give(_):
            sem.release()

    turn = Turn(a["turn"])
    hold = a["hold_ms"] / 1000

    async def participant(pi: int) -> None:
        while True:
            t_call = mono()
            lease, tok = await take()
            tg = mono()
            turn.took(pi)
            if state["stall"]:
                recs.append([pi, t_call, tg, None, None, tok])
                await hold_forever.wait()
            await asyncio.sleep(hold)
            t0 = mono()
            await give(lease)
            tr = mono()
            recs.append([pi, t_call, tg, t0, tr, tok])
            while turn.last() == pi:
                await asyncio.sleep(0.0002)

    loop = asyncio.get_running_loop()
    _emit({"ready": os.getpid()})
    line = await _stdin_lines_async(loop)
    assert line.strip() == "go", line
    tasks = [loop.create_task(participant(a["base"] + i)) for i in range(a["n"])]
    while True:
        line = (await _stdin_lines_async(loop)).strip()
        if line == "stall":
            state["stall"] = True
            _emit({"stalled": True})
            continue
        break
    errs = [repr(t.exception()) for t in tasks if t.done() and not t.cancelled() and t.exception()]
    _emit(
        {
            "recs": list(recs),
            "errors": errs[:5],
            "delivered": {str(k): v for k, v in delivered.items()},
        }
    )
    os._exit(0)


def _chain_threads(a: dict) -> None:
    """gpulock Pool, python-redis-lock or redis-py Lock participants, one thread each."""
    subject = a["subject"]
    recs: list[list] = []
    errs: list[str] = []
    state = {"stall": False}
    if subject == "gpulock-sync":
        from gpulock import Pool

        pool = Pool.from_url(a["url"], a["pool"])

        def make():
            def take():
                lease = pool.acquire(1, ttl=a.get("ttl", 30.0))
                return lease, lease.token

            return take, lambda lease: lease.release()
    elif subject == "redislock":
        import redis
        import redis_lock

        conn = redis.Redis.from_url(a["url"], **a.get("client_kw", {}))

        def make():
            lock = redis_lock.Lock(conn, a["pool"], **a.get("opts", {}))  # defaults: expire=None

            def take():
                lock.acquire(blocking=True)
                return None, -1

            return take, lambda _: lock.release()
    elif subject == "redispy":
        import redis

        conn = redis.Redis.from_url(a["url"], **a.get("client_kw", {}))

        def make():
            lock = conn.lock(a["pool"], **a.get("opts", {}))  # defaults: timeout=None, sleep=0.1

            def take():
                lock.acquire(blocking=True)
                return None, -1

            return take, lambda _: lock.release()
    else:
        raise SystemExit(f"unknown thread subject {subject!r}")

    turn = Turn(a["turn"])
    hold = a["hold_ms"] / 1000

    def participant(pi: int) -> None:
        take, give = make()
        try:
            while True:
                t_call = mono()
                lease, tok = take()
                tg = mono()
                turn.took(pi)
                if state["stall"]:
                    recs.append([pi, t_call, tg, None, None, tok])
                    threading.Event().wait()
                time.sleep(hold)
                t0 = mono()
                give(lease)
                tr = mono()
                recs.append([pi, t_call, tg, t0, tr, tok])
                while turn.last() == pi:
                    time.sleep(0.0002)
        except Exception as e:  # pragma: no cover - reported to the harness
            errs.append(repr(e))

    _emit({"ready": os.getpid()})
    assert sys.stdin.readline().strip() == "go"
    for i in range(a["n"]):
        threading.Thread(target=participant, args=(a["base"] + i,), daemon=True).start()
    while True:
        line = sys.stdin.readline().strip()
        if line == "stall":
            state["stall"] = True
            _emit({"stalled": True})
            continue
        break
    _emit({"recs": list(recs), "errors": errs[:5]})
    os._exit(0)


# ---- fairness under mixed sizes -------------------------------------------------------------


async def _fair_gpulock(a: dict) -> None:
    from gpulock import AsyncPool

    pool = AsyncPool.from_url(a["url"], a["pool"])
    recs: list[list] = []
    pending: dict[int, list] = {}
    stop = asyncio.Event()

    async def participant(pi: int, size: int) -> None:
        while not stop.is_set():
            t_call = mono()
            pending[pi] = [t_call, size]
            lease = await pool.acquire(size, ttl=30.0)
            tg = mono()
            pending.pop(pi, None)
            await asyncio.sleep(a["hold_ms"] / 1000)
            t0 = mono()
            await lease.release()
            recs.append([pi, size, t_call, tg, t0])

    loop = asyncio.get_running_loop()
    await pool.status()
    _emit({"ready": os.getpid()})
    assert (await _stdin_lines_async(loop)).strip() == "go"
    tasks = [loop.create_task(participant(a["base"] + i, s)) for i, s in enumerate(a["sizes"])]
    await _stdin_lines_async(loop)
    t_end = mono()
    errs = [repr(t.exception()) for t in tasks if t.done() and not t.cancelled() and t.exception()]
    _emit(
        {
            "recs": recs,
            "pending": {str(k): v for k, v in pending.items()},
            "t_end": t_end,
            "errors": errs[:5],
        }
    )
    os._exit(0)


# ---- crash reclaim --------------------------------------------------------------------------


def _lock_for(a: dict):
    import redis

    conn = redis.Redis.from_url(a["url"], **a.get("client_kw", {}))
    if a["subject"] == "redislock":
        import redis_lock

        return conn, lambda: redis_lock.Lock(conn, a["pool"], **a.get("opts", {}))
    return conn, lambda: conn.lock(a["pool"], **a.get("opts", {}))


def _holder(a: dict) -> None:
    if a["subject"].startswith("gpulock"):
        from gpulock import Pool

        pool = Pool.from_url(a["url"], a["pool"])
        pool.status()  # connect and load scripts before "go"
        _emit({"ready": os.getpid()})
        if sys.stdin.readline().strip() != "go":
            os._exit(0)
        lease = pool.acquire(1, **a.get("opts", {}))  # heartbeated at ttl/3 until the kill
        _emit({"acquired": mono(), "identifier": lease.id})
    else:
        conn, make = _lock_for(a)
        conn.ping()
        _emit({"ready": os.getpid()})
        if sys.stdin.readline().strip() != "go":
            os._exit(0)
        lock = make()
        lock.acquire(blocking=True)
        _emit({"acquired": mono()})
    while True:
        time.sleep(3600)


def _waiter(a: dict) -> None:
    if a["subject"].startswith("gpulock"):
        from gpulock import Pool

        pool = Pool.from_url(a["url"], a["pool"])
        pool.status()

        def make():
            class _L:
                def acquire(self, blocking=True):
                    self.lease = pool.acquire(
                        1, **a.get("opts", {})
                    )  # timeout=None: waits for good

                def release(self):
                    self.lease.release()

            return _L()
    else:
        conn, make = _lock_for(a)
        conn.ping()
    _emit({"ready": os.getpid()})
    while True:
        if sys.stdin.readline().strip() != "q":
            os._exit(0)
        lock = make()
        _emit({"queued": mono()})
        lock.acquire(blocking=True)
        _emit({"granted": mono()})
        lock.release()
        _emit({"released": True})


def _kept_holder(a: dict) -> None:
    """See "kept-holder" above. One JSON line per "hold": ``{"token"}`` (the lease's fencing
    token), or ``{"error"}``; any other line ends it."""
    from gpulock import AsyncPool, Pool

    if a["shell"] == "sync":
        pool = Pool.from_url(a["url"], a["pool"], keep=a["keep"])
        pool.status()  # connect, load the scripts and start the listener before the first hold
        _emit({"ready": os.getpid()})
        while sys.stdin.readline().strip() == "hold":
            try:
                lease = pool.acquire(a["amount"], timeout=10)
                token = lease.token
                lease.release()
                _emit({"token": token})
            except Exception as e:  # reported to the harness
                _emit({"error": repr(e)})
        os._exit(0)

    async def main() -> None:
        apool = AsyncPool.from_url(a["url"], a["pool"], keep=a["keep"])
        await apool.status()
        loop = asyncio.get_running_loop()
        _emit({"ready": os.getpid()})
        while (await _stdin_lines_async(loop)).strip() == "hold":
            try:
                lease = await apool.acquire(a["amount"], timeout=10)
                token = lease.token
                await lease.release()
                _emit({"token": token})
            except Exception as e:  # reported to the harness
                _emit({"error": repr(e)})
        os._exit(0)

    asyncio.run(main())


def worker_main(kind: str, args_json: str) -> None:
    _die_with_parent()
    a = json.loads(args_json)
    if kind == "chain":
        if a["subject"] in ("gpulock-async", "asyncio-sem"):
            asyncio.run(_chain_async(a))
        else:
            _chain_threads(a)
    elif kind == "fair":
        asyncio.run(_fair_gpulock(a))
    elif kind == "holder":
        _holder(a)
    elif kind == "waiter":
        _waiter(a)
    elif kind == "kept-holder":
        _kept_holder(a)
    else:
        raise SystemExit(f"unknown worker kind {kind!r}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "worker":
        worker_main(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(
            "usage: _peer_workers.py worker KIND ARGS_JSON (spawned by benchmarks/peers.py)"
        )
