"""The preemptible holder of test_preemption_faults.py (run as a script, not collected by pytest).

Usage: python _preempt_holder.py URL POOL AMOUNT TTL STATE_FILE PROCEED_FILE

Acquires AMOUNT with TTL at priority 0, preemptible, and heartbeats. STATE_FILE (JSON, rewritten
whole on every change) records what it sees: ``granted`` {id, token, pid}, ``asked`` (its
on_yield ran: {yield_requested, deadline_in_s}), ``lost`` (on_lost reasons). It does not yield
by itself: when PROCEED_FILE appears (the test kills, stops or resumes it meanwhile), it calls
ensure_valid() and release(), records what each did (``ensure_valid``, ``release``: "ok" or
"LeaseLost: <reason>") and exits 0. A cooperative holder is one whose test creates
PROCEED_FILE once it was asked; an uncooperative one, one whose test never does before the
deadline.
"""

import json
import os
import sys
import threading
import time

from gpulock import LeaseLost, Pool

_LOCK = threading.Lock()


def main() -> None:
    url, name, amount, ttl, state_file, proceed = sys.argv[1:7]
    out: dict = {"lost": []}

    def write() -> None:
        with _LOCK:
            with open(state_file + ".tmp", "w") as f:
                json.dump(out, f)
            os.replace(state_file + ".tmp", state_file)

    pool = Pool.from_url(url, name)
    lease = pool.acquire(int(amount), ttl=float(ttl), priority=0, preemptible=True, timeout=10)

    def asked(lz) -> None:
        dl = lz.yield_deadline
        out["asked"] = {
            "yield_requested": lz.yield_requested,
            "deadline_in_s": None if dl is None else dl - time.monotonic(),
        }
        write()

    def lost(lz) -> None:
        out["lost"].append(lz._state.lost_reason or "?")
        write()

    lease.on_yield(asked)
    lease.on_lost(lost)
    out["granted"] = {"id": lease.id, "token": lease.token, "pid": os.getpid()}
    write()

    while not os.path.exists(proceed):
        time.sleep(0.01)
    try:
        lease.ensure_valid()
        out["ensure_valid"] = "ok"
    except LeaseLost as e:
        out["ensure_valid"] = "LeaseLost: " + e.reason
    try:
        lease.release()
        out["release"] = "ok"
    except LeaseLost as e:
        out["release"] = "LeaseLost: " + e.reason
    # on_lost runs in the thread that found the lease lost: wait for it (bounded) when
    # ensure_valid above found it first
    end = time.monotonic() + 10
    while out["ensure_valid"] != "ok" and not out["lost"] and time.monotonic() < end:
        time.sleep(0.01)
    out["yield_requested_at_end"] = lease.yield_requested
    pool.close()
    write()


if __name__ == "__main__":
    main()
