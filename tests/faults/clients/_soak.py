"""The soak driver shared by test_holder_faults.py and test_soak_churn.py (not collected).

``run_soak`` starts worker processes (``_soak_worker.py``) on one pool and hits them with
faults for ``duration`` seconds and, past it, until every scheduled fault was observed (the
end waits on observed state, not on a fixed time: see "The end" below), then checks, on the raw keys and on the recorded
history (never on gpulock's own counters):

* the pool drains: ``used`` 0, no lease and nothing queued, within ttl + waiter_ttl after the
  last worker left;
* safety: every instant at which a worker *used* a lease (a Redis ``TIME`` read before an
  ``ensure_valid()`` that passed) lies in that lease; sweeping them all, the amounts in use
  at one instant never exceed the capacity; no fencing token was handed out twice;
* no worker saw an unexpected error.

Faults, every kind scheduled (a shuffled list that holds each kind once, then random ones):

* inside the workers (``_soak_worker.py``): SIGKILL or SIGSTOP at each step of the protocol,
  once the step's precondition was observed. The plans are dealt out to the first workers, and
  a replacement gets every plan that nobody injected yet;
* from outside, at arbitrary instants: SIGSTOP (resumed after a delay shorter or longer than
  the ttl), SIGKILL (killed workers are replaced), and with ``Churn``: a connection of a worker
  killed by the server (``CLIENT KILL``: a client disconnect; the hand-off subscription first),
  the crowd process (hundreds or thousands of acquires waiting) killed -9 while waiting, and
  Redis itself killed -9 and restarted empty on the same port.

The end: after ``duration``, while something scheduled is still missing (a plan nobody
injected, an external kind of the shuffled list, a stop longer than the ttl; with ``Churn``: two
Redis restarts and one quit of the crowd), the driver goes on for at most ``extend_s`` more
seconds: the workers keep running (a killed one is replaced and carries the missing plans), and
only what is still missing is injected from outside (no random stops, kills or restarts then:
they would only delay the missing plans). On a loaded machine a worker holding a plan may be
killed or stopped, or not see the plan's precondition, before a fixed end; this waits for it.
The end is then decided: the driver writes its instant (``END_TAIL_S`` = 3 s ahead: it looks
that long before ``duration``, so a run with nothing missing ends at ``duration``) into
``end_at`` in the work folder, which the workers read before each cycle (``END_AT`` ``@PATH``).

Redis restarts and processes that never saw the pool: a process that starts while the pool
is missing (after a restart, before a holder that knew it re-created it with its grace
period) would create it as a new pool, without a grace period, and could be granted bytes a
holder from before still uses — the documented limit ("A process that never saw the pool
re-creates it first", docs/RELIABILITY.md). The driver stays inside the promise: it restarts
Redis only once every live worker has read the pool (its ``S`` line), and starts a new worker
after a restart only once the pool exists again or one ``max_ttl`` has passed.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import redis

from gpulock import Pool
from gpulock.protocol.keys import pool_keys
from support.servers import RedisProcess
from support.soaklog import read_logs
from support.history import max_concurrent
from support.pools import check_consistent, raw
from support.procs import kill_quietly, proc_state


WORKER = Path(__file__).with_name("_soak_worker.py")
CAPACITY, MAX_AMOUNT = 100, 60
TTL, WAITER_TTL = 1.0, 1.0  # the workers' (see _soak_worker.py)
PLANS = [
    "kill_queued",
    "stop_queued",
    "kill_inflight",
    "stop_inflight",
    "kill_holding",
    "stop_holding",
    "kill_release",
    "stop_release",
]
CLOCK_NAME = "soak-clock"  # the workers' own TIME connection: one per process, counted
NAME = "soak"
EXTEND_S = 60.0  # at most this many seconds past the duration, waiting for what is missing
END_TAIL_S = 3.0  # the end is decided this long before it (no new process in its last 2 s)


@dataclasses.dataclass
class Churn:
    """What the churn soak adds to the holder-fault soak."""

    restart_every: tuple[float, float] = (7.0, 12.0)  # seconds between Redis restarts
    max_ttl: float = 2.0  # the workers' max_ttl: the grace period after a restart
    crowd: int = 300  # acquires waiting at once in the crowd process
    crowd_life: tuple[float, float] = (6.0, 14.0)  # the crowd closes its pool object after this
    max_connections: int = 8  # the workers' from_url(max_connections=)
    disconnect_p: float = 0.25  # share of the random external faults that kill a connection


class _Direct:
    """The driver's own connection: it rides out Redis restarts (one retry after a new
    connection)."""

    def __init__(self, url: str):
        self.c = redis.Redis.from_url(url, socket_timeout=5)

    def __call__(self, fn, *a) -> Any:
        for i in range(50):
            try:
                return fn(self.c, *a)
            except (redis.ConnectionError, redis.TimeoutError):
                if i == 49:
                    raise
                time.sleep(0.02)


def injected(work: Path) -> set[str]:
    """The fault kinds the workers injected so far (their F lines: written once the step's
    precondition was observed, right before the signal)."""
    kinds = set()
    for f in work.glob("w*.log"):
        for line in f.read_text().splitlines():
            if line.startswith("F "):
                kinds.add(line.split(" ")[1])
    return kinds


def _knows_pool(log: Path) -> bool:
    """The worker read the pool's status (its first line is ``S``)."""
    try:
        with open(log) as f:
            return f.readline().startswith("S ")
    except OSError:
        return False


def _redis_conns(pid: int, port: int) -> set[str]:
    """'ip:port' of this process's TCP connections to the Redis port (from /proc)."""
    try:
        return {
            f"{c.laddr.ip}:{c.laddr.port}"
            for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.raddr and c.raddr.port == port
        }
    except (psutil.Error, OSError):
        return set()


def run_soak(
    rp: RedisProcess,
    work: Path,
    duration: float,
    workers: int,
    fault_p: float,
    seed: int,
    churn: Churn | None = None,
    extend_s: float = EXTEND_S,
) -> dict:
    """Run the soak (see the module's docstring) and return its figures (``check`` and
    ``summary`` read them). ``duration`` and ``extend_s`` are seconds: the run lasts at least
    ``duration`` and at most ``duration + extend_s`` plus the workers' last cycles; raises
    AssertionError when a worker exits with an unexpected code, a worker logged an unexpected
    error, the pool does not drain, or a fencing token was handed out twice."""
    url = rp.url
    direct = _Direct(url)
    with Pool.from_url(url, NAME) as p:
        p.configure(CAPACITY, max_ttl=churn.max_ttl if churn else None)
    k = pool_keys(NAME)
    rng = random.Random(seed)
    start = time.time()
    soft_end = start + duration  # the end, unless something scheduled is still missing then
    goal_at = soft_end - END_TAIL_S  # from here on, the driver waits only for what is missing
    end_at = math.inf  # decided once nothing is missing (or extend_s passed): see decide_end
    end_file = work / "end_at"  # the workers' END_AT (@PATH): written when the end is decided
    late: list[str] | None = None  # what was missing once the duration had passed
    ended_missing: list[str] = []  # what was still missing when the end was decided
    next_goal_check = 0.0
    procs: dict[int, subprocess.Popen] = {}
    logs: dict[int, Path] = {}  # pid -> its log
    knows: set[int] = set()  # pids that read the pool (S)
    stats: collections.Counter = collections.Counter()
    stop_lengths: list[float] = []
    resume_at: dict[int, float] = {}
    gen = 0
    timeline: list[tuple[float, str]] = []  # (time.time(), what): written to timeline.txt
    # The crowd's own quit (its pool object closed with its acquires waiting) is scheduled too:
    # no random stop or kill hits the crowd before one crowd has quit.
    crowd_quit = False
    crowd_slot = workers if churn and churn.crowd else None
    env = dict(os.environ)
    if churn:
        env.update(
            GPULOCK_SOAK_MAX_TTL=str(churn.max_ttl),
            GPULOCK_SOAK_CROWD=str(churn.crowd),
            GPULOCK_SOAK_LIFE=f"{churn.crowd_life[0]},{churn.crowd_life[1]}",
            GPULOCK_SOAK_MAX_CONNECTIONS=str(churn.max_connections),
        )

    def spawn(slot: int, schedule: list[str]) -> None:
        nonlocal gen
        gen += 1
        shell = "crowd" if slot == crowd_slot else "sync" if slot % 2 == 0 else "async"
        out = work / f"w{slot}-{gen}.log"
        pr = subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                url,
                NAME,
                str(out),
                str(seed * 1000 + gen),
                f"@{end_file}",
                str(MAX_AMOUNT),
                str(fault_p),
                shell,
                ",".join(schedule),
            ],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        procs[slot] = pr
        logs[pr.pid] = out
        stats[f"started {shell}"] += 1
        timeline.append((time.time(), f"started {shell} {pr.pid} ({out.name})"))

    # Every fault kind is scheduled, not left to chance: the plans are dealt out to the first
    # workers (each injects its share in its first cycles, at the first cycle whose
    # precondition it observes), and a replacement gets every plan nobody injected yet.
    plans = PLANS[:]
    rng.shuffle(plans)
    ext = ["stop", "kill"] + (
        ["disconnect", "kill_crowd"] if churn else []
    )  # from outside: each once
    rng.shuffle(ext)
    stop_long = [True, False]  # the first stop outlasts the ttl, the second not
    next_restart = start + rng.uniform(*churn.restart_every) if churn else float("inf")
    last_restart = None
    restarts: list[float] = []  # seconds each restart took (kill -9 to PONG)
    respawn: set[int] = set()  # slots waiting for a replacement
    max_waiters = 0
    max_conns = collections.Counter()  # shell -> the most connections one process had
    samples = 0
    next_sample = 0.0
    server_counts: collections.Counter = collections.Counter()  # summed over Redis restarts

    def may_start_fresh(now: float) -> bool:
        if now >= end_at - 2.0 or now >= next_restart:
            return False  # the end, or a restart is due: no new process now
        if last_restart is None or now > last_restart + churn.max_ttl + 0.5:
            return True
        return bool(direct(lambda c: c.exists(k[0])))  # re-created (with its grace period)

    def missing_goals() -> list[str]:
        """What is scheduled and was not observed yet (empty: the end may come)."""
        out = [p for p in PLANS if p not in injected(work)]
        out += [f"external {kind}" for kind in ext]
        if stop_long and stop_long[0]:
            out.append("a stop longer than the ttl")
        if churn and len(restarts) < 2:
            out.append("two Redis restarts")
        if churn and churn.crowd and not crowd_quit:
            out.append("a quit of the crowd")
        return out

    def decide_end(now: float, missing: list[str]) -> float:
        """Write the end's instant for the workers (renamed into place: read whole or not at
        all) and return it."""
        tmp = work / "end_at.tmp"
        tmp.write_text(repr(now + END_TAIL_S))
        os.replace(tmp, end_file)
        ended_missing.extend(missing)
        timeline.append((now, f"end decided, {now - goal_at:.2f}s late (missing: {missing})"))
        return now + END_TAIL_S

    def shell_of(pid: int) -> str:
        return next(
            ("crowd" if s == crowd_slot else "sync" if s % 2 == 0 else "async")
            for s, pr in procs.items()
            if pr.pid == pid
        )

    try:
        for i in range(workers):
            spawn(i, plans[i::workers])
        if crowd_slot is not None:
            spawn(crowd_slot, [])
        next_ext = time.time() + 1.0
        # Until the last worker left (or a replacement is still due), 45 s past the end at most.
        while (procs or (respawn and time.time() < end_at - 2.0)) and time.time() < end_at + 45.0:
            now = time.time()
            if end_at == math.inf and now >= goal_at and now >= next_goal_check:
                next_goal_check = now + 0.5
                missing = missing_goals()
                if late is None:
                    late = missing
                if not missing or now >= goal_at + extend_s:
                    end_at = decide_end(now, missing)
                elif churn and len(restarts) >= 2:
                    next_restart = math.inf  # only what is missing, from here on
            for slot, pr in list(procs.items()):
                rc = pr.poll()
                if rc is not None:
                    err = pr.stderr.read()
                    stats[f"exit {rc}"] += 1
                    timeline.append((now, f"{shell_of(pr.pid)} {pr.pid} exited {rc}"))
                    if rc not in (0, -signal.SIGKILL):
                        raise AssertionError(f"worker exited {rc}: {err[-2000:]}")
                    del procs[slot]
                    if rc == 0 and slot == crowd_slot and now < end_at:
                        crowd_quit = True
                    if now < end_at - 2.0 and (rc != 0 or slot == crowd_slot):
                        respawn.add(slot)
                    continue
                if pr.pid not in knows and _knows_pool(logs[pr.pid]):
                    knows.add(pr.pid)
                st = proc_state(pr.pid)
                if st == "T":
                    if pr.pid not in resume_at:
                        long = stop_long.pop(0) if stop_long else rng.random() < 0.5
                        d = (
                            0.0
                            if now >= end_at
                            else rng.uniform(1.2, 2.5)
                            if long
                            else rng.uniform(0.05, 0.6)
                        )
                        resume_at[pr.pid] = now + d
                        stop_lengths.append(d)
                        timeline.append((now, f"{shell_of(pr.pid)} {pr.pid} stopped, for {d:.2f}s"))
                    elif now >= resume_at[pr.pid] or now >= end_at:
                        os.kill(pr.pid, signal.SIGCONT)
                        del resume_at[pr.pid]
            for slot in sorted(respawn):
                if may_start_fresh(now):
                    respawn.discard(slot)
                    if slot == crowd_slot:
                        spawn(slot, [])
                    else:
                        missing = [p for p in PLANS if p not in injected(work)]
                        rng.shuffle(missing)
                        spawn(slot, missing)
            if churn and now >= next_restart:
                if now >= end_at - 3.0:
                    next_restart = float("inf")
                elif all(pr.pid in knows for pr in procs.values()):
                    # Redis killed -9 and started again, empty, on the same port.
                    try:  # the server's counters, before it forgets them
                        before = {
                            a.decode(): int(b)
                            for a, b in direct.c.hgetall(k[0]).items()
                            if b.isdigit()
                        }
                    except redis.RedisError:
                        before = {}
                    for key in ("grants", "reaped_leases", "reaped_waiters"):
                        server_counts[key] += before.get(key, 0)
                    t0 = time.monotonic()
                    rp.restart()
                    restarts.append(time.monotonic() - t0)
                    last_restart = time.time()
                    timeline.append((last_restart, "Redis restarted"))
                    next_restart = last_restart + rng.uniform(*churn.restart_every)
            if churn and now >= next_sample:  # waiters and connections, as Redis sees them
                next_sample = now + 0.25
                try:
                    max_waiters = max(max_waiters, direct.c.zcard(k[3]))
                    clients = {c["addr"] for c in direct.c.client_list()}
                except redis.RedisError:
                    clients = None
                if clients is not None:
                    samples += 1
                    for pr in list(procs.values()):
                        n = len(_redis_conns(pr.pid, rp.port) & clients)
                        sh = shell_of(pr.pid)
                        max_conns[sh] = max(max_conns[sh], n)
            extending = now >= goal_at  # then only the scheduled kinds still missing
            if now >= next_ext and now < end_at - 2.0 and (ext or not extending):
                next_ext = now + rng.uniform(0.3, 1.0)  # faults from outside, at any instant
                running = {
                    s: pr for s, pr in procs.items() if proc_state(pr.pid) not in ("T", "Z", "")
                }
                if ext:
                    kind = ext.pop(0)
                elif churn and rng.random() < churn.disconnect_p:
                    kind = "disconnect"
                else:
                    kind = "stop" if rng.random() < 0.6 else "kill"
                if kind == "kill_crowd":
                    victim = running.get(crowd_slot)
                    if victim is None or victim.pid not in knows:
                        ext.insert(0, kind)  # later: the crowd is not waiting yet
                    else:
                        os.kill(victim.pid, signal.SIGKILL)
                        stats["external kill of the crowd"] += 1
                        timeline.append((now, f"kill -9 of the crowd {victim.pid}"))
                elif running and kind == "disconnect":
                    done = _disconnect(
                        direct,
                        rng,
                        list(running.values()),
                        rp.port,
                        first=not stats["disconnect pubsub"],
                    )
                    if done:
                        stats[done] += 1
                        timeline.append((now, done))
                    else:
                        ext.insert(0, kind)
                elif running:
                    victims = [pr for sl, pr in running.items() if sl != crowd_slot or crowd_quit]
                    victim = rng.choice(victims or list(running.values()))
                    os.kill(victim.pid, signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
                    stats[f"external {kind}"] += 1
                    timeline.append(
                        (now, f"external {kind} of {shell_of(victim.pid)} {victim.pid}")
                    )
                else:
                    ext.insert(0, kind)  # nothing running right now: later
            time.sleep(0.01)
        assert not procs, f"workers still running {time.time() - start:.0f}s after the start"
    finally:
        for pr in procs.values():
            kill_quietly(pr.pid, signal.SIGCONT)
            kill_quietly(pr.pid)
            pr.wait()

    (work / "timeline.txt").write_text(
        "".join(f"{t - start:8.3f} {what}\n" for t, what in timeline)
    )

    # Drain: all holders are gone; their leases expire after the ttl, their places after
    # waiter_ttl. The reap script is run directly so the check does not lean on a pool object.
    t0 = time.monotonic()
    while True:
        if direct(lambda c: c.exists(k[0])):
            direct(lambda c: raw(c, NAME, "reap"))
        counts = direct(lambda c: check_consistent(c, NAME))
        if counts == {"used": 0, "leases": 0, "queued": 0}:
            break
        assert time.monotonic() - t0 < TTL + WAITER_TTL + 3.0, f"did not drain: {counts}"
        time.sleep(0.02)
    drain_s = time.monotonic() - t0
    assert (
        int(direct(lambda c: c.hget(k[0], "used")) or 0) == 0
        and direct(lambda c: c.zcard(k[3])) == 0
    )
    cfg = {a.decode(): int(b) for a, b in direct(lambda c: c.hgetall(k[0])).items() if b.isdigit()}
    direct.c.close()

    # The recorded history.
    h = read_logs(work.glob("w*.log"))
    uses, amounts, grants, lost = h.uses, h.amounts, h.grants, h.lost
    faults, quits, errors = h.faults, h.quits, h.errors
    if errors:  # say where and when, next to what the driver did just before
        shells = {
            f"w{s}-": ("crowd" if s == crowd_slot else "sync" if s % 2 == 0 else "async")
            for s in range(workers + 1)
        }
        report = []
        for name, line in errors[:5]:
            at = float(line.rsplit(" at=", 1)[1]) if " at=" in line else end_at
            shell = next((v for k, v in shells.items() if name.startswith(k)), "?")
            before = [f"{t - at:+.2f}s {what}" for t, what in timeline if at - 12 <= t <= at]
            report.append(
                f"{shell} {name} at {at - start:.2f}s: {line[:160]}\n    before it: {before[-8:]}"
            )
        raise AssertionError(
            f"{len(errors)} unexpected errors (the driver's timeline: {work / 'timeline.txt'}):\n"
            + "\n".join(report)
        )
    assert len(set(grants)) == len(grants), "a fencing token was handed out twice"
    intervals = [(min(ts), max(ts) + 1, amounts[t]) for t, ts in uses.items()]
    peak, at = max_concurrent(intervals)
    return {
        "grants": len(grants),
        "leases used": len(intervals),
        "use instants checked": sum(map(len, uses.values())),
        "lost": lost,
        "peak": peak,
        "peak_at": at,
        "faults": dict(faults),
        "stats": dict(stats),
        "drain_s": drain_s,
        "run_s": round(end_at - start, 2),
        "extended_s": round(max(0.0, end_at - soft_end), 2),
        "missing after the duration": late or [],
        "missing at the end": ended_missing,
        "stops": len(stop_lengths),
        "stops > ttl": sum(d > TTL for d in stop_lengths),
        "restarts": len(restarts),
        "restart_s": [round(x, 3) for x in restarts],
        "max waiters": max_waiters,
        "max connections": dict(max_conns),
        "connection samples": samples,
        "crowd quits (waiting, PoolClosed)": quits,
        "server grants": cfg.get("grants", 0) + server_counts["grants"],
        "reaped leases": cfg.get("reaped_leases", 0) + server_counts["reaped_leases"],
        "reaped waiters": cfg.get("reaped_waiters", 0) + server_counts["reaped_waiters"],
    }


def _disconnect(
    direct: _Direct, rng: random.Random, running: list, port: int, first: bool
) -> str | None:
    """Kill one connection of a random running worker on the server's side (``CLIENT KILL``):
    the first time its hand-off subscription, later any of its connections."""
    try:
        clients = [c for c in direct.c.client_list() if c.get("name") != CLOCK_NAME]
    except redis.RedisError:
        return None
    rng.shuffle(running)
    for pr in running:
        mine = _redis_conns(pr.pid, port)
        cands = [c for c in clients if c["addr"] in mine]
        pubsub = [
            c
            for c in cands
            if int(c.get("sub", 0)) or int(c.get("psub", 0)) or int(c.get("ssub", 0))
        ]
        if first:
            cands = pubsub
        if not cands:
            continue
        c = rng.choice(cands)
        try:
            direct.c.client_kill_filter(_id=c["id"])
        except redis.RedisError:
            return None
        return "disconnect pubsub" if c in pubsub else "disconnect"
    return None


def summary(r: dict) -> str:
    """The soak's figures in one paragraph, to quote."""
    st = r["stats"]
    faults = ", ".join(f"{k} {v}" for k, v in sorted(r["faults"].items()))
    out = [
        f"{r['run_s']:.1f} s ({r['extended_s']:.1f} s past the duration, waiting for "
        f"{r['missing after the duration'] or 'nothing'}; still missing at the end: "
        f"{r['missing at the end'] or 'nothing'})",
        f"{r['grants']:,} grants ({r['server grants']:,} counted by the server)",
        f"{sum(r['faults'].values())} faults injected by the workers at a protocol step ({faults})",
        f"from outside: {st.get('external stop', 0)} stops ({r['stops > ttl']} of {r['stops']} stops longer "
        f"than the ttl), {st.get('external kill', 0)} kills -9",
    ]
    if r["restarts"]:
        quits = r["crowd quits (waiting, PoolClosed)"]
        out.append(
            f"{st.get('external kill of the crowd', 0)} kill -9 of the crowd while waiting, "
            f"{st.get('disconnect pubsub', 0) + st.get('disconnect', 0)} connections killed by the server "
            f"({st.get('disconnect pubsub', 0)} hand-off subscriptions), {r['restarts']} Redis restarts "
            f"(kill -9 to PONG {min(r['restart_s']) * 1000:.0f}-{max(r['restart_s']) * 1000:.0f} ms), "
            f"{len(quits)} crowd pool objects closed with {', '.join(str(w) for w, _ in quits)} acquires "
            f"waiting (each ended PoolClosed: {', '.join(str(c) for _, c in quits)})"
        )
        out.append(
            f"at most {r['max waiters']} requests queued; connections per process at most "
            + ", ".join(f"{k} {v}" for k, v in sorted(r["max connections"].items()))
            + f" ({r['connection samples']} CLIENT LIST samples)"
        )
    out.append(
        f"safety checked on {r['use instants checked']:,} use instants of {r['leases used']:,} leases: "
        f"peak {r['peak']} of {CAPACITY}; {r['lost']} leases found lost by their holders; "
        f"{r['reaped leases']} leases and {r['reaped waiters']} places reaped; drained {r['drain_s']:.2f} s "
        f"after the last worker left"
    )
    return "; ".join(out)


def check(r: dict, require_all_plans: bool = True) -> None:
    print(f"\nsoak: {r}\nsoak figures: {summary(r)}")
    assert r["peak"] <= CAPACITY, (
        f"{r['peak']} bytes in use at server time {r['peak_at']} us > capacity {CAPACITY}"
    )
    assert r["peak"] >= CAPACITY // 2, "the pool was never busy: the check had no teeth"
    assert r["grants"] >= 100
    if require_all_plans:
        missing = [p for p in PLANS if not r["faults"].get(p)]
        assert not missing, (
            f"fault kinds never injected in {r['run_s']} s ({r['extended_s']} s past the "
            f"duration, waiting for them): {missing}"
        )
    assert r["stats"].get("external stop") and r["stats"].get("external kill"), r["stats"]
    assert r["stops > ttl"] >= 1 and r["reaped leases"] >= 1
