"""The sync Pool's hand-off subscription, read by the threads that wait for grants.

In the asyncio shell a task of the event loop reads the subscription (:mod:`gpulock.runtime.listener`).
For a blocking acquire that would put a thread crossing into every hand-off: the Pool's loop
thread reads the grant, then the waiting thread must be woken and get the GIL. Here the
threads that wait read the connection themselves, one at a time (the *reader*): a reader that
reads its own grant returns with it, no other thread involved; the other grants it reads go
to the runtime (``on_grants``, on the reader's thread), whose registry completes those
waiters' futures, which wakes their threads (the *followers*). A reader that stops waiting
hands the reading to a follower. While no thread waits nobody reads: what arrives then waits
in the socket (a grant for a request given up, which its withdrawal gives back anyway), and
an acquire that may queue first reads a connection idle for :data:`IDLE_CHECK_S`, so that one
that died meanwhile is found before the acquire's grant would be missed on it.

What the connection does (subscribe, confirmations, failures and retries, Redis 6.2, slot
moves) is :meth:`gpulock.transport.pubsub.Connection.life`, the same the asyncio hub drives; this module
carries out its steps, on a connection of its own per Pool object
(:func:`gpulock.transport.connect.subscription_client`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Generator, Sequence
from typing import Any, Callable

from gpulock.transport.cluster import is_cluster_client
from gpulock.transport.connect import subscription_client
from gpulock.transport.pubsub import (
    CONFIRM_WAIT_S,
    Channel,
    Close,
    Connection,
    Open,
    Pause,
    Read,
    Send,
    SubStep,
)
from gpulock.protocol.replies import (
    Grant,
    YieldAsk,
    decode_events,
    decode_give_back,
    decode_yields,
)

#: The longest a reader sits in one read of the connection (s) before it looks at its own wait
#: again: a grant the heartbeat found, close() or a failure reach a reading thread within this.
READ_SLICE_S = 0.05

#: A subscription nobody has read for this long (s) is read once, without waiting, before an
#: acquire queues on it: a connection that died meanwhile (a restart, a proxy) is found then,
#: not after the grant it would have missed.
IDLE_CHECK_S = 1.0

_PENDING = object()  # a step not over yet (a pause): the next reader goes on with it


class ThreadWait:
    """One thread's wait in a :class:`ThreadSubscription`: for the grant of ``ticket`` (a
    blocking acquire's), or for the subscription's confirmation (``ticket`` None).

    As a :class:`~gpulock.runtime.waiters.WaiterFuture` watcher it is called (on the Pool's loop
    thread) when its waiter's future is done, and wakes the thread; :meth:`cancel` does the
    same when the loop thread stopped (``closed`` then). ``got``: the grant, when the thread
    read it itself as the reader. Waking it once the thread stopped waiting does nothing."""

    __slots__ = (
        "_sub",
        "ticket",
        "_lock",
        "_signalled",
        "done",
        "left",
        "closed",
        "got",
        "__weakref__",
    )

    def __init__(self, sub: ThreadSubscription, ticket: str | None):
        self._sub = sub
        self.ticket = ticket
        self._lock = threading.Lock()
        self._lock.acquire()  # released to wake the thread (see ThreadSubscription._signal)
        self._signalled = False
        self.done = False  # the waiter's future is done (or the loop thread stopped)
        self.left = False  # the thread stopped waiting
        self.closed = False
        self.got: Grant | None = None

    def __call__(self, _future: object = None) -> None:
        self._sub._finish(self, closed=False)

    def cancel(self) -> None:
        """The Pool's loop thread stopped: wake the thread (``closed``)."""
        self._sub._finish(self, closed=True)


class ThreadSubscription:
    """The hand-off subscription of one sync Pool object: ``channel`` on a connection of its
    own to the server of ``client`` (a sync client, or cluster client) that serves it; the
    grants read go to the reading thread itself when one is its own, the others to
    ``on_grants`` (a list of :class:`~gpulock.protocol.replies.Grant`; called on the reading thread).
    ``pool`` names it in messages; ``resubscribed()`` is called (on the reading thread) when
    the subscription is back after it was lost; ``on_yields`` gets the yield requests read
    (preemption; a list of :class:`~gpulock.protocol.replies.YieldAsk`, on the reading
    thread), and ``on_give_back()`` is called when the server asks for kept bytes back. While
    no thread waits, the runtime's own listener reads them."""

    def __init__(
        self,
        client: Any,
        channel: str,
        pool: str,
        on_grants: Callable[[Sequence[Grant]], None],
        resubscribed: Callable[[], None] | None = None,
        on_yields: Callable[[Sequence[YieldAsk]], None] | None = None,
        on_give_back: Callable[[], None] | None = None,
    ):
        self.pool = pool
        self._redis = client
        self._on_grants = on_grants
        self._on_yields = on_yields
        self._on_give_back = on_give_back
        self.channel = Channel(
            channel, self._on_message, event=threading.Event, resubscribed=resubscribed
        )
        self.conn = Connection(f"pub/sub subscription of pool {pool}")
        self.conn.channels[channel] = self.channel
        self._mutex = threading.Lock()  # the reader, the followers, each wait's flags
        self._reader: ThreadWait | None = None
        self._followers: deque[ThreadWait] = deque()
        self.closed = False
        # The reader's alone: the life, its pending step, the connection.
        self._life: Generator[SubStep, Any, None] = self.conn.life()
        self._step: SubStep | None = next(self._life)
        self._client: Any = None
        self._node: str | None = None  # host:port of the server of the last connection
        self._open: Any = None  # the PubSub the life opened and has not closed
        self._ps: Any = None  # the live one, once its subscription was sent
        self._resume_at: float | None = None  # the end of a pause in progress
        self._read_at = 0.0  # when a read of the connection last returned (monotonic s)

    @property
    def subscribed(self) -> bool:
        """Whether the server confirmed the subscription (and the connection did not fail
        since, as far as a reader saw)."""
        return bool(self.channel.subscribed.is_set())

    @property
    def ready(self) -> bool:
        """Whether an acquire may queue without :meth:`ensure_subscribed`: subscribed, and
        read by a thread now or within :data:`IDLE_CHECK_S`."""
        return self.channel.subscribed.is_set() and (
            self._reader is not None or time.monotonic() - self._read_at < IDLE_CHECK_S
        )

    def ensure_subscribed(self) -> None:
        """Subscribe, and wait up to :data:`gpulock.transport.pubsub.CONFIRM_WAIT_S` until Redis
        confirmed it, so that no grant published after the next enqueue can be missed
        (reading the connection meanwhile if no other thread does; one nobody read for
        :data:`IDLE_CHECK_S` is read first). Raises what
        :meth:`gpulock.transport.pubsub.Channel.after_news` raises."""
        if self.ready:
            return
        if self.subscribed:
            self._check()
        ch = self.channel
        if not ch.awaiting_news():
            return
        w = ThreadWait(self, None)
        in_time = self._take_part(
            w,
            time.monotonic() + CONFIRM_WAIT_S,
            lambda: ch.news.is_set() or self.closed,
            poll=READ_SLICE_S,
        )
        ch.after_news(self.pool, in_time)

    def wait(self, w: ThreadWait, timeout: float | None) -> bool:
        """Block the calling thread in ``w`` (made for it, and watching its waiter's future)
        until its grant is read or its future is done (True), or for ``timeout`` seconds (None:
        no limit; False), reading the connection while it is the reader."""
        until = None if timeout is None else time.monotonic() + timeout
        return self._take_part(w, until, lambda: w.done or w.got is not None)

    def close(self) -> None:
        """No more reading: the connection is closed now, or by the reader when it leaves."""
        with self._mutex:
            self.closed = True
            self.conn.channels.clear()  # the life ends
            idle = self._reader is None
        if idle:
            self._drop()

    def _check(self) -> None:
        """Read what waits on the connection, without waiting, unless a thread reads it: up
        to a read that finds nothing, or to the pause after a failure (then the channel is
        unsubscribed, and the caller waits for the next attempt's news)."""
        w = ThreadWait(self, None)
        with self._mutex:
            if self._reader is not None or self.closed:
                return
            self._reader = w
        try:
            while self._step is not None and not isinstance(self._step, Pause):
                step = self._step
                if self._advance(w, 0.0) is None and isinstance(step, Read):
                    break  # nothing more waits
        finally:
            self._leave(w)

    # ---- the reader and the followers ---------------------------------------------------
    def _take_part(
        self,
        w: ThreadWait,
        until: float | None,
        done: Callable[[], bool],
        poll: float | None = None,
    ) -> bool:
        """Wait in ``w`` until ``done()`` (True) or ``until`` (monotonic s; False): as the reader
        when nobody reads, else as a follower, woken by its future, by the reading handed to it,
        or (``poll``) every that many seconds."""
        with self._mutex:
            if self._reader is None and not self.closed:
                self._reader = w
            else:
                self._followers.append(w)
        try:
            while not done():
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if self._reader is w and self._step is not None:
                    self._advance(w, left)
                elif poll is None or (left is not None and left < poll):
                    self._block(w, left)
                else:
                    self._block(w, poll)
            return True
        finally:
            self._leave(w)

    def _leave(self, w: ThreadWait) -> None:
        with self._mutex:
            w.left = True
            if self._reader is not w:
                try:
                    self._followers.remove(w)
                except ValueError:
                    pass
                return
            self._reader = None
            while self._followers:
                nxt = self._followers.popleft()
                if not nxt.left:
                    self._reader = nxt
                    self._signal(nxt)
                    break
            drop = self.closed and self._reader is None
        if drop:
            self._drop()

    def _signal(self, w: ThreadWait) -> None:
        """Wake ``w``'s thread (the mutex held); a wake it has not taken yet stays."""
        if not w._signalled:
            w._signalled = True
            w._lock.release()

    def _block(self, w: ThreadWait, timeout: float | None) -> None:
        if w._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            with self._mutex:
                w._signalled = False

    def _finish(self, w: ThreadWait, closed: bool) -> None:
        with self._mutex:
            if w.done or w.left:
                return
            w.done, w.closed = True, closed
            self._signal(w)

    # ---- the reader's work: the connection's life, a step at a time -----------------------
    def _advance(self, w: ThreadWait, left: float | None) -> Any:
        """Carry out the pending step (a read for at most ``left`` seconds and
        :data:`READ_SLICE_S`) and go on to the next one. Returns the step's result (a read's
        message, or None), ``_PENDING`` for a pause not over, or the error it raised."""
        step = self._step
        assert step is not None  # the caller checked
        try:
            reply = self._do(step, w, left)
        except Exception as e:  # noqa: BLE001 - the life decides; anything else stops the reader
            self._resume(e, error=True)
            return e
        if reply is not _PENDING:
            self._resume(reply)
        return reply

    def _resume(self, value: Any, error: bool = False) -> None:
        # The life is driven one step per call, by whichever thread reads at the time (the
        # reading passes between waiting threads), not by one loop: so not by
        # gpulock_common.driver.drive, though by its rules (a result sent in, an Exception
        # thrown in).
        try:
            self._step = self._life.throw(value) if error else self._life.send(value)
        except StopIteration:
            self._step = None  # closed: no channel left
        except BaseException:
            # Interrupted inside the life (a KeyboardInterrupt while it handled a message):
            # the next reader starts it again, on a new connection. Its confirmation is news
            # still to come: an acquire must wait for it (ensure_subscribed) before it queues,
            # or a grant published before the new subscription is lost.
            self.channel.subscribed.clear()
            self.channel.news.clear()
            self._drop()
            self._life = self.conn.life()
            self._step = next(self._life, None)
            raise

    def _do(self, step: SubStep, w: ThreadWait, left: float | None) -> Any:
        if isinstance(step, Read):
            wait = READ_SLICE_S if left is None else min(READ_SLICE_S, left)
            msg = self._ps.get_message(timeout=wait)
            self._read_at = time.monotonic()
            return msg
        if isinstance(step, Open):
            self._drop()  # one an interrupted step left
            self._client = subscription_client(self._redis, self.channel.name)
            ckw = self._client.connection_pool.connection_kwargs
            self._node = f"{ckw.get('host')}:{ckw.get('port')}"
            self._open = self._client.pubsub(ignore_subscribe_messages=False)
            return None
        if isinstance(step, Send):
            self._ps = self._open
            if step.sharded:
                self._ps.ssubscribe(*step.names)
            else:
                self._ps.subscribe(*step.names)
            return None
        if isinstance(step, Close):
            self._drop()
            return None
        if isinstance(step, Pause):
            now = time.monotonic()
            if self._resume_at is None:
                self._resume_at = now + step.seconds
            if now < self._resume_at:
                pause = self._resume_at - now
                self._block(w, pause if left is None else min(pause, left))
                if time.monotonic() < self._resume_at:
                    return _PENDING
            self._resume_at = None
            return None
        if is_cluster_client(self._redis):  # Regroup: the channel's slot may have moved
            from gpulock.transport.shards import SyncShards, shards_of, slot_of

            shards = shards_of(self._redis)
            assert isinstance(shards, SyncShards)
            try:  # asked of a node other than the one the connection was on
                shards.refresh(slot_of(self.channel.name), self._node)
            except Exception:  # noqa: BLE001 - the cluster is still away: the next Open fails
                pass
        return None

    def _drop(self) -> None:
        """Close the connection quietly, if one is open."""
        ps, client = self._open, self._client
        self._open = self._ps = self._client = None
        for c in (ps, client):
            if c is not None:
                try:
                    c.close()
                except Exception:  # noqa: BLE001 - being dropped anyway
                    pass

    def _on_message(self, data: bytes) -> None:
        """A message of the channel, in the reader's thread: the reader keeps its own grant
        (its acquire hands it on to others sharing its waiter when it leaves it: see
        :meth:`gpulock.runtime.runtime.Runtime.leave_waiter`); the others go to the runtime."""
        grants = decode_events(data)
        if not grants:
            asks = decode_yields(data)
            if asks and self._on_yields is not None:
                self._on_yields(asks)
            elif self._on_give_back is not None and decode_give_back(data) is not None:
                self._on_give_back()  # kept bytes: someone waits (gpulock.runtime.kept)
            return
        r = self._reader
        if r is not None and r.ticket is not None:
            mine = [g for g in grants if g.ticket == r.ticket]
            if mine:
                r.got = mine[-1]
                grants = [g for g in grants if g.ticket != r.ticket]
        if grants:
            self._on_grants(grants)
