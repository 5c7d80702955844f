"""A hung Redis (SIGSTOP of the server) while a lease is held: ``on_lost`` must fire at the
lease's local validity deadline — before the server's expiry (SEMANTICS.md invariant 5) — even though
the heartbeat's renew call is stuck until its socket timeout (5 s, longer than the ttl)."""

from __future__ import annotations

import threading
import time

import pytest

from gpulock import LeaseLost, Pool
from support.waiting import wait_until

TTL_S = 1.5


@pytest.mark.timeout(60)
def test_on_lost_fires_at_local_deadline_while_redis_hangs(redis_proc1):
    with Pool.from_url(redis_proc1.url, "hung") as pool:
        pool.configure(100)
        lease = pool.acquire(10, ttl=TTL_S)
        fired = threading.Event()
        fired_at: list[float] = []
        lease.on_lost(lambda _l: (fired_at.append(time.monotonic()), fired.set()))
        first = lease.expires_at
        wait_until(lambda: lease.expires_at > first)  # one renewal done (observed, not slept for)
        offset = time.time() - time.monotonic()
        redis_proc1.pause()
        t_pause = time.monotonic()
        try:
            # (The deadline is at most TTL_S after the pause; the slack is for a loaded machine.
            # A hung renew call would end only ~5 s after it was sent.)
            assert fired.wait(TTL_S + 2.5), "on_lost did not fire while Redis hung"
            deadline = lease.valid_until
            # The server expiry of the last renewal whose reply the holder read (read now, not
            # before the pause: a reply could still land between that read and the pause). A
            # renewal the server ran without the holder reading its reply only moves the real
            # expiry later.
            server_expiry_wall = lease.expires_at
            with pytest.raises(LeaseLost):
                lease.ensure_valid()
        finally:
            redis_proc1.resume()
        print(
            f"\non_lost fired {fired_at[0] - deadline:+.3f}s from the local deadline, "
            f"{(fired_at[0] + offset - server_expiry_wall) * 1000:+.1f} ms from the server expiry "
            f"({fired_at[0] - t_pause:.2f}s after Redis hung)"
        )
        assert fired_at[0] >= deadline
        # At the deadline (a timer), not after the hung renew call's 5 s socket timeout. The
        # slack is for a loaded machine, where the heartbeat thread can be descheduled for a
        # second: the callback's lateness is scheduling, not the deadline the code computed.
        assert fired_at[0] - deadline < 1.5
        # The lease stops being valid locally before the server expiry: the deadline the code
        # computed (ensure_valid raised above, so it was enforced) is before that expiry. (The
        # callback's own time can be later than the expiry by any descheduling past the 65 ms
        # margin; that is the callback's scheduling, not what invariant 5 promises.)
        assert deadline + offset < server_expiry_wall
        with pytest.raises(LeaseLost):
            lease.release()
