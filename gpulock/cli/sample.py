"""``gpulock sample``: the device sampler as a command (one per host and device; any number may
run, one samples: :mod:`gpulock.devices.sampler`)."""

from __future__ import annotations

import asyncio
import logging
import signal

import typer

from gpulock.cli.common import (
    EXIT_USAGE,
    error_exit,
    fail,
    pool_name_param,
    say,
    seconds_param,
    target,
)
from gpulock.devices.sampler import (
    DEFAULT_INTERVAL,
    DEFAULT_REPORT_TTL,
    DeviceSampler,
    SamplerRound,
)
from gpulock.errors import GpuLockError
from gpulock.units import format_size


def sample(
    ctx: typer.Context,
    pool: str = typer.Option(
        ..., "--pool", "-p", callback=pool_name_param, help="The pool that stands for the device."
    ),
    device: int = typer.Option(0, "--device", min=0, max=1023, help="The device index."),
    device_reader: str = typer.Option(
        "auto",
        "--device-reader",
        help="auto, nvml, torch or fake:PATH (auto: $GPULOCK_FAKE_DEVICES, else NVML, else torch).",
    ),
    interval: float = typer.Option(
        DEFAULT_INTERVAL,
        "--interval",
        callback=seconds_param("--interval", minimum=0.05, maximum=3600),
        help="Seconds between samples.",
    ),
    report_ttl: float = typer.Option(
        DEFAULT_REPORT_TTL,
        "--report-ttl",
        callback=seconds_param("--report-ttl", minimum=0.1, maximum=86400),
        help="Seconds a report counts (at least two intervals): a sampler that dies stops "
        "holding bytes back after this long.",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only warnings and errors on stderr."),
) -> None:
    """Reconcile POOL with the device's real memory: publish the memory in use outside the
    pool's leases (the pool then grants at most capacity minus that), and flag holders that use
    more than they lease. Runs until SIGINT or SIGTERM. Run one per host and device, or more:
    one of them samples, the others stand by and take over when it dies."""
    from gpulock._async import AsyncPool
    from gpulock.devices import DeviceError, open_reader

    t = target(ctx)
    try:
        reader = open_reader(device_reader)
    except ValueError as e:
        fail(EXIT_USAGE, f"--device-reader: {e}")
    except DeviceError as e:
        fail(EXIT_USAGE, str(e))
    iv, rt = float(interval or DEFAULT_INTERVAL), float(report_ttl or DEFAULT_REPORT_TTL)
    if rt < 2 * iv:
        fail(
            EXIT_USAGE,
            f"--report-ttl ({rt:g} s) must be at least two --interval ({iv:g} s "
            f"each): a report must outlive a late round",
        )
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")

    async def main() -> None:
        from gpulock_common.aio import stop_tasks

        p = AsyncPool.from_url(t.url, pool)
        try:
            s = DeviceSampler(p, reader, device, interval=iv, report_ttl=rt)
        except ValueError as e:
            await p.aclose()
            fail(EXIT_USAGE, str(e))
        await p.status(limit=0)  # exits 66 / 69 now if the pool is missing or Redis is down
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        task = asyncio.create_task(_rounds(s, quiet))
        try:
            await stop.wait()
        finally:
            await stop_tasks([task])
            await p.aclose()

    try:
        asyncio.run(main())
    except GpuLockError as e:
        error_exit(e, t, pool)


async def _rounds(s: DeviceSampler, quiet: bool) -> None:
    """The sampler's rounds, saying on stderr when it starts or stops sampling and when the
    published external use changes."""
    last: list[SamplerRound] = []

    def said(r: SamplerRound) -> None:
        prev = last[0] if last else None
        if not quiet:
            name = f"pool {s.pool.name!r} device {s.device}"
            if prev is None or r.holder != prev.holder:
                say(
                    f"{name}: "
                    + ("sampling (this process holds the claim)" if r.holder else "standing by")
                )
            if r.holder and (prev is None or r.external != prev.external):
                say(f"{name}: external use {format_size(r.external)} ({r.external} bytes)")
        last[:] = [r]

    await s.run(said)
