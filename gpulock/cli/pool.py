"""``gpulock status`` and ``gpulock pool set|list|delete``: each goes to the backend the user
named, ``--redis-url`` or ``--broker-url`` (the broker's ``/v1/pools`` routes; ``pool set`` and
``pool delete`` need an admin token there)."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any, Optional

import typer

from gpulock_common.options import (
    DEFAULT_PLACEMENT,
    DEFAULT_YIELD_GRACE_S,
    PoolSettings,
    MAX_BACKFILL_WINDOW_S,
    MAX_MAX_WAITERS,
    MAX_TTL_S,
    MIN_BACKFILL_WINDOW_S,
    MIN_MAX_WAITERS,
    MAX_YIELD_GRACE_S,
    MIN_TTL_S,
    MIN_YIELD_GRACE_S,
    PLACEMENTS,
    POLICIES,
    PREEMPT_GAP_MAX,
    PREEMPT_GAP_MIN,
    Preemption,
)

from gpulock.cli.common import (
    EXIT_TEMPFAIL,
    Target,
    error_exit,
    fail,
    int_text_param,
    number_text_param,
    partial_exit,
    policy_param,
    pool_name_param,
    devices_param,
    duration_text_param,
    quota_param,
    redis_client,
    safe_url,
    say,
    seconds_param,
    seconds_text_param,
    size_param,
    target,
)
from gpulock.admin.pools import DeleteResult
from gpulock.cli.show import (
    devices_text,
    policy_text,
    preemption_text,
    print_status,
    quota_text,
)
from gpulock.errors import BackendUnavailable, GpuLockError, PoolNotFound
from gpulock.units import format_size

if TYPE_CHECKING:
    from gpulock import PoolStatus
    from gpulock.cli.broker import BrokerAdmin
    from gpulock.admin.listing import Unreachable

pool_app = typer.Typer(
    help="Create, list, change and delete pools.",
    no_args_is_help=True,
    rich_markup_mode=None,
    add_completion=False,
)


def _status_dict(st: PoolStatus) -> dict[str, Any]:
    """A status as ``--json`` prints it: PoolStatus's fields, ``free`` and
    ``effective_capacity``; each waiter's estimate as ``estimated_wait_s`` (seconds, null while
    the pool's drain rate is not measured) and ``drain`` ``{bytes_per_s, grants_per_s}`` or
    null (docs/SEMANTICS.md, "Wait estimate")."""
    d = st.to_dict()
    d["free"] = st.free
    d["effective_capacity"] = st.effective_capacity
    for w in d["waiters"]:
        w["estimated_wait_s"] = w.pop("estimated_wait")
    return d


def _status(t: Target, name: str, limit: int) -> PoolStatus:
    """The status of pool ``name`` from the backend."""
    if t.is_broker:
        from gpulock.cli.broker import BrokerAdmin, status_from_dict

        b = BrokerAdmin(t.url)
        try:
            st: PoolStatus = status_from_dict(b.call("GET", f"/v1/pools/{name}", name))
            return st
        finally:
            b.close()
    from gpulock._sync import Pool

    client = redis_client(t.url)
    try:
        return Pool(client, name).status(limit=limit)
    finally:
        client.close()


def _every_status(t: Target, limit: int) -> tuple[list[PoolStatus], list[Unreachable]]:
    """The status of every pool (sorted by name) the backend could read, and the shards of a
    Redis Cluster it could not (their pools are left out; docs/CLUSTER.md, "Listing while a
    shard is down"). Raises the core's errors when nothing could be read."""
    from gpulock.admin.listing import Unreachable

    if t.is_broker:
        from gpulock.cli.broker import BrokerAdmin, status_from_dict

        b = BrokerAdmin(t.url)
        try:
            r = b.call("GET", "/v1/pools")
        finally:
            b.close()
        # a broker older than partial answers sends no "unreachable"
        shards = [Unreachable.from_dict(u) for u in r.get("unreachable") or ()]
        return [status_from_dict(d) for d in r["pools"]], shards
    from gpulock.transport.cluster import is_cluster_url
    from gpulock.admin.listing import answering_url, list_pools, list_seeds, steer
    from gpulock._sync import Pool
    from gpulock.transport.translate import translate

    if is_cluster_url(t.url):
        # asked of the seeds first: the client then starts on the seeds that answered
        # (redis-py's asks them in random order and waits its socket timeout on a hung one)
        try:
            listing = list_seeds(t.url)
        except Exception as e:  # noqa: BLE001 - translated to gpulock's tree
            raise translate(e, "*") from e
        client = redis_client(answering_url(t.url, listing), ping_cluster=False)
        steer(client, listing)
    else:  # a lone server, or a plain URL of a cluster node
        client = redis_client(t.url, ping_cluster=False)
        try:
            listing = list_pools(client)
        except Exception as e:  # noqa: BLE001 - translated to gpulock's tree
            client.close()
            raise translate(e, "*") from e
    try:
        out = []
        for n in listing.names:
            try:
                out.append(Pool(client, n).status(limit=limit))
            except PoolNotFound:
                pass  # deleted between the scan and now
            except BackendUnavailable as e:
                listing.lost(n, e)  # its shard went away since the listing
        return out, listing.unreachable
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
        "keep the current value; a new pool needs it). On a pool of several devices: each "
        "device's capacity.",
    ),
    max_waiters: Optional[int] = typer.Option(
        None,
        "--max-waiters",
        metavar="N",
        # parsed from the text, so a bad value, a number or not, is named
        parser=int_text_param("--max-waiters", minimum=MIN_MAX_WAITERS, maximum=MAX_MAX_WAITERS),
        help=f"Most requests that may queue, {MIN_MAX_WAITERS} to {MAX_MAX_WAITERS} (default: "
        "keep the current value; 10000 for a new pool).",
    ),
    max_ttl: Optional[float] = typer.Option(
        None,
        "--max-ttl",
        callback=seconds_param("--max-ttl", minimum=MIN_TTL_S, maximum=MAX_TTL_S),
        help="Longest lease ttl the pool accepts, seconds; also the grace period after Redis "
        "restarts without data (default: keep the current value; 60 for a new pool).",
    ),
    policy: Optional[str] = typer.Option(
        None,
        "--policy",
        metavar="|".join(POLICIES),
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
        parser=seconds_text_param(
            "--backfill-window", minimum=MIN_BACKFILL_WINDOW_S, maximum=MAX_BACKFILL_WINDOW_S
        ),
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
    devices: Optional[str] = typer.Option(
        None,
        "--devices",
        metavar="N|SIZE,SIZE,...|auto",
        help="The pool's devices (GPUs): a count N (each of --capacity), each device's "
        "capacity (80GiB,80GiB,40GiB), or auto: each GPU NVML sees (or $GPULOCK_FAKE_DEVICES "
        "lists), its memory x --utilization (device D is GPU D as nvidia-smi numbers them). A lease is placed on one device "
        "(docs/SEMANTICS.md, 'Devices and placement'). The count changes only while the "
        "pool has no lease and no waiter.",
    ),
    utilization: Optional[float] = typer.Option(
        None,
        "--utilization",
        metavar="FRACTION",
        parser=number_text_param("--utilization", minimum=0.01, maximum=1.0),
        help="--devices auto: the share of each GPU's memory its device gets, 0.01 to 1 (default 0.9). "
        "Only with --devices auto.",
    ),
    placement: Optional[str] = typer.Option(
        None,
        "--placement",
        metavar="|".join(PLACEMENTS),
        help="How a request without a device is placed: bestfit (the device with the least "
        "free bytes that fits it: keeps large holes for large requests) or spread (the most "
        "free). Default: keep the current one; bestfit for a new pool.",
    ),
    preempt_gap: Optional[int] = typer.Option(
        None,
        "--preempt-gap",
        metavar="N",
        parser=int_text_param("--preempt-gap", minimum=PREEMPT_GAP_MIN, maximum=PREEMPT_GAP_MAX),
        help=f"Turn preemption on: a queued request at the head that does not fit asks holders "
        f"N or more priority levels below it to yield, {PREEMPT_GAP_MIN} to {PREEMPT_GAP_MAX} "
        "(docs/SEMANTICS.md, 'Preemption'). Default: keep the current setting; off for a new "
        "pool.",
    ),
    yield_grace: Optional[float] = typer.Option(
        None,
        "--yield-grace",
        metavar="DURATION",
        parser=duration_text_param(
            "--yield-grace", minimum=MIN_YIELD_GRACE_S, maximum=MAX_YIELD_GRACE_S
        ),
        help="With --preempt-gap: how long an asked lease has to release before the pool takes "
        f"it back, e.g. 30s, 500ms, 2m (a bare number: seconds; default "
        f"{DEFAULT_YIELD_GRACE_S:g}s).",
    ),
    no_preempt: bool = typer.Option(False, "--no-preempt", help="Turn preemption off."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Create pool NAME (--capacity or --devices needed), or change its capacity, queue bound, max ttl,
    queue policy, tenant quotas, devices or preemption (what is not given keeps its value).

    Lowering the capacity below what is in use is allowed: leases keep their bytes and nothing
    new is granted until enough is released. Raising it grants waiters that now fit. Through
    --broker-url it needs an admin token (GPULOCK_TOKEN).
    """
    t = target(ctx)
    # parsed here, not in a callback: typer hands a list option's callback result back as a list
    quotas = quota_param(quota)
    devs = devices_param(devices, capacity, utilization)
    if placement is not None and placement not in PLACEMENTS:
        raise typer.BadParameter(
            f"must be {' or '.join(PLACEMENTS)}, got {placement!r:.80}", param_hint="--placement"
        )
    settings = PoolSettings(
        None if capacity is None else int(capacity),
        max_waiters,
        max_ttl,
        policy,
        backfill_window,
        quotas,
        devs,
        placement,
        _preemption_param(preempt_gap, yield_grace, no_preempt),
    )
    try:
        if t.is_broker:
            from gpulock.cli.broker import BrokerAdmin

            b = BrokerAdmin(t.url)
            try:
                r = b.call("PUT", f"/v1/pools/{name}", name, _broker_body(b, name, settings))
            finally:
                b.close()
        else:
            r = _configure_redis(t.url, name, settings)
    except GpuLockError as e:
        error_exit(e, t, name, admin=True)
    if backfill_window is not None and r.get("policy") == "fifo":
        say(
            "note: the backfill window is stored but has no effect under policy fifo; it "
            "applies once the pool's policy is backfill (--policy backfill)"
        )
    if placement is not None and len(r.get("devices") or []) <= 1:
        say(
            "note: the placement is stored but has no effect on a pool of one device; it "
            "applies once the pool has several (--devices)"
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
        + (
            f", devices {devices_text(r['devices'])} (placement {r.get('placement', DEFAULT_PLACEMENT)})"
            if len(r.get("devices") or []) > 1
            else ""
        )
        # preemption: said when on, or when this command set it
        + (
            f", {preemption_text(r.get('preemption'))}"
            if r.get("preemption") or settings.preemption is not None
            else ""
        )
    )
    if r["used"] > r["capacity"]:
        print(
            f"gpulock: note: {format_size(r['used'] - r['capacity'])} more than the new capacity "
            "is leased now; those leases keep their bytes, and nothing new is granted until "
            "releases bring use under the capacity",
            file=sys.stderr,
        )


def _preemption_param(
    gap: Optional[int], grace: Optional[float], off: bool
) -> Optional[Preemption | bool]:
    """``pool set``'s preemption options as ``configure``'s ``preemption``: None (not given),
    False (--no-preempt) or a Preemption (--preempt-gap, with --yield-grace or its default).
    Exit 2 naming the options given together that cannot be."""
    if off and (gap is not None or grace is not None):
        raise typer.BadParameter(
            "--no-preempt turns preemption off: give it without --preempt-gap/--yield-grace",
            param_hint="--no-preempt",
        )
    if gap is None:
        if grace is not None:
            raise typer.BadParameter(
                f"--yield-grace {grace:g}s needs --preempt-gap N (preemption is on with a gap)",
                param_hint="--yield-grace",
            )
        return False if off else None
    return Preemption(gap, DEFAULT_YIELD_GRACE_S if grace is None else grace)


def _each_device(capacity: int, count: int) -> Optional[list[int]]:
    """``--capacity`` alone on a pool of ``count`` devices: it is each device's capacity, so
    the devices it sets (None on a pool of one device, whose capacity it is)."""
    return [capacity] * count if count > 1 else None


def _broker_body(b: BrokerAdmin, name: str, s: PoolSettings) -> dict[str, Any]:
    """The broker's PUT body for ``s``. The PUT needs a capacity: the devices' sum; else the
    one given, each device's on a pool of several; else the pool's own (a pool that does not
    exist is a 404 here, PoolNotFound: exit 66 saying to give --capacity)."""
    if s.devices is not None:
        s = s._replace(capacity=sum(_ints(s.devices)))
    elif s.capacity is None:
        s = s._replace(capacity=b.call("GET", f"/v1/pools/{name}", name)["capacity"])
    else:
        try:
            have = b.call("GET", f"/v1/pools/{name}", name).get("devices") or []
        except PoolNotFound:
            have = []  # a new pool, of one device
        each = _each_device(int(s.capacity), len(have))
        if each is not None:
            s = s._replace(devices=each, capacity=sum(each))
    return s.given()


def _ints(devices: Any) -> list[int]:
    """``--devices``' capacities (``devices_param`` gives bytes)."""
    return [int(c) for c in devices]


def _configure_redis(url: str, name: str, s: PoolSettings) -> dict[str, Any]:
    """``pool set`` on Redis: what ``s`` leaves out (None) is the pool's own, read first (a
    new pool needs a capacity or devices: PoolNotFound otherwise); ``--capacity`` alone on a
    pool of several devices is each device's."""
    from gpulock._sync import Pool

    client = redis_client(url)
    try:
        pool = Pool(client, name)
        try:
            st = pool.status(limit=0)
            if s.devices is None and s.capacity is not None:
                s = s._replace(devices=_each_device(int(s.capacity), len(st.devices)))
            s = s._replace(
                capacity=st.capacity if s.capacity is None else s.capacity,
                max_waiters=st.max_waiters if s.max_waiters is None else s.max_waiters,
                max_ttl=st.max_ttl if s.max_ttl is None and st.max_ttl else s.max_ttl,
            )
        except PoolNotFound:
            if s.capacity is None and s.devices is None:  # nothing to keep: needs --capacity
                raise
        if s.devices is not None:
            s = s._replace(capacity=None)
        # the others: None leaves each as the pool has it (configure.lua keeps them)
        return pool.configure(**s._asdict())
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
    """List the pools (one line each: name, capacity, use and its kept bytes, leases, waiters).

    On a Redis Cluster with a shard down, the pools of the other shards are listed, the shards
    that did not answer are named on stderr, and the exit status is 69; --json then prints
    {"pools": [...], "unreachable": [{"node", "slots", "error"}, ...]} instead of the list.
    """
    t = target(ctx)
    try:
        statuses, shards = _every_status(t, 0)
    except GpuLockError as e:
        error_exit(e, t)
    if as_json:
        out = []
        for s in statuses:
            d = _status_dict(s)
            d.pop("leases", None)
            d.pop("waiters", None)
            out.append(d)
        print(json.dumps(_listing_json(out, shards), indent=2))
    elif not statuses and not shards:
        say(f"no pools in {t.describe()} (create one: gpulock pool set NAME --capacity SIZE)")
    elif statuses:
        w = max(len(s.pool) for s in statuses)
        for s in statuses:
            pct = (100.0 * s.used / s.capacity) if s.capacity else 0.0
            kept = f", {format_size(s.kept_bytes)} kept" if s.kept_leases else ""  # part of used
            print(
                f"{s.pool:<{w}}  capacity {format_size(s.capacity)}  used {format_size(s.used)} ({pct:.0f}%{kept})  "
                f"{s.lease_count} lease(s)  {s.waiter_count} waiter(s)"
            )
    if shards:
        sys.stdout.flush()
        partial_exit(t, shards)


def _listing_json(pools: list[dict[str, Any]], shards: list[Unreachable]) -> Any:
    """A listing's JSON: the list of pools (unchanged for a complete answer), or, when shards
    of a cluster could not be read, ``{"pools": [...], "unreachable": [...]}``."""
    if not shards:
        return pools
    return {"pools": pools, "unreachable": [u.to_dict() for u in shards]}


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
    if r.leases:
        say(
            "note: a holder still running puts its lease back, and so makes the pool again, "
            "at its next renewal (as after a Redis restart without data): stop the holders "
            "for the pool to stay deleted"
        )


def _delete(t: Target, name: str, force: bool) -> DeleteResult:
    if t.is_broker:
        from gpulock.cli.broker import BrokerAdmin

        b = BrokerAdmin(t.url)
        try:
            return b.delete_pool(name, force=force)
        finally:
            b.close()
    from gpulock.admin.pools import delete_pool

    client = redis_client(t.url)
    try:
        return delete_pool(client, name, force=force)
    finally:
        client.close()


# ---- status ------------------------------------------------------------------------------------
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
    through --broker-url).

    Without NAME on a Redis Cluster with a shard down: the pools of the other shards, the
    shards that did not answer named on stderr, exit status 69; --json then prints
    {"pools": [...], "unreachable": [{"node", "slots", "error"}, ...]} instead of the list.
    """
    from rich.console import Console

    t = target(ctx)
    shards: list[Unreachable] = []
    try:
        if name is not None:
            statuses = [_status(t, name, limit)]
        else:
            statuses, shards = _every_status(t, limit)
    except GpuLockError as e:
        error_exit(e, t, name or "")

    if as_json:
        if name is not None:
            print(json.dumps(_status_dict(statuses[0]), indent=2))
            return
        print(json.dumps(_listing_json([_status_dict(s) for s in statuses], shards), indent=2))
    else:
        width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "200"))
        console = Console(file=sys.stdout, width=width, highlight=False)
        if not statuses and not shards:
            console.print(
                f"no pools in {safe_url(t.url)} (create one: gpulock pool set NAME --capacity SIZE)"
            )
        for i, st in enumerate(statuses):
            if i:
                console.print()
            print_status(console, st)
    if shards:
        sys.stdout.flush()
        partial_exit(t, shards)
