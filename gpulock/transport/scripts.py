"""The Lua script registry: reads ``lua/*.lua`` once and builds each operation in its two
forms, both from the same files:

* a **script** (``Script.source``, run with ``EVALSHA Script.sha``): ``lib.lua``, then
  ``bind(KEYS)``, then the operation's file. Every Redis and Valkey runs it.
* a **function** of the one gpulock **library** (:func:`library`, loaded once per server with
  ``FUNCTION LOAD``, run with ``FCALL Script.function``): ``lib.lua`` once, then each
  operation's file wrapped as a function of ``(KEYS, ARGV)`` that starts with ``bind(KEYS)``.
  Redis ≥ 7.0 and Valkey ≥ 7.2. A function does not rebuild ``lib.lua``'s helpers on every
  call as a script does, which is most of what the library saves (docs/BENCHMARKS.md).

The library's name carries a hash of its code (``gpulock_<12 hex>``, its functions
``gpulock_<12 hex>_<operation>``), so two gpulock versions on one server never replace each
other's functions. Which form a server gets, and what to do when a script or the library is
missing there, is :mod:`gpulock.transport.dialect`'s to decide.
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
    "resize",
)

#: Operations registered with the ``allow-oom`` flag: a function without it is refused as a
#: whole while Redis is over ``maxmemory``; these free memory or change none it would need
#: (a renewal moves an expiry), so holders keep their leases and give them back when Redis is
#: full. A script (EVALSHA) has no flags: Redis refuses its first write that may grow memory
#: instead, and these scripts then still run (docs/RELIABILITY.md, "Redis is full").
ALLOW_OOM = frozenset({"release", "renew", "cancel", "reap", "status"})

_SCRIPT_PRELUDE = "if redis.replicate_commands then redis.replicate_commands() end\n"


@dataclass(frozen=True)
class Script:
    """One operation: ``source`` and ``sha`` of its script form, ``function`` the name of its
    function in :func:`library`."""

    name: str
    source: str
    sha: str
    function: str


@dataclass(frozen=True)
class Library:
    """The gpulock function library: ``name`` and ``code`` (for ``FUNCTION LOAD``)."""

    name: str
    code: str


def _lua_dir() -> Traversable:
    """The scripts ship inside the wheel as ``gpulock/lua``; a source checkout keeps them in
    the top-level ``lua/`` folder next to the package."""
    packaged = resources.files("gpulock").joinpath("lua")
    if packaged.joinpath("lib.lua").is_file():
        return packaged
    return Path(__file__).resolve().parents[2] / "lua"


@cache
def _sources() -> tuple[str, dict[str, str]]:
    d = _lua_dir()
    lib = d.joinpath("lib.lua").read_text(encoding="utf-8")
    return lib, {n: d.joinpath(f"{n}.lua").read_text(encoding="utf-8") for n in OPERATIONS}


@cache
def library() -> Library:
    """The function library: ``lib.lua``, then one function per operation."""
    lib, bodies = _sources()
    tag = hashlib.sha1("\0".join([lib, *(bodies[n] for n in OPERATIONS)]).encode()).hexdigest()[:12]
    name = f"gpulock_{tag}"
    parts = [f"#!lua name={name}\n", lib]
    for op in OPERATIONS:
        flags = "{'allow-oom'}" if op in ALLOW_OOM else "{}"
        parts.append(
            f"\nlocal function op_{op}(KEYS, ARGV)\nbind(KEYS)\n{bodies[op]}\nend\n"
            f"redis.register_function{{function_name='{name}_{op}', callback=op_{op}, "
            f"flags={flags}}}\n"
        )
    return Library(name, "".join(parts))


@cache
def scripts() -> dict[str, Script]:
    """All operations, keyed by name (``acquire``, ``release``, ...)."""
    lib, bodies = _sources()
    prefix = library().name
    out = {}
    for name in OPERATIONS:
        source = _SCRIPT_PRELUDE + lib + "\nbind(KEYS)\n" + bodies[name]
        out[name] = Script(
            name, source, hashlib.sha1(source.encode()).hexdigest(), f"{prefix}_{name}"
        )
    return out
