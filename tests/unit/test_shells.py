"""The two pool shells, :class:`gpulock.AsyncPool` and :class:`gpulock.Pool`, offer the same
public surface: the same methods, properties and attributes (async or blocking aside). What a
proxy needs for holders on other hosts is not part of it: :class:`gpulock.runtime.remote.
RemoteHolders`. No Redis."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

from gpulock import AsyncPool, Pool

#: Names that genuinely differ, each with why: (AsyncPool's, Pool's).
RENAMED = {
    # asyncio's spelling of an awaitable close (as redis.asyncio's own `aclose`); a blocking
    # object's is `close` (as redis-py's).
    ("aclose", "close"),
}


def _public(names: object) -> set[str]:
    return {n for n in names if not n.startswith("_")}  # type: ignore[attr-defined]


def _surface(cls: type, instance: object) -> set[str]:
    """The public names of ``cls`` (methods, properties) and of an ``instance``'s attributes."""
    return _public(dir(cls)) | _public(vars(instance))


def test_async_pool_and_pool_have_the_same_public_surface():
    apool = AsyncPool(aioredis.Redis(), "shells")  # no I/O until first use
    spool = Pool(redis.Redis(), "shells")
    try:
        a = _surface(AsyncPool, apool) - {x for x, _ in RENAMED}
        s = _surface(Pool, spool) - {y for _, y in RENAMED}
    finally:
        spool.close()
    assert a - s == set(), f"AsyncPool has, Pool lacks: {sorted(a - s)}"
    assert s - a == set(), f"Pool has, AsyncPool lacks: {sorted(s - a)}"


def test_the_renamed_names_exist_on_their_side():
    for async_name, sync_name in RENAMED:
        assert callable(getattr(AsyncPool, async_name)) and not hasattr(Pool, async_name)
        assert callable(getattr(Pool, sync_name)) and not hasattr(AsyncPool, sync_name)


def test_no_proxy_methods_on_the_shells():
    """The remote holders' calls live on RemoteHolders (gpulock.runtime.remote), not here."""
    for cls in (AsyncPool, Pool):
        assert not [n for n in dir(cls) if n.endswith("_remote")], cls
