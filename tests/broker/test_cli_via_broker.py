"""Every ``gpulock`` command either honours ``--broker-url`` or refuses it with a usage error;
none falls back to a Redis the user did not name. Messages name the broker, in the command's
own units (issue 10 items 4 and 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support.ports import free_port

from ._support import ADMIN_TOKEN, USER_TOKEN


def _gpulock(
    *args: str, token: str | None = USER_TOKEN, timeout: float = 60
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("GPULOCK_TOKEN", None)
    env.pop("GPULOCK_BROKER_URL", None)
    # A Redis URL that nothing answers: a command that ignored --broker-url and fell back to
    # Redis would fail with 69 here instead of writing to some Redis nobody named.
    env["GPULOCK_REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"
    if token is not None:
        env["GPULOCK_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "gpulock", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_pool_set_goes_through_the_broker(broker_srv, admin):
    r = _gpulock(
        "--broker-url",
        broker_srv.url,
        "pool",
        "set",
        "gpuX",
        "--capacity",
        "1GiB",
        token=ADMIN_TOKEN,
    )
    assert r.returncode == 0, (r.returncode, r.stderr)
    st = admin.get("/v1/pools/gpuX")
    assert st.status_code == 200 and st.json()["capacity"] == 2**30, st.text
    assert "created" in r.stdout


def test_pool_set_with_a_user_token_is_refused_as_permission(broker_srv):
    r = _gpulock("--broker-url", broker_srv.url, "pool", "set", "gpuY", "--capacity", "1GiB")
    assert r.returncode == 77, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "admin" in r.stderr
    # the advice fits: an admin token, not "a token ... for this pool"
    assert "needs an admin token" in r.stderr and "for this pool" not in r.stderr, r.stderr


def test_status_and_pool_list_go_through_the_broker(broker_srv, gpu, user):
    held = user.post(f"/v1/pools/{gpu}/leases", json={"amount": "3GiB", "ttl": 30})
    assert held.status_code == 201, held.text
    r = _gpulock("--broker-url", broker_srv.url, "status", gpu, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["pool"] == gpu and d["capacity"] == 10 * 2**30 and d["used"] == 3 * 2**30, d
    r = _gpulock("--broker-url", broker_srv.url, "status")
    assert r.returncode == 0, r.stderr
    assert f"pool {gpu}" in r.stdout and "3.0GiB" in r.stdout, r.stdout
    r = _gpulock("--broker-url", broker_srv.url, "pool", "list", "--json")
    assert r.returncode == 0, r.stderr
    assert [p["pool"] for p in json.loads(r.stdout)] == [gpu], r.stdout
    r = _gpulock("--broker-url", broker_srv.url, "pool", "list")
    assert r.returncode == 0 and r.stdout.split()[0] == gpu, r.stdout


def test_pool_set_max_ttl_goes_through_the_broker(broker_srv, admin):
    r = _gpulock(
        "--broker-url",
        broker_srv.url,
        "pool",
        "set",
        "gpuT",
        "--capacity",
        "1GiB",
        "--max-ttl",
        "3600",
        "--json",
        token=ADMIN_TOKEN,
    )
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert json.loads(r.stdout)["max_ttl"] == 3600, r.stdout
    assert admin.get("/v1/pools/gpuT").json()["max_ttl"] == 3600
    # a capacity change alone keeps it
    r = _gpulock(
        "--broker-url",
        broker_srv.url,
        "pool",
        "set",
        "gpuT",
        "--capacity",
        "2GiB",
        token=ADMIN_TOKEN,
    )
    assert r.returncode == 0, (r.returncode, r.stderr)
    st = admin.get("/v1/pools/gpuT").json()
    assert (st["capacity"], st["max_ttl"]) == (2 * 2**30, 3600), st
    r = _gpulock("--broker-url", broker_srv.url, "status", "gpuT", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["max_ttl"] == 3600, (r.stdout, r.stderr)
    r = _gpulock(
        "--broker-url",
        broker_srv.url,
        "run",
        "--pool",
        "gpuT",
        "--amount",
        "1GiB",
        "--ttl",
        "120",
        "--",
        sys.executable,
        "-c",
        "pass",
    )
    assert r.returncode == 0, (
        r.returncode,
        r.stderr,
    )  # over the default 60 s, within the pool's 3600


def test_pool_set_policy_goes_through_the_broker(broker_srv, admin):
    """--policy and --backfill-window go in the PUT body; the reply and `status` (text and
    JSON) show them; what is left out, the capacity too, is kept; a bad value is exit 2
    before anything is sent."""
    url = broker_srv.url

    def pool_set(*args: str) -> subprocess.CompletedProcess:
        return _gpulock("--broker-url", url, "pool", "set", "gpuB", *args, token=ADMIN_TOKEN)

    r = pool_set("--capacity", "1GiB", "--policy", "backfill", "--backfill-window", "0.5")
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert "created" in r.stdout and "policy backfill (window 0.5s)" in r.stdout, r.stdout
    st = admin.get("/v1/pools/gpuB").json()
    assert (st["policy"], st["backfill_window"]) == ("backfill", 0.5), st
    r = _gpulock("--broker-url", url, "status", "gpuB", "--json", token=ADMIN_TOKEN)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["policy"], d["backfill_window"]) == ("backfill", 0.5), d
    r = _gpulock("--broker-url", url, "status", "gpuB", token=ADMIN_TOKEN)
    assert r.returncode == 0 and "queue policy backfill (window 0.5s)" in r.stdout, r.stdout
    r = pool_set("--policy", "fifo", "--json")
    assert r.returncode == 0, (r.returncode, r.stderr)
    d = json.loads(r.stdout)
    assert (d["capacity"], d["policy"], d["backfill_window"]) == (2**30, "fifo", 0.5), d
    r = pool_set("--capacity", "2GiB")
    assert r.returncode == 0 and r.stdout.rstrip().endswith(", policy fifo"), r.stdout
    assert admin.get("/v1/pools/gpuB").json()["policy"] == "fifo"
    for bad in (("--policy", "lifo"), ("--backfill-window", "0")):
        r = pool_set("--capacity", "4GiB", *bad)
        assert r.returncode == 2 and bad[0] in r.stderr and bad[1] in r.stderr, r.stderr
    assert admin.get("/v1/pools/gpuB").json()["capacity"] == 2 * 2**30  # nothing sent
    r = _gpulock(
        "--broker-url", url, "pool", "set", "gpuNone", "--policy", "backfill", token=ADMIN_TOKEN
    )
    assert r.returncode == 66, (r.returncode, r.stderr)
    assert "--capacity SIZE" in r.stderr and url in r.stderr, r.stderr
    assert admin.get("/v1/pools/gpuNone").status_code == 404


def test_pool_set_devices_goes_through_the_broker(broker_srv, admin):
    """--devices (sizes, or a count with --capacity each) creates a pool of several devices
    through the broker, --capacity alone then sets each device's, and status shows them."""
    url = broker_srv.url

    def pool_set(name: str, *args: str) -> subprocess.CompletedProcess:
        return _gpulock("--broker-url", url, "pool", "set", name, *args, token=ADMIN_TOKEN)

    r = pool_set("gpuD1", "--devices", "2GiB,1GiB", "--placement", "spread")
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert "devices 2.0GiB,1.0GiB (placement spread)" in r.stdout, r.stdout
    r = pool_set("gpuD2", "--devices", "3", "--capacity", "1GiB")
    assert r.returncode == 0, (r.returncode, r.stderr)
    r = pool_set("gpuD2", "--capacity", "2GiB", "--json")
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert json.loads(r.stdout)["devices"] == [2 * 2**30] * 3
    st = admin.get("/v1/pools/gpuD2").json()
    assert [d["capacity"] for d in st["devices"]] == [2 * 2**30] * 3
    r = _gpulock("--broker-url", url, "status", "gpuD1", token=ADMIN_TOKEN)
    assert r.returncode == 0 and "devices (spread): 0 0B of 2.0GiB, 1 0B of 1.0GiB" in r.stdout, (
        r.stdout
    )


def test_pool_delete_goes_through_the_broker(broker_srv, gpu, admin, user):
    held = user.post(f"/v1/pools/{gpu}/leases", json={"amount": "1GiB", "ttl": 30})
    assert held.status_code == 201, held.text
    r = _gpulock("--broker-url", broker_srv.url, "pool", "delete", gpu)  # a user token
    assert r.returncode == 77, (r.returncode, r.stderr)
    assert "admin" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "needs an admin token" in r.stderr and "for this pool" not in r.stderr, r.stderr
    r = _gpulock("--broker-url", broker_srv.url, "pool", "delete", gpu, token=ADMIN_TOKEN)
    assert r.returncode == 75, (r.returncode, r.stderr)
    assert "1 lease(s) held" in r.stderr and "--force" in r.stderr and broker_srv.url in r.stderr, (
        r.stderr
    )
    assert admin.get(f"/v1/pools/{gpu}").status_code == 200  # still there
    r = _gpulock(
        "--broker-url", broker_srv.url, "pool", "delete", gpu, "--force", token=ADMIN_TOKEN
    )
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert f"pool {gpu} deleted (1 lease(s) and 0 waiter(s) dropped)" in r.stdout, r.stdout
    assert admin.get(f"/v1/pools/{gpu}").status_code == 404
    r = _gpulock("--broker-url", broker_srv.url, "pool", "delete", gpu, token=ADMIN_TOKEN)
    assert r.returncode == 66, (r.returncode, r.stderr)
    assert broker_srv.url in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_missing_pool_names_the_broker(broker_srv):
    r = _gpulock("--broker-url", broker_srv.url, "status", "nope")
    assert r.returncode == 66, (r.returncode, r.stderr)
    assert broker_srv.url in r.stderr, r.stderr


def test_run_through_an_unreachable_broker_says_broker(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    r = _gpulock(
        "--broker-url",
        url,
        "run",
        "--pool",
        "gpu0",
        "--amount",
        "1GiB",
        "--timeout",
        "2",
        "--",
        "true",
    )
    assert r.returncode == 69, (r.returncode, r.stderr)
    assert f"broker at {url} is unavailable" in r.stderr, r.stderr
    assert "Redis" not in r.stderr, r.stderr


def test_run_with_a_bad_or_missing_token_exits_77_listed_in_help(broker_srv, gpu):
    for token in ("wrong-token-0123456789abcdef", None):
        r = _gpulock(
            "--broker-url",
            broker_srv.url,
            "run",
            "--pool",
            gpu,
            "--amount",
            "1GiB",
            "--",
            "true",
            token=token,
        )
        assert r.returncode == 77, (token, r.returncode, r.stderr)
        assert "GPULOCK_TOKEN" in r.stderr and "Traceback" not in r.stderr, r.stderr
    h = _gpulock("run", "--help")
    assert "77" in h.stdout and "token" in h.stdout, h.stdout


def test_run_ttl_over_the_pools_max_is_refused_in_seconds(broker_srv, gpu):
    r = _gpulock(
        "--broker-url",
        broker_srv.url,
        "run",
        "--pool",
        gpu,
        "--amount",
        "1GiB",
        "--ttl",
        "120",
        "--",
        "true",
    )
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "--ttl 120" in r.stderr and "60 s" in r.stderr, r.stderr
    assert "ttl_ms" not in r.stderr, r.stderr


def test_run_ttl_under_the_brokers_least_is_refused_naming_the_option(broker_srv, gpu, admin):
    r = _gpulock(
        "--broker-url", broker_srv.url, "run", "--pool", gpu, "--amount", "1GiB", "--ttl", "0.5",
        "--", "true",
    )  # fmt: skip
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "--ttl must be between 1 and" in r.stderr and "got 0.5" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert admin.get(f"/v1/pools/{gpu}").json()["used"] == 0


def test_serve_refuses_a_broker_url():
    r = _gpulock(
        "--broker-url",
        "http://127.0.0.1:1",
        "serve",
        "--model",
        "sleep",
        "--port",
        str(free_port()),
    )
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "--broker-url" in r.stderr and "Redis:" not in r.stderr


def test_a_broker_url_that_is_not_http_is_a_usage_error():
    r = _gpulock("--broker-url", "redis://127.0.0.1:1/0", "status")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "http" in r.stderr and "Traceback" not in r.stderr


def test_broker_default_port_is_not_serves():
    """The broker (8100) and gpulock serve (8000) can run on one host with their defaults."""
    from gpulock_broker.app import DEFAULT_PORT

    assert DEFAULT_PORT == 8100
    for args in (("-m", "gpulock", "broker", "--help"), ("-m", "gpulock_broker", "--help")):
        r = subprocess.run(
            [sys.executable, *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "200"},
        )
        assert r.returncode == 0 and "8100" in r.stdout, (args, r.stdout, r.stderr)
    r = _gpulock("serve", "--help")
    assert "8000" in r.stdout, r.stdout


def test_status_from_a_broker_carries_each_waiters_priority():
    """`gpulock --broker-url status` builds the core's WaiterInfo from the broker's JSON: the
    priority is carried, and a broker older than priorities (no field) reads as 0."""
    from gpulock.cli.broker import status_from_dict

    pool = {
        "pool": "p",
        "capacity": 10,
        "used": 10,
        "max_waiters": 5,
        "lease_count": 0,
        "waiter_count": 2,
        "waiters": [
            {"position": 1, "amount": 3, "waited": 0.5, "holder": {}, "priority": 7},
            {"position": 2, "amount": 4, "waited": 1.5, "holder": {}},
        ],
    }
    st = status_from_dict(pool)
    assert [(w.position, w.priority) for w in st.waiters] == [(1, 7), (2, 0)]
    assert [w["priority"] for w in st.to_dict()["waiters"]] == [7, 0]
    # the queue policy: carried, and FIFO (2 s window) from a broker older than policies
    assert (st.policy, st.backfill_window) == ("fifo", 2.0)
    st = status_from_dict({**pool, "policy": "backfill", "backfill_window": 0.25})
    assert (st.policy, st.backfill_window) == ("backfill", 0.25)
