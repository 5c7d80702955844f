"""Load on a pool per master of a cluster from one process and one client, for the cluster fault
tests: two workers per pool loop ``acquire(60 of 100, timeout=30)`` → 10 ms → ``release()``
(one holds while the other waits: grants are handed off), and record when each grant came and
what each call raised. ``shell`` "async": ``AsyncPool`` objects on one ``redis.asyncio`` cluster
client, in an event loop of a thread of their own; "sync": ``Pool`` objects on one sync cluster
client, a thread per worker; "broker": the SDK's ``gpulock_client.Pool`` objects on a broker
(``url`` is the broker's, ``token`` a bearer token), a thread per worker."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from gpulock import AsyncPool, Pool
from gpulock._async import _CLIENT_DEFAULTS
from gpulock.transport.connect import async_client, sync_client

AMOUNT, CAPACITY, HOLD_S = 60, 100, 0.01


class ShardLoad:
    """See the module docstring. ``grants[name]``: monotonic times; ``errors``: (name, repr)."""

    def __init__(self, url: str, names: list[str], shell: str, token: str | None = None):
        assert shell in ("async", "sync", "broker"), shell
        self.url, self.names, self.shell, self.token = url, list(names), shell, token
        self.grants: dict[str, list[float]] = {n: [] for n in names}
        self.errors: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pools: dict[str, Any] = {}
        self._ready = threading.Event()

    # ---- running -------------------------------------------------------------------------
    def start(self, extra: list[str] = ()) -> ShardLoad:  # type: ignore[assignment]
        """Start the workers; ``extra``: more pools made on the same client, without load."""
        if self.shell == "async":
            t = threading.Thread(target=self._run_async, args=(list(extra),), daemon=True)
            self._threads.append(t)
            t.start()
            assert self._ready.wait(30), "the async load did not start"
        else:
            if self.shell == "broker":
                import gpulock_client

                for n in [*self.names, *extra]:
                    self.pools[n] = gpulock_client.Pool(self.url, n, token=self.token)
            else:
                client = sync_client(self.url, **_CLIENT_DEFAULTS)
                for n in [*self.names, *extra]:
                    self.pools[n] = Pool(client, n)
            for n in self.names:
                for _ in range(2):
                    t = threading.Thread(target=self._sync_worker, args=(n,), daemon=True)
                    self._threads.append(t)
                    t.start()
        deadline = time.monotonic() + 30
        while not all(self.grants[n] for n in self.names):
            assert time.monotonic() < deadline, f"no grants yet: {self.errors[:3]}"
            time.sleep(0.01)
        return self

    def _run_async(self, extra: list[str]) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            client = async_client(self.url, **_CLIENT_DEFAULTS)
            for n in [*self.names, *extra]:
                self.pools[n] = AsyncPool(client, n)
            tasks = [asyncio.create_task(self._async_worker(n)) for n in self.names for _ in "ab"]
            self._ready.set()
            while not self._stop.is_set():
                await asyncio.sleep(0.02)
            await asyncio.gather(*tasks, return_exceptions=True)
            for p in self.pools.values():
                await p.aclose()
            await client.aclose()

        asyncio.run(main())

    async def _async_worker(self, name: str) -> None:
        p = self.pools[name]
        while not self._stop.is_set():
            try:
                lease = await p.acquire(AMOUNT, ttl=10, timeout=30)
                self.grants[name].append(time.monotonic())
                await asyncio.sleep(HOLD_S)
                await lease.release()
            except Exception as e:  # noqa: BLE001 - recorded: the test asserts there is none
                self.errors.append((name, repr(e)))
                await asyncio.sleep(0.05)

    def _sync_worker(self, name: str) -> None:
        p = self.pools[name]
        while not self._stop.is_set():
            try:
                lease = p.acquire(AMOUNT, ttl=10, timeout=30)
                self.grants[name].append(time.monotonic())
                time.sleep(HOLD_S)
                lease.release()
            except Exception as e:  # noqa: BLE001 - recorded: the test asserts there is none
                self.errors.append((name, repr(e)))
                time.sleep(0.05)

    def run(self, fn: Any, timeout: float = 60.0) -> Any:
        """``fn(pool objects by name)`` on the load's side: awaited in its loop when it is a
        coroutine function (async shell), else called here."""
        if self.shell == "async":
            assert self.loop is not None
            fut = asyncio.run_coroutine_threadsafe(fn(self.pools), self.loop)
            return fut.result(timeout)
        return fn(self.pools)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        if self.shell != "async":
            for p in self.pools.values():
                p.close()

    # ---- reading -------------------------------------------------------------------------
    def count(self, name: str, t0: float, t1: float) -> int:
        """Grants of ``name`` within (t0, t1)."""
        return sum(1 for g in self.grants[name] if t0 < g < t1)

    def first_after(self, name: str, t: float) -> float | None:
        return next((g for g in self.grants[name] if g > t), None)

    def longest_gap(self, name: str, t0: float, t1: float) -> float:
        """The longest time without a grant of ``name`` within [t0, t1]."""
        pts = [t0, *(g for g in self.grants[name] if t0 < g < t1), t1]
        return max(b - a for a, b in zip(pts, pts[1:]))
