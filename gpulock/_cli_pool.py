"""``gpulock status`` and ``gpulock pool set|list|delete``: each goes to the backend the user
named, ``--redis-url`` or ``--broker-url`` (the broker's ``/v1/pools`` routes; ``pool set`` and
``pool delete`` need an admin token there)."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any, Optional

import typer

from ._cli_common import (
    EXIT_TEMPFAIL,
    Target,
    error_exit,
    fail,
    policy_param,
    pool_name_param,
    quota_param,
    redis_client,
    safe_url,
    say,
    seconds_param,
    seconds_text_param,
    secs,
    size_param,
    target,
)
from ._admin import DeleteResult
from .errors import GpuLockError, PoolNotFound
from .units import format_size

if TYPE_CHECKING:
    from rich.console import Console

    from . import PoolStatus

pool_app = typer.Typer(
    help="Create, list, change and delete pools.",
    no_args_is_help=True,
    rich_markup_mode=None,
    add_completion=False,
)


def _status_dict(st: PoolStatus) -> dict[str, Any]:
    d = st.to_dict()
    d["free"] = st.free
    d["effective_capacity"] = st.effective_capacity
    return d


def _statuses(t: Target, name: Optional[str], limit: int) -> list[PoolStatus]:
    """The status of pool ``name``, or of every pool (sorted by name), from the backend."""
    if t.is_broker:
        from ._cli_broker import BrokerAdmin, status_from_dict

        b = BrokerAdmin(t.url)
        try:
            if name is not None:
                return [status_from_dict(b.call("GET", f"/v1/pools/{name}", name))]
            return [status_from_dict(d) for d in b.call("GET", "/v1/pools")["pools"]]
        finally:
            b.close()
    from ._admin import pool_names
    from ._sync import Pool

    client = redis_client(t.url)
    try:
        if name is not None:
            return [Pool(client, name).status(limit=limit)]
        out = []
        for n in pool_names(client):
            try:
                out.append(Pool(client, n).status(limit=limit))
            except PoolNotFound:
                pass  # deleted between the scan and now
        return out
    finally:
        client.close()


# ---- pool set --------------------------------------------------------------------------------
@pool_app.command("set")
def pool_set(
    ctx: typer.Context,
    name: str = typer.Argument(
        ..., metavar="NAME", callback=pool_name_param, help="Pool name: 1-64 of [A-Za-z0-9._-]."
    ),
    capacity: Optional[str] = typer.Option(
        None,
        "--capacity",
        "-c",
        callback=size_param("capacity"),
        help="Bytes the pool lends out: 8GiB, 512MiB, 24GB, or a number of bytes (default: "
        "keep the current value; a new pool needs it).",
    ),
    max_waiters: Optional[int] = typer.Option(
        None,
        "--max-waiters",
        min=1,
        max=1_000_000,
        help="Most requests that may queue (default: keep the current value; 10000 for a new pool).",
    ),
    max_ttl: Optional[float] = typer.Option(
        None,
        "--max-ttl",
        callback=seconds_param("--max-ttl", minimum=0.1, maximum=86400),
        help="Longest lease ttl the pool accepts, seconds; also the grace period after Redis "
        "restarts without data (default: keep the current value; 60 for a new pool).",
    ),
    policy: Optional[str] = typer.Option(
        None,
        "--policy",
        metavar="fifo|backfill",
        callback=policy_param,
        help="Queue policy: fifo (nothing passes the head of the queue) or backfill (while the "
        "head does not fit, later requests that fit are granted, for at most "
        "--backfill-window; docs/SEMANTICS.md, 'Backfill'). Default: keep the current one; "
        "fifo for a new pool.",
    ),
    backfill_window: Optional[float] = typer.Option(
        None,
        "--backfill-window",
        metavar="SECONDS",
        # parsed from the text, so a value that is not a number is named too
        parser=seconds_text_param("--backfill-window", minimum=0.001, maximum=86400),
        help="Under backfill, how long a head that does not fit may be passed, seconds "
        "(default: keep the current value; 2 for a new pool).",
    ),
    quota: Optional[list[str]] = typer.Option(
        None,
        "--quota",
        metavar="TENANT=SIZE",
        help="Cap the bytes one tenant's leases may hold (repeatable; SIZE 0 or none removes "
        "the cap; docs/SEMANTICS.md, 'Tenant quotas'). Tenants not named keep theirs.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Create pool NAME (--capacity needed), or change its capacity, queue bound, max ttl,
    queue policy or tenant quotas (what is not given keeps its value).

    Lowering the capacity below what is in use is allowed: leases keep their bytes and nothing
    new is granted until enough is released. Raising it grants waiters that now fit. Through
    --broker-url it needs an admin token (GPULOCK_TOKEN).
    """
    t = target(ctx)
    # parsed here, not in a callback: typer hands a list option's callback result back as a list
    quotas = quota_param(quota)
    try:
        if t.is_broker:
            from ._cli_broker import BrokerAdmin

            b = BrokerAdmin(t.url)
            try:
                # The broker's PUT needs a capacity: left out, the pool's (a pool that does
                # not exist is a 404 here, PoolNotFound: exit 66 saying to give --capacity)
                cap = (
                    capacity
                    if capacity is not None
                    else b.call("GET", f"/v1/pools/{name}", name)["capacity"]
                )
                body: dict[str, Any] = {"capacity": cap}
                if max_waiters is not None:
                    body["max_waiters"] = max_waiters
                if max_ttl is not None:
                    body["max_ttl"] = max_ttl
                if policy is not None:
                    body["policy"] = policy
                if backfill_window is not None:
                    body["backfill_window"] = backfill_window
                if quotas is not None:
                    body["quotas"] = quotas
                r = b.call("PUT", f"/v1/pools/{name}", name, body)
            finally:
                b.close()
        else:
            r = _configure_redis(
                t.url,
                name,
                None if capacity is None else int(capacity),
                max_waiters,
                max_ttl,
                policy,
                backfill_window,
                quotas,
            )
    except GpuLockError as e:
        error_exit(e, t, name, admin=True)
    if backfill_window is not None and r.get("policy") == "fifo":
        say(
            "note: the backfill window is stored but has no effect under policy fifo; it "
            "applies once the pool's policy is backfill (--policy backfill)"
        )
    if as_json:
        print(json.dumps({"pool": name, **{k: v for k, v in r.items() if k != "pool"}}))
        return
    what = "created" if r["created"] else "updated"
    print(
        f"pool {name} {what}: capacity {format_size(r['capacity'])} ({r['capacity']} bytes), "
        f"max_waiters {r['max_waiters']}, used {format_size(r['used'])} ({r['used']} bytes)"
        + (f", {policy_text(r['policy'], r.get('backfill_window'))}" if "policy" in r else "")
        + (f", quotas {quota_text(r['quotas'])}" if r.get("quotas") else "")
    )
    if r["used"] > r["capacity"]:
        print(
            f"gpulock: note: {format_size(r['used'] - r['capacity'])} more than the new capacity "
            "is leased now; those leases keep their bytes, and nothing new is granted until "
            "releases bring use under the capacity",
            file=sys.stderr,
        )


def policy_text(policy: str, window: Optional[float]) -> str:
    """``policy fifo``, or ``policy backfill (window 2s)``."""
    if policy == "backfill" and window is not None:
        return f"policy backfill (window {window:g}s)"
    return f"policy {policy}"


def quota_text(quotas: dict[str, int]) -> str:
    """``alice=8GiB bob=4GiB``: tenant quotas as sizes."""
    return " ".join(f"{t}={format_size(b)}" for t, b in sorted(quotas.items()))


def _configure_redis(
    url: str,
    name: str,
    capacity: Optional[int],
    max_waiters: Optional[int],
    max_ttl: Optional[float],
    policy: Optional[str] = None,
    backfill_window: Optional[float] = None,
    quotas: Optional[dict[str, int]] = None,
) -> dict[str, Any]:
    from ._sync import Pool

    client = redis_client(url)
    try:
        pool = Pool(client, name)
        cap, mw, mt = capacity, max_waiters, max_ttl
        if cap is None or mw is None or mt is None:
            try:
                st = pool.status(limit=0)
                cap = st.capacity if cap is None else cap
                mw = st.max_waiters if mw is None else mw
                if mt is None and st.max_ttl:
                    mt = st.max_ttl
            except PoolNotFound:
                if cap is None:  # nothing to keep: a new pool needs --capacity
                    raise
        # policy and window: None leaves each as the pool has it (configure.lua keeps them)
        return pool.configure(
            cap,
            max_waiters=mw,
            max_ttl=mt,
            policy=policy,
            backfill_window=backfill_window,
            quotas=quotas,
        )
    finally:
        client.close()


# ---- pool list -------------------------------------------------------------------------------
@pool_app.command("list")
def pool_list(
    ctx: typer.Context,
    as_json: bool = typer.Option(
        False, "--json", help="A JSON list of the pools (bytes, seconds)."
    ),
) -> None:
    """List the pools (one line each: name, capacity, use, leases, waiters)."""
    t = target(ctx)
    try:
        statuses = _statuses(t, None, 0)
    except GpuLockError as e:
        error_exit(e, t)
    if as_json:
        out = []
        for s in statuses:
            d = _status_dict(s)
            d.pop("leases", None)
            d.pop("waiters", None)
            out.append(d)
        print(json.dumps(out, indent=2))
        return
    if not statuses:
        say(f"no pools in {t.describe()} (create one: gpulock pool set NAME --capacity SIZE)")
        return
    w = max(len(s.pool) for s in statuses)
    for s in statuses:
        pct = (100.0 * s.used / s.capacity) if s.capacity else 0.0
        print(
            f"{s.pool:<{w}}  capacity {format_size(s.capacity)}  used {format_size(s.used)} ({pct:.0f}%)  "
            f"{s.lease_count} lease(s)  {s.waiter_count} waiter(s)"
        )


# ---- pool delete -----------------------------------------------------------------------------
@pool_app.command("delete")
def pool_delete(
    ctx: typer.Context,
    name: str = typer.Argument(
        ..., metavar="NAME", callback=pool_name_param, help="Pool to delete."
    ),
    force: bool = typer.Option(
        False, "--force", help="Delete even while leases are held or requests wait."
    ),
) -> None:
    """Delete pool NAME: its configuration, leases and queue.

    Refused (exit 75) while the pool has live leases or waiters, unless --force. A holder
    still running when its pool is deleted by force sees what it would see after a Redis
    restart without data: it puts its lease back, and so makes the pool again, at its next
    renewal. Stop the holders first. Through --broker-url it needs an admin token
    (GPULOCK_TOKEN).
    """
    t = target(ctx)
    try:
        r = _delete(t, name, force)
    except GpuLockError as e:
        error_exit(e, t, name, admin=True)
    if r.state == "missing":
        error_exit(PoolNotFound(name), t, name)
    if r.state == "in_use":
        fail(
            EXIT_TEMPFAIL,
            f"pool {name!r} in {t.describe()} is in use: {r.leases} lease(s) held, {r.waiters} "
            f"request(s) waiting; nothing was deleted (give --force to delete it anyway)",
        )
    extra = (
        f" ({r.leases} lease(s) and {r.waiters} waiter(s) dropped)"
        if (r.leases or r.waiters)
        else ""
    )
    print(f"pool {name} deleted{extra}")


def _delete(t: Target, name: str, force: bool) -> DeleteResult:
    if t.is_broker:
        from ._cli_broker import BrokerAdmin

        b = BrokerAdmin(t.url)
        try:
            return b.delete_pool(name, force=force)
        finally:
            b.close()
    from ._admin import delete_pool

    client = redis_client(t.url)
    try:
        return delete_pool(client, name, force=force)
    finally:
        client.close()


# ---- status ------------------------------------------------------------------------------------
# Control characters of holder metadata (set by any client) shown as escapes: raw, an ANSI
# sequence would reach the terminal and a newline would break the table.
_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F]}


def _shown(value: Any) -> Any:
    """Holder metadata as table text (a ``rich.text.Text``): literal (no rich markup),
    control characters escaped."""
    from rich.text import Text

    return Text(str(value).translate(_CONTROLS))


def _print_status(console: Console, st: PoolStatus) -> None:
    from rich.table import Table

    pct = (100.0 * st.used / st.capacity) if st.capacity else 0.0
    console.print(
        f"pool [bold]{st.pool}[/bold]: capacity {format_size(st.capacity)}, used {format_size(st.used)} "
        f"({pct:.0f}%), free {format_size(st.free)}; {st.lease_count} lease(s), "
        f"{st.waiter_count} waiter(s), max_waiters {st.max_waiters}",
        highlight=False,
    )
    if st.policy != "fifo":  # FIFO, every pool's default, goes unsaid
        how = (
            ": while the head of the queue does not fit, later requests that fit are granted, "
            "for at most the window"
            if st.policy == "backfill"
            else ""
        )
        console.print(f"queue {policy_text(st.policy, st.backfill_window)}{how}", highlight=False)
    if st.grace_left > 0:
        console.print(
            f"grace period: Redis lost the pool's data; no new grants for {secs(st.grace_left)} "
            "more, while the leases held before are put back (docs/RELIABILITY.md)",
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
    if st.leases:
        t = Table(title=None, show_edge=False, pad_edge=False, box=None, header_style="bold")
        cols: tuple[tuple[str, dict[str, Any]], ...] = (
            ("lease", {}),
            ("amount", {"justify": "right"}),
            ("token", {"justify": "right"}),
            *((("tenant", {}),) if lease_tenants else ()),
            ("host", {}),
            ("pid", {"justify": "right"}),
            ("purpose", {"overflow": "fold"}),
            ("held", {"justify": "right"}),
            ("expires in", {"justify": "right"}),
        )
        for col, kw in cols:
            t.add_column(col, no_wrap=col != "purpose", **kw)
        for li in st.leases:
            h = li.holder
            t.add_row(
                li.lease_id[:8],
                format_size(li.amount),
                str(li.token),
                *((li.tenant or "-",) if lease_tenants else ()),
                _shown(h.get("host", "?")),
                _shown(h.get("pid", "?")),
                _shown(h.get("purpose", "")),
                secs(li.held_for),
                secs(li.expires_in),
            )
        console.print(t)
    if st.waiters:
        t = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
        cols = (
            ("position", {"justify": "right"}),
            ("amount", {"justify": "right"}),
            ("priority", {"justify": "right"}),
            *((("tenant", {}),) if waiter_tenants else ()),
            ("host", {}),
            ("pid", {"justify": "right"}),
            ("purpose", {"overflow": "fold"}),
            ("waited", {"justify": "right"}),
            ("request id", {}),
        )
        for col, kw in cols:
            t.add_column(col, no_wrap=col != "purpose", **kw)
        for w in st.waiters:
            h = w.holder
            t.add_row(
                str(w.position),
                format_size(w.amount),
                str(w.priority),
                *((w.tenant or "-",) if waiter_tenants else ()),
                _shown(h.get("host", "?")),
                _shown(h.get("pid", "?")),
                _shown(h.get("purpose", "")),
                secs(w.waited),
                w.request_id[:12],
            )
        console.print(t)
    if st.lease_count > len(st.leases) or st.waiter_count > len(st.waiters):
        console.print(
            f"(listing first {len(st.leases)} leases and {len(st.waiters)} waiters)",
            highlight=False,
        )


def status(
    ctx: typer.Context,
    name: Optional[str] = typer.Argument(
        None, metavar="[NAME]", callback=pool_name_param, help="Pool to show (default: every pool)."
    ),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="JSON for programs: amounts in bytes, times in seconds. One "
        "object for NAME, a list of objects without it.",
    ),
    limit: int = typer.Option(
        1000, "--limit", min=0, max=100000, help="Most leases and waiters to list per pool."
    ),
) -> None:
    """Show capacity, use, leases and waiters of one pool or of all pools (through Redis, or
    through --broker-url)."""
    from rich.console import Console

    t = target(ctx)
    try:
        statuses = _statuses(t, name, limit)
    except GpuLockError as e:
        error_exit(e, t, name or "")

    if as_json:
        out: Any = (
            _status_dict(statuses[0]) if name is not None else [_status_dict(s) for s in statuses]
        )
        print(json.dumps(out, indent=2))
        return
    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "200"))
    console = Console(file=sys.stdout, width=width, highlight=False)
    if not statuses:
        console.print(
            f"no pools in {safe_url(t.url)} (create one: gpulock pool set NAME --capacity SIZE)"
        )
        return
    for i, st in enumerate(statuses):
        if i:
            console.print()
        _print_status(console, st)
