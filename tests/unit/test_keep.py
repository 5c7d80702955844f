"""The I/O-free rules of kept bytes (gpulock/protocol/keep.py; docs/SEMANTICS.md "Kept bytes"):
what an acquire may take from an idle kept lease, what a release puts back, draining, expiry,
and the fork rule. The scripts' side is tested against real servers in
tests/integration/test_keep_core.py."""

from __future__ import annotations

import os

import pytest

from gpulock.protocol.keep import MIN_LEFT_S, KeptLeases, take_for
from gpulock.protocol.lease import LeaseState
from gpulock.protocol.replies import Grant


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(clock: Clock, held: dict[str, LeaseState], *, amount: int = 60, device: int = 0):
    k = KeptLeases(30.0, clock, hold=lambda s: held.__setitem__(s.lease_id, s))
    g = Grant("t" * 32, f"{len(held):032x}", 7, 5_000, amount, 1_000, device=device)
    s = LeaseState("p", g, 10.0, clock() + 6.0, clock)
    s.keeper = k
    held[s.lease_id] = s
    return k, s


def test_adopt_then_take_hands_the_same_lease_on() -> None:
    clock, held = Clock(), {}
    k, s = make(clock, held)
    idle = k.adopt(s)
    assert s.released and not idle.released and idle.kept
    assert held[s.lease_id] is idle  # the heartbeat renews the idle one now
    got = take_for(k, 10.0, 60, None, None, None, None, 0, None, None, True)
    assert got is not None
    assert (got.lease_id, got.token, got.amount) == (s.lease_id, s.token, 60)
    assert idle.released and held[s.lease_id] is got
    assert k.idle_count == 0 and k.grants == 1
    # nothing left to take: a second acquire asks Redis
    assert take_for(k, 10.0, 60, None, None, None, None, 0, None, None, True) is None
    back = k.put_back(got)
    assert back is not None and got.released and held[s.lease_id] is back
    assert k.idle_count == 1


@pytest.mark.parametrize(
    "kw",
    [
        {"amount": 59},
        {"amount": 61},
        {"ttl": 11},
        {"priority": 1},
        {"tenant": "alice"},
        {"device": 1},
        {"preemptible": False},
    ],
)
def test_only_an_exact_fit_is_taken(kw: dict) -> None:
    clock, held = Clock(), {}
    k, s = make(clock, held)
    k.adopt(s)
    args = {"amount": 60, "ttl": None, "priority": 0, "tenant": None, "device": None}
    args["preemptible"] = True
    args.update(kw)
    got = take_for(
        k, 10.0, args["amount"], args["ttl"], None, None, None, args["priority"],
        args["tenant"], args["device"], args["preemptible"],
    )  # fmt: skip
    assert got is None and k.idle_count == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"timeout": -1},
        {"timeout": "5"},
        {"timeout": True},
        {"holder": ["x"]},
        {"on_queued": 3},
        {"priority": 0.0},
        {"amount": "lots"},
        {"amount": 60.0},
        {"ttl": "10s"},
    ],
)
def test_unusual_arguments_go_the_full_path(bad: dict) -> None:
    """The fast path grants nothing for an argument it does not check cheaply: the full path
    then validates it (and names a bad one)."""
    clock, held = Clock(), {}
    k, s = make(clock, held)
    k.adopt(s)
    a = {"amount": 60, "ttl": None, "timeout": None, "holder": None, "on_queued": None}
    a["priority"] = 0
    a.update(bad)
    got = take_for(
        k, 10.0, a["amount"], a["ttl"], a["timeout"], a["holder"], a["on_queued"],
        a["priority"], None, None, True,
    )  # fmt: skip
    assert got is None and k.idle_count == 1


def test_size_strings_and_pinned_devices_fit() -> None:
    clock, held = Clock(), {}
    k, s = make(clock, held, amount=4 << 30, device=2)
    k.adopt(s)
    assert take_for(k, 10.0, "4GiB", 10, 5, {"job": "x"}, print, 0, "", 2, True) is not None


def test_draining_stops_grants_until_the_server_keeps_again() -> None:
    clock, held = Clock(), {}
    k, s = make(clock, held)
    idle = k.adopt(s)
    given = k.give_back()
    assert given == [idle] and k.draining and k.idle_count == 0
    # a grant made before the request came (in use) goes to Redis at its release
    _, s2 = make(clock, held)
    s2.kept = True
    assert k.put_back(s2) is None and not s2.released
    k.adopt(s2)  # the server answered "kept": nobody waits any more
    assert not k.draining
    assert take_for(k, 10.0, 60, None, None, None, None, 0, None, None, True) is not None


def test_expired_gives_back_an_idle_lease_whose_validity_runs_short() -> None:
    clock, held = Clock(), {}
    k, s = make(clock, held)
    idle = k.adopt(s)
    clock.t = idle.valid_until - 0.4  # under 0.5 s left: its renewals are failing
    assert k.expired() == [idle]


def test_lost_asked_or_short_leases_are_neither_taken_nor_put_back() -> None:
    clock, held = Clock(), {}
    k, s = make(clock, held)
    idle = k.adopt(s)
    clock.t = idle.valid_until - MIN_LEFT_S + 0.01  # too little validity left to start work
    assert take_for(k, 10.0, 60, None, None, None, None, 0, None, None, True) is None
    clock.t = 100.0
    idle.asked(idle.expires_ms)
    assert take_for(k, 10.0, 60, None, None, None, None, 0, None, None, True) is None
    _, s3 = make(clock, held)
    s3.kept = True
    s3.mark_lost("gone")
    assert k.put_back(s3) is None


def test_expired_gives_back_what_idled_keep_seconds() -> None:
    clock, held = Clock(), {}
    k, s = make(clock, held)
    idle = k.adopt(s)
    idle.valid_until = clock() + 100.0  # renewed meanwhile
    clock.t += 29.0
    assert k.expired() == []
    clock.t += 1.0
    assert k.expired() == [idle] and k.idle_count == 0 and not k.draining


def test_stop_keeps_nothing_more() -> None:
    clock, held = Clock(), {}
    k, s = make(clock, held)
    idle = k.adopt(s)
    assert k.stop() == [idle]
    _, s2 = make(clock, held)
    s2.kept = True
    assert k.put_back(s2) is None and not k.on


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_grants_from_its_parents_kept_leases() -> None:
    clock, held = Clock(), {}
    k, s = make(clock, held)
    k.adopt(s)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it could take, then leave at once
        got = take_for(k, 10.0, 60, None, None, None, None, 0, None, None, True)
        os.write(w, b"none" if got is None and not k.on else b"took")
        os._exit(0)
    os.close(w)
    answer = os.read(r, 16)
    os.waitpid(pid, 0)
    assert answer == b"none"
    assert k.idle_count == 1  # the parent keeps its own
