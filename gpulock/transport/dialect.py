"""How a gpulock script call is spelled for one server, and how a call that finds its script
missing recovers: no I/O, one copy for every driver (sync and asyncio calls, pipelines, the
background runtime).

A :class:`Dialect` starts with functions: ``FCALL gpulock_<hash>_<op>`` of the library of
:func:`gpulock.transport.scripts.library` (Redis ≥ 7.0, Valkey ≥ 7.2). When the server shows it cannot
run them (no ``FCALL`` or ``FUNCTION`` command, as Redis 6.2; or the user's ACL refuses them)
it switches, once, to scripts: ``EVALSHA <sha>``. A call that finds its code missing (a
restart without data, ``SCRIPT FLUSH`` / ``FUNCTION FLUSH``, a failover to a replica that had
not received it) loads it and tries again: :meth:`Dialect.recover` yields the steps, the
driver carries them out.
"""

from __future__ import annotations

import weakref
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

from gpulock.transport.scripts import Script, library

__all__ = ["Dialect", "Load", "Send", "dialect_of"]


@dataclass(frozen=True)
class Send:
    """Send the command ``words`` and give its reply to the recovery (or raise its error)."""

    words: tuple[Any, ...]


@dataclass(frozen=True)
class Load:
    """Load code on the server: ``kind`` "script" (``SCRIPT LOAD code``) or "library"
    (``FUNCTION LOAD REPLACE code``: on a cluster, on every master)."""

    kind: str
    code: str


def _unusable(err: BaseException, command: str) -> bool:
    """Whether ``err`` says the server cannot run ``command`` for us: it does not know it, or
    the user's ACL refuses it."""
    text = str(err).lower()
    if isinstance(err, NoPermissionError):
        return command in text  # not a refusal of the pool's keys
    return isinstance(err, ResponseError) and "unknown command" in text and command in text


class Dialect:
    """One client's way of calling the gpulock scripts (see the module docstring).
    ``functions``: whether calls go out as ``FCALL`` (else ``EVALSHA``)."""

    __slots__ = ("functions", "__weakref__")

    def __init__(self, functions: bool = True):
        self.functions = functions

    def words(self, sc: Script, keys: Sequence[str], args: Sequence[Any]) -> tuple[Any, ...]:
        """The command that runs ``sc`` with ``keys`` and ``args``."""
        if self.functions:
            return ("FCALL", sc.function, len(keys), *keys, *args)
        return ("EVALSHA", sc.sha, len(keys), *keys, *args)

    def fix(self, err: BaseException, sc: Script) -> Load | None:
        """What to load after ``sc`` failed with ``err`` (one :meth:`is_missing` says is about
        missing code): the script, the library, or nothing but a retry (``None``: after
        switching to scripts, or when another call switched already and this one's ``FCALL``
        was sent before it)."""
        if isinstance(err, NoScriptError):
            return Load("script", sc.source)
        if isinstance(err, ResponseError) and _missing_function(err):
            return Load("library", library().code) if self.functions else None
        if _unusable(err, "fcall"):
            self.functions = False  # the server cannot run functions: scripts from now on
        return None

    def is_missing(self, err: BaseException) -> bool:
        """Whether ``err`` says the code of a call is missing or cannot run as sent (then
        :meth:`fix` says what to do before trying again). Also when this client has switched
        to scripts since the call was sent: calls in flight at that moment retry too."""
        return isinstance(err, NoScriptError) or (
            isinstance(err, ResponseError) and (_missing_function(err) or _unusable(err, "fcall"))
        )

    def load_failed(self, step: Load, err: BaseException) -> bool:
        """After ``step`` failed with ``err``: whether to go on with scripts (the server
        cannot load functions: no ``FUNCTION`` command, or the ACL refuses it); else the
        error is the call's."""
        if step.kind == "library" and _unusable(err, "function"):
            self.functions = False
            return True
        return False

    def recover(
        self, err: BaseException, sc: Script, keys: Sequence[str], args: Sequence[Any]
    ) -> Generator[Send | Load, Any, Any]:
        """After the first try of ``sc`` failed with ``err``: load what is missing and try
        again, at most twice. Returns the reply; raises ``err`` when it is not about missing
        code, or the error of the last try."""
        for _ in range(3):
            if not self.is_missing(err):
                raise err
            step = self.fix(err, sc)
            if step is not None:
                try:
                    yield step
                except (ResponseError, NoPermissionError) as e:
                    if not self.load_failed(step, e):
                        raise
            try:
                return (yield Send(self.words(sc, keys, args)))
            except (ResponseError, NoPermissionError) as e:
                err = e
        raise err


def _missing_function(err: ResponseError) -> bool:
    return "function not found" in str(err).lower()


_DIALECTS: weakref.WeakKeyDictionary[Any, Dialect] = weakref.WeakKeyDictionary()


def dialect_of(client: Any) -> Dialect:
    """The :class:`Dialect` of a redis-py client (sync or asyncio; made on first use), shared
    by every pool object on it, so that the server is probed once per client."""
    if client is None:  # no client (a runtime made without one, in unit tests)
        return Dialect()
    d = _DIALECTS.get(client)
    if d is None:
        d = _DIALECTS[client] = Dialect()
    return d
