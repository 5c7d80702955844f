"""The lane (gpulock/transport/lane.py): script calls on redis-py connections kept at hand. What must
hold whatever happens to a call: a later call never reads an earlier call's reply (a
connection goes back only with nothing left to read), the client's connection cap holds, a
connection error drops the connections at hand, and a forked child never uses the parent's.

Replies are checked with ``ECHO`` of a value unique to each call, so a reply read by the wrong
call shows."""

from __future__ import annotations

import asyncio
import os

import pytest
import redis

from gpulock.transport.connect import async_client, sync_client
from gpulock.transport.lane import async_lane, encode, sync_lane

pytestmark = pytest.mark.timeout(120)


def _echo(lane, i: int) -> bytes:
    return lane.execute(encode(("ECHO", f"call-{i}")))


def test_replies_match_calls_and_connections_are_kept_at_hand(redis_proc):
    c = sync_client(redis_proc.url, max_connections=16)
    lane = sync_lane(c)
    assert lane is not None and lane is sync_lane(c)  # one lane per client
    for i in range(50):
        assert _echo(lane, i) == f"call-{i}".encode()
    assert len(lane.idle) == 1  # the one connection used, kept at hand
    c.close()


def test_a_timed_out_call_leaves_nothing_for_the_next(redis_proc):
    """The server stops answering (SIGSTOP): the call times out; its reply, sent once the
    server runs again, must not be read by the next call."""
    c = sync_client(redis_proc.url, max_connections=16, socket_timeout=0.3)
    lane = sync_lane(c)
    assert _echo(lane, 0) == b"call-0"
    redis_proc.pause()
    try:
        with pytest.raises(redis.exceptions.TimeoutError):
            _echo(lane, 1)
    finally:
        redis_proc.resume()
    assert lane.idle == []  # that connection was not kept
    for i in range(2, 10):
        assert _echo(lane, i) == f"call-{i}".encode()
    c.close()


async def test_a_cancellation_anywhere_leaves_nothing_for_the_next(redis_proc):
    """Cancel a call after 0, 1, 2, ... loop iterations (before it is sent, while it is sent,
    while its reply is awaited, after): every later call reads its own reply, and the
    connections in use never exceed the cap."""
    c = async_client(redis_proc.url, max_connections=4)
    lane = async_lane(c)
    assert lane is not None
    n = 0
    for k in range(12):
        task = asyncio.create_task(lane.execute(encode(("ECHO", f"cancelled-{k}"))))
        for _ in range(k):
            await asyncio.sleep(0)
        task.cancel()
        try:
            r = await task
            assert r == f"cancelled-{k}".encode()  # it finished before the cancellation
        except asyncio.CancelledError:
            pass
        for _ in range(3):
            n += 1
            assert await lane.execute(encode(("ECHO", f"call-{n}"))) == f"call-{n}".encode()
    assert len(lane.idle) <= lane.keep
    await c.aclose()


def test_a_connection_error_drops_the_connections_at_hand(redis_proc):
    """Redis restarts (without data): every connection at hand is dead. The first call fails
    (these clients do not retry) and the lane drops the others, so the next calls work
    instead of each failing once."""
    c = sync_client(redis_proc.url, max_connections=16)
    lane = sync_lane(c)
    import threading

    # Put several connections at hand: calls at once from threads.
    barrier = threading.Barrier(4)

    def burst(i: int) -> None:
        barrier.wait()
        for j in range(20):
            assert _echo(lane, 100 * i + j) == f"call-{100 * i + j}".encode()

    threads = [threading.Thread(target=burst, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 1 <= len(lane.idle) <= lane.keep
    redis_proc.restart()
    with pytest.raises(redis.exceptions.ConnectionError):
        _echo(lane, 1)
    assert lane.idle == []
    for i in range(5):
        assert _echo(lane, i) == f"call-{i}".encode()
    c.close()


def test_a_forked_child_never_uses_the_parents_connections(redis_proc):
    c = sync_client(redis_proc.url, max_connections=16)
    lane = sync_lane(c)
    assert _echo(lane, 0) == b"call-0"
    parent_conn = lane.idle[0]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own connection, its own replies
        os.close(r)
        ok = True
        try:
            for i in range(200):
                ok &= _echo(lane, 1000 + i) == f"call-{1000 + i}".encode()
            ok &= parent_conn not in lane.idle
        except BaseException:  # noqa: BLE001 - reported through the exit status
            ok = False
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    for i in range(200):  # meanwhile the parent goes on with its own
        assert _echo(lane, i) == f"call-{i}".encode()
    assert os.read(r, 1) == b"1", "the child read a wrong reply or reused the parent's connection"
    os.waitpid(pid, 0)
    os.close(r)
    assert lane.idle and lane.idle[0] is parent_conn
    c.close()


async def test_a_connection_closed_under_a_call_is_a_connection_error(redis_proc):
    """Another task closes every connection of the client (as closing the client does) at
    each point of a call (after 0, 1, 2, ... loop iterations: while it takes a connection,
    connects, writes, waits for its reply): the call succeeds or fails with a ConnectionError,
    never with what redis-py's connection trips over when its stream vanishes under it (an
    AttributeError on None), and the next calls work."""
    c = async_client(redis_proc.url, max_connections=4)
    lane = async_lane(c)
    n = 0
    for k in range(16):
        await lane.drop_idle()  # each call connects anew: the connect and write steps too
        call = asyncio.create_task(lane.execute(encode(("ECHO", f"cut-{k}"))))
        for _ in range(k):
            await asyncio.sleep(0)
        await c.connection_pool.disconnect(inuse_connections=True)
        try:
            assert await call == f"cut-{k}".encode()
        except redis.exceptions.ConnectionError:
            pass
        for _ in range(2):
            n += 1
            assert await lane.execute(encode(("ECHO", f"call-{n}"))) == f"call-{n}".encode()
    await c.aclose()
