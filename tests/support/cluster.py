"""The real Redis Cluster / Valkey cluster the tests start (:mod:`gpulock.transport.local_cluster`, which
the benchmarks use too), and the faults the cluster tests inject into it: a master killed
(``kill -9``) or stopped (SIGSTOP) until its replica is promoted, then healed (started again or
resumed: it rejoins as a replica), so that one cluster serves several fault tests in turn."""

from __future__ import annotations

import time

from redis.crc import key_slot

from gpulock.embedded import RedisProcess
from gpulock.protocol.keys import pool_key
from gpulock.transport import local_cluster
from gpulock.transport.local_cluster import Cluster

from .ports import cluster_port

__all__ = [
    "Cluster",
    "Failover",
    "masters_now",
    "pool_on",
    "seeds_url",
    "start_cluster",
    "wait_replicated",
]


def start_cluster(binary: str, **kw) -> Cluster:
    """:func:`gpulock.transport.local_cluster.start_cluster` (same arguments) on node ports of
    this test process's own (:func:`support.ports.cluster_port`)."""
    return local_cluster.start_cluster(binary, pick_port=cluster_port, **kw)


def _tag_of_slot(slot: int) -> str:
    return next(f"{{t{i}}}" for i in range(10**6) if key_slot(f"{{t{i}}}".encode()) == slot)


#: Keys in slots 0, 8191 and 16383: one in each third of the slots, so on three masters.
PROBES = [_tag_of_slot(s) for s in (0, 8191, 16383)]


def masters_now(c: Cluster) -> list[RedisProcess]:
    """The masters now (after earlier failovers), in slot order: of slot 0 (redis-py's
    "default" node: the first primary its slot map lists), of slot 8191 and of slot 16383."""
    return [c.master_of(k) for k in PROBES]


def seeds_url(*nodes: RedisProcess) -> str:
    """``redis+cluster://`` naming ``nodes`` as the seeds, in that order (redis-py's cluster
    clients take the first master they list, a seed, as their "default" node)."""
    return "redis+cluster://" + ",".join(f"{n.host}:{n.port}" for n in nodes)


def pool_on(c: Cluster, node: RedisProcess, prefix: str, skip: int = 0) -> str:
    """A pool name ``prefix<n>`` whose slot ``node`` serves now (the ``skip``-th such name)."""
    for n in range(100_000):
        name = f"{prefix}{n}"
        if c.master_of(pool_key(name, "cfg")) is node:
            if skip == 0:
                return name
            skip -= 1
    raise RuntimeError(f"no pool name with prefix {prefix!r} on {node.port}")


def wait_replicated(c: Cluster, master: RedisProcess, timeout: float = 10.0) -> None:
    """Until every replica of ``master`` has applied everything ``master`` has written so far
    (its replication offset, read now)."""
    info = c.client(master).info("replication")
    target = int(info["master_repl_offset"])
    deadline = time.monotonic() + timeout
    while True:
        info = c.client(master).info("replication")
        offsets = [int(v["offset"]) for k, v in info.items() if k.startswith("slave")]
        if offsets and min(offsets) >= target:
            return
        assert time.monotonic() < deadline, "the replicas did not catch up"
        time.sleep(0.01)


class Failover:
    """One fault of a master: ``how`` is "kill" (``kill -9``) or "stop" (SIGSTOP: its
    connections succeed, its replies never come). :meth:`start` injects it and returns its
    local time (``time.monotonic()``); :meth:`promoted` waits for its replica's promotion and
    returns the time the replica answered ``ROLE`` as a master (polled every 10 ms);
    :meth:`heal` starts or resumes the node and waits until it is a synced replica."""

    def __init__(self, c: Cluster, master: RedisProcess, how: str):
        assert how in ("kill", "stop"), how
        self.c, self.master, self.how = c, master, how
        self.replica = c.replica_of(master)
        self.at: float | None = None

    def start(self) -> float:
        if self.how == "kill":
            self.master.kill()
        else:
            self.c.pause(self.master)
        self.at = time.monotonic()
        return self.at

    def promoted(self, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while not self.c.is_master(self.replica, 0.2):
            assert time.monotonic() < deadline, "the replica was not promoted"
            time.sleep(0.01)
        return time.monotonic()

    def heal(self) -> None:
        if self.how == "kill":
            if self.master.proc is None or self.master.proc.poll() is not None:
                self.master.start()
        elif self.master.port in self.c.paused:
            self.c.resume(self.master)
        self.c.wait_synced(self.master, 60)
