"""The per-process history file (tests): one JSON line per grant, release, loss and CUDA call,
so a test can check that no two leases over the budget were ever held at once."""

from __future__ import annotations

import asyncio
import json
import os
import time
import typing
from typing import Any

from gpulock._async import AsyncLease


class History:
    """Writes ``<prefix>.<pid>.jsonl`` once opened; does nothing when not."""

    def __init__(self) -> None:
        self._file: typing.TextIO | None = None

    async def open(self, prefix: str) -> None:
        """Open (append, line buffered) this process's file for ``prefix``."""
        path = f"{prefix}.{os.getpid()}.jsonl"
        self._file = await asyncio.to_thread(lambda: open(path, "a", buffering=1))

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None

    def record(self, event: str, lease: AsyncLease | None, **kw: Any) -> None:
        """One line: ``e`` (the event), ``pid``, ``t`` (wall clock, seconds), ``kw``, and the
        lease's id, amount, token, server grant time and last known server expiry (both Unix
        ms, the server's clock: on one host, the clock ``t`` reads) when a lease is given. A
        lease that expired on the server before its release or loss was recorded gave its
        bytes back at ``expires_ms`` at the latest, not at ``t``. Write errors are ignored."""
        if self._file is None:
            return
        rec = {"e": event, "pid": os.getpid(), "t": time.time(), **kw}
        if lease is not None:
            rec.update(
                lease_id=lease.id,
                amount=lease.amount,
                token=lease.token,
                server_grant_ms=int(round(lease.expires_at * 1000 - lease.ttl * 1000)),
                expires_ms=int(round(lease.expires_at * 1000)),
            )
        try:
            self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")
        except Exception:
            pass
