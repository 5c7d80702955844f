"""Calling the gpulock scripts of one pool on one redis-py client: the command the client's
:class:`~gpulock._dialect.Dialect` spells (``FCALL`` or ``EVALSHA``), sent on the client's
:mod:`~gpulock._lane` (a cluster client: through redis-py), and the recovery when the script
or the library is missing on the server. :class:`SyncScripts` and :class:`AsyncScripts` only
drive the I/O; what to send and what an error means is decided in ``_dialect.py``.

The command's head (``FCALL <function> 8 <the eight keys>``) is encoded once per operation and
dialect; a call encodes only its arguments.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.exceptions import ResponseError

from ._cluster import is_cluster_client
from ._cluster import ready as cluster_ready
from ._dialect import Dialect, Load, Send, dialect_of
from ._lane import async_lane, encode, encode_args, sync_lane
from ._scripts import Script, scripts

__all__ = ["AsyncScripts", "SyncScripts", "load"]


class _Heads:
    """The encoded heads of one pool's commands, by (operation, dialect)."""

    def __init__(self, keys: Sequence[str], dialect: Dialect):
        self.keys = tuple(keys)
        self.dialect = dialect
        self._heads: dict[tuple[str, bool], tuple[int, bytes]] = {}

    def words(self, sc: Script, args: Sequence[Any]) -> tuple[Any, ...]:
        return self.dialect.words(sc, self.keys, args)

    def packed(self, sc: Script, args: Sequence[Any]) -> bytes:
        """The whole command as RESP bytes (:func:`gpulock._lane.encode` of :meth:`words`)."""
        k = (sc.name, self.dialect.functions)
        head = self._heads.get(k)
        if head is None:
            w = self.dialect.words(sc, self.keys, ())
            head = self._heads[k] = (len(w), encode_args(w))
        n, body = head
        return b"*%d\r\n%s%s" % (n + len(args), body, encode_args(args))


def load(client: Any, step: Load) -> Any:
    """Carry out ``step`` on ``client`` (sync: the reply; asyncio: an awaitable of it)."""
    if step.kind == "script":
        return client.script_load(step.code)
    return client.function_load(step.code, replace=True)


class SyncScripts:
    """The scripts of the pool with ``keys`` on ``client`` (a ``redis.Redis`` or a sync
    ``RedisCluster``)."""

    def __init__(self, client: Any, keys: Sequence[str]):
        self.client = client
        self.heads = _Heads(keys, dialect_of(client))
        self.lane = sync_lane(client)
        self._scripts = scripts()

    def call(self, name: str, args: Sequence[Any]) -> Any:
        """Run operation ``name`` with ``args``: its reply. Raises what redis-py raises for
        the call (an error reply as ``ResponseError``; ``ConnectionError``, ...)."""
        sc = self._scripts[name]
        try:
            if self.lane is not None:
                return self.lane.execute(self.heads.packed(sc, args))
            return self.client.execute_command(*self.heads.words(sc, args))
        except ResponseError as e:
            return self._recover(e, sc, args)

    def _recover(self, err: ResponseError, sc: Script, args: Sequence[Any]) -> Any:
        steps = self.heads.dialect.recover(err, sc, self.heads.keys, args)
        reply: Any = None
        error: ResponseError | None = None
        while True:
            try:
                step = steps.send(reply) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value
            reply, error = None, None
            try:
                if isinstance(step, Send):
                    reply = (
                        self.lane.execute(encode(step.words))
                        if self.lane is not None
                        else self.client.execute_command(*step.words)
                    )
                else:
                    load(self.client, step)
            except ResponseError as e:
                error = e

    def drop_idle(self) -> None:
        """Close the lane's idle connections (after a connection error)."""
        if self.lane is not None:
            self.lane.drop_idle()


class AsyncScripts:
    """The scripts of the pool with ``keys`` on ``client`` (a ``redis.asyncio.Redis`` or an
    asyncio ``RedisCluster``), in one event loop. ``first``: how a call's first try is sent
    (``first(scripts, sc, args)``; the pool object's coalescing of concurrent calls,
    :class:`gpulock._batch.Batcher`); default :meth:`send`."""

    def __init__(
        self,
        client: Any,
        keys: Sequence[str],
        first: Callable[[AsyncScripts, Script, Sequence[Any]], Awaitable[Any]] | None = None,
    ):
        self.client = client
        self.heads = _Heads(keys, dialect_of(client))
        self.lane = async_lane(client)
        self.first = first
        self.cluster = is_cluster_client(client)  # once: an isinstance of it is slow
        self._scripts = scripts()

    def words(self, sc: Script, args: Sequence[Any]) -> tuple[Any, ...]:
        """The command running ``sc`` with ``args`` (for a pipeline)."""
        return self.heads.words(sc, args)

    async def send_many(self, calls: Sequence[tuple[Script, Sequence[Any]]]) -> list[Any]:
        """First tries of several calls at once, in one round trip: each reply, or the
        ``ResponseError`` of each error reply (a pipeline; on the lane when there is one).
        Raises a connection error or timeout for all of them."""
        if self.lane is not None:
            return await self.lane.execute_many([self.heads.packed(sc, a) for sc, a in calls])
        async with self.client.pipeline(transaction=False) as p:
            for sc, a in calls:
                p.execute_command(*self.heads.words(sc, a))
            replies: list[Any] = await p.execute(raise_on_error=False)
        return replies

    async def send(self, sc: Script, args: Sequence[Any]) -> Any:
        """One try of ``sc`` on its own connection: the reply, or redis-py's error."""
        if self.lane is not None:
            return await self.lane.execute(self.heads.packed(sc, args))
        return await self.client.execute_command(*self.heads.words(sc, args))

    async def call(self, name: str, args: Sequence[Any]) -> Any:
        """As :meth:`SyncScripts.call` (a cluster client reads the cluster first, once)."""
        sc = self._scripts[name]
        if self.cluster:
            await cluster_ready(self.client)
        try:
            if self.first is not None:
                return await self.first(self, sc, args)
            return await self.send(sc, args)
        except ResponseError as e:
            return await self._recover(e, sc, args)

    async def _recover(self, err: ResponseError, sc: Script, args: Sequence[Any]) -> Any:
        steps = self.heads.dialect.recover(err, sc, self.heads.keys, args)
        reply: Any = None
        error: ResponseError | None = None
        while True:
            try:
                step = steps.send(reply) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value
            reply, error = None, None
            try:
                if isinstance(step, Send):
                    reply = (
                        await self.lane.execute(encode(step.words))
                        if self.lane is not None
                        else await self.client.execute_command(*step.words)
                    )
                else:
                    await load(self.client, step)
            except ResponseError as e:
                error = e

    async def drop_idle(self) -> None:
        """Close the lane's idle connections (after a connection error)."""
        if self.lane is not None:
            await self.lane.drop_idle()
