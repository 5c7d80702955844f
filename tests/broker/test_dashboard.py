"""The broker's ``/dashboard`` (issue 15): the page and its data need an admin token for the
data only, name no token identity, and, in headless Chromium under a running load, show the
numbers ``gpulock status --json`` reports, live."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

from gpulock import Pool
from gpulock.errors import GpuLockError
from gpulock_broker.auth import parse_tokens
from gpulock_client import Pool as SdkPool
from support.browser import Browser, dom_view, pool_dom, status_view
from support.drain import measure_drain, queue_behind
from support.pools import GiB
from support.waiting import wait_until

from ._support import ADMIN_TOKEN, TOKENS, USER_TOKEN, client

pytestmark = pytest.mark.timeout(180)


def status_json(redis_url: str, pool: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "gpulock", "--redis-url", redis_url, "status", pool, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_page_is_public_its_data_needs_an_admin_token(broker_srv, gpu):
    with client(broker_srv.url, None) as anon:
        page = anon.get("/dashboard")
        assert page.status_code == 200
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert 'src="dashboard/dashboard.js"' in page.text
        js = anon.get("/dashboard/dashboard.js")
        assert js.status_code == 200 and "fetch(" in js.text
        assert js.headers["content-type"].startswith("text/javascript")
        assert anon.get("/dashboard/dashboard.css").status_code == 200
        r = anon.get("/dashboard/data")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    with client(broker_srv.url, USER_TOKEN) as user:
        r = user.get("/dashboard/data")
        assert r.status_code == 403, r.text
    with client(broker_srv.url, ADMIN_TOKEN) as admin:
        r = admin.get("/dashboard/data")
        assert r.status_code == 200, r.text
        assert [p["pool"] for p in r.json()["pools"]] == ["gpu-a"]


def test_the_data_names_no_token_identity_and_counts_503s(broker_srv, gpu, user, admin):
    r = user.post(
        "/v1/pools/gpu-a/leases",
        json={"amount": "8GiB", "ttl": 60, "holder": {"job": "train-1"}, "request_id": "rq-1"},
    )
    assert r.status_code == 201, r.text
    busy = user.post(
        "/v1/pools/gpu-a/leases", json={"amount": "4GiB", "queue": False, "request_id": "rq-2"}
    )
    assert busy.status_code == 503, busy.text

    def view():
        d = admin.get("/dashboard/data").json()["pools"][0]
        return d if d["rejected"] == 1 else None

    d = wait_until(view, 10, "the 503 counted in the view")
    (lease,) = d["leases"]
    assert lease["amount"] == 8 * GiB and lease["holder"]["job"] == "train-1"
    assert lease["holder"]["principal"] == "user" and "owner" not in lease["holder"]
    text = admin.get("/dashboard/data").text
    for p in parse_tokens(TOKENS, "test"):
        assert p.id not in text  # the token identities the leases carry in Redis
    assert USER_TOKEN not in text and "rq-1" not in text and "rq-2" not in text


def test_the_page_shows_what_gpulock_status_reports_live(
    broker_srv, redis_srv, gpu, user, tmp_path
):
    leases = []
    for amount, job in (("3GiB", "train-1"), ("4GiB", "train-2")):
        r = user.post(
            "/v1/pools/gpu-a/leases", json={"amount": amount, "ttl": 60, "holder": {"job": job}}
        )
        assert r.status_code == 201, r.text
        leases.append(r.json())
    # a waiter that cannot fit (3 GiB free), queued through the core, until the 4 GiB go
    waiter_pool = Pool.from_url(redis_srv.url, "gpu-a")
    got: list = []

    def wait_for_5() -> None:
        try:
            got.append(waiter_pool.acquire("5GiB", timeout=120, holder={"job": "eval"}))
        except GpuLockError as e:
            got.append(e)

    th = threading.Thread(target=wait_for_5, daemon=True)
    th.start()
    try:
        wait_until(
            lambda: status_json(redis_srv.url, "gpu-a")["waiter_count"] == 1, 30, "the waiter"
        )
        with Browser(tmp_path) as b:
            page = b.new_page(f"{broker_srv.url}/dashboard#token={ADMIN_TOKEN}")
            st = status_view(status_json(redis_srv.url, "gpu-a"))
            assert st["lease_count"] == 2 and st["waiter_count"] == 1
            d = wait_until(
                lambda: (x := pool_dom(page, "gpu-a")) and dom_view(x) == st and x,
                30,
                f"the page to show {st}",
                interval=0.1,
            )
            assert d["state"] == "ok"
            assert ADMIN_TOKEN not in page.evaluate("location.href")  # taken off the address bar
            assert "3.00 GiB" in d["text"] and "job=train-1" in d["text"]
            for p in parse_tokens(TOKENS, "test"):
                assert p.id not in d["text"]
            # a 503 shows up; the chart fills from the pool's samples
            busy = user.post("/v1/pools/gpu-a/leases", json={"amount": "4GiB", "queue": False})
            assert busy.status_code == 503
            wait_until(
                lambda: (
                    (x := pool_dom(page, "gpu-a"))
                    and x["stats"]["rejected"] == 1
                    and x["points"].get("used", 0) >= 2
                ),
                30,
                "one 503 and two samples on the page",
                interval=0.1,
            )
            # live: the 4 GiB go, the waiter is granted, the page follows
            r = user.delete(f"/v1/pools/gpu-a/leases/{leases[1]['lease_id']}")
            assert r.status_code == 200, r.text
            wait_until(lambda: got, 30, "the waiter's grant")
            st2 = status_view(status_json(redis_srv.url, "gpu-a"))
            assert st2["waiter_count"] == 0 and st2["used"] == 8 * GiB
            wait_until(
                lambda: (x := pool_dom(page, "gpu-a")) and dom_view(x) == st2,
                30,
                f"the page to show {st2}",
                interval=0.1,
            )
            # a reload draws the same history again: it is Redis's, not the page's
            seen = pool_dom(page, "gpu-a")
            before, updates = seen["points"]["used"], seen["updates"]
            page.call("Page.reload", ignoreCache=True)
            wait_until(
                lambda: (
                    (x := pool_dom(page, "gpu-a"))
                    and x["updates"] < updates  # the new page's first renders
                    and x["points"].get("used", 0) >= before
                ),
                30,
                "the history after a reload",
                interval=0.1,
            )
            shot = tmp_path / "dashboard.png"
            page.screenshot(shot)
            assert shot.stat().st_size > 10_000
            if os.environ.get("GPULOCK_DASHBOARD_SCREENSHOT"):
                shutil.copy(shot, os.environ["GPULOCK_DASHBOARD_SCREENSHOT"])
    finally:
        waiter_pool.close()
        th.join(10)


def _top_via_broker(url: str, token: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("GPULOCK_TOKEN", "GPULOCK_BROKER_URL")}
    env["COLUMNS"] = "200"
    if token:
        env["GPULOCK_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "gpulock", "--broker-url", url, "top", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_top_goes_through_the_brokers_dashboard_with_an_admin_token(broker_srv, gpu, user):
    r = user.post("/v1/pools/gpu-a/leases", json={"amount": "2GiB", "holder": {"job": "t"}})
    assert r.status_code == 201, r.text
    token = r.json()["token"]
    out = _top_via_broker(broker_srv.url, ADMIN_TOKEN, "gpu-a", "--once")
    assert out.returncode == 0, out.stderr
    assert "gpu-a" in out.stdout and str(token) in out.stdout and "job=t" in out.stdout
    refused = _top_via_broker(broker_srv.url, USER_TOKEN, "--once")
    assert refused.returncode != 0 and "admin" in refused.stderr


def test_the_data_is_a_503_while_redis_is_down(broker_srv, redis_srv, gpu, admin):
    assert admin.get("/dashboard/data").status_code == 200
    redis_srv.kill()
    r = admin.get("/dashboard/data")
    assert r.status_code == 503, r.text
    assert r.json()["detail"]["error"] == "backend_unavailable"
    assert r.headers["retry-after"] == "1"


def test_the_page_shows_the_device_report(broker_srv, redis_srv, gpu, user, admin, tmp_path):
    """The device sampler's report (published here as a sampler would, ``external.lua``): the
    page shows the bytes in use outside the pool's leases and the over-user (its holder and
    bytes; no lease id and no token identity, as everywhere on the page)."""
    import asyncio

    from gpulock import AsyncPool

    r = user.post("/v1/pools/gpu-a/leases", json={"amount": "1GiB", "holder": {"job": "greedy"}})
    assert r.status_code == 201, r.text
    lid = r.json()["lease_id"]
    over = [
        {
            "pid": 4242,
            "holder": {"host": "h1", "pid": 4242, "job": "greedy", "owner": "hidden"},
            "lease_ids": [lid],
            "leased": GiB,
            "actual": 3 * GiB,
            "excess": 2 * GiB,
            "over_for": 5.0,
        }
    ]

    async def report() -> None:
        p = AsyncPool.from_url(redis_srv.url, "gpu-a")
        try:
            await p.device_report("dash-test", 60_000, 2 * GiB, 60_000, json.dumps(over))
        finally:
            await p.aclose()

    asyncio.run(report())
    assert status_json(redis_srv.url, "gpu-a")["external"] == 2 * GiB
    with Browser(tmp_path) as b:
        page = b.new_page(f"{broker_srv.url}/dashboard#token={ADMIN_TOKEN}")
        d = wait_until(
            lambda: (x := pool_dom(page, "gpu-a")) and x["stats"].get("external") == 2 * GiB and x,
            30,
            "the external use on the page",
            interval=0.1,
        )
        assert d["stats"]["free"] == 7 * GiB  # 10 GiB - 2 GiB outside - 1 GiB leased
        assert (
            "over its lease: host=h1 pid=4242 job=greedy uses 3.00 GiB for 1.00 GiB leased"
            in d["text"]
        )
        assert "2.00 GiB over" in d["text"]
        assert "hidden" not in d["text"] and lid not in d["text"]  # no owner, no lease id
    data = admin.get("/dashboard/data").text
    assert lid not in data and "hidden" not in data


# The waiters table's "est. wait" column and the pool's drain rate, as the page shows them:
# {drain: the stat's data-value or null, rows: [[est. wait text, data-value or null], ...]}.
_WAIT_DOM_JS = """
(function (name) {
  var sec = document.querySelector('section.pool[data-pool="' + name + '"]');
  if (!sec) return null;
  var drain = sec.querySelector('.stats [data-field="drain"]');
  var heads = Array.prototype.map.call(sec.querySelectorAll('table.waiters thead th'),
    function (th) { return th.textContent; });
  var i = heads.indexOf('est. wait');
  var rows = Array.prototype.map.call(sec.querySelectorAll('table.waiters tbody tr'),
    function (tr) {
      var td = tr.querySelectorAll('td')[i];
      return td ? [td.textContent, td.getAttribute('data-value')] : null;
    });
  return {drain: drain ? drain.getAttribute('data-value') : null, column: i, rows: rows,
          drainText: drain ? drain.textContent : null};
})(%s)
"""


def test_the_page_shows_each_waiters_estimated_wait(broker_srv, redis_srv, gpu, tmp_path):
    core = Pool.from_url(redis_srv.url, gpu)
    threads: list[threading.Thread] = []
    holder = core.acquire(10 * GiB)
    try:
        with Browser(tmp_path) as b:
            threads = queue_behind(core, GiB, 2)
            page = b.new_page(f"{broker_srv.url}/dashboard#token={ADMIN_TOKEN}")
            # not measured yet: the column is there, each estimate a dash, no drain rate
            seen = wait_until(
                lambda: (
                    (x := page.evaluate(_WAIT_DOM_JS % json.dumps(gpu)))
                    and len(x["rows"]) == 2
                    and x
                ),
                30,
                "the two waiters on the page",
                interval=0.1,
            )
            assert seen["column"] >= 0 and seen["drain"] is None, seen
            assert [r[0] for r in seen["rows"]] == ["–", "–"] and seen["drainText"] == "–"
            holder.release()
            for t in threads:
                t.join(120)
            drain = measure_drain(core, 10 * GiB)
            holder = core.acquire(10 * GiB)
            threads = queue_behind(core, GiB, 2)
            st = status_json(redis_srv.url, gpu)
            want = [w["estimated_wait_s"] for w in st["waiters"]]
            assert st["drain"]["bytes_per_s"] == drain.bytes_per_s and None not in want

            def shown() -> dict | None:
                x = page.evaluate(_WAIT_DOM_JS % json.dumps(gpu))
                if not x or len(x["rows"]) != 2 or None in (r[1] for r in x["rows"]):
                    return None
                return x

            seen = wait_until(shown, 30, "the estimates on the page", interval=0.1)
            assert [float(r[1]) for r in seen["rows"]] == pytest.approx(want)
            assert all(r[0].startswith("~") and r[0].endswith(" s") for r in seen["rows"]), seen
            assert float(seen["drain"]) == drain.bytes_per_s
            assert "grants" in seen["drainText"], seen
    finally:
        holder.release()
        for t in threads:
            t.join(120)
        core.close()


_YIELD_DOM_JS = """
(function (name) {
  var sec = document.querySelector('section.pool[data-pool="' + name + '"]');
  if (!sec) return null;
  var p = sec.querySelector('p.preemption');
  var rows = Array.prototype.map.call(sec.querySelectorAll('table.leases tbody tr.yielding'),
    function (tr) { return {token: tr.getAttribute('data-token'),
                            yieldIn: tr.getAttribute('data-yield-in'), text: tr.textContent}; });
  return {preemption: p ? p.getAttribute('data-preemption') : null,
          asked: p ? p.getAttribute('data-asked') : null, text: p ? p.textContent : null,
          rows: rows};
})(%s)
"""


def test_the_page_shows_preemption_and_marks_a_lease_asked_to_yield(
    broker_srv, redis_srv, gpu, admin, tmp_path
):
    """Preemption turned on through the broker (its PUT body); a holder of the whole pool at
    priority -10 and a request at 10 queued behind it, which asks it to yield: the broker's
    pool answer and the page show the setting and the counters, and mark the lease with its
    deadline."""
    r = admin.put(
        "/v1/pools/gpu-a",
        json={"capacity": "10GiB", "preemption": {"gap": 5, "yield_grace_s": 600}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["preemption"] == {"gap": 5, "yield_grace_s": 600.0}
    core = Pool.from_url(redis_srv.url, gpu)
    holder = core.acquire(10 * GiB, priority=-10)
    got: list = []

    def wait() -> None:
        try:
            got.append(core.acquire(GiB, priority=10, timeout=120))
        except GpuLockError as e:
            got.append(e)

    th = threading.Thread(target=wait, daemon=True)
    th.start()
    try:
        out = wait_until(
            lambda: (d := admin.get(f"/v1/pools/{gpu}").json())["yields"]["asked"] == 1 and d,
            60,
            "the holder asked to yield",
        )
        assert out["preemption"] == {"gap": 5, "yield_grace_s": 600.0}
        (li,) = out["leases"]
        assert li["priority"] == -10 and 0 < li["yield_in"] <= 600
        with Browser(tmp_path) as b:
            page = b.new_page(f"{broker_srv.url}/dashboard#token={ADMIN_TOKEN}")
            seen = wait_until(
                lambda: (x := page.evaluate(_YIELD_DOM_JS % json.dumps(gpu))) and x["rows"] and x,
                30,
                "the asked lease marked on the page",
                interval=0.1,
            )
            assert seen["preemption"] == "on" and seen["asked"] == "1", seen
            assert "5 or more priority levels" in seen["text"], seen
            (row,) = seen["rows"]
            assert row["token"] == str(holder.token) and 0 < float(row["yieldIn"]) <= 600
            assert "asked to yield: taken back in" in row["text"], row
        r = admin.put("/v1/pools/gpu-a", json={"capacity": "10GiB", "preemption": False})
        assert r.status_code == 200 and r.json()["preemption"] is None, r.text
    finally:
        holder.release()
        th.join(120)
        for x in got:
            if not isinstance(x, Exception):
                x.release()
        core.close()


_KEPT_DOM_JS = """
(function (name) {
  var sec = document.querySelector('section.pool[data-pool="' + name + '"]');
  if (!sec) return null;
  var p = sec.querySelector('p.kept');
  var stat = sec.querySelector('.stats [data-field="kept_bytes"]');
  var rows = Array.prototype.map.call(sec.querySelectorAll('table.leases tbody tr'),
    function (tr) { return {token: tr.getAttribute('data-token'), kept: tr.getAttribute('data-kept'),
                            cls: tr.getAttribute('class'), text: tr.textContent}; });
  var heads = Array.prototype.map.call(sec.querySelectorAll('table.leases thead th'),
    function (th) { return th.textContent; });
  return {keptLeases: p ? p.getAttribute('data-kept-leases') : null,
          keptBytes: p ? p.getAttribute('data-kept-bytes') : null,
          releasesKept: p ? p.getAttribute('data-releases-kept') : null,
          text: p ? p.textContent : null, stat: stat ? stat.getAttribute('data-value') : null,
          rows: rows, heads: heads};
})(%s)
"""


def _gpulock_via(broker_url: str, *args: str) -> subprocess.CompletedProcess:
    """``gpulock --broker-url BROKER ARGS`` with the admin token, on a 200-column terminal."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    env.update(GPULOCK_TOKEN=ADMIN_TOKEN, COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "gpulock", "--broker-url", broker_url, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_broker_and_the_page_show_kept_bytes_and_mark_a_kept_lease(
    broker_srv, redis_srv, gpu, user, admin, tmp_path
):
    """A lease held through the broker (which keeps nothing): the broker's pool answer, the
    CLI through it and the page show nothing kept. Then a pool object with ``keep=3600`` on the
    same Redis acquires 4 GiB and releases it with nobody waiting, so it keeps it: the broker's
    answers (pool and list, the SDK's ``status()``), ``gpulock --broker-url status`` and the
    page show the kept bytes and mark that lease kept, the broker's lease not."""
    r = user.post("/v1/pools/gpu-a/leases", json={"amount": "2GiB", "holder": {"job": "plain"}})
    assert r.status_code == 201, r.text
    plain = r.json()
    out = admin.get(f"/v1/pools/{gpu}").json()
    assert (out["kept_bytes"], out["kept_leases"], out["releases_kept"]) == (0, 0, 0)
    assert [li["kept"] for li in out["leases"]] == [False]
    # keeps an idle lease far longer than a loaded machine takes to read what shows it
    keeper = Pool.from_url(redis_srv.url, gpu, keep=3600)
    try:
        with Browser(tmp_path) as b:
            page = b.new_page(f"{broker_srv.url}/dashboard#token={ADMIN_TOKEN}")
            seen = wait_until(
                lambda: (x := page.evaluate(_KEPT_DOM_JS % json.dumps(gpu))) and x["rows"] and x,
                30,
                "the broker's lease on the page",
                interval=0.1,
            )
            assert seen["keptLeases"] is None and seen["stat"] is None, seen  # nothing kept
            assert "kept" not in seen["heads"] and [r["kept"] for r in seen["rows"]] == [None]

            lease = keeper.acquire(4 * GiB, holder={"job": "keeper"})
            lease.release()  # nobody waits: kept
            out = admin.get(f"/v1/pools/{gpu}").json()
            assert (out["kept_bytes"], out["kept_leases"], out["releases_kept"]) == (4 * GiB, 1, 1)
            assert out["kept_asked_back"] == 0 and out["used"] == 6 * GiB
            kept = {li["token"]: li["kept"] for li in out["leases"]}
            assert kept == {lease.token: True, plain["token"]: False}
            with SdkPool(broker_srv.url, gpu, token=USER_TOKEN) as sdk:  # the broker's JSON
                got = sdk.status()
            assert (got["kept_bytes"], got["kept_leases"]) == (4 * GiB, 1)
            assert {li["token"]: li["kept"] for li in got["leases"]} == kept
            (listed,) = admin.get("/v1/pools").json()["pools"]
            assert (listed["kept_bytes"], listed["kept_leases"]) == (4 * GiB, 1)
            view = admin.get("/dashboard/data").json()["pools"][0]
            assert (view["kept_bytes"], view["kept_leases"], view["releases_kept"]) == (
                4 * GiB,
                1,
                1,
            )

            r = _gpulock_via(broker_srv.url, "status", gpu, "--json")
            assert r.returncode == 0, r.stderr
            d = json.loads(r.stdout)
            assert (d["kept_bytes"], d["kept_leases"], d["releases_kept"]) == (4 * GiB, 1, 1)
            assert sorted(li["kept"] for li in d["leases"]) == [False, True]
            r = _gpulock_via(broker_srv.url, "status", gpu)
            assert "kept: 1 lease, 4.0GiB (their holders give them back" in r.stdout, r.stdout

            seen = wait_until(
                lambda: (
                    (x := page.evaluate(_KEPT_DOM_JS % json.dumps(gpu)))
                    and x["keptLeases"] == "1"
                    and len(x["rows"]) == 2
                    and x
                ),
                30,
                "the kept lease marked on the page",
                interval=0.1,
            )
            assert seen["keptBytes"] == str(4 * GiB) and seen["stat"] == str(4 * GiB), seen
            assert seen["releasesKept"] == "1", seen
            assert "their holders give them back when a request does not fit" in seen["text"]
            assert seen["heads"][-1] == "kept", seen
            rows = {r["token"]: r for r in seen["rows"]}
            assert rows[str(lease.token)]["kept"] == "1" and "kept" in rows[str(lease.token)]["cls"]
            assert "kept by its holder" in rows[str(lease.token)]["text"]
            assert rows[str(plain["token"])]["kept"] is None, rows
    finally:
        keeper.close()
        user.delete(f"/v1/pools/gpu-a/leases/{plain['lease_id']}")
