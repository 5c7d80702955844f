"""SEMANTICS.md invariant 1 (safety) on a recorded history: many OS processes compete for a pool
whose capacity is far below their demand; each logs its leases' intervals on the Redis server
clock; the test sweeps the merged history. gpulock's own ``used`` counter is not consulted.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulock import Pool
from support.history import max_concurrent

WORKERS = 8
CAPACITY = 100
MAX_AMOUNT = 60  # mean demand 8 x 30.5 = 244 bytes held at once: ~2.4x the capacity
DURATION_S = 15.0

WORKER = Path(__file__).with_name("_safety_worker.py")


def token_order_violations(rows) -> list[tuple]:
    """Pairs proving a token out of grant order: A's grant surely happened before B's
    (A's upper bound t_grant < B's lower bound t_req) but token_A > token_B."""
    by_token = sorted(rows, key=lambda r: r["token"], reverse=True)
    bad = []
    best = None  # the row with the smallest t_grant among larger tokens
    for r in by_token:
        if best is not None and best["t_grant"] < r["t_req"]:
            bad.append((best, r))
        if best is None or r["t_grant"] < best["t_grant"]:
            best = r
    return bad


def test_sweep_catches_an_overlap():
    """The checker itself: an over-capacity overlap and a token out of order are caught."""
    assert max_concurrent([(0, 10, 60), (10, 20, 60)]) == (60, 0)  # hand-off at the same instant
    assert max_concurrent([(0, 10, 60), (9, 20, 60)]) == (120, 9)
    rows = [{"t_req": 0, "t_grant": 5, "token": 2}, {"t_req": 6, "t_grant": 9, "token": 1}]
    assert token_order_violations(rows)
    rows[0]["token"], rows[1]["token"] = 1, 2
    assert not token_order_violations(rows)


@pytest.mark.timeout(90)
def test_safety_invariant_on_recorded_history(redis_proc1, tmp_path):
    url, name = redis_proc1.url, "safety"
    with Pool.from_url(url, name) as pool:
        pool.configure(CAPACITY)
    start_at = time.time() + 2.0  # all workers start together, after their imports
    procs = []
    outs = [tmp_path / f"w{i}.log" for i in range(WORKERS)]
    try:
        for i, out in enumerate(outs):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKER),
                        url,
                        name,
                        str(out),
                        str(1000 + i),
                        repr(start_at),
                        str(DURATION_S),
                        str(MAX_AMOUNT),
                    ],
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        for p in procs:
            _, err = p.communicate(timeout=DURATION_S + 60)
            assert p.returncode == 0, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    rows = []
    for i, out in enumerate(outs):
        for line in out.read_text().splitlines():
            t_req, t_grant, t_rel, amount, token, lost = map(int, line.split())
            rows.append(
                {
                    "w": i,
                    "t_req": t_req,
                    "t_grant": t_grant,
                    "t_rel": t_rel,
                    "amount": amount,
                    "token": token,
                    "lost": lost,
                }
            )
    per_worker = [sum(r["w"] == i for r in rows) for i in range(WORKERS)]
    print(f"\nsafety history: {len(rows)} leases, per worker {per_worker}")
    assert len(rows) >= 200 and min(per_worker) >= 5, per_worker
    assert not [r for r in rows if r["lost"]], (
        "a lease expired while held: the intervals are not valid"
    )

    peak, at = max_concurrent([(r["t_grant"], r["t_rel"], r["amount"]) for r in rows])
    print(f"peak sum of held amounts: {peak} of capacity {CAPACITY}")
    assert peak <= CAPACITY, f"{peak} bytes held at server time {at} us > capacity {CAPACITY}"
    # The test had teeth: the pool was kept busy, not trivially under-used.
    assert peak >= CAPACITY // 2

    tokens = [r["token"] for r in rows]
    assert len(set(tokens)) == len(tokens), "a fencing token was issued twice"
    bad = token_order_violations(rows)
    assert not bad, f"fencing tokens out of grant order: {bad[:3]}"
