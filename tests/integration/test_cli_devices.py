"""Devices on the command line: ``gpulock pool set --devices`` makes a pool of several devices
(a count with ``--capacity`` each, or each device's capacity) and ``--placement`` picks the
rule; ``gpulock status`` shows each device's use and each lease's device; ``gpulock run`` puts
its lease on a device (``--pool NAME/D`` pins one) and gives CMD ``GPULOCK_DEVICE`` and, on a
pool of several devices, ``CUDA_VISIBLE_DEVICES`` naming only that GPU; bad values exit 2
naming them with nothing changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from integration.test_cli_pools import _status, gpulock

from gpulock import Pool

# A hang catcher, not a speed check: a test here runs up to 15 `python -m gpulock` processes,
# each a second or more on a loaded 2-core machine (one took 39 s with two suites running).
pytestmark = pytest.mark.timeout(300)
GiB = 2**30
SHOW_ENV = [
    sys.executable,
    "-c",
    "import os; e = os.environ.get; "
    "print(e('GPULOCK_DEVICE'), e('CUDA_VISIBLE_DEVICES'), e('CUDA_DEVICE_ORDER'))",
]


@pytest.fixture
def url(redis_proc1):
    return redis_proc1.url


def run_show(
    url: str, pool: str, amount: str, visible: str | None = None
) -> subprocess.CompletedProcess:
    """``gpulock run`` of a command that prints its GPULOCK_DEVICE and CUDA_VISIBLE_DEVICES,
    with ``visible`` as gpulock run's own CUDA_VISIBLE_DEVICES (None: unset)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("CUDA_DEVICE_ORDER", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    env["GPULOCK_REDIS_URL"] = url
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "gpulock",
            "run",
            "--pool",
            pool,
            "--amount",
            amount,
            "--",
            *SHOW_ENV,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_pool_set_devices_status_and_placement(url):
    r = gpulock(url, "pool", "set", "node", "--devices", "4", "--capacity", "8GiB")
    assert r.returncode == 0, r.stderr
    assert "capacity 32.0GiB" in r.stdout and "devices 4 x 8.0GiB (placement bestfit)" in r.stdout
    st = _status(url, "node")
    assert [(d["index"], d["capacity"], d["used"]) for d in st["devices"]] == [
        (i, 8 * GiB, 0) for i in range(4)
    ]
    # --capacity alone on a pool of several devices: each device's
    r = gpulock(url, "pool", "set", "node", "--capacity", "4GiB", "--placement", "spread", "--json")
    assert r.returncode == 0 and "no effect" not in r.stderr, r.stderr
    one = gpulock(url, "pool", "set", "one", "-c", "1GiB", "--placement", "spread")
    assert one.returncode == 0 and "no effect on a pool of one device" in one.stderr, one.stderr
    out = json.loads(r.stdout)
    assert (out["capacity"], out["devices"], out["placement"]) == (
        16 * GiB,
        [4 * GiB] * 4,
        "spread",
    )
    r = gpulock(url, "pool", "set", "node", "--devices", "4GiB,2GiB", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["devices"] == [4 * GiB, 2 * GiB]
    pool = Pool.from_url(url, "node")
    try:
        with pool.lease(GiB, device=1):
            r = gpulock(url, "status", "node")
            assert r.returncode == 0, r.stderr
            assert "devices (spread): 0 0B of 4.0GiB, 1 1.0GiB of 2.0GiB" in r.stdout, r.stdout
            assert "device" in r.stdout.split("devices (spread)")[1]  # the leases' column
            r = gpulock(url, "top", "node", "--once")
            assert r.returncode == 0, r.stderr
            assert "devices (spread): 0 0B/4.0GiB  1 1.0GiB/2.0GiB" in r.stdout, r.stdout
            assert "device" in r.stdout.split("leases (1)")[1], r.stdout  # the column
    finally:
        pool.close()


def test_run_puts_its_command_on_the_leased_device(url):
    assert gpulock(url, "pool", "set", "node", "--devices", "3", "-c", "4GiB").returncode == 0
    r = run_show(url, "node/2", "1GiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2", "2", "PCI_BUS_ID"]
    # placed: best fit takes the fullest device that fits, so device 0 with 3 GiB held
    pool = Pool.from_url(url, "node")
    try:
        with pool.lease(3 * GiB, device=1):
            r = run_show(url, "node", "1GiB")
            assert r.stdout.split() == ["1", "1", "PCI_BUS_ID"], r.stderr
            # gpulock run's own CUDA_VISIBLE_DEVICES maps device D to its D-th GPU
            r = run_show(url, "node", "1GiB", visible="5,6,7")
            assert r.stdout.split() == ["1", "6", "PCI_BUS_ID"], r.stderr
    finally:
        pool.close()


def test_run_on_a_pool_of_one_device_leaves_cuda_visible_devices_alone(url):
    assert gpulock(url, "pool", "set", "one", "-c", "4GiB").returncode == 0
    r = run_show(url, "one", "1GiB", visible="3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "3", "None"]
    r = run_show(url, "one/0", "1GiB")
    assert r.stdout.split() == ["0", "None", "None"], r.stderr


@pytest.mark.parametrize(
    "args, msg",
    [
        (("pool", "set", "p", "--devices", "2"), "needs --capacity"),
        (("pool", "set", "p", "--devices", "0", "-c", "1GiB"), "devices must be 1 to 64"),
        (("pool", "set", "p", "--devices", "1GiB,lots"), "capacity of device 1"),
        (("pool", "set", "p", "--devices", "1GiB,1GiB", "-c", "2GiB"), "leave --capacity out"),
        (("pool", "set", "p", "-c", "1GiB", "--placement", "random"), "bestfit or spread"),
        (("run", "--pool", "p/x", "--amount", "1", "--", "true"), "the device must be an index"),
        (("run", "--pool", "p/64", "--amount", "1", "--", "true"), "the device must be an index"),
    ],
)
def test_bad_device_values_exit_2_naming_them(url, args, msg):
    r = gpulock(url, *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert msg in r.stderr, r.stderr
    assert gpulock(url, "status", "p").returncode == 66  # nothing was made


def test_run_pinned_to_a_device_the_pool_lacks_exits_2(url):
    assert gpulock(url, "pool", "set", "node", "--devices", "2", "-c", "1GiB").returncode == 0
    r = gpulock(url, "run", "--pool", "node/5", "--amount", "1", "--", "true")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "device 5 is not a device of the pool" in r.stderr, r.stderr


def test_pool_set_devices_auto_makes_a_device_of_each_gpu_the_reader_sees(url, tmp_path):
    """``--devices auto`` on CPU, with an injected device list (the fake reader): one device
    per GPU, each its memory x --utilization; no GPU to read is exit 2 with nothing made."""
    from gpulock.devices import write_fake_devices

    fake = tmp_path / "gpus.json"
    write_fake_devices(
        fake,
        [
            {"index": 0, "total": 80 * GiB, "used": 0},
            {"index": 1, "total": 80 * GiB, "used": GiB},
            {"index": 2, "total": 40 * GiB, "used": 0},
        ],
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    env.update(GPULOCK_REDIS_URL=url, GPULOCK_FAKE_DEVICES=str(fake))
    argv = [sys.executable, "-m", "gpulock", "pool", "set", "node", "--devices", "auto"]
    r = subprocess.run(
        [*argv, "--utilization", "0.5", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["devices"] == [40 * GiB, 40 * GiB, 20 * GiB]
    env["GPULOCK_FAKE_DEVICES"] = str(tmp_path / "none.json")
    r = subprocess.run(
        [*argv[:5], "other", *argv[6:]], env=env, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 2 and "auto: cannot read the GPUs" in r.stderr, r.stderr
    assert gpulock(url, "status", "other").returncode == 66


@pytest.mark.parametrize(
    "entries, shown",
    [
        # device 1 unreadable (used > total): not a pool of device 0 alone
        ([(0, 80, 0), (1, 8, 9), (2, 80, 0)], "device 1: 'used'"),
        ([(0, 80, 0), (2, 80, 0)], "has no device 1"),  # a gap in the indices
        ([(0, 80, 0), (1, 0, 0)], "device 1 reports 0 bytes"),
    ],
)
def test_pool_set_devices_auto_refuses_a_gpu_it_cannot_read(url, tmp_path, entries, shown):
    """--devices auto makes a pool of every GPU the reader counts, or of none: a GPU it cannot
    read (or one with no memory) is exit 2 naming it, with nothing made, rather than a pool
    that silently leaves it (and every GPU after it) out."""
    from gpulock.devices import write_fake_devices

    fake = tmp_path / "gpus.json"
    write_fake_devices(
        fake, [{"index": i, "total": t * GiB, "used": u * GiB} for i, t, u in entries]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    env.update(GPULOCK_REDIS_URL=url, GPULOCK_FAKE_DEVICES=str(fake))
    r = subprocess.run(
        [sys.executable, "-m", "gpulock", "pool", "set", "node", "--devices", "auto"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and shown in r.stderr, (r.returncode, r.stderr)
    assert gpulock(url, "status", "node").returncode == 66


@pytest.mark.parametrize("argv", [["--devices", "\u00b2", "-c", "1GiB"], ["--devices", "2\u00b2"]])
def test_pool_set_non_ascii_digits_are_exit_2(url, argv):
    """A character that str.isdigit() passes but int() refuses ("²") is a bad value (exit 2
    naming it), never a traceback."""
    r = gpulock(url, "pool", "set", "node", *argv)
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert gpulock(url, "status", "node").returncode == 66
    r = gpulock(url, "run", "--pool", "node/\u00b2", "--amount", "1GiB", "--", "true")
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr)


@pytest.mark.parametrize("devices", [None, "2", "1GiB,1GiB"])
def test_pool_set_utilization_without_devices_auto_is_refused(url, devices):
    """--utilization scales only what --devices auto reads: given with anything else it would
    change nothing, so it is exit 2 naming it, with nothing made or changed."""
    dev = [] if devices is None else ["--devices", devices]
    r = gpulock(url, "pool", "set", "node", "-c", "1GiB", *dev, "--utilization", "0.5")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "--utilization" in r.stderr and "only with --devices auto" in r.stderr, r.stderr
    assert gpulock(url, "status", "node").returncode == 66  # nothing made


@pytest.mark.parametrize(
    "visible, target",
    [("4,5", "node/3"), ("4,5", "node"), ("", "node/0"), ("-1", "node/0"), ("4,-1,5", "node/1")],
)
def test_run_refuses_a_device_its_cuda_visible_devices_hides(url, visible, target):
    """gpulock run's own CUDA_VISIBLE_DEVICES maps device D to its D-th GPU: a lease that may
    land past its end (a pinned device it does not show, or any device of a pool of more
    than it shows) is exit 2 before anything is acquired."""
    assert gpulock(url, "pool", "set", "node", "--devices", "4", "-c", "1GiB").returncode == 0
    r = run_show(url, target, "1GiB", visible=visible)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "CUDA_VISIBLE_DEVICES" in r.stderr and "GPU(s)" in r.stderr, r.stderr
    assert _status(url, "node")["grants"] == 0


def test_run_through_a_broker_errors_name_the_device(url):
    """(a unit check of the broker error mapping: the SDK's message, naming the device, is
    kept)"""
    import gpulock_client

    from gpulock.cli.broker import core_error

    e = core_error(gpulock_client.CapacityExceeded(5, 4, "exceeds the capacity of device 1"))
    assert "device 1" in str(e) and (e.amount, e.capacity) == (5, 4)
