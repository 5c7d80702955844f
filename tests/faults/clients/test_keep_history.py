"""SEMANTICS.md invariant 1 (safety) on a recorded history of pool objects that keep
(docs/SEMANTICS.md, "Kept bytes"): several OS processes with mixed amounts (a repeated amount is
granted from kept bytes, another one gives them back first; now and then a request that does
not fit tells the holders) over a pool below their demand.

A grant from kept bytes is the same lease in Redis as the grant it was kept from: the history
counts each Redis lease once, over [its first grant, its last release], an inner bound of its
life in Redis, valid only if the lease stayed the same one in Redis all along; that is checked:
every grant of it read the same holder record (token and grant ms) right after it was made.
At the client's level, two grants from one kept lease never overlap in time and come from one
process only. Besides, the raw keys, sampled all along, never hold more than the capacity, and
every lease the kept list names is a live one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from gpulock import Pool
from gpulock.protocol.keys import pool_keys
from support.history import max_concurrent
from support.pools import _s, check_consistent
from support.waiting import wait_until

WORKERS = 6
CAPACITY = 100
DURATION_S = 12.0
WORKER = Path(__file__).with_name("_keep_worker.py")


class _Sampler:
    """Reads the holder records and the kept list together (MULTI) every few ms."""

    def __init__(self, url: str, name: str):
        self.c = redis.Redis.from_url(url, socket_timeout=5)
        self.k = pool_keys(name)
        self.peak = self.samples = self.kept_seen = 0
        self.bad: list = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.c.pipeline(transaction=True) as p:
                holders, kept = p.hgetall(self.k.holders).hget(self.k.cfg, "kept").execute()
            total = sum(int(_s(v).split("|")[0]) for v in holders.values())
            self.peak = max(self.peak, total)
            live = {_s(x) for x in holders}
            named = [x.split("|")[0] for x in _s(kept).split()] if kept else []
            self.kept_seen = max(self.kept_seen, len(named))
            if not set(named) <= live or len(set(named)) != len(named):
                self.bad.append((named, sorted(live)))
            self.samples += 1
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(10)
        self.c.close()


@pytest.mark.timeout(120)
def test_safety_with_kept_bytes_on_recorded_history(redis_proc1, tmp_path):
    url, name = redis_proc1.url, "keephist"
    with Pool.from_url(url, name) as pool:
        pool.configure(CAPACITY)
    start_at = time.time() + 2.0
    outs = [tmp_path / f"w{i}.log" for i in range(WORKERS)]
    samp = _Sampler(url, name)
    procs = []
    try:
        for i, out in enumerate(outs):
            argv = [sys.executable, str(WORKER), url, name, str(out), str(100 + i)]
            argv += [repr(start_at), str(DURATION_S)]
            procs.append(subprocess.Popen(argv, stderr=subprocess.PIPE, text=True))
        for p in procs:
            _, err = p.communicate(timeout=DURATION_S + 60)
            assert p.returncode == 0, err
    finally:
        samp.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    rows = [json.loads(line) for out in outs for line in out.read_text().splitlines()]
    kept_rows = [r for r in rows if r["kept"]]
    by_lid: dict[str, list[dict]] = {}
    for r in rows:
        by_lid.setdefault(r["lid"], []).append(r)
    print(
        f"\nkeep history: {len(rows)} grants, {len(kept_rows)} from kept bytes, "
        f"{len(by_lid)} leases in Redis; sampler: {samp.samples} samples, peak {samp.peak}, "
        f"most kept at once {samp.kept_seen}"
    )
    assert len(rows) >= 100 and len(kept_rows) >= 20, (len(rows), len(kept_rows))
    assert len(by_lid) >= 20  # kept bytes were given back and new leases made

    # Every grant read its own live holder record; the grants of one lease read one record
    # (the same token and grant ms): one lease in Redis from its first grant to its last.
    for lid, grants in by_lid.items():
        assert all(g["server_token"] == g["token"] for g in grants), grants
        assert len({(g["token"], g["acq_ms"]) for g in grants}) == 1, grants
        assert len({g["pid"] for g in grants}) == 1, grants  # one holder
        assert len({g["amount"] for g in grants}) == 1, grants
        first, rest = grants[0], grants[1:]
        assert not first["kept"] and all(g["kept"] for g in rest), grants
        # the grants of one lease follow each other: none starts before the last released
        for a, b in zip(grants, rest):
            assert a["t_rel"] <= b["t_req"], (a, b)

    # Safety: each Redis lease counted once over [first grant, last release].
    intervals = [
        (gs[0]["t_grant"], max(g["t_rel"] for g in gs), gs[0]["amount"]) for gs in by_lid.values()
    ]
    peak, at = max_concurrent(intervals)
    print(f"peak of the leases' inner intervals: {peak} of capacity {CAPACITY}")
    assert peak <= CAPACITY, f"{peak} bytes held at server time {at} us > capacity {CAPACITY}"
    # at the client's level: the grants in use at one instant
    in_use, _ = max_concurrent([(r["t_grant"], r["t_rel"], r["amount"]) for r in rows])
    assert in_use <= peak
    tokens = {gs[0]["token"] for gs in by_lid.values()}
    assert len(tokens) == len(by_lid), "a fencing token was issued to two leases"

    assert samp.peak <= CAPACITY, samp.peak
    assert not samp.bad, samp.bad[:3]
    assert samp.kept_seen >= 1
    # nothing leaks: the workers' close gave their idle kept leases back (best effort: one
    # that failed expires after its ttl, 10 s)
    c = redis.Redis.from_url(url)
    wait_until(lambda: check_consistent(c, name)["used"] == 0, 60, "every lease gone")
    c.close()
