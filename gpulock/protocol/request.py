"""The request vocabulary of the core: :class:`AcquireRequest`, a validated acquire (from the
pool's name, the amount and the :class:`~gpulock_common.options.AcquireOptions`) and the ARGV of
``acquire.lua`` it makes. No I/O; ``protocol/flow.py`` builds the operations from it and from
``protocol/args.py`` (validation and encoding), ``protocol/replies.py`` (reply decoding),
``protocol/retry.py`` (the retry policy) and ``protocol/lease.py`` (the lease's local
validity clock).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from gpulock_common.options import AcquireOptions as AcquireOptions

from gpulock.protocol.args import (
    MAX_TTL_S,
    MIN_TTL_S,
    encode_meta,
    new_id,
    validate_request_id,
)
from gpulock.units import parse_seconds, parse_size

# imported from here by runtime/runtime.py; moves with its split
from gpulock.protocol.args import DEFAULT_MAX_WAITERS as DEFAULT_MAX_WAITERS
from gpulock.protocol.args import DEFAULT_POLL_INTERVAL_S as DEFAULT_POLL_INTERVAL_S
from gpulock.protocol.args import ttl_ms as ttl_ms
from gpulock.protocol.lease import LeaseState as LeaseState
from gpulock.protocol.lease import validity_deadline as validity_deadline
from gpulock.protocol.replies import REASSERT_REFUSED as REASSERT_REFUSED
from gpulock.protocol.replies import Grant as Grant
from gpulock.protocol.replies import decode_acquire as decode_acquire
from gpulock.protocol.replies import decode_events as decode_events
from gpulock.protocol.replies import decode_status as decode_status
from gpulock.protocol.retry import retry_delay as retry_delay


@lru_cache(maxsize=64)
def _ms_arg(seconds: float) -> str:
    """A ttl in seconds as ``acquire.lua``'s milliseconds argument (a pool's few ttls, cached:
    this runs on every acquire)."""
    return str(ttl_ms(seconds))


class AcquireRequest(NamedTuple):
    """A validated acquire: everything the script needs, plus the caller's timeout. Immutable:
    a named tuple, the cheapest immutable record to make on every acquire (docs/BENCHMARKS.md,
    section 9)."""

    pool: str
    amount: int
    ttl_s: float
    timeout_s: float | None
    ticket: str
    lease_id: str
    meta: str
    waiter_ttl_s: float
    priority: int = 0
    tenant: str = ""  # "" for none
    device: int | None = None  # the device it pins (docs/SEMANTICS.md, "Devices"); None: any
    resident: bool = False  # held for its holder's life (docs/SEMANTICS.md, "Resident leases")
    preemptible: bool = True  # False: the server never asks it to yield (preemption)
    keepable: bool = True  # no request id, not resident: its lease may be kept (protocol/keep.py)

    @classmethod
    def build(
        cls,
        pool: str,
        amount: int | float | str,
        options: AcquireOptions,
        *,
        waiter_ttl: float,
        default_ttl: float,
    ) -> "AcquireRequest":
        """``options`` checked (the vocabulary's checks, then the core's: ttl, timeout,
        request id, holder metadata) with the pool object's ``waiter_ttl`` and ``default_ttl``
        (seconds). Raises InvalidArgument naming the first bad value."""
        amt = parse_size(amount)
        o = options
        ttl_s = parse_seconds(
            default_ttl if o.ttl is None else o.ttl,
            name="ttl",
            minimum=MIN_TTL_S,
            maximum=MAX_TTL_S,
        )
        o = o.checked()  # the timeout first (as seconds), then priority, device, tenant, ...
        ticket = new_id() if o.request_id is None else validate_request_id(o.request_id)
        return cls(
            pool,
            amt,
            ttl_s,
            o.timeout,
            ticket,
            new_id(),
            encode_meta(o.holder),
            waiter_ttl,
            o.priority,
            o.tenant or "",
            o.device,
            o.resident,
            o.preemptible,
            o.request_id is None and not o.resident,
        )

    def argv(self, mode: str, channel: str) -> list[str]:
        """ARGV of ``acquire.lua``; ``channel`` is the caller runtime's pub/sub channel id."""
        argv = [
            self.ticket,
            self.lease_id,
            str(self.amount),
            _ms_arg(self.ttl_s),
            _ms_arg(self.waiter_ttl_s),
            mode,
            self.meta,
            channel,
            str(self.priority),
        ]
        keep = not self.preemptible  # ARGV 13 '0'; absent (''): may be asked
        if self.tenant or self.device is not None or self.resident or keep:
            argv.append(self.tenant)
        if self.device is not None or self.resident or keep:
            argv.append("" if self.device is None else str(self.device))
        if self.resident or keep:
            argv.append("resident" if self.resident else "")
        if keep:
            argv.append("0")
        return argv
