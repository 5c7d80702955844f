"""Server-sent events and OpenAI's error object (gpulock/http/sse.py), and what a streaming
route refuses when it is declared (gpulock.fastapi._stream, _signature): no I/O."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest
from pydantic import BaseModel

from gpulock.errors import InvalidArgument, LeaseLost
from gpulock.fastapi import SSE_DONE, GpuLimiter, StreamLease, error_body, sse_event
from gpulock.fastapi._stream import lease_param, stream_error, stream_kind


def test_an_event_is_data_lines_and_a_blank_line():
    assert sse_event({"a": 1, "b": "é"}) == 'data: {"a":1,"b":"é"}\n\n'.encode()
    assert sse_event("two\nlines") == b"data: two\ndata: lines\n\n"
    assert sse_event("cr\r\nlf\rx") == b"data: cr\ndata: lf\ndata: x\n\n"
    assert sse_event("") == b"data: \n\n"
    assert sse_event([1, 2], event="error") == b"event: error\ndata: [1,2]\n\n"
    assert SSE_DONE == b"data: [DONE]\n\n"

    class Chunk(BaseModel):
        id: str
        n: int

    assert sse_event(Chunk(id="x", n=2)) == b'data: {"id":"x","n":2}\n\n'
    with pytest.raises(ValueError, match="one line"):
        sse_event({}, event="a\nb")
    with pytest.raises(TypeError):
        sse_event({"x": object()})


def test_the_error_object_is_openais():
    assert error_body(503, "lost", "lease_lost") == {
        "error": {"message": "lost", "type": "server_error", "param": None, "code": "lease_lost"}
    }
    assert error_body(400, "bad", param="input")["error"]["type"] == "invalid_request_error"
    assert error_body(401, "who")["error"]["type"] == "authentication_error"
    assert error_body(403, "no")["error"]["type"] == "permission_error"


def test_the_service_answers_with_the_same_object():
    from gpulock_service import openai_errors

    assert openai_errors.error_body is error_body


def test_a_streams_media_type():
    assert stream_kind("sse") == (True, "text/event-stream")
    assert stream_kind("text/event-stream") == (True, "text/event-stream")
    assert stream_kind("application/x-ndjson") == (False, "application/x-ndjson")
    for bad in ("", "plain", " text/plain", "text/plain\r\nX-Evil: 1", None, 3):
        with pytest.raises(InvalidArgument, match="media type"):
            stream_kind(bad)  # type: ignore[arg-type]


def test_a_mid_stream_error_is_named_and_an_unknown_one_is_not_echoed():
    status, reason, message = stream_error(LeaseLost("0123456789abcdef", "expired"))
    assert (status, reason) == (503, "lease_lost") and "lost mid-stream (expired)" in message
    status, reason, message = stream_error(ValueError("secret path /etc/x"))
    assert (status, reason) == (500, "internal_error") and "secret" not in message


def test_the_lease_parameter_is_found_by_its_annotation():
    def a(x: int, s: StreamLease) -> Iterator[int]:
        yield x

    def b(x: int) -> Iterator[int]:
        yield x

    assert lease_param(a) == "s" and lease_param(b) is None


def test_a_streaming_route_is_refused_when_declared():
    gpu = GpuLimiter("redis://127.0.0.1:1/0", "p")  # no I/O until start()
    with pytest.raises(InvalidArgument, match="media type"):
        gpu.endpoint("r", estimate=lambda: 1, stream="nonsense")

    async def coro() -> None:
        pass

    with pytest.raises(TypeError, match="generator function"):
        gpu.endpoint("r", estimate=lambda: 1, stream="sse")(coro)

    def gen(n: int, stream: StreamLease) -> Iterator[dict]:
        yield {"n": n}

    handler = gpu.endpoint("r", estimate=lambda n: n, stream="sse")(gen)
    params = inspect.signature(handler).parameters
    assert "n" in params and "stream" not in params  # the lease is not a request parameter
    assert not hasattr(handler, "__wrapped__")  # FastAPI must not stream the generator itself
