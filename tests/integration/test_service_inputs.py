"""The embeddings service's inputs, in-process against a real Redis (the sleep model: it
counts words as tokens):

* an input over the model's context (``GPULOCK_MAX_TOKENS``) was cut and embedded without a
  word (``prompt_tokens`` 256 for a 100k-word input); now it is a 400
  ``context_length_exceeded`` in OpenAI's shape naming the input and the bound, unless the
  request says ``"truncate": true`` (or the service ``GPULOCK_TRUNCATE=true`` and the request
  nothing): then it is embedded from its first tokens, counted as those;
* more inputs than ``GPULOCK_MAX_BATCH`` is a 413 naming the setting and its value;
* an invalid body's 400 names the path in the body the client sent (``input[0][1]``), not
  pydantic's internals (``input.list[list[function-before[integral(), int]]].0.1``).
"""

from __future__ import annotations

import pytest
from support.apps import Running
from support.waiting import async_wait_until

pytestmark = pytest.mark.timeout(60)

CONTEXT = 8  # GPULOCK_MAX_TOKENS: words of the sleep model


def _app(url: str, pool: str, **kw):
    from gpulock_service.app import create_app
    from gpulock_service.settings import Settings

    settings = Settings(
        redis_url=url,
        pool=pool,
        capacity="1GiB",
        configure="set",
        model="sleep",
        sleep_seconds=0,
        sleep_bytes="1MiB",
        resident="0",
        max_tokens=CONTEXT,
        reaper_interval=0.1,
        dashboard=False,
        **kw,
    )
    return create_app(settings)


async def _ready(app) -> None:
    await async_wait_until(lambda: app.state.limiter.readiness()[0], timeout=30, what="ready")


async def test_an_input_over_the_context_is_400_unless_truncation_is_asked(redis_proc1):
    app = _app(redis_proc1.url, "ctx")
    long = " ".join(f"w{i}" for i in range(100_000))
    async with Running(app) as c:
        await _ready(app)
        r = await c.post("/v1/embeddings", json={"input": ["fits", long]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "input"
        assert err["type"] == "invalid_request_error"
        msg = err["message"]
        assert "input[1]" in msg and f"context of {CONTEXT} tokens" in msg and "100000" in msg
        assert "GPULOCK_MAX_TOKENS" in msg and '"truncate": true' in msg

        r = await c.post("/v1/embeddings", json={"input": ["fits", long], "truncate": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 1 + CONTEXT  # counted as embedded

        exact = " ".join(["w"] * CONTEXT)  # the context itself fits
        r = await c.post("/v1/embeddings", json={"input": exact, "truncate": False})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == CONTEXT

        ids = list(range(1, CONTEXT + 2))  # token ids count as their ids
        r = await c.post("/v1/embeddings", json={"input": [ids]})
        assert r.status_code == 400 and "input[0]" in r.json()["error"]["message"], r.text
        r = await c.post("/v1/embeddings", json={"input": [ids], "truncate": True})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == CONTEXT

        r = await c.post("/v1/embeddings", json={"input": "x", "truncate": "yes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate", r.text


async def test_truncation_as_the_services_default_and_max_batch_is_a_setting(redis_proc1):
    app = _app(redis_proc1.url, "ctx-default", truncate=True, max_batch=3)
    long = "many words " * 50
    async with Running(app) as c:
        await _ready(app)
        r = await c.post("/v1/embeddings", json={"input": [long]})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == CONTEXT, r.text
        r = await c.post("/v1/embeddings", json={"input": [long], "truncate": False})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        r = await c.post("/v1/embeddings", json={"input": ["a"] * 4})
        assert r.status_code == 413, r.text
        msg = r.json()["error"]["message"]
        assert "at most 3 per request (GPULOCK_MAX_BATCH)" in msg and "holds 4 inputs" in msg
        r = await c.post("/v1/embeddings", json={"input": ["a"] * 3})
        assert r.status_code == 200, r.text


async def test_an_invalid_body_is_said_in_users_words(redis_proc1):
    app = _app(redis_proc1.url, "words")
    async with Running(app) as c:
        await _ready(app)
        r = await c.post("/v1/embeddings", json={"input": [[1, "two"]]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["message"] == (
            'invalid request: input[0][1]: Input should be a valid integer (got "two")'
        ), err
        assert err["param"] == "input"
        r = await c.post("/v1/embeddings", json={"input": ["a", 5]})
        msg = r.json()["error"]["message"]
        assert "input[1]: Input should be a valid string or a valid list (got 5)" in msg, msg
        for internal in ("function-before", "list[", ".str", "Value error"):
            assert internal not in msg, msg
