"""The two forms of the scripts (gpulock/transport/scripts.py, gpulock/transport/dialect.py): functions of one
library (FCALL) where the server has them, scripts (EVALSHA) where it does not or the ACL
refuses them; and code that goes missing on the server (FUNCTION FLUSH, SCRIPT FLUSH, as after
a restart without data) is loaded again, by the caller's calls and the background runtime's.

A server without functions (Redis 6.2) is stood in for by renaming FCALL and FUNCTION away
(``rename-command``): the server then answers as 6.2 does, "unknown command". Run on every
server kind (Redis 7 and the embedded Valkey)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from gpulock import AsyncPool, Pool
from gpulock.transport.scripts import library, scripts
from support.servers import RedisProcess
from support.pools import assert_empty, check_consistent

pytestmark = pytest.mark.timeout(120)

NO_FUNCTIONS = ["--rename-command", "FCALL", "", "--rename-command", "FUNCTION", ""]


def _calls(c: redis.Redis) -> dict[str, int]:
    """Calls of FCALL and EVALSHA since the last CONFIG RESETSTAT."""
    st = c.info("commandstats")
    return {k: int(st.get(f"cmdstat_{k}", {}).get("calls", 0)) for k in ("fcall", "evalsha")}


def _exercise_sync(url: str, pool: str) -> None:
    """Grants, a queued waiter handed a lease by a release, status: every foreground path."""
    with Pool.from_url(url, pool, capacity=10) as p:
        first = p.acquire(10)
        got = []
        import threading

        t = threading.Thread(target=lambda: got.append(p.acquire(5, timeout=30)))
        t.start()
        deadline = time.monotonic() + 30
        while p.status().waiter_count == 0:  # the waiter queued
            assert time.monotonic() < deadline
            time.sleep(0.01)
        first.release()
        t.join(30)
        got[0].release()
        assert p.status().used == 0


async def _exercise_async(url: str, pool: str) -> None:
    async with AsyncPool.from_url(url, pool, capacity=10) as p:
        first = await p.acquire(10)
        waiter = asyncio.create_task(p.acquire(5, timeout=30))
        while (await p.status()).waiter_count == 0:
            await asyncio.sleep(0.01)
        await first.release()
        await (await waiter).release()
        assert (await p.status()).used == 0


def test_functions_where_the_server_has_them(redis_proc, rclient):
    rclient.config_resetstat()
    _exercise_sync(redis_proc.url, "fs")
    asyncio.run(_exercise_async(redis_proc.url, "fa"))
    calls = _calls(rclient)
    assert calls["fcall"] > 0 and calls["evalsha"] == 0, calls
    libs = {lib["library_name"]: lib for lib in _decode(rclient.function_list())}
    lib = libs[library().name.encode()]
    flags = {f["name"]: set(f["flags"]) for f in lib["functions"]}
    assert flags[scripts()["release"].function.encode()] == {b"allow-oom"}
    assert flags[scripts()["acquire"].function.encode()] == set()
    check_consistent(rclient, "fs")
    check_consistent(rclient, "fa")


def _decode(libs: list) -> list[dict]:
    """FUNCTION LIST's reply (flat lists) as dicts."""
    out = []
    for lib in libs:
        d = dict(zip(lib[::2], lib[1::2]))
        d = {(k.decode() if isinstance(k, bytes) else k): v for k, v in d.items()}
        d["functions"] = [
            {(k.decode() if isinstance(k, bytes) else k): v for k, v in zip(f[::2], f[1::2])}
            for f in d["functions"]
        ]
        out.append(d)
    return out


def test_scripts_where_the_server_has_no_functions(server_binary):
    with RedisProcess(server_binary, extra_args=NO_FUNCTIONS) as srv:
        c = redis.Redis.from_url(srv.url)
        c.config_resetstat()
        _exercise_sync(srv.url, "ss")
        asyncio.run(_exercise_async(srv.url, "sa"))
        calls = _calls(c)
        assert calls["evalsha"] > 0 and calls["fcall"] == 0, calls
        assert_empty(c, "ss")
        assert_empty(c, "sa")
        c.close()


def test_scripts_when_the_acl_refuses_functions(redis_proc, rclient):
    """A user allowed scripts but not functions (``-@all`` plus the commands it needs)."""
    rclient.execute_command(
        "ACL", "SETUSER", "nofn", "on", ">pw", "~*", "&*", "+@all", "-fcall", "-function"
    )
    url = redis_proc.url.replace("redis://", "redis://nofn:pw@")
    rclient.config_resetstat()
    _exercise_sync(url, "as")
    asyncio.run(_exercise_async(url, "aa"))
    calls = _calls(rclient)
    assert calls["evalsha"] > 0, calls
    check_consistent(rclient, "as")


@pytest.mark.parametrize("functions", [True, False], ids=["functions", "scripts"])
def test_code_flushed_from_the_server_is_loaded_again(server_binary, functions):
    """FUNCTION FLUSH / SCRIPT FLUSH while leases are held and a waiter waits: the holders'
    heartbeat (background runtime), the waiter's refresh, the releases and new acquires all
    load the code again and go on."""
    args = [] if functions else NO_FUNCTIONS
    with RedisProcess(server_binary, extra_args=args) as srv:
        c = redis.Redis.from_url(srv.url)

        def flush() -> None:
            c.script_flush()
            if functions:
                c.function_flush()

        with Pool.from_url(srv.url, "fl", capacity=10, default_ttl=0.6) as p:
            held = p.acquire(10)
            lost: list = []
            held.on_lost(lost.append)
            flush()
            t_end = time.monotonic() + 1.5  # over two renewals (ttl/3 = 0.2 s)
            while time.monotonic() < t_end:
                held.ensure_valid()
                time.sleep(0.05)
            assert not lost
            flush()
            held.release()
            flush()
            with p.acquire(4) as lease:
                flush()
                assert p.status().used == 4
                lease.ensure_valid()
        assert_empty(c, "fl")
        c.close()


async def test_async_code_flushed_is_loaded_again(redis_proc, rclient):
    async with AsyncPool.from_url(redis_proc.url, "afl", capacity=10, default_ttl=0.6) as p:
        held = await p.acquire(10)
        rclient.function_flush()
        rclient.script_flush()
        await asyncio.sleep(1.0)  # the heartbeat renews through the flush
        held.ensure_valid()
        rclient.function_flush()
        await held.release()
        rclient.function_flush()
        async with p.lease(3):
            pass
    assert_empty(rclient, "afl")


@pytest.mark.parametrize("how", ["no-functions", "acl"])
def test_overlapping_first_calls_all_switch_to_scripts(server_binary, how):
    """A new client's first calls overlap (tasks of one AsyncPool, threads of one Pool) on a
    server that cannot run functions: every call that was sent as FCALL before the first
    refusal switched the client to scripts retries as a script; none fails."""
    import threading

    args = NO_FUNCTIONS if how == "no-functions" else []
    with RedisProcess(server_binary, extra_args=args) as srv:
        url = srv.url
        if how == "acl":
            admin = redis.Redis.from_url(srv.url)
            admin.execute_command(
                "ACL", "SETUSER", "nofn", "on", ">pw", "~*", "&*", "+@all", "-fcall", "-function"
            )
            admin.close()
            url = srv.url.replace("redis://", "redis://nofn:pw@")

        async def tasks() -> list:
            async with AsyncPool.from_url(url, "oa", capacity=100) as p:

                async def one() -> None:
                    async with p.lease(1, timeout=30):
                        await asyncio.sleep(0)

                return await asyncio.gather(*(one() for _ in range(20)), return_exceptions=True)

        outs = asyncio.run(tasks())
        assert not [o for o in outs if isinstance(o, BaseException)], outs

        errors: list = []
        with Pool.from_url(url, "os", capacity=100) as p:
            go = threading.Barrier(20)

            def one() -> None:
                go.wait()
                try:
                    p.acquire(1, timeout=30).release()
                except BaseException as e:  # noqa: BLE001 - collected for the assertion
                    errors.append(e)

            threads = [threading.Thread(target=one) for _ in range(20)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        assert not errors, errors


async def _exercise_resize(url: str, pool: str) -> None:
    """Resizes (docs/SEMANTICS.md, "Resizing a lease"): a shrink hands its bytes to a waiter, a
    growth granted now, one queued and granted by another holder's release, one that times out
    (the lease keeps its amount), and the deadlock rule's refusal."""
    from gpulock import AcquireTimeout, ResizeRefused

    async with AsyncPool.from_url(url, pool, capacity=100) as p:
        a = await p.acquire(100)
        w = asyncio.create_task(p.acquire(30, timeout=30))
        while (await p.status()).waiter_count == 0:
            await asyncio.sleep(0.01)
        await a.resize(70)
        b = await asyncio.wait_for(w, 10)
        await b.resize(20)  # shrink with nobody waiting
        await a.resize(80)  # grows now: 10 free
        grow = asyncio.create_task(a.resize(90, timeout=30))
        while (await p.status()).waiter_count == 0:
            await asyncio.sleep(0.01)
        with pytest.raises(ResizeRefused):
            await b.resize(30)  # both waiting could never end
        await b.release()
        await asyncio.wait_for(grow, 10)
        assert a.amount == 90
        b = await p.acquire(10)
        with pytest.raises(AcquireTimeout):
            await a.resize(95, timeout=0.2)
        assert a.amount == 90 and (await p.status()).used == 100
        await b.release()
        await a.release()


def test_resize_where_the_server_has_no_functions(server_binary):
    """``resize.lua`` as a script (EVALSHA), as on Redis 6.2, which has no functions."""
    with RedisProcess(server_binary, extra_args=NO_FUNCTIONS) as srv:
        c = redis.Redis.from_url(srv.url)
        c.config_resetstat()
        asyncio.run(_exercise_resize(srv.url, "rz"))
        calls = _calls(c)
        assert calls["evalsha"] > 0 and calls["fcall"] == 0, calls
        assert_empty(c, "rz")
        c.close()


def test_resize_as_a_function(redis_proc, rclient):
    rclient.config_resetstat()
    asyncio.run(_exercise_resize(redis_proc.url, "rzf"))
    calls = _calls(rclient)
    assert calls["fcall"] > 0 and calls["evalsha"] == 0, calls
    assert_empty(rclient, "rzf")
