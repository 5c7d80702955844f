"""An integer as a JSON body carries it, for pydantic request models.

JSON Schema's ``integer`` (what an OpenAPI schema says for an ``int`` field) includes ``3.0``:
a number with a zero fraction is an integer. Pydantic's strict ``int`` refuses it, so a client
that writes numbers as floats (JavaScript, schemathesis) was refused a value its schema allows.
:data:`JsonInt` takes ``3`` and ``3.0`` as 3 and still refuses ``"3"``, ``true``, ``3.5``,
NaN and infinities; its schema stays ``{"type": "integer"}``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BeforeValidator, Strict
from typing_extensions import Annotated

__all__ = ["INTEGRAL", "JsonInt", "integral"]


def integral(v: Any) -> Any:
    """``v`` as an int when it is a float with no fraction (``3.0`` -> 3), else ``v`` unchanged
    (the strict int check then refuses what is not an int)."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


#: The validator, for a constrained field: ``Annotated[int, Field(ge=1), INTEGRAL]`` (the
#: constraints before it, so that they reach the schema as ``minimum``/``maximum``).
INTEGRAL = BeforeValidator(integral)

JsonInt = Annotated[int, Strict(), INTEGRAL]
