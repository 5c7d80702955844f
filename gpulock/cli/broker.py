"""The CLI's side of an HTTP broker (``--broker-url``): the pool routes of the broker's API
behind the core's exceptions, and a gpulock_client pool with the surface ``gpulock run`` uses.
Needs the ``gpulock-client`` package (httpx); imported only when a broker URL is in use."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, Callable

from gpulock_common.wire import error_from_reply
from gpulock_common.options import DEFAULT_BACKFILL_WINDOW_S, DEFAULT_PLACEMENT, DEFAULT_POLICY

from gpulock import errors as E
from gpulock.admin.pools import DeleteResult
from gpulock.cli.common import EXIT_USAGE, fail


def _require_client() -> ModuleType:
    try:
        import gpulock_client
    except ImportError:
        fail(
            EXIT_USAGE,
            "--broker-url needs the gpulock-client package: from a checkout of gpulock, pip install -e ./clients/common -e ./clients/python",
        )
    return gpulock_client


class BrokerAdmin:
    """Blocking calls to the broker's pool routes (``/v1/pools...``) with the token from
    ``GPULOCK_TOKEN``; an error reply raises the shared error the error table reads it as
    (:func:`gpulock_common.wire.error_from_reply`: PoolNotFound, BackendUnavailable,
    AuthError, ...)."""

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
            raise error_from_reply(status, body, None if pool == "*" else pool)
        return body

    def delete_pool(self, name: str, *, force: bool = False) -> DeleteResult:
        """``DELETE /v1/pools/NAME``: the same outcomes as gpulock.admin.pools.delete_pool (404 is
        ``missing``, 409 ``in_use`` with the broker's counts)."""
        status, body = self._request(
            "DELETE", f"/v1/pools/{name}", params={"force": "true"} if force else None
        )
        detail = body.get("detail") if isinstance(body, dict) else None
        code = detail.get("error") if isinstance(detail, dict) else None
        if status == 409 and code == "pool_in_use" and isinstance(detail, dict):
            return DeleteResult(
                "in_use", int(detail.get("leases") or 0), int(detail.get("waiters") or 0)
            )
        if status >= 300:
            err = error_from_reply(status, body, name)
            if isinstance(err, E.PoolNotFound):
                return DeleteResult("missing", 0, 0)
            raise err
        return DeleteResult("deleted", int(body.get("leases") or 0), int(body.get("waiters") or 0))

    def close(self) -> None:
        self._http.close()


def status_from_dict(d: dict[str, Any]) -> Any:
    """A broker's pool object (``GET /v1/pools/NAME``) as the core's PoolStatus."""
    from gpulock.estimates.wait import DrainRate
    from gpulock_common.options import Preemption

    from gpulock.protocol.replies import (
        DeviceUse,
        LeaseInfo,
        PoolStatus,
        TenantUse,
        WaiterInfo,
        YieldCounts,
    )

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
            x.get("yield_in"),  # nor one older than preemption
            x.get("priority"),
            x.get("kept", False),  # nor one older than kept bytes
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
            growth_of=x.get("growth_of"),  # a broker older than resizes sends none
            growth_token=x.get("growth_token"),
            estimated_wait=x.get("estimated_wait_s"),  # the server's, by the one rule
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
        drain=DrainRate(**d["drain"]) if d.get("drain") else None,  # an older broker: none
        preemption=Preemption(**d["preemption"]) if d.get("preemption") else None,
        yields=YieldCounts(**(d.get("yields") or {})),
        kept_bytes=d.get("kept_bytes", 0),
        kept_leases=d.get("kept_leases", 0),
        releases_kept=d.get("releases_kept", 0),
        kept_asked_back=d.get("kept_asked_back", 0),
    )


def core_error(e: Exception) -> Exception:
    """A gpulock_client error as `gpulock run` treats it: the SDK raises the core's own classes
    (the shared tree of gpulock_common), so each is itself, but a full queue, which `gpulock
    run` reports as not granted now (AcquireTimeout: try again later, exit 75)."""
    if isinstance(e, E.QueueFull):
        return E.AcquireTimeout(str(e), queue_length=e.queue_length)
    return e


class BrokerLease:
    """A gpulock_client lease (whose exceptions are the core's); a
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

    @property
    def yield_deadline(self) -> float | None:
        deadline: float | None = self._inner.yield_deadline  # a gpulock_client lease's
        return deadline

    def on_lost(self, cb: Callable[[Any], Any]) -> None:
        self._inner.on_lost(lambda _lease: cb(self))

    def on_yield(self, cb: Callable[[Any], Any]) -> None:
        self._inner.on_yield(lambda _lease: cb(self))

    def ensure_valid(self) -> None:
        self._inner.ensure_valid()

    def release(self) -> None:
        self._inner.release()


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
        preemptible: bool = True,
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
                    preemptible=preemptible,
                    **pin,
                )
            )
        except gpulock_client.QueueFull as e:
            raise core_error(e) from e

    def grace_left(self) -> float:
        return float(self._inner.grace_left())

    def close(self) -> None:
        self._inner.close()
