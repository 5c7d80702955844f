"""The CLI's side of an HTTP broker (``--broker-url``): the pool routes of the broker's API
behind the core's exceptions, and a gpulock_client pool with the surface ``gpulock run`` uses.
Needs the ``gpulock-client`` package (httpx); imported only when a broker URL is in use."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, Callable

from gpulock_common.validation import describe
from gpulock_common.options import DEFAULT_BACKFILL_WINDOW_S, DEFAULT_PLACEMENT, DEFAULT_POLICY

from gpulock import errors as E
from gpulock.admin.pools import DeleteResult
from gpulock.cli.common import EXIT_USAGE, AuthFailed, fail


def _require_client() -> ModuleType:
    try:
        import gpulock_client
    except ImportError:
        fail(
            EXIT_USAGE,
            "--broker-url needs the gpulock-client package: from a checkout of gpulock, pip install -e ./clients/common -e ./clients/python",
        )
    return gpulock_client


def _from_reply(status: int, body: Any, pool: str) -> E.GpuLockError:
    d = body.get("detail") if isinstance(body, dict) else None
    detail = d if isinstance(d, dict) else {}
    if isinstance(d, list):  # FastAPI's 422: name the fields, in users' words
        msg = describe(d)
    else:
        msg = str(detail.get("message", d if d is not None else f"HTTP {status}"))
    code = detail.get("error")
    if status in (401, 403):
        return AuthFailed(msg)
    if status == 404 and code == "pool_not_found":
        return E.PoolNotFound(pool)
    if status in (400, 422):
        return E.InvalidArgument(msg)
    if status in (502, 503, 504):
        return E.BackendUnavailable(msg)
    return E.GpuLockError(f"unexpected HTTP {status} from the broker: {msg}")


class BrokerAdmin:
    """Blocking calls to the broker's pool routes (``/v1/pools...``) with the token from
    ``GPULOCK_TOKEN``; errors are the core's (PoolNotFound, BackendUnavailable, ...) or
    :class:`AuthFailed`."""

    def __init__(self, url: str, timeout: float = 10.0):
        _require_client()
        import httpx

        token = os.environ.get("GPULOCK_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    def _request(
        self, method: str, path: str, json: Any = None, params: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        import httpx

        try:
            r = self._http.request(method, path, json=json, params=params)
        except httpx.TransportError as e:
            raise E.BackendUnavailable(f"{type(e).__name__}: {e}") from e
        try:
            body = r.json()
        except ValueError:
            body = None
        return r.status_code, body

    def call(
        self,
        method: str,
        path: str,
        pool: str = "*",
        json: Any = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        status, body = self._request(method, path, json, params)
        if status >= 300:
            raise _from_reply(status, body, pool)
        return body

    def delete_pool(self, name: str, *, force: bool = False) -> DeleteResult:
        """``DELETE /v1/pools/NAME``: the same outcomes as gpulock.admin.pools.delete_pool (404 is
        ``missing``, 409 ``in_use`` with the broker's counts)."""
        status, body = self._request(
            "DELETE", f"/v1/pools/{name}", params={"force": "true"} if force else None
        )
        detail = body.get("detail") if isinstance(body, dict) else None
        code = detail.get("error") if isinstance(detail, dict) else None
        if status == 404 and code == "pool_not_found":
            return DeleteResult("missing", 0, 0)
        if status == 409 and code == "pool_in_use" and isinstance(detail, dict):
            return DeleteResult(
                "in_use", int(detail.get("leases") or 0), int(detail.get("waiters") or 0)
            )
        if status >= 300:
            raise _from_reply(status, body, name)
        return DeleteResult("deleted", int(body.get("leases") or 0), int(body.get("waiters") or 0))

    def close(self) -> None:
        self._http.close()


def status_from_dict(d: dict[str, Any]) -> Any:
    """A broker's pool object (``GET /v1/pools/NAME``) as the core's PoolStatus."""
    from gpulock.protocol.replies import DeviceUse, LeaseInfo, PoolStatus, TenantUse, WaiterInfo

    leases = [
        LeaseInfo(
            x["lease_id"],
            x["amount"],
            x["token"],
            x["expires_in"],
            x["held_for"],
            x["ttl"],
            "",
            x.get("holder") or {},
            x.get("tenant", ""),  # a broker older than tenants sends none
            x.get("device", 0),  # nor one older than devices
        )
        for x in d.get("leases", [])
    ]
    waiters = [
        WaiterInfo(
            x["position"],
            "",
            x["amount"],
            x["waited"],
            0.0,
            x.get("holder") or {},
            priority=x.get("priority", 0),  # a broker older than priorities sends none
            tenant=x.get("tenant", ""),
            device=x.get("device"),
        )
        for x in d.get("waiters", [])
    ]
    return PoolStatus(
        d["pool"],
        d["capacity"],
        d["used"],
        d.get("epoch", 0),
        d.get("fence", 0),
        d["max_waiters"],
        d["lease_count"],
        d["waiter_count"],
        d.get("grants", 0),
        d.get("reaped_leases", 0),
        d.get("reaped_waiters", 0),
        leases=leases,
        waiters=waiters,
        max_ttl=d.get("max_ttl", 0.0),
        # a broker older than queue policies sends neither: its pools are FIFO
        policy=d.get("policy", DEFAULT_POLICY),
        tenants={
            t: TenantUse(int(u.get("used", 0)), int(u.get("quota", 0)))
            for t, u in (d.get("tenants") or {}).items()
        },
        backfill_window=d.get("backfill_window", DEFAULT_BACKFILL_WINDOW_S),
        devices=[
            DeviceUse(int(x["index"]), int(x["capacity"]), int(x["used"]))
            for x in d.get("devices") or []
        ]
        or [DeviceUse(0, d["capacity"], d["used"])],
        placement=d.get("placement", DEFAULT_PLACEMENT),
    )


def core_error(e: Exception) -> Exception:
    """A gpulock_client error as the core's exception of the same meaning (same attributes), so
    `gpulock run` treats leases through a broker and through Redis alike. gpulock_client's
    QueueFull becomes AcquireTimeout (not granted now; try again later), its AuthError
    :class:`AuthFailed`; anything else a plain GpuLockError with the same message."""
    import gpulock_client as C

    if isinstance(e, C.LeaseLost):
        return E.LeaseLost(e.lease_id, e.reason)
    if isinstance(e, C.AcquireTimeout):
        return E.AcquireTimeout(
            str(e),
            position=e.position,
            queue_length=e.queue_length,
            retry_after=e.retry_after,
            grace_left=e.grace_left,
        )
    if isinstance(e, C.QuotaExceeded):
        return E.QuotaExceeded(e.amount, e.quota, e.tenant, resident=e.resident)
    if isinstance(e, C.CapacityExceeded):  # the broker's message: it may name a device
        return E.CapacityExceeded(e.amount, e.capacity, str(e))
    if isinstance(e, C.QueueFull):
        return E.AcquireTimeout(str(e), queue_length=e.queue_length)
    if isinstance(e, C.InvalidArgument):
        return E.InvalidArgument(str(e))
    if isinstance(e, C.BackendUnavailable):
        return E.BackendUnavailable(str(e))
    if isinstance(e, C.PoolNotFound):
        return E.PoolNotFound(str(getattr(e, "pool", "?")))
    if isinstance(e, C.AuthError):
        return AuthFailed(str(e))
    return E.GpuLockError(str(e))


class BrokerLease:
    """A gpulock_client lease behind the core's exceptions (see core_error); a
    :class:`~gpulock.cli.common.RunLease`."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.id: str = inner.id
        self.token: int = inner.token
        self.device: int = getattr(inner, "device", 0)

    @property
    def valid_until(self) -> float:
        valid_until: float = self._inner.valid_until  # a gpulock_client lease's
        return valid_until

    def on_lost(self, cb: Callable[[Any], Any]) -> None:
        self._inner.on_lost(lambda _lease: cb(self))

    def ensure_valid(self) -> None:
        import gpulock_client

        try:
            self._inner.ensure_valid()
        except gpulock_client.GpuLockError as e:
            raise core_error(e) from e

    def release(self) -> None:
        import gpulock_client

        try:
            self._inner.release()
        except gpulock_client.GpuLockError as e:
            raise core_error(e) from e


class BrokerPool:
    """gpulock_client.Pool with the core Pool's acquire/close and exceptions; a
    :class:`~gpulock.cli.common.RunPool`."""

    def __init__(self, url: str, pool: str, default_ttl: float):
        gpulock_client = _require_client()
        self._inner = gpulock_client.Pool(
            url, pool, token=os.environ.get("GPULOCK_TOKEN"), default_ttl=default_ttl
        )

    def acquire(
        self,
        amount: int,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        holder: dict[str, Any] | None = None,
        on_queued: Callable[[int], Any] | None = None,
        priority: int = 0,
        tenant: str | None = None,
        device: int | None = None,
    ) -> BrokerLease:
        import gpulock_client

        if tenant:
            raise E.InvalidArgument(
                "a broker counts a lease under its token's tenant; a request cannot name one"
            )

        pin = {} if device is None else {"device": device}
        try:
            return BrokerLease(
                self._inner.acquire(
                    amount,
                    ttl=ttl,
                    timeout=timeout,
                    holder=holder,
                    on_queued=on_queued,
                    priority=priority,
                    **pin,
                )
            )
        except gpulock_client.GpuLockError as e:
            raise core_error(e) from e

    def grace_left(self) -> float:
        return float(self._inner.grace_left())

    def close(self) -> None:
        self._inner.close()
