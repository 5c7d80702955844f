"""A real Redis Cluster (or Valkey cluster) on loopback, for the tests and the benchmarks: N
masters with R replicas each, slots split evenly, formed with CLUSTER MEET / ADDSLOTS /
REPLICATE (no redis-cli needed), each node a :class:`gpulock.embedded.RedisProcess` without
persistence.

Ports are picked below 55536: a node's cluster bus listens on port + 10000."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from gpulock.protocol.keys import pool_key
from gpulock.embedded import RedisProcess

#: Start replication at once, stop without waiting for replicas.
FAST_REPLICATION = ["--repl-diskless-sync-delay", "0", "--shutdown-timeout", "0"]

SLOTS = 16384
#: Node ports are drawn from [20000, 45000): each node's bus port (+ 10000) stays below 55536.
PORT_RANGE = (20000, 45000)


def _free_cluster_port(host: str = "127.0.0.1") -> int:
    """A port free for the node and for its bus (port + 10000), both below 65536."""
    for _ in range(200):
        p = random.randrange(*PORT_RANGE)
        ok = True
        for q in (p, p + 10000):
            with socket.socket() as s:
                try:
                    s.bind((host, q))
                except OSError:
                    ok = False
                    break
        if ok:
            return p
    raise RuntimeError("no free port pair for a cluster node")


@dataclass
class Cluster:
    """The nodes of a running cluster; ``masters[i]`` has replicas ``replicas[i]``."""

    binary: str
    masters: list[RedisProcess] = field(default_factory=list)
    replicas: list[list[RedisProcess]] = field(default_factory=list)
    #: Ports of the nodes stopped by :meth:`pause` (SIGSTOP) and not resumed yet.
    paused: set[int] = field(default_factory=set)

    @property
    def nodes(self) -> list[RedisProcess]:
        return self.masters + [r for rs in self.replicas for r in rs]

    @property
    def url(self) -> str:
        """``redis+cluster://`` naming every master as a seed."""
        return "redis+cluster://" + ",".join(f"{m.host}:{m.port}" for m in self.masters)

    def node_url(self, i: int = 0) -> str:
        """A plain ``redis://`` URL of master ``i``."""
        return self.masters[i].url

    def client(self, node: RedisProcess) -> Any:  # redis.Redis; execute_command is unannotated
        """A client of ``node`` alone (MOVED for keys of other nodes' slots)."""
        return redis.Redis(host=node.host, port=node.port, socket_timeout=5)

    def master_of(self, key: str) -> RedisProcess:
        """The node that serves ``key``'s slot now (asked of a live node)."""
        for n in self.live_nodes():
            try:
                slot = self.client(n).execute_command("CLUSTER", "KEYSLOT", key)
                for start, end, primary, *_ in self.client(n).execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        port = primary[1]
                        return next(x for x in self.nodes if x.port == port)
            except redis.RedisError:
                continue
        raise RuntimeError(f"no live node knows the master of {key!r}")

    def names_by_master(self, prefix: str, per_master: int = 1) -> list[list[str]]:
        """Pool names ``prefix0``, ``prefix1``, ... grouped by the master that serves each
        (``[i]``: ``per_master`` names on ``masters[i]``), for spreading pools over masters."""
        out: list[list[str]] = [[] for _ in self.masters]
        index = {m.port: i for i, m in enumerate(self.masters)}
        for n in range(100_000):
            name = f"{prefix}{n}"
            i = index[self.master_of(pool_key(name, "cfg")).port]
            if len(out[i]) < per_master:
                out[i].append(name)
            if all(len(x) == per_master for x in out):
                return out
        raise RuntimeError(f"no names found for prefix {prefix!r}")

    def keyslot(self, key: str) -> int:
        """The hash slot of ``key`` (asked of a live node)."""
        for n in self.live_nodes():
            try:
                return int(self.client(n).execute_command("CLUSTER", "KEYSLOT", key))
            except redis.RedisError:
                continue
        raise RuntimeError("no live node answers")

    def live_nodes(self) -> list[RedisProcess]:
        """The nodes whose process runs and is not paused."""
        return [
            n
            for n in self.nodes
            if n.proc is not None and n.proc.poll() is None and n.port not in self.paused
        ]

    def pause(self, node: RedisProcess) -> None:
        """SIGSTOP ``node``: connections to it succeed, its replies never come."""
        node.pause()
        self.paused.add(node.port)

    def resume(self, node: RedisProcess) -> None:
        """SIGCONT a node stopped by :meth:`pause`."""
        node.resume()
        self.paused.discard(node.port)

    def replica_of(self, master: RedisProcess) -> RedisProcess:
        """A live replica of ``master`` that says its link to it is up."""
        for n in self.live_nodes():
            if n is master:
                continue
            try:
                info = self.client(n).info("replication")
            except redis.RedisError:
                continue
            if info.get("role") == "slave" and int(info.get("master_port", 0)) == master.port:
                return n
        raise RuntimeError(f"no live replica of {master.host}:{master.port}")

    def is_master(self, node: RedisProcess, timeout: float = 0.5) -> bool:
        """Whether ``node`` says it is a master now (False when it does not answer)."""
        try:
            c: Any = redis.Redis(host=node.host, port=node.port, socket_timeout=timeout)
            try:
                role = c.execute_command("ROLE")
            finally:
                c.close()
        except (redis.RedisError, OSError):
            return False
        return bytes(role[0]) == b"master"

    def wait_synced(self, node: RedisProcess, timeout: float = 30.0) -> None:
        """Until ``node`` is a replica whose link to its master is up, and every live node
        says ``cluster_state:ok`` (after a node rejoined)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                info = self.client(node).info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") == "up":
                    break
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{node.host}:{node.port} did not sync as a replica")
            time.sleep(0.05)
        self.wait_ok(max(1.0, deadline - time.monotonic()))

    def migrate_slot(self, key: str, to: RedisProcess, step_pause: float = 0.0) -> None:
        """Move the slot of ``key`` from the master that serves it to master ``to`` as
        ``redis-cli --cluster reshard`` does: ``SETSLOT IMPORTING``/``MIGRATING``, ``MIGRATE``
        of its keys one at a time (``step_pause`` seconds after each, so that clients meet
        the slot half-moved: ``ASK`` and ``TRYAGAIN``), then ``SETSLOT NODE`` on every master."""
        src = self.master_of(key)
        if src is to:
            return
        slot = self.keyslot(key)
        s, d = self.client(src), self.client(to)
        sid, did = (x.execute_command("CLUSTER", "MYID") for x in (s, d))
        d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", sid)
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", did)
        while True:
            keys = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1)
            if not keys:
                break
            s.execute_command("MIGRATE", to.host, to.port, "", 0, 5000, "KEYS", *keys)
            if step_pause:
                time.sleep(step_pause)
        for n in [to, src] + [m for m in self.live_nodes() if m not in (to, src)]:
            try:
                if n is to or n is src or self.is_master(n):
                    self.client(n).execute_command("CLUSTER", "SETSLOT", slot, "NODE", did)
            except redis.RedisError:
                pass

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok`` and knows every live node."""
        live = self.live_nodes()
        deadline = time.monotonic() + timeout
        while True:
            try:
                infos = [self.client(n).execute_command("CLUSTER", "INFO") for n in live]
                if all(_field(i, "cluster_state") == "ok" for i in infos):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok within {timeout}s")
            time.sleep(0.05)

    def stop(self) -> None:
        for n in self.nodes:
            try:
                n.stop()
            except Exception:
                pass


def _field(info: bytes | str, name: str) -> str:
    text = info.decode() if isinstance(info, bytes) else info
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k == name:
            return v.strip()
    return ""


def start_cluster(
    binary: str,
    masters: int = 3,
    replicas: int = 1,
    node_timeout_ms: int = 1000,
    full_coverage: bool = False,
    pick_port: Callable[[], int] | None = None,
) -> Cluster:
    """Start and form a cluster; returns it once every node says ``cluster_state:ok`` and
    every replica has synced. ``full_coverage``: ``cluster-require-full-coverage yes``
    (Redis's default: every node refuses every key while a slot has no master), else ``no``.
    ``pick_port``: returns each node's port, free with its bus port (+ 10000), both below
    65536 (default: drawn at random from :data:`PORT_RANGE`). The caller stops it
    (:meth:`Cluster.stop`)."""
    pick = pick_port or _free_cluster_port
    c = Cluster(binary)
    args = [
        "--cluster-enabled",
        "yes",
        "--cluster-node-timeout",
        str(node_timeout_ms),
        "--cluster-require-full-coverage",
        "yes" if full_coverage else "no",
        *FAST_REPLICATION,
    ]

    def node() -> RedisProcess:
        p = RedisProcess(binary, port=pick(), extra_args=list(args))
        p.extra_args += ["--cluster-config-file", f"{p.dir}/nodes.conf"]
        return p.start()

    try:
        c.masters = [node() for _ in range(masters)]
        c.replicas = [[node() for _ in range(replicas)] for _ in range(masters)]
        first = c.client(c.masters[0])
        for n in c.nodes[1:]:
            first.execute_command("CLUSTER", "MEET", n.host, n.port)
        per = SLOTS // masters
        for i, m in enumerate(c.masters):
            lo, hi = i * per, (SLOTS - 1 if i == masters - 1 else (i + 1) * per - 1)
            c.client(m).execute_command("CLUSTER", "ADDSLOTS", *range(lo, hi + 1))
        ids = [c.client(m).execute_command("CLUSTER", "MYID") for m in c.masters]
        ids = [i.decode() if isinstance(i, bytes) else i for i in ids]
        deadline = time.monotonic() + 30
        for i, rs in enumerate(c.replicas):
            for r in rs:
                while True:  # REPLICATE needs the master known to this node (gossip)
                    try:
                        c.client(r).execute_command("CLUSTER", "REPLICATE", ids[i])
                        break
                    except redis.ResponseError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)
        c.wait_ok()
        for rs in c.replicas:
            for r in rs:
                while c.client(r).info("replication").get("master_link_status") != "up":
                    if time.monotonic() > deadline:
                        raise RuntimeError("a replica did not sync")
                    time.sleep(0.05)
        return c
    except BaseException:
        c.stop()
        raise
