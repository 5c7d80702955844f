"""A hung Redis (SIGSTOP of the server) while a lease is held: ``on_lost`` must fire at the
lease's local validity deadline — before the server's expiry (DESIGN invariant 5) — even though
the heartbeat's renew call is stuck until its socket timeout (5 s, longer than the ttl)."""

from __future__ import annotations

import threading
import time

import pytest

from gpulock import LeaseLost, Pool

TTL_S = 1.5


@pytest.mark.timeout(60)
def test_on_lost_fires_at_local_deadline_while_redis_hangs(redis_proc1):
    with Pool.from_url(redis_proc1.url, "hung") as pool:
        pool.configure(100)
        lease = pool.acquire(10, ttl=TTL_S)
        fired = threading.Event()
        fired_at: list[float] = []
        lease.on_lost(lambda _l: (fired_at.append(time.monotonic()), fired.set()))
        time.sleep(0.6)  # one renewal done
        server_expiry_wall = lease.expires_at  # pinned: no renewal can succeed from now on
        offset = time.time() - time.monotonic()
        redis_proc1.pause()
        t_pause = time.monotonic()
        try:
            assert fired.wait(TTL_S + 1.0), "on_lost did not fire while Redis hung"
            deadline = lease.valid_until
            with pytest.raises(LeaseLost):
                lease.ensure_valid()
        finally:
            redis_proc1.resume()
        print(f"\non_lost fired {fired_at[0] - deadline:+.3f}s from the local deadline, "
              f"{(fired_at[0] + offset - server_expiry_wall) * 1000:+.1f} ms from the server expiry "
              f"({fired_at[0] - t_pause:.2f}s after Redis hung)")
        assert fired_at[0] >= deadline
        assert fired_at[0] - deadline < 0.25
        assert fired_at[0] + offset < server_expiry_wall  # lost locally before the server expiry
        with pytest.raises(LeaseLost):
            lease.release()
