"""The safety sweep over recorded lease intervals: the intervals of the service's recorded
history (grants to releases, guarded calls), and the most bytes held at one instant."""

from __future__ import annotations

import time


def max_concurrent(intervals: list[tuple[int, int, int]]) -> tuple[int, int]:
    """Sweep intervals [grant, release) (half-open: a release at t frees before a grant at t
    takes) and return (the largest sum of amounts held at one instant, that instant). Raises
    AssertionError for an interval that ends before it starts."""
    events = []
    for grant, release, amount in intervals:
        assert grant <= release, (grant, release)
        events.append((grant, 1, amount))
        events.append((release, 0, -amount))  # 0 sorts before 1: releases first at a tie
    events.sort()
    held = peak = at = 0
    for t, _, delta in events:
        held += delta
        if held > peak:
            peak, at = held, t
    return peak, at


def lease_intervals(
    events: list[dict],
    *,
    routes: set[str] | None = None,
    killed: dict[int, dict] | None = None,
    end: float | None = None,
) -> list[tuple[float, float, int, str]]:
    """``(start, end, amount, lease_id)`` per lease: from the worker's grant record (written
    after the grant returned) to its release or loss record (a release record is written before
    the release is sent), or to the lease's last known server expiry (``expires_ms`` in that
    record) where that came first: a worker stalled past it (a loaded machine) records its
    release or loss late, while the server already gave the bytes to another (on one host the
    records' ``t`` and the server's ms read the same clock). So each interval is an inner bound
    of the server's, and the sweep of them is at most what the server held at any instant.
    A lease lost without a record (a worker killed with -9) lasts until its server expiry,
    read from Redis after the kill (``killed[pid]`` is :meth:`Service.expiries_of`: a dead
    holder renews nothing more); one with no end record at all lasts until ``end``."""
    killed = killed or {}
    end = end if end is not None else time.time() + 3600
    grants, ends = {}, {}
    for e in events:
        if routes is not None and e.get("route") not in routes:
            continue
        if e["e"] == "grant":
            grants[e["lease_id"]] = e
        elif e["e"] in ("release", "lost"):
            ends.setdefault(e["lease_id"], e)  # the first (a lost lease may be released too)
    out = []
    for lid, g in grants.items():
        if lid in ends:
            rec = ends[lid]
            t1 = min(rec["t"], rec["expires_ms"] / 1000) if "expires_ms" in rec else rec["t"]
        elif g["pid"] in killed:
            expiries = killed[g["pid"]]
            t1 = expiries.get(
                lid, expiries["killed_at"]
            )  # not in Redis any more: it ended before we looked
        else:
            t1 = end
        out.append((g["t"], max(g["t"], t1), int(g["amount"]), lid))
    return out


def cuda_intervals(
    events: list[dict], *, killed: dict[int, float] | None = None
) -> list[tuple[float, float, int, str]]:
    """``(start, end, amount, lease_id)`` of each guarded call's thread (cuda_start to
    cuda_end; a call cut by kill -9 ends at the kill)."""
    killed = killed or {}
    starts, ends = {}, {}
    for e in events:
        if e["e"] == "cuda_start":
            starts[e["lease_id"]] = e
        elif e["e"] == "cuda_end":
            ends[e["lease_id"]] = e
    out = []
    for lid, s in starts.items():
        t1 = ends[lid]["t"] if lid in ends else killed.get(s["pid"], time.time() + 3600)
        out.append((s["t"], t1, int(s["amount"]), lid))
    return out


def max_overlap(intervals: list[tuple[float, float, int, str]]) -> tuple[int, int]:
    """The most bytes and the most intervals alive at one instant (ends sort before starts at
    equal times)."""
    points = []
    for t0, t1, amount, _ in intervals:
        points.append((t0, 1, amount))
        points.append((t1, 0, -amount))
    points.sort(key=lambda p: (p[0], p[1]))
    used = count = peak_used = peak_count = 0
    for _, kind, delta in points:
        used += delta
        count += 1 if kind == 1 else -1
        peak_used = max(peak_used, used)
        peak_count = max(peak_count, count)
    return peak_used, peak_count
