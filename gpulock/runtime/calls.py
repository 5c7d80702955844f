"""The script calls a pool object's background work makes, and the settings they follow.

:class:`Settings` is what the pool object set (:meth:`~gpulock.runtime.runtime.Runtime.use_settings`);
:class:`Calls` runs the Lua scripts on the runtime's own redis.asyncio client: EVALSHA with a
NOSCRIPT reload, retried on the common policy (:func:`gpulock.transport.retry.retrying`) when given
a bound, and the renewal followed by ``WAIT`` for ``sync_replicas``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import AuthenticationError

from gpulock.protocol.keys import pool_key
from gpulock.protocol.request import DEFAULT_MAX_WAITERS
from gpulock.transport.retry import retrying
from gpulock.transport.script_calls import AsyncScripts
from gpulock.transport.translate import translate

DEFAULT_BACKEND_TIMEOUT_S = 5.0  # the pool object's backend_timeout, until it sets its own


@dataclass
class Settings:
    """The pool object's settings the background work follows.

    ``capacity`` (bytes; None: not given), ``max_waiters`` and ``max_ttl_ms``: what the pool is
    created with again after Redis lost it, for a pool never seen. ``sync_replicas``: a renewal
    counts for the lease's validity only once that many replicas acknowledged it (WAIT, at most
    ``sync_timeout_ms``), so a failover to one of them cannot lose what the holder relies on;
    0: off. ``backend_timeout``: the bound (s) of background retries."""

    capacity: int | None = None
    max_waiters: int = DEFAULT_MAX_WAITERS
    max_ttl_ms: int = 0
    sync_replicas: int = 0
    sync_timeout_ms: int = 1000
    backend_timeout: float = DEFAULT_BACKEND_TIMEOUT_S


class Calls:
    """The pool's scripts, called on ``redis`` (a redis.asyncio client) with ``keys``."""

    def __init__(self, redis: Any, pool: str, keys: Sequence[str], settings: Settings):
        self.redis = redis
        self.pool = pool
        self.keys = keys
        self.settings = settings
        self.sync_key = pool_key(pool, "sync")  # a counter INCRed before each WAIT
        self.scripts = AsyncScripts(redis, keys)

    async def _eval_once(self, name: str, args: list[Any]) -> Any:
        try:
            return await self.scripts.call(name, args)
        except AuthenticationError as e:  # a ConnectionError to redis-py; retrying cannot help
            raise translate(e, self.pool) from e

    async def eval(self, name: str, args: list[Any], *, bound: float = 0.0) -> Any:
        """EVALSHA with NOSCRIPT reload. ``bound`` > 0: retry connection errors on the common
        policy (:func:`gpulock.transport.retry.retrying`, the foreground's) for that many seconds; 0:
        one try (the ticker's own calls: the loop retries them on the same schedule)."""
        if bound <= 0:
            return await self._eval_once(name, args)
        async for attempt in retrying(bound, asynchronous=True):
            with attempt:
                return await self._eval_once(name, args)
        raise AssertionError("unreachable")

    async def cancel_quietly(
        self, ticket: str, args: list[str] | None = None, script: str = "cancel"
    ) -> None:
        """Withdraw a request (leave the queue, give back a grant that raced in), retried on
        the common policy for backend_timeout; if Redis stays away the waiter expires after its
        waiter_ttl and a grant after its ttl. ``script``/``args``: another withdrawal (a
        growth's: ``resize`` back), default ``cancel`` of ``ticket``."""
        try:
            await self.eval(
                script, [ticket] if args is None else args, bound=self.settings.backend_timeout
            )
        except Exception:  # noqa: BLE001 - best effort; expiry is the backstop
            pass

    async def renew_synced(self, args: list[Any], bound: float = 0.0) -> tuple[Any, int]:
        """Run ``renew`` of ``args`` and then, on the same connection to the pool's master, an
        INCR of the pool's sync counter and ``WAIT sync_replicas sync_timeout_ms``
        (:func:`gpulock.transport.script_calls.synced_renew`): returns (renew reply, replicas that
        acknowledged everything this connection wrote, the renewal included). ``bound`` > 0:
        connection errors retried on the common policy for that many seconds; 0: one try."""
        st = self.settings
        return await self.scripts.renew_synced(
            args, st.sync_replicas, st.sync_timeout_ms, self.sync_key, bound
        )

    async def drop_idle_connections(self) -> None:
        """After a connection error, close the connections the client's lane keeps at hand:
        if Redis restarted they are all dead, and each would fail one later call ("Connection
        closed by server"); new ones are opened on demand. The pool's own idle connections
        are left to redis-py, which checks each one as it hands it out (its
        ``disconnect(inuse_connections=False)`` would close them in tasks that run later,
        when some may already serve a call)."""
        try:
            await self.scripts.drop_idle()
        except Exception:  # noqa: BLE001 - best effort; a dead connection fails once and is dropped
            pass
