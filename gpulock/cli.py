"""The ``gpulock`` command line: configure pools, show their status, and run any command under
a lease (``flock(1)`` for GPU memory).

Every command reads the Redis URL from ``--redis-url`` or ``GPULOCK_REDIS_URL``. gpulock's own
messages go to stderr; stdout carries only data (``status``, ``pool set``) or, for
``gpulock run``, only CMD's output.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import sys
import threading
import time
from typing import Any, NoReturn, Optional

import typer

from . import __version__
from .errors import (
    AcquireTimeout,
    BackendUnavailable,
    CapacityExceeded,
    GpuLockError,
    InvalidArgument,
    LeaseLost,
    PoolNotFound,
    QueueFull,
)
from .units import format_size, parse_seconds, parse_size

__all__ = ["app", "main"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_RUN_TTL_S = 30.0
DEFAULT_GRACE_S = 10.0

# Exit codes of gpulock itself (sysexits.h where one fits). ``gpulock run`` otherwise passes
# CMD's own exit status through, so a script that must tell them apart reads stderr.
EXIT_USAGE = 2  # bad option or value (click's code for usage errors); nothing was changed
EXIT_CAPACITY = 65  # EX_DATAERR: the amount is larger than the whole pool: no wait can end
EXIT_NO_POOL = 66  # EX_NOINPUT: the pool is not configured in Redis
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: Redis unreachable or not answering
EXIT_LEASE_LOST = 70  # EX_SOFTWARE: the lease was lost while CMD ran; CMD was stopped
EXIT_TEMPFAIL = 75  # EX_TEMPFAIL: no lease within --timeout, or the pool's queue is full
EXIT_ERROR = 1  # any other gpulock error
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127

# Signals `gpulock run` passes on to CMD's process group while CMD runs.
FORWARDED_SIGNALS = tuple(
    getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGWINCH")
    if hasattr(signal, n)
)

app = typer.Typer(
    name="gpulock",
    help="Share GPU memory between processes and hosts through leases kept in Redis.",
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,  # plain click help and errors: stable text for scripts and tests
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
pool_app = typer.Typer(help="Create and change pools.", no_args_is_help=True, rich_markup_mode=None,
                       add_completion=False)
app.add_typer(pool_app, name="pool")


# ---- helpers ------------------------------------------------------------------------------
def _say(msg: str) -> None:
    """One line of gpulock's own output, to stderr (stdout belongs to data or to CMD)."""
    try:
        print(f"gpulock: {msg}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _fail(code: int, msg: str) -> NoReturn:
    _say(f"error: {msg}")
    raise typer.Exit(code)


def _safe_url(url: str) -> str:
    """The URL with any password masked, for messages."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def _size_param(name: str):
    def cb(value: Optional[str]) -> Optional[int]:
        if value is None:
            return None
        try:
            return parse_size(value, name=name)
        except InvalidArgument as e:
            raise typer.BadParameter(str(e)) from None
    return cb


def _seconds_param(name: str, *, minimum: float, maximum: float, allow_zero: bool = False):
    def cb(value: Optional[float]) -> Optional[float]:
        if value is None:
            return None
        try:
            return parse_seconds(value, name=name, minimum=minimum, maximum=maximum, allow_zero=allow_zero)
        except InvalidArgument as e:
            raise typer.BadParameter(str(e)) from None
    return cb


def _pool_name_param(value: Optional[str]) -> Optional[str]:
    if value is None:
        return None
    from ._protocol import validate_pool_name

    try:
        return validate_pool_name(value)
    except InvalidArgument as e:
        raise typer.BadParameter(str(e)) from None


def _error_exit(e: BaseException, url: str) -> NoReturn:
    """Map a gpulock error to one clear line on stderr and its exit code."""
    if isinstance(e, PoolNotFound):
        _fail(EXIT_NO_POOL, str(e))
    if isinstance(e, CapacityExceeded):
        _fail(EXIT_CAPACITY, f"{e}; the request can never be granted")
    if isinstance(e, BackendUnavailable):
        _fail(EXIT_UNAVAILABLE, f"Redis at {_safe_url(url)} is unavailable: {e.__cause__ or e}")
    if isinstance(e, (AcquireTimeout, QueueFull)):
        _fail(EXIT_TEMPFAIL, str(e))
    if isinstance(e, InvalidArgument):
        _fail(EXIT_USAGE, str(e))
    _fail(EXIT_ERROR, str(e))


def _url(ctx: typer.Context) -> str:
    return (ctx.obj or {}).get("redis_url", DEFAULT_REDIS_URL)


def _client(url: str):
    """A client that has answered one PING. A Redis that is down when a command starts fails
    the command at once (exit 69) instead of after the library's retry bound (meant for blips
    in a long-running process)."""
    import redis

    from ._async import _CLIENT_DEFAULTS
    from ._connect import short_error, sync_client

    try:
        c = sync_client(url, **_CLIENT_DEFAULTS)
    except ValueError as e:  # a malformed URL
        _fail(EXIT_USAGE, f"bad Redis URL {_safe_url(url)!r}: {e}")
    try:
        c.ping()
    except redis.RedisError as e:
        c.close()
        _fail(EXIT_UNAVAILABLE, f"Redis at {_safe_url(url)} is unavailable: {short_error(e)}")
    return c


def _secs(x: float) -> str:
    if x < 0:
        return "expired"
    if x < 60:
        return f"{x:.1f}s"
    if x < 3600:
        return f"{int(x // 60)}m{int(x % 60):02d}s"
    return f"{int(x // 3600)}h{int(x % 3600 // 60):02d}m"


# ---- global options -------------------------------------------------------------------------
def _version(value: bool) -> None:
    if value:
        print(f"gpulock {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    ctx: typer.Context,
    redis_url: str = typer.Option(
        DEFAULT_REDIS_URL, "--redis-url", envvar="GPULOCK_REDIS_URL", show_default=True,
        help="Redis holding the pools (redis://, rediss://, unix:// or redis+sentinel://HOST:PORT,.../SERVICE).",
    ),
    broker_url: Optional[str] = typer.Option(
        None, "--broker-url", envvar="GPULOCK_BROKER_URL",
        help="gpulock run only: lease through this HTTP broker instead of Redis (bearer token "
             "from GPULOCK_TOKEN; needs the gpulock-client package).",
    ),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Share GPU memory between processes and hosts through leases kept in Redis.

    \b
    Exit codes of gpulock itself (gpulock run otherwise returns CMD's status):
      2   bad option or value (nothing was changed)
      65  amount larger than the pool's capacity (can never be granted)
      66  pool not configured in Redis
      69  Redis unreachable
      70  gpulock run: the lease was lost while CMD ran; CMD was stopped
      75  gpulock run: no lease within --timeout, or the pool's queue is full
      1   any other error
    """
    ctx.obj = {"redis_url": redis_url, "broker_url": broker_url}
    src = ctx.get_parameter_source("redis_url")
    if getattr(src, "name", None) == "COMMANDLINE":
        # `gpulock --redis-url URL serve|broker ...`: the subcommands read GPULOCK_REDIS_URL.
        os.environ["GPULOCK_REDIS_URL"] = redis_url


# ---- pool set --------------------------------------------------------------------------------
@pool_app.command("set")
def pool_set(
    ctx: typer.Context,
    name: str = typer.Argument(..., metavar="NAME", callback=_pool_name_param, help="Pool name: 1-64 of [A-Za-z0-9._-]."),
    capacity: str = typer.Option(..., "--capacity", "-c", callback=_size_param("capacity"),
                                 help="Bytes the pool lends out: 8GiB, 512MiB, 24GB, or a number of bytes."),
    max_waiters: Optional[int] = typer.Option(
        None, "--max-waiters", min=1, max=1_000_000,
        help="Most requests that may queue (default: keep the current value; 10000 for a new pool)."),
    max_ttl: Optional[float] = typer.Option(
        None, "--max-ttl", callback=_seconds_param("--max-ttl", minimum=0.1, maximum=86400),
        help="Longest lease ttl the pool accepts, seconds; also the grace period after Redis "
             "restarts without data (default: keep the current value; 60 for a new pool)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Create pool NAME, or change its capacity (and queue bound, max ttl).

    Lowering the capacity below what is in use is allowed: leases keep their bytes and nothing
    new is granted until enough is released. Raising it grants waiters that now fit.
    """
    from ._sync import Pool

    url = _url(ctx)
    client = _client(url)
    try:
        pool = Pool(client, name)
        mw, mt = max_waiters, max_ttl
        if mw is None or mt is None:
            try:
                st = pool.status(limit=0)
                mw = st.max_waiters if mw is None else mw
                if mt is None and getattr(st, "max_ttl", 0):
                    mt = st.max_ttl
            except PoolNotFound:
                pass
        r = pool.configure(capacity, max_waiters=mw, max_ttl=mt)
    except GpuLockError as e:
        _error_exit(e, url)
    finally:
        client.close()
    if as_json:
        print(json.dumps({"pool": name, **r}))
        return
    what = "created" if r["created"] else "updated"
    print(f"pool {name} {what}: capacity {format_size(r['capacity'])} ({r['capacity']} bytes), "
          f"max_waiters {r['max_waiters']}, used {format_size(r['used'])} ({r['used']} bytes)")


# ---- status ------------------------------------------------------------------------------------
def _pool_names(client) -> list[str]:
    from ._protocol import _POOL_RE

    names = set()
    for key in client.scan_iter(match="gpulock:{*}:cfg", count=1000):
        k = key.decode() if isinstance(key, bytes) else key
        m = re.fullmatch(r"gpulock:\{(.*)\}:cfg", k)
        if m and _POOL_RE.match(m.group(1)):
            names.add(m.group(1))
    return sorted(names)


def _status_dict(st) -> dict[str, Any]:
    d = st.to_dict()
    d["free"] = st.free
    return d


def _print_status(console, st) -> None:
    from rich.table import Table

    pct = (100.0 * st.used / st.capacity) if st.capacity else 0.0
    console.print(
        f"pool [bold]{st.pool}[/bold]: capacity {format_size(st.capacity)}, used {format_size(st.used)} "
        f"({pct:.0f}%), free {format_size(st.free)}; {st.lease_count} lease(s), "
        f"{st.waiter_count} waiter(s), max_waiters {st.max_waiters}",
        highlight=False)
    if st.leases:
        t = Table(title=None, show_edge=False, pad_edge=False, box=None, header_style="bold")
        for col, kw in (("lease", {}), ("amount", {"justify": "right"}), ("token", {"justify": "right"}),
                        ("host", {}), ("pid", {"justify": "right"}), ("purpose", {"overflow": "fold"}),
                        ("held", {"justify": "right"}), ("expires in", {"justify": "right"})):
            t.add_column(col, no_wrap=col != "purpose", **kw)
        for li in st.leases:
            h = li.holder
            t.add_row(li.lease_id[:8], format_size(li.amount), str(li.token), str(h.get("host", "?")),
                      str(h.get("pid", "?")), str(h.get("purpose", "")), _secs(li.held_for),
                      _secs(li.expires_in))
        console.print(t)
    if st.waiters:
        t = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
        for col, kw in (("position", {"justify": "right"}), ("amount", {"justify": "right"}), ("host", {}),
                        ("pid", {"justify": "right"}), ("purpose", {"overflow": "fold"}),
                        ("waited", {"justify": "right"}), ("request id", {})):
            t.add_column(col, no_wrap=col != "purpose", **kw)
        for w in st.waiters:
            h = w.holder
            t.add_row(str(w.position), format_size(w.amount), str(h.get("host", "?")), str(h.get("pid", "?")),
                      str(h.get("purpose", "")), _secs(w.waited), w.request_id[:12])
        console.print(t)
    if st.lease_count > len(st.leases) or st.waiter_count > len(st.waiters):
        console.print(f"(listing first {len(st.leases)} leases and {len(st.waiters)} waiters)", highlight=False)


@app.command("status")
def status(
    ctx: typer.Context,
    name: Optional[str] = typer.Argument(None, metavar="[NAME]", callback=_pool_name_param,
                                         help="Pool to show (default: every pool in this Redis)."),
    as_json: bool = typer.Option(False, "--json",
                                 help="JSON for programs: amounts in bytes, times in seconds. One "
                                      "object for NAME, a list of objects without it."),
    limit: int = typer.Option(1000, "--limit", min=0, max=100000, help="Most leases and waiters to list per pool."),
) -> None:
    """Show capacity, use, leases and waiters of one pool or of all pools."""
    from rich.console import Console

    from ._sync import Pool

    url = _url(ctx)
    client = _client(url)
    try:
        if name is not None:
            statuses = [Pool(client, name).status(limit=limit)]
        else:
            try:
                names = _pool_names(client)
            except Exception as e:
                from ._protocol import translate

                raise translate(e, "*") from e
            statuses = []
            for n in names:
                try:
                    statuses.append(Pool(client, n).status(limit=limit))
                except PoolNotFound:
                    pass  # deleted between the scan and now
    except GpuLockError as e:
        _error_exit(e, url)
    finally:
        client.close()

    if as_json:
        out: Any = _status_dict(statuses[0]) if name is not None else [_status_dict(s) for s in statuses]
        print(json.dumps(out, indent=2))
        return
    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "200"))
    console = Console(file=sys.stdout, width=width, highlight=False)
    if not statuses:
        console.print(f"no pools in {_safe_url(url)} (create one: gpulock pool set NAME --capacity SIZE)")
        return
    for i, st in enumerate(statuses):
        if i:
            console.print()
        _print_status(console, st)


# ---- run ---------------------------------------------------------------------------------------
class _Signalled(BaseException):
    """Raised in the main thread by a signal that arrives while waiting for the lease."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _child_setup(parent_pid: int, prctl: Any) -> None:
    """In CMD's process between fork and exec: own process group (so signals and a lost lease
    reach all of CMD's processes), and die with gpulock (Linux PR_SET_PDEATHSIG), so a killed
    ``gpulock run`` does not leave CMD on the GPU without a heartbeat."""
    os.setpgid(0, 0)
    if prctl is not None:
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # gpulock died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)


def _prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _clip(text: str, limit: int = 300) -> str:
    """Shorten ``text`` so that it takes at most ``limit`` bytes as JSON (holder metadata is
    limited to 512 bytes in all; non-ASCII characters take up to 6)."""
    if len(json.dumps(text)) <= limit:
        return text
    while text and len(json.dumps(text + "...")) > limit:
        text = text[: max(0, min(len(text) - 1, len(text) * limit // len(json.dumps(text))))]
    return text + "..."


def _not_ignored(sigs) -> list[int]:
    """Signals whose disposition is not SIG_IGN: an ignored one (``nohup``, ``cmd &`` in a
    script) stays ignored, in gpulock and in CMD, as it would without gpulock."""
    return [s for s in sigs if signal.getsignal(s) is not signal.SIG_IGN]


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


RUN_HELP = f"""Run CMD while holding AMOUNT bytes of pool POOL (flock(1) for GPU memory).

Waits in the pool's FIFO queue (printing the queue position to stderr), then runs CMD with
GPULOCK_LEASE_ID, GPULOCK_FENCING_TOKEN, GPULOCK_POOL and GPULOCK_AMOUNT in its environment,
renews the lease every ttl/3 while CMD runs, and releases it when CMD exits. Put `--` before
CMD.

CMD runs in its own process group; SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2 and
SIGWINCH sent to gpulock run are forwarded to that group (a signal ignored when gpulock run
starts, as under nohup, stays ignored in both). If gpulock run itself is killed
(kill -9), CMD is killed too (Linux: PR_SET_PDEATHSIG), because its lease would expire after
the ttl with nobody renewing it; CMD's own children are not covered by that.

If the lease is lost while CMD runs (Redis unreachable or this host paused past the ttl, or the
lease was removed), CMD's process group gets SIGTERM, then SIGKILL after --grace seconds, and
gpulock run exits {EXIT_LEASE_LOST}. The lease is considered lost shortly *before* the server
expires it, but a CMD that takes its grace period may overlap with the next holder.

\b
Exit status:
  CMD's exit status, or 128+N if CMD was killed by signal N
  {EXIT_TEMPFAIL}   no lease within --timeout (EX_TEMPFAIL), or the pool's queue is full
  {EXIT_LEASE_LOST}   the lease was lost while CMD ran; CMD was sent SIGTERM/SIGKILL
  {EXIT_CAPACITY}   --amount is larger than the pool's capacity
  {EXIT_NO_POOL}   the pool is not configured (gpulock pool set NAME --capacity SIZE)
  {EXIT_UNAVAILABLE}   Redis unreachable
  2    bad option or value
  126  CMD is not executable; 127 CMD not found
  130, 143  interrupted (SIGINT, SIGTERM) while waiting; nothing is held
"""


@app.command(
    "run",
    help=RUN_HELP,
    context_settings={"allow_interspersed_args": False},
    no_args_is_help=True,
    options_metavar="[OPTIONS] --",
)
def run(
    ctx: typer.Context,
    cmd: list[str] = typer.Argument(..., metavar="CMD", help="The command (and its arguments) to run under the lease."),
    pool: str = typer.Option(..., "--pool", "-p", callback=_pool_name_param, help="Pool to lease from."),
    amount: str = typer.Option(..., "--amount", "-a", callback=_size_param("amount"),
                               help="Bytes to hold while CMD runs: 4GiB, 512MiB, or a number of bytes."),
    ttl: float = typer.Option(DEFAULT_RUN_TTL_S, "--ttl", callback=_seconds_param("--ttl", minimum=0.1, maximum=86400),
                              help="Lease time to live in seconds; renewed every ttl/3. A crashed "
                                   "holder's bytes return after at most this long."),
    timeout: Optional[float] = typer.Option(
        None, "--timeout", callback=_seconds_param("--timeout", minimum=0.0, maximum=1e9, allow_zero=True),
        help=f"Seconds to wait for the lease (default: forever; 0: try once). Exit {EXIT_TEMPFAIL} when it runs out."),
    grace: float = typer.Option(DEFAULT_GRACE_S, "--grace", callback=_seconds_param("--grace", minimum=0.0,
                                                                                   maximum=86400, allow_zero=True),
                                help="Seconds between SIGTERM and SIGKILL when the lease is lost."),
    purpose: Optional[str] = typer.Option(None, "--purpose", help="Shown by gpulock status (default: CMD)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only errors on stderr (no queue position)."),
) -> None:
    from ._sync import Pool

    url = _url(ctx)
    if not cmd:
        _fail(EXIT_USAGE, "no command given (gpulock run --pool NAME --amount SIZE -- CMD ARGS...)")
    exe = cmd[0]
    if os.sep not in exe and shutil.which(exe) is None:
        _fail(EXIT_NOT_FOUND, f"command not found: {exe!r}")
    meta = {"purpose": _clip(purpose if purpose is not None else shlex.join(cmd))}

    broker = (ctx.obj or {}).get("broker_url")
    if broker:
        try:
            import gpulock_client
        except ImportError:
            _fail(EXIT_USAGE, "--broker-url needs the gpulock-client package (pip install gpulock-client)")
        url = broker
        p = _BrokerPool(gpulock_client.Pool(broker, pool, token=os.environ.get("GPULOCK_TOKEN"), default_ttl=ttl))
    else:
        _client(url).close()  # fail fast (exit 69) if Redis is down now
        try:
            p = Pool.from_url(url, pool, default_ttl=ttl)
        except ValueError as e:
            _fail(EXIT_USAGE, f"bad Redis URL {_safe_url(url)!r}: {e}")
    try:
        code = _run_under_lease(p, url, pool, amount, ttl, timeout, grace, cmd, meta, quiet)
    finally:
        p.close()
    raise typer.Exit(code)


def _core_error(e: Exception) -> Exception:
    """A gpulock_client error as the core's exception of the same name (same attributes), so
    `gpulock run` treats leases through a broker and through Redis alike."""
    from . import errors as E

    g = lambda k, d=0: getattr(e, k, d)  # noqa: E731
    name = type(e).__name__
    if name == "LeaseLost":
        return E.LeaseLost(g("lease_id", ""), g("reason", str(e)))
    if name == "AcquireTimeout":
        return E.AcquireTimeout(str(e), position=g("position"), queue_length=g("queue_length"),
                                retry_after=g("retry_after", None))
    if name == "CapacityExceeded":
        return E.CapacityExceeded(g("amount"), g("capacity"))
    if name == "QueueFull":
        return E.AcquireTimeout(str(e), queue_length=g("queue_length"))
    if name == "InvalidArgument":
        return E.InvalidArgument(str(e))
    if name == "BackendUnavailable":
        return E.BackendUnavailable(str(e))
    if name == "PoolNotFound":
        return E.PoolNotFound(str(getattr(e, "pool", "?")))
    return E.GpuLockError(str(e))


class _BrokerLease:
    """A gpulock_client lease behind the core's exceptions (see _core_error)."""

    def __init__(self, inner):
        self._inner = inner
        self.id, self.token = inner.id, inner.token

    @property
    def valid_until(self) -> float:
        return self._inner.valid_until

    def on_lost(self, cb) -> None:
        self._inner.on_lost(lambda _lease: cb(self))

    def ensure_valid(self) -> None:
        import gpulock_client

        try:
            self._inner.ensure_valid()
        except gpulock_client.GpuLockError as e:
            raise _core_error(e) from e

    def release(self) -> None:
        import gpulock_client

        try:
            self._inner.release()
        except gpulock_client.GpuLockError as e:
            raise _core_error(e) from e


class _BrokerPool:
    """gpulock_client.Pool with the core Pool's acquire/close and exceptions."""

    def __init__(self, inner):
        self._inner = inner

    def acquire(self, amount, **kw):
        import gpulock_client

        try:
            return _BrokerLease(self._inner.acquire(amount, **kw))
        except gpulock_client.GpuLockError as e:
            raise _core_error(e) from e

    def close(self) -> None:
        self._inner.close()


def _run_under_lease(p, url: str, pool: str, amount: int, ttl: float, timeout: Optional[float],
                     grace: float, cmd: list[str], meta: dict, quiet: bool) -> int:
    info = (lambda msg: None) if quiet else _say
    queued_at: list[float] = []

    def on_queued(pos: int) -> None:
        if not queued_at:
            queued_at.append(time.monotonic())
        info(f"waiting for {format_size(amount)} on pool {pool!r}: position {pos} in the queue")

    # While waiting: a signal interrupts the wait (Pool.acquire leaves the queue and releases a
    # grant that raced in), then we exit 128+N. Later signals during that cleanup are noted only.
    interrupted: list[int] = []

    def wait_handler(signum, frame):
        if not interrupted:
            interrupted.append(signum)
            raise _Signalled(signum)

    old = {s: signal.signal(s, wait_handler) for s in _not_ignored((signal.SIGINT, signal.SIGTERM, signal.SIGHUP))}
    try:
        try:
            lease = p.acquire(amount, ttl=ttl, timeout=timeout, holder=meta, on_queued=on_queued)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    except _Signalled as e:
        _say(f"interrupted by {signal.Signals(e.signum).name} while waiting for the lease; nothing is held")
        return 128 + e.signum
    except AcquireTimeout as e:
        _say(f"error: no lease of {format_size(amount)} on pool {pool!r} within {timeout}s "
             f"({'queue position ' + str(e.position) if e.position else 'not granted'}); exit {EXIT_TEMPFAIL}")
        return EXIT_TEMPFAIL
    except GpuLockError as e:
        try:
            _error_exit(e, url)
        except typer.Exit as x:
            return x.exit_code
    if interrupted:  # a signal landed after the grant but before we could raise
        _release(lease, pool)
        return 128 + interrupted[0]
    if queued_at:
        info(f"granted {format_size(amount)} on pool {pool!r} after {time.monotonic() - queued_at[0]:.1f}s")
    return _supervise(lease, pool, amount, grace, cmd)


def _release(lease, pool: str, *, wait: float = 6.0, quiet: bool = False) -> None:
    """Release, waiting at most ``wait`` seconds (an unreachable Redis would otherwise hold us
    for the socket timeout plus the retry bound); the lease expires after its ttl anyway."""
    problem: list[str] = []

    def go() -> None:
        try:
            lease.release()
        except LeaseLost as e:
            problem.append(f"lease on pool {pool!r} was already gone at release: {e.reason}")
        except GpuLockError as e:
            problem.append(f"could not release the lease on pool {pool!r} ({e}); it expires after its ttl")

    t = threading.Thread(target=go, name="gpulock-run-release", daemon=True)
    t.start()
    t.join(wait)
    if t.is_alive():
        problem.append(f"Redis did not confirm the release within {wait:g}s; the lease on pool {pool!r} "
                       f"expires after its ttl")
    if problem and not quiet:
        _say(f"warning: {problem[0]}")


def _supervise(lease, pool: str, amount: int, grace: float, cmd: list[str]) -> int:
    env = dict(os.environ)
    env.update(GPULOCK_LEASE_ID=lease.id, GPULOCK_FENCING_TOKEN=str(lease.token), GPULOCK_POOL=pool,
               GPULOCK_AMOUNT=str(amount))
    wake = threading.Event()
    lost_info: list[str] = []

    def on_lost(_lease) -> None:
        wake.set()

    import subprocess

    prctl = _prctl()
    parent = os.getpid()
    try:
        proc = subprocess.Popen(cmd, env=env, preexec_fn=lambda: _child_setup(parent, prctl))
    except FileNotFoundError as e:
        _release(lease, pool)
        _say(f"error: command not found: {cmd[0]!r} ({e.strerror})")
        return EXIT_NOT_FOUND
    except PermissionError as e:
        _release(lease, pool)
        _say(f"error: cannot execute {cmd[0]!r}: {e.strerror}")
        return EXIT_NOT_EXECUTABLE
    except OSError as e:
        _release(lease, pool)
        _say(f"error: cannot start {cmd[0]!r}: {e}")
        return EXIT_NOT_EXECUTABLE

    exited = threading.Event()

    def reap_child() -> None:
        proc.wait()
        exited.set()
        wake.set()

    threading.Thread(target=reap_child, name="gpulock-run-wait", daemon=True).start()

    def send(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:  # group gone and pid reused by someone else's group: unlikely
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def forward(signum, frame):
        if not exited.is_set():
            send(signum)

    old = {s: signal.signal(s, forward) for s in _not_ignored(FORWARDED_SIGNALS)}
    lease.on_lost(on_lost)
    try:
        while not exited.is_set():
            # Wake at the lease's local validity deadline too (on_lost should fire then; this
            # is the belt to its braces), or at once when CMD exits or on_lost fires.
            delay = lease.valid_until - time.monotonic()
            wake.wait(min(max(delay, 0.0), 5.0) + 0.001)
            wake.clear()
            if exited.is_set():
                break
            try:
                lease.ensure_valid()
            except LeaseLost as e:
                lost_info.append(e.reason)
                break
        if lost_info:
            _say(f"error: lease {lease.id[:8]}… on pool {pool!r} lost while CMD (pid {proc.pid}) ran: "
                 f"{lost_info[0]}; sending SIGTERM, SIGKILL in {grace:g}s")
            send(signal.SIGTERM)
            if not exited.wait(grace):
                _say(f"CMD (pid {proc.pid}) still running after {grace:g}s; sending SIGKILL")
                send(signal.SIGKILL)
                exited.wait()
            _say(f"CMD stopped ({_describe(proc.returncode)}) after the lease was lost; exit {EXIT_LEASE_LOST}")
            _release(lease, pool, wait=1.0, quiet=True)  # frees the bytes early if Redis still has it
            return EXIT_LEASE_LOST
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    _release(lease, pool)
    return _exit_status(proc.returncode)


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def main(argv: Optional[list[str]] = None) -> int:
    """Console-script entry point."""
    try:
        app(args=argv, prog_name="gpulock", standalone_mode=True)
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0


def _register_extras() -> None:
    try:
        from gpulock_service.cli import register
    except ImportError:
        pass
    else:
        register(app)
    try:
        from gpulock_service.broker.app import register_broker
    except ImportError:
        pass
    else:
        register_broker(app)


_register_extras()
