"""Holders killed (-9) and stopped (SIGSTOP) at every step of the protocol, at random, in many
processes at once: a bounded soak (issue 5 item 5: holder crash and pause;
the safety, no-leak and lost-means-known invariants).

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

The driver is ``_soak.run_soak`` (shared with the churn soak, test_soak_churn.py). The CI run
lasts ``SOAK_S`` (40 s; up to ``EXTEND_S`` more while a scheduled fault was not observed
yet); ``--run-slow`` adds a 5-minute one (``GPULOCK_SOAK_S``
overrides its length).
"""

from __future__ import annotations

import os
import time

import pytest

from ._soak import EXTEND_S, check, run_soak

SOAK_S = 40.0
WORKERS = 6


@pytest.mark.timeout(SOAK_S + EXTEND_S + 150)  # see test_soak_churn_short
def test_fault_soak_short(redis_proc1, tmp_path):
    r = run_soak(redis_proc1, tmp_path, SOAK_S, WORKERS, fault_p=0.12, seed=5)
    check(r)


@pytest.mark.slow
@pytest.mark.timeout(int(os.environ.get("GPULOCK_SOAK_S", "300")) + EXTEND_S + 180)
def test_fault_soak_long(redis_proc1, tmp_path):
    r = run_soak(
        redis_proc1,
        tmp_path,
        float(os.environ.get("GPULOCK_SOAK_S", "300")),
        8,
        fault_p=0.08,
        seed=int(time.time()),
    )
    check(r)
