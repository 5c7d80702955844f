"""``gpulock run``: run a command while holding a lease (``flock(1)`` for GPU memory),
through Redis or through an HTTP broker, with one exit-code contract for both."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import time
from dataclasses import replace
from types import FrameType
from typing import Any, Optional

import typer
from gpulock_common.grace import grace_note
from gpulock_common.options import (
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
from gpulock.errors import AcquireTimeout, GpuLockError
from gpulock.units import format_size, is_index

DEFAULT_RUN_TTL_S = 30.0
DEFAULT_GRACE_S = 10.0


class _Signalled(BaseException):
    """Raised in the main thread by a signal that arrives while waiting for the lease."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _clip(text: str, limit: int = 300) -> str:
    """Shorten ``text`` so that it takes at most ``limit`` bytes as JSON (holder metadata is
    limited to 512 bytes in all; non-ASCII characters take up to 6)."""
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

    if t.is_broker:
        from gpulock.cli.broker import BrokerAdmin, BrokerPool

        try:  # the broker's least ttl (its holder renews over HTTP), said before anything is sent
            check_seconds(ttl, name="--ttl", minimum=MIN_REMOTE_TTL_S, maximum=MAX_TTL_S)
        except GpuLockError as e:
            fail(EXIT_USAGE, f"{e} (through a broker)")
        b = BrokerAdmin(t.url)  # fail fast (69, 77, 66) if the broker is down or refuses the token
        try:
            n_devices = len(b.call("GET", f"/v1/pools/{pool}", pool).get("devices") or [0])
        except GpuLockError as e:
            error_exit(e, t, pool)
        finally:
            b.close()
        p: RunPool = BrokerPool(t.url, pool, default_ttl=ttl)
    else:
        from gpulock.runtime.calls import DEFAULT_BACKEND_TIMEOUT_S

        redis_client(t.url).close()  # fail fast (exit 69) if Redis is down now
        # --timeout is the time to get the lease: the calls before the acquire ride out a
        # failover or a migration as long as the acquire itself would
        p = Pool.from_url(
            t.url,
            pool,
            default_ttl=ttl,
            backend_timeout=max(DEFAULT_BACKEND_TIMEOUT_S, timeout or 0.0),
        )
        try:
            n_devices = len(p.status(limit=0).devices)
        except GpuLockError as e:
            p.close()
            error_exit(e, t, pool)
    if n_devices > 1 and "CUDA_VISIBLE_DEVICES" in os.environ:
        _check_visible(p, pool, pin, n_devices, os.environ["CUDA_VISIBLE_DEVICES"])
    if enf is not None and device is None and n_devices > 1:
        enf = replace(enf, device=-1)  # the lease's GPU, once it is granted
    try:
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
            time.monotonic() - started,
        )
    finally:
        p.close()
    raise typer.Exit(code)


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
    enf: Optional[EnforceOptions] = None,
    priority: int = 0,
    tenant: Optional[str] = None,
    pin: Optional[int] = None,
    n_devices: int = 1,
    spent: float = 0.0,
) -> int:
    """Acquire (within what is left of ``timeout`` after the ``spent`` seconds of the calls
    before), then run CMD under the lease: the exit code."""
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

    old = {
        s: signal.signal(s, wait_handler)
        for s in not_ignored((signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
    }
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
    except GpuLockError as e:
        try:
            error_exit(e, t, pool)
        except typer.Exit as x:
            return x.exit_code
    if interrupted:  # a signal landed after the grant but before we could raise
        release_lease(lease, pool)
        return 128 + interrupted[0]
    if queued_at:
        info(
            f"granted {format_size(amount)} on pool {pool!r} after {time.monotonic() - queued_at[0]:.1f}s"
        )
    return supervise(lease, pool, amount, grace, cmd, enf, n_devices)


def _check_visible(
    p: RunPool, pool: str, pin: Optional[int], n_devices: int, inherited: str
) -> None:
    """Exit 2 (before anything is acquired) when gpulock run's own CUDA_VISIBLE_DEVICES shows
    fewer GPUs than the lease may land on: device D is its D-th GPU, and a lease on a device
    past its end would run CMD on a GPU this environment hides."""
    shown = len(visible_entries(inherited))
    need = n_devices if pin is None else pin + 1
    if shown >= need:
        return
    p.close()
    where = f"device {pin}" if pin is not None else f"any of pool {pool!r}'s {n_devices} devices"
    fail(
        EXIT_USAGE,
        f"CUDA_VISIBLE_DEVICES={inherited!r} shows {shown} GPU(s), and the lease may be on "
        f"{where} (device D is its D-th GPU): unset CUDA_VISIBLE_DEVICES, list every GPU of "
        "the pool, or pin a device it shows (--pool NAME/D)",
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
