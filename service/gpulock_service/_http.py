"""HTTP details shared by the embeddings service and the lease broker."""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


def _finite(x: Any) -> Any:
    """The value with every non-finite float (NaN, ±Infinity) replaced by its name."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI's own handler echoes the bad input; Python's JSON parser accepts NaN and
    # Infinity, which JSON (and so the error response) cannot carry: that was a 500.
    return JSONResponse({"detail": _finite(jsonable_encoder(exc.errors()))}, status_code=422)


def install_error_handlers(app: FastAPI) -> None:
    """422 for every invalid request, also one that sent NaN or Infinity."""
    app.add_exception_handler(RequestValidationError, _validation_error)
