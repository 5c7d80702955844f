"""The release flows (:mod:`gpulock.protocol.flow`'s conventions: I/O-free generators of
steps): :func:`release` and :func:`release_kept` (one ``release.lua`` call, with ``keep`` mode
for kept bytes: :mod:`gpulock.protocol.keep`) and :func:`release_lease` (a held lease's
``release()``). Re-exported by :mod:`gpulock.protocol.flow`."""

from __future__ import annotations

from gpulock_common import traces

from gpulock.errors import LeaseLost
from gpulock.protocol.lease import LeaseState
from gpulock.protocol.replies import ReleaseReply, decode_release
from gpulock.protocol.steps import LISTEN, Eval, Flow, RuntimeView, Unanswered, Withdraw


def release(
    pool: str, lease_id: str, token: int, bound: float | None = None, keep_on: str = ""
) -> Flow[tuple[bool, int]]:
    """``release.lua`` once: returns ``(released, server_now_ms)``. False: the server no
    longer had the lease, and nothing of others was freed. The first try may have run when
    it fails with a connection error: a retry that then finds no lease cannot tell "released
    by us just now" from "lost", so it counts as released. Retried for ``bound`` seconds
    (default backend_timeout). ``keep_on``: a channel id asks for ``keep`` mode (the
    lease is kept when nobody waits: :func:`release_kept` reads that answer).

    Raises: BackendUnavailable."""
    rep = yield from release_kept(lease_id, token, bound, keep_on)
    return rep.released, rep.now_ms


def release_kept(
    lease_id: str, token: int, bound: float | None = None, keep_on: str = ""
) -> Flow[ReleaseReply]:
    """:func:`release`'s call, answering the whole reply (``kept``: the server keeps the lease
    for this holder, ``keep_on`` its channel id). A retry after an unanswered first try is
    sent without ``keep``: the first may have kept the lease, and a plain release then ends it
    either way (counted as released)."""
    args = [lease_id, str(token)]
    if keep_on:
        args += ["keep", keep_on]
    try:
        r = yield Eval("release", args, bound=0)
    except Unanswered:
        rep = decode_release((yield Eval("release", args[:2], bound=bound)))
        return rep._replace(released=True, kept=False)
    return decode_release(r)


def release_lease(s: LeaseState, rt: RuntimeView | None) -> Flow[None]:
    """A held lease's ``release()`` (idempotent: later calls do nothing); ``rt`` stops its
    heartbeat.

    Retried while the lease is still valid (its local deadline; at least 1 s): after that the
    server frees its bytes at expiry anyway.

    Raises:
        LeaseLost: the server no longer had it (it expired or was reaped), or it had been
            found lost before; nothing of others is freed.
        BackendUnavailable: Redis unreachable within the retry bound (it expires after its ttl).
    """
    if s.released:
        return None
    was_lost = s.lost_reason
    keeper = s.keeper
    keep_on = ""
    if (
        rt is not None
        and keeper is not None
        and keeper.on
        and was_lost is None
        and not s.yield_requested
    ):
        keep_on = rt.channel_id  # nobody waiting: the server keeps it (protocol/keep.py)
    s.released = True
    bound = max(1.0, s.seconds_left())
    if rt is not None and not keep_on:
        rt.untrack(s.lease_id)  # a dict pop: safe from any thread
    try:
        if keep_on and not rt.listening:  # type: ignore[union-attr]
            yield LISTEN  # a request for the kept bytes back comes on the channel: listen first
        rep = yield from release_kept(s.lease_id, s.token, bound, keep_on)
        ok = rep.released
    except BaseException as e:
        if keep_on:
            rt.untrack(s.lease_id)  # type: ignore[union-attr]
        if rt is not None and not isinstance(e, (Exception, GeneratorExit)):
            # Interrupted (a cancellation, Ctrl-C): the call may or may not have run, and one in
            # keep mode may have kept the lease for a holder that no longer knows it. A plain
            # release in the background ends it either way (a second one finds nothing).
            yield Withdraw(s.lease_id, True, "release", [s.lease_id, str(s.token)])
        elif s.span is not None:
            traces.lost(s, f"its release failed ({e}); it expires on the server")
        raise
    if keep_on:
        if rep.kept:
            rt.track(keeper.adopt(s))  # type: ignore[union-attr]
        else:
            rt.untrack(s.lease_id)  # type: ignore[union-attr]
    if s.span is not None and ok:
        traces.released(s)
    elif s.span is not None:
        traces.lost(s, "the server no longer had it when it was released")
    if not ok and was_lost is None:
        raise LeaseLost(
            s.lease_id,
            "the server no longer had it when it was released "
            "(it expired: a pause, or Redis unreachable past its ttl)",
        )
    if was_lost is not None:
        raise LeaseLost(s.lease_id, was_lost)
    return None
