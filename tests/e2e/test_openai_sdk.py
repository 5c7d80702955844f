"""The official ``openai`` SDK (sync and async clients) against the real service (uvicorn, one
worker, the sleep model: 1 GiB per input, capacity 2 GiB):

* embeddings of text and of token ids (one list, a list of lists), counted as their tokens;
  ``models.list`` items carry ``created``; ``models.retrieve`` answers the served id and
  raises ``NotFoundError`` (``code == "model_not_found"``) for another;
* errors reach the SDK in OpenAI's shape: ``BadRequestError`` (400, not FastAPI's 422) with
  ``param``, ``code`` and the service's message; every answer carries ``X-Request-ID``;
* the SDK's retry on 503 + Retry-After: the pool's whole capacity is held by another lease, so
  the first attempt is refused (503, ``queue_timeout``); once the test has seen that 503 it
  releases the lease, and the SDK's retry (after Retry-After) is granted;
* ``PYTORCH_CUDA_ALLOC_CONF``: ``expandable_segments:True`` unless the user set it, as
  ``/health`` reports;
* one ``gpulock.access`` line per request in the service's log, with its request id; a
  generated request id does not make the request idempotent (reusing it is no conflict);
* an input over the model's context is the SDK's ``BadRequestError``
  (``context_length_exceeded``), embedded from its first tokens with
  ``extra_body={"truncate": True}``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from support.pools import GiB

from gpulock import Pool

openai = pytest.importorskip("openai")

ENV = {
    "GPULOCK_MODEL": "sleep",
    "GPULOCK_SLEEP_BYTES": "1GiB",
    "GPULOCK_SLEEP_SECONDS": "0",
    "GPULOCK_RESIDENT": "0",
    "GPULOCK_ACQUIRE_TIMEOUT": "5",
    "GPULOCK_LOG_FORMAT": "json",
}


@pytest.fixture(scope="module")
def svc(make_service):
    s = make_service(
        "openai",
        server="uvicorn",
        workers=1,
        env=ENV,
        capacity=2 * GiB,
        unset=("PYTORCH_CUDA_ALLOC_CONF",),
    )
    s.wait_ready(1, timeout=60)
    return s


def _client(svc, **kw):
    return openai.OpenAI(base_url=svc.url + "/v1", api_key="unused", **kw)


def _access_rows(svc) -> list[dict]:
    rows = []
    for line in svc.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"request_id"' in line:
            rows.append(json.loads(line))
    return rows


@pytest.mark.timeout(60)
def test_sync_client_embeddings_models_and_errors(svc):
    c = _client(svc, max_retries=0)
    r = c.embeddings.create(model="sleep", input=["one two", "three"])
    assert [d.index for d in r.data] == [0, 1] and len(r.data[0].embedding) == 8
    assert r.usage.prompt_tokens == 3  # the sleep model counts words

    ids = c.embeddings.create(model="sleep", input=[[101, 7592, 2088, 102]])
    assert len(ids.data) == 1 and ids.usage.prompt_tokens == 4  # counted as its tokens
    flat = c.embeddings.create(model="sleep", input=[7592, 2088])
    assert len(flat.data) == 1 and flat.usage.prompt_tokens == 2

    listed = c.models.list()
    (m,) = listed.data
    assert m.id == "sleep" and isinstance(m.created, int) and m.created > 0
    got = c.models.retrieve("sleep")
    assert got.id == "sleep" and got.created == m.created

    with pytest.raises(openai.NotFoundError) as nf:
        c.models.retrieve("gpt-4")
    assert nf.value.code == "model_not_found" and "'gpt-4' is not served here" in str(nf.value)
    assert len(nf.value.response.headers["x-request-id"]) == 32

    with pytest.raises(openai.BadRequestError) as bad:
        c.embeddings.create(model="sleep", input="x", dimensions=3)
    e = bad.value
    assert e.status_code == 400 and e.param == "dimensions" and e.type == "invalid_request_error"
    assert "returns 8 dimensions, not 3" in e.message

    # what FastAPI's validation refuses is a 400 in OpenAI's shape too, naming the field
    with pytest.raises(openai.BadRequestError) as invalid:
        c.embeddings.create(model="sleep", input=[[1, "two"]])  # type: ignore[list-item]
    assert invalid.value.status_code == 400 and invalid.value.param is not None
    assert invalid.value.param.startswith("input")
    with pytest.raises(openai.BadRequestError) as empty:
        c.embeddings.create(model="sleep", input=[[]])
    assert "input[0] is an empty list of token ids" in empty.value.message

    with pytest.raises(openai.NotFoundError) as wrong_model:
        c.embeddings.create(model="text-embedding-3-small", input="x")
    assert wrong_model.value.code == "model_not_found" and wrong_model.value.param == "model"

    # a body that is not JSON: 400 invalid_json, no field named (FastAPI's loc is an offset)
    for raw in (b"hello", b'{"input": ['):
        r = httpx.post(
            f"{svc.url}/v1/embeddings", content=raw, headers={"Content-Type": "application/json"}
        )
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "invalid_json", r.text
        assert err["param"] is None and "is not valid JSON" in err["message"], r.text


@pytest.mark.timeout(60)
def test_an_input_over_the_context_is_refused_unless_truncation_is_asked(svc):
    """A 300-word input (the sleep model counts words; its context is GPULOCK_MAX_TOKENS,
    256) was embedded cut, counted as 256, without a word: the SDK's BadRequestError now, as
    OpenAI answers; with ``extra_body={"truncate": True}`` it is embedded from its first 256."""
    c = _client(svc, max_retries=0)
    text = " ".join(["word"] * 300)
    with pytest.raises(openai.BadRequestError) as bad:
        c.embeddings.create(model="sleep", input=["short", text])
    e = bad.value
    assert e.code == "context_length_exceeded" and e.param == "input"
    assert "input[1]" in e.message and "context of 256 tokens" in e.message
    assert "300 tokens counted" in e.message
    r = c.embeddings.create(model="sleep", input=["short", text], extra_body={"truncate": True})
    assert len(r.data) == 2 and r.usage.prompt_tokens == 1 + 256


@pytest.mark.timeout(60)
def test_async_client(svc):
    async def main():
        c = openai.AsyncOpenAI(base_url=svc.url + "/v1", api_key="unused", max_retries=0)
        try:
            r = await c.embeddings.create(model="sleep", input=[[5, 6, 7], [8]])
            assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == 4
            m = await c.models.retrieve("sleep")
            assert m.id == "sleep" and m.created > 0
            with pytest.raises(openai.BadRequestError) as bad:
                await c.embeddings.create(model="sleep", input=[])
            assert bad.value.param == "input"
        finally:
            await c.close()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_sdk_retries_503_with_retry_after(svc):
    statuses: list[tuple[int, str | None]] = []

    def seen(response: httpx.Response) -> None:
        if response.request.url.path == "/v1/embeddings":
            statuses.append((response.status_code, response.headers.get("retry-after")))

    pool = Pool.from_url(svc.redis_url, svc.pool)
    lease = pool.acquire(2 * GiB, ttl=60, timeout=10)  # the whole capacity: the service waits
    released = False
    try:
        http = httpx.Client(event_hooks={"response": [seen]}, timeout=60)
        c = _client(svc, max_retries=3, http_client=http)
        result: dict = {}

        def call() -> None:
            try:
                result["ok"] = c.embeddings.create(model="sleep", input="retried")
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                result["error"] = e

        t = threading.Thread(target=call)
        t.start()
        deadline = time.monotonic() + 30
        while not statuses and time.monotonic() < deadline:
            time.sleep(0.02)  # polling for the observed 503, not ordering by time
        assert statuses, "no answer to the first attempt"
        status, retry_after = statuses[0]
        assert status == 503 and retry_after is not None and int(retry_after) >= 1
        lease.release()
        released = True
        t.join(60)
        assert "error" not in result, result
        assert result["ok"].data[0].embedding == [7.0] * 8
        assert [s for s, _ in statuses] == [503, 200]
    finally:
        if not released:
            lease.release()
        pool.close()


@pytest.mark.timeout(60)
def test_request_ids_and_access_log(svc):
    with httpx.Client(base_url=svc.url, timeout=30) as h:
        a = h.post("/v1/embeddings", json={"input": "alpha"})
        assert a.status_code == 200, a.text
        gen = a.headers["x-request-id"]
        assert len(gen) == 32
        # the generated id was not stored as an idempotency key: reused with other input it
        # is a new request (a stored one would answer 409, or replay alpha's result)
        b = h.post("/v1/embeddings", json={"input": "beta gamma"}, headers={"X-Request-ID": gen})
        assert b.status_code == 200, b.text
        assert b.json()["usage"]["prompt_tokens"] == 2
        assert b.headers.get_list("x-request-id") == [gen]
        # an error answer carries one too
        bad = h.post("/v1/embeddings", json={"input": 5})
        assert bad.status_code == 400 and len(bad.headers["x-request-id"]) == 32
        assert bad.json()["error"]["param"] == "input"
    # a line is written once its response is sent: wait until both are there (observed state)
    want = {gen, bad.headers["x-request-id"]}
    deadline = time.monotonic() + 10
    while True:
        rows = {r["request_id"]: r for r in _access_rows(svc)}
        if want <= set(rows) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    first = rows[gen]  # the first of the two with this id is overwritten by the second
    assert first["method"] == "POST" and first["path"] == "/v1/embeddings"
    assert first["status"] == 200 and first["lease_bytes"] == GiB
    assert first["queue_wait_ms"] is not None and first["duration_ms"] >= 0
    assert first["time"].endswith("+00:00") and first["time"][:4].isdigit()  # dated, UTC
    refused = rows[bad.headers["x-request-id"]]
    assert refused["status"] == 400 and refused["lease_bytes"] is None


@pytest.mark.timeout(60)
def test_cuda_alloc_conf_default_and_users_own(svc, make_service):
    h = httpx.get(svc.url + "/health", timeout=10).json()
    assert h["pytorch_cuda_alloc_conf"] == {
        "value": "expandable_segments:True",
        "set_by": "gpulock",
    }
    assert h["oom_backoff"] == {"enabled": True, "factor": 1.0, "scales": {}}  # no OOM yet
    own = make_service(
        "openai-own-alloc",
        server="uvicorn",
        workers=1,
        env={**ENV, "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"},
        capacity=GiB,
    )
    own.wait_ready(1, timeout=60)
    h = httpx.get(own.url + "/health", timeout=10).json()
    assert h["pytorch_cuda_alloc_conf"] == {"value": "max_split_size_mb:128", "set_by": "user"}


@pytest.mark.timeout(60)
def test_http_metrics_every_status_tokens_and_openmetrics(svc):
    def key(method: str, route: str, status: int) -> str:
        return f"gpulock_http_requests_total{{method={method},route={route},status={status}}}"

    want = {
        key("POST", "/v1/embeddings", 200): 1,
        key("POST", "/v1/embeddings", 400): 2,  # validation, and a body that is not JSON
        key("GET", "/v1/models/{model_id:path}", 404): 1,
        key("GET", "/no/such/route", 404): 0,  # never a series per path
        key("GET", "<unmatched>", 404): 1,
        "gpulock_embedding_input_tokens_sum": 5,
        "gpulock_embedding_input_tokens_count": 1,
        "gpulock_embedding_inputs_sum": 2,
    }
    before = svc.metrics()
    with httpx.Client(base_url=svc.url, timeout=30) as h:
        assert h.post("/v1/embeddings", json={"input": ["a b c", "d e"]}).status_code == 200
        assert h.post("/v1/embeddings", json={"input": 5}).status_code == 400
        r = h.post("/v1/embeddings", content=b"{nope", headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert h.get("/v1/models/nope").status_code == 404
        assert h.get("/no/such/route").status_code == 404
    # each request is counted once its answer is sent: wait until the counts are there
    deadline = time.monotonic() + 10
    while True:
        now = svc.metrics()
        got = {k: now.get(k, 0) - before.get(k, 0) for k in want}
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert got == want
    assert now["gpulock_http_request_duration_seconds_count{method=POST,route=/v1/embeddings}"] >= 3

    om = httpx.get(
        svc.url + "/metrics",
        headers={"Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8"},
        timeout=10,
    )
    assert om.headers["content-type"].startswith("application/openmetrics-text"), om.headers
    assert om.text.endswith("# EOF\n") and om.text.count("# EOF") == 1
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    names = {f.name for f in text_string_to_metric_families(om.text)}
    assert {"gpulock_http_requests", "gpulock_embedding_input_tokens", "gpulock_pool_up"} <= names
    plain = httpx.get(svc.url + "/metrics", timeout=10)
    assert plain.headers["content-type"].startswith("text/plain"), plain.headers
