"""Holders killed (-9) and stopped (SIGSTOP) at every step of the protocol, at random, in many
processes at once: a bounded soak (issue 5 item 5; DESIGN §5 holder crash and pause,
invariants 1, 2 and 5).

Each worker process (``_soak_worker.py``, half of them on the sync ``Pool``, half on
``AsyncPool``) loops acquire -> hold -> release and, now and then, injects a fault into itself
at one step: while queued (in ``on_queued``), with the acquire on the wire and its reply unread
(the server may have granted it), while holding, and with the release on the wire. ``kill``
is SIGKILL; ``stop`` is SIGSTOP, which this test ends with SIGCONT after a random delay —
shorter or longer than the 1 s ttl. The test also stops and kills workers from outside at
arbitrary instants, and replaces the killed ones.

Checked on the recorded history, never on gpulock's own counters: every instant at which a
worker *used* a lease (a Redis ``TIME`` read before an ``ensure_valid()`` that passed) lies
in that lease; sweeping all of them, the amounts in use at any instant never exceed the
capacity. At the end, with every worker gone, ``used`` is 0 and the queue is empty on the raw
keys within ttl + waiter_ttl, no worker saw an unexpected error, and each fault kind was hit.
Every kind is scheduled (dealt out to the workers, and to replacements while missing), not left
to chance, and a worker injects a plan only once it observed the step's precondition (its
ticket in the queue on the raw keys, the lease valid, the request on the wire).

The CI run lasts ``SOAK_S`` (40 s); ``--run-slow`` adds a 5-minute one (``GPULOCK_SOAK_S``
overrides its length).
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from gpulock import Pool
from gpulock._protocol import pool_keys
from helpers import raw

from ._support import check_consistent, kill_quietly, max_concurrent, proc_state

WORKER = Path(__file__).with_name("_soak_worker.py")
CAPACITY, MAX_AMOUNT = 100, 60
SOAK_S = 40.0
WORKERS = 6
TTL, WAITER_TTL = 1.0, 1.0  # the workers' (see _soak_worker.py)
PLANS = ["kill_queued", "stop_queued", "kill_inflight", "stop_inflight", "kill_holding", "stop_holding",
         "kill_release", "stop_release"]


def injected(work: Path) -> set[str]:
    """The fault kinds the workers injected so far (their F lines: written once the step's
    precondition was observed, right before the signal)."""
    kinds = set()
    for f in work.glob("w*.log"):
        for line in f.read_text().splitlines():
            if line.startswith("F "):
                kinds.add(line.split(" ")[1])
    return kinds


def run_soak(url: str, work: Path, duration: float, workers: int, fault_p: float, seed: int) -> dict:
    name = "soak"
    direct = redis.Redis.from_url(url)
    with Pool.from_url(url, name) as p:
        p.configure(CAPACITY)
    rng = random.Random(seed)
    start = time.time()
    end_at = start + duration
    procs: dict[int, subprocess.Popen] = {}
    stats = collections.Counter()
    stop_lengths: list[float] = []
    resume_at: dict[int, float] = {}
    gen = 0

    def spawn(slot: int, schedule: list[str]) -> None:
        nonlocal gen
        gen += 1
        shell = "sync" if slot % 2 == 0 else "async"
        out = work / f"w{slot}-{gen}.log"
        procs[slot] = subprocess.Popen(
            [sys.executable, str(WORKER), url, name, str(out), str(seed * 1000 + gen), repr(end_at),
             str(MAX_AMOUNT), str(fault_p), shell, ",".join(schedule)], stderr=subprocess.PIPE, text=True)

    # Every fault kind is scheduled, not left to chance: the plans are dealt out to the first
    # workers (each injects its share in its first cycles, at the first cycle whose
    # precondition it observes), and a replacement gets every plan nobody injected yet.
    plans = PLANS[:]
    rng.shuffle(plans)
    ext = ["stop", "kill"]  # the faults from outside: each once first, then at random
    rng.shuffle(ext)
    stop_long = [True, False]  # the first stop from outside outlasts the ttl, the second not

    try:
        for i in range(workers):
            spawn(i, plans[i::workers])
        next_ext = time.time() + 1.0
        hard_end = end_at + 45.0
        while procs and time.time() < hard_end:
            now = time.time()
            for slot, pr in list(procs.items()):
                rc = pr.poll()
                if rc is not None:
                    err = pr.stderr.read()
                    stats[f"exit {rc}"] += 1
                    if rc not in (0, -signal.SIGKILL):
                        raise AssertionError(f"worker exited {rc}: {err[-2000:]}")
                    del procs[slot]
                    if rc != 0 and now < end_at - 2.0:
                        missing = [k for k in PLANS if k not in injected(work)]
                        rng.shuffle(missing)
                        spawn(slot, missing)
                    continue
                st = proc_state(pr.pid)
                if st == "T":
                    if pr.pid not in resume_at:
                        long = stop_long.pop(0) if stop_long else rng.random() < 0.5
                        d = 0.0 if now >= end_at else rng.uniform(1.2, 2.5) if long else rng.uniform(0.05, 0.6)
                        resume_at[pr.pid] = now + d
                        stop_lengths.append(d)
                    elif now >= resume_at[pr.pid] or now >= end_at:
                        os.kill(pr.pid, signal.SIGCONT)
                        del resume_at[pr.pid]
            if now >= next_ext and now < end_at - 2.0:  # faults from outside, at any instant
                next_ext = now + rng.uniform(0.3, 1.0)
                running = [pr for pr in procs.values() if proc_state(pr.pid) not in ("T", "Z", "")]
                if running:
                    victim = rng.choice(running)
                    if (ext.pop(0) if ext else "stop" if rng.random() < 0.6 else "kill") == "stop":
                        os.kill(victim.pid, signal.SIGSTOP)
                        stats["external stop"] += 1
                    else:
                        os.kill(victim.pid, signal.SIGKILL)
                        stats["external kill"] += 1
            time.sleep(0.01)
        assert not procs, f"workers still running {hard_end - start:.0f}s after the start"
    finally:
        for pr in procs.values():
            kill_quietly(pr.pid, signal.SIGCONT)
            kill_quietly(pr.pid)
            pr.wait()

    # Drain: all holders are gone; their leases expire after the ttl, their places after
    # waiter_ttl. The reap script is run directly so the check does not lean on a pool object.
    t0 = time.monotonic()
    k = pool_keys(name)
    while True:
        raw(direct, name, "reap")
        counts = check_consistent(direct, name)
        if counts == {"used": 0, "leases": 0, "queued": 0}:
            break
        assert time.monotonic() - t0 < TTL + WAITER_TTL + 3.0, f"did not drain: {counts}"
        time.sleep(0.02)
    drain_s = time.monotonic() - t0
    assert int(direct.hget(k[0], "used")) == 0 and direct.zcard(k[3]) == 0
    cfg = {a.decode(): int(b) for a, b in direct.hgetall(k[0]).items()}
    direct.close()

    # The recorded history.
    uses: dict[int, list[int]] = collections.defaultdict(list)
    amounts: dict[int, int] = {}
    grants, lost, errors = [], 0, []
    faults = collections.Counter()
    for f in work.glob("w*.log"):
        for line in f.read_text().splitlines():
            p = line.split(" ", 3)
            if p[0] == "G":
                grants.append(int(p[1]))
                amounts[int(p[1])] = int(p[2])
            elif p[0] == "U":
                uses[int(p[1])].append(int(p[3]))
                amounts[int(p[1])] = int(p[2])
            elif p[0] == "L":
                lost += 1
            elif p[0] == "F":
                faults[p[1]] += 1
            elif p[0] == "E":
                errors.append(line)
    assert not errors, errors[:5]
    assert len(set(grants)) == len(grants), "a fencing token was handed out twice"
    intervals = [(min(ts), max(ts) + 1, amounts[t]) for t, ts in uses.items()]
    peak, at = max_concurrent(intervals)
    return {"grants": len(grants), "leases used": len(intervals), "lost": lost, "peak": peak, "peak_at": at,
            "faults": dict(faults), "stats": dict(stats), "drain_s": drain_s,
            "stops": len(stop_lengths), "stops > ttl": sum(d > TTL for d in stop_lengths),
            "server grants": cfg.get("grants"), "reaped leases": cfg.get("reaped_leases"),
            "reaped waiters": cfg.get("reaped_waiters")}


def _check(r: dict, require_all_plans: bool) -> None:
    print(f"\nfault soak: {r}")
    assert r["peak"] <= CAPACITY, f"{r['peak']} bytes in use at server time {r['peak_at']} us > capacity {CAPACITY}"
    assert r["peak"] >= CAPACITY // 2, "the pool was never busy: the check had no teeth"
    assert r["grants"] >= 100
    if require_all_plans:
        missing = [p for p in PLANS if not r["faults"].get(p)]
        assert not missing, f"fault kinds never injected: {missing}"
    assert r["stats"].get("external stop") and r["stats"].get("external kill"), r["stats"]
    assert r["stops > ttl"] >= 1 and r["reaped leases"] >= 1


@pytest.mark.timeout(SOAK_S + 120)
def test_fault_soak_short(redis_proc1, tmp_path):
    r = run_soak(redis_proc1.url, tmp_path, SOAK_S, WORKERS, fault_p=0.12, seed=5)
    _check(r, require_all_plans=True)


@pytest.mark.slow
@pytest.mark.timeout(int(os.environ.get("GPULOCK_SOAK_S", "300")) + 180)
def test_fault_soak_long(redis_proc1, tmp_path):
    r = run_soak(redis_proc1.url, tmp_path, float(os.environ.get("GPULOCK_SOAK_S", "300")), 8,
                 fault_p=0.08, seed=int(time.time()))
    _check(r, require_all_plans=True)
