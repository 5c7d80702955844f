"""Device truth against a real server, with the fake device file as the device (issue 18 items
1 and 3): the pool grants at most capacity minus the device's external use; a request that fits
only without it queues and is granted once the device shows the memory free (after the
hysteresis); a killed worker whose memory the device still shows is not granted again; a dead
sampler's report expires; one sampler per pool among several; over-users are flagged with
holder, lease and excess; ``gpulock run --enforce`` stops a command over its lease; bad
reports are refused naming the value and change nothing.

Every wait polls observed state (support.waiting); the sampler rounds are driven by the test
(``run_once``) except where a sampler process is killed."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import redis

from gpulock import AcquireTimeout, AsyncPool, InvalidArgument, PoolNotFound
from gpulock.cli import EXIT_OVERUSE
from gpulock.devices.sampler import DeviceSampler
from gpulock.devices.truth import Smoother
from gpulock.devices import FakeReader, write_fake_devices
from support.pools import MiB, raw, raw_configure, snapshot
from support.procs import gpulock_argv, kill_quietly
from support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.timeout(90)

HOST = socket.gethostname()
STRANGER = 4_000_000  # a pid no test process has (pid_max is at most 4194304)


def device(path, used: int, processes: dict[int, int] | None) -> None:
    doc: dict = {"index": 0, "total": 1 << 40, "used": used}
    if processes is not None:
        doc["processes"] = {str(k): v for k, v in processes.items()}
    write_fake_devices(path, [doc])


def sampler(pool: AsyncPool, path, **kw) -> DeviceSampler:
    kw.setdefault("smoother", Smoother(threshold=1, fall_samples=2, fall_seconds=0.0))
    kw.setdefault("overuse_hold", 0.0)
    kw.setdefault("slack", 0)
    return DeviceSampler(pool, FakeReader(path), 0, host=HOST, **kw)


async def test_external_use_holds_bytes_back_until_the_device_frees_them(make_apool, tmp_path):
    f = tmp_path / "dev.json"
    p = make_apool()
    await p.configure(1000)
    device(f, 400, {STRANGER: 400})  # a notebook outside gpulock
    s = sampler(p, f)
    r = await s.run_once()
    assert (r.holder, r.external_raw, r.external) == (True, 400, 400)
    st = await p.status()
    assert (st.external, st.effective_capacity, st.free) == (400, 600, 600)
    assert st.external_left > 0

    held = await p.acquire(300, ttl=30, timeout=0)  # 300 + 400 <= 1000
    with pytest.raises(AcquireTimeout, match="300/1000 bytes used, 400 held back for device"):
        await p.acquire(400, timeout=0)  # fits the capacity, not capacity - external
    waiter = asyncio.create_task(p.acquire(600, ttl=30, timeout=60))
    await async_wait_until(lambda: p.waiting == 1, what="the 600 to queue")
    st = await p.status()
    assert st.waiter_count == 1 and st.used == 300

    device(f, 0, {})  # the notebook exits
    r = await s.run_once()
    assert (r.external_raw, r.external) == (0, 400)  # a fall waits for its second sample
    assert (await p.status()).waiter_count == 1 and not waiter.done()
    r = await s.run_once()
    assert r.external == 0 and r.granted == 1  # the report's script handed the room on
    lease = await asyncio.wait_for(waiter, 10)
    assert lease.amount == 600
    st = await p.status()
    assert (st.external, st.used, st.waiter_count) == (0, 900, 0)
    await lease.release()
    await held.release()


_WORKER = textwrap.dedent(
    """
    import os, sys, time
    from gpulock import Pool
    url, pool, flag = sys.argv[1:4]
    p = Pool.from_url(url, pool)
    lease = p.acquire(400, ttl=5.0, timeout=30)  # 5 s: no missed renewal on a loaded host
    with open(flag + ".tmp", "w") as f:
        f.write(lease.id)
    os.replace(flag + ".tmp", flag)
    time.sleep(600)
    """
)


async def test_a_killed_worker_whose_memory_the_device_still_shows_is_not_granted_again(
    redis_proc, make_apool, tmp_path
):
    """The hung-worker case (gunicorn #2646): the worker is SIGKILLed, its lease expires and is
    reaped, but the device still lists its pid with its memory. Those bytes stay held back until
    the device stops listing it."""
    f, flag = tmp_path / "dev.json", tmp_path / "granted"
    p = make_apool()
    await p.configure(1000)
    device(f, 0, {})
    w = subprocess.Popen([sys.executable, "-c", _WORKER, redis_proc.url, p.name, str(flag)])
    try:
        await async_wait_until(flag.exists, 30, "the worker's lease")
        lease_id = flag.read_text()
        device(f, 400, {w.pid: 400})  # the worker allocated its lease
        s = sampler(p, f)
        r = await s.run_once()
        assert r.external == 0 and r.overusers == []  # a holder within its lease
        st = await p.status()
        assert [lz.lease_id for lz in st.leases] == [lease_id]
        assert st.leases[0].holder["pid"] == w.pid and st.leases[0].holder["host"] == HOST

        w.kill()  # the worker dies; the device (a hung process) still shows its memory
        w.wait()

        async def reaped() -> bool:
            return (await p.status()).lease_count == 0

        await _async_poll(reaped, 30, "the dead worker's lease to expire")
        r = await s.run_once()
        assert r.external == 400  # no live lease for that pid now: external
        with pytest.raises(AcquireTimeout):
            await p.acquire(601, timeout=0)
        ok = await p.acquire(600, timeout=0)
        await ok.release()
        for _ in range(3):  # however many rounds: still shown, still held back
            assert (await s.run_once()).external == 400
        with pytest.raises(AcquireTimeout):
            await p.acquire(601, timeout=0)

        device(f, 0, {})  # the device frees the memory at last
        await s.run_once()
        assert (await s.run_once()).external == 0
        full = await p.acquire(1000, timeout=0)
        await full.release()
    finally:
        kill_quietly(w.pid)
        w.wait()


async def _async_poll(pred, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await pred():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def test_a_dead_sampler_report_expires_and_the_queue_moves(redis_proc, tmp_path):
    """``gpulock sample`` publishes; SIGKILL it and the report expires after --report-ttl: the
    pool grants its full capacity again, to the waiter that was queued behind the report,
    without any other call from the test (the waiter's own heartbeat moves the queue)."""
    f = tmp_path / "dev.json"
    device(f, 500 * MiB, {STRANGER: 500 * MiB})  # over the default 64 MiB threshold
    env = {**os.environ, "GPULOCK_REDIS_URL": redis_proc.url}
    c = redis.Redis.from_url(redis_proc.url)
    from gpulock import Pool

    with Pool.from_url(redis_proc.url, "dead") as p:
        p.configure(1000 * MiB)
        proc = subprocess.Popen(
            [
                *gpulock_argv(),
                "sample",
                "--pool",
                "dead",
                "--device-reader",
                f"fake:{f}",
                "--interval",
                "0.2",
                "--report-ttl",
                "5",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_until(lambda: p.status().external == 500 * MiB, 30, "the sampler's report")
            with pytest.raises(AcquireTimeout):
                p.acquire(800 * MiB, timeout=0)
            got: list = []

            def take() -> None:
                got.append(p.acquire(800 * MiB, ttl=30, timeout=60))

            import threading

            t = threading.Thread(target=take)
            t.start()
            wait_until(lambda: p.status().waiter_count == 1, 10, "the 800 to queue")
            import time

            killed = time.monotonic()
            proc.kill()
            proc.wait()
            t.join(30)
            assert got, "the waiter was not granted after the report expired"
            print(
                f"\nsampler killed -> waiter granted: {time.monotonic() - killed:.2f} s (report ttl 5 s)"
            )
            st = p.status()
            assert (st.external, st.external_left, st.used) == (0, 0.0, 800 * MiB)
            got[0].release()
        finally:
            kill_quietly(proc.pid)
            out, err = proc.communicate()
    assert "sampling" in err and "external use" in err, err
    c.close()


async def test_one_sampler_per_pool_among_several(make_apool, tmp_path):
    f = tmp_path / "dev.json"
    device(f, 100, {STRANGER: 100})
    p = make_apool()
    await p.configure(1000)
    # claim_ttl 3 s: the holder renews it every round here, so a standby can take it only if
    # the test stalls for 3 s between two rounds
    ss = [sampler(p, f, claim_ttl=3.0, interval=0.1, report_ttl=5.0) for _ in range(3)]
    rounds = [await s.run_once() for s in ss]
    assert [r.holder for r in rounds] == [True, False, False]
    assert rounds[1].reading is None  # a standby does not read the device
    for _ in range(3):  # the holder renews its claim each round; the others stay out
        assert [(await s.run_once()).holder for s in ss] == [True, False, False]

    # The holder stops; its claim runs out and one of the others takes over.
    async def taken() -> bool:
        return any([(await s.run_once()).holder for s in ss[1:]])

    await _async_poll(taken, 30, "a standby to take the claim over")
    holders = [s for s in ss[1:] if s.holding]
    assert len(holders) == 1
    assert [(await s.run_once()).holder for s in ss[1:]] == [s is holders[0] for s in ss[1:]]
    assert (await ss[0].run_once()).holder is False


async def test_over_user_is_flagged_with_holder_lease_and_excess(make_apool, tmp_path, caplog):
    f = tmp_path / "dev.json"
    p = make_apool()
    await p.configure(1 << 40)
    mine = await p.acquire(100 * MiB, ttl=30, holder={"purpose": "greedy"})
    device(f, 300 * MiB, {os.getpid(): 300 * MiB})
    s = sampler(p, f, margin=0.10, slack=0)
    with caplog.at_level(logging.WARNING, logger="gpulock.device"):
        r = await s.run_once()
    assert [(o.pid, o.lease_ids, o.excess) for o in r.overusers] == [
        (os.getpid(), (mine.id,), 200 * MiB)
    ]
    assert r.external == 200 * MiB  # what it uses beyond its lease is outside the leases too
    st = await p.status()
    assert len(st.overusers) == 1
    o = st.overusers[0]
    assert o["pid"] == os.getpid() and o["lease_ids"] == [mine.id]
    assert (o["leased"], o["actual"], o["excess"]) == (100 * MiB, 300 * MiB, 200 * MiB)
    assert o["holder"]["purpose"] == "greedy" and o["holder"]["host"] == HOST
    text = caplog.text
    assert mine.id in text and str(200 * MiB) in text and "greedy" in text

    # Within the margin: no longer flagged (and the flag leaves status with the next report).
    device(f, 105 * MiB, {os.getpid(): 105 * MiB})
    assert (await s.run_once()).overusers == []
    assert (await p.status()).overusers == []
    await mine.release()


async def test_over_use_must_last_the_hold_before_it_is_flagged(make_apool, tmp_path):
    f = tmp_path / "dev.json"
    p = make_apool()
    await p.configure(1 << 40)
    mine = await p.acquire(100 * MiB, ttl=30)
    device(f, 300 * MiB, {os.getpid(): 300 * MiB})
    t = [0.0]
    s = sampler(p, f, overuse_hold=5.0, clock=lambda: t[0])
    assert (await s.run_once()).overusers == []
    t[0] = 4.9
    assert (await s.run_once()).overusers == []
    t[0] = 5.0
    r = await s.run_once()
    assert [o.over_for for o in r.overusers] == [5.0]
    await mine.release()


_GREEDY = "import time; time.sleep(120)"


def test_run_enforce_stops_a_command_over_its_lease(redis_proc, tmp_path):
    f = tmp_path / "dev.json"
    device(f, 0, {})
    env = {**os.environ, "GPULOCK_REDIS_URL": redis_proc.url}
    from gpulock import Pool

    with Pool.from_url(redis_proc.url, "enf") as p:
        p.configure(1 << 40)
        proc = subprocess.Popen(
            [
                *gpulock_argv(),
                "run",
                "--pool",
                "enf",
                "--amount",
                "100MiB",
                "--enforce",
                "--enforce-margin",
                "10%",
                "--enforce-slack",
                "0",
                "--enforce-grace",
                "0.5",
                "--grace",
                "5",
                "--device-reader",
                f"fake:{f}",
                "--",
                sys.executable,
                "-c",
                _GREEDY,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            st = wait_until(lambda: p.status().leases, 30, "the run's lease")
            pid = st[0].holder["pid"]  # gpulock run's pid; CMD is its child
            from support.procs import children

            kids = wait_until(lambda: children(pid), 30, "CMD to start")
            device(f, 105 * MiB, {kids[0]: 105 * MiB})  # within the 10% margin
            # Within the margin for well over the grace: CMD keeps running.
            wait_until(lambda: proc.poll() is None and _stays(proc, 1.5), 10, "CMD to stay")
            device(f, 200 * MiB, {kids[0]: 200 * MiB})
            out, err = proc.communicate(timeout=30)
        finally:
            kill_quietly(proc.pid)
        assert proc.returncode == EXIT_OVERUSE, err
        assert "--enforce" in err and f"pid {kids[0]}" in err and "SIGTERM" in err, err
        assert "exit 71" in err
        assert p.status().lease_count == 0  # released


def _stays(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return True
    return False


async def test_a_commands_memory_counts_as_its_gpulock_run_holder(redis_proc, make_apool, tmp_path):
    """``gpulock run`` holds the lease in its own process; its command (a child) is what the
    device lists. The command's use is charged to the run's lease: not external (not granted
    twice), and flagged as the run's over-use when it exceeds the lease."""
    f = tmp_path / "dev.json"
    device(f, 0, {})
    p = make_apool()
    await p.configure(1000 * MiB)
    env = {**os.environ, "GPULOCK_REDIS_URL": redis_proc.url}
    proc = subprocess.Popen(
        [
            *gpulock_argv(),
            "run",
            "--pool",
            p.name,
            "--amount",
            "400MiB",
            "--",
            sys.executable,
            "-c",
            _GREEDY,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        from support.procs import children

        async def leased() -> bool:
            return (await p.status()).lease_count == 1

        await _async_poll(leased, 30, "the run's lease")
        st = await p.status()
        run_pid, lease_id = st.leases[0].holder["pid"], st.leases[0].lease_id
        assert run_pid == proc.pid
        kids = wait_until(lambda: children(run_pid), 30, "CMD to start")
        device(f, 400 * MiB, {kids[0]: 400 * MiB})  # CMD uses exactly its lease
        s = sampler(p, f, margin=0.10, slack=0)
        r = await s.run_once()
        assert (r.external_raw, r.overusers) == (0, [])
        assert (await p.status()).free == 600 * MiB

        device(f, 700 * MiB, {kids[0]: 700 * MiB})  # CMD goes 300 MiB over its lease
        r = await s.run_once()
        assert [(o.pid, o.lease_ids, o.excess) for o in r.overusers] == [
            (run_pid, (lease_id,), 300 * MiB)
        ]
        assert r.external_raw == 300 * MiB  # only the excess is outside the leases
    finally:
        kill_quietly(proc.pid)
        proc.wait()


def test_run_enforce_refuses_bad_options_before_anything_is_held(redis_proc, tmp_path):
    env = {**os.environ, "GPULOCK_REDIS_URL": redis_proc.url}
    c = redis.Redis.from_url(redis_proc.url)
    raw_configure(c, "enfbad", 1000)
    dev, noproc = tmp_path / "dev.json", tmp_path / "noproc.json"
    device(dev, 0, {})
    device(noproc, 0, None)
    before = snapshot(c)
    for extra, needle in (
        (["--enforce-margin", "-3%"], "--enforce-margin"),
        (["--enforce-margin", "lots"], "'lots'"),
        (["--device-reader", "cuda"], "'cuda'"),
        (["--enforce-slack", "-1"], "--enforce-slack"),
        (["--enforce-margin", "10"], "did you mean 10%"),
        (["--device-reader", f"fake:{tmp_path}/missing.json"], "--enforce cannot read device 0"),
        (["--device-reader", f"fake:{noproc}"], "needs each process's device use"),
        (["--device-reader", f"fake:{dev}", "--device", "3"], "--enforce cannot read device 3"),
    ):
        r = subprocess.run(
            [
                *gpulock_argv(),
                "run",
                "--pool",
                "enfbad",
                "--amount",
                "10",
                "--enforce",
                *extra,
                "--",
                "true",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 2, (extra, r.stderr)
        assert needle in r.stderr, (extra, r.stderr)
        assert snapshot(c) == before
    c.close()


def _ext(sid="s1", claim=3000, mode="report", external=10, report=5000, overuse=""):
    return [sid, claim, mode, external, report, overuse]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (_ext(external=-5), "external must be a decimal integer, got '-5'"),
        (_ext(external=1001), "external 1001 exceeds the capacity 1000"),
        (_ext(external="1e3"), "got '1e3'"),
        (_ext(report=0), "report_ms must be in [100, 86400000], got 0"),
        (_ext(claim=5), "claim_ms must be in [100, 86400000], got 5"),
        (_ext(mode="write"), "mode must be 'claim' or 'report', got 'write'"),
        (_ext(sid="a b"), "sampler id must be 1-128 characters"),
        (_ext(overuse="{not json"), "overuse must be a JSON array or object"),
        (_ext(overuse="x" * 4097), "at most 4096 bytes"),
    ],
)
def test_bad_reports_are_refused_naming_the_value_and_change_nothing(rclient, argv, needle):
    raw_configure(rclient, "bad", 1000)
    raw(rclient, "bad", "external", *_ext(external=100))  # a report in place
    before = snapshot(rclient)
    with pytest.raises(redis.ResponseError) as ei:
        raw(rclient, "bad", "external", *argv)
    assert str(ei.value).startswith("GPULOCK_BADARG") and needle in str(ei.value), str(ei.value)
    assert snapshot(rclient) == before


async def test_bad_reports_through_the_api(make_apool):
    p = make_apool()
    with pytest.raises(PoolNotFound):
        await p.device_report("s1", 3000, 10, 5000)
    await p.configure(1000)
    with pytest.raises(InvalidArgument, match="exceeds the capacity 1000"):
        await p.device_report("s1", 3000, 5000, 5000)
    st = await p.status()
    assert (st.external, st.external_left) == (0, 0.0)
    r = await p.device_report("s1", 3000, 250, 5000, json.dumps([]))
    assert (r.holder, r.written, r.external) == (1, 1, 250)
    # another sampler may not overwrite it while the claim lasts
    r = await p.device_report("s2", 3000, 0, 5000)
    assert (r.holder, r.written, r.external) == (0, 0, 250)
    assert (await p.status()).external == 250


async def test_a_sampler_taking_over_goes_on_from_the_live_report(make_apool, tmp_path):
    """A standby that takes the claim over starts its smoothing from the report in force: a
    fall it sees at once still has to last (here two samples) before it is published."""
    f = tmp_path / "dev.json"
    p = make_apool()
    await p.configure(1000)
    r = await p.device_report("old-sampler", 100, 400, 30000)  # a claim of 100 ms
    assert r.written == 1
    device(f, 0, {})
    s = sampler(p, f)

    async def took_over() -> bool:
        return (await s.run_once()).holder

    await _async_poll(took_over, 30, "the standby to take the claim over")
    assert s.last is not None and s.last.external == 400  # the first sample of 0: not yet
    assert (await s.run_once()).external == 0
    assert (await p.status()).external == 0


def test_sample_refuses_a_report_ttl_shorter_than_two_intervals(redis_proc, tmp_path):
    env = {**os.environ, "GPULOCK_REDIS_URL": redis_proc.url}
    argv = [*gpulock_argv(), "sample", "--pool", "p", "--device-reader", f"fake:{tmp_path}/d"]
    r = subprocess.run(
        [*argv, "--interval", "3", "--report-ttl", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2, r.stderr
    assert "--report-ttl (5 s) must be at least two --interval (3 s each)" in r.stderr
