"""gpulock-client's wait-connection gate (I/O-free, in the core): FIFO hand-over, withdrawing,
and how acquire_steps takes and gives back a slot (driven with a fake clock and canned
replies, no network)."""

from __future__ import annotations

import random

import pytest
from gpulock_client import _core as core
from gpulock_client.errors import AcquireTimeout, InvalidArgument


class W:
    def __init__(self, name, willing=True):
        self.name, self.willing, self.woken = name, willing, False

    def wake(self):
        if not self.willing:
            return False
        self.woken = True
        return True


def test_gate_is_fifo_and_hands_slots_over():
    g = core.Gate(2)
    a, b, c, d, e = (W(x) for x in "abcde")
    assert g.enter(a) and g.enter(b) and g.in_use == 2
    assert not g.enter(c) and not g.enter(d) and g.waiting == 2
    g.leave()  # a's slot goes to c, the first in line
    assert c.woken and not d.woken and g.in_use == 2 and g.waiting == 1
    assert not g.enter(e)  # behind d, although nothing is free yet
    g.withdraw(d)  # d stops waiting (timeout); e is next
    g.leave()
    assert e.woken and not d.woken
    g.leave()
    g.leave()
    assert g.in_use == 0 and g.waiting == 0
    assert g.enter(W("f"))  # free again: at once


def test_gate_skips_waiters_that_stopped_waiting():
    g = core.Gate(1)
    assert g.enter(W("a"))
    gone, next_ = W("gone", willing=False), W("next")
    assert not g.enter(gone) and not g.enter(next_)
    g.leave()
    assert next_.woken and g.in_use == 1 and g.waiting == 0
    g.leave()
    assert g.in_use == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_gate_size_is_checked(bad):
    with pytest.raises(InvalidArgument):
        core.Gate(bad)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _cfg(clock, gate):
    return core.PoolConfig("p", max_wait=5, clock=clock, rng=random.Random(1), gate=gate)


GRANT = {
    "lease_id": "a" * 32,
    "amount": 5,
    "token": 7,
    "ttl": 30.0,
    "expires_in": 30.0,
    "expires_at": 1e9,
    "acquired_at": 1e9,
    "request_id": "r",
}


def test_acquire_enters_first_holds_the_slot_to_the_end_and_leaves():
    clock, gate = Clock(), core.Gate(1)
    gen = core.acquire_steps(
        _cfg(clock, gate),
        5,
        core.AcquireOptions(ttl=None, timeout=10, holder=None, request_id="r"),
        on_queued=None,
    )
    step = gen.send(None)
    assert isinstance(step, core.Enter) and step.gate is gate and step.deadline == 110.0
    assert gate.enter(W("driver"))  # what the driver does for the step
    post = gen.send(True)
    assert isinstance(post, core.Http) and post.lane == core.WAIT and post.json["wait"] == 5
    queued = core.Reply(
        503, {"retry-after": "0"}, {"detail": {"error": "queued", "position": 1}}, clock()
    )
    assert isinstance(gen.send(queued), core.Sleep)
    assert gate.in_use == 1  # kept across the long polls
    assert gen.send(None).lane == core.WAIT
    with pytest.raises(StopIteration) as stop:
        gen.send(core.Reply(201, {}, GRANT, clock()))
    assert stop.value.value[0]["lease_id"] == "a" * 32
    assert gate.in_use == 0


def test_no_slot_before_the_timeout_is_acquire_timeout_at_position_0():
    clock, gate = Clock(), core.Gate(1)
    gen = core.acquire_steps(
        _cfg(clock, gate),
        5,
        core.AcquireOptions(ttl=None, timeout=2, holder=None, request_id="r"),
        on_queued=None,
    )
    assert isinstance(gen.send(None), core.Enter)
    clock.t += 2
    with pytest.raises(AcquireTimeout) as e:
        gen.send(False)
    assert e.value.position == 0 and e.value.waited == 2 and "max_connections" in str(e.value)
    assert "no grant of 5 within 2.0s:" in str(e.value)
    assert gate.in_use == 0  # it never held one
    # a computed timeout prints to the millisecond
    gen = core.acquire_steps(
        _cfg(clock, gate),
        5,
        core.AcquireOptions(ttl=None, timeout=0.6995481290000498, holder=None, request_id="r"),
        on_queued=None,
    )
    assert isinstance(gen.send(None), core.Enter)
    clock.t += 1
    with pytest.raises(AcquireTimeout, match=r"no grant of 5 within 0\.7s: it waited"):
        gen.send(False)


def test_an_interrupted_acquire_leaves_the_gate_when_closed():
    clock, gate = Clock(), core.Gate(1)
    gen = core.acquire_steps(
        _cfg(clock, gate),
        5,
        core.AcquireOptions(ttl=None, timeout=None, holder=None, request_id="r"),
        on_queued=None,
    )
    gen.send(None)
    assert gate.enter(W("driver"))
    assert isinstance(gen.send(True), core.Http)
    gen.close()  # the driver's finally after a KeyboardInterrupt / CancelledError mid-request
    assert gate.in_use == 0


def test_timeout_zero_skips_the_gate_and_goes_on_the_control_lane():
    clock, gate = Clock(), core.Gate(1)
    assert gate.enter(W("other"))  # every wait connection taken
    gen = core.acquire_steps(
        _cfg(clock, gate),
        5,
        core.AcquireOptions(ttl=None, timeout=0, holder=None, request_id="r"),
        on_queued=None,
    )
    step = gen.send(None)
    assert isinstance(step, core.Http) and step.lane == core.CONTROL and step.json["queue"] is False
