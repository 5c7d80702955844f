"""Per-shape estimates: measured CUDA peaks per shape bucket, stored in the pool's estimates
hash where every worker finds them, and the formula they replace."""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable
from typing import Any

from ._backend import Backend
from ._backoff import note_bucket
from ._settings import Settings


def next_bucket(n: int, *, minimum: int = 1) -> int:
    """The next power of two ≥ n (and ≥ minimum): the shape buckets calibration measures."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


def _field(route: str, batch: int, tokens: int) -> str:
    return f"{route}|b{next_bucket(batch)}|s{next_bucket(tokens, minimum=8)}"


class Estimates:
    """This worker's cache of the pool's calibrated estimates.

    Args:
        settings: ``acquire_timeout`` bounds each calibration lease's wait (× 6).
        backend: the pool, its Redis client and executor, and its last status.
        scale: a bucket's OOM back-off multiplier now (≥ 1; see :mod:`gpulock.oom_backoff`).
    """

    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        scale: Callable[[str], float] = lambda bucket: 1.0,
    ):
        self._settings = settings
        self._backend = backend
        self._scale = scale
        self.cache: dict[str, int] = {}

    @property
    def key(self) -> str:
        """``gpulock:{pool}:estimates``: hash of calibrated per-shape peaks, field
        ``<route>|b<batch bucket>|s<token bucket>`` → bytes."""
        return self._backend.key("estimates")

    async def refresh(self) -> dict[str, int]:
        """Reload the calibrated per-shape estimates from Redis into this worker's cache."""
        raw = await self._backend.command("HGETALL", self.key)
        pairs = raw.items() if isinstance(raw, dict) else zip(raw[::2], raw[1::2])  # RESP3/2
        self.cache = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in pairs}
        return self.cache

    def estimate(
        self, route: str, batch: int, tokens: int, formula: Callable[[int, int], int]
    ) -> int:
        """Bytes for a request of ``batch`` × ``tokens`` on ``route``: the calibrated peak of
        its shape bucket (next power of two of each) when one was measured, else
        ``formula(batch, tokens)``; times the bucket's OOM back-off scale (1 unless an OOM
        raised it). The bucket is noted for the job this task starts next, whose OOM raises
        it (:func:`gpulock.fastapi._backoff.note_bucket`)."""
        field = _field(route, batch, tokens)
        note_bucket(field)
        v = self.cache.get(field)
        base = max(1, v) if v is not None else int(formula(batch, tokens))
        scale = self._scale(field)
        return base if scale <= 1.0 else math.ceil(base * scale)

    async def calibrate(
        self,
        route: str,
        run_shape: Callable[[int, int], Any],
        shapes: list[tuple[int, int]],
        device: str,
        formula: Callable[[int, int], int],
        *,
        margin: float = 1.1,
    ) -> dict[str, int]:
        """Measure the peak CUDA memory of ``run_shape(batch, tokens)`` for each shape (under a
        lease of the formula's estimate × 2, so nothing runs unleased) with
        ``torch.cuda.max_memory_allocated``, and store ``ceil(peak × margin)`` per shape bucket
        in the pool's estimates hash, where every worker's :meth:`estimate` finds it.

        Raises: RuntimeError on a CPU device."""
        from gpulock.cuda import measure_peak

        if not device.startswith("cuda"):
            raise RuntimeError("calibration measures CUDA peaks; the device is " + device)
        be = self._backend
        assert be.pool is not None and be.executor is not None and be.redis is not None
        out: dict[str, int] = {}
        for batch, tokens in shapes:
            b, s = next_bucket(batch), next_bucket(tokens, minimum=8)
            amount = min(
                2 * int(formula(b, s)),
                be.status.capacity if be.status else 2 * int(formula(b, s)),
            )
            async with be.pool.lease(
                amount,
                timeout=self._settings.acquire_timeout * 6,
                holder={"purpose": "calibration"},
                tenant=self._settings.tenant,
            ) as lease:
                lease.ensure_valid()
                peak = await asyncio.get_running_loop().run_in_executor(
                    be.executor, measure_peak, functools.partial(run_shape, b, s), device
                )
            out[f"{route}|b{b}|s{s}"] = max(1, math.ceil(peak * margin))
        if out:
            await be.command("HSET", self.key, *(w for kv in out.items() for w in kv))
            self.cache.update(out)
        return out
