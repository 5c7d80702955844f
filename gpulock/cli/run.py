"""``gpulock run``: run a command while holding a lease (``flock(1)`` for GPU memory),
through Redis or through an HTTP broker, with one exit-code contract for both."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import time
from contextlib import ExitStack
from dataclasses import replace
from types import FrameType
from typing import Any, Callable, Optional

import typer
from gpulock_common.grace import grace_note
from gpulock_common.options import (
    MAX_REMOTE_HOLDER_JSON,
    MAX_TIMEOUT_S,
    MAX_TTL_S,
    MIN_REMOTE_TTL_S,
    MIN_TTL_S,
    check_seconds,
)

from gpulock.cli.common import (
    EXIT_CAPACITY,
    EXIT_LEASE_LOST,
    EXIT_NO_POOL,
    EXIT_NOPERM,
    EXIT_NOT_FOUND,
    EXIT_OVERUSE,
    EXIT_TEMPFAIL,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    RunPool,
    Target,
    error_exit,
    fail,
    pool_target_param,
    split_pool_target,
    priority_param,
    tenant_param,
    redis_client,
    say,
    seconds_param,
    secs,
    size_param,
    target,
)
from gpulock.cli.child import (
    EnforceOptions,
    not_ignored,
    release_lease,
    supervise,
    visible_entries,
    visible_gpu,
)
from gpulock.errors import AcquireTimeout, GpuLockError, PoolNotFound
from gpulock.units import format_size, is_index

DEFAULT_RUN_TTL_S = 30.0
DEFAULT_GRACE_S = 10.0
DEFAULT_YIELD_SIGNAL = "SIGTERM"


def parse_yield_signal(value: str) -> Optional[int]:
    """``--yield-signal``: a signal name (SIGUSR1, USR1, any case), a signal number, or
    ``none`` (no signal): the signal number, None for none. A bad value is exit 2 naming it."""
    text = value.strip()
    if text.lower() == "none":
        return None
    valid = {int(s) for s in signal.valid_signals()}
    if text.isdigit():
        n = int(text)
        if n in valid and n != 0:
            return n
    else:
        name = text.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        sig = getattr(signal.Signals, name, None) if not name.startswith("SIG_") else None
        if sig is not None and int(sig) in valid:
            return int(sig)
    fail(
        EXIT_USAGE,
        f"--yield-signal: {value!r} is not a signal: give a name (SIGTERM, SIGINT, SIGUSR1), "
        "a number, or none",
    )


class _Signalled(BaseException):
    """Raised in the main thread by a signal that arrives while waiting for the lease."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# What the holder metadata takes besides the purpose's text, at most: the SDK adds the host
# (cut to 64 characters) and the pid (7 digits on Linux) to what gpulock run gives.
_HOLDER_OVERHEAD = (
    len(json.dumps({"host": "h" * 64, "pid": 9_999_999, "purpose": ""}, separators=(",", ":"))) - 2
)


def _clip(text: str, limit: int = MAX_REMOTE_HOLDER_JSON - _HOLDER_OVERHEAD) -> str:
    """Shorten ``text`` so that it takes at most ``limit`` bytes as JSON (non-ASCII characters
    take up to 6): by default so that the holder metadata with it as the purpose fits what a
    broker takes (:data:`gpulock_common.options.MAX_REMOTE_HOLDER_JSON`), the tighter of the
    two paths (Redis takes 512 bytes in all)."""
    if len(json.dumps(text)) <= limit:
        return text
    while text and len(json.dumps(text + "...")) > limit:
        text = text[: max(0, min(len(text) - 1, len(text) * limit // len(json.dumps(text))))]
    return text + "..."


RUN_HELP = f"""Run CMD while holding AMOUNT bytes of pool POOL (flock(1) for GPU memory).

Waits in the pool's queue (by --priority, then first come first served; printing the queue
position to stderr), then runs CMD with GPULOCK_LEASE_ID, GPULOCK_FENCING_TOKEN, GPULOCK_POOL,
GPULOCK_AMOUNT and GPULOCK_DEVICE (the pool's device the lease is on) in its environment,
renews the lease every ttl/3 while CMD runs, and releases it when CMD exits. Put `--` before
CMD.

On a pool of several devices the lease is placed on one (--pool NAME/D pins device D) and CMD
also gets CUDA_VISIBLE_DEVICES naming only that GPU: device D is GPU D (as nvidia-smi numbers
them: CUDA_DEVICE_ORDER=PCI_BUS_ID unless set), or the D-th entry of CUDA_VISIBLE_DEVICES when
gpulock run's own environment sets it.

On a pool with preemption on (gpulock pool set --preempt-gap), a waiting request of a priority
at least the pool's gap above this lease's may ask its holder to yield it: gpulock run then
says so on stderr and sends CMD's process group --yield-signal (SIGTERM unless set). A CMD that
exits on it has its lease released as usual; one that does not is stopped when the server takes
the lease back at the yield deadline (as on a lost lease, below). --no-preemptible: never
asked.

CMD runs in its own process group; SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2 and
SIGWINCH sent to gpulock run are forwarded to that group (a signal ignored when gpulock run
starts, as under nohup, stays ignored in both). If gpulock run itself is killed
(kill -9), CMD is killed too (Linux: PR_SET_PDEATHSIG), because its lease would expire after
the ttl with nobody renewing it; CMD's own children are not covered by that.

If the lease is lost while CMD runs (Redis unreachable or this host paused past the ttl, or the
lease was removed), CMD's process group gets SIGTERM, then SIGKILL after --grace seconds, and
gpulock run exits {EXIT_LEASE_LOST}. The lease is considered lost shortly *before* the server
expires it, but a CMD that takes its grace period may overlap with the next holder.

With --enforce, gpulock run reads CMD's device memory (CMD and its descendants, per-process
use from NVML, or the fake device file of --device-reader fake:PATH) every 0.25 s; when it
exceeds the lease by --enforce-margin plus --enforce-slack for --enforce-grace seconds without
a break, CMD's process group gets SIGTERM, then SIGKILL after --grace seconds, and gpulock run
exits {EXIT_OVERUSE}. A reader without per-process use (torch) enforces nothing (said on stderr).

\b
Exit status:
  CMD's exit status, or 128+N if CMD was killed by signal N
  {EXIT_TEMPFAIL}   no lease within --timeout (EX_TEMPFAIL), or the pool's queue is full
  {EXIT_LEASE_LOST}   the lease was lost while CMD ran; CMD was sent SIGTERM/SIGKILL
  {EXIT_OVERUSE}   --enforce: CMD used more device memory than its lease; CMD was sent
       SIGTERM/SIGKILL
  {EXIT_CAPACITY}   --amount is larger than the pool's capacity (on a pool of several devices:
       its device's, or the largest device's) or the --tenant's quota
  {EXIT_NO_POOL}   the pool is not configured (gpulock pool set NAME --capacity SIZE)
  {EXIT_UNAVAILABLE}   Redis or the broker unreachable
  {EXIT_NOPERM}   the broker refused the token (GPULOCK_TOKEN missing, wrong, or not
       allowed this pool)
  {EXIT_USAGE}    bad option or value (also --ttl over the pool's max ttl); nothing was changed
  126  CMD is not executable; 127 CMD not found
  1    any other gpulock error
  130, 143  interrupted (SIGINT, SIGTERM) while waiting; nothing is held
"""


def run(
    ctx: typer.Context,
    cmd: list[str] = typer.Argument(
        ..., metavar="CMD", help="The command (and its arguments) to run under the lease."
    ),
    pool: str = typer.Option(
        ...,
        "--pool",
        "-p",
        callback=pool_target_param,
        metavar="NAME[/DEVICE]",
        help="Pool to lease from; NAME/D pins device D of a pool of several devices.",
    ),
    amount: str = typer.Option(
        ...,
        "--amount",
        "-a",
        callback=size_param("amount"),
        help="Bytes to hold while CMD runs: 4GiB, 512MiB, or a number of bytes.",
    ),
    ttl: float = typer.Option(
        DEFAULT_RUN_TTL_S,
        "--ttl",
        callback=seconds_param("--ttl", minimum=MIN_TTL_S, maximum=MAX_TTL_S),
        help="Lease time to live in seconds; renewed every ttl/3. A crashed "
        "holder's bytes return after at most this long. At most the "
        "pool's max ttl (60 unless set with gpulock pool set --max-ttl).",
    ),
    timeout: Optional[float] = typer.Option(
        None,
        "--timeout",
        callback=seconds_param("--timeout", minimum=0.0, maximum=MAX_TIMEOUT_S, allow_zero=True),
        help=f"Seconds to wait for the lease (default: forever; 0: try once). Exit {EXIT_TEMPFAIL} when it runs out.",
    ),
    priority: str = typer.Option(
        "0",
        "--priority",
        callback=priority_param,
        metavar="N",
        help="An integer in [-100, 100]; higher goes first in the pool's queue. A waiting "
        "request gains one level per second waited, so none starves.",
    ),
    tenant: Optional[str] = typer.Option(
        None,
        "--tenant",
        callback=tenant_param,
        metavar="NAME",
        help="The tenant the lease counts under: the pool's quota for it (gpulock pool set "
        "--quota NAME=SIZE) caps what its leases hold. Through --broker-url the token's "
        "tenant is used and this is refused.",
    ),
    preemptible: bool = typer.Option(
        True,
        "--preemptible/--no-preemptible",
        help="Whether a waiting request of higher priority may ask for this lease (on a pool "
        "with preemption on); --no-preemptible: never asked.",
    ),
    yield_signal: str = typer.Option(
        DEFAULT_YIELD_SIGNAL,
        "--yield-signal",
        metavar="NAME|NUMBER|none",
        help="The signal CMD's process group gets when the lease is asked to yield: a name "
        "(SIGINT, SIGUSR1), a number, or none (no signal; the request is only said on stderr).",
    ),
    grace: float = typer.Option(
        DEFAULT_GRACE_S,
        "--grace",
        callback=seconds_param("--grace", minimum=0.0, maximum=86400, allow_zero=True),
        help="Seconds between SIGTERM and SIGKILL when the lease is lost (or --enforce stops CMD).",
    ),
    purpose: Optional[str] = typer.Option(
        None, "--purpose", help="Shown by gpulock status (default: CMD)."
    ),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="Only errors on stderr (no queue position)."
    ),
    enforce: bool = typer.Option(
        False,
        "--enforce",
        help="Stop CMD if its device memory exceeds the lease (see above).",
    ),
    enforce_margin: str = typer.Option(
        "10%", "--enforce-margin", help="--enforce: allowed excess over the lease (10% or 0.1)."
    ),
    enforce_slack: str = typer.Option(
        "512MiB",
        "--enforce-slack",
        callback=size_param("--enforce-slack", allow_zero=True),
        help="--enforce: bytes allowed beyond the margin (the CUDA context, which no lease counts).",
    ),
    enforce_grace: float = typer.Option(
        5.0,
        "--enforce-grace",
        callback=seconds_param("--enforce-grace", minimum=0.0, maximum=86400, allow_zero=True),
        help="--enforce: seconds CMD may stay over before it is stopped.",
    ),
    device: Optional[int] = typer.Option(
        None,
        "--device",
        min=0,
        max=1023,
        help="--enforce: the GPU index to read (default: the GPU of the lease's device: GPU D "
        "for device D, or the D-th GPU CUDA_VISIBLE_DEVICES shows; device 0 on a pool of one "
        "device).",
    ),
    device_reader: str = typer.Option(
        "auto",
        "--device-reader",
        help="--enforce: auto, nvml, torch or fake:PATH (auto: $GPULOCK_FAKE_DEVICES, else NVML, "
        "else torch).",
    ),
) -> None:
    from gpulock._sync import Pool

    started = time.monotonic()
    pool, pin = split_pool_target(pool)
    yield_sig = parse_yield_signal(yield_signal)
    enf = None
    if enforce:
        # the GPU to read: --device, else a pinned device's (a pool of one device: GPU 0)
        gpu = visible_gpu(pin or 0, os.environ.get("CUDA_VISIBLE_DEVICES"))
        enf = _enforce_options(
            enforce_margin,
            int(enforce_slack or 0),
            float(enforce_grace or 0.0),
            device if device is not None else int(gpu) if is_index(gpu) else pin or 0,
            device_reader,
        )

    t = target(ctx)
    if tenant and t.is_broker:
        fail(
            EXIT_USAGE,
            "--tenant: through a broker the lease counts under the token's tenant (its "
            "'tenant' in the broker's tokens file); leave --tenant out",
        )
    if not cmd:
        fail(EXIT_USAGE, "no command given (gpulock run --pool NAME --amount SIZE -- CMD ARGS...)")
    exe = cmd[0]
    if os.sep not in exe and shutil.which(exe) is None:
        fail(EXIT_NOT_FOUND, f"command not found: {exe!r}")
    meta = {"purpose": _clip(purpose if purpose is not None else shlex.join(cmd))}

    with ExitStack() as opened:
        p: RunPool
        if t.is_broker:
            from gpulock.cli.broker import BrokerAdmin, BrokerPool

            try:  # the broker's least ttl (its holder renews over HTTP), said before anything is sent
                check_seconds(ttl, name="--ttl", minimum=MIN_REMOTE_TTL_S, maximum=MAX_TTL_S)
            except GpuLockError as e:
                fail(EXIT_USAGE, f"{e} (through a broker)")
            b = BrokerAdmin(t.url)
            opened.callback(b.close)

            def count_devices() -> int:
                return len(b.call("GET", f"/v1/pools/{pool}", pool).get("devices") or [0])

            # fail fast (69, 77) if the broker is down or refuses the token; a pool it does not
            # find is the acquire's to decide (_pool_devices)
            n_devices = _pool_devices(count_devices, t, pool)
            p = BrokerPool(t.url, pool, default_ttl=ttl)
            opened.callback(p.close)
        else:
            from gpulock.runtime.calls import DEFAULT_BACKEND_TIMEOUT_S

            redis_client(t.url).close()  # fail fast (exit 69) if Redis is down now
            # --timeout is the time to get the lease: the calls before the acquire ride out a
            # failover or a migration as long as the acquire itself would
            core = Pool.from_url(
                t.url,
                pool,
                default_ttl=ttl,
                backend_timeout=max(DEFAULT_BACKEND_TIMEOUT_S, timeout or 0.0),
            )
            p = core
            opened.callback(p.close)

            def count_devices() -> int:
                return len(core.status(limit=0).devices)

            n_devices = _pool_devices(count_devices, t, pool)
        if n_devices is not None:
            problem = _visible_problem(pool, pin, n_devices)
            if problem:
                fail(EXIT_USAGE, problem)
        if enf is not None and device is None:
            enf = replace(enf, device=-1)  # the lease's GPU, once it is granted
        code = _run_under_lease(
            p,
            t,
            pool,
            int(amount),
            ttl,
            timeout,
            grace,
            cmd,
            meta,
            quiet,
            enf,
            int(priority),
            tenant or None,
            pin,
            n_devices,
            count_devices,
            time.monotonic() - started,
            preemptible,
            yield_sig,
        )
    raise typer.Exit(code)


def _pool_devices(count_devices: Callable[[], int], t: Target, pool: str) -> Optional[int]:
    """The pool's number of devices, read before the acquire (``count_devices``: one status
    read through the broker or Redis); exits as :func:`error_exit` says on an error (69 the
    backend unreachable, 77 the token refused, ...). None when the pool is not found: the
    acquire decides then (one by a pool object that saw the pool, as the broker's, makes it
    again as last seen, with the grace period; else it raises PoolNotFound, exit 66), and the
    count is read after the grant."""
    try:
        return count_devices()
    except PoolNotFound:
        return None
    except GpuLockError as e:
        error_exit(e, t, pool)


def _run_under_lease(
    p: RunPool,
    t: Target,
    pool: str,
    amount: int,
    ttl: float,
    timeout: Optional[float],
    grace: float,
    cmd: list[str],
    meta: dict[str, Any],
    quiet: bool,
    enf: Optional[EnforceOptions],
    priority: int,
    tenant: Optional[str],
    pin: Optional[int],
    n_devices: Optional[int],
    count_devices: Callable[[], int],
    spent: float,
    preemptible: bool = True,
    yield_signal: Optional[int] = signal.SIGTERM,
) -> int:
    """Acquire (within what is left of ``timeout`` after the ``spent`` seconds of the calls
    before), then run CMD under the lease: the exit code. ``n_devices`` None (the pool was not
    found before the acquire, which made it again): ``count_devices()`` reads it once the
    lease is granted, before CMD starts, and a CUDA_VISIBLE_DEVICES that hides the lease's
    device then is exit 2 with the lease released."""
    info = (lambda msg: None) if quiet else say
    queued_at: list[float] = []

    def on_queued(pos: int) -> None:
        if not queued_at:
            queued_at.append(time.monotonic())
        on = "" if pin is None else f" device {pin}"
        grace = p.grace_left()
        why = f" ({grace_note(pool, grace)})" if grace > 0 else ""
        # a QueuePlace: the queue's length and the server's estimate (docs/SEMANTICS.md,
        # "Wait estimate"); nothing is said of either while not known
        length = getattr(pos, "queue_length", None)
        wait = getattr(pos, "estimated_wait", None)
        of = f" of {length}" if length else ""
        left = f", about {secs(wait)} left" if wait is not None else ""
        info(
            f"waiting for {format_size(amount)} on pool {pool!r}{on}: position {pos} in the "
            f"queue{of}{left}{why}"
        )

    # While waiting: a signal interrupts the wait (Pool.acquire leaves the queue and releases a
    # grant that raced in), then we exit 128+N. Later signals during that cleanup are noted only.
    interrupted: list[int] = []

    def wait_handler(signum: int, frame: FrameType | None) -> None:
        if not interrupted:
            interrupted.append(signum)
            raise _Signalled(signum)

    caught = not_ignored((signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
    old = {s: signal.signal(s, wait_handler) for s in caught}
    try:
        try:
            lease = p.acquire(
                amount,
                ttl=ttl,
                timeout=None if timeout is None else max(0.0, timeout - spent),
                holder=meta,
                on_queued=on_queued,
                priority=priority,
                tenant=tenant,
                device=pin,
                preemptible=preemptible,
            )
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    except _Signalled as e:
        say(
            f"interrupted by {signal.Signals(e.signum).name} while waiting for the lease; nothing is held"
        )
        return 128 + e.signum
    except AcquireTimeout as e:
        why = f": {grace_note(pool, e.grace_left)}" if e.grace_left > 0 else ""
        say(
            f"error: no lease of {format_size(amount)} on pool {pool!r} within {timeout}s "
            f"({'queue position ' + str(e.position) if e.position else 'not granted'}){why}; "
            f"exit {EXIT_TEMPFAIL}"
        )
        return EXIT_TEMPFAIL
    except GpuLockError as e:  # PoolNotFound too: the pool gone, and this pool object never saw it
        return _exit_code(e, t, pool)
    if n_devices is None:
        # the pool was gone before the acquire, which made it again: its devices, read before
        # CMD starts, decide the checks and the pinning as they would have before the acquire
        old = {
            s: signal.signal(s, lambda signum, frame: interrupted.append(signum)) for s in caught
        }
        try:
            n_devices = count_devices()
        except GpuLockError as e:
            release_lease(lease, pool)
            return _exit_code(e, t, pool)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        problem = _visible_problem(pool, pin, n_devices)
        if problem:
            release_lease(lease, pool)
            say(f"error: {problem}")
            return EXIT_USAGE
    if interrupted:  # a signal landed after the grant but before we could raise
        release_lease(lease, pool)
        return 128 + interrupted[0]
    if queued_at:
        info(
            f"granted {format_size(amount)} on pool {pool!r} after {time.monotonic() - queued_at[0]:.1f}s"
        )
    return supervise(lease, pool, amount, grace, cmd, enf, n_devices, yield_signal, quiet)


def _exit_code(e: GpuLockError, t: Target, pool: str) -> int:
    """The exit code :func:`error_exit` gives ``e`` (its line said on stderr), as a value."""
    try:
        error_exit(e, t, pool)
    except typer.Exit as x:
        return int(x.exit_code)


def _visible_problem(pool: str, pin: Optional[int], n_devices: int) -> Optional[str]:
    """What is wrong (None: nothing) when gpulock run's own CUDA_VISIBLE_DEVICES shows fewer
    GPUs than a lease on a pool of ``n_devices`` devices (``pin``: the one it is pinned to) may
    land on: device D is its D-th GPU, and a lease on a device past its end would run CMD on a
    GPU this environment hides. Exit 2 before anything is acquired (or, when the devices were
    known only after the grant, with the lease released)."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if n_devices <= 1 or inherited is None:
        return None
    shown = len(visible_entries(inherited))
    need = n_devices if pin is None else pin + 1
    if shown >= need:
        return None
    where = f"device {pin}" if pin is not None else f"any of pool {pool!r}'s {n_devices} devices"
    return (
        f"CUDA_VISIBLE_DEVICES={inherited!r} shows {shown} GPU(s), and the lease may be on "
        f"{where} (device D is its D-th GPU): unset CUDA_VISIBLE_DEVICES, list every GPU of "
        "the pool, or pin a device it shows (--pool NAME/D)"
    )


def _enforce_options(
    margin: str, slack: int, hold: float, device: int, reader_spec: str
) -> EnforceOptions:
    """``--enforce``'s options, checked before anything is acquired (exit 2 naming a bad one)."""
    from gpulock.devices import DeviceError, open_reader
    from gpulock.units import parse_fraction

    try:
        m = parse_fraction(margin, name="--enforce-margin")
    except GpuLockError as e:
        fail(EXIT_USAGE, str(e))
    try:
        reader = open_reader(reader_spec)
    except ValueError as e:
        fail(EXIT_USAGE, f"--device-reader: {e}")
    except DeviceError as e:
        fail(EXIT_USAGE, f"--enforce: {e}")
    # One read now: a reader that cannot see the device (or sees no process's use) would
    # enforce nothing, and a command run unwatched under --enforce is a silent failure.
    try:
        probe = reader.read(device)
    except DeviceError as e:
        fail(EXIT_USAGE, f"--enforce cannot read device {device} ({reader.name} reader): {e}")
    if probe.processes is None:
        fail(
            EXIT_USAGE,
            f"--enforce needs each process's device use; the {reader.name} reader has none on "
            f"device {device} (install nvidia-ml-py: pip install 'gpulock[gpu]')",
        )
    return EnforceOptions(reader, device, m, slack, hold)
