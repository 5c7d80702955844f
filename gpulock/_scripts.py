"""The Lua script registry: reads ``lua/*.lua`` once, prepends ``lib.lua`` and keeps each
script's SHA1 so calls go out as EVALSHA. On NOSCRIPT (a restarted Redis, SCRIPT FLUSH,
failover) the caller loads the script again and retries once; see ``_sync.py``/``_async.py``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

OPERATIONS = (
    "acquire",
    "release",
    "renew",
    "cancel",
    "reap",
    "status",
    "configure",
    "reassert",
    "external",
)


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str


def _lua_dir() -> Traversable:
    """The scripts ship inside the wheel as ``gpulock/lua``; a source checkout keeps them in
    the top-level ``lua/`` folder next to the package."""
    packaged = resources.files("gpulock").joinpath("lua")
    if packaged.joinpath("lib.lua").is_file():
        return packaged
    return Path(__file__).resolve().parent.parent / "lua"


@cache
def scripts() -> dict[str, Script]:
    """All operations, keyed by name (``acquire``, ``release``, ...)."""
    d = _lua_dir()
    lib = d.joinpath("lib.lua").read_text(encoding="utf-8")
    out = {}
    for name in OPERATIONS:
        body = d.joinpath(f"{name}.lua").read_text(encoding="utf-8")
        source = lib + "\n" + body
        out[name] = Script(name, source, hashlib.sha1(source.encode()).hexdigest())
    return out
