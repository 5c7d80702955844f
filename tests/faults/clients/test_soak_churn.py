"""A bounded soak with churn (issue 9 item 8): everything of the holder-fault soak
(test_holder_faults.py: holders killed -9 and stopped at every step of the protocol, from
inside and outside) plus

* Redis killed -9 and restarted empty on the same port, every 7–12 s (the holders put their
  leases back; nothing new is granted for one ``max_ttl``, the grace period);
* client disconnects: a worker's connection killed by the server (``CLIENT KILL``, its
  hand-off subscription first), and a process with hundreds of acquires waiting that closes
  its pool object (``PoolClosed`` for each waiting acquire) or is killed -9 while they wait;
* hundreds (``--run-slow``: 2,000) of acquires waiting at once in one process (``AsyncPool``).

Checked at the end: ``used`` 0 and the queue empty on the raw keys, the safety invariant on
the recorded history (the amounts in use at every instant of Redis server time, from the
``TIME`` reads the workers logged), no fencing token twice, no unexpected error, every fault
kind injected, and the connections each process holds to Redis (``CLIENT LIST``, matched to
the process's sockets) within its ``max_connections``. The driver is ``_soak.run_soak``.

The short run (CI) lasts ``SHORT_S``, and up to ``EXTEND_S`` more while a scheduled fault was
not observed yet (a loaded machine); ``--run-slow`` adds a long one (``GPULOCK_SOAK_S``,
default 300 s).
"""

from __future__ import annotations

import inspect
import os
import time

import pytest

from gpulock import AsyncPool

from ._soak import EXTEND_S, Churn, check, run_soak

SHORT_S = 45.0


def _check_churn(r: dict, churn: Churn) -> None:
    check(r)
    s = r["stats"]
    assert r["restarts"] >= 2, r["restarts"]
    assert s.get("disconnect pubsub") and s.get("external kill of the crowd"), s
    quits = r["crowd quits (waiting, PoolClosed)"]
    assert quits and max(w for w, _ in quits) >= churn.crowd // 3, (
        quits
    )  # it went away with many waiting
    assert all(c <= w for w, c in quits), quits
    assert r["max waiters"] >= churn.crowd // 2, r["max waiters"]
    # Connections per process, as Redis sees them: an AsyncPool opens at most max_connections
    # (its subscription included), a sync Pool at most max_connections plus its background
    # client's min(max_connections, 4); each worker adds its one TIME connection.
    if "max_connections" in inspect.signature(AsyncPool.from_url).parameters:
        m = churn.max_connections
        bound = {"crowd": m + 1, "async": m + 1, "sync": m + min(m, 4) + 1}
    else:  # pool objects without the setting: a generous bound only
        bound = {"crowd": 64, "async": 32, "sync": 32}
    assert r["connection samples"] >= 20
    for shell, n in r["max connections"].items():
        assert n <= bound[shell], (shell, n, bound)


# The run lasts SHORT_S, up to EXTEND_S more while a scheduled fault is missing, then the
# workers' last cycles (45 s at most), the drain and the checks: sized for a loaded machine.
@pytest.mark.timeout(SHORT_S + EXTEND_S + 150)
def test_soak_churn_short(redis_proc1, tmp_path):
    churn = Churn(crowd=300)
    r = run_soak(redis_proc1, tmp_path, SHORT_S, 4, fault_p=0.1, seed=9, churn=churn)
    _check_churn(r, churn)


@pytest.mark.slow
@pytest.mark.timeout(int(os.environ.get("GPULOCK_SOAK_S", "300")) + EXTEND_S + 240)
def test_soak_churn_long(redis_proc1, tmp_path):
    churn = Churn(crowd=2000, crowd_life=(15.0, 40.0))
    r = run_soak(
        redis_proc1,
        tmp_path,
        float(os.environ.get("GPULOCK_SOAK_S", "300")),
        6,
        fault_p=0.08,
        seed=int(time.time()),
        churn=churn,
    )
    _check_churn(r, churn)
