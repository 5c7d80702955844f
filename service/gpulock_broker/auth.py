"""Bearer tokens for the HTTP lease API.

Tokens come from a JSON document, read from a file (``--tokens-file`` or
``GPULOCK_BROKER_TOKENS_FILE``) or from the environment (``GPULOCK_BROKER_TOKENS``)::

    {"tokens": [
      {"name": "trainer-a", "token": "<secret>",  "pools": ["gpu0", "gpu1"]},
      {"name": "ops",       "sha256": "<hex of sha256(secret)>", "pools": ["*"], "admin": true}
    ]}

``pools`` lists the pools the token may lease from (``"*"``: all); ``admin`` allows
``PUT /v1/pools/{pool}`` (capacity). ``tenant`` names the tenant the token's leases count
under for tenant quotas (1-64 of ``[A-Za-z0-9._:-]``, ``""`` for none); left out, it is the
token's ``name`` when that is a valid tenant name, else none. A client cannot choose it. Give ``sha256`` instead of ``token`` to keep the secret
out of the file. A token is checked by hashing it and comparing the digest with every entry in
constant time (``hmac.compare_digest``, no early exit). A token's identity, recorded with its
leases so that only it can renew or release them, is the first 16 hex digits of its SHA-256:
never the token itself. Tokens are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from gpulock.protocol.args import TENANT_RE, validate_tenant
from gpulock.errors import InvalidArgument

__all__ = ["Principal", "TokenStore", "load_tokens", "TokenConfigError"]

MIN_TOKEN_CHARS = 16


class TokenConfigError(ValueError):
    """The token configuration is missing or malformed; the message says where and why."""


@dataclass(frozen=True)
class Principal:
    """Who a valid token belongs to. ``id`` is a hash prefix of the token, safe to store."""

    name: str
    id: str
    pools: frozenset[str]
    admin: bool
    digest: bytes
    tenant: str = ""  # the tenant its leases count under ("" for none)

    def may_use(self, pool: str) -> bool:
        return "*" in self.pools or pool in self.pools

    def __repr__(self) -> str:  # never print the digest
        return (
            f"Principal(name={self.name!r}, id={self.id!r}, admin={self.admin}, "
            f"tenant={self.tenant!r})"
        )


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def _principal(i: int, e: Any, where: str) -> Principal:
    if not isinstance(e, dict):
        raise TokenConfigError(f"{where}: tokens[{i}] must be an object")
    unknown = set(e) - {"name", "token", "sha256", "pools", "admin", "tenant"}
    if unknown:
        raise TokenConfigError(f"{where}: tokens[{i}] has unknown keys {sorted(unknown)}")
    if ("token" in e) == ("sha256" in e):
        raise TokenConfigError(f"{where}: tokens[{i}] needs exactly one of 'token' or 'sha256'")
    if "token" in e:
        tok = e["token"]
        if not isinstance(tok, str) or len(tok) < MIN_TOKEN_CHARS:
            raise TokenConfigError(
                f"{where}: tokens[{i}].token must be a string of at least "
                f"{MIN_TOKEN_CHARS} characters"
            )
        digest = token_digest(tok)
    else:
        h = e["sha256"]
        try:
            digest = bytes.fromhex(h) if isinstance(h, str) else b""
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise TokenConfigError(f"{where}: tokens[{i}].sha256 must be 64 hex digits")
    pools = e.get("pools", [])
    if not isinstance(pools, list) or not all(isinstance(p, str) and p for p in pools):
        raise TokenConfigError(f'{where}: tokens[{i}].pools must be a list of pool names (or "*")')
    admin = e.get("admin", False)
    if not isinstance(admin, bool):
        raise TokenConfigError(f"{where}: tokens[{i}].admin must be true or false")
    name = e.get("name", f"token{i}")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise TokenConfigError(f"{where}: tokens[{i}].name must be a string of 1-64 characters")
    if "tenant" in e:
        try:
            tenant = validate_tenant(e["tenant"])
        except InvalidArgument as x:
            raise TokenConfigError(f"{where}: tokens[{i}].{x}") from None
    else:
        tenant = name if TENANT_RE.fullmatch(name) else ""
    return Principal(name, digest.hex()[:16], frozenset(pools), admin, digest, tenant)


def parse_tokens(doc: Any, where: str) -> list[Principal]:
    if isinstance(doc, dict):
        doc = doc.get("tokens")
    if not isinstance(doc, list):
        raise TokenConfigError(f'{where}: expected {{"tokens": [...]}}')
    out = [_principal(i, e, where) for i, e in enumerate(doc)]
    seen: set[bytes] = set()
    for p in out:
        if p.digest in seen:
            raise TokenConfigError(f"{where}: the same token appears twice (entry {p.name!r})")
        seen.add(p.digest)
    return out


def load_tokens(
    path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None
) -> list[Principal]:
    """Read tokens from ``path``, else ``$GPULOCK_BROKER_TOKENS_FILE``, else the JSON in
    ``$GPULOCK_BROKER_TOKENS``.

    Raises: TokenConfigError (nothing configured, unreadable file, bad JSON or entries)."""
    if env is None:
        env = os.environ
    path = path or env.get("GPULOCK_BROKER_TOKENS_FILE") or None
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise TokenConfigError(f"cannot read tokens file {str(path)!r}: {e.strerror}") from None
        where = str(path)
    elif env.get("GPULOCK_BROKER_TOKENS"):
        text, where = env["GPULOCK_BROKER_TOKENS"], "$GPULOCK_BROKER_TOKENS"
    else:
        raise TokenConfigError(
            "no broker tokens configured: give --tokens-file, "
            "GPULOCK_BROKER_TOKENS_FILE or GPULOCK_BROKER_TOKENS"
        )
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenConfigError(f"{where}: not valid JSON ({e.msg} at line {e.lineno})") from None
    return parse_tokens(doc, where)


class TokenStore:
    """Looks up the principal of a presented bearer token in constant time."""

    def __init__(self, principals: Iterable[Principal]):
        self._all = tuple(principals)
        if not self._all:
            raise TokenConfigError("no broker tokens configured")

    def __len__(self) -> int:
        return len(self._all)

    def lookup(self, token: str) -> Principal | None:
        d = token_digest(token)
        found = None
        for p in self._all:  # no early exit: the time does not depend on which entry matched
            if hmac.compare_digest(d, p.digest):
                found = p
        return found
