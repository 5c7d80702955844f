"""The kept-places rule the FastAPI service and the broker share (gpulock.http.places): holds,
extension by each answer, attachment and busy places, withdrawal by the place's own timer.

Holds are tens of milliseconds on the real event-loop clock; every assertion is on observed
state (the withdrawal callback's event, the clock at that moment), none on how soon a timer
ran."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import pytest

from gpulock.http.places import RECHECK_S, KeptPlace, KeptPlaces, hold_for

pytestmark = pytest.mark.timeout(30)


class Expiries:
    """Records withdrawals: (key, place, clock at the call)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, KeptPlace, float]] = []
        self.event = asyncio.Event()

    def __call__(self, key: str, place: KeptPlace) -> None:
        self.seen.append((key, place, time.monotonic()))
        self.event.set()

    async def next(self, timeout: float = 10.0) -> tuple[str, KeptPlace, float]:
        await asyncio.wait_for(self.event.wait(), timeout)
        self.event.clear()
        return self.seen[-1]


def test_hold_for_covers_twice_the_retry_after_within_the_cap():
    assert hold_for(0, hold=5.0) == 5.0
    assert hold_for(4, hold=5.0) == 10.0  # 2 * 4 + 2
    assert hold_for(40, hold=5.0, cap=30.0) == 30.0
    assert hold_for(4, hold=5.0, extra=6.0) == 16.0  # the grace left comes on top
    assert hold_for(1, hold=0.5, cap=math.inf) == 4.0


async def test_a_detached_place_is_withdrawn_once_its_hold_ran_out():
    exp = Expiries()
    places: KeptPlaces[str, KeptPlace] = KeptPlaces(0.05, exp)
    p = places.attach("a", KeptPlace)
    assert places.get("a") is p and p.attached == 1
    places.detach("a", p, keep=True)
    kept_until = p.until
    key, got, at = await exp.next()
    assert (key, got) == ("a", p) and at >= kept_until
    assert places.get("a") is None and len(places) == 0


async def test_each_answer_extends_the_hold_and_keep_never_shortens_it():
    exp = Expiries()
    places: KeptPlaces[str, KeptPlace] = KeptPlaces(0.05, exp)
    p = places.attach("a", KeptPlace)
    places.keep("a", p, until=time.monotonic() + 0.3)  # an answer that told a Retry-After
    places.detach("a", p, keep=True)  # the shorter default hold does not cut it back
    assert p.until - time.monotonic() > 0.2
    places.keep("a", p, until=time.monotonic() + 0.01)  # nor does a shorter keep
    until = p.until
    assert until - time.monotonic() > 0.2
    _, _, at = await exp.next()
    assert at >= until


async def test_an_attached_or_busy_place_is_not_withdrawn():
    @dataclass(eq=False)
    class Busy(KeptPlace):
        calls: int = 0

        def busy(self) -> bool:
            return self.attached > 0 or self.calls > 0

    exp = Expiries()
    places: KeptPlaces[str, Busy] = KeptPlaces(0.02, exp)
    p = places.attach("a", Busy)
    places.keep("a", p, until=time.monotonic())  # due now, but a request is attached
    q = places.attach("b", Busy)
    q.calls = 1
    places.detach("b", q, keep=False)  # nothing attached, but a call is in flight
    assert places.get("b") is q
    await asyncio.sleep(3 * RECHECK_S)  # timers ran (and re-armed) meanwhile
    assert exp.seen == [] and places.get("a") is p and places.get("b") is q
    q.calls = 0  # the call ended: withdrawn at the next look
    key, got, _ = await exp.next()
    assert (key, got) == ("b", q)
    places.detach("a", p, keep=True)
    key, got, _ = await exp.next()
    assert (key, got) == ("a", p)


async def test_a_final_answer_drops_the_place_without_withdrawing_it():
    exp = Expiries()
    places: KeptPlaces[str, KeptPlace] = KeptPlaces(0.02, exp)
    p = places.attach("a", KeptPlace)
    places.keep("a", p, until=time.monotonic() + 0.02)
    places.detach("a", p, keep=False)  # granted: settled by the caller
    assert places.get("a") is None and p.timer is None
    await asyncio.sleep(0.1)
    assert exp.seen == []


async def test_discard_is_by_identity_and_on_expire_may_keep_it_again():
    exp = Expiries()
    again: list[int] = []
    places: KeptPlaces[str, KeptPlace]

    def on_expire(key: str, place: KeptPlace) -> None:
        exp(key, place)
        if not again:  # the first time: someone asked for more (the service's follower hold)
            again.append(1)
            places.keep(key, place, until=time.monotonic() + 0.05)

    places = KeptPlaces(0.02, on_expire)
    old = KeptPlace()
    places.keep("a", old, until=time.monotonic() + 10)
    new = KeptPlace()
    places.keep("a", new, until=time.monotonic())  # another place is kept for "a": ignored
    assert places.get("a") is old and new.timer is None
    assert places.discard("a", new) is None and places.get("a") is old
    assert places.discard("a", old) is old and old.timer is None
    places.keep("a", new, until=time.monotonic() + 0.02)
    await exp.next()
    assert places.get("a") is new  # kept again by on_expire
    _, _, at = await exp.next()
    assert places.get("a") is None and at >= new.until


async def test_clear_cancels_every_timer():
    exp = Expiries()
    places: KeptPlaces[str, KeptPlace] = KeptPlaces(0.02, exp)
    ps = [KeptPlace() for _ in range(3)]
    for i, p in enumerate(ps):
        places.keep(str(i), p, until=time.monotonic() + 0.02)
    assert [k for k, _ in places.clear()] == ["0", "1", "2"]
    assert len(places) == 0 and all(p.timer is None for p in ps)
    await asyncio.sleep(0.1)
    assert exp.seen == []
