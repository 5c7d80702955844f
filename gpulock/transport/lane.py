"""The short path of a script call: one command, on one of redis-py's own connections, sent as
pre-encoded bytes and read back with the connection's own parser.

A redis-py call spends more of an uncontended round trip in the client than in Redis (the
connection pool's lock and socket health check on every checkout, argument checks, the
observability hooks; with ``redis.asyncio`` also a task per write): measured in
docs/BENCHMARKS.md, section 9. A lane keeps up to ``keep``
connections it took from the client's pool at hand between calls, so a call pays none of that,
and gives every other connection back. It never opens a connection of its own, so the client's
``max_connections`` still bounds them all.

The rules that make that safe:

* a connection goes back to the lane (or the pool) only with nothing left to read: after a
  reply or a Redis error reply; after any other exception (a timeout, a dropped connection, a
  cancellation or KeyboardInterrupt in the middle of a read) it is disconnected first;
* it keeps redis-py's behaviour around a call: the connection's ``Retry`` (none with the
  clients gpulock makes) and its health check (a PING after ``health_check_interval`` idle);
* after a fork the child never touches the parent's connections;
* :meth:`drop_idle` closes the connections at hand; a connection error does it too (if Redis
  restarted, they are all dead, and each would fail one later call).

A cluster client has no single connection pool: gpulock's calls on it go on the lane of the
node that serves their slot (:mod:`gpulock.transport.shards`).
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

__all__ = ["AsyncLane", "SyncLane", "async_lane", "encode", "encode_args", "sync_lane"]


def _bulk(w: Any) -> bytes:
    if isinstance(w, str):
        b = w.encode()
    elif isinstance(w, bytes):
        b = w
    elif isinstance(w, int):
        b = str(w).encode()
    else:
        raise TypeError(f"a command word is str, bytes or int, not {type(w).__name__}")
    return b"$%d\r\n%s\r\n" % (len(b), b)


def encode(words: Sequence[Any]) -> bytes:
    """``words`` (str, bytes or int) as one RESP command: an array of bulk strings."""
    return b"*%d\r\n" % len(words) + encode_args(words)


def encode_args(words: Sequence[Any]) -> bytes:
    """``words`` as consecutive RESP bulk strings (no array header). All-ASCII text (what
    gpulock's scripts take: ids, numbers, JSON written with ``ensure_ascii``) is encoded in
    one step, since its length in characters is its length in bytes."""
    parts = [f"${len(w)}\r\n{w}\r\n" for w in words if type(w) is str]
    if len(parts) == len(words):
        text = "".join(parts)
        if text.isascii():
            return text.encode()
    return b"".join(map(_bulk, words))


def _keep(pool: Any) -> int:
    """How many connections a lane keeps at hand: a quarter of the client's cap (at most 4),
    so that the pool always has connections left for everyone else on the client (its
    pub/sub connection, the caller's own commands); none under a cap of 4."""
    cap = getattr(pool, "max_connections", None) or 16
    return max(0, min(4, int(cap) // 4))


_LANES: weakref.WeakSet[Any] = weakref.WeakSet()  # every lane of this process


def _forget_in_child() -> None:
    """In a forked child: no lane may use the parent's connections (they are the parent's
    sockets); each starts empty, and takes its own from its pool (redis-py's pools make new
    connections in a child)."""
    for lane in list(_LANES):
        lane.idle = []


os.register_at_fork(after_in_child=_forget_in_child)


def _roundtrip(conn: Any, packed: bytes) -> Any:
    conn.send_packed_command((packed,))
    return conn.read_response()


class SyncLane:
    """The short path on ``pool`` (a ``redis.ConnectionPool``; see the module docstring)."""

    def __init__(self, pool: Any):
        self.pool = pool
        self.keep = _keep(pool)
        self.idle: list[Any] = []
        _LANES.add(self)

    def _take(self) -> Any:
        try:
            return self.idle.pop()  # atomic under the GIL: threads share a lane
        except IndexError:
            return self.pool.get_connection()

    def _give(self, conn: Any) -> None:
        if len(self.idle) < self.keep:
            self.idle.append(conn)
        else:
            self.pool.release(conn)

    def execute(self, packed: bytes) -> Any:
        """Send ``packed`` (:func:`encode`) and return the reply. Raises what redis-py raises
        for the call (a ``ResponseError`` for an error reply; ``ConnectionError``, ...)."""
        conn = self._take()
        try:
            if conn.retry.get_retries():
                reply = conn.retry.call_with_retry(
                    lambda: _roundtrip(conn, packed), lambda _e: conn.disconnect()
                )
            else:
                conn.send_packed_command((packed,))
                reply = conn.read_response()
        except ResponseError:
            self._give(conn)  # the error reply was read whole
            raise
        except BaseException as e:
            conn.disconnect()  # unknown state: a reply may be left half read
            self.pool.release(conn)
            if isinstance(e, RedisConnectionError):
                self.drop_idle()  # Redis went away or restarted: those are dead too
            raise
        self._give(conn)
        return reply

    def execute_many(self, packed: Sequence[bytes]) -> list[Any]:
        """As :meth:`AsyncLane.execute_many`."""
        conn = self._take()
        out: list[Any] = []
        try:
            conn.send_packed_command((b"".join(packed),))
            for _ in packed:
                try:
                    out.append(conn.read_response())
                except ResponseError as e:
                    out.append(e)
        except BaseException as e:
            conn.disconnect()
            self.pool.release(conn)
            if isinstance(e, RedisConnectionError):
                self.drop_idle()
            raise
        self._give(conn)
        return out

    def drop_idle(self) -> None:
        """Close the connections at hand and give them back to the pool."""
        idle, self.idle = self.idle, []
        for conn in idle:
            try:
                conn.disconnect()
            finally:
                self.pool.release(conn)


async def _asend(conn: Any, packed: bytes) -> None:
    """``packed`` sent on ``conn`` (a ``redis.asyncio`` connection). A connected connection
    whose health check is not due gets the bytes written straight to its stream:
    ``send_packed_command`` would wrap even a write the kernel takes at once in
    ``asyncio.wait_for`` (a task and a loop iteration per call, with ``socket_timeout`` set);
    a write the kernel did not take whole waits for the stream to drain as it would."""
    w = getattr(conn, "_writer", None)
    hc = conn.health_check_interval
    if (
        w is None
        or w.is_closing()
        or (hc and asyncio.get_running_loop().time() > conn.next_health_check)
    ):
        await conn.send_packed_command(packed)  # connects, checks health
    else:
        w.write(packed)
        if w.transport.get_write_buffer_size():
            await conn.send_packed_command(b"")  # drains, within socket_timeout


def _closed_under(e: BaseException) -> RedisConnectionError | None:
    """The error to raise when a connection was closed by someone else in the middle of a
    call, or while it was being opened: redis-py's asyncio connection then fails on its own
    vanished stream (an AttributeError on ``None``; ``disconnect`` ran in another task, as when
    the client is closed)."""
    if isinstance(e, AttributeError) and "'NoneType'" in str(e):
        return RedisConnectionError(f"the connection was closed under the call ({e})")
    return None


async def _aroundtrip(conn: Any, packed: bytes) -> Any:
    """``packed`` sent (:func:`_asend`) and its reply read on ``conn``."""
    await _asend(conn, packed)
    return await conn.read_response()


class AsyncLane:
    """The short path on ``pool`` (a ``redis.asyncio.ConnectionPool``), in one event loop."""

    def __init__(self, pool: Any):
        self.pool = pool
        self.keep = _keep(pool)
        self.idle: list[Any] = []
        _LANES.add(self)

    async def execute(self, packed: bytes) -> Any:
        """As :meth:`SyncLane.execute`; a cancellation disconnects the connection it used."""
        conn = self.idle.pop() if self.idle else await self._take()
        try:
            if conn.retry.get_retries():

                async def fail(_e: BaseException) -> None:
                    await conn.disconnect()

                reply = await conn.retry.call_with_retry(lambda: _aroundtrip(conn, packed), fail)
            else:
                await _asend(conn, packed)
                reply = await conn.read_response()
        except ResponseError:
            await self._give(conn)
            raise
        except BaseException as e:
            closed = _closed_under(e)
            try:
                await conn.disconnect(nowait=True)
            finally:
                await self.pool.release(conn)
            if isinstance(e, RedisConnectionError) or closed:
                await self.drop_idle()  # Redis went away or restarted: those are dead too
            if closed:
                raise closed from e
            raise
        if len(self.idle) < self.keep:
            self.idle.append(conn)
        else:
            await self.pool.release(conn)
        return reply

    async def execute_many(self, packed: Sequence[bytes]) -> list[Any]:
        """Send the commands ``packed`` in one write and read their replies in order: a list
        with each reply, or the ``ResponseError`` of each error reply. A connection error or
        a cancellation fails them all (none retried here: each caller retries by its own
        rules)."""
        conn = await self._take()
        out: list[Any] = []
        try:
            await _asend(conn, b"".join(packed))
            for _ in packed:
                try:
                    out.append(await conn.read_response())
                except ResponseError as e:
                    out.append(e)
        except BaseException as e:
            closed = _closed_under(e)
            try:
                await conn.disconnect(nowait=True)
            finally:
                await self.pool.release(conn)
            if isinstance(e, RedisConnectionError) or closed:
                await self.drop_idle()
            if closed:
                raise closed from e
            raise
        await self._give(conn)
        return out

    async def _take(self) -> Any:
        if self.idle:
            return self.idle.pop()
        try:
            return await self.pool.get_connection()
        except AttributeError as e:
            closed = _closed_under(e)
            if closed is None:
                raise
            raise closed from e

    async def _give(self, conn: Any) -> None:
        if len(self.idle) < self.keep:
            self.idle.append(conn)
        else:
            await self.pool.release(conn)

    async def drop_idle(self) -> None:
        """Close the connections at hand and give them back to the pool."""
        idle, self.idle = self.idle, []
        for conn in idle:
            try:
                await conn.disconnect(nowait=True)
            finally:
                await self.pool.release(conn)


#: The attribute of a redis-py connection pool that holds its lane (a lane is made on first
#: use and lives as long as its pool; a weak mapping would keep the pool alive, since the lane
#: refers to it).
_ATTR = "_gpulock_lane"


def sync_lane(client: Any) -> SyncLane | None:
    """The lane of a ``redis.Redis`` (one per connection pool); None for a cluster client."""
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return None
    lane = getattr(pool, _ATTR, None)
    if not isinstance(lane, SyncLane):
        lane = SyncLane(pool)
        setattr(pool, _ATTR, lane)
    return lane


def async_lane(client: Any) -> AsyncLane | None:
    """The lane of a ``redis.asyncio.Redis`` (one per connection pool); None for a cluster
    client."""
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return None
    lane = getattr(pool, _ATTR, None)
    if not isinstance(lane, AsyncLane):
        lane = AsyncLane(pool)
        setattr(pool, _ATTR, lane)
    return lane
