"""What every ``gpulock`` command shares: exit codes, messages, option parsers, and the
backend a command talks to (a Redis URL, or a broker URL), chosen once and never swapped for a
default the user did not name."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional, Protocol, Sequence

import typer
from gpulock_common.errors import AuthError

from gpulock.errors import (
    AcquireTimeout,
    BackendUnavailable,
    CapacityExceeded,
    InvalidArgument,
    PoolNotFound,
    QueueFull,
)
from gpulock.units import format_size, is_index, parse_duration, parse_seconds, parse_size

if TYPE_CHECKING:
    import redis

    from gpulock.admin.listing import Unreachable

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

# Exit codes of gpulock itself (sysexits.h where one fits). ``gpulock run`` otherwise passes
# CMD's own exit status through, so a script that must tell them apart reads stderr.
EXIT_USAGE = 2  # bad option or value (click's code for usage errors); nothing was changed
EXIT_CAPACITY = 65  # EX_DATAERR: the amount is larger than the whole pool: no wait can end
EXIT_NO_POOL = 66  # EX_NOINPUT: the pool is not configured in Redis
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: Redis (or the broker) unreachable or not answering
EXIT_LEASE_LOST = 70  # EX_SOFTWARE: the lease was lost while CMD ran; CMD was stopped
EXIT_OVERUSE = 71  # gpulock run --enforce: CMD used more device memory than its lease; stopped
EXIT_TEMPFAIL = (
    75  # EX_TEMPFAIL: no lease within --timeout, the queue is full, or the pool is in use
)
EXIT_NOPERM = 77  # EX_NOPERM: the broker refused the token (bad, missing, or not allowed)
EXIT_ERROR = 1  # any other gpulock error
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127

EXIT_CODES_HELP = f"""\b
Exit codes of gpulock itself (gpulock run otherwise returns CMD's status):
  {EXIT_USAGE}   bad option or value (nothing was changed)
  {EXIT_CAPACITY}  amount larger than the pool's capacity or its tenant's quota (can never be granted)
  {EXIT_NO_POOL}  pool not configured
  {EXIT_UNAVAILABLE}  Redis or the broker unreachable; status, pool list, top without a name: a
      shard of a Redis Cluster did not answer (the pools of the others are listed)
  {EXIT_LEASE_LOST}  gpulock run: the lease was lost while CMD ran; CMD was stopped
  {EXIT_OVERUSE}  gpulock run --enforce: CMD used more device memory than its lease; CMD was stopped
  {EXIT_TEMPFAIL}  gpulock run: no lease within --timeout, or the pool's queue is full;
      gpulock pool delete: the pool has leases or waiters (give --force)
  {EXIT_NOPERM}  the broker refused the token (GPULOCK_TOKEN missing, wrong, or not allowed)
  {EXIT_ERROR}   any other error"""


def say(msg: str) -> None:
    """One line of gpulock's own output, to stderr (stdout belongs to data or to CMD)."""
    try:
        print(f"gpulock: {msg}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def fail(code: int, msg: str) -> NoReturn:
    say(f"error: {msg}")
    raise typer.Exit(code)


def safe_url(url: str) -> str:
    """The URL with any password masked, for messages."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def size_param(name: str, *, allow_zero: bool = False) -> Callable[[Optional[str]], Optional[int]]:
    def cb(value: Optional[str]) -> Optional[int]:
        if value is None:
            return None
        if allow_zero and value.strip() == "0":
            return 0
        try:
            return parse_size(value, name=name)
        except InvalidArgument as e:
            raise typer.BadParameter(str(e)) from None

    return cb


def priority_param(value: Optional[str]) -> int:
    """``--priority``: an integer in [-100, 100] (the vocabulary's parse of text, then the
    core's check, so a bad one is exit 2 naming it)."""
    from gpulock_common.options import parse_priority

    if value is None:
        return 0
    try:
        return parse_priority(value)
    except InvalidArgument as e:
        raise typer.BadParameter(str(e)) from None


def tenant_param(value: Optional[str]) -> Optional[str]:
    """``--tenant``: a tenant name, 1-64 of [A-Za-z0-9._:-] (the core's check, so a bad one is
    exit 2 naming it, as is an empty one: an unset variable in ``--tenant "$T"`` must not
    escape the quota); None when the flag is not given."""
    from gpulock.protocol.args import validate_tenant

    if value is not None and value.strip() == "":
        raise typer.BadParameter("an empty tenant; leave --tenant out for no tenant")
    try:
        return validate_tenant(value) or None
    except InvalidArgument as e:
        raise typer.BadParameter(str(e)) from None


def policy_param(value: Optional[str]) -> Optional[str]:
    """``--policy``: a pool's queue policy, one of ``POLICIES`` (the vocabulary's check, so a
    bad one is exit 2 naming it); None keeps the pool's."""
    from gpulock_common.options import check_policy

    try:
        return check_policy(value)
    except InvalidArgument as e:
        raise typer.BadParameter(str(e)) from None


def quota_param(values: Optional[list[str]]) -> Optional[dict[str, int]]:
    """``--quota TENANT=SIZE`` (repeatable): tenant quotas in bytes, 0 for a SIZE of 0 or
    "none" (removes that tenant's quota). A bad tenant or size is exit 2 naming it; None when
    the flag is not given (the pool keeps its quotas)."""
    if not values:
        return None
    from gpulock.protocol.args import decode_quotas, encode_quotas

    out: dict[str, int | str | None] = {}
    for v in values:
        tenant, eq, size = v.partition("=")
        if not eq or not tenant:
            raise typer.BadParameter(
                f"takes TENANT=SIZE (e.g. alice=8GiB), got {v!r:.80}", param_hint="--quota"
            )
        if tenant in out:
            raise typer.BadParameter(f"tenant {tenant!r} is given twice", param_hint="--quota")
        out[tenant] = size  # "0" or "none" removes it (encode_quotas)
    try:
        return decode_quotas(encode_quotas(out))  # the core's check names a bad tenant or size
    except InvalidArgument as e:
        raise typer.BadParameter(str(e), param_hint="--quota") from None


def devices_param(
    value: Optional[str], capacity: Optional[str], utilization: Optional[float] = None
) -> Optional[list[int]]:
    """``--devices N`` (N devices of ``--capacity`` each), ``--devices SIZE,SIZE,...`` or
    ``--devices auto`` (each GPU the device reader sees, NVML or ``$GPULOCK_FAKE_DEVICES``,
    its total memory x ``utilization``, default 0.9): each device's capacity in bytes; None
    when not given. Exit 2 naming a bad value, a reader that sees no device, or a
    ``utilization`` given without ``auto`` (it would change nothing)."""
    v = (value or "").strip()
    if utilization is not None and v.lower() != "auto":
        raise typer.BadParameter(
            f"{utilization:g} applies only with --devices auto (each GPU's memory x it); "
            + ("--devices is not given" if value is None else f"--devices is {v!r:.80}"),
            param_hint="--utilization",
        )
    if value is None:
        return None
    from gpulock.protocol.args import encode_devices

    if v.lower() == "auto":
        utilization = 0.9 if utilization is None else utilization
        if capacity is not None:
            raise typer.BadParameter(
                "--devices auto takes each GPU's memory; leave --capacity out",
                param_hint="--devices",
            )
        from gpulock.devices import DeviceError, open_reader, read_all

        try:
            return [max(1, int(d.total_bytes * utilization)) for d in read_all(open_reader("auto"))]
        except (DeviceError, ValueError) as e:
            raise typer.BadParameter(
                f"auto: cannot read the GPUs: {e}", param_hint="--devices"
            ) from None
    spec: int | list[str] = int(v) if is_index(v) else [x.strip() for x in v.split(",")]
    if isinstance(spec, int) and capacity is None:
        raise typer.BadParameter(
            f"--devices {v} needs --capacity (each device's capacity), or give each device's "
            "capacity: --devices 80GiB,80GiB",
            param_hint="--devices",
        )
    try:
        _, caps = encode_devices(spec, capacity if isinstance(spec, int) else None)
    except InvalidArgument as e:
        raise typer.BadParameter(
            f"{e} (--devices takes a count N, sizes SIZE,SIZE,... or auto)", param_hint="--devices"
        ) from None
    if isinstance(spec, list) and capacity is not None:
        raise typer.BadParameter(
            "with each device's capacity, leave --capacity out (the pool's is their sum)",
            param_hint="--devices",
        )
    return [int(c) for c in caps.split()]


def seconds_param(
    name: str, *, minimum: float, maximum: float, allow_zero: bool = False
) -> Callable[[Optional[float]], Optional[float]]:
    def cb(value: Optional[float]) -> Optional[float]:
        if value is None:
            return None
        try:
            return parse_seconds(
                value, name=name, minimum=minimum, maximum=maximum, allow_zero=allow_zero
            )
        except InvalidArgument as e:
            raise typer.BadParameter(str(e)) from None

    return cb


def seconds_text_param(name: str, *, minimum: float, maximum: float) -> Callable[[str], float]:
    """A ``parser=`` for an option of seconds: the text as given, so a bad one, a number or
    not, is exit 2 naming it (a float option's own message does not name what it got)."""

    def parse(value: str) -> float:
        try:
            return parse_seconds(value, name=name, minimum=minimum, maximum=maximum)
        except InvalidArgument as e:
            raise typer.BadParameter(str(e)) from None

    return parse


def duration_text_param(name: str, *, minimum: float, maximum: float) -> Callable[[str], float]:
    """A ``parser=`` for an option of a duration (``30s``, ``500ms``, ``2m``; a bare number is
    seconds: :func:`gpulock.units.parse_duration`), as seconds: a bad one is exit 2 naming it."""

    def parse(value: str) -> float:
        try:
            return parse_duration(value, name=name, minimum=minimum, maximum=maximum)
        except InvalidArgument as e:
            raise typer.BadParameter(str(e)) from None

    return parse


_INTEGER_TEXT = re.compile(r"[+-]?[0-9]{1,20}")


def int_text_param(name: str, *, minimum: int, maximum: int) -> Callable[[str], int]:
    """A ``parser=`` for an integer option in [minimum, maximum]: the text as given, so a bad
    one, a number or not, is exit 2 naming it (an int option's own message does not name what
    it got)."""

    def parse(value: str) -> int:
        text = value.strip()
        if not (text.isascii() and _INTEGER_TEXT.fullmatch(text)) or not (
            minimum <= int(text) <= maximum
        ):
            raise typer.BadParameter(
                f"{name} must be an integer in [{minimum}, {maximum}], got {value!r:.80}"
            )
        return int(text)

    return parse


def number_text_param(name: str, *, minimum: float, maximum: float) -> Callable[[str], float]:
    """A ``parser=`` for a number option in [minimum, maximum]: the text as given, so a bad
    one (not a number, NaN, out of range) is exit 2 naming it."""

    def parse(value: str) -> float:
        try:
            f = float(value) if value.strip().isascii() else float("nan")
        except ValueError:
            f = float("nan")
        if not minimum <= f <= maximum:  # NaN too
            raise typer.BadParameter(
                f"{name} must be a number between {minimum:g} and {maximum:g}, got {value!r:.80}"
            )
        return f

    return parse


def pool_name_param(value: Optional[str]) -> Optional[str]:
    if value is None:
        return None
    from gpulock.protocol.args import validate_pool_name

    try:
        return validate_pool_name(value)
    except InvalidArgument as e:
        raise typer.BadParameter(str(e)) from None


def pool_target_param(value: Optional[str]) -> Optional[str]:
    """``--pool NAME`` or ``NAME/D`` (device D of a pool of several devices): checked here,
    split by :func:`split_pool_target`."""
    if value is None:
        return None
    split_pool_target(value)
    return value


def split_pool_target(value: str) -> tuple[str, Optional[int]]:
    """``NAME`` -> (NAME, None); ``NAME/D`` -> (NAME, D), D a device index. Raises
    typer.BadParameter naming the bad part."""
    name, sep, dev = value.partition("/")
    name = pool_name_param(name) or ""
    if not sep:
        return name, None
    from gpulock.protocol.args import MAX_DEVICES

    if not is_index(dev) or not 0 <= int(dev) < MAX_DEVICES:
        raise typer.BadParameter(
            f"NAME/DEVICE: the device must be an index 0..{MAX_DEVICES - 1}, got {dev!r}"
        )
    return name, int(dev)


def secs(x: float) -> str:
    if x < 0:
        return "expired"
    if x < 60:
        return f"{x:.1f}s"
    if x < 3600:
        return f"{int(x // 60)}m{int(x % 60):02d}s"
    return f"{int(x // 3600)}h{int(x % 3600 // 60):02d}m"


def wait_text(estimated_wait: float | None) -> str:
    """A waiter's estimated wait (seconds; docs/SEMANTICS.md, "Wait estimate") as a table
    shows it: ``~3.2s``, ``~4m10s``; ``—`` when not known (the pool's drain rate is not
    measured yet)."""
    return "—" if estimated_wait is None else f"~{secs(max(0.0, estimated_wait))}"


def drain_text(bytes_per_s: float | None, grants_per_s: float | None) -> str:
    """A pool's drain rate (docs/SEMANTICS.md, "Wait estimate") in words: ``drains 1.5GiB/s,
    2.40 grants/s``, or ``drain rate not measured yet``."""
    if bytes_per_s is None or grants_per_s is None:
        return "drain rate not measured yet"
    return f"drains {format_size(int(bytes_per_s))}/s, {grants_per_s:.2f} grants/s"


# ---- the backend --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """Where a command goes: ``kind`` is ``"redis"`` or ``"broker"``."""

    kind: str
    url: str

    @property
    def is_broker(self) -> bool:
        return self.kind == "broker"

    def describe(self) -> str:
        return f"{'broker' if self.is_broker else 'Redis'} at {safe_url(self.url)}"


class RunLease(Protocol):
    """The lease ``gpulock run`` holds while CMD runs: the core's :class:`gpulock.Lease`, or a
    lease through a broker (``cli.broker.BrokerLease``). Errors are the core's exceptions."""

    @property
    def id(self) -> str: ...

    @property
    def token(self) -> int: ...

    @property
    def device(self) -> int:
        """The pool's device the lease is on (0 on a pool of one device)."""
        ...

    @property
    def valid_until(self) -> float:
        """Local ``time.monotonic()`` instant after which the lease counts as lost."""
        ...

    @property
    def yield_deadline(self) -> float | None:
        """None until the server asked the holder to yield the lease (preemption); then the
        local ``time.monotonic()`` instant by which it takes the bytes back at the latest."""
        ...

    def on_lost(self, callback: Callable[[Any], Any]) -> None: ...

    def on_yield(self, callback: Callable[[Any], Any]) -> None:
        """``callback(lease)`` once when the holder learns it is asked to yield the lease."""
        ...

    def ensure_valid(self) -> None: ...

    def release(self) -> None: ...


class RunPool(Protocol):
    """The pool ``gpulock run`` leases from: the core's :class:`gpulock.Pool` (Redis), or
    ``cli.broker.BrokerPool`` (a broker, through the gpulock-client SDK). ``amount`` in
    bytes, ``ttl``/``timeout`` in seconds, ``priority`` in [-100, 100] (higher first),
    ``tenant`` the tenant the lease counts under (None: none; a broker takes it from the
    token, so its pool refuses one), ``device`` the device it must be on (None: the pool
    places it), ``preemptible`` False for a lease the server never asks to yield; errors are the core's exceptions. ``grace_left()``: seconds left in the pool's
    restart grace period as last seen (0: none)."""

    def acquire(
        self,
        amount: int,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        holder: dict[str, Any] | None = None,
        on_queued: Callable[[int], Any] | None = None,
        priority: int = 0,
        tenant: str | None = None,
        device: int | None = None,
        preemptible: bool = True,
    ) -> RunLease: ...

    def grace_left(self) -> float: ...

    def close(self) -> None: ...


def check_redis_url(url: str) -> str:
    """Usage error (exit 2) for a URL the core cannot parse (an unknown scheme, a bad port):
    the core's own parser decides, with no I/O."""
    from gpulock.transport.connect import check_url

    try:
        check_url(url)
    except ValueError as e:  # InvalidArgument is a ValueError too
        fail(EXIT_USAGE, f"bad Redis URL {safe_url(url)!r}: {e}")
    return url


def check_broker_url(url: str) -> str:
    from urllib.parse import urlsplit

    try:
        p = urlsplit(url)
        ok = p.scheme in ("http", "https") and bool(p.hostname)
        p.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        ok = False
    if not ok:
        fail(
            EXIT_USAGE,
            f"bad broker URL {safe_url(url)!r}: expected http://HOST:PORT or https://HOST:PORT "
            f"(a Redis URL goes in --redis-url)",
        )
    return url


def target(ctx: typer.Context) -> Target:
    """The backend of this command, validated (exit 2 for a malformed URL)."""
    obj = ctx.find_root().obj or {}
    t: Target = obj.get("target") or Target("redis", DEFAULT_REDIS_URL)
    if t.is_broker:
        check_broker_url(t.url)
    else:
        check_redis_url(t.url)
    return t


def redis_client(url: str, *, ping_cluster: bool = True) -> redis.Redis:
    """A client that has answered one PING. A Redis that is down when a command starts fails
    the command at once (exit 69) instead of after the library's retry bound (meant for blips
    in a long-running process). ``ping_cluster=False``: a cluster client is not pinged (the
    listings, which name a shard that is down instead of failing): making it read the slot
    map from a seed already, and redis-py sends PING to one node, which may be the one down."""
    import redis

    from gpulock._async import _CLIENT_DEFAULTS
    from gpulock.transport.connect import short_error, sync_client

    from gpulock.errors import BackendUnavailable

    try:
        c = sync_client(url, **dict[str, Any](_CLIENT_DEFAULTS))
    except ValueError as e:  # a malformed URL
        fail(EXIT_USAGE, f"bad Redis URL {safe_url(url)!r}: {e}")
    except BackendUnavailable as e:  # a cluster none of whose seeds answered
        fail(EXIT_UNAVAILABLE, str(e))
    from gpulock.transport.cluster import is_cluster_client

    if not ping_cluster and is_cluster_client(c):
        return c
    try:
        c.ping()
    except redis.RedisError as e:
        c.close()
        fail(EXIT_UNAVAILABLE, f"Redis at {safe_url(url)} is unavailable: {short_error(e)}")
    return c


def partial_exit(t: Target, unreachable: Sequence[Unreachable]) -> NoReturn:
    """A listing printed only the pools of the shards that answered: name the others on stderr
    and exit 69 (EX_UNAVAILABLE: part of the backend is unavailable; the data printed is
    what the rest holds)."""
    fail(
        EXIT_UNAVAILABLE,
        f"partial answer from {t.describe()}: {len(unreachable)} shard(s) of the cluster could "
        "not be read, their pools are not listed: " + "; ".join(u.describe() for u in unreachable),
    )


def error_exit(e: BaseException, t: Target, pool: str = "", *, admin: bool = False) -> NoReturn:
    """Map a gpulock error to one clear line on stderr and its exit code, in the words of the
    command line (seconds, option names) and naming the backend it looked at. ``admin``: the
    command needs an admin token through a broker (pool set, pool delete)."""
    where = t.describe()
    if isinstance(e, PoolNotFound):
        name = getattr(e, "pool", "") or pool
        opt = f"--broker-url {safe_url(t.url)}" if t.is_broker else f"--redis-url {safe_url(t.url)}"
        fail(
            EXIT_NO_POOL,
            f"pool {name!r} is not configured in {where} (never set up, or Redis restarted "
            f"without its data); create it: gpulock {opt} pool set {name} --capacity SIZE",
        )
    if isinstance(e, CapacityExceeded):
        fail(EXIT_CAPACITY, f"{e}; the request can never be granted")
    if isinstance(e, AuthError):  # the broker refused the token (HTTP 401/403)
        hint = "" if os.environ.get("GPULOCK_TOKEN") else " (GPULOCK_TOKEN is not set)"
        if admin:
            fail(
                EXIT_NOPERM,
                f"{where} refused the token{hint}: {e}; this command needs an admin token: set "
                f'GPULOCK_TOKEN to one the broker\'s tokens file marks "admin": true',
            )
        fail(
            EXIT_NOPERM,
            f"{where} refused the token{hint}: {e}; set GPULOCK_TOKEN to a token the broker's "
            f"tokens file lists for this pool",
        )
    if isinstance(e, BackendUnavailable):
        fail(EXIT_UNAVAILABLE, f"{where} is unavailable: {e.__cause__ or e}")
    if isinstance(e, (AcquireTimeout, QueueFull)):
        fail(EXIT_TEMPFAIL, str(e))
    if isinstance(e, InvalidArgument):
        from gpulock.transport.translate import TTL_OVER_MAX

        m = TTL_OVER_MAX.search(str(e))
        if m:
            ttl, mx = float(m.group(1)), float(m.group(2))
            name = pool or "NAME"
            fail(
                EXIT_USAGE,
                f"--ttl {ttl:g} is longer than pool {name!r} allows: its max ttl is {mx:g} s; give "
                f"--ttl {mx:g} or less, or raise the bound: gpulock pool set {name} --max-ttl {ttl:g}",
            )
        fail(EXIT_USAGE, str(e))
    fail(EXIT_ERROR, str(e))
