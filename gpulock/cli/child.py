"""CMD's process under ``gpulock run``'s lease: started in its own process group (dying with
gpulock), sent the signals gpulock gets, sent ``--yield-signal`` when the server asks the holder
to yield the lease (preemption), stopped (SIGTERM, then SIGKILL after the grace) when the lease
is lost or ``--enforce`` finds it over its lease; the lease released when it ends. Its exit
status is the command's."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any, Iterable, Optional

from gpulock.cli.common import (
    EXIT_LEASE_LOST,
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    EXIT_OVERUSE,
    RunLease,
    say,
)
from gpulock.errors import GpuLockError, LeaseLost
from gpulock.units import format_size, is_index

# Signals `gpulock run` passes on to CMD's process group while CMD runs.
FORWARDED_SIGNALS = tuple(
    getattr(signal, n)
    for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGWINCH")
    if hasattr(signal, n)
)


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


def not_ignored(sigs: Iterable[int]) -> list[int]:
    """Signals whose disposition is not SIG_IGN: an ignored one (``nohup``, ``cmd &`` in a
    script) stays ignored, in gpulock and in CMD, as it would without gpulock."""
    return [s for s in sigs if signal.getsignal(s) is not signal.SIG_IGN]


def visible_entries(inherited: str) -> list[str]:
    """The GPUs a CUDA_VISIBLE_DEVICES value shows ("2,3", or GPU UUIDs), as CUDA reads it:
    up to the first entry that names none (empty, or negative such as -1)."""
    out = []
    for e in inherited.split(","):
        e = e.strip()
        if not e or e.startswith("-"):
            break
        out.append(e)
    return out


def visible_gpu(device: int, inherited: Optional[str]) -> str:
    """The CUDA_VISIBLE_DEVICES entry for a pool's device ``device``: the ``device``-th GPU
    ``inherited`` (gpulock run's own CUDA_VISIBLE_DEVICES) shows when it is set (the caller
    checked it shows that many), else the device index itself (device D is GPU D)."""
    if inherited is None:
        return str(device)
    entries = visible_entries(inherited)
    return entries[device] if device < len(entries) else str(device)


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


@dataclass(frozen=True)
class EnforceOptions:
    """``--enforce``'s checked options: the device reader and index, the allowed excess over the
    lease (``margin``, a fraction, plus ``slack`` bytes) and how long CMD may stay over
    (``hold``, seconds). ``device`` -1: the GPU of the lease's device, known once it is
    granted (:func:`supervise` reads it)."""

    reader: Any  # a gpulock.devices.DeviceReader
    device: int
    margin: float
    slack: int
    hold: float


def release_lease(lease: RunLease, pool: str, *, wait: float = 6.0, quiet: bool = False) -> None:
    """Release, waiting at most ``wait`` seconds (an unreachable Redis would otherwise hold us
    for the socket timeout plus the retry bound); the lease expires after its ttl anyway."""
    problem: list[str] = []

    def go() -> None:
        try:
            lease.release()
        except LeaseLost as e:
            problem.append(f"lease on pool {pool!r} was already gone at release: {e.reason}")
        except GpuLockError as e:
            problem.append(
                f"could not release the lease on pool {pool!r} ({e}); it expires after its ttl"
            )

    t = threading.Thread(target=go, name="gpulock-run-release", daemon=True)
    t.start()
    t.join(wait)
    if t.is_alive():
        problem.append(
            f"Redis did not confirm the release within {wait:g}s; the lease on pool {pool!r} "
            f"expires after its ttl"
        )
    if problem and not quiet:
        say(f"warning: {problem[0]}")


def yield_note(lease: RunLease, pool: str, sig: Optional[int], pid: int) -> str:
    """The line said when the server asked the holder to yield ``lease`` (preemption): by when
    (seconds from now, on the lease's conservative local deadline) and what CMD (``pid``) is
    sent: signal ``sig``, or nothing (None)."""
    deadline = lease.yield_deadline
    left = "" if deadline is None else f" within {max(0.0, deadline - time.monotonic()):.1f}s"
    what = (
        f"sending {_signal_name(sig)} to CMD (pid {pid})"
        if sig is not None
        else f"CMD (pid {pid}) is not signalled (--yield-signal none)"
    )
    return (
        f"lease {lease.id[:8]}… on pool {pool!r} asked to yield to a request of higher "
        f"priority: release it{left} or the server takes it back (then CMD is stopped as on a "
        f"lost lease); {what}"
    )


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def supervise(
    lease: RunLease,
    pool: str,
    amount: int,
    grace: float,
    cmd: list[str],
    enf: Optional[EnforceOptions] = None,
    n_devices: int = 1,
    yield_signal: Optional[int] = signal.SIGTERM,
    quiet: bool = False,
) -> int:
    """Run ``cmd`` under ``lease`` and release it when CMD ends: the exit code (CMD's, or
    EXIT_LEASE_LOST, EXIT_OVERUSE, 126, 127). When the server asks the holder to yield the
    lease, CMD's process group gets ``yield_signal`` (None: nothing) once and a line says so
    on stderr (unless ``quiet``); the release after CMD exits is the normal one, and a lease
    taken back at the deadline is a lost lease."""
    env = dict(os.environ)
    env.update(
        GPULOCK_LEASE_ID=lease.id,
        GPULOCK_FENCING_TOKEN=str(lease.token),
        GPULOCK_POOL=pool,
        GPULOCK_AMOUNT=str(amount),
        GPULOCK_DEVICE=str(lease.device),
    )
    gpu = visible_gpu(lease.device, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if n_devices > 1:
        env["CUDA_VISIBLE_DEVICES"] = gpu
        # GPU D is NVML's (and nvidia-smi's) D: CUDA numbers GPUs so only in PCI bus order
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if enf is not None and enf.device < 0:  # --enforce reads the lease's GPU
        enf = replace(enf, device=int(gpu) if is_index(gpu) else lease.device)
    wake = threading.Event()
    lost_info: list[str] = []

    def on_lost(_lease: object) -> None:
        wake.set()

    import subprocess

    prctl = _prctl()
    parent = os.getpid()
    # The forwarding handler goes in before CMD starts: a signal that came between the start
    # and the handler killed gpulock run by the default action (CMD lived on, orphaned). One
    # that comes before CMD exists is kept and sent as soon as it does.
    pending: list[int] = []
    started: list[subprocess.Popen[bytes]] = []
    exited = threading.Event()

    def forward(signum: int, frame: FrameType | None) -> None:
        if not started:
            pending.append(signum)
        elif not exited.is_set():
            send(signum)

    old = {s: signal.signal(s, forward) for s in not_ignored(FORWARDED_SIGNALS)}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    try:
        proc = subprocess.Popen(cmd, env=env, preexec_fn=lambda: _child_setup(parent, prctl))
    except FileNotFoundError as e:
        restore()
        release_lease(lease, pool)
        say(f"error: command not found: {cmd[0]!r} ({e.strerror})")
        return EXIT_NOT_FOUND
    except PermissionError as e:
        restore()
        release_lease(lease, pool)
        say(f"error: cannot execute {cmd[0]!r}: {e.strerror}")
        return EXIT_NOT_EXECUTABLE
    except OSError as e:
        restore()
        release_lease(lease, pool)
        say(f"error: cannot start {cmd[0]!r}: {e}")
        return EXIT_NOT_EXECUTABLE

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

    started.append(proc)  # from here the handler sends; what came before is sent now
    for sig in pending:
        send(sig)

    def stop_child() -> None:
        """SIGTERM CMD's process group, then SIGKILL it after ``grace`` s; wait until it exited."""
        send(signal.SIGTERM)
        if not exited.wait(grace):
            say(f"CMD (pid {proc.pid}) still running after {grace:g}s; sending SIGKILL")
            send(signal.SIGKILL)
            exited.wait()

    lease.on_lost(on_lost)
    asked: list[bool] = []  # the server asked the holder to yield; told CMD once

    def on_yield(_lease: object) -> None:
        asked.append(True)
        wake.set()

    lease.on_yield(on_yield)
    yield_told = False
    breach: list[Any] = []
    enforcer = None
    if enf is not None:
        from gpulock.devices.enforce import Enforcer

        def on_over(b: Any) -> None:
            breach.append(b)
            wake.set()

        enforcer = Enforcer(
            enf.reader,
            enf.device,
            proc.pid,
            amount,
            margin=enf.margin,
            slack=enf.slack,
            hold=enf.hold,
            on_over=on_over,
            on_note=lambda text: say(f"warning: {text}"),
        )
        enforcer.start()
    try:
        while not exited.is_set():
            # Wake at the lease's local validity deadline too (on_lost should fire then; this
            # is the belt to its braces), or at once when CMD exits or on_lost fires.
            delay = lease.valid_until - time.monotonic()
            wake.wait(min(max(delay, 0.0), 5.0) + 0.001)
            wake.clear()
            if exited.is_set() or breach:
                break
            if asked and not yield_told:
                yield_told = True
                if not quiet:
                    say(yield_note(lease, pool, yield_signal, proc.pid))
                if yield_signal is not None:
                    send(yield_signal)
            try:
                lease.ensure_valid()
            except LeaseLost as e:
                lost_info.append(e.reason)
                break
        if lost_info:
            say(
                f"error: lease {lease.id[:8]}… on pool {pool!r} lost while CMD (pid {proc.pid}) ran: "
                f"{lost_info[0]}; sending SIGTERM, SIGKILL in {grace:g}s"
            )
            stop_child()
            say(
                f"CMD stopped ({_describe(proc.returncode)}) after the lease was lost; exit {EXIT_LEASE_LOST}"
            )
            release_lease(
                lease, pool, wait=1.0, quiet=True
            )  # frees the bytes early if Redis still has it
            return EXIT_LEASE_LOST
        if breach and not exited.is_set():
            b = breach[0]
            say(
                f"error: CMD (pid {proc.pid}) uses {format_size(b.actual)} ({b.actual} bytes) of "
                f"device memory for a lease of {format_size(b.leased)} ({b.leased} bytes) on pool "
                f"{pool!r}, {format_size(b.actual - b.leased)} over for {b.over_for:.1f}s "
                f"(--enforce); sending SIGTERM, SIGKILL in {grace:g}s"
            )
            stop_child()
            say(
                f"CMD stopped ({_describe(proc.returncode)}) for using more device memory than "
                f"its lease; exit {EXIT_OVERUSE}"
            )
            release_lease(lease, pool)
            return EXIT_OVERUSE
    finally:
        if enforcer is not None:
            enforcer.stop()
        restore()
    release_lease(lease, pool)
    return _exit_status(proc.returncode)


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"
