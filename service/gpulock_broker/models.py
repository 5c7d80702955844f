"""Request bodies of the HTTP lease API (``/v1``); the answers' bodies are in
:mod:`.answers`. Units: amounts in bytes, durations in seconds, instants as Unix seconds on the
Redis server's clock."""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from typing_extensions import Annotated

from gpulock_common.options import MAX_TTL_S as MAX_POOL_TTL_S
from gpulock_common.options import MIN_TTL_S as MIN_POOL_TTL_S
from gpulock_common.options import (
    MAX_REMOTE_HOLDER_JSON,
    DEFAULT_TTL_S,
    DEFAULT_YIELD_GRACE_S,
    MAX_BACKFILL_WINDOW_S,
    MAX_DEVICES,
    MAX_MAX_WAITERS,
    MAX_REMOTE_REQUEST_ID_LEN,
    MAX_TIMEOUT_S,
    MIN_BACKFILL_WINDOW_S,
    MIN_MAX_WAITERS,
    MIN_REMOTE_TTL_S,
    MAX_YIELD_GRACE_S,
    MIN_YIELD_GRACE_S,
    PREEMPT_GAP_MAX,
    PREEMPT_GAP_MIN,
    Preemption,
    PRIORITY_MAX,
    PRIORITY_MIN,
    REQUEST_ID_CHARS,
    TENANT_PATTERN as _TENANT,
    AcquireOptions,
    Placement,
    Policy,
    PoolSettings,
    check_device,
    check_placement,
    check_policy,
    check_priority,
)

from gpulock.protocol.args import decode_quotas, encode_quotas, meta_unicode_error, removes_quota
from gpulock.http.json_int import INTEGRAL, integral
from gpulock.errors import InvalidArgument
from gpulock.units import MAX_BYTES, SIZE_TEXT_MAX_LENGTH, SIZE_TEXT_PATTERN, parse_size_text

# The bounds, defaults and choices of these bodies are gpulock's vocabulary
# (gpulock_common.options), so the OpenAPI schema states what the core accepts; the broker's
# own are the ones below.
POOL_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
# the broker scopes a request id to the token (gpulock_common.options, "Over HTTP")
REQUEST_ID_PATTERN = f"^{REQUEST_ID_CHARS}{{1,{MAX_REMOTE_REQUEST_ID_LEN}}}$"
LEASE_ID_PATTERN = r"^[0-9a-f]{32}$"
MAX_HOLDER_JSON = MAX_REMOTE_HOLDER_JSON  # the broker adds owner, principal and via
# A lease over HTTP is renewed every ttl/3 by a client on another host: at least a second.
MIN_TTL_S, MAX_TTL_S = MIN_REMOTE_TTL_S, MAX_POOL_TTL_S

Scalar = Union[str, int, float, bool, None]
# Sizes as text: gpulock.units.SIZE_TEXT_PATTERN is the exact rule (never zero, no fraction of a
# byte, below 2**53), so the schema allows what the handler accepts and nothing else.
Size = Union[
    Annotated[int, Field(ge=1, le=MAX_BYTES)],
    Annotated[str, Field(pattern=SIZE_TEXT_PATTERN, max_length=SIZE_TEXT_MAX_LENGTH)],
]


# Tenant quotas (PUT /v1/pools/{pool} "quotas"): a tenant name as the scripts take it, to bytes
# (0 removes the quota), a size as text (the exact rule above), or "0" / "none" / null (removes).
TENANT_PATTERN = f"^{_TENANT}$"
QUOTA_REMOVE_PATTERN = r"^ *(?:0|[Nn][Oo][Nn][Ee]) *$"
QuotaSize = Union[
    Annotated[int, Field(ge=0, le=MAX_BYTES), INTEGRAL],
    Annotated[
        str,
        Field(
            pattern=f"(?:{SIZE_TEXT_PATTERN})|(?:{QUOTA_REMOVE_PATTERN})",
            max_length=SIZE_TEXT_MAX_LENGTH,
        ),
    ],
    None,
]


def _only_tenant_keys(schema: dict[str, Any]) -> None:
    """The quotas object's schema allows no key but a tenant name (patternProperties alone
    would let any other key through, which the handler refuses)."""
    for branch in schema.get("anyOf", []):
        if branch.get("type") == "object":
            branch["additionalProperties"] = False


def _size(v: Any, name: str) -> int:
    try:
        return parse_size_text(v, name=name)
    except InvalidArgument as e:
        raise ValueError(str(e)) from None


def _validated_bytes(v: int | str) -> int:
    """A validated ``Size`` field's value: its ``mode="before"`` validator has already turned a
    size string into bytes, so only the schema (what clients may send) keeps the ``str``."""
    if not isinstance(v, int):
        raise TypeError(f"size field not validated: {v!r}")
    return v


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # no "1" for 1, no 0 for false


class LeaseRequest(_Body):
    amount: Size = Field(
        ...,
        description='Bytes to hold: an integer, or a size such as "4GiB", "512MiB", "1.5GB".',
        examples=["4GiB", 1048576],
    )
    ttl: float = Field(
        DEFAULT_TTL_S,
        ge=MIN_TTL_S,
        le=MAX_TTL_S,
        allow_inf_nan=False,
        description="Lease time to live in seconds; renew (PUT) every ttl/3.",
    )
    wait: float = Field(
        0.0,
        ge=0.0,
        le=3600.0,
        allow_inf_nan=False,
        description="Seconds the server may hold this request while it is queued "
        "(capped by the broker's --max-wait). 0: answer at once.",
    )
    queue: bool = Field(
        True, description="False: never queue; 503 at once when it does not fit now."
    )
    holder: Optional[dict[str, Scalar]] = Field(
        None,
        description=f"Metadata shown in pool status (host, pid, purpose...), at most "
        f"{MAX_HOLDER_JSON} bytes as JSON.",
    )
    request_id: Optional[str] = Field(
        None,
        pattern=REQUEST_ID_PATTERN,
        description="Idempotency key, chosen by the client: a retry with the same id keeps its place "
        "in the queue and gets the same grant. Scoped to the bearer token.",
    )
    priority: Annotated[int, Field(ge=PRIORITY_MIN, le=PRIORITY_MAX), INTEGRAL] = Field(
        0,
        description=f"An integer in [{PRIORITY_MIN}, {PRIORITY_MAX}]; higher goes first in the "
        "queue. A queued request gains one level per second waited (aging), so none starves. "
        "A retry with the same request_id keeps its first place.",
        examples=[0, 5],
    )
    device: Optional[Annotated[int, Field(ge=0, le=MAX_DEVICES - 1), INTEGRAL]] = Field(
        None,
        description=f"The index of the device (0 .. {MAX_DEVICES - 1}) the lease must be on, on a "
        "pool of several devices (GET /v1/pools/{pool} lists them); null or absent: the pool "
        "places it (its placement). A device the pool does not have is a 422 naming it; an "
        "amount above that device's capacity is a 413.",
        examples=[None, 1],
    )
    preemptible: bool = Field(
        True,
        description="False: the server never asks the holder to yield this lease. Default "
        "true: on a pool with preemption on, a queued request of a priority at least the "
        "pool's gap higher that cannot fit may ask for it; the holder learns it from its "
        "renewals (yield_requested, yield_deadline_s) and should release it by then, else "
        "the server takes it back (the lease is lost).",
    )

    @field_validator("amount", mode="before")
    @classmethod
    def _amount(cls, v: Any) -> int:
        return _size(v, "amount")

    @field_validator("priority", mode="before")
    @classmethod
    def _priority(cls, v: Any) -> int:
        # The core's check, so the 422 names the value (the schema keeps the bounds); text is
        # refused (a JSON body says an integer).
        try:
            return check_priority(integral(v))
        except InvalidArgument as e:
            raise ValueError(str(e)) from None

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, v: Any) -> Optional[int]:
        # The core's check, so the 422 names the value (the schema keeps the bounds); whether
        # the pool has that device is the pool's to say (a 422 from the script).
        try:
            return check_device(integral(v))
        except InvalidArgument:
            raise ValueError(
                f"device must be a device index in [0, {MAX_DEVICES - 1}] or null, got {v!r:.80}"
            ) from None

    @property
    def amount_bytes(self) -> int:
        return _validated_bytes(self.amount)

    @property
    def options(self) -> AcquireOptions:
        """The acquire's options this body gives (the broker adds the rest: the holder's
        owner, the ticket, the tenant of the token)."""
        return AcquireOptions(
            ttl=self.ttl,
            holder=self.holder,
            request_id=self.request_id,
            priority=self.priority,
            device=self.device,
            preemptible=self.preemptible,
        )

    @field_validator("holder")
    @classmethod
    def _holder(cls, v: Optional[dict]) -> Optional[dict]:
        if v is not None:
            bad = meta_unicode_error(v)  # the core's check (encode_meta): never stored
            if bad:
                raise ValueError(bad)
            n = len(json.dumps(v, separators=(",", ":"), ensure_ascii=True))
            if n > MAX_HOLDER_JSON:
                raise ValueError(f"holder is {n} bytes as JSON; at most {MAX_HOLDER_JSON}")
        return v


class RenewRequest(_Body):
    ttl: Optional[float] = Field(
        None,
        ge=MIN_TTL_S,
        le=MAX_TTL_S,
        allow_inf_nan=False,
        description="New time to live in seconds from now (default: the lease's ttl).",
    )


class ResizeRequest(_Body):
    amount: Size = Field(
        ...,
        description='The lease\'s new amount: bytes, or a size such as "6GiB". Smaller: the '
        "freed bytes go to the queue at once. Larger: the difference is requested at the "
        "lease's tenant and device, ordered at the lease's place in the queue (ahead of the new "
        "requests its request was ahead of), now or after "
        'waiting (docs/SEMANTICS.md, "Resizing a lease").',
        examples=["6GiB", 1048576],
    )
    timeout: Optional[float] = Field(
        None,
        ge=0.0,
        le=MAX_TIMEOUT_S,
        allow_inf_nan=False,
        description="Seconds a growth may wait, counted from the request that starts it (a "
        "retry of the same resize joins it); null: as long as the client keeps coming back; "
        "0: never waits (503 queue_timeout when it cannot be granted now).",
    )
    wait: float = Field(
        0.0,
        ge=0.0,
        le=3600.0,
        allow_inf_nan=False,
        description="Seconds the server may hold this request while the growth waits (capped "
        "by the broker's --max-wait). 0: answer at once (503 queued while it waits).",
    )

    @field_validator("amount", mode="before")
    @classmethod
    def _amount(cls, v: Any) -> int:
        return _size(v, "amount")

    @property
    def amount_bytes(self) -> int:
        return _validated_bytes(self.amount)


def _capacity_or_devices(schema: dict[str, Any]) -> None:
    """The body gives the pool's capacity, its devices, or both, not null (the handler
    refuses neither, so the schema states it)."""
    schema["anyOf"] = [
        {"required": [k], "properties": {k: {"not": {"type": "null"}}}}
        for k in ("capacity", "devices")
    ]


class PreemptionRequest(_Body):
    """A pool's preemption setting, on (docs/SEMANTICS.md, "Preemption")."""

    gap: Annotated[int, Field(ge=PREEMPT_GAP_MIN, le=PREEMPT_GAP_MAX), INTEGRAL] = Field(
        ...,
        description="A queued request at the head that does not fit asks holders whose "
        "priority is at least this much below its own to yield.",
    )
    yield_grace_s: float = Field(
        DEFAULT_YIELD_GRACE_S,
        ge=MIN_YIELD_GRACE_S,
        le=MAX_YIELD_GRACE_S,
        allow_inf_nan=False,
        description="Seconds an asked lease has to release before the pool takes it back.",
    )


class PoolConfigRequest(_Body):
    model_config = ConfigDict(json_schema_extra=_capacity_or_devices)

    capacity: Optional[Size] = Field(
        None,
        description='Bytes, or a size such as "24GiB". Required unless devices is given; with '
        "devices, their sum (the default).",
    )
    max_waiters: Optional[
        Annotated[int, Field(ge=MIN_MAX_WAITERS, le=MAX_MAX_WAITERS), INTEGRAL]
    ] = Field(
        None,
        description="Queue bound (default: keep the current one; 10000 for a new pool).",
    )
    max_ttl: Optional[float] = Field(
        None,
        ge=MIN_POOL_TTL_S,
        le=MAX_POOL_TTL_S,
        allow_inf_nan=False,
        description="Longest lease ttl the pool accepts, seconds; also the grace period after Redis restarts "
        "without its data (default: keep the current one; 60 for a new pool).",
    )

    policy: Optional[Policy] = Field(
        None,
        description="Queue policy: fifo (nothing passes the head of the queue) or backfill "
        "(while the head does not fit, later requests that fit are granted, for at most "
        "backfill_window). Default: keep the current one; fifo for a new pool.",
    )
    backfill_window: Optional[float] = Field(
        None,
        ge=MIN_BACKFILL_WINDOW_S,
        le=MAX_BACKFILL_WINDOW_S,
        allow_inf_nan=False,
        description="Seconds a head that does not fit may be passed under backfill (default: "
        "keep the current value; 2 for a new pool).",
    )

    quotas: Optional[dict[Annotated[str, Field(pattern=TENANT_PATTERN)], QuotaSize]] = Field(
        None,
        description="Tenant quotas: tenant (1-64 of [A-Za-z0-9._:-], a token's tenant) to the "
        'bytes its leases may hold, as bytes or a size ("8GiB"); 0 or null removes that '
        'tenant\'s quota. Tenants left out keep theirs (docs/SEMANTICS.md, "Tenant quotas").',
        json_schema_extra=_only_tenant_keys,
    )

    devices: Optional[list[Size]] = Field(
        None,
        min_length=1,
        max_length=MAX_DEVICES,
        description=f"The pool's devices (GPUs), device 0 first: the capacity of each, as bytes "
        f'or a size ("80GiB"), 1 to {MAX_DEVICES} of them; a lease is placed on one. capacity, '
        "when given, must be their sum. The count of devices changes only while the pool has "
        "no lease and no waiter; on a pool of several devices, a capacity other than the "
        'current one needs devices (docs/SEMANTICS.md, "Devices and placement"). Default: '
        "keep them (one device of capacity for a new pool).",
        examples=[["80GiB", "80GiB"]],
    )
    placement: Optional[Placement] = Field(
        None,
        description="Where a request that names no device goes: bestfit (the device with the "
        "least free bytes that fits) or spread (the most free); ties go to the lowest index. "
        "Default: keep the current one; bestfit for a new pool.",
    )
    preemption: Union[Literal[False], PreemptionRequest, None] = Field(
        None,
        description='Preemption (docs/SEMANTICS.md, "Preemption"): {"gap", "yield_grace_s"} '
        "turns it on, false turns it off. Default: keep the current setting; off for a new "
        "pool.",
        examples=[{"gap": 10, "yield_grace_s": 30}],
    )

    @field_validator("capacity", mode="before")
    @classmethod
    def _capacity(cls, v: Any) -> Optional[int]:
        return None if v is None else _size(v, "capacity")

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, v: Any) -> Any:
        # Each by the rule of capacity (so the 422 names the device and the value); the count
        # by the core's bound.
        if v is None:
            return v
        if not isinstance(v, list) or not 1 <= len(v) <= MAX_DEVICES:
            raise ValueError(
                f"devices must be a list of 1 to {MAX_DEVICES} capacities, got {v!r:.80}"
            )
        return [_size(c, f"capacity of device {i}") for i, c in enumerate(v)]

    @field_validator("placement", mode="before")
    @classmethod
    def _placement(cls, v: Any) -> Any:
        # The core's check, so the 422 names the value (the schema keeps the choices).
        try:
            return check_placement(v)
        except InvalidArgument as e:
            raise ValueError(str(e)) from None

    @model_validator(mode="after")
    def _capacity_is_the_sum(self) -> "PoolConfigRequest":
        if self.devices is None:
            if self.capacity is None:
                raise ValueError("capacity is required (or devices: each device's capacity)")
            return self
        caps = [_validated_bytes(c) for c in self.devices]
        total = sum(caps)
        if self.capacity is not None and self.capacity != total:
            raise ValueError(
                f"capacity {self.capacity} is not the sum of the devices' capacities "
                f"({total} bytes: devices {caps!r:.200})"
            )
        if total > MAX_BYTES:
            raise ValueError(
                f"the devices' capacities sum to {total} bytes, above the largest capacity, "
                f"{MAX_BYTES} bytes"
            )
        return self

    @field_validator("quotas", mode="before")
    @classmethod
    def _quota_values_named(cls, v: Any) -> Any:
        # JSON true/false is not a size (a lax int would read it as 1/0); a text that is
        # neither a size nor a removal is named here (the schema's pattern error would show
        # the whole size pattern instead of the value)
        if isinstance(v, dict):
            for t, b in v.items():
                if isinstance(b, bool):
                    raise ValueError(f"quota of tenant {t!r} must be a size, got {b!r}")
                if isinstance(b, str) and not removes_quota(b):
                    _size(b, f"quota of tenant {t!r}")
        return v

    @field_validator("quotas")
    @classmethod
    def _quotas(cls, v: Any) -> Any:
        # In bytes (0: remove): text by the exact rule the schema states (parse_size_text), so
        # what the schema allows is what is accepted; then the core's check of the whole.
        if v is None:
            return v
        out: dict[str, int] = {}
        for t, b in v.items():
            if removes_quota(b):  # the core's rule (the schema's pattern already held)
                out[t] = 0
            else:
                out[t] = _size(b, f"quota of tenant {t!r}") if isinstance(b, str) else b
        try:
            encode_quotas(out)
        except InvalidArgument as e:
            raise ValueError(str(e)) from None
        return out

    @property
    def quota_bytes(self) -> dict[str, int] | None:
        """``quotas`` in bytes (0: remove), None when not given."""
        return None if self.quotas is None else decode_quotas(encode_quotas(self.quotas))

    @field_validator("policy", mode="before")
    @classmethod
    def _policy(cls, v: Any) -> Any:
        # The core's check, so the 422 names the value (the schema keeps the choices).
        try:
            return check_policy(v)
        except InvalidArgument as e:
            raise ValueError(str(e)) from None

    @property
    def capacity_bytes(self) -> int | None:
        """``capacity`` in bytes; None when not given (then the devices' sum)."""
        return None if self.capacity is None else _validated_bytes(self.capacity)

    @property
    def device_bytes(self) -> list[int] | None:
        """``devices``: each device's capacity in bytes; None when not given."""
        return None if self.devices is None else [_validated_bytes(c) for c in self.devices]

    @property
    def settings(self) -> PoolSettings:
        """The pool settings this body gives, in bytes and seconds (what it leaves out: None,
        the pool keeps it), as the broker passes them on to the pool's ``configure``."""
        return PoolSettings(
            capacity=self.capacity_bytes,
            max_waiters=self.max_waiters,
            max_ttl=self.max_ttl,
            policy=self.policy,
            backfill_window=self.backfill_window,
            quotas=self.quota_bytes,
            devices=self.device_bytes,
            placement=self.placement,
            preemption=(
                Preemption(self.preemption.gap, self.preemption.yield_grace_s)
                if isinstance(self.preemption, PreemptionRequest)
                else self.preemption
            ),
        )
