"""Validation errors in users' words, one owner for every surface: the HTTP servers' 400/422
(the service, the broker, a user's GpuLimiter app) and the clients that show them (the SDK,
the CLI).

FastAPI answers an invalid body with pydantic's errors, ``{"detail": [{"loc", "msg", "input",
...}]}``, whose ``loc`` names pydantic's internals: each member of a union it tried
(``["body", "input", "list[function-before[integral(), int]]", 0]``) and markers such as
``"[key]"``; and whose ``msg`` may start with "Value error, ". Two steps turn them into what a
user wrote and reads:

* :func:`plain_errors` (a server, which holds the parsed body): each ``loc`` becomes the path
  through the body the client sent (a union member's name or a marker is in no body, and is
  dropped); of the errors a union gave one field, only the deepest are kept (the member that
  matched furthest); errors saying the same at the same path are one; "Value error, " goes.
* :func:`describe` (anyone): a list of errors as one line, ``input[0][1]: Input should be a
  valid integer, unable to parse string as an integer (got "two")``; several messages at one
  path (a union's members) joined with "or".

No I/O here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["describe", "param_of", "path_text", "plain_errors"]

_LOCATIONS = ("body", "query", "path", "header", "cookie")
_PREFIXES = ("Value error, ", "Assertion failed, ")
_NO_BODY = object()


def _walk(loc: Sequence[Any], body: Any, missing: bool) -> tuple[list[Any], bool]:
    """``(loc as a path through body, whether an element was dropped)``: the location first
    (``body``, ``query``, ...), then each key or index that is in ``body``; another element
    (a union member's name, ``[key]``) is dropped, but for a missing field's own name (the
    last element of a ``missing`` error). Without a body to walk, ``loc`` is kept as it is."""
    if not loc:
        return [], False
    out: list[Any] = [loc[0]]
    cur = body if loc[0] == "body" else _NO_BODY
    dropped = False
    rest = list(loc[1:])
    for k, part in enumerate(rest):
        if cur is _NO_BODY:
            out.append(part)
        elif isinstance(part, int) and isinstance(cur, list) and 0 <= part < len(cur):
            out.append(part)
            cur = cur[part]
        elif isinstance(part, str) and isinstance(cur, dict) and part in cur:
            out.append(part)
            cur = cur[part]
        elif missing and k == len(rest) - 1 and isinstance(part, str):
            out.append(part)
        else:
            dropped = True
    return out, dropped


def plain_errors(errors: Iterable[Any], body: Any = _NO_BODY) -> list[dict[str, Any]]:
    """``errors`` (pydantic's, as FastAPI lists them) with each ``loc`` the path through
    ``body`` (the parsed JSON the client sent) that the user wrote (see the module
    docstring). Among the errors of one field of which any named a union member, only those
    of the deepest path are kept; errors with the same path and message are one; a message's
    "Value error, " is left out. Each error is a new dict; anything that is not a dict is
    left out."""
    walked: list[tuple[dict[str, Any], bool]] = []
    for e in errors:
        if not isinstance(e, dict):
            continue
        loc = e.get("loc")
        loc = list(loc) if isinstance(loc, (list, tuple)) else []
        path, dropped = _walk(loc, body, e.get("type") == "missing")
        walked.append(({**e, "loc": path, "msg": _message(e.get("msg"))}, dropped))
    deepest: dict[tuple[Any, ...], int] = {}
    unions: set[tuple[Any, ...]] = set()
    for e, dropped in walked:
        field = tuple(e["loc"][:2])
        deepest[field] = max(deepest.get(field, 0), len(e["loc"]))
        if dropped:
            unions.add(field)
    out: list[dict[str, Any]] = []
    seen: set[tuple[str, str]] = set()
    for e, _ in walked:
        field = tuple(e["loc"][:2])
        if field in unions and len(e["loc"]) < deepest[field]:
            continue
        key = (json.dumps(e["loc"], default=str), str(e.get("msg")))
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def path_text(loc: Sequence[Any]) -> str:
    """A ``loc`` as a user writes the path: ``input[0][1]``, ``holder.job``,
    ``quotas["team a"]``; a leading ``body`` left out, another location said after the name
    (``limit (query)``); ``body`` for the body itself."""
    parts = list(loc)
    where = parts.pop(0) if parts and parts[0] in _LOCATIONS else "body"
    text = ""
    for p in parts:
        if isinstance(p, int):
            text += f"[{p}]"
        elif isinstance(p, str) and p.isidentifier():
            text += f".{p}" if text else p
        else:
            text += f"[{json.dumps(str(p))}]"
    if not text:
        return where
    return text if where == "body" else f"{text} ({where})"


def _message(msg: Any) -> str:
    m = str(msg) if msg is not None else "invalid"
    for prefix in _PREFIXES:
        if m.startswith(prefix):
            return m[len(prefix) :]
    return m


def _joined(msgs: list[str]) -> str:
    """Several messages about one path (a union's members) as one: ``Input should be a valid
    string, a valid integer or a valid list``."""
    if len(msgs) == 1:
        return msgs[0]
    head = "Input should be "
    if all(m.startswith(head) for m in msgs):
        rest = [m[len(head) :] for m in msgs]
        return head + ", ".join(rest[:-1]) + " or " + rest[-1]
    return "; or ".join(msgs)


def describe(errors: Iterable[Any], *, show_input: int = 120) -> str:
    """``errors`` (FastAPI's ``detail`` list; dicts with ``loc`` and ``msg``) as one line:
    ``path: message (got value)`` for each path, ``; ``-separated. The value is the error's
    ``input`` as JSON, cut to ``show_input`` characters (none for a missing field, or when the
    message names it already: gpulock's checks say ``..., got <value>``)."""
    order: list[str] = []
    msgs: dict[str, list[str]] = {}
    got: dict[str, str] = {}
    for e in errors:
        if not isinstance(e, dict):
            continue
        loc = e.get("loc")
        where = path_text(loc if isinstance(loc, (list, tuple)) else ())
        if where not in msgs:
            order.append(where)
            msgs[where] = []
        m = _message(e.get("msg"))
        if m not in msgs[where]:
            msgs[where].append(m)
        if where not in got and "input" in e and e.get("type") != "missing":
            got[where] = json.dumps(e["input"], default=str)[:show_input]
    return "; ".join(
        f"{w}: {_joined(msgs[w])}"
        + (f" (got {got[w]})" if w in got and not _says_got(msgs[w]) else "")
        for w in order
    )


def _says_got(msgs: list[str]) -> bool:
    """Whether every message already names the value (gpulock's own checks end in ``, got
    <value>``, a size's in ``; got <value>``), so that ``(got ...)`` would say it twice."""
    return all(", got " in m or "; got " in m for m in msgs)


def param_of(errors: Iterable[Any]) -> str | None:
    """The field the first error is about (``input`` of ``input[0][1]``), or None."""
    for e in errors:
        loc = e.get("loc") if isinstance(e, dict) else None
        if isinstance(loc, (list, tuple)):
            parts = list(loc[1:]) if loc and loc[0] in _LOCATIONS else list(loc)
            return str(parts[0]) if parts else None
    return None
