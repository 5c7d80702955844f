"""Findings of a new user, on every HTTP surface as real processes (the service under gunicorn,
the broker's own entry point, a user's GpuLimiter app under gunicorn with the service's
config; the fixtures of ``test_http_limits``):

* a request head over 64 KiB answers 431 (heads of 70 and 100 KB were served with 200: the
  bytes were counted only after the parser had completed the request), one of 64 KiB is served;
* JSON nested too deeply answers 400 "JSON nested too deeply" or a 422, never a 500 (the
  broker's was a 500: its own NaN check's parser overflowed, and so did the rendering of the
  422 that echoes the nested input back);
* the guards' 400, 408 and 413 come in the surface's error shape: OpenAI's ``{"error":
  {"message", "type", "param", "code"}}`` on the service, ``{"detail": TEXT}`` on a user's
  app, ``{"detail": {"error", "message"}}`` on the broker (as its other errors), with the
  surface's own wording (the broker's 413 spoke of "inputs").
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from test_http_limits import (
    READ_TIMEOUT,
    SURFACES,
    _slow_client,
    _target,
    broker,  # noqa: F401 - fixture
    service,  # noqa: F401 - fixture
    user_app,  # noqa: F401 - fixture
)

MAX_HEAD = 64 * 1024
OK = {"service": {"input": ["x"]}, "broker": {"amount": 1}, "user_app": {"texts": ["x"]}}
FIELD = {"service": "input", "broker": "holder", "user_app": "texts"}


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _raw(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send ``data`` at once; return everything answered until the server closes (or the
    first complete answer with Content-Length)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        got = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
            head, sep, body = got.partition(b"\r\n\r\n")
            if sep:
                cl = [
                    int(x.split(b":", 1)[1])
                    for x in head.split(b"\r\n")
                    if x.lower().startswith(b"content-length:")
                ]
                if cl and len(body) >= cl[0]:
                    break
        return got


def _head_of(size: int) -> bytes:
    """A GET /health whose request line and headers are exactly ``size`` bytes."""
    base = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: \r\n\r\n"
    return base.replace(b"X-Pad: ", b"X-Pad: " + b"a" * (size - len(base)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [MAX_HEAD + 1, 69_961, 100_000])
@pytest.mark.parametrize("surface", SURFACES)
def test_a_head_over_64KiB_is_431(request, surface, size):
    url = _target(request, surface)[0]
    head = _head_of(size)
    assert len(head) == size
    answer = _raw(_port(url), head)
    assert answer.startswith(b"HTTP/1.1 431"), (surface, size, answer[:200])
    # in one write or in a few: the same
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=10) as s:
        for i in range(0, size, 8192):
            try:
                s.sendall(head[i : i + 8192])
            except (BrokenPipeError, ConnectionResetError):
                break
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
    assert got.startswith(b"HTTP/1.1 431"), (surface, size, got[:200])
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # still serving


@pytest.mark.timeout(60)
@pytest.mark.parametrize("surface", SURFACES)
def test_a_head_of_64KiB_is_served(request, surface):
    url = _target(request, surface)[0]
    answer = _raw(_port(url), _head_of(MAX_HEAD))
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def _nested_bodies(surface: str) -> list[tuple[str, str]]:
    ok = json.dumps(OK[surface])[:-1]
    f = FIELD[surface]
    base = {k: v for k, v in OK[surface].items() if k != f}
    pre = json.dumps(base)[:-1] + (", " if base else "")
    return [
        (
            "holder-like: 500 nested objects",
            pre + f'"{f}": ' + '{"a":' * 500 + "1" + "}" * 500 + "}",
        ),
        (
            "3,000 nested arrays in an unknown field",
            ok + ', "zzz": ' + "[" * 3000 + "]" * 3000 + "}",
        ),
        ("1,000 nested arrays in the field", pre + f'"{f}": ' + "[" * 1000 + "]" * 1000 + "}"),
        ("600 nested arrays in the field", pre + f'"{f}": ' + "[" * 600 + "]" * 600 + "}"),
        ("100,000 nested arrays", pre + f'"{f}": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("surface", SURFACES)
def test_json_nested_too_deeply_is_400_or_422_never_500(request, surface):
    url, path, headers = _target(request, surface)
    for what, body in _nested_bodies(surface):
        r = httpx.post(
            url + path,
            content=body.encode(),
            timeout=30,
            headers={**headers, "Content-Type": "application/json"},
        )
        assert r.status_code in (400, 422), (surface, what, r.status_code, r.text[:300])
        if r.status_code == 400 and surface == "service" and r.json()["error"]["code"] is None:
            # the service answers validation errors 400 (OpenAI's convention), naming the field
            assert r.json()["error"]["param"] == FIELD[surface], (what, r.text[:300])
            assert len(r.content) < 64 * 1024, (what, len(r.content))
        elif r.status_code == 400:
            assert "JSON nested too deeply" in r.text, (surface, what, r.text[:300])
        else:
            assert len(r.content) < 64 * 1024, (
                surface,
                what,
                len(r.content),
            )  # the echo is bounded
    r = httpx.post(url + path, json=OK[surface], headers=headers, timeout=10)
    assert r.status_code in (200, 201), r.text  # still serving
    if surface == "broker":
        assert (
            httpx.delete(f"{url}{path}/{r.json()['lease_id']}", headers=headers).status_code == 200
        )


def _shape(surface: str, r_status: int, body, code: str) -> str:
    """The message of a guard's error body, checking the surface's shape."""
    if surface == "service":
        err = body.get("error") if isinstance(body, dict) else None
        assert isinstance(err, dict) and err.get("code") == code, (r_status, body)
        assert err["type"] == ("server_error" if r_status >= 500 else "invalid_request_error")
        assert isinstance(err["message"], str), (r_status, body)
        return err["message"]
    detail = body["detail"]
    if surface == "broker":
        assert (
            isinstance(detail, dict)
            and detail.get("error") == code
            and isinstance(detail.get("message"), str)
        ), (r_status, detail)
        return detail["message"]
    assert isinstance(detail, str), (surface, r_status, detail)
    return detail


@pytest.mark.timeout(60)
@pytest.mark.parametrize("surface", SURFACES)
def test_guard_errors_have_the_surface_error_shape(request, surface):
    url, path, headers = _target(request, surface)
    jh = {**headers, "Content-Type": "application/json"}
    r = httpx.post(url + path, content=b'{"x": "caf\xe9"}', headers=jh, timeout=10)
    assert r.status_code == 400
    assert "UTF-8" in _shape(surface, 400, r.json(), "invalid_utf8")

    r = httpx.post(
        url + path,
        content=(json.dumps(OK[surface])[:-1] + ', "z": ' + "[" * 5000 + "]" * 5000 + "}"),
        headers=jh,
        timeout=10,
    )
    assert r.status_code == 400
    assert "nested too deeply" in _shape(surface, 400, r.json(), "nested_too_deeply")

    big = (json.dumps(OK[surface])[:-1] + " " * (2 * 2**20) + "}").encode()
    r = httpx.post(url + path, content=big, headers=jh, timeout=10)
    assert r.status_code == 413
    msg = _shape(surface, 413, r.json(), "request_too_large")
    assert "1048576" in msg and "GPULOCK_MAX_REQUEST_BYTES" in msg
    if surface == "broker":
        assert "inputs" not in msg and "lease request" in msg, msg
    else:
        assert "fewer or shorter inputs" in msg, msg

    # 408: a body that stops arriving
    hdrs = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{hdrs}"
        f'Content-Length: 100\r\n\r\n{{"input": ['
    ).encode()
    _, answer = _slow_client(_port(url), head, b"", every=0.2, give_up=4 * READ_TIMEOUT)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert "GPULOCK_READ_TIMEOUT" in _shape(surface, 408, body, "request_timeout")
