"""Pool objects and fork(): what a child process can and cannot use of its parent's (the
lanes' own fork rule is tested in test_lane.py)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.timeout(60)


def test_a_pool_used_before_a_fork_says_so_in_the_child(redis_proc):
    """A blocking Pool's background thread (its heartbeat) does not survive fork(): in the
    child, a pool object used before the fork refuses acquires naming the fork (a lease taken
    there would never be renewed), closes at once, and a new Pool works (a fresh user's
    finding: the lease was taken and silently lost)."""
    from gpulock import InvalidArgument, Pool

    p = Pool.from_url(redis_proc.url, "forked", capacity=10)
    p.acquire(1).release()  # the background thread runs now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        res = b"?"
        try:
            try:
                p.acquire(1, ttl=30)
                res = b"acquired"
            except InvalidArgument as e:
                res = b"refused" if "fork" in str(e) else b"other"
            p.close()
            with Pool.from_url(redis_proc.url, "forked") as fresh:
                fresh.acquire(1).release()
            res += b"+fresh"
        except BaseException:  # noqa: BLE001 - reported through the pipe
            res += b"+error"
        os.write(w, res)
        os._exit(0)
    os.close(w)
    got = os.read(r, 64)
    os.waitpid(pid, 0)
    os.close(r)
    assert got == b"refused+fresh", got
    p.acquire(1).release()  # the parent's pool object is untouched
    p.close()
