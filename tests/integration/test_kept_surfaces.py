"""What shows kept bytes (docs/SEMANTICS.md, "Kept bytes"), against real servers: a pool object
with ``keep=`` acquires and releases while nobody waits, so the pool answers "kept" and its
holder keeps the lease; ``status()``, ``gpulock status`` (text and ``--json``), ``gpulock top``,
``gpulock pool list`` and ``/metrics``' pool families show the lease kept, the kept bytes and the
counters; a request that does not fit asks the holder to give it back, and they show that. With
keeping off (the default) nothing is shown as kept."""

from __future__ import annotations

import json

import pytest
from support.pools import GiB
from support.waiting import wait_until
from integration.test_cli_pools import gpulock
from integration.test_preemption_surfaces import _metrics_text, _pool_samples, wide

from gpulock import Pool

pytestmark = pytest.mark.timeout(120)

# Seconds the keeping pool object may keep an idle lease: far longer than a loaded machine
# takes to read the surfaces, so the lease is never given back for idling while they are read.
KEEP_S = 3600

KEPT_LINE = (
    "kept: 1 lease, 4.0GiB (their holders give them back when a request does not fit); "
    "releases kept 1, asked back 0"
)


def _lease_header(text: str) -> list[str]:
    """The column names of ``gpulock status``'s lease table (its line starting ``lease``)."""
    (line,) = [x for x in text.splitlines() if x.startswith("lease ")]
    return line.split()


def test_a_kept_lease_in_status_top_pool_list_and_metrics(redis_proc1):
    """A keeping pool object releases its 4 GiB lease with nobody waiting: the pool keeps it
    listed as kept (still counted in used). Then a request of 8 GiB does not fit: the holder
    is asked to give it back, gives it back, and the request is granted."""
    url, name = redis_proc1.url, "kp-on"
    admin = Pool.from_url(url, name)
    keeper = Pool.from_url(url, name, keep=KEEP_S)
    try:
        admin.configure(10 * GiB)
        lease = keeper.acquire(4 * GiB, holder={"job": "keeper"})
        lease.release()  # nobody waits: kept
        st = admin.status()
        (li,) = st.leases
        assert li.lease_id == lease.id and li.kept and st.kept == [li]
        assert (st.kept_bytes, st.kept_leases, st.releases_kept, st.kept_asked_back) == (
            4 * GiB,
            1,
            1,
            0,
        )
        assert st.used == 4 * GiB and st.free == 6 * GiB  # kept bytes are held bytes

        r = gpulock(url, "status", name, "--json")
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        assert (d["kept_bytes"], d["kept_leases"], d["releases_kept"], d["kept_asked_back"]) == (
            4 * GiB,
            1,
            1,
            0,
        )
        assert [x["kept"] for x in d["leases"]] == [True]
        r = wide(url, "status", name)
        assert r.returncode == 0, r.stderr
        assert KEPT_LINE in r.stdout, r.stdout
        head = _lease_header(r.stdout)
        (row,) = [x for x in r.stdout.splitlines() if x.startswith(lease.id[:8])]
        assert head[-1] == "kept" and row.split()[-1] == "kept", r.stdout

        r = wide(url, "top", name, "--once")
        assert r.returncode == 0, r.stderr
        assert "used 4.0GiB (4.0GiB kept)" in r.stdout, r.stdout
        assert (
            "kept 1 lease, 4.0GiB (given back when a request does not fit)  releases kept 1  "
            "asked back 0" in r.stdout
        ), r.stdout
        rows = [x for x in r.stdout.splitlines() if "job=keeper" in x]
        assert len(rows) == 1 and rows[0].rstrip(" │").endswith("│ kept"), r.stdout

        r = gpulock(url, "pool", "list")
        assert r.returncode == 0, r.stderr
        assert "used 4.0GiB (40%, 4.0GiB kept)" in r.stdout, r.stdout
        r = gpulock(url, "pool", "list", "--json")
        (p,) = json.loads(r.stdout)
        assert (p["kept_bytes"], p["kept_leases"]) == (4 * GiB, 1)

        vals = _pool_samples(_metrics_text(st), name)
        assert vals["gpulock_pool_kept_bytes"] == 4 * GiB
        assert vals["gpulock_pool_kept_leases"] == 1
        assert vals["gpulock_pool_releases_kept_total"] == 1
        assert vals["gpulock_pool_kept_asked_back_total"] == 0

        # a request that does not fit next to the kept lease: its holder is asked to give it
        # back, and does, in the background (asked once, or again if the waiter refreshed its
        # place before the give-back landed)
        big = admin.acquire(8 * GiB, timeout=60, holder={"job": "big"})
        st = admin.status()
        (li,) = st.leases
        assert li.lease_id == big.id and not li.kept and st.kept == []
        assert (st.kept_bytes, st.kept_leases, st.releases_kept) == (0, 0, 1)
        told = st.kept_asked_back
        assert told >= 1
        r = wide(url, "status", name)
        assert (
            "kept: 0 leases, 0B (their holders give them back when a request does not fit); "
            f"releases kept 1, asked back {told}" in r.stdout
        ), r.stdout
        assert "kept" not in _lease_header(r.stdout), r.stdout  # no kept column
        r = wide(url, "top", name, "--once")
        assert f"releases kept 1  asked back {told}" in r.stdout, r.stdout
        assert "GiB kept)" not in r.stdout, r.stdout
        r = gpulock(url, "pool", "list")
        assert "kept" not in r.stdout, r.stdout
        vals = _pool_samples(_metrics_text(st), name)
        assert (vals["gpulock_pool_kept_bytes"], vals["gpulock_pool_kept_leases"]) == (0, 0)
        assert vals["gpulock_pool_kept_asked_back_total"] == told
        big.release()
    finally:
        keeper.close()
        admin.close()


def test_nothing_is_shown_kept_without_keep(redis_proc1):
    """A pool object with keeping off (the default) releases a lease and holds another: every
    surface shows no kept lease, no kept bytes and zero counters."""
    url, name = redis_proc1.url, "kp-off"
    p = Pool.from_url(url, name)
    try:
        p.configure(10 * GiB)
        p.acquire(4 * GiB).release()
        held = p.acquire(2 * GiB, holder={"job": "plain"})
        st = wait_until(lambda: (s := p.status()).lease_count == 1 and s, 30, "one lease")
        assert [li.kept for li in st.leases] == [False] and st.kept == []
        assert (st.kept_bytes, st.kept_leases, st.releases_kept, st.kept_asked_back) == (0,) * 4
        d = json.loads(gpulock(url, "status", name, "--json").stdout)
        assert (d["kept_bytes"], d["kept_leases"], d["releases_kept"], d["kept_asked_back"]) == (
            0,
        ) * 4
        assert [x["kept"] for x in d["leases"]] == [False]
        for args in (("status", name), ("top", name, "--once"), ("pool", "list")):
            r = wide(url, *args)
            assert r.returncode == 0, r.stderr
            assert "kept" not in r.stdout, (args, r.stdout)
        vals = _pool_samples(_metrics_text(st), name)
        for m in (
            "gpulock_pool_kept_bytes",
            "gpulock_pool_kept_leases",
            "gpulock_pool_releases_kept_total",
            "gpulock_pool_kept_asked_back_total",
        ):
            assert vals[m] == 0, m
        held.release()
    finally:
        p.close()
