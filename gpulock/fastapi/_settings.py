"""The settings of one :class:`~gpulock.fastapi.GpuLimiter`, shared by its parts (which read
them when they use them)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from gpulock_common.options import check_max_waiters

from gpulock.protocol.args import MAX_KEEP_S, validate_tenant
from gpulock.errors import InvalidArgument
from gpulock.units import parse_seconds, parse_size


@dataclass
class Settings:
    """What ``GpuLimiter(...)`` was given; the arguments are documented there. Sizes in
    bytes, times in seconds."""

    redis_url: str
    pool_name: str
    capacity: int | None
    configure_mode: str
    acquire_timeout: float
    inference_timeout: float
    ttl: float
    executor_threads: int
    park_timeout: float
    result_ttl: float
    max_retry_after: float
    max_waiters: int | None
    reaper_interval: float
    history_file: str | None
    enabled: bool
    exit_on_fatal: bool
    request_id_header: str
    priority_header: str | None = None
    tenant: str | None = None
    keep: float = 0.0

    @classmethod
    def of(
        cls,
        redis_url: str,
        pool: str,
        *,
        capacity: int | str | None,
        configure: str,
        executor_threads: int,
        history_file: str | None,
        **rest: Any,
    ) -> Settings:
        """Settings from ``GpuLimiter``'s arguments: ``pool`` is ``pool_name``, ``configure``
        ``configure_mode``, a ``capacity`` of None or "" none, a ``history_file`` of None env
        ``GPULOCK_HISTORY_FILE``; the times become floats.

        Raises: InvalidArgument for a ``configure`` other than "create"/"set", fewer than one
        executor thread, a capacity that is not a size, a ``priority_header`` that is not
        a header name, a ``tenant`` that is not a tenant name (1-64 of [A-Za-z0-9._:-]), a
        ``keep`` that is neither 0 nor 0.1-3600 seconds (:func:`check_keep`), or a
        ``max_waiters`` outside the pool's bounds (:func:`gpulock_common.options.check_max_waiters`)."""
        if configure not in ("create", "set"):
            raise InvalidArgument(f"configure must be 'create' or 'set', got {configure!r}")
        if int(executor_threads) < 1:
            raise InvalidArgument(f"executor_threads must be >= 1, got {executor_threads!r}")
        ph = rest.get("priority_header")
        if ph is not None and (not isinstance(ph, str) or not _HEADER_NAME.fullmatch(ph)):
            raise InvalidArgument(
                f"priority_header must be None or an HTTP header name, got {ph!r:.80}"
            )
        rest["tenant"] = validate_tenant(rest.get("tenant")) or None
        rest["keep"] = check_keep(rest.get("keep", 0.0))
        if rest.get("max_waiters") is not None:  # the pool's queue bound: the vocabulary's
            rest["max_waiters"] = check_max_waiters(rest["max_waiters"])
        for name in _SECONDS:
            rest[name] = float(rest[name])
        return cls(
            redis_url=redis_url,
            pool_name=pool,
            capacity=None if capacity in (None, "") else parse_size(capacity, name="capacity"),
            configure_mode=configure,
            executor_threads=int(executor_threads),
            history_file=(
                history_file if history_file is not None else os.environ.get("GPULOCK_HISTORY_FILE")
            ),
            **rest,
        )


def check_keep(keep: int | float | str | None) -> float:
    """``keep`` as seconds (float): 0 (off) or 0.1 to 3600 (the core's bound,
    ``MAX_KEEP_S``); a string of a number is read as one (the service's ``GPULOCK_KEEP``).

    Raises: InvalidArgument naming ``keep`` and the value."""
    try:
        return parse_seconds(
            keep,
            name="keep",
            minimum=0.1,
            maximum=MAX_KEEP_S,
            allow_zero=True,
        )
    except InvalidArgument as e:
        raise InvalidArgument(f"{e} (0: off, the default)") from None


# RFC 9110's token: the characters of a header's name
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}")

_SECONDS = (
    "acquire_timeout",
    "inference_timeout",
    "ttl",
    "park_timeout",
    "result_ttl",
    "max_retry_after",
    "reaper_interval",
)
