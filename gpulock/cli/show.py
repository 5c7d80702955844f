"""How ``gpulock status`` and ``gpulock pool set`` print a pool: the status text and tables
(:func:`print_status`) and the short forms of its settings (queue policy, quotas, devices,
preemption) and of its kept bytes."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Mapping, Optional

from gpulock.cli.common import drain_text, secs, wait_text
from gpulock.units import format_size

if TYPE_CHECKING:
    from rich.console import Console

    from gpulock.protocol.replies import LeaseInfo, PoolStatus, WaiterInfo, YieldCounts


def policy_text(policy: str, window: Optional[float]) -> str:
    """``policy fifo``, or ``policy backfill (window 2s)``."""
    if policy == "backfill" and window is not None:
        return f"policy backfill (window {window:g}s)"
    return f"policy {policy}"


def devices_text(caps: list[int]) -> str:
    """``4 x 80GiB``, or ``80GiB,80GiB,40GiB``: a pool's devices' capacities as sizes."""
    if len(set(caps)) == 1:
        return f"{len(caps)} x {format_size(caps[0])}"
    return ",".join(format_size(c) for c in caps)


def quota_text(quotas: dict[str, int]) -> str:
    """``alice=8GiB bob=4GiB``: tenant quotas as sizes."""
    return " ".join(f"{t}={format_size(b)}" for t, b in sorted(quotas.items()))


def preemption_text(p: Optional[Mapping[str, Any]]) -> str:
    """``preemption gap 10, yield grace 30s``, or ``preemption off``: a configure reply's
    ``preemption`` (``{"gap", "yield_grace_s"}``; None: off)."""
    if not p:
        return "preemption off"
    return f"preemption gap {p['gap']}, yield grace {p['yield_grace_s']:g}s"


def yields_text(y: YieldCounts) -> str:
    """``asked 3, yielded 2 (mean 1.2s to yield), taken back 1``: a pool's preemption
    counters."""
    mean = y.mean_time_to_yield
    done = f"yielded {y.done}" + (f" (mean {secs(mean)} to yield)" if mean is not None else "")
    return f"asked {y.asked}, {done}, taken back {y.taken}"


def yield_by_text(li: LeaseInfo, now: Optional[float] = None) -> str:
    """``yield by 14:03:21 (in 12s)`` for a lease asked to yield (local wall-clock time the
    pool takes it back), ``-`` for one not asked."""
    if li.yield_in is None:
        return "-"
    at = (time.time() if now is None else now) + max(0.0, li.yield_in)
    return f"yield by {time.strftime('%H:%M:%S', time.localtime(at))} (in {secs(li.yield_in)})"


def kept_text(st: PoolStatus) -> str:
    """``kept: 2 leases, 3GiB (their holders give them back when a request does not fit);
    releases kept 14, asked back 1``: the leases their holders keep (docs/SEMANTICS.md, "Kept
    bytes") and the pool's counters."""
    n = st.kept_leases
    return (
        f"kept: {n} lease{'' if n == 1 else 's'}, {format_size(st.kept_bytes)} (their holders "
        f"give them back when a request does not fit); releases kept {st.releases_kept}, "
        f"asked back {st.kept_asked_back}"
    )


def growth_text(w: WaiterInfo) -> str:
    """``lease 1a2b3c4d +512MiB`` for a queued growth (the lease it grows, by how much), ``-``
    for a new request."""
    if not w.growth_of:
        return "-"
    return f"lease {w.growth_of[:8]} +{format_size(w.amount)}"


# Control characters of holder metadata (set by any client) shown as escapes: raw, an ANSI
# sequence would reach the terminal and a newline would break the table.
_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F]}


def _shown(value: Any) -> Any:
    """Holder metadata as table text (a ``rich.text.Text``): literal (no rich markup),
    control characters escaped."""
    from rich.text import Text

    return Text(str(value).translate(_CONTROLS))


def print_status(console: Console, st: PoolStatus) -> None:
    from rich.table import Table

    pct = (100.0 * st.used / st.capacity) if st.capacity else 0.0
    console.print(
        f"pool [bold]{st.pool}[/bold]: capacity {format_size(st.capacity)}, used {format_size(st.used)} "
        f"({pct:.0f}%), free {format_size(st.free)}; {st.lease_count} lease(s), "
        f"{st.waiter_count} waiter(s), max_waiters {st.max_waiters}",
        highlight=False,
    )
    if st.drain is not None:  # the wait estimates' rate (docs/SEMANTICS.md, "Wait estimate")
        rate = drain_text(st.drain.bytes_per_s, st.drain.grants_per_s)
        console.print(f"queue {rate} while busy", highlight=False)
    elif st.waiters:
        console.print(f"queue {drain_text(None, None)}: no wait estimates", highlight=False)
    if st.policy != "fifo":  # FIFO, every pool's default, goes unsaid
        how = (
            ": while the head of the queue does not fit, later requests that fit are granted, "
            "for at most the window"
            if st.policy == "backfill"
            else ""
        )
        console.print(f"queue {policy_text(st.policy, st.backfill_window)}{how}", highlight=False)
    if st.preemption is not None or st.yields.asked:
        p = st.preemption
        console.print(
            preemption_text(p.shown() if p else None) + f"; {yields_text(st.yields)}",
            highlight=False,
        )
    if st.kept_leases or st.releases_kept:  # said once a holder has kept a lease
        console.print(kept_text(st), highlight=False)
    if st.grace_left > 0:
        console.print(
            f"grace period: Redis lost the pool's data; no new grants for {secs(st.grace_left)} "
            "more, while the leases held before are put back (docs/RELIABILITY.md)",
            highlight=False,
        )
    if len(st.devices) > 1:
        console.print(
            f"devices ({st.placement}): "
            + ", ".join(
                f"{d.index} {format_size(d.used)} of {format_size(d.capacity)}" for d in st.devices
            ),
            highlight=False,
        )
    if st.tenants:
        console.print(
            "tenants: "
            + ", ".join(
                f"{t} {format_size(u.used)}"
                + (f" of quota {format_size(u.quota)}" if u.quota else " (no quota)")
                for t, u in st.tenants.items()
            ),
            highlight=False,
        )
    if st.external_left > 0:
        console.print(
            f"device: {format_size(st.external)} in use outside the pool's leases; effective "
            f"capacity {format_size(st.effective_capacity)} (report counts {secs(st.external_left)} more)",
            highlight=False,
        )
    for o in st.overusers:
        h = o.get("holder") or {}
        console.print(
            f"over-user: host {h.get('host', '?')} pid {o.get('pid', '?')} lease "
            f"{','.join(str(x)[:8] for x in o.get('lease_ids', []))}: uses "
            f"{format_size(int(o.get('actual', 0)))} for {format_size(int(o.get('leased', 0)))} "
            f"leased, {format_size(int(o.get('excess', 0)))} over",
            highlight=False,
        )
    lease_tenants = any(li.tenant for li in st.leases)  # a tenant column only when one is set
    waiter_tenants = any(w.tenant for w in st.waiters)
    growths = any(w.growth_of for w in st.waiters)  # a growth column only when one is queued
    devs = len(st.devices) > 1  # a device column only on a pool of several
    # a priority column for the leases with preemption on; a yield column once one is asked
    prios = st.preemption is not None
    yields = any(li.yield_in is not None for li in st.leases)
    kept = any(li.kept for li in st.leases)  # a kept column while a listed lease is kept
    # an estimate column only once the drain rate is measured (before, every cell would be a
    # dash, and the line above says why): a narrow terminal keeps its room for the purpose
    ests = st.drain is not None
    if st.leases:
        t = Table(title=None, show_edge=False, pad_edge=False, box=None, header_style="bold")
        cols: tuple[tuple[str, dict[str, Any]], ...] = (
            ("lease", {}),
            ("amount", {"justify": "right"}),
            ("token", {"justify": "right"}),
            *((("device", {"justify": "right"}),) if devs else ()),
            *((("tenant", {}),) if lease_tenants else ()),
            ("host", {}),
            ("pid", {"justify": "right"}),
            ("purpose", {"overflow": "fold"}),
            *((("priority", {"justify": "right"}),) if prios else ()),
            ("held", {"justify": "right"}),
            ("expires in", {"justify": "right"}),
            *((("yield", {}),) if yields else ()),
            *((("kept", {}),) if kept else ()),
        )
        for col, kw in cols:
            t.add_column(col, no_wrap=col != "purpose", **kw)
        for li in st.leases:
            h = li.holder
            t.add_row(
                li.lease_id[:8],
                format_size(li.amount),
                str(li.token),
                *((str(li.device),) if devs else ()),
                *((li.tenant or "-",) if lease_tenants else ()),
                _shown(h.get("host", "?")),
                _shown(h.get("pid", "?")),
                _shown(h.get("purpose", "")),
                *(("-" if li.priority is None else str(li.priority),) if prios else ()),
                secs(li.held_for),
                secs(li.expires_in),
                *((yield_by_text(li),) if yields else ()),
                *(("kept" if li.kept else "-",) if kept else ()),
            )
        console.print(t)
    if st.waiters:
        t = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
        cols = (
            ("position", {"justify": "right"}),
            ("amount", {"justify": "right"}),
            *((("growth of", {}),) if growths else ()),
            ("priority", {"justify": "right"}),
            *((("device", {"justify": "right"}),) if devs else ()),
            *((("tenant", {}),) if waiter_tenants else ()),
            ("host", {}),
            ("pid", {"justify": "right"}),
            ("purpose", {"overflow": "fold"}),
            ("waited", {"justify": "right"}),
            *((("est. wait", {"justify": "right"}),) if ests else ()),
            ("request id", {}),
        )
        for col, kw in cols:
            t.add_column(col, no_wrap=col != "purpose", **kw)
        for w in st.waiters:
            h = w.holder
            t.add_row(
                str(w.position),
                format_size(w.amount),
                *((growth_text(w),) if growths else ()),
                str(w.priority),
                *((("any" if w.device is None else str(w.device)),) if devs else ()),
                *((w.tenant or "-",) if waiter_tenants else ()),
                _shown(h.get("host", "?")),
                _shown(h.get("pid", "?")),
                _shown(h.get("purpose", "")),
                secs(w.waited),
                *((wait_text(w.estimated_wait),) if ests else ()),
                w.request_id[:12],
            )
        console.print(t)
    if st.lease_count > len(st.leases) or st.waiter_count > len(st.waiters):
        console.print(
            f"(listing first {len(st.leases)} leases and {len(st.waiters)} waiters)",
            highlight=False,
        )
