"""The part of a multi-host Redis URL (Sentinel, Cluster) that both forms share: credentials and
a comma-separated host list. No I/O."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

__all__ = ["auth_kwargs", "credentials_and_hosts"]


def credentials_and_hosts(
    netloc: str, default_port: int
) -> tuple[str | None, str | None, list[tuple[str, int]]]:
    """``USER:PASSWORD@H1:P1,H2[:P2]`` as (username or None, password or None, [(host, port)])
    (percent-decoded; a host without a port gets ``default_port``). Raises ValueError naming
    the bad part (an empty host, a port that is not a number)."""
    creds, _, hosts = netloc.rpartition("@")
    username: str | None = None
    password: str | None = None
    if creds:
        user, sep, pw = creds.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if sep else None
    out: list[tuple[str, int]] = []
    for hp in hosts.split(","):
        hp = hp.strip()
        host, sep, port = hp.rpartition(":") if ":" in hp else (hp, "", "")
        if not host:
            raise ValueError(f"empty host in {hosts!r}")
        try:
            n = int(port) if sep else default_port
        except ValueError:
            raise ValueError(f"bad port {port!r} in {hp!r}") from None
        if not 0 < n < 65536:
            raise ValueError(f"port {n} out of range (1-65535) in {hp!r}")
        out.append((host, n))
    return username, password, out


def auth_kwargs(
    defaults: dict[str, Any], username: str | None, password: str | None, ssl: bool
) -> dict[str, Any]:
    """``defaults`` plus the URL's credentials and TLS, as redis-py's client arguments."""
    kw = dict(defaults)
    if username:
        kw["username"] = username
    if password is not None:
        kw["password"] = password
    if ssl:
        kw["ssl"] = True
    return kw
