"""The wait estimate's error in the scheduling benchmark (docs/BENCHMARKS.md, 12.2).

For every request that queued, the benchmark keeps the place its first ``on_queued`` call got
(a :class:`gpulock_common.queue.QueuePlace`: position, ``estimated_wait`` in seconds or None
while the pool's drain rate was not measured, ``queue_length``) and its actual wait
(``acquire()`` called to granted, seconds). :func:`error_stats` summarizes them,
:func:`samples` lists a few, :func:`build_error_table` puts one line a run.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from _util import percentile
from gpulock_common.queue import QueuePlace

__all__ = ["Queued", "error_stats", "samples", "build_error_table"]


class Queued(NamedTuple):
    """A request that queued: ``asked`` (monotonic seconds), its first ``place``, its
    ``wait_s`` (acquire() called to granted) and what it asked (``what``: bytes in MiB,
    priority, tenant)."""

    asked: float
    place: QueuePlace
    wait_s: float
    what: dict[str, Any]


def error_stats(queued: list[Queued]) -> dict[str, Any]:
    """The error of the estimates of ``queued`` (their first places' ``estimated_wait``)
    against their waits.

    Returns ``queued`` (how many), ``estimated`` (those with an estimate), ``unmeasured``
    (those with None), and over the estimated ones: ``abs_ms`` (p50 and p90 of |estimate -
    wait|, ms), ``rel`` (p50 and p90 of |estimate - wait| / wait, a fraction), ``signed_ms_p50``
    (median of estimate - wait, ms: > 0 the estimate is too long, < 0 too short),
    ``over_share`` (the fraction of estimates longer than the wait) and ``estimate_ms_p50`` /
    ``actual_ms_p50`` (medians, ms, for scale). Every statistic is nan when none had an
    estimate."""
    got = [(q.place.estimated_wait, q.wait_s) for q in queued]
    pairs = [(e, a) for e, a in got if e is not None]
    signed = [(e - a) * 1000 for e, a in pairs]
    absolute = [abs(d) for d in signed]
    rel = [abs(e - a) / a for e, a in pairs if a > 0]
    return {
        "queued": len(got),
        "estimated": len(pairs),
        "unmeasured": len(got) - len(pairs),
        "abs_ms": {"p50": percentile(absolute, 50), "p90": percentile(absolute, 90)},
        "rel": {"p50": percentile(rel, 50), "p90": percentile(rel, 90)},
        "signed_ms_p50": percentile(signed, 50),
        "over_share": sum(1 for d in signed if d > 0) / len(signed) if signed else math.nan,
        "estimate_ms_p50": percentile([e * 1000 for e, _ in pairs], 50),
        "actual_ms_p50": percentile([a * 1000 for _, a in pairs], 50),
    }


def samples(queued: list[Queued], n: int = 12) -> list[dict[str, Any]]:
    """The first ``n`` of ``queued`` to ask, as the estimate saw them: what they asked, their
    position and the queue's length when queued, the estimate and the wait (ms)."""
    out = []
    for q in sorted(queued, key=lambda q: q.asked)[:n]:
        e = q.place.estimated_wait
        out.append(
            {
                **q.what,
                "position": int(q.place),
                "queue_length": q.place.queue_length,
                "estimate_ms": None if e is None else e * 1000,
                "wait_ms": q.wait_s * 1000,
            }
        )
    return out


def _fmt(s: dict[str, Any]) -> list[str]:
    return [
        f"{s['estimated']}/{s['queued']}",
        f"{s['abs_ms']['p50']:.0f} / {s['abs_ms']['p90']:.0f}",
        f"{s['rel']['p50']:.0%} / {s['rel']['p90']:.0%}",
        f"{s['signed_ms_p50']:+.0f} ({s['over_share']:.0%} over)",
        f"{s['estimate_ms_p50']:.0f} / {s['actual_ms_p50']:.0f}",
    ]


HEADS = [
    "estimated / queued",
    "|error| p50 / p90 (ms)",
    "relative p50 / p90",
    "signed p50 (ms)",
    "estimate p50 / wait p50 (ms)",
]


def build_error_table(R: dict[str, Any], row_label: dict[str, str]) -> str:
    """One line a run of ``R["runs"]`` and ``R["placement"]``: its workload, policy (or
    placement row, named by ``row_label``), grants/s and the estimate's error
    (``r["wait_estimate"]``)."""
    from peers import table

    rows = [
        [r["workload"], r["policy"], f"{r['grants_per_s']:.0f}", *_fmt(r["wait_estimate"])]
        for r in R["runs"]
    ] + [
        [
            r["workload"],
            f"4 devices: {row_label.get(r['row'], r['row'])}",
            f"{r['grants_per_s']:.0f}",
            *_fmt(r["wait_estimate"]),
        ]
        for r in R["placement"]
    ]
    return table(["workload", "policy", "grants/s", *HEADS], rows)
