"""Request and response bodies of the HTTP lease API (``/v1``). Units: amounts in bytes,
durations in seconds, instants as Unix seconds on the Redis server's clock."""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator
from typing_extensions import Annotated

from gpulock._args import MAX_TTL_S as MAX_POOL_TTL_S
from gpulock._args import MIN_TTL_S as MIN_POOL_TTL_S
from gpulock._args import (
    PRIORITY_MAX,
    PRIORITY_MIN,
    decode_quotas,
    encode_quotas,
    meta_unicode_error,
    removes_quota,
    validate_priority,
)
from gpulock._flow import queue_policy
from gpulock._json_int import INTEGRAL, integral
from gpulock.errors import InvalidArgument
from gpulock.units import SIZE_TEXT_MAX_LENGTH, SIZE_TEXT_PATTERN, parse_size_text

POOL_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,96}$"
LEASE_ID_PATTERN = r"^[0-9a-f]{32}$"
MAX_HOLDER_JSON = 256
MIN_TTL_S, MAX_TTL_S = 1.0, 86400.0
MIN_BACKFILL_WINDOW_S, MAX_BACKFILL_WINDOW_S = 0.001, 86400.0  # gpulock._flow.queue_policy's

Scalar = Union[str, int, float, bool, None]
MAX_BYTES = 2**53 - 1
# Sizes as text: gpulock.units.SIZE_TEXT_PATTERN is the exact rule (never zero, no fraction of a
# byte, below 2**53), so the schema allows what the handler accepts and nothing else.
Size = Union[
    Annotated[int, Field(ge=1, le=MAX_BYTES)],
    Annotated[str, Field(pattern=SIZE_TEXT_PATTERN, max_length=SIZE_TEXT_MAX_LENGTH)],
]


# Tenant quotas (PUT /v1/pools/{pool} "quotas"): a tenant name as the scripts take it, to bytes
# (0 removes the quota), a size as text (the exact rule above), or "0" / "none" / null (removes).
TENANT_PATTERN = r"^[A-Za-z0-9._:-]{1,64}$"
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
        30.0,
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

    @field_validator("amount", mode="before")
    @classmethod
    def _amount(cls, v: Any) -> int:
        return _size(v, "amount")

    @field_validator("priority", mode="before")
    @classmethod
    def _priority(cls, v: Any) -> int:
        # The core's check, so the 422 names the value (the schema keeps the bounds). It takes
        # decimal digits too (from a header or a command line); a JSON body says an integer.
        v = integral(v)
        if isinstance(v, str):
            raise ValueError(
                f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {v!r:.80}"
            )
        try:
            return validate_priority(v)
        except InvalidArgument as e:
            raise ValueError(str(e)) from None

    @property
    def amount_bytes(self) -> int:
        return _validated_bytes(self.amount)

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


class PoolConfigRequest(_Body):
    capacity: Size = Field(..., description='Bytes, or a size such as "24GiB".')
    max_waiters: Optional[Annotated[int, Field(ge=1, le=1_000_000), INTEGRAL]] = Field(
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

    policy: Optional[Literal["fifo", "backfill"]] = Field(
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

    @field_validator("capacity", mode="before")
    @classmethod
    def _capacity(cls, v: Any) -> int:
        return _size(v, "capacity")

    @field_validator("quotas", mode="before")
    @classmethod
    def _no_bool_quota(cls, v: Any) -> Any:
        # JSON true/false is not a size (a lax int would read it as 1/0)
        if isinstance(v, dict):
            for t, b in v.items():
                if isinstance(b, bool):
                    raise ValueError(f"quota of tenant {t!r} must be a size, got {b!r}")
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
        if v is not None:
            try:
                queue_policy(v, None)
            except InvalidArgument as e:
                raise ValueError(str(e)) from None
        return v

    @property
    def capacity_bytes(self) -> int:
        return _validated_bytes(self.capacity)


class LeaseGrant(BaseModel):
    lease_id: str = Field(..., description="32 hex digits; the path of PUT/DELETE.")
    pool: str
    amount: int = Field(..., description="bytes")
    token: int = Field(..., description="Fencing token: strictly increasing per pool.")
    ttl: float = Field(..., description="seconds")
    expires_in: float = Field(
        ...,
        description="Seconds left on the server clock when this reply was made. "
        "Count them from when you *sent* the request plus ``held_ms`` × (1 − 1%) "
        "(Chubby's rule).",
    )
    expires_at: float = Field(..., description="Unix seconds, Redis server clock.")
    acquired_at: float = Field(..., description="Unix seconds, Redis server clock.")
    request_id: str
    held_ms: int = Field(
        0,
        description="Milliseconds the broker held this request (a long poll) before "
        "answering, on its own monotonic clock. Count ``expires_in`` from "
        "``sent + held_ms/1000 * (1 - 1%)`` instead of from ``sent``.",
    )


class LeaseRenewed(BaseModel):
    lease_id: str
    pool: str
    token: int
    ttl: float
    expires_in: float = Field(..., description="seconds left, server clock, at the reply")
    expires_at: float


class LeaseReleased(BaseModel):
    lease_id: str
    pool: str
    released: bool = True
    released_at: Optional[float] = Field(
        None, description="Unix seconds, server clock (None on a repeat)."
    )


class RequestCancelled(BaseModel):
    request_id: str
    pool: str
    outcome: Literal["none", "left_queue", "released_grant"]


class LeaseInfoOut(BaseModel):
    lease_id: str
    amount: int
    token: int
    expires_in: float
    held_for: float
    ttl: float
    holder: dict[str, Any]
    tenant: str = Field("", description="the tenant its bytes count under; empty for none")


class WaiterInfoOut(BaseModel):
    position: int
    amount: int
    waited: float
    holder: dict[str, Any]
    priority: int = Field(
        0,
        description="As requested (the queue ages it: one level per second waited); 0 for "
        "requests made without one.",
    )
    tenant: str = Field("", description="the tenant it asks for; empty for none")


class TenantUseOut(BaseModel):
    used: int = Field(..., description="bytes the tenant's live leases hold")
    quota: int = Field(..., description="bytes its leases may hold; 0 for no quota")


class PoolOut(BaseModel):
    pool: str
    capacity: int
    used: int
    free: int
    epoch: int
    fence: int
    max_waiters: int
    max_ttl: float = Field(
        ..., description="seconds: the longest ttl a lease may have (0: unbounded)"
    )
    lease_count: int
    waiter_count: int
    grants: int
    reaped_leases: int
    reaped_waiters: int
    leases: list[LeaseInfoOut] = []
    waiters: list[WaiterInfoOut] = []
    policy: str = Field(
        ..., description='queue policy: "fifo" or "backfill" (docs/SEMANTICS.md, "Backfill")'
    )
    backfill_window: float = Field(
        ..., description="seconds a head that does not fit may be passed under backfill"
    )
    tenants: dict[str, TenantUseOut] = Field(
        default_factory=dict,
        description="tenants with a quota or a live lease: use and quota, bytes",
    )


class PoolList(BaseModel):
    pools: list[PoolOut]


class PoolConfigured(BaseModel):
    pool: str
    created: bool
    capacity: int
    epoch: int
    used: int
    max_waiters: int
    max_ttl: float = Field(..., description="seconds")
    policy: str = Field(..., description='queue policy: "fifo" or "backfill"')
    backfill_window: float = Field(..., description="seconds (backfill's window)")
    quotas: dict[str, int] = Field(
        default_factory=dict, description="every tenant quota of the pool, bytes by tenant"
    )


class PoolDeleted(BaseModel):
    pool: str
    deleted: bool = True
    leases: int = Field(..., description="live leases dropped with the pool (only with force=true)")
    waiters: int = Field(
        ..., description="live waiting requests dropped with the pool (only with force=true)"
    )


class ErrorDetail(BaseModel):
    error: str = Field(
        ...,
        description="unauthorized, forbidden, queued, busy, queue_full, "
        "backend_unavailable, capacity_exceeded, pool_not_found, "
        "pool_in_use, lease_lost, not_found, invalid; from the HTTP "
        "guards: invalid_utf8, invalid_json, nested_too_deeply, "
        "request_too_large, request_timeout",
    )
    message: str
    request_id: Optional[str] = None
    position: Optional[int] = Field(None, description="1-based place in the queue")
    queue_length: Optional[int] = None
    retry_after: Optional[float] = Field(
        None, description="seconds; the Retry-After header, rounded up"
    )
    hold_place_for: Optional[float] = Field(
        None, description="seconds the place is kept for a retry with the same request_id"
    )
    lease_id: Optional[str] = None
    amount: Optional[int] = None
    capacity: Optional[int] = None
    leases: Optional[int] = Field(None, description="pool_in_use: the live leases")
    waiters: Optional[int] = Field(None, description="pool_in_use: the live waiting requests")


class ErrorResponse(BaseModel):
    detail: ErrorDetail
