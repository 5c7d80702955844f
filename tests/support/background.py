"""A blocking acquire on a thread of its own, for tests that must act while it waits."""

from __future__ import annotations

import threading
from typing import Any


def acquire_in_thread(pool: Any, amount: Any, **kw: Any) -> tuple[threading.Thread, dict]:
    """Start ``pool.acquire(amount, **kw)`` (a sync pool object: the core's or the SDK's) on a
    daemon thread. Returns the thread and a dict that gets ``"lease"`` (the grant) or
    ``"error"`` (what it raised) when it ends."""
    out: dict = {}

    def run() -> None:
        try:
            out["lease"] = pool.acquire(amount, **kw)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out
