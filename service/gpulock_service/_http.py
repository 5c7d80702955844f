"""HTTP details shared by the embeddings service and the lease broker."""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


def _renderable(x: Any) -> Any:
    """The value with what JSON in UTF-8 cannot carry made printable: non-finite floats (NaN,
    ±Infinity) become their names, lone surrogates (``"\\ud800"``) their escapes."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, str):
        try:
            x.encode("utf-8")
            return x
        except UnicodeEncodeError:
            return x.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(x, dict):
        return {_renderable(k): _renderable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_renderable(v) for v in x]
    return x


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI's own handler echoes the bad input; Python's JSON parser accepts NaN, Infinity
    # and lone surrogates, which the error response cannot carry: each was a 500.
    return JSONResponse({"detail": _renderable(jsonable_encoder(exc.errors()))}, status_code=422)


def install_error_handlers(app: FastAPI) -> None:
    """422 for every invalid request, also one that sent NaN, Infinity or a lone surrogate."""
    app.add_exception_handler(RequestValidationError, _validation_error)
