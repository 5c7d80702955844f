"""The vocabulary of an acquire and of a pool's settings, defined once for every surface: the
core (``gpulock``), its SDK (``gpulock-client``), the broker's request models, the CLI's
options and the FastAPI integration's settings.

- bounds and defaults: priorities, ttls, holder metadata, devices, the queue bound, the
  backfill window;
- the choices: queue policies (:data:`Policy`, :data:`POLICIES`) and placements
  (:data:`Placement`, :data:`PLACEMENTS`), as ``Literal`` types (a pydantic field of that type
  states the choices in its OpenAPI schema) and as tuples;
- the checks both sides make before anything is sent, each one function: a priority
  (:func:`check_priority`; text only through :func:`parse_priority`), a device index, a
  tenant, ``resident``, a policy, a placement;
- :class:`AcquireOptions`: every option of an acquire, with its default, as one value that the
  layers below the public ``acquire`` methods pass on;
- :class:`PoolSettings`: every setting a pool's ``configure`` takes (None: keep the pool's),
  as one value that the layers below the public ``configure`` methods, the broker's request
  model and the CLI pass on; a duration's check (:func:`check_seconds`);
- :class:`Preemption`: a pool's preemption setting (docs/SEMANTICS.md, "Preemption"), with
  its wire form.

The Lua scripts enforce the same bounds and choices (``lua/lib.lua``);
``tests/unit/test_vocabulary.py`` reads them from there and compares. Standard library only,
no I/O. Raises :class:`~gpulock_common.errors.InvalidArgument` naming a bad value.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Dict, Literal, Mapping, NamedTuple, Optional, Sequence, Tuple, Union, cast

from .errors import InvalidArgument

# Priorities (docs/SEMANTICS.md, "Priorities"): higher goes first; a queued request's effective
# priority rises by one level per AGING_S seconds waited (lua/lib.lua PRIO_MIN, PRIO_MAX,
# AGING_US).
PRIORITY_MIN, PRIORITY_MAX = -100, 100
AGING_S = 1.0

# A lease's ttl and a pool's max_ttl, seconds (lua/lib.lua MIN_TTL_MS, MAX_TTL_MS); the ttl of a
# lease that names none (a pool object's default_ttl, the SDK's, the broker's request).
MIN_TTL_S, MAX_TTL_S = 0.1, 86400.0
DEFAULT_TTL_S = 30.0

# How long an acquire waits, seconds: 0 tries once; None (no bound) is the way to wait forever,
# and a bound this large (about 31.7 years) is the longest one a clock can add safely.
MAX_TIMEOUT_S = 1e9

# Holder metadata: at most this many bytes as JSON (lua/lib.lua MAX_META).
MAX_META_BYTES = 512
# A remote holder's metadata (the broker's acquire body's `holder`, compact JSON): at most this
# many bytes, so the broker's own fields (owner, principal, via) fit within MAX_META_BYTES.
MAX_REMOTE_HOLDER_JSON = 256

# Request ids (the idempotency key, the waiter's ticket): 1 to MAX_REQUEST_ID_LEN characters of
# REQUEST_ID_CHARS (lua/lib.lua id_arg).
REQUEST_ID_CHARS = "[A-Za-z0-9._:-]"
MAX_REQUEST_ID_LEN = 128

# Over HTTP (the broker's /v1, and its SDK, which checks the same before sending):
# - a lease's ttl is at least MIN_REMOTE_TTL_S: its holder, on another host, renews it every
#   ttl/3 through the broker, and a third of the core's 0.1 s is less than one HTTP round
#   trip's jitter;
# - a request id is at most MAX_REMOTE_REQUEST_ID_LEN characters: the broker scopes it to the
#   token (its 16 hex digits and ":" before it), and the core's MAX_REQUEST_ID_LEN holds for
#   the scoped one.
MIN_REMOTE_TTL_S = 1.0
MAX_REMOTE_REQUEST_ID_LEN = 96

# Devices (docs/SEMANTICS.md, "Devices and placement"): a pool holds 1 to MAX_DEVICES devices
# (lua/lib.lua MAX_DEVICES); a request's device is an index in [0, MAX_DEVICES).
MAX_DEVICES = 64

# The queue bound a pool takes (lua/lib.lua MIN_WAITERS, MAX_WAITERS), and a new pool's.
MIN_MAX_WAITERS, MAX_MAX_WAITERS = 1, 1_000_000
DEFAULT_MAX_WAITERS = 10_000

# The longest ttl a lease may have in a pool this library creates (a pool's ``max_ttl``, within
# [MIN_TTL_S, MAX_TTL_S]), unless the pool object is given another: also the length of the
# grace period after Redis lost a pool (docs/SEMANTICS.md). Twice the default ttl.
DEFAULT_MAX_TTL_S = 60.0

# Queue policies (docs/SEMANTICS.md, "Backfill"; lua/lib.lua POLICIES): fifo, nothing passes
# the head of the queue; backfill, a later request that fits may pass a head that does not, for
# at most the pool's backfill window (seconds; lua/lib.lua MIN_BACKFILL_MS, MAX_BACKFILL_MS,
# DEFAULT_BACKFILL_MS). The first of each is a new pool's.
Policy = Literal["fifo", "backfill"]
POLICIES: Tuple[Policy, ...] = ("fifo", "backfill")
DEFAULT_POLICY: Policy = "fifo"
MIN_BACKFILL_WINDOW_S, MAX_BACKFILL_WINDOW_S = 0.001, 86400.0
DEFAULT_BACKFILL_WINDOW_S = 2.0

# Placements (docs/SEMANTICS.md, "Devices and placement"; lua/lib.lua PLACEMENTS): where a
# request that names no device goes on a pool of several: bestfit, the device with the least
# free bytes that fits; spread, the one with the most.
Placement = Literal["bestfit", "spread"]
PLACEMENTS: Tuple[Placement, ...] = ("bestfit", "spread")
DEFAULT_PLACEMENT: Placement = "bestfit"

# Preemption (docs/SEMANTICS.md, "Preemption"; lua/lib.lua PREEMPT_GAP_MIN, PREEMPT_GAP_MAX and
# the yield grace's bounds): a queued request at the head asks lower-priority holders to yield
# when its priority is at least theirs + gap; an asked lease is taken back at the latest
# yield_grace seconds later. Off on a new pool; DEFAULT_YIELD_GRACE_S when only a gap is given.
PREEMPT_GAP_MIN, PREEMPT_GAP_MAX = 1, 200
MIN_YIELD_GRACE_S, MAX_YIELD_GRACE_S = 0.1, 86400.0
DEFAULT_YIELD_GRACE_S = 30.0

# Tenants (docs/SEMANTICS.md, "Tenant quotas"): the name a lease's bytes count under
# (lua/lib.lua tenant_arg).
TENANT_PATTERN = r"[A-Za-z0-9._:-]{1,64}"
_TENANT_RE = re.compile(TENANT_PATTERN)
_PRIORITY_TEXT = re.compile(r"[+-]?[0-9]{1,8}")
_REQUEST_ID_RE = re.compile(f"{REQUEST_ID_CHARS}+")


def _bad_priority(value: Any) -> InvalidArgument:
    return InvalidArgument(
        f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {value!r:.80}"
    )


def check_priority(priority: Any) -> int:
    """A request's priority as an ``int``: an integer in [PRIORITY_MIN, PRIORITY_MAX], of any
    integer type (one with ``__index__``, such as numpy's). Bools, floats and text are refused:
    text is the edges' to parse (:func:`parse_priority`). Raises InvalidArgument naming it."""
    p: int
    if type(priority) is int:
        p = priority
    else:
        if isinstance(priority, (bool, str, bytes, float)):
            raise _bad_priority(priority)
        try:
            p = operator.index(priority)  # numpy's integers, for one
        except TypeError:
            raise _bad_priority(priority) from None
    if not PRIORITY_MIN <= p <= PRIORITY_MAX:
        raise _bad_priority(p)
    return p


def parse_priority(value: Any) -> int:
    """:func:`check_priority` of a value that may be text: a command line's, a header's or a
    route declaration's decimal digits (at most 8, an optional sign, spaces around ignored).
    Raises InvalidArgument naming it."""
    if isinstance(value, str) and _PRIORITY_TEXT.fullmatch(value.strip()):
        value = int(value)
    return check_priority(value)


def check_device(device: Any) -> Optional[int]:
    """``device`` if it is None (any device) or a device index in [0, MAX_DEVICES) (an int,
    not a bool), else InvalidArgument naming it (before anything is sent). Whether the pool
    has that device is the pool's to say (the script: InvalidArgument naming it)."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < MAX_DEVICES:
        raise InvalidArgument(
            f"device must be a device index in [0, {MAX_DEVICES - 1}] or None, got {device!r:.80}"
        )
    return device


def check_request_id(rid: Any, *, longest: int = MAX_REQUEST_ID_LEN) -> str:
    """A request id: 1 to ``longest`` characters of REQUEST_ID_CHARS (MAX_REQUEST_ID_LEN for
    the core; MAX_REMOTE_REQUEST_ID_LEN over HTTP). Raises InvalidArgument naming it."""
    if not isinstance(rid, str) or not _REQUEST_ID_RE.fullmatch(rid) or len(rid) > longest:
        raise InvalidArgument(
            f"request_id must be 1-{longest} characters of {REQUEST_ID_CHARS}, got {rid!r:.200}"
        )
    return rid


def check_holder(holder: Any) -> Optional[Dict[str, Any]]:
    """A request's holder metadata: a dict (None or empty: none). Raises InvalidArgument naming
    anything else. (Its size as JSON is the core's to check, and the broker's.)"""
    if holder and not isinstance(holder, dict):
        raise InvalidArgument(f"holder must be a dict of metadata, got {holder!r:.80}")
    return cast(Optional[Dict[str, Any]], holder)


def check_tenant(tenant: Any) -> str:
    """A request's tenant: 1-64 characters of [A-Za-z0-9._:-], or None / "" for none (returned
    as ""). Raises InvalidArgument naming the bad value."""
    if tenant is None or tenant == "":
        return ""
    if not isinstance(tenant, str) or not _TENANT_RE.fullmatch(tenant):
        raise InvalidArgument(
            f"tenant must be 1-64 characters of [A-Za-z0-9._:-], got {tenant!r:.80}"
        )
    return tenant


def check_resident(resident: Any) -> bool:
    """``acquire``'s ``resident``: True or False (docs/SEMANTICS.md, "Resident leases").
    Raises InvalidArgument for anything else (a truthy string would otherwise turn a request
    into a lease held for its holder's life)."""
    if resident is True or resident is False:
        return resident
    raise InvalidArgument(f"resident must be True or False, got {resident!r:.80}")


def check_preemptible(preemptible: Any) -> bool:
    """``acquire``'s ``preemptible``: True (the default: a pool with preemption on may ask the
    holder to yield the lease to a request of higher priority) or False (never asked). Raises
    InvalidArgument for anything else."""
    if preemptible is True or preemptible is False:
        return preemptible
    raise InvalidArgument(f"preemptible must be True or False, got {preemptible!r:.80}")


def _choices(values: Tuple[str, ...]) -> str:
    return " or ".join(f"'{v}'" for v in values)


def check_policy(policy: Any) -> Optional[Policy]:
    """A pool's queue policy, one of :data:`POLICIES` (None: unchanged). Raises
    InvalidArgument naming the bad value."""
    if policy is None or policy in POLICIES:
        return cast(Optional[Policy], policy)
    raise InvalidArgument(f"policy must be {_choices(POLICIES)}, got {policy!r:.80}")


def check_placement(placement: Any) -> Optional[Placement]:
    """A pool's placement rule, one of :data:`PLACEMENTS` (None: unchanged). Raises
    InvalidArgument naming the bad value."""
    if placement is None or placement in PLACEMENTS:
        return cast(Optional[Placement], placement)
    raise InvalidArgument(f"placement must be {_choices(PLACEMENTS)}, got {placement!r:.80}")


class AcquireOptions(NamedTuple):
    """Every option of an acquire besides the amount, with its default: what the public
    ``acquire`` methods take as keywords (``gpulock.Pool``, ``gpulock.AsyncPool``, the SDK's
    pools; meanings and units: :meth:`gpulock.AsyncPool.acquire`), passed on below them as one
    value. A new option is a field here (with its check in :meth:`checked` when both sides
    make it), then a keyword of those methods and whatever carries it (docs/ARCHITECTURE.md,
    "Adding an acquire option").

    A named tuple: immutable, typed, and the cheapest record to make on every acquire
    (``_replace`` changes a field, ``_asdict`` gives the keywords)."""

    ttl: Optional[float] = None  # seconds; None: the pool object's default_ttl
    timeout: Optional[float] = None  # seconds to wait; None: forever; 0: try once
    holder: Optional[Dict[str, Any]] = None  # metadata shown in status
    request_id: Optional[str] = None  # the idempotency key; None: a fresh one
    priority: int = 0  # [PRIORITY_MIN, PRIORITY_MAX], higher first
    tenant: Optional[str] = None  # who the bytes count under; None: none
    device: Optional[int] = None  # the device it must be on; None: the pool places it
    resident: bool = False  # held for its holder's whole life
    preemptible: bool = True  # False: never asked to yield to a higher priority

    def checked(self, *, remote: bool = False) -> AcquireOptions:
        """These options after the checks both sides make before anything is sent: the
        timeout (as a ``float`` in [0, MAX_TIMEOUT_S], or None), the priority (as an ``int``:
        :func:`check_priority`), the device, the tenant, ``resident``, ``preemptible`` and that the holder is a
        dict; with ``remote`` (the SDK's, over HTTP) also the ttl and the request id by the
        broker's bounds (MIN_REMOTE_TTL_S, MAX_REMOTE_REQUEST_ID_LEN). Raises InvalidArgument
        naming the first bad value."""
        t = self.timeout
        if t is not None:
            t = check_seconds(t, name="timeout", minimum=0.0, maximum=MAX_TIMEOUT_S)
        p = self.priority
        if not (p == 0 and type(p) is int):  # the default, on every acquire: no call
            p = check_priority(p)
        check_device(self.device)
        check_tenant(self.tenant)
        check_resident(self.resident)
        if self.preemptible is not True:  # the default, on every acquire: no call
            check_preemptible(self.preemptible)
        check_holder(self.holder)
        if remote:
            if self.ttl is not None:
                check_seconds(self.ttl, name="ttl", minimum=MIN_REMOTE_TTL_S, maximum=MAX_TTL_S)
            if self.request_id is not None:
                check_request_id(self.request_id, longest=MAX_REMOTE_REQUEST_ID_LEN)
        if p is self.priority and t is self.timeout:
            return self
        return self._replace(priority=p, timeout=t)


def check_seconds(value: Any, *, name: str, minimum: float, maximum: float) -> float:
    """A duration in seconds as a ``float`` in [minimum, maximum]: a number (not a bool) or
    its decimal text, finite. Raises InvalidArgument naming it. (``gpulock.units.parse_seconds``
    is this check with None and zero allowed where a setting means "none" by them.)"""
    if value is None or isinstance(value, bool):
        raise InvalidArgument(f"{name} must be a number of seconds, got {value!r}")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{name} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(f):
        raise InvalidArgument(f"{name} must be a finite number of seconds, got {value!r}")
    if f < minimum or f > maximum:
        raise InvalidArgument(
            f"{name} must be between {minimum:g} and {maximum:g} seconds, got {value!r}"
        )
    return f


def check_max_waiters(max_waiters: Any) -> int:
    """A pool's queue bound as an ``int`` in [MIN_MAX_WAITERS, MAX_MAX_WAITERS] (any integer
    type; not a bool, a float or text). Raises InvalidArgument naming it."""
    try:
        if isinstance(max_waiters, (bool, str, bytes, float)):
            raise TypeError
        n = operator.index(max_waiters)
    except TypeError:
        n = None
    if n is None or not MIN_MAX_WAITERS <= n <= MAX_MAX_WAITERS:
        raise InvalidArgument(
            f"max_waiters must be an integer in [{MIN_MAX_WAITERS}, {MAX_MAX_WAITERS}], "
            f"got {max_waiters!r:.80}"
        )
    return n


@dataclass(frozen=True)
class Preemption:
    """A pool's preemption setting, on (docs/SEMANTICS.md, "Preemption"): a queued request at
    the head of the queue that does not fit asks holders whose priority is at least ``gap``
    below its own to yield, and an asked lease is taken back at the latest ``yield_grace_s``
    seconds after it was asked. ``gap``: an integer in [PREEMPT_GAP_MIN, PREEMPT_GAP_MAX];
    ``yield_grace_s``: seconds in [MIN_YIELD_GRACE_S, MAX_YIELD_GRACE_S] (kept to the ms).
    Raises InvalidArgument naming a bad value."""

    gap: int
    yield_grace_s: float = DEFAULT_YIELD_GRACE_S

    def __post_init__(self) -> None:
        g = self.gap
        try:
            if isinstance(g, (bool, str, bytes, float)):
                raise TypeError
            n: Optional[int] = operator.index(g)
        except TypeError:
            n = None
        if n is None or not PREEMPT_GAP_MIN <= n <= PREEMPT_GAP_MAX:
            raise InvalidArgument(
                f"preemption gap must be an integer in [{PREEMPT_GAP_MIN}, {PREEMPT_GAP_MAX}], "
                f"got {g!r:.80}"
            )
        s = check_seconds(
            self.yield_grace_s,
            name="yield_grace",
            minimum=MIN_YIELD_GRACE_S,
            maximum=MAX_YIELD_GRACE_S,
        )
        object.__setattr__(self, "gap", n)
        object.__setattr__(self, "yield_grace_s", round(s * 1000) / 1000)

    @property
    def yield_grace_ms(self) -> int:
        """The yield grace in ms, as the pool keeps it."""
        return round(self.yield_grace_s * 1000)

    def to_wire(self) -> str:
        """The setting as ``configure.lua`` takes and answers it: "<gap> <yield_grace_ms>"."""
        return f"{self.gap} {self.yield_grace_ms}"

    @classmethod
    def from_wire(cls, text: str) -> Optional[Preemption]:
        """A setting as ``configure.lua`` and ``status.lua`` answer it: "<gap>
        <yield_grace_ms>", or "" (off: None). Raises InvalidArgument for anything else."""
        if not text:
            return None
        parts = text.split(" ")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise InvalidArgument(f"preemption must be '<gap> <yield_grace_ms>', got {text!r:.80}")
        return cls(int(parts[0]), int(parts[1]) / 1000)

    def shown(self) -> Dict[str, Any]:
        """As a reply or a request body shows it: ``{"gap", "yield_grace_s"}``."""
        return {"gap": self.gap, "yield_grace_s": self.yield_grace_s}


def check_preemption(preemption: Any) -> Union[Preemption, bool, None]:
    """``configure``'s ``preemption``: None (unchanged), False (off) or a :class:`Preemption`
    (on). True is refused (it names no gap), as is anything else: InvalidArgument naming it."""
    if preemption is None or preemption is False or isinstance(preemption, Preemption):
        return cast(Union[Preemption, bool, None], preemption)
    raise InvalidArgument(
        "preemption must be None (unchanged), False (off) or Preemption(gap, yield_grace_s) "
        f"(on), got {preemption!r:.80}"
    )


class PoolSettings(NamedTuple):
    """Every setting of a pool that its ``configure`` sets, each None to keep the pool's (a
    new pool's default then): what the public ``configure`` methods take as keywords
    (``gpulock.Pool``, ``gpulock.AsyncPool``, the SDK's pools; meanings and units:
    :meth:`gpulock.AsyncPool.configure`), the broker's ``PUT /v1/pools/{pool}`` body and
    ``gpulock pool set``'s options, passed on below them as one value. A new setting is a
    field here (with its check in :meth:`checked`), then whatever carries it
    (docs/ARCHITECTURE.md, "Adding a pool setting").

    Sizes (``capacity``, ``quotas``' values, ``devices``' capacities) stay as given: bytes or
    size text, which the core and the broker parse (``gpulock.units``)."""

    capacity: Union[int, str, None] = None  # bytes or a size ("24GiB"); None: the pool's own
    max_waiters: Optional[int] = None  # the queue bound, [MIN_MAX_WAITERS, MAX_MAX_WAITERS]
    max_ttl: Optional[float] = None  # seconds, [MIN_TTL_S, MAX_TTL_S]; also the grace period
    policy: Optional[str] = None  # one of POLICIES
    backfill_window: Optional[float] = None  # seconds, [MIN_BACKFILL_WINDOW_S, MAX_...]
    quotas: Optional[Mapping[str, Union[int, str, None]]] = None  # tenant: size; 0/None: remove
    devices: Union[int, Sequence[Union[int, str]], None] = None  # a count, or each one's size
    placement: Optional[str] = None  # one of PLACEMENTS
    preemption: Union[Preemption, bool, None] = None  # False: off; a Preemption: on

    def checked(self) -> PoolSettings:
        """These settings after the checks both sides make before anything is sent: the
        queue bound (an ``int``), ``max_ttl`` and ``backfill_window`` (``float`` seconds in
        their bounds), the policy and the placement (one of the choices), the preemption
        setting (:func:`check_preemption`). Raises
        InvalidArgument naming the first bad value."""
        mw, mt, bw = self.max_waiters, self.max_ttl, self.backfill_window
        if mw is not None:
            mw = check_max_waiters(mw)
        if mt is not None:
            mt = check_seconds(mt, name="max_ttl", minimum=MIN_TTL_S, maximum=MAX_TTL_S)
        check_policy(self.policy)
        if bw is not None:
            bw = check_seconds(
                bw,
                name="backfill_window",
                minimum=MIN_BACKFILL_WINDOW_S,
                maximum=MAX_BACKFILL_WINDOW_S,
            )
        check_placement(self.placement)
        check_preemption(self.preemption)
        return self._replace(max_waiters=mw, max_ttl=mt, backfill_window=bw)

    def given(self) -> Dict[str, Any]:
        """The settings given (not None) as the broker's request body: quotas as a dict,
        devices as a list, preemption as ``{"gap", "yield_grace_s"}`` (:meth:`Preemption.shown`)
        or False."""
        out = {k: v for k, v in self._asdict().items() if v is not None}
        if isinstance(self.preemption, Preemption):
            out["preemption"] = self.preemption.shown()
        if self.quotas is not None:
            out["quotas"] = dict(self.quotas)
        if self.devices is not None and not isinstance(self.devices, (int, str, bytes)):
            out["devices"] = list(self.devices)
        return out
