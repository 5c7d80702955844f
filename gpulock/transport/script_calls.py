"""Calling the gpulock scripts of one pool on one redis-py client: the command the client's
:class:`~gpulock.transport.dialect.Dialect` spells (``FCALL`` or ``EVALSHA``), sent on the client's
:mod:`~gpulock.transport.lane`, and the recovery when the script or the library is missing on the
server. A cluster client's calls go to the pool's shard alone (:mod:`gpulock.transport.shards`), on
the lane of the master that serves the pool's slot. :class:`SyncScripts` and
:class:`AsyncScripts` only drive the I/O; what to send and what an error means is decided in
``transport/dialect.py`` and ``transport/route.py``.

The command's head (``FCALL <function> 8 <the eight keys>``) is encoded once per operation and
dialect; a call encodes only its arguments.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Union

from redis.exceptions import AuthenticationError, ResponseError

from gpulock_common.driver import adrive, drive

from gpulock.transport.retry import retrying
from gpulock.transport.dialect import Dialect, Load, Send, dialect_of
from gpulock.transport.lane import AsyncLane, SyncLane, async_lane, encode, encode_args, sync_lane
from gpulock.transport.route import ShardUnavailable, is_shard_error
from gpulock.transport.scripts import Script, scripts
from gpulock.transport.shards import (
    ASKING,
    SyncShards,
    batch_replies,
    batch_words,
    shards_of,
    slot_of,
)
from gpulock.transport.shards_async import AsyncShards

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
        """The whole command as RESP bytes (:func:`gpulock.transport.lane.encode` of :meth:`words`)."""
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


def _load_words(step: Load) -> tuple[str, ...]:
    if step.kind == "script":
        return ("SCRIPT", "LOAD", step.code)
    return ("FUNCTION", "LOAD", "REPLACE", step.code)


# ---- the synced renewal, without I/O --------------------------------------------------------
@dataclass(frozen=True)
class Batch:
    """Send ``commands`` (each a tuple of words) on one connection, in order: the replies
    come back as a list, an error reply as its ``ResponseError``."""

    commands: tuple[tuple[Any, ...], ...]


def synced_renew(
    dialect: Dialect,
    sc: Script,
    keys: Sequence[str],
    args: Sequence[Any],
    replicas: int,
    timeout_ms: int,
    sync_key: str,
) -> Generator[Union[Batch, Load], Any, tuple[Any, int]]:
    """``renew`` of ``args``, an INCR of the pool's sync counter ``sync_key`` and ``WAIT
    replicas timeout_ms``, on one connection: WAIT waits for the connection's last write; a
    renewal that changes no expiry (same millisecond) replicates nothing, and the INCR comes
    later in the replication stream than the grant and the renewal, so its acknowledgement
    covers both. Loads missing code and tries again, at most twice. Returns ``(renew reply,
    replicas that acknowledged)``; raises the first other error among the replies."""
    for attempt in range(3):
        res = yield Batch(
            (
                dialect.words(sc, keys, args),
                ("INCR", sync_key),
                ("WAIT", replicas, timeout_ms),
            )
        )
        first = res[0]
        if isinstance(first, Exception) and dialect.is_missing(first) and attempt < 2:
            step = dialect.fix(first, sc)
            if step is not None:
                try:
                    yield step
                except ResponseError as e:
                    if not dialect.load_failed(step, e):
                        raise
            continue
        for x in res:
            if isinstance(x, Exception):
                raise x
        return res[0], int(res[2])
    raise AssertionError("unreachable")


def _unless_shard(e: BaseException) -> BaseException | None:
    """What a recovery's driver throws into its steps: ``e``, but for a shard's error (a
    redirect, TRYAGAIN, CLUSTERDOWN), which propagates to the cluster route instead (None)."""
    return None if is_shard_error(e) else e


def _one(replies: list[Any]) -> Any:
    r = replies[-1]
    if isinstance(r, BaseException):
        raise r
    return r


# ---- the sync driver ------------------------------------------------------------------------
class SyncScripts:
    """The scripts of the pool with ``keys`` on ``client`` (a ``redis.Redis`` or a sync
    ``RedisCluster``)."""

    def __init__(self, client: Any, keys: Sequence[str]):
        self.client = client
        self.heads = _Heads(keys, dialect_of(client))
        self.lane = sync_lane(client)
        self.shards: SyncShards | None = shards_of(client)  # type: ignore[assignment]
        self.slot = slot_of(keys[0]) if keys else 0
        self._scripts = scripts()

    def call(self, name: str, args: Sequence[Any]) -> Any:
        """Run operation ``name`` with ``args``: its reply. Raises what redis-py raises for
        the call (an error reply as ``ResponseError``; ``ConnectionError``, ...; on a
        cluster, :class:`~gpulock.transport.route.ShardUnavailable` for what the caller should retry)."""
        sc = self._scripts[name]
        if self.shards is not None:
            return self.shards.call(
                self.slot, lambda lane, asking: self._on(lane, asking, sc, args)
            )
        try:
            if self.lane is not None:
                return self.lane.execute(self.heads.packed(sc, args))
            return self.client.execute_command(*self.heads.words(sc, args))
        except ResponseError as e:
            return self._recover(e, sc, args, self._send, lambda step: load(self.client, step))

    def _send(self, words: tuple[Any, ...]) -> Any:
        if self.lane is not None:
            return self.lane.execute(encode(words))
        return self.client.execute_command(*words)

    def _on(self, lane: SyncLane, asking: bool, sc: Script, args: Sequence[Any]) -> Any:
        """One try on a cluster node's ``lane`` (after ``ASKING`` when ``asking``), loading
        the code there when it is missing."""

        def send(packed: bytes) -> Any:
            return _one(lane.execute_many([ASKING, packed])) if asking else lane.execute(packed)

        try:
            return send(self.heads.packed(sc, args))
        except ResponseError as e:
            if is_shard_error(e):
                raise
            return self._recover(
                e,
                sc,
                args,
                lambda w: send(encode(w)),
                lambda s: lane.execute(encode(_load_words(s))),
            )

    def _recover(
        self,
        err: ResponseError,
        sc: Script,
        args: Sequence[Any],
        send: Callable[[tuple[Any, ...]], Any],
        do_load: Callable[[Load], Any],
    ) -> Any:
        def do_step(step: Send | Load) -> Any:
            if isinstance(step, Send):
                return send(step.words)
            do_load(step)
            return None

        steps = self.heads.dialect.recover(err, sc, self.heads.keys, args)
        return drive(steps, do_step, catch=ResponseError, into=_unless_shard)

    def renew_synced(
        self,
        args: Sequence[Any],
        replicas: int,
        timeout_ms: int,
        sync_key: str,
        bound: float = 0.0,
    ) -> tuple[Any, int]:
        """:func:`synced_renew` on the pool's master (a pipeline on a client of one server;
        on a cluster, the lane of the slot's master): ``(renew reply, replicas that
        acknowledged)``. ``bound`` > 0: connection errors retried on the common policy
        (:func:`gpulock.transport.retry.retrying`) for that many seconds; 0: one try. The
        synced renewal's one I/O, with :meth:`AsyncScripts.renew_synced`: the blocking ``Pool``
        calls it, the runtime (the asyncio shell, the heartbeat) its asyncio twin."""
        if bound <= 0:
            return self._renew_synced(args, replicas, timeout_ms, sync_key)
        for attempt in retrying(bound, asynchronous=False):
            with attempt:
                return self._renew_synced(args, replicas, timeout_ms, sync_key)
        raise AssertionError("unreachable")

    def _renew_synced(
        self, args: Sequence[Any], replicas: int, timeout_ms: int, sync_key: str
    ) -> tuple[Any, int]:
        if self.shards is not None:
            return self.shards.call(  # type: ignore[no-any-return]
                self.slot,
                lambda lane, asking: self._synced_on(
                    lane, asking, args, replicas, timeout_ms, sync_key
                ),
            )
        steps = synced_renew(
            self.heads.dialect,
            self._scripts["renew"],
            self.heads.keys,
            args,
            replicas,
            timeout_ms,
            sync_key,
        )
        return self._run_synced(steps, self._pipeline, lambda s: load(self.client, s))

    def _pipeline(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        with self.client.pipeline(transaction=False) as p:
            for c in commands:
                p.execute_command(*c)
            out: list[Any] = p.execute(raise_on_error=False)
        return out

    def _synced_on(
        self,
        lane: SyncLane,
        asking: bool,
        args: Sequence[Any],
        replicas: int,
        timeout_ms: int,
        sync_key: str,
    ) -> tuple[Any, int]:
        steps = synced_renew(
            self.heads.dialect,
            self._scripts["renew"],
            self.heads.keys,
            args,
            replicas,
            timeout_ms,
            sync_key,
        )
        return self._run_synced(
            steps,
            lambda cmds: batch_replies(lane.execute_many(batch_words(cmds, asking)), asking),
            lambda s: lane.execute(encode(_load_words(s))),
        )

    @staticmethod
    def _run_synced(
        steps: Generator[Union[Batch, Load], Any, tuple[Any, int]],
        batch: Callable[[Sequence[Sequence[Any]]], list[Any]],
        do_load: Callable[[Load], Any],
    ) -> tuple[Any, int]:
        def do_step(step: Batch | Load) -> Any:
            if isinstance(step, Batch):
                return batch(step.commands)  # its error replies are values: none to throw in
            do_load(step)
            return None

        return drive(steps, do_step, catch=ResponseError, into=_unless_shard)

    def drop_idle(self) -> None:
        """Close the lane's idle connections (after a connection error)."""
        if self.lane is not None:
            self.lane.drop_idle()


# ---- the asyncio driver ---------------------------------------------------------------------
class AsyncScripts:
    """The scripts of the pool with ``keys`` on ``client`` (a ``redis.asyncio.Redis`` or an
    asyncio ``RedisCluster``), in one event loop. ``first``: how a call's first try is sent
    (``first(scripts, sc, args)``; the pool object's coalescing of concurrent calls,
    :class:`gpulock.transport.batch.Batcher`); default :meth:`send`."""

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
        self.shards: AsyncShards | None = shards_of(client)  # type: ignore[assignment]
        self.slot = slot_of(keys[0]) if keys else 0
        self._scripts = scripts()

    def words(self, sc: Script, args: Sequence[Any]) -> tuple[Any, ...]:
        """The command running ``sc`` with ``args`` (for a pipeline)."""
        return self.heads.words(sc, args)

    async def _lane(self) -> AsyncLane | None:
        """The lane a first try goes on: the client's, or on a cluster the lane of the
        master the slot map names for the pool's slot."""
        if self.shards is None:
            return self.lane
        await self.shards.ready()
        node = self.shards.node_name(self.slot)
        if node is None:
            raise ShardUnavailable(self.slot, None, "no master serves it (the slot map has none)")
        return await self.shards.lane(node)

    async def send_many(self, calls: Sequence[tuple[Script, Sequence[Any]]]) -> list[Any]:
        """First tries of several calls at once, in one round trip: each reply, or the
        ``ResponseError`` of each error reply (a pipeline; on the lane when there is one).
        Raises a connection error or timeout for all of them."""
        lane = await self._lane()
        if lane is not None:
            return await lane.execute_many([self.heads.packed(sc, a) for sc, a in calls])
        async with self.client.pipeline(transaction=False) as p:
            for sc, a in calls:
                p.execute_command(*self.heads.words(sc, a))
            replies: list[Any] = await p.execute(raise_on_error=False)
        return replies

    async def send(self, sc: Script, args: Sequence[Any]) -> Any:
        """One try of ``sc`` on its own connection: the reply, or redis-py's error."""
        lane = await self._lane()
        if lane is not None:
            return await lane.execute(self.heads.packed(sc, args))
        return await self.client.execute_command(*self.heads.words(sc, args))

    async def call(self, name: str, args: Sequence[Any]) -> Any:
        """As :meth:`SyncScripts.call`. On a cluster the first try goes to the master the
        slot map names; what it meets is handled by :mod:`gpulock.transport.route` from there."""
        sc = self._scripts[name]
        err: BaseException
        node: str | None = None  # the master the first try goes to (cluster)
        try:
            if self.shards is not None:
                await self.shards.ready()
                node = self.shards.node_name(self.slot)
                with self.shards.watch(self.slot, node):
                    if self.first is not None:
                        return await self.first(self, sc, args)
                    return await self.send(sc, args)
            if self.first is not None:
                return await self.first(self, sc, args)
            return await self.send(sc, args)
        except ResponseError as e:
            if self.shards is None:
                return await self._recover(e, sc, args, self.lane)
            err = e
            if not is_shard_error(e):
                try:  # missing code on the master that answered: load it there
                    return await self._recover(e, sc, args, await self._lane())
                except ResponseError as e2:
                    if not is_shard_error(e2):
                        raise
                    err = e2
        except AuthenticationError:
            raise
        except Exception as e:
            if self.shards is None:
                raise
            err = e
        return await self.shards.call(
            self.slot,
            lambda lane, asking: self._on(lane, asking, sc, args),
            first=None if node is None else (node, err),
        )

    async def _on(self, lane: AsyncLane, asking: bool, sc: Script, args: Sequence[Any]) -> Any:
        """As :meth:`SyncScripts._on`."""
        packed = self.heads.packed(sc, args)
        try:
            if asking:
                return _one(await lane.execute_many([ASKING, packed]))
            return await lane.execute(packed)
        except ResponseError as e:
            if is_shard_error(e):
                raise
            return await self._recover(e, sc, args, lane, asking)

    async def _recover(
        self,
        err: ResponseError,
        sc: Script,
        args: Sequence[Any],
        lane: AsyncLane | None,
        asking: bool = False,
    ) -> Any:
        async def do_step(step: Send | Load) -> Any:
            if isinstance(step, Send):
                if lane is None:
                    return await self.client.execute_command(*step.words)
                if asking:
                    return _one(await lane.execute_many([ASKING, encode(step.words)]))
                return await lane.execute(encode(step.words))
            if lane is None or self.shards is None:
                await load(self.client, step)
            else:
                await lane.execute(encode(_load_words(step)))
            return None

        steps = self.heads.dialect.recover(err, sc, self.heads.keys, args)
        # a shard's error (a redirect, TRYAGAIN, CLUSTERDOWN) is the cluster route's to handle
        return await adrive(
            steps,
            do_step,
            catch=ResponseError,
            into=lambda e: None if self.shards is not None and is_shard_error(e) else e,
        )

    async def renew_synced(
        self,
        args: Sequence[Any],
        replicas: int,
        timeout_ms: int,
        sync_key: str,
        bound: float = 0.0,
    ) -> tuple[Any, int]:
        """As :meth:`SyncScripts.renew_synced`."""
        if bound <= 0:
            return await self._renew_synced(args, replicas, timeout_ms, sync_key)
        async for attempt in retrying(bound, asynchronous=True):
            with attempt:
                return await self._renew_synced(args, replicas, timeout_ms, sync_key)
        raise AssertionError("unreachable")

    async def _renew_synced(
        self, args: Sequence[Any], replicas: int, timeout_ms: int, sync_key: str
    ) -> tuple[Any, int]:
        if self.shards is not None:
            return await self.shards.call(  # type: ignore[no-any-return]
                self.slot,
                lambda lane, asking: self._synced_on(
                    lane, asking, args, replicas, timeout_ms, sync_key
                ),
            )
        steps = synced_renew(
            self.heads.dialect,
            self._scripts["renew"],
            self.heads.keys,
            args,
            replicas,
            timeout_ms,
            sync_key,
        )

        async def batch(cmds: Sequence[Sequence[Any]]) -> list[Any]:
            async with self.client.pipeline(transaction=False) as p:
                for c in cmds:
                    p.execute_command(*c)
                out: list[Any] = await p.execute(raise_on_error=False)
            return out

        return await self._run_synced(steps, batch, lambda s: load(self.client, s))

    async def _synced_on(
        self,
        lane: AsyncLane,
        asking: bool,
        args: Sequence[Any],
        replicas: int,
        timeout_ms: int,
        sync_key: str,
    ) -> tuple[Any, int]:
        steps = synced_renew(
            self.heads.dialect,
            self._scripts["renew"],
            self.heads.keys,
            args,
            replicas,
            timeout_ms,
            sync_key,
        )

        async def batch(cmds: Sequence[Sequence[Any]]) -> list[Any]:
            return batch_replies(await lane.execute_many(batch_words(cmds, asking)), asking)

        return await self._run_synced(steps, batch, lambda s: lane.execute(encode(_load_words(s))))

    @staticmethod
    async def _run_synced(
        steps: Generator[Union[Batch, Load], Any, tuple[Any, int]],
        batch: Callable[[Sequence[Sequence[Any]]], Awaitable[list[Any]]],
        do_load: Callable[[Load], Awaitable[Any]],
    ) -> tuple[Any, int]:
        async def do_step(step: Batch | Load) -> Any:
            if isinstance(step, Batch):
                return await batch(step.commands)  # its error replies are values
            await do_load(step)
            return None

        return await adrive(steps, do_step, catch=ResponseError, into=_unless_shard)

    async def drop_idle(self) -> None:
        """Close the lane's idle connections (after a connection error)."""
        if self.lane is not None:
            await self.lane.drop_idle()
