"""Argument validation and encoding of the core: pool names, request ids, fencing tokens, a pool
object's settings, capacities, random ids, holder metadata (JSON, at most 512 bytes) and ttls
in milliseconds, with the default lease and waiter timings. No I/O.

Raises :class:`~gpulock.errors.InvalidArgument` for a bad value (and
:class:`~gpulock.errors.CapacityExceeded` for an amount over a known capacity).
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import threading
from typing import Any, Mapping

from gpulock_common.options import AGING_S as AGING_S
from gpulock_common.options import DEFAULT_MAX_TTL_S as DEFAULT_MAX_TTL_S
from gpulock_common.options import DEFAULT_MAX_WAITERS as DEFAULT_MAX_WAITERS
from gpulock_common.options import DEFAULT_TTL_S as DEFAULT_TTL_S
from gpulock_common.options import MAX_DEVICES as MAX_DEVICES
from gpulock_common.options import MAX_META_BYTES as MAX_META_BYTES
from gpulock_common.options import MAX_TTL_S as MAX_TTL_S
from gpulock_common.options import MIN_TTL_S as MIN_TTL_S
from gpulock_common.options import PLACEMENTS as PLACEMENTS
from gpulock_common.options import PRIORITY_MAX as PRIORITY_MAX
from gpulock_common.options import PRIORITY_MIN as PRIORITY_MIN
from gpulock_common.options import TENANT_PATTERN
from gpulock_common.options import check_device, check_placement, check_request_id
from gpulock_common.options import check_holder, check_resident, check_tenant

from gpulock.errors import CapacityExceeded, InvalidArgument
from gpulock.protocol.keys import POOL_NAME_RE
from gpulock.units import MAX_BYTES, parse_seconds, parse_size

# Lease and waiter timing (seconds). The lease's ttl bounds and default are the vocabulary's
# (gpulock_common.options); the heartbeat renews at ttl/3 (as etcd and Redisson do), which
# survives two lost heartbeats before expiry.
DEFAULT_WAITER_TTL_S = 5.0
# Waiters refresh their expiry (and re-poll as a backstop for a lost pub/sub message) this often.
DEFAULT_POLL_INTERVAL_S = 1.0
# The longest ttl a lease may have in a pool this library creates (``max_ttl``) is the
# vocabulary's DEFAULT_MAX_TTL_S, as are a pool's other settings' bounds.


def validate_pool_name(name: object) -> str:
    """Pool names: 1-64 characters of ``[A-Za-z0-9._-]``. No braces (they would break the
    hash tag), colons (the key separator) or spaces."""
    if not isinstance(name, str) or not POOL_NAME_RE.fullmatch(name):
        raise InvalidArgument(f"pool name must be 1-64 characters of [A-Za-z0-9._-], got {name!r}")
    return name


# Request ids, tenants, devices, placements, ``resident``: the vocabulary's checks (gpulock_common.options),
# which the SDK makes too (a priority's: AcquireOptions.checked).
validate_tenant = check_tenant
validate_request_id = check_request_id
validate_device = check_device
validate_resident = check_resident
validate_placement = check_placement
TENANT_RE = re.compile(TENANT_PATTERN)


def encode_quotas(quotas: object) -> str:
    """``configure``'s tenant quotas as ``configure.lua`` takes them: a mapping of tenant to
    bytes or a size ("4GiB"; 0, "0", None or "none" removes that tenant's quota), as
    ``"<tenant>=<bytes> ..."``. Raises InvalidArgument naming the bad tenant or size."""
    if not isinstance(quotas, Mapping):
        raise InvalidArgument(f"quotas must be a mapping of tenant to size, got {quotas!r:.80}")
    items = []
    for tenant, size in quotas.items():
        t = validate_tenant(tenant)
        if not t:
            raise InvalidArgument("quotas: a tenant must be named, got an empty name")
        if isinstance(size, bool):
            raise InvalidArgument(f"quota of tenant {t!r} must be a size, got {size!r}")
        try:
            b = 0 if removes_quota(size) else parse_size(size)
        except InvalidArgument as e:
            raise InvalidArgument(f"quota of tenant {t!r}: {e} (0 or none removes it)") from None
        items.append(f"{t}={b}")
    return " ".join(items)


def removes_quota(size: object) -> bool:
    """Whether a quota's size means "no quota": 0, None, or the text "0" or "none"."""
    if size is None or (isinstance(size, int) and size == 0):
        return True
    return isinstance(size, str) and size.strip().lower() in ("0", "none")


def decode_quotas(spec: str) -> dict[str, int]:
    """``configure.lua``'s reply of the pool's quotas (``"<tenant>=<bytes> ..."``) as a dict."""
    out = {}
    for item in spec.split():
        t, _, b = item.partition("=")
        out[t] = int(b)
    return out


def validate_token(token: object) -> int:
    """A fencing token from outside (a remote holder's): a non-negative integer, or its
    decimal digits."""
    if isinstance(token, str) and token.isascii() and token.isdigit() and len(token) <= 16:
        token = int(token)
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= 2**53 - 1:
        raise InvalidArgument(f"token must be a non-negative integer, got {token!r:.80}")
    return token


def validate_lease_id(lease_id: object) -> str:
    """A lease id from outside (a remote holder's): 32 hex digits."""
    if (
        not isinstance(lease_id, str)
        or len(lease_id) != 32
        or not all(c in "0123456789abcdefABCDEF" for c in lease_id)
    ):
        raise InvalidArgument(f"lease id must be 32 hex digits, got {lease_id!r:.80}")
    return lease_id


#: The longest ``keep`` (seconds) a pool object may keep an idle kept lease.
MAX_KEEP_S = 3600.0


class PoolOptions:
    """The validated settings both shells carry as attributes (meanings and units:
    :class:`gpulock.AsyncPool`), set by :meth:`_set_options` from :func:`pool_settings`."""

    name: str
    capacity: int | None
    default_ttl: float
    waiter_ttl: float
    poll_interval: float
    max_waiters: int
    backend_timeout: float
    max_ttl: float
    sync_replicas: int
    sync_timeout: float
    keep: float

    def _set_options(self, name: str, **settings: Any) -> None:
        """Validate (:func:`pool_settings`, which raises InvalidArgument) and set them."""
        for k, v in pool_settings(name, **settings).items():
            setattr(self, k, v)


def pool_settings(
    name: str,
    *,
    capacity: int | str | None,
    default_ttl: float,
    waiter_ttl: float,
    poll_interval: float,
    max_waiters: int,
    backend_timeout: float,
    max_ttl: float | None,
    sync_replicas: int,
    sync_timeout: float,
    keep: float = 0.0,
) -> dict[str, Any]:
    """Validate a pool object's settings, for both shells (see ``AsyncPool`` for their meaning
    and units). Returns the attribute values; raises InvalidArgument naming a bad one."""
    dttl = parse_seconds(default_ttl, name="default_ttl", minimum=MIN_TTL_S, maximum=MAX_TTL_S)
    mttl = parse_seconds(
        max(DEFAULT_MAX_TTL_S, dttl) if max_ttl is None else max_ttl,
        name="max_ttl",
        minimum=MIN_TTL_S,
        maximum=MAX_TTL_S,
    )
    if dttl > mttl:
        raise InvalidArgument(f"default_ttl {default_ttl!r} is longer than max_ttl {mttl!r}")
    if (
        not isinstance(sync_replicas, int)
        or isinstance(sync_replicas, bool)
        or not 0 <= sync_replicas <= 16
    ):
        raise InvalidArgument(f"sync_replicas must be an integer in [0, 16], got {sync_replicas!r}")
    return {
        "name": validate_pool_name(name),
        "capacity": None if capacity is None else parse_size(capacity, name="capacity"),
        "default_ttl": default_ttl,
        "waiter_ttl": waiter_ttl,
        "poll_interval": poll_interval,
        "max_waiters": max_waiters,
        "backend_timeout": backend_timeout,
        "max_ttl": mttl,
        "sync_replicas": sync_replicas,
        "sync_timeout": parse_seconds(
            sync_timeout, name="sync_timeout", minimum=0.001, maximum=60.0
        ),
        # 0: off; else how long an idle kept lease is kept (protocol/keep.py)
        "keep": parse_seconds(keep, name="keep", minimum=0.1, maximum=MAX_KEEP_S, allow_zero=True),
    }


def configure_capacity(capacity: int | str | None, current: int | None) -> int:
    """The capacity a pool object's ``configure`` sets (bytes): the one given, else the pool
    object's own. Raises InvalidArgument for a bad one, or when neither is there."""
    value = capacity if capacity is not None else current
    if value is None:
        raise InvalidArgument("capacity must be a size in bytes, got None")
    return parse_size(value, name="capacity")


_ID_BYTES = 16
_RANDOM = bytearray()  # random bytes not yet used: os.urandom, drawn 1 KiB at a time
_RANDOM_LOCK = threading.Lock()
# A forked child must not hand out the ids its parent will also hand out.
os.register_at_fork(after_in_child=_RANDOM.clear)


def new_id() -> str:
    """A 128-bit random id as 32 hex digits (lease ids and default tickets), from
    ``os.urandom`` (one system call per 64 ids)."""
    with _RANDOM_LOCK:
        if len(_RANDOM) < _ID_BYTES:
            _RANDOM.extend(os.urandom(64 * _ID_BYTES))
        b = _RANDOM[-_ID_BYTES:]
        del _RANDOM[-_ID_BYTES:]
    return b.hex()


_HOST = socket.gethostname()
_DEFAULT_META: dict[str, str] = {}  # "": the default metadata of this process
os.register_at_fork(after_in_child=_DEFAULT_META.clear)  # the child's pid is another


def encode_meta(holder: dict[str, Any] | None) -> str:
    """Holder metadata as compact JSON (at most 512 bytes). Host and pid are added unless
    given, so ``gpulock status`` can say who holds what."""
    if not holder:
        cached = _DEFAULT_META.get("")
        if cached is None:
            cached = _DEFAULT_META[""] = json.dumps(
                {"host": _HOST, "pid": os.getpid()}, separators=(",", ":")
            )
        return cached
    meta = {"host": _HOST, "pid": os.getpid()}
    if holder:
        meta.update(check_holder(holder) or {})
    try:
        # allow_nan=False: NaN and infinities are not JSON (every reader of the record, `gpulock
        # status --json` too, would then write what strict parsers refuse; the broker refuses
        # them in its requests the same way)
        s = json.dumps(meta, separators=(",", ":"), default=str, ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        odd = [k for k, v in meta.items() if isinstance(v, float) and not math.isfinite(v)]
        if odd:
            raise InvalidArgument(
                f"holder metadata {odd[0]!r} is {meta[odd[0]]!r}: JSON has no NaN or infinity"
            ) from None
        raise InvalidArgument(f"holder metadata is not JSON-serialisable: {e}") from None
    # ensure_ascii writes a lone surrogate ("\ud800") as its escape, which every reader then
    # decodes back to a str that cannot be encoded as UTF-8 (the broker's status was a 500 for
    # as long as the lease lived). Escapes of surrogates only appear for such text or for
    # characters outside the BMP (json writes lower-case hex), so the exact check runs only then.
    if "\\ud" in s:
        bad = meta_unicode_error(meta)
        if bad:
            raise InvalidArgument(bad)
    if len(s) > MAX_META_BYTES:
        raise InvalidArgument(
            f"holder metadata is {len(s)} bytes as JSON; at most {MAX_META_BYTES}"
        )
    return s


def meta_unicode_error(holder: dict[str, Any]) -> str | None:
    """None when every key and value of ``holder`` can be written as JSON in UTF-8, else a
    message naming the first one that cannot (it holds a lone surrogate such as ``"\\ud800"``,
    which Python's JSON parser accepts in input). The one check of every surface: the core's
    :func:`encode_meta` and the broker's request model."""
    for k, v in holder.items():
        try:
            str(k).encode("utf-8")
        except UnicodeEncodeError:
            return (
                f"holder metadata key {k!r} is not valid Unicode (a lone surrogate); "
                f"JSON in UTF-8 cannot carry it"
            )
        try:
            json.dumps(v, default=str, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return (
                f"holder metadata {k!r} has a value that is not valid Unicode (a lone surrogate, "
                f"such as '\\ud800'); JSON in UTF-8 cannot carry it"
            )
        except (TypeError, ValueError, RecursionError):
            pass  # not JSON at all: the caller says so
    return None


def _printable(x: Any, depth: int = 0) -> Any:
    """Decoded metadata with lone surrogates written as their escapes (bounded depth)."""
    if isinstance(x, str):
        try:
            x.encode("utf-8")
            return x
        except UnicodeEncodeError:
            return x.encode("utf-8", "backslashreplace").decode("utf-8")
    if depth > 32:
        return x
    if isinstance(x, dict):
        return {_printable(k, depth + 1): _printable(v, depth + 1) for k, v in x.items()}
    if isinstance(x, list):
        return [_printable(v, depth + 1) for v in x]
    return x


def reply_text(v: Any) -> str:
    """A script reply's string field as text (redis-py gives bytes without decode_responses)."""
    return v.decode() if isinstance(v, bytes) else str(v)


def decode_meta(s: str | bytes) -> dict[str, Any]:
    if isinstance(s, bytes):
        s = s.decode("utf-8", "replace")
    try:
        v = json.loads(s) if s else {}
    except (ValueError, RecursionError):
        return {"raw": s}
    if "\\ud" in s.lower():  # metadata stored before encode_meta refused lone surrogates
        v = _printable(v)
    return v if isinstance(v, dict) else {"value": v}


def ttl_ms(ttl_s: float) -> int:
    return max(int(MIN_TTL_S * 1000), int(round(ttl_s * 1000)))


def check_amount_vs_capacity(amount: int, capacity: int | None) -> None:
    if capacity is not None and amount > capacity:
        raise CapacityExceeded(amount, capacity)


def encode_devices(devices: object, capacity: int | str | None) -> tuple[int, str]:
    """``configure``'s devices as ``configure.lua`` takes them: ``devices`` a count N (N
    devices of ``capacity`` bytes each) or a sequence of each device's capacity (bytes or
    sizes; ``capacity``, when given, must be their sum). Returns (the pool's capacity, the
    sum, in bytes; "<bytes> <bytes> ..."). Raises InvalidArgument naming the bad value."""
    if isinstance(devices, bool):
        raise InvalidArgument(f"devices must be a count or a list of capacities, got {devices!r}")
    if isinstance(devices, int):
        if not 1 <= devices <= MAX_DEVICES:
            raise InvalidArgument(f"devices must be 1 to {MAX_DEVICES}, got {devices}")
        if capacity is None:
            raise InvalidArgument("devices=N needs capacity: the capacity of each device")
        caps = [parse_size(capacity)] * devices
    elif isinstance(devices, (list, tuple)):
        if not 1 <= len(devices) <= MAX_DEVICES:
            raise InvalidArgument(
                f"devices must list 1 to {MAX_DEVICES} capacities, got {len(devices)}"
            )
        caps = []
        for i, c in enumerate(devices):
            try:
                caps.append(parse_size(c))
            except InvalidArgument as e:
                raise InvalidArgument(f"capacity of device {i}: {e}") from None
        if capacity is not None and parse_size(capacity) != sum(caps):
            raise InvalidArgument(
                f"capacity {capacity!r} is not the sum of the devices' capacities ({sum(caps)} bytes)"
            )
    else:
        raise InvalidArgument(
            f"devices must be a count or a list of capacities, got {devices!r:.80}"
        )
    if sum(caps) > MAX_BYTES:
        raise InvalidArgument(
            f"the devices' capacities sum to {sum(caps)} bytes, more than a pool may hold "
            f"({MAX_BYTES})"
        )
    return sum(caps), " ".join(str(c) for c in caps)
