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
from ._stream import LeasedStream, StreamLease, lease_param, stream_kind


class _Calls(Protocol):
    """What the route shapes use of a ``GpuLimiter``: its guarded calls (``limiter.calls``,
    :class:`~gpulock.fastapi._call.GuardedCalls`)."""

    def admit(self, route: str) -> None: ...

    async def call(
        self,
        fn: Callable[[], Any] | LeasedStream,
        *,
        route: str,
        amount: int | str,
        request: Request | None = None,
        response: Response | None = None,
        request_id: str | None = None,
        fingerprint_of: Callable[[], str] | None = None,
        priority: int | RoutePriority = 0,
        preemptible: bool | None = None,
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
    function and its arguments; the result comes back after the thread returned. Or
    :meth:`stream` a generator under the lease. ``preemptible``: the route's (the pool may ask
    its leases to yield; docs/SERVICE.md, "Preemption")."""

    def __init__(
        self,
        calls: _Calls,
        route: str,
        estimate: Callable[..., int] | None,
        request: Request,
        response: Response,
        priority: RoutePriority | None = None,
        preemptible: bool = False,
    ):
        self.calls, self.route, self._estimate = calls, route, estimate
        self.request, self.response = request, response
        self.priority = priority or RoutePriority()
        self.preemptible = preemptible

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
            preemptible=self.preemptible,
        )

    async def stream(
        self,
        fn: Callable[..., Any],
        *args: Any,
        amount: int | str | None = None,
        media_type: str = "sse",
        **kwargs: Any,
    ) -> LeasedStream:
        """Lease ``amount`` bytes (default ``estimate(*args, **kwargs)``), make the first chunk
        of ``fn(*args, **kwargs)`` (a generator function, sync or async, or a plain function
        returning an iterable; a parameter of ``fn`` annotated :class:`StreamLease` receives
        the stream's lease) and return the response that streams the rest under the lease
        (:mod:`gpulock.fastapi._stream`); return it from the handler. ``media_type``: ``"sse"``
        (server-sent events, ``data: [DONE]`` at the end) or a plain stream's media type.
        Errors until the first chunk is made are raised as :meth:`__call__`'s are.

        Raises: TypeError for a coroutine function or no amount; InvalidArgument for a bad
        ``media_type``."""
        if inspect.iscoroutinefunction(fn):
            raise TypeError(
                "GpuCall.stream takes a generator function (sync or async) or a plain function "
                "returning an iterable; got a coroutine function"
            )
        if amount is None:
            if self._estimate is None:
                raise TypeError("give amount= or an estimate to guard()")
            amount = self._estimate(*args, **kwargs)
        body = LeasedStream(_source(fn, args, kwargs), media_type, route=self.route)
        result: LeasedStream = await self.calls.call(
            body,
            route=self.route,
            amount=amount,
            request=self.request,
            response=self.response,
            priority=self.priority,
            preemptible=self.preemptible,
        )
        return result


def _source(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[[StreamLease], Any]:
    """``fn`` bound to its arguments, taking the stream's lease (passed to the parameter
    annotated :class:`StreamLease`, if it has one)."""
    name = lease_param(fn)
    if name is None:
        return lambda handle: fn(*args, **kwargs)
    return lambda handle: fn(*args, **{**kwargs, name: handle})


def guard(
    calls: _Calls,
    route: str,
    estimate: Callable[..., int] | None,
    priority: RoutePriority | None = None,
    preemptible: bool = False,
) -> Callable[..., GpuCall]:
    """The dependency behind ``GpuLimiter.guard``: gives each request a :class:`GpuCall`."""

    def dependency(request: Request, response: Response) -> GpuCall:
        return GpuCall(calls, route, estimate, request, response, priority, preemptible)

    return dependency


def endpoint(
    calls: _Calls,
    route: str,
    estimate: Callable[..., int],
    priority: RoutePriority | None = None,
    stream: str | None = None,
    preemptible: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The decorator behind ``GpuLimiter.endpoint``: the handler's parameters, with their
    resolved annotations, made keyword-only, plus a ``Request`` and a ``Response`` parameter
    when it has none; ``estimate`` receives the parameters it declares (all of them when it
    takes ``**kwargs``). ``stream`` (``"sse"`` or a media type): the handler is a generator
    function (sync or async) or returns an iterable, streamed under the lease
    (:class:`LeasedStream`); its parameter annotated :class:`StreamLease`, if any, is not
    FastAPI's but receives the stream's lease. ``preemptible``: the pool may ask the route's
    leases to yield (a stream then ends at its next chunk boundary).

    Raises: TypeError for an ``async def`` handler; InvalidArgument for a bad ``stream``."""
    if stream is not None:
        stream_kind(stream)  # refused when the route is declared

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):
            raise TypeError(
                "gpulock endpoint() wraps a plain def handler (its body runs in a thread); "
                "in an async handler use Depends(limiter.guard(...)) and await call(fn, ...)"
                + (", or a generator function (sync or async) with stream=" if stream else "")
            )
        sig = inspect.signature(fn)
        try:
            hints = typing.get_type_hints(fn, include_extras=True)
        except Exception:
            hints = {}
        lease_name = lease_param(fn) if stream is not None else None
        params = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in sig.parameters.values()
            if p.name != lease_name
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
            work: Callable[[], Any] | LeasedStream = functools.partial(fn, **user_kw)
            if stream is not None:
                work = LeasedStream(_source(fn, (), user_kw), stream, route=route)
            return await calls.call(
                work,
                route=route,
                amount=amount,
                request=request,
                response=response,
                fingerprint_of=lambda: _fingerprint(route, user_kw),
                priority=priority or RoutePriority(),
                preemptible=preemptible,
            )

        ret = hints.get("return", sig.return_annotation)
        if stream is not None:
            # FastAPI streams a generator handler itself (found through __wrapped__, and a
            # return annotation of what it yields): it sees an async def returning a response
            del wrapper.__wrapped__
            ret = LeasedStream
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
