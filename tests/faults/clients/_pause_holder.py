"""The paused holder of test_fault_pause.py (run as a script, not collected by pytest).

Usage: python _pause_holder.py URL POOL AMOUNT TTL STATE_FILE PROCEED_FILE

Acquires AMOUNT with TTL, writes {"granted": ...} to STATE_FILE, then idles until PROCEED_FILE
appears (the test SIGSTOPs it meanwhile, then SIGCONTs it and creates the file). Then it calls
ensure_valid() and release() and writes what each did to STATE_FILE. Times: ``*_wall`` are
time.time() seconds (CLOCK_REALTIME, the clock Redis TIME reads on this host); local monotonic
instants are converted with the offset measured at the grant.
"""

import json
import os
import sys
import time

from gpulock import LeaseLost, Pool


def main() -> None:
    url, name, amount, ttl, state_file, proceed = sys.argv[1:7]
    pool = Pool.from_url(url, name)
    lease = pool.acquire(int(amount), ttl=float(ttl), timeout=10)
    offset = time.time() - time.monotonic()  # monotonic -> wall, on this host
    lost_at: list[float] = []
    lease.on_lost(lambda _l: lost_at.append(time.monotonic()))
    out = {"granted": {"id": lease.id, "token": lease.token, "pid": os.getpid()}}
    with open(state_file + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(state_file + ".tmp", state_file)

    while not os.path.exists(proceed):
        time.sleep(0.01)
    resumed = time.monotonic()
    out["valid_until_wall"] = lease.valid_until + offset  # the last successful renewal's deadline
    out["server_expiry_wall"] = lease.expires_at  # the server expiry that renewal set
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
    # on_lost runs in the thread that marked the lease lost: when the heartbeat marked it (it
    # runs again at SIGCONT) while ensure_valid() above found it lost, the callback may still
    # be on its way: wait for it (bounded), so the record does not depend on which thread won.
    deadline = time.monotonic() + 10
    while not lost_at and time.monotonic() < deadline:
        time.sleep(0.01)
    out["on_lost_wall"] = [t + offset for t in lost_at]
    out["resumed_wall"] = resumed + offset
    pool.close()
    with open(state_file + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(state_file + ".tmp", state_file)


if __name__ == "__main__":
    main()
