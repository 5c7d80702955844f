"""A small TCP proxy for fault tests: one listening port ("the URL clients know") in front of
a Redis that can change.

* ``set_target(port)`` repoints it (a DNS change, a failover, Redis back on another port); by
  default the open connections are cut, as they are when the old server is gone.
* ``freeze()`` / ``thaw()`` stop and restart forwarding in both directions; bytes read meanwhile
  are held in the proxy (``drop_held()`` throws them away): a replication link that lags, or a
  peer that stops answering without closing its connections.
* ``delay`` (seconds) is added before each chunk is forwarded, in each direction: a slow Redis.

It runs an asyncio loop on a daemon thread of the test process. Not collected by pytest.
"""

from __future__ import annotations

import asyncio
import threading

from .ports import free_port


class Proxy:
    def __init__(self, target_port: int, *, host: str = "127.0.0.1", port: int | None = None):
        self.host = host
        self.port = port or free_port(host)
        self.target = (host, target_port)
        self.delay = 0.0
        self.connections = 0  # accepted so far
        self._loop = asyncio.new_event_loop()
        self._flowing: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.base_events.Server | None = None
        self._drop_epoch = 0
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="test-proxy"
        )
        self._thread.start()
        self._call(self._start())

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def _call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(
            self._handle, self.host, self.port, reuse_address=True
        )

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            await self._serve(cr, cw)
        except asyncio.CancelledError:  # closing: end quietly (asyncio logs a cancelled handler)
            cw.close()

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.connections += 1
        epoch = self._drop_epoch
        try:
            sr, sw = await asyncio.wait_for(asyncio.open_connection(*self.target), 2.0)
        except (OSError, asyncio.TimeoutError):
            cw.close()
            return
        if epoch != self._drop_epoch:  # repointed while connecting
            sw.close()
            cw.close()
            return
        self._writers.update((cw, sw))
        await asyncio.gather(
            self._pump(cr, sw, epoch), self._pump(sr, cw, epoch), return_exceptions=True
        )
        for w in (cw, sw):
            self._writers.discard(w)
            w.close()

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, epoch: int) -> None:
        """Forward r -> w. Each chunk is stamped when read and written ``delay`` seconds later
        (latency, not a throughput limit), and only while the proxy is not frozen."""
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def read() -> None:
            try:
                while True:
                    data = await r.read(65536)
                    await q.put((loop.time(), data))
                    if not data:
                        return
            except (OSError, asyncio.CancelledError):
                await q.put((loop.time(), b""))

        reader = loop.create_task(read())
        try:
            while True:
                t, data = await q.get()
                if not data:
                    break
                wait = t + self.delay - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._flowing.wait()
                if epoch != self._drop_epoch:
                    break  # held bytes of a cut connection are thrown away
                w.write(data)
                await w.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            reader.cancel()
            try:
                w.close()
            except Exception:
                pass

    # ---- controls (called from the test thread) -------------------------------------------
    def set_target(self, port: int, *, host: str | None = None, cut: bool = True) -> None:
        self.target = (host or self.host, port)
        if cut:
            self.cut()

    def cut(self) -> None:
        """Close every open connection (held bytes are dropped)."""

        async def go():
            self._drop_epoch += 1
            for w in list(self._writers):
                w.close()
            self._writers.clear()
            self._flowing.set()

        self._call(go())

    def freeze(self) -> None:
        self._loop.call_soon_threadsafe(self._flowing.clear)

    def thaw(self) -> None:
        self._loop.call_soon_threadsafe(self._flowing.set)

    def drop_held(self) -> None:
        """Throw away what a freeze held back, cutting the connections it belonged to."""
        self.cut()

    def close(self) -> None:
        if self._loop.is_closed() or not self._thread.is_alive():
            return

        async def go():
            self._drop_epoch += 1
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                w.close()
            self._flowing.set()
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self._call(go())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> "Proxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
