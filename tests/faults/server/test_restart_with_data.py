"""A server restarted with its data (``RedisProcess(data_dir=...)``: the persistence of ``gpulock
serve``'s embedded server, an append-only file with ``appendfsync no``): what kill -9 keeps.

* Every write a client was answered is in the file (handed to the kernel) before the answer,
  so kill -9 of the server, right after an answer, loses none of them (docs/SERVICE.md, "The
  embedded server's data"). ``everysec`` would not do: Valkey answers writes it holds back
  while the fsync of the second before still runs (``benchmarks/aof_kill.py`` counts them).
* The pool comes back as it was: the same epoch, its leases with their ids and tokens, no grace
  period; a holder's heartbeat goes on without any recovery, and a new request is granted at
  once.
"""

from __future__ import annotations

import pytest
import redis

from gpulock import Pool
from gpulock.embedded import PERSISTENCE_ARGS
from support.servers import RedisProcess
from support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


def test_the_persistence_is_an_append_only_file_written_before_each_answer(server_binary, tmp_path):
    assert PERSISTENCE_ARGS == ("--save", "", "--appendonly", "yes", "--appendfsync", "no")
    with RedisProcess(server_binary, data_dir=tmp_path / "data") as rp:
        c = redis.Redis.from_url(rp.url)
        got = c.config_get("append*")
        assert (got["appendonly"], got["appendfsync"]) == ("yes", "no"), got
        assert c.config_get("save")["save"] == "", c.config_get("save")
        c.close()


def test_every_answered_write_survives_kill_9_of_the_server(server_binary, tmp_path):
    with RedisProcess(server_binary, data_dir=tmp_path / "data") as rp:
        for _ in range(20):
            c = redis.Redis.from_url(rp.url)
            for _ in range(300):
                n = c.incr("n")  # each one answered before the next is sent
            c.close()
            rp.restart()  # kill -9 right after the last answer; a server on the same directory
            c = redis.Redis.from_url(rp.url)
            assert int(c.get("n")) == n
            c.close()


def test_a_server_restarted_with_its_data_keeps_the_pool_and_has_no_grace_period(
    server_binary, tmp_path
):
    with RedisProcess(server_binary, data_dir=tmp_path / "data") as rp:
        holder = Pool.from_url(rp.url, "kept", default_ttl=1.5)
        holder.configure(100, max_ttl=30)  # a grace period would be 30 s
        lease = holder.acquire(60)
        before = holder.status()
        rp.restart()  # kill -9, then a server on the same port and directory
        other = Pool.from_url(rp.url, "kept")
        st = other.status()
        assert st.epoch == before.epoch and st.grace_left == 0, (before, st)
        assert [(x.lease_id, x.token) for x in st.leases] == [(lease.id, lease.token)]
        # no grace period: what fits is granted at once (timeout=0 is refused in one)
        with other.acquire(40, timeout=0):
            pass
        # the holder's heartbeats go on (ttl 1.5 s): its lease lives past two ttls after the
        # restart, with no recovery (nothing put back, the same epoch)
        then = st.leases[0].held_for
        wait_until(lambda: other.status().leases[0].held_for > then + 3.0, 10, "the lease held")
        lease.ensure_valid()
        st = other.status()
        assert st.reasserted == 0 and st.epoch == before.epoch, st
        lease.release()
        assert other.status().used == 0
        other.close()
        holder.close()
