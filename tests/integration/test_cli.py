"""The ``gpulock`` command line, run as a real process against a real Redis on a free port.

Every invocation gets ``GPULOCK_REDIS_URL`` set to the test's server, so nothing here can reach
a Redis on 6379.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import redis

from gpulock import AcquireTimeout, Pool
from gpulock.cli import EXIT_CAPACITY, EXIT_NO_POOL, EXIT_TEMPFAIL, EXIT_UNAVAILABLE
from support.ports import free_port
from support.pools import GiB
from support.procs import gpulock_argv, with_default_signals
from support.waiting import wait_until

# A hang catcher, not a speed check: a test here runs up to 15 `python -m gpulock` processes,
# each a second or more on a loaded 2-core machine (one took 39 s with two suites running).
pytestmark = pytest.mark.timeout(300)


def cli(url: str, *args: str, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPULOCK_REDIS_URL": url}
    env.pop("COLUMNS", None)
    return subprocess.run(
        [*gpulock_argv(), *args], env=env, capture_output=True, text=True, timeout=timeout, **kw
    )


def start(url: str, *args: str, **kw) -> subprocess.Popen:
    """``gpulock ARGS`` running, its signals at their default disposition (the tests send
    them), its stdout and stderr piped."""
    env = {**os.environ, "GPULOCK_REDIS_URL": url}
    return subprocess.Popen(
        with_default_signals([*gpulock_argv(), *args]),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def snapshot(url: str) -> dict:
    """Every key and its DUMP, to show that a refused command changed nothing."""
    c = redis.Redis.from_url(url)
    try:
        return {k: c.dump(k) for k in sorted(c.keys("*"))}
    finally:
        c.close()


def status_json(url: str, name: str) -> dict:
    r = cli(url, "status", name, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def url(redis_proc1):
    return redis_proc1.url


# ---- pool set / status -----------------------------------------------------------------------
def test_pool_set_and_status_round_trip(redis_proc):
    url = redis_proc.url
    r = cli(url, "pool", "set", "gpu0", "--capacity", "8GiB")
    assert r.returncode == 0, r.stderr
    assert "created" in r.stdout and "8.0GiB" in r.stdout and str(8 * GiB) in r.stdout
    st = status_json(url, "gpu0")
    assert (st["pool"], st["capacity"], st["used"], st["free"]) == ("gpu0", 8 * GiB, 0, 8 * GiB)
    assert st["max_waiters"] == 10000 and st["leases"] == [] and st["waiters"] == []

    r = cli(url, "pool", "set", "gpu0", "--capacity", "4GiB", "--max-waiters", "7", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {
        "pool": "gpu0",
        "created": 0,
        "capacity": 4 * GiB,
        "epoch": st["epoch"],
        "used": 0,
        "max_waiters": 7,
        "policy": "fifo",
        "backfill_window": 2.0,
        "quotas": {},
        "devices": [4 * GiB],
        "placement": "bestfit",
        "preemption": None,
    }
    # Without --max-waiters the current bound is kept.
    r = cli(url, "pool", "set", "gpu0", "--capacity", "6GiB")
    assert r.returncode == 0 and "updated" in r.stdout, r
    st = status_json(url, "gpu0")
    assert (st["capacity"], st["max_waiters"]) == (6 * GiB, 7)

    # A lease and a waiter show up with holder metadata, in the table and in JSON.
    assert cli(url, "pool", "set", "gpu1", "--capacity", "1GiB").returncode == 0
    with Pool.from_url(url, "gpu0") as pool:
        lease = pool.acquire("5GiB", ttl=30, holder={"purpose": "train-llama"})
        waiter_err: list[BaseException] = []

        def wait() -> None:
            try:
                # the timeout only bounds a failure: the waiter must outlast the five CLI
                # calls below (each a Python start, seconds on a loaded host; 8 s was not enough
                # in CI), and is granted at the release
                pool.acquire("2GiB", timeout=200, holder={"purpose": "eval-job"}).release()
            except AcquireTimeout as e:
                waiter_err.append(e)

        th = threading.Thread(target=wait)
        th.start()
        try:
            st = wait_until(
                lambda: (s := status_json(url, "gpu0"))["waiters"] and s, timeout=30, interval=0.05
            )
            assert (st["used"], st["free"], st["lease_count"], st["waiter_count"]) == (
                5 * GiB,
                GiB,
                1,
                1,
            )
            (li,) = st["leases"]
            assert (
                li["lease_id"] == lease.id
                and li["token"] == lease.token
                and li["amount"] == 5 * GiB
            )
            assert li["holder"]["purpose"] == "train-llama" and li["holder"]["pid"] == os.getpid()
            assert 25 < li["expires_in"] <= 30 and li["ttl"] == 30.0
            (w,) = st["waiters"]
            assert (w["position"], w["amount"], w["holder"]["purpose"]) == (1, 2 * GiB, "eval-job")
            assert 0 <= w["waited"] < 50

            r = cli(url, "status", "gpu0")
            assert r.returncode == 0, r.stderr
            out = r.stdout
            assert "capacity 6.0GiB, used 5.0GiB" in out and "free 1.0GiB" in out
            assert lease.id[:8] in out and str(lease.token) in out and "train-llama" in out
            assert str(os.getpid()) in out and "expires in" in out
            assert "position" in out and "eval-job" in out and "2.0GiB" in out

            r = cli(url, "status", "--json")  # all pools
            assert r.returncode == 0, r.stderr
            assert [p["pool"] for p in json.loads(r.stdout)] == ["gpu0", "gpu1"]
            r = cli(url, "status")
            assert "pool gpu0" in r.stdout and "pool gpu1" in r.stdout
        finally:
            lease.release()
            th.join()
    assert not waiter_err  # granted after the release
    assert status_json(url, "gpu0")["used"] == 0


def test_status_labels_a_queued_growth_with_its_lease(url):
    """A growth waiting in the queue (lease.resize) is listed as the growth of its lease, by
    the bytes it grows by, with the lease's holder: ``growth_of`` and ``growth_token`` in
    JSON (None for a new request), a "growth of" column in the table."""
    assert cli(url, "pool", "set", "gpu0", "--capacity", "4GiB").returncode == 0
    with Pool.from_url(url, "gpu0") as pool:
        a = pool.acquire("2GiB", holder={"purpose": "stream-a"})
        b = pool.acquire("2GiB", holder={"purpose": "stream-b"})
        errs: list[BaseException] = []

        def grow() -> None:
            try:
                a.resize("3GiB", timeout=200)  # B may free bytes: queued until it does
            except Exception as e:  # noqa: BLE001
                errs.append(e)

        th = threading.Thread(target=grow)
        th.start()
        new: list = []
        th_new = threading.Thread(target=lambda: new.append(pool.acquire("1GiB", timeout=200)))
        try:
            wait_until(lambda: status_json(url, "gpu0")["waiters"], timeout=30, interval=0.05)
            th_new.start()  # a new request queued behind the growth
            st = wait_until(
                lambda: len((s := status_json(url, "gpu0"))["waiters"]) == 2 and s,
                timeout=30,
                interval=0.05,
            )
            g, w = st["waiters"]
            assert (g["position"], g["amount"], g["growth_of"], g["growth_token"]) == (
                1,
                GiB,
                a.id,
                a.token,
            )
            assert g["holder"]["purpose"] == "stream-a"
            assert (w["position"], w["growth_of"], w["growth_token"]) == (2, None, None)
            r = cli(url, "status", "gpu0")
            assert r.returncode == 0, r.stderr
            assert "growth of" in r.stdout, r.stdout
            (row,) = [ln for ln in r.stdout.splitlines() if "stream-a" in ln and "+1.0GiB" in ln]
            assert f"lease {a.id[:8]} +1.0GiB" in row, r.stdout
        finally:
            b.release()  # the growth is granted, then the new request (1 GiB left)
            th.join(30)
            th_new.join(30)
            for x in new:
                x.release()
            a.release()
    assert not errs and [x.amount for x in new] == [GiB]
    st = status_json(url, "gpu0")
    assert st["used"] == 0 and st["waiters"] == []


def test_status_of_missing_pool_and_empty_redis(url):
    r = cli(url, "status")
    assert r.returncode == 0 and "no pools" in r.stdout
    r = cli(url, "status", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == []
    r = cli(url, "status", "nope")
    assert r.returncode == EXIT_NO_POOL
    assert r.stdout == "" and "'nope' is not configured" in r.stderr


@pytest.mark.parametrize(
    "bad", ["8XB", "0", "-1GiB", "nan", "1.5B", "abc", "", "1e9", "9007199254740992"]
)
def test_bad_sizes_are_refused_and_change_nothing(url, bad):
    assert cli(url, "pool", "set", "gpu0", "--capacity", "2GiB").returncode == 0
    before = snapshot(url)
    r = cli(url, "pool", "set", "gpu0", "--capacity", bad)
    assert r.returncode == 2
    assert repr(bad) in r.stderr and "--capacity" in r.stderr, r.stderr
    r = cli(url, "run", "--pool", "gpu0", "--amount", bad, "--", "true")
    assert r.returncode == 2
    assert repr(bad) in r.stderr and "--amount" in r.stderr, r.stderr
    assert snapshot(url) == before


@pytest.mark.parametrize(
    "args",
    [
        ["pool", "set", "a{b}", "--capacity", "1GiB"],
        ["pool", "set", "a:b", "--capacity", "1GiB"],
        ["pool", "set", "gpu0", "--capacity", "1GiB", "--max-waiters", "0"],
        ["pool", "set", "gpu0", "--capacity", "1GiB", "--policy", "lifo"],
        ["pool", "set", "gpu0", "--backfill-window", "0"],
        ["pool", "set", "gpu0", "--policy", "backfill", "--backfill-window", "never"],
        ["run", "--pool", "a b", "--amount", "1GiB", "--", "true"],
        ["run", "--pool", "gpu0", "--amount", "1GiB", "--ttl", "0", "--", "true"],
        ["run", "--pool", "gpu0", "--amount", "1GiB", "--ttl", "nan", "--", "true"],
        ["run", "--pool", "gpu0", "--amount", "1GiB", "--timeout", "-1", "--", "true"],
        ["run", "--pool", "gpu0", "--amount", "1GiB", "--priority", "101", "--", "true"],
        ["run", "--pool", "gpu0", "--amount", "1GiB", "--priority", "high", "--", "true"],
        ["run", "--pool", "gpu0", "--amount", "1GiB"],
    ],
)
def test_bad_arguments_exit_2_and_change_nothing(url, args):
    assert cli(url, "pool", "set", "gpu0", "--capacity", "2GiB").returncode == 0
    before = snapshot(url)
    r = cli(url, *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == "" or "Usage" in r.stdout
    assert snapshot(url) == before


# ---- run ---------------------------------------------------------------------------------------
PRINT_ENV = textwrap.dedent("""
    import json, os, sys
    print(json.dumps({k: os.environ.get(k) for k in
                      ("GPULOCK_LEASE_ID", "GPULOCK_FENCING_TOKEN", "GPULOCK_POOL", "GPULOCK_AMOUNT")}))
    sys.stdout.flush()
    sys.exit(int(sys.argv[1]))
""")


def test_run_passes_env_returns_status_and_keeps_stdout_clean(url):
    assert cli(url, "pool", "set", "gpu0", "--capacity", "8GiB").returncode == 0
    fence_before = status_json(url, "gpu0")["fence"]
    r = cli(
        url, "run", "--pool", "gpu0", "--amount", "3GiB", "--", sys.executable, "-c", PRINT_ENV, "7"
    )
    assert r.returncode == 7, r.stderr
    env = json.loads(r.stdout)  # stdout is exactly CMD's one line
    assert r.stdout.count("\n") == 1
    assert env["GPULOCK_POOL"] == "gpu0" and env["GPULOCK_AMOUNT"] == str(3 * GiB)
    assert len(env["GPULOCK_LEASE_ID"]) == 32 and int(env["GPULOCK_LEASE_ID"], 16) >= 0
    assert int(env["GPULOCK_FENCING_TOKEN"]) == fence_before + 1
    st = status_json(url, "gpu0")
    assert st["used"] == 0 and st["leases"] == [] and st["grants"] == 1

    r = cli(
        url, "run", "--pool", "gpu0", "--amount", "1GiB", "--", sys.executable, "-c", PRINT_ENV, "0"
    )
    assert r.returncode == 0
    assert int(json.loads(r.stdout)["GPULOCK_FENCING_TOKEN"]) == fence_before + 2


def test_run_waits_in_queue_messages_on_stderr_only(url):
    assert cli(url, "pool", "set", "gpu0", "--capacity", "4GiB").returncode == 0
    with Pool.from_url(url, "gpu0") as pool:
        lease = pool.acquire("3GiB", ttl=30)
        p = start(
            url,
            "run",
            "--pool",
            "gpu0",
            "--amount",
            "2GiB",
            "--purpose",
            "queued-job",
            "--",
            sys.executable,
            "-c",
            "print('hello from cmd')",
        )
        try:
            st = wait_until(
                lambda: (s := status_json(url, "gpu0"))["waiters"] and s, timeout=30, interval=0.05
            )
            assert st["waiters"][0]["holder"]["purpose"] == "queued-job"
            time.sleep(0.2)
        finally:
            lease.release()
        out, err = p.communicate(timeout=20)
    assert p.returncode == 0, err
    assert out == "hello from cmd\n"
    assert "position 1" in err and "granted" in err
    assert all(line.startswith("gpulock: ") for line in err.splitlines()), err
    assert status_json(url, "gpu0")["used"] == 0


def test_run_reports_signal_death_as_128_plus_n(url):
    assert cli(url, "pool", "set", "gpu0", "--capacity", "1GiB").returncode == 0
    r = cli(
        url,
        "run",
        "-p",
        "gpu0",
        "-a",
        "1MiB",
        "--",
        sys.executable,
        "-c",
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    )
    assert r.returncode == 128 + signal.SIGKILL
    assert status_json(url, "gpu0")["used"] == 0


def test_run_timeout_exits_75_and_leaves_nothing(url, tmp_path):
    assert cli(url, "pool", "set", "gpu0", "--capacity", "4GiB").returncode == 0
    marker = tmp_path / "ran"
    with Pool.from_url(url, "gpu0") as pool:
        lease = pool.acquire("4GiB", ttl=30)
        try:
            t0 = time.monotonic()
            r = cli(
                url,
                "run",
                "--pool",
                "gpu0",
                "--amount",
                "1GiB",
                "--timeout",
                "0.5",
                "--",
                "touch",
                str(marker),
            )
            took = time.monotonic() - t0
            assert r.returncode == EXIT_TEMPFAIL == 75
            assert "no lease of 1.0GiB on pool 'gpu0' within 0.5s" in r.stderr
            assert r.stdout == "" and not marker.exists() and took < 10
            # --timeout 0: try once.
            r = cli(
                url,
                "run",
                "--pool",
                "gpu0",
                "--amount",
                "1GiB",
                "--timeout",
                "0",
                "--",
                "touch",
                str(marker),
            )
            assert r.returncode == 75 and not marker.exists()
            st = status_json(url, "gpu0")
            assert (st["used"], st["waiter_count"], st["lease_count"]) == (4 * GiB, 0, 1)
        finally:
            lease.release()


def test_run_error_exit_codes(url, tmp_path):
    assert cli(url, "pool", "set", "gpu0", "--capacity", "1GiB").returncode == 0
    marker = tmp_path / "ran"
    r = cli(url, "run", "-p", "gpu0", "-a", "2GiB", "--", "touch", str(marker))
    assert r.returncode == EXIT_CAPACITY
    assert "exceeds the pool's capacity" in r.stderr and len(r.stderr.splitlines()) == 1
    r = cli(url, "run", "-p", "nope", "-a", "1MiB", "--", "touch", str(marker))
    assert r.returncode == EXIT_NO_POOL and "'nope' is not configured" in r.stderr
    r = cli(url, "run", "-p", "gpu0", "-a", "1MiB", "--", "no-such-command-xyz")
    assert r.returncode == 127 and "command not found" in r.stderr
    dead = f"redis://127.0.0.1:{free_port()}/0"
    r = cli(dead, "run", "-p", "gpu0", "-a", "1MiB", "--", "touch", str(marker))
    assert r.returncode == EXIT_UNAVAILABLE and "unavailable" in r.stderr
    r = cli(dead, "status")
    assert r.returncode == EXIT_UNAVAILABLE
    assert not marker.exists()
    assert status_json(url, "gpu0")["used"] == 0


TRAP_TERM = textwrap.dedent("""
    import os, signal, sys, time
    marker = sys.argv[1]
    def on_term(signum, frame):
        with open(marker, "a") as f:
            f.write(f"TERM {os.getpid()}\\n")
        sys.exit(42)
    signal.signal(signal.SIGTERM, on_term)
    with open(marker + ".ready", "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(0.05)
""")


def test_run_forwards_sigterm_to_cmd(url, tmp_path):
    assert cli(url, "pool", "set", "gpu0", "--capacity", "1GiB").returncode == 0
    marker = tmp_path / "m"
    p = start(
        url, "run", "-p", "gpu0", "-a", "1MiB", "--", sys.executable, "-c", TRAP_TERM, str(marker)
    )
    wait_until(lambda: Path(str(marker) + ".ready").exists(), timeout=30, interval=0.05)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 42, err  # CMD's own status after handling the forwarded TERM
    assert marker.read_text().startswith("TERM")
    assert status_json(url, "gpu0")["used"] == 0


def test_run_interrupted_while_waiting_leaves_the_queue(url, tmp_path):
    assert cli(url, "pool", "set", "gpu0", "--capacity", "1GiB").returncode == 0
    marker = tmp_path / "ran"
    with Pool.from_url(url, "gpu0") as pool:
        lease = pool.acquire("1GiB", ttl=30)
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                p = start(url, "run", "-p", "gpu0", "-a", "1MiB", "--", "touch", str(marker))
                wait_until(
                    lambda: status_json(url, "gpu0")["waiter_count"] == 1, timeout=30, interval=0.05
                )
                p.send_signal(sig)
                out, err = p.communicate(timeout=30)
                assert p.returncode == 128 + sig, err
                assert "nothing is held" in err
                assert status_json(url, "gpu0")["waiter_count"] == 0
        finally:
            lease.release()
    assert not marker.exists()
    assert status_json(url, "gpu0")["used"] == 0


def test_extras_hook_registers_and_tolerates_absence(monkeypatch):
    """A ``gpulock.cli`` entry point (``gpulock_service.cli:register``) is called with the app
    when its module imports; without it the CLI works."""
    import types
    from importlib.metadata import EntryPoint

    import gpulock.cli as cli_mod

    ep = EntryPoint("serve", "gpulock_service.cli:register", cli_mod.ENTRY_POINT_GROUP)
    monkeypatch.setattr(cli_mod, "_extra_entry_points", lambda: [ep])
    seen = []
    fake = types.ModuleType("gpulock_service.cli")
    fake.register = lambda app: seen.append(app)
    monkeypatch.setitem(sys.modules, "gpulock_service.cli", fake)
    cli_mod._register_extras()
    assert seen == [cli_mod.app]
    monkeypatch.setitem(sys.modules, "gpulock_service.cli", None)  # import now raises ImportError
    cli_mod._register_extras()
    assert seen == [cli_mod.app]


def test_run_long_unicode_command_line_fits_holder_metadata(url):
    assert cli(url, "pool", "set", "gpu0", "--capacity", "1GiB").returncode == 0
    long_arg = "é" * 2000
    r = cli(
        url,
        "run",
        "-p",
        "gpu0",
        "-a",
        "1MiB",
        "--",
        sys.executable,
        "-c",
        "import json, subprocess, sys; print('ok')",
        long_arg,
    )
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr


def test_pool_set_below_what_is_leased_says_so(url):
    """Lowering the capacity below what is leased revokes nothing (the leases keep their
    bytes; nothing new is granted until use is under it): `pool set` still succeeds, and says
    so, so the operator is not left believing the pool is within its new capacity."""
    assert cli(url, "pool", "set", "shrink", "--capacity", "1GiB").returncode == 0
    with Pool.from_url(url, "shrink") as pool, pool.lease("1GiB", ttl=30):
        r = cli(url, "pool", "set", "shrink", "--capacity", "512MiB")
        assert r.returncode == 0, r.stderr
        assert "512.0MiB" in r.stdout and "nothing new is granted" in r.stderr, r
        assert pool.status().used == 1 << 30  # nothing revoked
    r = cli(url, "pool", "set", "shrink", "--capacity", "2GiB")
    assert r.returncode == 0 and "nothing new is granted" not in r.stderr, r


@pytest.mark.parametrize("command", ["serve", "broker"])
def test_a_bad_log_format_exits_2_naming_it(url, command):
    before = snapshot(url)
    r = cli(url, command, "--log-format", "xml", "--port", str(free_port()))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "--log-format" in r.stderr and "'xml'" in r.stderr, r.stderr
    assert snapshot(url) == before


def test_status_shows_holder_metadata_literally(redis_proc):
    """Holder metadata is set by any client: `gpulock status` shows its control characters as
    escapes and its brackets as text, so an ANSI sequence cannot reach the terminal and a
    newline cannot break the table (a fresh user's finding)."""
    with Pool.from_url(redis_proc.url, "lit", capacity=100) as p:
        lease = p.acquire(1, holder={"purpose": "\x1b[31mRED\x1b[0m\nfake line\r[bold]x[/bold]"})
        r = cli(redis_proc.url, "status", "lit")
        lease.release()
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\r" not in r.stdout
    for piece in ("\\x1b[31mRED", "\\x0afake", "\\x0d[bold]x"):  # (the column may fold)
        assert piece in r.stdout, r.stdout


# ---- priorities --------------------------------------------------------------------------------
APPEND = "import sys; open(sys.argv[1], 'a').write(sys.argv[2] + '\\n')"


def waiter_row(text: str, purpose: str) -> list[str]:
    """The fields of the waiter table's row for ``purpose`` (position, amount, priority, ...)."""
    (row,) = [ln.split() for ln in text.splitlines() if f" {purpose} " in f" {ln} "]
    return row


def test_run_priority_goes_first_and_status_shows_it(url, tmp_path):
    """At capacity, `gpulock run --priority 0` queues, then `--priority 50`: status (JSON and
    table) lists the priority-50 one first with its priority, and it runs first. (A waiter's
    priority ages up one level a second: 50 levels apart, the second may queue up to 50 s after
    the first, as a CLI start on a loaded machine can take several seconds.)"""
    assert cli(url, "pool", "set", "gpu0", "--capacity", "4GiB").returncode == 0
    out = tmp_path / "order"
    procs = []

    def run(purpose: str, prio: str) -> subprocess.Popen:
        p = start(
            url,
            "run",
            "--pool",
            "gpu0",
            "--amount",
            "3GiB",
            "--priority",
            prio,
            "--purpose",
            purpose,
            "--",
            sys.executable,
            "-c",
            APPEND,
            str(out),
            purpose,
        )
        procs.append(p)
        return p

    def waiting(n: int):
        ws = status_json(url, "gpu0")["waiters"]
        return len(ws) == n and [(w["holder"]["purpose"], w["priority"]) for w in ws]

    with Pool.from_url(url, "gpu0") as pool:
        lease = pool.acquire("4GiB", ttl=30)
        try:
            run("low", "0")
            wait_until(lambda: waiting(1), timeout=30, interval=0.05, what="low queued")
            run("high", "50")
            assert wait_until(
                lambda: waiting(2), timeout=30, interval=0.05, what="both queued"
            ) == [("high", 50), ("low", 0)]
            r = cli(url, "status", "gpu0")
            assert r.returncode == 0, r.stderr
            assert "priority" in r.stdout, r.stdout
            assert waiter_row(r.stdout, "high")[:3] == ["1", "3.0GiB", "50"], r.stdout
            assert waiter_row(r.stdout, "low")[:3] == ["2", "3.0GiB", "0"], r.stdout
        finally:
            lease.release()
            for p in procs:
                p.communicate(timeout=30)
    assert [p.returncode for p in procs] == [0, 0], [p.stderr for p in procs]
    assert out.read_text().split() == ["high", "low"]
    assert status_json(url, "gpu0")["used"] == 0


@pytest.mark.parametrize("bad", ["101", "-101", "high", "1.5", ""])
def test_run_bad_priority_exits_2_naming_it(url, bad):
    assert cli(url, "pool", "set", "gpu0", "--capacity", "2GiB").returncode == 0
    before = snapshot(url)
    r = cli(url, "run", "--pool", "gpu0", "--amount", "1GiB", "--priority", bad, "--", "true")
    assert r.returncode == 2, (r.stdout, r.stderr)
    shown = bad if bad.lstrip("-").isdigit() else repr(bad)
    assert f"got {shown}" in r.stderr and "--priority" in r.stderr, r.stderr
    assert snapshot(url) == before
