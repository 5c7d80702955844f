"""The blocking Pool's hand-off: its waiting threads read the subscription themselves, one at a
time (gpulock/runtime/sync_listener.py). The thread reading returns with its own grant; a grant for
another waiting thread of the process reaches that thread; the reading passes on when the
reader stops waiting (granted, timed out, interrupted, closed); a connection that died while
nobody read is found before an acquire queues on it.

Pools here poll every 60 s unless a test says otherwise, so a grant that reaches its thread
within the test came by the hand-off message, not by the heartbeat's poll. The tests order
their steps by what they observe (the queue on the server, which thread reads), never by
sleeping.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis

import gpulock.runtime.sync_listener as sync_listener
from gpulock import AcquireTimeout, Pool, PoolClosed
from gpulock.protocol.keys import pool_keys
from support.pools import assert_empty
from support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


class Acquire:
    """``pool.acquire(*args, **kw)`` on a thread of its own; ``out``: its lease or error."""

    def __init__(self, pool: Pool, *args: Any, **kw: Any):
        self.out: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=(pool, args, kw), daemon=True)
        self.thread.start()

    def _run(self, pool: Pool, args: tuple, kw: dict) -> None:
        try:
            self.out["lease"] = pool.acquire(*args, **kw)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertions
            self.out["error"] = e

    def result(self, timeout: float = 20.0) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the acquire is still waiting"
        if "error" in self.out:
            raise self.out["error"]
        return self.out["lease"]


def sub(pool: Pool) -> sync_listener.ThreadSubscription:
    assert pool._bg is not None
    return pool._bg.sub


def reader_ticket(pool: Pool) -> str | None:
    r = pool._bg.sub._reader if pool._bg is not None else None
    return r.ticket if r is not None else None


def follower_tickets(pool: Pool) -> list[str | None]:
    return [w.ticket for w in list(pool._bg.sub._followers)] if pool._bg is not None else []


def queued(rclient: redis.Redis, pool_name: str) -> int:
    return int(rclient.zcard(pool_keys(pool_name)[3]))


def test_the_reading_thread_returns_with_its_own_grant(make_pool, rclient, pool_name):
    pool = make_pool(capacity=1, poll_interval=60)
    holder = make_pool(capacity=1).acquire(1, ttl=30)
    a = Acquire(pool, 1, ttl=30, request_id="a")
    wait_until(lambda: reader_ticket(pool) == "a" and queued(rclient, pool_name) == 1)
    holder.release()
    lease = a.result()
    assert sub(pool)._reader is None  # nobody reads while nobody waits
    lease.release()
    assert_empty(rclient, pool_name)


def test_a_waiter_queued_on_the_callers_thread_keeps_its_place(make_pool, rclient, pool_name):
    """The blocking acquire registers its waiter on its own thread, while the pool object's
    heartbeat already runs with a plan 10 s ahead (the held lease's renewal): the heartbeat
    still refreshes the place (the server's waiter expiry moves on, past several waiter ttls),
    and nothing is reaped."""
    pool = make_pool(capacity=1, waiter_ttl=0.75, poll_interval=0.1)
    holder = pool.acquire(1, ttl=30)
    a = Acquire(pool, 1, ttl=30, request_id="a")
    wexp = pool_keys(pool_name)[5]
    first = wait_until(lambda: rclient.zscore(wexp, "a"), what="the place")
    wait_until(
        lambda: (rclient.zscore(wexp, "a") or 0) > first + 3 * 750,
        timeout=20,
        what="the place kept for three waiter ttls",
    )
    assert pool.status().reaped_waiters == 0
    holder.release()
    a.result().release()
    assert_empty(rclient, pool_name)


def test_a_grant_read_by_another_waiting_thread_reaches_its_thread(make_pool, rclient, pool_name):
    """One release grants two threads of the process in one message: the reader keeps its
    own grant and hands the other to the runtime, which wakes the other thread."""
    pool = make_pool(capacity=2, poll_interval=60)
    holder = make_pool(capacity=2).acquire(2, ttl=30)
    a = Acquire(pool, 1, ttl=30, request_id="a")
    wait_until(lambda: reader_ticket(pool) == "a")
    b = Acquire(pool, 1, ttl=30, request_id="b")
    wait_until(lambda: follower_tickets(pool) == ["b"] and queued(rclient, pool_name) == 2)
    holder.release()
    la, lb = a.result(), b.result()
    assert {la.request_id, lb.request_id} == {"a", "b"}
    la.release()
    lb.release()
    assert_empty(rclient, pool_name)


def test_the_reading_passes_to_a_waiting_thread_when_the_reader_is_granted(
    make_pool, rclient, pool_name
):
    pool = make_pool(capacity=1, poll_interval=60)
    holder = make_pool(capacity=1).acquire(1, ttl=30)
    a = Acquire(pool, 1, ttl=30, request_id="a")
    wait_until(lambda: reader_ticket(pool) == "a")
    b = Acquire(pool, 1, ttl=30, request_id="b")
    wait_until(lambda: follower_tickets(pool) == ["b"] and queued(rclient, pool_name) == 2)
    holder.release()
    la = a.result()
    wait_until(lambda: reader_ticket(pool) == "b")  # handed on: b reads its grant itself
    la.release()
    b.result().release()
    assert_empty(rclient, pool_name)


def test_the_reader_giving_up_hands_the_reading_to_a_waiting_thread(make_pool, rclient, pool_name):
    """The reader times out while another thread waits: that thread reads from then on and
    gets its grant by the hand-off."""
    pool = make_pool(capacity=1, poll_interval=60)
    holder = make_pool(capacity=1).acquire(1, ttl=30)
    a = Acquire(pool, 1, ttl=30, timeout=1.0, request_id="a")
    wait_until(lambda: reader_ticket(pool) == "a")
    b = Acquire(pool, 1, ttl=30, request_id="b")
    wait_until(lambda: follower_tickets(pool) == ["b"])
    with pytest.raises(AcquireTimeout):
        a.result()
    wait_until(lambda: reader_ticket(pool) == "b" and queued(rclient, pool_name) == 1)
    holder.release()
    b.result().release()
    assert_empty(rclient, pool_name)


def test_one_request_id_in_two_threads_the_reader_hands_its_grant_on(make_pool, rclient, pool_name):
    """Two threads acquire with one request id (one place, one grant): the thread reading the
    subscription reads the grant, and the other thread gets the same lease."""
    pool = make_pool(capacity=1, poll_interval=60)
    holder = make_pool(capacity=1).acquire(1, ttl=30)
    a = Acquire(pool, 1, ttl=30, request_id="same")
    wait_until(lambda: reader_ticket(pool) == "same")
    b = Acquire(pool, 1, ttl=30, request_id="same")
    wait_until(lambda: follower_tickets(pool) == ["same"])
    rt = pool._runtime
    assert rt is not None
    wait_until(lambda: rt.waiters["same"].users == 2, what="both acquires on the one waiter")
    assert queued(rclient, pool_name) == 1
    holder.release()
    la, lb = a.result(), b.result()
    assert la.id == lb.id and la.token == lb.token
    la.release()
    lb.release()  # the same lease: a no-op
    assert_empty(rclient, pool_name)


def test_an_interrupted_reader_leaves_the_subscription_working(
    make_pool, rclient, pool_name, monkeypatch
):
    """KeyboardInterrupt while the reading thread handles its grant message: that acquire
    raises it and withdraws (the grant is given back); the subscription starts again, and the
    next waiter gets its grant by the hand-off."""
    pool = make_pool(capacity=1, poll_interval=60)
    other = make_pool(capacity=1)
    holder = other.acquire(1, ttl=30)
    real = sync_listener.ThreadSubscription._on_message
    calls = []

    def interrupted(self, data):
        calls.append(data)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, data)

    monkeypatch.setattr(sync_listener.ThreadSubscription, "_on_message", interrupted)
    a = Acquire(pool, 1, ttl=30, request_id="a")
    wait_until(lambda: reader_ticket(pool) == "a" and queued(rclient, pool_name) == 1)
    holder.release()
    with pytest.raises(KeyboardInterrupt):
        a.result()
    # The subscription starts again on a new connection: until Redis confirms it, the next
    # acquire must wait for that confirmation before it queues (a grant published before it
    # would be lost: with a 60 s poll, b below would wait out its timeout; seen under load).
    assert not sub(pool).subscribed and not sub(pool).channel.news.is_set()
    wait_until(lambda: other.status().used == 0, what="the interrupted acquire's grant back")
    holder = other.acquire(1, ttl=30)
    b = Acquire(pool, 1, ttl=30, request_id="b")
    wait_until(lambda: reader_ticket(pool) == "b" and queued(rclient, pool_name) == 1)
    holder.release()
    b.result().release()
    assert_empty(rclient, pool_name)


def test_a_subscription_that_died_while_nobody_read_is_found_before_queueing(
    make_pool, rclient, pool_name, monkeypatch
):
    """The server drops the subscription connection while no thread waits (nobody reads it):
    the next acquire that may queue reads the connection first, finds it closed, subscribes
    again, and then gets its grant by the hand-off. Every lease here is not preemptible: a
    pool object holding a preemptible lease also subscribes its runtime's listener (for asks
    to yield), and this test counts the waiting threads' subscription alone."""
    monkeypatch.setattr(sync_listener, "IDLE_CHECK_S", 0.0)
    pool = make_pool(capacity=1, poll_interval=60)
    other = make_pool(capacity=1)
    # timeout=0: no subscription of its own
    holder = other.acquire(1, ttl=30, timeout=0, preemptible=False)
    a = Acquire(pool, 1, ttl=30, preemptible=False)
    wait_until(lambda: queued(rclient, pool_name) == 1)
    holder.release()
    a.result().release()  # subscribed, and idle now

    def subscribers() -> list[dict]:
        return [c for c in rclient.client_list() if int(c.get("sub", 0)) + int(c.get("ssub", 0))]

    (conn,) = subscribers()
    rclient.client_kill_filter(_id=conn["id"])
    wait_until(lambda: not subscribers(), what="the subscription dropped")
    assert sub(pool).subscribed  # nobody read it: the pool object has not noticed yet
    holder = other.acquire(1, ttl=30, timeout=0, preemptible=False)
    b = Acquire(pool, 1, ttl=30, preemptible=False)
    wait_until(lambda: queued(rclient, pool_name) == 1)
    assert [c["id"] for c in subscribers()] != [conn["id"]]  # subscribed again first
    holder.release()
    b.result().release()
    assert_empty(rclient, pool_name)


def test_grants_whose_message_is_lost_reach_the_reading_thread_by_the_poll(
    make_pool, rclient, pool_name, monkeypatch
):
    monkeypatch.setattr(sync_listener, "decode_events", lambda data: [])
    pool = make_pool(capacity=1, poll_interval=0.2)
    holder = make_pool(capacity=1).acquire(1, ttl=30)
    a = Acquire(pool, 1, ttl=30, request_id="a")
    wait_until(lambda: reader_ticket(pool) == "a" and queued(rclient, pool_name) == 1)
    holder.release()
    a.result().release()
    assert_empty(rclient, pool_name)


def test_close_ends_the_readers_wait_and_the_followers(make_pool, rclient, pool_name):
    pool = make_pool(capacity=1, poll_interval=60)
    other = make_pool(capacity=1)
    holder = other.acquire(1, ttl=30)
    a = Acquire(pool, 1, ttl=30, request_id="a")
    wait_until(lambda: reader_ticket(pool) == "a")
    b = Acquire(pool, 1, ttl=30, request_id="b")
    wait_until(lambda: follower_tickets(pool) == ["b"] and queued(rclient, pool_name) == 2)
    s = sub(pool)
    pool.close()
    for w in (a, b):
        with pytest.raises(PoolClosed):
            w.result()
    assert s._reader is None and s._ps is None  # the subscription's connection is closed
    assert other.status().waiter_count == 0
    holder.release()
    assert_empty(rclient, pool_name)
