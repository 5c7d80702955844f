"""Preemption on the core's side, without a server: acquire's ARGV 13, the yield requests
(hand-off message and renewal reply) decoded, a lease's yield state and callbacks, and the
preemption field a lease is re-asserted with."""

from __future__ import annotations

import logging

import pytest

from gpulock.errors import InvalidArgument
from gpulock.protocol import replies as _replies
from gpulock.protocol.lease import CLOCK_DRIFT, LeaseBase, LeaseState
from gpulock.protocol.request import AcquireOptions, AcquireRequest


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _request(**kw):
    return AcquireRequest.build("p", 1024, AcquireOptions(**kw), waiter_ttl=5.0, default_ttl=2.0)


def test_acquire_argv_sends_preemptible_only_when_false():
    assert len(_request().argv("wait", "c")) == 9  # the default: nothing more on the wire
    argv = _request(preemptible=False).argv("wait", "c")
    assert argv[9:] == ["", "", "", "0"]  # tenant, device, kind, preemptible
    argv = _request(preemptible=False, tenant="t", device=1, resident=True).argv("try", "c")
    assert argv[9:] == ["t", "1", "resident", "0"]
    assert _request(tenant="t").argv("wait", "c")[9:] == ["t"]


@pytest.mark.parametrize("bad", [0, 1, "no", None])
def test_preemptible_must_be_a_bool(bad):
    with pytest.raises(InvalidArgument, match="preemptible"):
        _request(preemptible=bad)


def test_decode_yields_and_events_keep_apart():
    a, b = "a" * 32, "b" * 32
    msg = f"y 5000\n{a} 35000\n{b} 36000".encode()
    assert _replies.decode_yields(msg) == [
        _replies.YieldAsk(a, 35_000, 5_000),
        _replies.YieldAsk(b, 36_000, 5_000),
    ]
    assert _replies.decode_events(msg) == []  # not a grant
    grant = f"g 5000\nt1 {a} 7 9000 512".encode()
    assert _replies.decode_yields(grant) == []
    assert len(_replies.decode_events(grant)) == 1


def test_decode_renew_reads_yields():
    r = [9_000, 4, [12_000, 0, 15_000], [], [], [0, 0, 15_000]]
    rep = _replies.decode_renew(r)
    assert rep.expiries == [12_000, 0, 15_000] and rep.yields == [0, 0, 15_000]
    old = _replies.decode_renew([9_000, 4, [12_000], []])  # a server before preemption
    assert old.yields == [0]


def _state(clock: _Clock, expires_ms: int = 12_000, now_ms: int = 10_000) -> LeaseState:
    g = _replies.Grant("t", "c" * 32, 7, expires_ms, 512, now_ms)
    from gpulock.protocol.lease import validity_deadline

    return LeaseState("p", g, 2.0, validity_deadline(clock(), now_ms, expires_ms), clock)


def test_asked_counts_the_deadline_like_the_validity():
    clock = _Clock()
    s = _state(clock)
    seen = []
    view = LeaseBase(s, None)
    view.on_yield(seen.append)
    assert not view.yield_requested and view.yield_deadline is None
    assert s.asked(13_000)
    assert seen == [view] and view.yield_requested
    # one server second after the expiry, shrunk by the drift bound, after valid_until
    assert view.yield_deadline == pytest.approx(s.valid_until + 1.0 * (1 - CLOCK_DRIFT))
    assert not s.asked(14_000)  # once: the first stays
    assert view.yield_deadline == pytest.approx(s.valid_until + 1.0 * (1 - CLOCK_DRIFT))
    late = []
    view.on_yield(late.append)  # registered after the fact: at once
    assert late == [view] and seen == [view]


def test_a_renewal_capped_at_the_deadline_stops_the_validity():
    clock = _Clock()
    s = _state(clock)
    # the renewal that tells the ask: its expiry is the deadline (capped), and yields says so
    s.renewed(clock(), 10_500, 11_500)
    s.asked(11_500)
    assert s.yield_deadline == pytest.approx(s.valid_until)
    end = s.valid_until
    clock.t += 0.3
    s.renewed(clock(), 10_800, 11_500)  # capped: the server no longer moves it
    # only the drift bound's share of the 0.3 s between the two renewals can move it
    assert s.valid_until <= end + 0.3 * CLOCK_DRIFT + 1e-9
    clock.t = s.valid_until
    # the reason names the take-back, not an unreachable server
    with pytest.raises(Exception, match="taken back: asked to yield"):
        s.check()


def test_a_lease_not_asked_past_its_deadline_blames_no_renewal():
    clock = _Clock()
    s = _state(clock)
    s.renewed(clock(), 10_500, 11_500)
    clock.t = s.valid_until
    with pytest.raises(Exception, match="no successful renewal before the local validity deadline"):
        s.check()


def test_on_yield_errors_are_logged(caplog):
    clock = _Clock()
    s = _state(clock)
    view = LeaseBase(s, None)

    def boom(_lease):
        raise RuntimeError("boom")

    view.on_yield(boom)
    with caplog.at_level(logging.ERROR, logger="gpulock"):
        assert s.asked(13_000)
    assert "on_yield callback raised" in caplog.text


def test_no_yield_after_release_or_loss():
    clock = _Clock()
    s = _state(clock)
    s.released = True
    assert not s.asked(13_000) and s.yield_deadline is None
    s2 = _state(clock)
    s2.mark_lost("gone")
    assert not s2.asked(13_000)


def test_preemption_field():
    clock = _Clock()
    s = _state(clock)
    s.priority = -3
    assert s.preemption_field("abc") == "-3|abc"
    s.preemptible = False
    assert s.preemption_field("abc") == ""
    s.preemptible, s.resident = True, True
    assert s.preemption_field("abc") == ""


def test_on_yield_needs_a_callable_at_once():
    """A callback that is not callable is refused when it is given, not when the ask comes."""
    from gpulock_common.aio import plain_or_coroutine

    s = _state(_Clock())
    with pytest.raises(TypeError, match="on_yield takes a callable, got 42"):
        s.add_yield_callback(42)
    with pytest.raises(TypeError, match="on_yield takes a callable, got 42"):
        plain_or_coroutine(42, lambda c: None, "on_yield", logging.getLogger("t"))
