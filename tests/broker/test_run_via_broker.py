"""`gpulock run --broker-url`: a command run under a lease taken through the HTTP broker
(issue 4 item 3), with the same exit-code contract as through Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support.waiting import wait_until

from ._support import USER_TOKEN

# CMD of the priority tests: append argv[2] to the file argv[1], one line.
APPEND = "import sys; open(sys.argv[1], 'a').write(sys.argv[2] + chr(10))"


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


def test_run_through_broker_priority_goes_first_and_status_shows_it(
    broker_srv, gpu, user, tmp_path
):
    """Through the broker: at capacity, `gpulock run --priority 0` queues, then `--priority 50`;
    `gpulock status` (JSON and table, through the broker) lists the priority-50 one first with
    its priority, and it runs first. (Priorities age one level a second: 50 apart, the second
    may queue up to 50 s after the first, as a CLI start on a loaded machine can take seconds.)"""
    held = user.post(f"/v1/pools/{gpu}/leases", json={"amount": "10GiB", "ttl": 30})
    assert held.status_code == 201, held.text
    out = tmp_path / "order"
    env = dict(os.environ, GPULOCK_TOKEN=USER_TOKEN)
    env.pop("GPULOCK_REDIS_URL", None)
    procs = []

    def run(purpose: str, prio: str) -> None:
        argv = [sys.executable, "-m", "gpulock", "--broker-url", broker_srv.url, "run"]
        argv += ["--pool", gpu, "--amount", "6GiB", "--priority", prio, "--purpose", purpose]
        argv += ["--", sys.executable, "-c", APPEND, str(out), purpose]
        procs.append(
            subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )

    def waiting(n: int):
        ws = user.get(f"/v1/pools/{gpu}").json()["waiters"]
        return len(ws) == n and [(w["holder"]["purpose"], w["priority"]) for w in ws]

    try:
        run("low", "0")
        wait_until(lambda: waiting(1), timeout=30, interval=0.05, what="low queued")
        run("high", "50")
        assert wait_until(lambda: waiting(2), timeout=30, interval=0.05, what="both queued") == [
            ("high", 50),
            ("low", 0),
        ]
        r = _run(broker_srv.url, "status", gpu, "--json")
        assert r.returncode == 0, r.stderr
        ws = json.loads(r.stdout)["waiters"]
        assert [(w["holder"]["purpose"], w["priority"]) for w in ws] == [("high", 50), ("low", 0)]
        r = _run(broker_srv.url, "status", gpu)
        assert r.returncode == 0, r.stderr
        rows = {
            # position amount priority tenant host pid purpose ... (the token's tenant: "user")
            ln.split()[6]: ln.split()[:4]
            for ln in r.stdout.splitlines()
            if ln.split()[6:7] in (["high"], ["low"])
        }
        assert rows == {
            "high": ["1", "6.0GiB", "50", "user"],
            "low": ["2", "6.0GiB", "0", "user"],
        }, r.stdout
    finally:
        user.delete(f"/v1/pools/{gpu}/leases/{held.json()['lease_id']}")
        for p in procs:
            p.communicate(timeout=60)
    assert [p.returncode for p in procs] == [0, 0], [p.stderr for p in procs]
    assert out.read_text().split() == ["high", "low"]


def test_run_through_broker_bad_priority_exits_2_naming_it(broker_srv, gpu, user):
    r = _run(
        broker_srv.url, "run", "--pool", gpu, "--amount", "1GiB", "--priority", "200", "--", "true"
    )
    assert r.returncode == 2 and "got 200" in r.stderr, (r.returncode, r.stderr)
    st = user.get(f"/v1/pools/{gpu}").json()
    assert st["used"] == 0 and st["waiter_count"] == 0 and st["grants"] == 0
