"""Device truth without I/O: the fake device file, external use, the smoothing's rise/fall
rules, over-use detection and its timer (gpulock.devices, gpulock.devices.truth)."""

from __future__ import annotations

import json

import pytest

from gpulock import LeaseInfo
from gpulock.devices.truth import (
    OveruseTimer,
    Smoother,
    exceeds,
    external_use,
    find_overuse,
    fold_into_holders,
)
from gpulock.devices import (
    DeviceError,
    DeviceReading,
    FakeReader,
    NvmlReader,
    open_reader,
    write_fake_devices,
)

MiB = 1 << 20


def lease(lid: str, amount: int, host: str = "h1", pid: int | None = 10) -> LeaseInfo:
    holder = {"host": host} if pid is None else {"host": host, "pid": pid}
    return LeaseInfo(lid, amount, 1, 30.0, 0.0, 30.0, "t-" + lid, holder)


def test_fake_reader_reads_and_follows_rewrites(tmp_path):
    f = tmp_path / "dev.json"
    write_fake_devices(f, [{"index": 0, "total": 100, "used": 40, "processes": {"7": 40}}])
    r = FakeReader(f)
    assert r.read(0) == DeviceReading(0, 100, 40, {7: 40})
    write_fake_devices(
        f, [{"index": 0, "total": 100, "used": 5}, {"index": 1, "total": 9, "used": 1}]
    )
    assert r.read(0) == DeviceReading(0, 100, 5, None)
    assert r.read(1).total_bytes == 9
    with pytest.raises(DeviceError, match="no device 2"):
        r.read(2)


@pytest.mark.parametrize(
    "doc, match",
    [
        ("not json", "unreadable"),
        ({"devices": 3}, "no 'devices' list"),
        ({"devices": [{"index": 0, "total": -1, "used": 0}]}, "'total' must be a non-negative"),
        ({"devices": [{"index": 0, "total": 1, "used": 0, "processes": {"x": 1}}]}, "pid 'x'"),
        ({"devices": [{"index": 0, "total": 1, "used": 0, "processes": [1]}]}, "map pid"),
        ({"devices": [{"total": 1, "used": 0}]}, "entry 0 needs an integer 'index'"),
        ({"devices": [{"index": "0", "total": 1, "used": 0}]}, "needs an integer 'index'"),
        ({"devices": [{"index": 0, "total": 1, "used": 5}]}, "'used' 5 is more than"),
        ({"devices": [{"index": 0, "total": 9, "used": 0, "processes": {"-1": 1}}]}, "not a pid"),
    ],
)
def test_fake_reader_names_bad_files(tmp_path, doc, match):
    f = tmp_path / "dev.json"
    f.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(DeviceError, match=match):
        FakeReader(f).read(0)
    with pytest.raises(DeviceError, match="unreadable"):
        FakeReader(tmp_path / "missing.json").read(0)


def test_open_reader_specs(tmp_path, monkeypatch):
    assert isinstance(open_reader(f"fake:{tmp_path}/d.json"), FakeReader)
    assert isinstance(open_reader("nvml"), NvmlReader)
    with pytest.raises(ValueError, match="'cuda'"):
        open_reader("cuda")
    with pytest.raises(ValueError, match="needs a file path"):
        open_reader("fake:")
    monkeypatch.setenv("GPULOCK_FAKE_DEVICES", str(tmp_path / "e.json"))
    r = open_reader("auto")
    assert isinstance(r, FakeReader) and r.path.name == "e.json"


def test_nvml_reader_without_nvml_says_how_to_install():
    try:
        import pynvml  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        with pytest.raises(DeviceError, match=r"gpulock\[gpu\]"):
            NvmlReader().read(0)
    else:
        pytest.skip("nvidia-ml-py is installed here")


def test_external_use_per_process():
    leases = [
        lease("a", 100, pid=10),
        lease("b", 50, pid=10),
        lease("c", 30, pid=11),
        lease("d", 999, host="h2", pid=12),
    ]
    # pid 10 holds 150 and uses 120 (under: 0), pid 11 holds 30 and uses 50 (20 over),
    # pid 12's lease is on another host (its 70 count), pid 13 holds nothing (40 count)
    r = DeviceReading(0, 1000, 280, {10: 120, 11: 50, 12: 70, 13: 40})
    assert external_use(r, leases, "h1") == 20 + 70 + 40
    # a holder whose metadata lacks a pid is no holder of any process
    assert external_use(DeviceReading(0, 1000, 5, {10: 5}), [lease("x", 9, pid=None)], "h1") == 5


def test_fold_into_holders_charges_descendants_to_the_nearest_holder():
    tree = {21: [20, 10, 1], 22: [21, 20, 10, 1], 30: [1], 20: [10, 1]}
    # 10 and 20 hold leases; 21 and 22 descend from 20 (nearest holder), 30 from none
    got = fold_into_holders(
        {10: 5, 20: 1, 21: 2, 22: 3, 30: 7, 99: 4}, {10, 20}, lambda p: tree.get(p, [])
    )
    assert got == {10: 5, 20: 6, 30: 7, 99: 4}
    assert fold_into_holders({}, {10}, lambda p: tree.get(p, [])) == {}


def test_external_use_per_process_is_never_below_used_minus_leased():
    # the reader lists no process (another container's memory), yet the device is 600 used
    leases = [lease("a", 100, pid=10)]
    assert external_use(DeviceReading(0, 1000, 600, {}), leases, "h1") == 500
    assert external_use(DeviceReading(0, 1000, 600, {10: 100}), leases, "h1") == 500


def test_external_use_without_per_process():
    leases = [lease("a", 100, pid=10), lease("b", 50, pid=11), lease("d", 999, host="h2")]
    assert external_use(DeviceReading(0, 1000, 400, None), leases, "h1") == 250
    assert external_use(DeviceReading(0, 1000, 100, None), leases, "h1") == 0


def test_smoother_rises_at_once_falls_after_it_lasts():
    s = Smoother(threshold=10, fall_samples=3, fall_seconds=2.0)
    assert s.update(100, 0.0) == 100  # a rise: at once
    assert s.update(105, 0.5) == 100  # under the threshold: ignored
    assert s.update(40, 1.0) == 100  # a fall starts
    assert s.update(50, 2.0) == 100
    assert s.update(45, 2.5) == 100  # three samples, but only 1.5 s
    assert s.update(42, 3.0) == 50  # 4 samples, 2 s: the highest value of the fall
    assert s.update(200, 3.1) == 200
    assert s.update(20, 3.2) == 200
    assert s.update(195, 3.3) == 200  # back within the threshold: the fall is off
    assert s.update(20, 3.4) == 200
    assert s.update(20, 4.0) == 200
    assert s.update(20, 5.0) == 200  # a new fall: 3 samples but 1.6 s
    assert s.update(20, 5.4) == 20
    assert s.update(0, 5.5) == 20
    assert s.update(0, 6.0) == 20
    assert s.update(0, 8.0) == 0  # a fall to zero is published even if under the threshold
    with pytest.raises(ValueError, match="-1"):
        s.update(-1, 9.0)


def test_exceeds_rule():
    assert not exceeds(110, 100, 0.10, 0)
    assert exceeds(111, 100, 0.10, 0)
    assert not exceeds(110 + 5, 100, 0.10, 5)
    assert exceeds(1, 0, 0.0, 0)


def test_find_overuse_names_holder_lease_and_excess():
    leases = [lease("a", 100 * MiB, pid=10), lease("b", 100 * MiB, pid=11)]
    r = DeviceReading(0, 1 << 40, 0, {10: 300 * MiB, 11: 150 * MiB, 12: 999 * MiB})
    over = find_overuse(r, leases, "h1", margin=0.10, slack=64 * MiB)
    assert [(o.pid, o.lease_ids, o.leased, o.actual, o.excess) for o in over] == [
        (10, ("a",), 100 * MiB, 300 * MiB, 200 * MiB)
    ]
    assert over[0].holder == {"host": "h1", "pid": 10}
    assert find_overuse(DeviceReading(0, 1, 1, None), leases, "h1") == []


def test_overuse_timer():
    t = OveruseTimer(hold=2.0)
    assert t.held([1, 2], 0.0) == {}
    assert t.held([1], 1.0) == {}  # 2 broke off
    assert t.held([1, 2], 2.0) == {1: 2.0}
    assert t.held([2], 4.0) == {2: 2.0}
    with pytest.raises(ValueError):
        OveruseTimer(-1)


def test_parse_fraction():
    from gpulock import InvalidArgument
    from gpulock.units import parse_fraction

    assert parse_fraction("10%", name="m") == pytest.approx(0.10)
    assert parse_fraction("0.25", name="m") == 0.25 and parse_fraction(0, name="m") == 0.0
    assert (
        parse_fraction("150%", name="m") == pytest.approx(1.5) and parse_fraction(1, name="m") == 1
    )
    for bad in ("-3%", "ten", "", True, "2000%", float("nan"), "10", 10, "1.5"):
        with pytest.raises(InvalidArgument, match="m must be"):
            parse_fraction(bad, name="m")
    with pytest.raises(InvalidArgument, match="did you mean 10%"):
        parse_fraction("10", name="m")


def test_enforcer_counts_the_tree_and_says_when_it_cannot_enforce(tmp_path):
    import os

    from gpulock.devices.enforce import Enforcer

    f = tmp_path / "dev.json"
    notes: list[str] = []
    t = [0.0]
    e = Enforcer(
        FakeReader(f),
        0,
        os.getpid(),
        100,
        margin=0.10,
        slack=0,
        hold=1.0,
        on_over=lambda b: None,
        on_note=notes.append,
        clock=lambda: t[0],
    )
    assert e.check() is None and "cannot read device 0" in notes[0]
    write_fake_devices(f, [{"index": 0, "total": 1000, "used": 500}])
    assert e.check() is None and e.check() is None
    assert len(notes) == 2 and "no per-process use" in notes[1]  # each said once
    # this process and a pid outside its tree: only the tree counts
    write_fake_devices(
        f,
        [
            {
                "index": 0,
                "total": 1000,
                "used": 500,
                "processes": {str(os.getpid()): 111, "4000000": 900},
            }
        ],
    )
    assert e.check() is None  # over, not yet for the hold
    t[0] = 1.0
    b = e.check()
    assert b is not None and (b.actual, b.leased, b.over_for, b.pids) == (
        111,
        100,
        1.0,
        (os.getpid(),),
    )
    write_fake_devices(
        f, [{"index": 0, "total": 1000, "used": 500, "processes": {str(os.getpid()): 110}}]
    )
    t[0] = 2.0
    assert e.check() is None  # within the margin: the timer starts again
