"""gpulock-common: the core and the SDK share one error tree and one lease validity clock, and
the shared distribution needs nothing outside the standard library."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import gpulock.errors
import gpulock_client
import gpulock_client.errors
import gpulock_common.errors
import gpulock_common.lease
import pytest
from gpulock.protocol import lease as _lease
from gpulock_client import _core as C

ROOT = Path(__file__).resolve().parents[2]


def test_every_error_class_is_the_shared_one():
    shared = set(gpulock_common.errors.__all__)
    assert set(gpulock.errors.__all__) <= shared
    assert set(gpulock_client.errors.__all__) <= shared
    for name in gpulock.errors.__all__:
        assert getattr(gpulock.errors, name) is getattr(gpulock_common.errors, name), name
    for name in gpulock_client.errors.__all__:
        cls = getattr(gpulock_common.errors, name)
        assert getattr(gpulock_client.errors, name) is cls, name
        assert getattr(gpulock_client, name) is cls, name
    both = set(gpulock.errors.__all__) & set(gpulock_client.errors.__all__)
    assert {"GpuLockError", "LeaseLost", "AcquireTimeout", "CapacityExceeded"} <= both
    for name in both:
        assert getattr(gpulock.errors, name) is getattr(gpulock_client, name), name
    assert gpulock.errors.LeaseLost is gpulock_client.LeaseLost
    assert gpulock.GpuLockError is gpulock_client.GpuLockError


def test_constructors_serve_both_sides():
    e = gpulock_common.errors.CapacityExceeded(10, 5)
    assert (e.amount, e.capacity, e.status) == (10, 5, None) and "5 bytes" in str(e)
    e = gpulock_common.errors.CapacityExceeded(9, 4, "from the broker")
    assert (e.amount, e.capacity, str(e)) == (9, 4, "from the broker")
    q = gpulock_common.errors.QueueFull("gpu0", 3, 3)
    assert (q.pool, q.queue_length, q.max_waiters) == ("gpu0", 3, 3) and "max_waiters=3" in str(q)
    q = gpulock_common.errors.QueueFull("gpu0", 7, message="full")
    assert (q.queue_length, q.max_waiters, str(q)) == (7, None, "full")
    p = gpulock_common.errors.PoolNotFound("gpu0")
    assert p.pool == "gpu0" and "gpulock pool set gpu0" in str(p)
    assert str(gpulock_common.errors.PoolNotFound("gpu0", "m")) == "m"


def test_one_validity_rule():
    rule = gpulock_common.lease.validity_deadline
    assert (
        C.validity_deadline is rule and C.reply_made_after is gpulock_common.lease.reply_made_after
    )
    assert _lease.CLOCK_DRIFT == C.CLOCK_DRIFT == gpulock_common.lease.CLOCK_DRIFT
    assert _lease.SAFETY_MARGIN_S == C.SAFETY_MARGIN_S == gpulock_common.lease.SAFETY_MARGIN_S
    # The core's (sent, server now ms, server expiry ms) is the rule over that span.
    assert math.isclose(_lease.validity_deadline(10.0, 50_000, 53_000), rule(10.0, 3.0))
    assert _lease.validity_deadline(10.0, 60_000, 53_000) == rule(10.0, 0.0)
    # The SDK's long-polled grant: counted from sent + held, both shrunk by the drift bound.
    d = rule(100.0, 2.0, 4.0)
    assert math.isclose(d, 100.0 + 6.0 * (1 - C.CLOCK_DRIFT) - C.SAFETY_MARGIN_S)
    for state in (_lease.LeaseState, C.LeaseState):
        assert issubclass(state, gpulock_common.lease.LocalLeaseState)
    for view in (_lease.LeaseBase, C.LeaseBase):
        assert issubclass(view, gpulock_common.lease.LeaseView)


def test_local_state_without_an_owner_calls_back_with_nothing():
    t = [0.0]
    s = gpulock_common.lease.LocalLeaseState("p", "a" * 32, 1, 2, 3.0, 1.0, lambda: t[0])
    fired = []
    s.add_callback(lambda: fired.append("none"))
    s.add_callback(lambda o: fired.append(o), owner=None)
    s.check()
    t[0] = 1.0
    assert s.lost and s.active  # past its deadline, not marked until someone looks
    with pytest.raises(gpulock_common.errors.LeaseLost, match="local validity deadline"):
        s.check()
    assert not s.active and s.lost_reason
    assert fired == ["none", None]
    assert s.mark_lost("again") is False and fired == ["none", None]


def test_importing_gpulock_common_imports_only_the_standard_library():
    script = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import gpulock_common, gpulock_common.errors, gpulock_common.lease, gpulock_common.units\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(sorted(n for n in new if n != 'gpulock_common' and n not in sys.stdlib_module_names))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('redis', 'httpx', 'fastapi', 'torch', 'gpulock', 'gpulock_client', 'tenacity')))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert r.stdout.split("\n")[:2] == ["[]", "[]"], r.stdout + r.stderr


def test_importing_gpulock_client_imports_no_redis_torch_or_fastapi():
    script = (
        "import sys, gpulock_client\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('redis', 'fastapi', 'torch', 'gpulock', 'tenacity')))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert r.stdout.strip() == "[]", r.stdout + r.stderr


def test_both_distributions_depend_on_gpulock_common():
    """Both require at least the gpulock-common of this tree: a change to gpulock-common that
    they need (0.2.0: the error table and the option vocabulary; 0.3.0: the step driver) bumps its version and their
    lower bound together, so pip never pairs them with an older one."""
    import gpulock_common

    tomllib = pytest.importorskip("tomllib")
    common = tomllib.loads((ROOT / "clients/common/pyproject.toml").read_text())["project"]
    assert (common["name"], common["dependencies"]) == ("gpulock-common", [])
    assert common["version"] == gpulock_common.__version__
    for path in ("pyproject.toml", "clients/python/pyproject.toml"):
        deps = tomllib.loads((ROOT / path).read_text())["project"]["dependencies"]
        assert f"gpulock-common>={common['version']}" in deps, path
