"""The two shapes a route takes its lease in: ``Depends(limiter.guard(...))`` gives the handler
a :class:`GpuCall`; ``@limiter.endpoint(...)`` rewrites a plain ``def`` handler's signature
into an ``async def`` FastAPI sees with the same parameters (plus the Request and Response it
needs), whose body runs under the lease. Both fingerprint the call's arguments, so a reused
``X-Request-ID`` with other arguments is told apart (409)."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import typing
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import Request, Response

from ._priority import RoutePriority


class _Calls(Protocol):
    """What the route shapes use of a ``GpuLimiter``: its guarded calls (``limiter.calls``,
    :class:`~gpulock.fastapi._call.GuardedCalls`)."""

    def admit(self, route: str) -> None: ...

    async def call(
        self,
        fn: Callable[[], Any],
        *,
        route: str,
        amount: int | str,
        request: Request | None = None,
        response: Response | None = None,
        request_id: str | None = None,
        fingerprint_of: Callable[[], str] | None = None,
        priority: int | RoutePriority = 0,
    ) -> Any: ...


def _order_params(params: list[inspect.Parameter]) -> list[inspect.Parameter]:
    """Parameters in an order ``inspect.Signature`` accepts (positional ones first, keyword
    ones after); our handlers are called by keyword only."""
    return [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        else p
        for p in params
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]


def _fingerprint(route: str, kwargs: dict[str, Any]) -> str:
    """16 hex digits of SHA-256 over the route and the JSON of the call's arguments (their
    ``repr`` when they do not encode)."""
    try:
        from fastapi.encoders import jsonable_encoder

        text = json.dumps(
            jsonable_encoder(kwargs), sort_keys=True, separators=(",", ":"), default=repr
        )
    except Exception:
        text = repr(sorted(kwargs.items()))
    return hashlib.sha256(f"{route}\n{text}".encode()).hexdigest()[:16]


class GpuCall:
    """What ``Depends(limiter.guard(route, estimate=...))`` gives a handler: call it with the
    function and its arguments; the result comes back after the thread returned."""

    def __init__(
        self,
        calls: _Calls,
        route: str,
        estimate: Callable[..., int] | None,
        request: Request,
        response: Response,
        priority: RoutePriority | None = None,
    ):
        self.calls, self.route, self._estimate = calls, route, estimate
        self.request, self.response = request, response
        self.priority = priority or RoutePriority()

    async def __call__(
        self, fn: Callable[..., Any], *args: Any, amount: int | str | None = None, **kwargs: Any
    ) -> Any:
        if inspect.iscoroutinefunction(fn):
            raise TypeError("GpuCall runs a plain function in a thread; got a coroutine function")
        if amount is None:
            if self._estimate is None:
                raise TypeError("give amount= or an estimate to guard()")
            amount = self._estimate(*args, **kwargs)
        return await self.calls.call(
            functools.partial(fn, *args, **kwargs),
            route=self.route,
            amount=amount,
            request=self.request,
            response=self.response,
            fingerprint_of=lambda: _fingerprint(self.route, {"args": args, **kwargs}),
            priority=self.priority,
        )


def guard(
    calls: _Calls,
    route: str,
    estimate: Callable[..., int] | None,
    priority: RoutePriority | None = None,
) -> Callable[..., GpuCall]:
    """The dependency behind ``GpuLimiter.guard``: gives each request a :class:`GpuCall`."""

    def dependency(request: Request, response: Response) -> GpuCall:
        return GpuCall(calls, route, estimate, request, response, priority)

    return dependency


def endpoint(
    calls: _Calls,
    route: str,
    estimate: Callable[..., int],
    priority: RoutePriority | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The decorator behind ``GpuLimiter.endpoint``: the handler's parameters, with their
    resolved annotations, made keyword-only, plus a ``Request`` and a ``Response`` parameter
    when it has none; ``estimate`` receives the parameters it declares (all of them when it
    takes ``**kwargs``).

    Raises: TypeError for an ``async def`` handler."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):
            raise TypeError(
                "gpulock endpoint() wraps a plain def handler (its body runs in a thread); "
                "in an async handler use Depends(limiter.guard(...)) and await call(fn, ...)"
            )
        sig = inspect.signature(fn)
        try:
            hints = typing.get_type_hints(fn, include_extras=True)
        except Exception:
            hints = {}
        params = [
            p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()
        ]
        names = {p.name for p in params}
        req_name = next((p.name for p in params if p.annotation is Request), None)
        resp_name = next((p.name for p in params if p.annotation is Response), None)
        extra = []
        if req_name is None:
            req_name = "_gpulock_request"
            extra.append(
                inspect.Parameter(req_name, inspect.Parameter.KEYWORD_ONLY, annotation=Request)
            )
        if resp_name is None:
            resp_name = "_gpulock_response"
            extra.append(
                inspect.Parameter(resp_name, inspect.Parameter.KEYWORD_ONLY, annotation=Response)
            )
        est_params = inspect.signature(estimate).parameters
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in est_params.values())

        @functools.wraps(fn)
        async def wrapper(**kw: Any) -> Any:
            request: Request = kw[req_name]
            response: Response = kw[resp_name]
            user_kw = {k: v for k, v in kw.items() if k in names}
            calls.admit(route)
            est_kw = user_kw if takes_all else {k: v for k, v in user_kw.items() if k in est_params}
            amount = estimate(**est_kw)
            return await calls.call(
                functools.partial(fn, **user_kw),
                route=route,
                amount=amount,
                request=request,
                response=response,
                fingerprint_of=lambda: _fingerprint(route, user_kw),
                priority=priority or RoutePriority(),
            )

        ret = hints.get("return", sig.return_annotation)
        # Functions take any attribute, and inspect.signature (so FastAPI) reads this one;
        # typeshed's functools._Wrapped does not declare it.
        wrapper.__signature__ = sig.replace(  # type: ignore[attr-defined]
            parameters=_order_params(params + extra), return_annotation=ret
        )
        wrapper.__annotations__ = {
            **{p.name: p.annotation for p in params + extra},
            "return": ret,
        }
        return wrapper

    return deco
