"""The route class of the HTTP lease API's router: bodies with numbers JSON does not have
are refused before FastAPI's validation."""

from __future__ import annotations

import json
import math

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

__all__ = ["FiniteJSONRoute"]


class _NotFinite(ValueError):
    pass


def _no_constant(name: str) -> float:
    raise _NotFinite(name)


def _finite(text: str) -> float:
    f = float(text)
    if not math.isfinite(f):
        raise _NotFinite(text)
    return f


class FiniteJSONRoute(APIRoute):
    """Refuses bodies with NaN, Infinity or overflowing numbers (Python's JSON parser accepts
    them) with a 422, before FastAPI's validation, whose error reply would echo the value back
    and fail to render it (a 500)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            body = await request.body()  # cached: the handler reads it again
            if body:
                try:
                    json.loads(body, parse_constant=_no_constant, parse_float=_finite)
                except _NotFinite as e:
                    return JSONResponse(
                        {
                            "detail": [
                                {
                                    "loc": ["body"],
                                    "type": "value_error",
                                    "msg": f"{e} is not a finite number",
                                }
                            ]
                        },
                        status_code=422,
                    )
                except ValueError:
                    pass  # not JSON: FastAPI answers that
            return await handler(request)

        return route
