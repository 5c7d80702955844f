"""``gpulock top``: the dashboard's view in the terminal (rich's Live), for SSH sessions.

The frame is drawn from the JSON of :func:`gpulock.dashboard.view.dashboard_view`, read from Redis
(``--redis-url``) or from a broker's ``/dashboard/data`` (``--broker-url``, admin token in
``GPULOCK_TOKEN``). ``--once`` prints one frame and exits; ``--iterations N`` stops after N.
When stdout is not a terminal (a pipe, a file) each frame is printed in turn instead.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Optional

import typer

from gpulock_common.options import DEFAULT_BACKFILL_WINDOW_S, DEFAULT_PLACEMENT, DEFAULT_POLICY

from gpulock.cli.common import (
    EXIT_NO_POOL,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    Target,
    drain_text,
    error_exit,
    fail,
    partial_exit,
    pool_name_param,
    safe_url,
    target,
    wait_text,
)
from gpulock.errors import GpuLockError
from gpulock.units import format_size

if TYPE_CHECKING:
    from rich.console import RenderableType

__all__ = ["fetch_view", "render_view", "sparkline", "top"]

_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[int], top: int, width: int) -> str:
    """The newest ``width`` values as block characters scaled to ``top`` (bytes)."""
    vals = values[-width:]
    if not vals or top <= 0:
        return ""
    return "".join(_BARS[min(len(_BARS) - 1, max(0, v * len(_BARS) // (top + 1)))] for v in vals)


def _holder(h: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in h.items())


def _growth(w: dict[str, Any]) -> str:
    """``token 1796138604867005 +512MiB`` for a queued growth (the fencing token of the lease it
    grows, by how much; the dashboard's view names no lease id), ``-`` for a new request."""
    tok = w.get("growth_token")
    return f"token {tok} +{format_size(w['amount'])}" if tok else "-"


def _secs(s: float) -> str:
    return f"{s:.1f}s" if s < 60 else f"{int(s // 60)}m{int(s % 60):02d}s"


def _yield_in(s: Optional[float]) -> str:
    """A lease's ``yield_in`` (seconds until the pool takes it back): ``in 12.0s``; ``-``
    when not asked to yield."""
    return "-" if s is None else f"in {_secs(s)}"


def render_view(view: dict[str, Any], *, limit: int = 20) -> RenderableType:
    """One frame: a panel per pool (numbers, a sparkline of used bytes, leases, queue)."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from gpulock.admin.listing import Unreachable

    parts: list[Any] = []
    for p in view["pools"]:
        rate = "-" if p["grant_rate"] is None else f"{p['grant_rate']:.1f}/s"
        head = Text()
        # kept bytes (docs/SEMANTICS.md, "Kept bytes"): part of used, said while a lease is kept
        kept_n = p.get("kept_leases", 0)  # a broker older than kept bytes sends none
        kept = f" ({format_size(p['kept_bytes'])} kept)" if kept_n else ""
        head.append(
            f"capacity {format_size(p['capacity'])}  used {format_size(p['used'])}{kept}  "
            f"resident {format_size(p['resident'])}  free {format_size(p['free'])}\n"
        )
        if p.get("external"):  # the device report holds bytes back (docs/SEMANTICS.md)
            head.append(
                f"device: {format_size(p['external'])} in use outside the leases, effective "
                f"capacity {format_size(p['effective_capacity'])}\n"
            )
        for o in p.get("overusers", ()):
            who = " ".join(f"{k}={v}" for k, v in o["holder"].items()) or "?"
            head.append(
                f"over-user: {who} uses {format_size(o['actual'])} for a lease of "
                f"{format_size(o['leased'])} ({format_size(o['excess'])} over)\n"
            )
        policy = p.get("policy", DEFAULT_POLICY)  # a broker older than queue policies sends none
        if policy == "backfill":
            policy = f"backfill (window {p.get('backfill_window', DEFAULT_BACKFILL_WINDOW_S):g}s)"
        head.append(
            f"leases {p['lease_count']}  queued {p['waiter_count']}  policy {policy}  "
            f"grants {rate}  503s {p['rejected']}  OOMs {p['oom']}\n"
        )
        drain = p.get("drain")  # None while not measured (and from a broker older than it)
        head.append(
            f"queue {drain_text(drain['bytes_per_s'], drain['grants_per_s'])} while busy\n"
            if drain
            else f"queue {drain_text(None, None)}\n"
        )
        devices = p.get("devices") or []  # a broker older than devices sends none
        if len(devices) > 1:
            head.append(
                f"devices ({p.get('placement', DEFAULT_PLACEMENT)}): "
                + "  ".join(
                    f"{d['index']} {format_size(d['used'])}/{format_size(d['capacity'])}"
                    for d in devices
                )
                + "\n"
            )
        pre, y = p.get("preemption"), p.get("yields") or {}  # a broker older than it: none
        if pre or y.get("asked"):
            mean = y.get("mean_time_to_yield")
            head.append(
                (f"preemption gap {pre['gap']}, grace {pre['yield_grace_s']:g}s" if pre else "preemption off")
                + f"  asked {y.get('asked', 0)}  yielded {y.get('done', 0)}"
                + (f" (mean {_secs(mean)})" if mean is not None else "")
                + f"  taken back {y.get('taken', 0)}\n"
            )  # fmt: skip
        if kept_n or p.get("releases_kept"):  # once a holder has kept a lease
            head.append(
                f"kept {kept_n} lease{'' if kept_n == 1 else 's'}, "
                f"{format_size(p['kept_bytes'])} (given back when a request does not fit)  "
                f"releases kept {p['releases_kept']}  asked back {p['kept_asked_back']}\n"
            )
        hist = p["history"]
        top = max([p["capacity"], *hist["capacity"]]) if hist["capacity"] else p["capacity"]
        line = sparkline(hist["used"], top, 60)
        head.append(f"used, last {len(line)} s: {line or '(no samples yet)'}")
        leases = Table(title=f"leases ({p['lease_count']})", title_justify="left", expand=False)
        several = len(devices) > 1  # a device column only then
        # a yield column while a listed lease is asked to yield
        asked = any(lz.get("yield_in") is not None for lz in p["leases"][:limit])
        kept_col = any(lz.get("kept") for lz in p["leases"][:limit])  # a kept column then
        for col, right in (
            ("holder", False),
            ("amount", True),
            ("token", True),
            *((("device", True),) if several else ()),
            ("expires in", True),
            *((("yield by", True),) if asked else ()),
            *((("kept", False),) if kept_col else ()),
        ):
            leases.add_column(col, justify="right" if right else "left")
        for lz in p["leases"][:limit]:
            leases.add_row(
                _holder(lz["holder"]), format_size(lz["amount"]), str(lz["token"]),
                *((str(lz.get("device", 0)),) if several else ()), _secs(lz["expires_in"]),
                *((_yield_in(lz.get("yield_in")),) if asked else ()),
                *(("kept" if lz.get("kept") else "-",) if kept_col else ()),
            )  # fmt: skip
        queue = Table(title=f"queue ({p['waiter_count']})", title_justify="left", expand=False)
        # a growth column only while a growth is queued (a broker older than resizes sends none)
        growths = any(w.get("growth_token") for w in p["waiters"][:limit])
        for col, right in (
            ("position", True),
            ("amount", True),
            *((("growth of", False),) if growths else ()),
            ("priority", True),
            ("waited", True),
            ("est. wait", True),
            ("holder", False),
        ):
            queue.add_column(col, justify="right" if right else "left")
        for w in p["waiters"][:limit]:
            queue.add_row(
                str(w["position"]), format_size(w["amount"]),
                *((_growth(w),) if growths else ()), str(w.get("priority", 0)),
                _secs(w["waited"]), wait_text(w.get("estimated_wait_s")), _holder(w["holder"]),
            )  # fmt: skip
        parts.append(Panel(Group(head, leases, queue), title=p["pool"], title_align="left"))
    for name, msg in view["errors"].items():
        parts.append(Panel(Text(msg, style="red"), title=name, title_align="left"))
    for d in view.get("unreachable") or ():  # a broker older than partial answers sends none
        u = Unreachable.from_dict(d)
        parts.append(
            Panel(
                Text(f"{u.describe()}; the pools of this shard are not shown", style="red"),
                title=f"shard {u.node or '(no master)'} unreachable",
                title_align="left",
            )
        )
    if not parts:
        parts.append(Text("no pools"))
    return Group(*parts)


async def _redis_view(url: str, name: Optional[str], limit: int) -> dict[str, Any]:
    from gpulock._async import _CLIENT_DEFAULTS, AsyncPool
    from gpulock.transport.cluster import is_cluster_url
    from gpulock.transport.cluster import ready as cluster_ready
    from gpulock.transport.connect import async_client
    from gpulock.dashboard.view import dashboard_view
    from gpulock.admin.listing import Listing, alist_pools, answering_url, list_seeds, steer
    from gpulock.transport.translate import translate

    listing: Optional[Listing] = None
    if name is None and is_cluster_url(url):
        # asked of the seeds first: the client then starts on the seeds that answered (as
        # gpulock status does)
        try:
            listing = await asyncio.to_thread(list_seeds, url)
        except Exception as e:  # noqa: BLE001 - translated to gpulock's tree
            raise translate(e, "*") from e
        url = answering_url(url, listing)
    redis = async_client(url, **dict[str, Any](_CLIENT_DEFAULTS))
    pools: dict[str, AsyncPool] = {}

    async def status(n: str, lim: int) -> Any:
        if n not in pools:
            pools[n] = AsyncPool(redis, n)
        return await pools[n].status(limit=lim)

    try:
        if name is not None:
            return await dashboard_view(redis, [name], status, limit=limit)
        try:
            if listing is None:  # a lone server, or a plain URL of a cluster node
                listing = await alist_pools(redis)
            # a cluster client reads the slot map now (not in a pool's bounded read), then
            # keeps away from the masters that did not answer
            await cluster_ready(redis)
            steer(redis, listing)
        except Exception as e:  # noqa: BLE001 - translated to gpulock's tree
            raise translate(e, "*") from e
        return await dashboard_view(
            redis, listing.names, status, limit=limit, unreachable=listing.unreachable
        )
    finally:
        for p in pools.values():
            await p.aclose()
        await redis.aclose()


def fetch_view(t: Target, name: Optional[str], limit: int) -> dict[str, Any]:
    """The view from the backend ``t`` (one pool, or all). Raises the core's errors."""
    if t.is_broker:
        from gpulock.cli.broker import BrokerAdmin

        b = BrokerAdmin(t.url)
        try:
            view: dict[str, Any] = b.call("GET", "/dashboard/data")
        finally:
            b.close()
        if name is not None:
            view = {
                "pools": [p for p in view["pools"] if p["pool"] == name],
                "errors": {k: v for k, v in view["errors"].items() if k == name},
                "unreachable": [],
            }
            if not view["pools"] and not view["errors"]:
                view["errors"][name] = f"no pool {name!r} at {safe_url(t.url)}"
        return view
    return asyncio.run(_redis_view(t.url, name, limit))


def top(
    ctx: typer.Context,
    name: Optional[str] = typer.Argument(
        None, metavar="[NAME]", callback=pool_name_param, help="Pool to show (default: every pool)."
    ),
    interval: float = typer.Option(
        1.0, "--interval", min=0.1, max=3600, help="Seconds between frames."
    ),
    iterations: int = typer.Option(
        0, "--iterations", "-n", min=0, help="Stop after this many frames (0: until Ctrl-C)."
    ),
    once: bool = typer.Option(False, "--once", help="Print one frame and exit (--iterations 1)."),
    limit: int = typer.Option(
        20, "--limit", min=0, max=10000, help="Most leases and waiters listed per pool."
    ),
) -> None:
    """The live view of the pools (capacity, used and resident bytes, leases, queue, grant
    rate, 503s, OOMs), redrawn every --interval seconds; the dashboard's view for terminals."""
    from rich.console import Console
    from rich.live import Live

    t = target(ctx)
    if once:
        if iterations not in (0, 1):
            fail(EXIT_USAGE, "give --once or --iterations, not both")
        iterations = 1
    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "120"))
    console = Console(file=sys.stdout, width=width, highlight=False)

    def view() -> dict[str, Any]:
        try:
            return fetch_view(t, name, limit)
        except GpuLockError as e:
            error_exit(e, t, name or "", admin=t.is_broker)  # a broker's view: admin tokens only

    def frame() -> RenderableType:
        return render_view(view(), limit=limit)

    if iterations == 1:
        v = view()
        console.print(render_view(v, limit=limit))
        if name is not None and not v["pools"]:
            # one frame of the one pool asked for, which could not be read: the command failed
            # (66 when the pool does not exist, as for gpulock status; else 69)
            msg = str(v["errors"].get(name, ""))
            missing = "not configured" in msg or msg.startswith("no pool")
            raise typer.Exit(EXIT_NO_POOL if missing else EXIT_UNAVAILABLE)
        if name is None and v.get("unreachable"):
            from gpulock.admin.listing import Unreachable

            sys.stdout.flush()
            partial_exit(t, [Unreachable.from_dict(d) for d in v["unreachable"]])
        return
    n = 0
    if not console.is_terminal:
        # A pipe or a file (watch's log, `gpulock top | tee`): Live draws only its last frame
        # there, so each frame is printed in turn, flushed (as top -b does).
        try:
            while True:
                console.print(frame())
                sys.stdout.flush()
                n += 1
                if iterations and n >= iterations:
                    return
                time.sleep(interval)
        except KeyboardInterrupt:
            return
    try:
        with Live(frame(), console=console, auto_refresh=False, screen=False) as live:
            n = 1
            while not iterations or n < iterations:
                time.sleep(interval)
                live.update(frame(), refresh=True)
                n += 1
    except KeyboardInterrupt:
        pass
