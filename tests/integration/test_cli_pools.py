"""``gpulock pool list``, ``gpulock pool delete``, and the CLI's messages about a pool: a
missing pool names the Redis it looked at; a ttl over the pool's bound is refused in the
command's own units (issue 10 items 4, 5, 9)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import redis

from gpulock import LeaseLost, Pool
from support.ports import free_port

# A hang catcher, not a speed check: a test here runs up to 15 `python -m gpulock` processes,
# each a second or more on a loaded 2-core machine (one took 39 s with two suites running).
pytestmark = pytest.mark.timeout(300)


def gpulock(url: str | None, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    if url is not None:
        env["GPULOCK_REDIS_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "gpulock", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def url(redis_proc1):
    return redis_proc1.url


def _keys(url: str, pool: str) -> list[str]:
    c = redis.Redis.from_url(url)
    try:
        return sorted(k.decode() for k in c.scan_iter(match=f"gpulock:{{{pool}}}:*"))
    finally:
        c.close()


def test_pool_list(url):
    r = gpulock(url, "pool", "list")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and "no pools" in r.stderr
    for name, cap in (("b-pool", "2GiB"), ("a-pool", "1GiB")):
        assert gpulock(url, "pool", "set", name, "--capacity", cap).returncode == 0
    r = gpulock(url, "pool", "list")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == ["a-pool", "b-pool"], r.stdout
    assert "1.0GiB" in lines[0] and "2.0GiB" in lines[1], r.stdout
    r = gpulock(url, "pool", "list", "--json")
    assert [(p["pool"], p["capacity"]) for p in json.loads(r.stdout)] == [
        ("a-pool", 2**30),
        ("b-pool", 2 * 2**30),
    ]


def test_pool_delete_refuses_while_leases_are_held_unless_forced(url):
    # A long ttl: the holder's first renewal (ttl/3) comes long after this test; a renewal of
    # a force-deleted pool's lease would put the pool back (Redis-lost-its-data rule).
    assert (
        gpulock(url, "pool", "set", "gone", "--capacity", "4GiB", "--max-ttl", "3600").returncode
        == 0
    )
    assert gpulock(url, "pool", "set", "kept", "--capacity", "4GiB").returncode == 0
    p = Pool.from_url(url, "gone")
    try:
        lease = p.acquire("1GiB", ttl=3000)
        r = gpulock(url, "pool", "delete", "gone")
        assert r.returncode == 75, (r.returncode, r.stderr)
        assert "1 lease" in r.stderr and "--force" in r.stderr, r.stderr
        assert "gpulock:{gone}:cfg" in _keys(url, "gone")  # nothing changed
        r = gpulock(url, "pool", "delete", "gone", "--force")
        assert r.returncode == 0, r.stderr
        assert "deleted" in r.stdout and "makes the pool again" in r.stderr, r.stderr
        assert _keys(url, "gone") == []
        assert _keys(url, "kept")  # the other pool is untouched
        with pytest.raises(LeaseLost):  # a late release of a forced-out lease changes nothing
            lease.release()
        assert _keys(url, "gone") == []
    finally:
        p.close()
    r = gpulock(url, "pool", "delete", "gone")
    assert r.returncode == 66, (r.returncode, r.stderr)
    assert url in r.stderr
    r = gpulock(url, "pool", "list")
    assert r.stdout.split()[0] == "kept"


def test_pool_delete_of_an_idle_pool(url):
    assert gpulock(url, "pool", "set", "idle", "--capacity", "1GiB").returncode == 0
    r = gpulock(url, "pool", "delete", "idle")
    assert r.returncode == 0, r.stderr
    assert _keys(url, "idle") == []


def test_missing_pool_names_the_redis_url(url):
    for args in (("status", "nope"), ("run", "--pool", "nope", "--amount", "1GiB", "--", "true")):
        r = gpulock(url, *args)
        assert r.returncode == 66, (args, r.returncode, r.stderr)
        assert f"not configured in Redis at {url}" in r.stderr, r.stderr


def test_run_ttl_over_the_pools_max_is_refused_in_seconds(url):
    assert gpulock(url, "pool", "set", "p", "--capacity", "1GiB").returncode == 0
    r = gpulock(url, "run", "--pool", "p", "--amount", "1MiB", "--ttl", "120", "--", "true")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "--ttl 120" in r.stderr and "60 s" in r.stderr and "--max-ttl" in r.stderr, r.stderr
    assert "ttl_ms" not in r.stderr, r.stderr
    # the hint is a command that works as given
    hint = r.stderr.strip().rsplit("raise the bound: gpulock ", 1)[1].split()
    assert hint == ["pool", "set", "p", "--max-ttl", "120"], r.stderr
    assert gpulock(url, *hint).returncode == 0
    r = gpulock(url, "run", "--pool", "p", "--amount", "1MiB", "--ttl", "120", "--", "true")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("status",),
        ("pool", "list"),
        ("pool", "set", "p", "--capacity", "1GiB"),
        ("run", "--pool", "p", "--amount", "1GiB", "--", "true"),
    ],
)
def test_an_unknown_url_scheme_is_a_usage_error_everywhere(args):
    r = gpulock(None, "--redis-url", "garbage", *args)
    assert r.returncode == 2, (args, r.returncode, r.stderr)
    assert "garbage" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = gpulock("garbage", *args)  # the same from GPULOCK_REDIS_URL
    assert r.returncode == 2, (args, r.returncode, r.stderr)


def test_both_urls_on_the_command_line_is_a_usage_error(url):
    r = gpulock(None, "--redis-url", url, "--broker-url", "http://127.0.0.1:1", "status")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "--redis-url" in r.stderr and "--broker-url" in r.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (("--pool", "bad/name"), "pool name"),
        (("--redis-url", "garbage"), "garbage"),
        (("--model", "nosuch"), "nosuch"),
        (("--model", "no_such_module_xyz:factory"), "no_such_module_xyz"),
        (("--log-level", "loud"), "loud"),
        (("--capacity", "lots"), "capacity"),
        (("--redis-url", "redis://127.0.0.1:1/0", "--data-dir", "x"), "--data-dir"),
        (("--data-dir", " "), "--data-dir is empty"),
        (("--data-dir", "/proc/version/x"), "/proc/version/x"),  # not a directory one can make
    ],
)
def test_serve_validates_every_option_before_starting_anything(args, needle):
    r = gpulock(None, "serve", "--port", str(free_port()), *args, timeout=60)
    assert r.returncode == 2, (args, r.returncode, r.stderr)
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "Redis:" not in r.stderr and "workers" not in r.stderr, (
        r.stderr
    )  # no banner: nothing started


def test_serve_with_an_unreachable_redis_exits_69():
    """An unreachable --redis-url is EX_UNAVAILABLE (69), as in the rest of the CLI, with a
    line that says so; 2 is for bad values only. No worker starts."""
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    r = gpulock(
        None,
        "serve",
        "--port",
        str(free_port()),
        "--redis-url",
        dead,
        "--model",
        "sleep",
        timeout=60,
    )
    assert r.returncode == 69, (r.returncode, r.stderr)
    assert "unreachable" in r.stderr and dead in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "starting:" not in r.stderr, r.stderr


@pytest.mark.parametrize("redis_env", [False, True])
def test_serve_refuses_a_broker_url_from_the_environment(redis_env):
    """GPULOCK_BROKER_URL in the environment stops serve as --broker-url does (exit 2, naming
    it, nothing started), also with a GPULOCK_REDIS_URL beside it (the broker's wins, as for
    every command); --redis-url on the command line wins over it, as for every command (serve
    then goes on to its next check: here a busy port)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    env["GPULOCK_BROKER_URL"] = "http://127.0.0.1:1"
    url = f"redis://127.0.0.1:{free_port()}/0"
    if redis_env:
        env["GPULOCK_REDIS_URL"] = url
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        cmd = [sys.executable, "-m", "gpulock", "serve", "--port", port, "--model", "sleep"]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert "GPULOCK_BROKER_URL" in r.stderr and "--redis-url" in r.stderr, r.stderr
        assert "Redis:" not in r.stderr and "workers" not in r.stderr, r.stderr  # nothing started
        assert "in use" not in r.stderr, r.stderr  # refused before any other check
        given = (
            [*cmd, "--redis-url", url] if redis_env else [*cmd[:3], "--redis-url", url, *cmd[3:]]
        )
        r = subprocess.run(given, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"{port} is in use" in r.stderr, (given, r.stderr)
    assert "GPULOCK_BROKER_URL" not in r.stderr, r.stderr


# ---- pool set --policy / --backfill-window (docs/SEMANTICS.md, "Backfill") -------------------
def _status(url: str, name: str) -> dict:
    r = gpulock(url, "status", name, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_pool_set_policy_and_window_and_what_is_kept(url):
    r = gpulock(
        url, "pool", "set", "bf", "--capacity", "1GiB", "--policy", "backfill",
        "--backfill-window", "0.5",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "created" in r.stdout and "policy backfill (window 0.5s)" in r.stdout, r.stdout
    st = _status(url, "bf")
    assert (st["policy"], st["backfill_window"]) == ("backfill", 0.5), st
    r = gpulock(url, "status", "bf")
    assert r.returncode == 0, r.stderr
    assert "queue policy backfill (window 0.5s)" in r.stdout, r.stdout
    # a capacity change alone keeps the policy and the window
    r = gpulock(url, "pool", "set", "bf", "--capacity", "2GiB", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["capacity"], d["policy"], d["backfill_window"]) == (2 * 2**30, "backfill", 0.5), d
    # the window alone, then the policy alone, without --capacity: the rest is kept
    r = gpulock(url, "pool", "set", "bf", "--backfill-window", "3")
    assert r.returncode == 0, r.stderr
    assert "updated" in r.stdout and "policy backfill (window 3s)" in r.stdout, r.stdout
    r = gpulock(url, "pool", "set", "bf", "--policy", "fifo", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["created"], d["capacity"], d["policy"], d["backfill_window"]) == (
        0,
        2 * 2**30,
        "fifo",
        3.0,
    ), d
    st = _status(url, "bf")
    assert (st["capacity"], st["policy"], st["max_waiters"]) == (2 * 2**30, "fifo", 10000), st
    # a window under FIFO is kept for later, and the command says it does nothing yet
    r = gpulock(url, "pool", "set", "bf", "--backfill-window", "4")
    assert r.returncode == 0 and "no effect under policy fifo" in r.stderr, r.stderr
    assert _status(url, "bf")["backfill_window"] == 4.0
    r = gpulock(url, "status", "bf")
    assert r.returncode == 0 and "policy" not in r.stdout, r.stdout  # FIFO goes unsaid
    r = gpulock(url, "pool", "set", "bf", "--capacity", "1GiB")
    assert r.returncode == 0 and r.stdout.rstrip().endswith(", policy fifo"), r.stdout
    # a new pool gets FIFO
    r = gpulock(url, "pool", "set", "plain", "--capacity", "1GiB", "--json")
    d = json.loads(r.stdout)
    assert (d["policy"], d["backfill_window"]) == ("fifo", 2.0), d


def test_pool_set_without_capacity_needs_an_existing_pool(url):
    r = gpulock(url, "pool", "set", "nope", "--policy", "backfill")
    assert r.returncode == 66, (r.returncode, r.stderr)
    assert "not configured" in r.stderr and "--capacity SIZE" in r.stderr, r.stderr
    assert _keys(url, "nope") == []  # nothing made


@pytest.mark.parametrize(
    "args, shown",
    [
        (("--policy", "lifo"), "'lifo'"),
        (("--policy", "FIFO"), "'FIFO'"),
        (("--policy", ""), "''"),
        (("--backfill-window", "0"), "0"),
        (("--backfill-window", "-1"), "-1"),
        (("--backfill-window", "86401"), "86401"),
        (("--backfill-window", "nan"), "nan"),
        (("--backfill-window", "inf"), "inf"),
        (("--backfill-window", "soon"), "soon"),
        # an integer option names the value it got too (typer's own message did not)
        (("--max-waiters", "-1"), "'-1'"),
        (("--max-waiters", "0"), "'0'"),
        (("--max-waiters", "1000001"), "'1000001'"),
        (("--max-waiters", "abc"), "'abc'"),
        (("--max-waiters", "1.5"), "'1.5'"),
        (("--utilization", "0"), "'0'"),
        (("--utilization", "1.5"), "'1.5'"),
        (("--utilization", "nan"), "'nan'"),
        (("--utilization", "most"), "'most'"),
    ],
)
def test_pool_set_bad_values_exit_2_naming_them(url, args, shown):
    assert gpulock(url, "pool", "set", "p", "--capacity", "1GiB").returncode == 0
    c = redis.Redis.from_url(url)
    try:
        before = {k: c.dump(k) for k in sorted(c.keys("*"))}
        for more in ((), ("--capacity", "2GiB")):
            r = gpulock(url, "pool", "set", "p", *more, *args)
            assert r.returncode == 2, (args, r.returncode, r.stderr)
            assert args[0] in r.stderr and shown in r.stderr, r.stderr
            assert "Traceback" not in r.stderr, r.stderr
        assert {k: c.dump(k) for k in sorted(c.keys("*"))} == before  # nothing changed
    finally:
        c.close()


def test_status_says_when_a_pool_is_in_its_grace_period(url):
    """A pool made again after Redis lost its data (configure's grace flag, as a pool object's
    recovery sends it) grants nothing for one max_ttl: gpulock status says so, with the time
    left."""
    from support.pools import raw

    c = redis.Redis.from_url(url)
    try:
        raw(c, "g", "configure", 2**30, 100, "set", 30_000, "1")
    finally:
        c.close()
    r = gpulock(url, "status", "g")
    assert r.returncode == 0, r.stderr
    assert "grace period: Redis lost the pool's data; no new grants for" in r.stdout, r.stdout
    assert _status(url, "g")["grace_left"] > 20
    assert gpulock(url, "pool", "set", "plain", "--capacity", "1GiB").returncode == 0
    assert "grace" not in gpulock(url, "status", "plain").stdout


def test_a_size_the_cli_prints_it_accepts(url):
    """``gpulock pool list`` (and the service's messages) print ``1.4GiB``; ``--capacity
    1.4GiB`` was refused ("must be a whole number of bytes"): what gpulock prints it reads
    back, a fraction of a byte counting as a whole one."""
    r = gpulock(url, "pool", "set", "sizes", "--capacity", "1500000000")
    assert r.returncode == 0, r.stderr
    listed = gpulock(url, "pool", "list")
    assert listed.returncode == 0 and "1.4GiB" in listed.stdout, listed.stdout
    r = gpulock(url, "pool", "set", "sizes", "--capacity", "1.4GiB")
    assert r.returncode == 0, r.stderr
    with Pool.from_url(url, "sizes") as p:
        assert p.status().capacity == 1_503_238_554  # 1.4 x 2**30 = 1503238553.6, rounded up
