"""`gpulock run --broker-url`: a command run under a lease taken through the HTTP broker
(issue 4 item 3), with the same exit-code contract as through Redis."""

from __future__ import annotations

import os
import subprocess
import sys

from ._support import USER_TOKEN


def _run(
    broker_url: str, *args: str, token: str = USER_TOKEN, timeout: float = 60
) -> subprocess.CompletedProcess:
    env = dict(os.environ, GPULOCK_TOKEN=token)
    env.pop("GPULOCK_REDIS_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "gpulock", "--broker-url", broker_url, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_run_through_broker_passes_lease_env_and_exit_status(broker_srv, gpu, admin):
    r = _run(
        broker_srv.url,
        "run",
        "--pool",
        gpu,
        "--amount",
        "4GiB",
        "--ttl",
        "5",
        "--",
        sys.executable,
        "-c",
        "import os,sys; print(os.environ['GPULOCK_POOL'], os.environ['GPULOCK_FENCING_TOKEN'],"
        " len(os.environ['GPULOCK_LEASE_ID'])); sys.exit(3)",
    )
    assert r.returncode == 3, r.stderr
    pool, token, idlen = r.stdout.split()
    assert pool == gpu and int(token) > 0 and int(idlen) == 32
    st = admin.get(f"/v1/pools/{gpu}").json()
    assert st["used"] == 0, st  # released when the command exited


def test_run_through_broker_times_out_with_75(broker_srv, gpu, user):
    held = user.post(f"/v1/pools/{gpu}/leases", json={"amount": "10GiB", "ttl": 30})
    assert held.status_code == 201, held.text
    r = _run(
        broker_srv.url, "run", "--pool", gpu, "--amount", "1GiB", "--timeout", "0.5", "--", "true"
    )
    assert r.returncode == 75, (r.returncode, r.stderr)
    assert r.stdout == ""


def test_run_through_broker_capacity_exceeded(broker_srv, gpu):
    r = _run(broker_srv.url, "run", "--pool", gpu, "--amount", "11GiB", "--", "true")
    assert r.returncode == 65, (r.returncode, r.stderr)
