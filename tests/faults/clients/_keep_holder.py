"""A holder of kept bytes for test_keep_faults.py (run as a script, not collected by pytest).

Usage: python _keep_holder.py URL POOL TTL STATE_FILE PROCEED_FILE

With a pool object that keeps (``keep=30``): acquires 40 and 30 bytes, releases the 30 and
acquires 30 again (a grant from kept bytes: in use), then releases the 40 (the server keeps
the lease: idle kept bytes). Writes {"idle", "used": {"id", "token"}, "counts", "pid"} to
STATE_FILE, then waits for PROCEED_FILE (the test kills it with -9, or SIGSTOPs and SIGCONTs
it meanwhile). Then it writes what it knew of the idle kept lease (its local validity
deadline and server expiry, as ``*_wall``: time.time() seconds) and whether it was still
active, and asks for 40 bytes again (timeout 30 s): the new lease's id and token, and the
counts of its kept leases after it.
"""

import json
import os
import sys
import time

from gpulock import Pool


def write(path: str, out: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    url, name, ttl, state_file, proceed = sys.argv[1:6]
    pool = Pool.from_url(url, name, keep=30, default_ttl=float(ttl))
    a = pool.acquire(40, timeout=10)
    b = pool.acquire(30, timeout=10)
    b.release()
    used = pool.acquire(30, timeout=10)  # from b's kept bytes (a request of another size
    a.release()  # would have given the idle ones back first)
    assert pool._bg is not None
    kept = pool._bg.rt.kept
    idle = kept.idle()
    assert [s.lease_id for s in idle] == [a.id] and used.id == b.id, (idle, a.id, b.id)
    state = idle[0]  # the state the heartbeat renews while the lease is idle
    offset = time.time() - time.monotonic()  # monotonic -> wall, on this host
    out = {
        "idle": {"id": a.id, "token": a.token},
        "used": {"id": used.id, "token": used.token},
        "counts": kept.counts(),
        "pid": os.getpid(),
    }
    write(state_file, out)
    while not os.path.exists(proceed):
        time.sleep(0.01)
    out["valid_until_wall"] = state.valid_until + offset
    out["server_expiry_wall"] = state.expires_ms / 1000
    out["resumed_wall"] = time.time()
    again = pool.acquire(40, timeout=30)
    out["again"] = {"id": again.id, "token": again.token}
    out["counts_after"] = kept.counts()
    again.release()
    pool.close()
    write(state_file, out)


if __name__ == "__main__":
    main()
