"""Headless Chromium for the dashboard tests, driven over the DevTools protocol (CDP) with the
``websockets`` client (no browser-automation package).

Chromium is Debian's ``chromium`` (``/usr/bin/chromium``; ``.ci/run`` installs it). Without it
the tests skip, except under ``CI=true``, where they fail: CI must run them.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .procs import _LIVE, stop_group
from .waiting import wait_until

# As root, in this closed network: no sandbox, no GPU, and no background connections (their
# refused connections stall it otherwise).
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,1400",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
]


def chromium_binary() -> str:
    """The Chromium binary; skips the test without one (fails it when ``CI`` is true)."""
    found = shutil.which("chromium") or (
        "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
    )
    if found:
        return found
    msg = "no chromium binary (apt-get install chromium; .ci/run installs it)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(msg)
    pytest.skip(msg)


class Page:
    """One tab, over its own CDP websocket."""

    def __init__(self, ws_url: str):
        from websockets.sync.client import connect

        self._stack = contextlib.ExitStack()
        self._ws = self._stack.enter_context(connect(ws_url, max_size=64 * 2**20, open_timeout=10))
        self._ids = itertools.count(1)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send a CDP command and return its result (events in between are dropped)."""
        n = next(self._ids)
        self._ws.send(json.dumps({"id": n, "method": method, "params": params}))
        while True:
            msg = json.loads(self._ws.recv(timeout=30))
            if msg.get("id") == n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def goto(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def screenshot(self, path: Path) -> None:
        r = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(r["data"]))

    def close(self) -> None:
        self._stack.close()


class Browser:
    """``with Browser(tmp) as b: page = b.new_page(url)``: a fresh headless Chromium with its
    own profile in ``tmp``, killed on exit."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.binary = chromium_binary()

    def __enter__(self) -> Browser:
        profile = self.tmp / "chromium-profile"
        profile.mkdir(parents=True, exist_ok=True)
        port_file = profile / "DevToolsActivePort"
        port_file.unlink(missing_ok=True)  # a reused profile's is a dead browser's port
        self._log = open(self.tmp / "chromium.log", "wb")
        self.proc = subprocess.Popen(
            [self.binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        _LIVE.add(self.proc.pid)

        def port() -> str | None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited: {self.log_tail()}")
            lines = port_file.read_text().split() if port_file.exists() else []
            return lines[0] if len(lines) >= 2 else None

        self.port = wait_until(port, 60, "chromium's DevTools port", interval=0.05)
        self._pages: list[Page] = []
        return self

    def log_tail(self) -> str:
        try:
            return (self.tmp / "chromium.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def new_page(self, url: str) -> Page:
        """A new tab that has started loading ``url``."""
        import httpx

        r = httpx.put(f"http://127.0.0.1:{self.port}/json/new?about:blank", timeout=10)
        r.raise_for_status()
        page = Page(r.json()["webSocketDebuggerUrl"])
        self._pages.append(page)
        page.goto(url)
        return page

    def __exit__(self, *exc: Any) -> None:
        for p in self._pages:
            try:
                p.close()
            except Exception:  # noqa: BLE001 - the browser goes next anyway
                pass
        stop_group(self.proc, 5)
        self._log.close()


# JavaScript that reads what the dashboard page shows for pool NAME, by its data attributes:
# {stats: {field: raw value}, leases: [[token, amount]], waiters: [[position, amount]],
#  points: {series: number of chart points}, state, updates, text}; null before the pool shows.
POOL_DOM_JS = """
(function (name) {
  var sec = document.querySelector('section.pool[data-pool="' + name + '"]');
  var st = document.getElementById('status');
  if (!sec) return null;
  var stats = {};
  sec.querySelectorAll('.stats [data-field]').forEach(function (e) {
    stats[e.getAttribute('data-field')] = e.getAttribute('data-value');
  });
  function rows(sel) {
    return Array.prototype.map.call(sec.querySelectorAll(sel), function (tr) {
      return Array.prototype.map.call(tr.querySelectorAll('td[data-value]'), function (td) {
        return td.getAttribute('data-value');
      });
    });
  }
  var points = {};
  sec.querySelectorAll('polyline[data-series]').forEach(function (p) {
    points[p.getAttribute('data-series')] = p.getAttribute('points').trim().split(/\\s+/).length;
  });
  return {stats: stats, leases: rows('table.leases tbody tr'), waiters: rows('table.waiters tbody tr'),
          points: points, state: st.getAttribute('data-state'),
          updates: Number(st.getAttribute('data-updates')), text: document.body.innerText};
})(%s)
"""


def pool_dom(page: Page, pool: str) -> dict[str, Any] | None:
    """What the page shows for ``pool`` (see :data:`POOL_DOM_JS`): ``stats`` as ints/floats
    where given, ``leases`` as ``{(token, amount)}``, ``waiters`` as ``[(position, amount)]``."""
    d = page.evaluate(POOL_DOM_JS % json.dumps(pool))
    if d is None:
        return None

    def num(v: str | None) -> float | int | None:
        if v is None:
            return None
        f = float(v)
        return int(f) if f.is_integer() and "." not in v else f

    d["stats"] = {k: num(v) for k, v in d["stats"].items()}
    if not {"capacity", "used", "free", "lease_count", "waiter_count"} <= d["stats"].keys():
        return None  # the pool's card is drawn, its numbers not yet: read again
    # lease rows: amount, token, expires in; waiter rows: position, amount, priority, waited
    d["leases"] = {(int(r[1]), int(r[0])) for r in d["leases"]}
    d["waiters"] = [(int(r[0]), int(r[1])) for r in d["waiters"]]
    return d


def status_view(st: dict[str, Any]) -> dict[str, Any]:
    """The same fields from a ``gpulock status --json`` object."""
    return {
        "capacity": st["capacity"],
        "used": st["used"],
        "free": st["free"],
        "lease_count": st["lease_count"],
        "waiter_count": st["waiter_count"],
        "leases": {(lz["token"], lz["amount"]) for lz in st["leases"]},
        "waiters": [(w["position"], w["amount"]) for w in st["waiters"]],
    }


def dom_view(d: dict[str, Any]) -> dict[str, Any]:
    """:func:`status_view`'s fields from :func:`pool_dom`'s."""
    s = d["stats"]
    return {
        "capacity": s["capacity"],
        "used": s["used"],
        "free": s["free"],
        "lease_count": s["lease_count"],
        "waiter_count": s["waiter_count"],
        "leases": d["leases"],
        "waiters": d["waiters"],
    }
