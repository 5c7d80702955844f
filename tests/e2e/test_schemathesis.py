"""schemathesis against the real service (uvicorn, one worker, a model that embeds at once,
against a real Redis; with dynamic batching and without): every check and every phase, no check excluded
(tests/schemathesis/service.toml names the statuses that depend on the pool's state); and the
regressions it found, as plain requests."""

from __future__ import annotations

import os

import httpx
import pytest
from support.pools import GiB
from support.schemathesis_cli import run_schemathesis

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {
    "GPULOCK_MODEL": "plain_model:factory",
    "GPULOCK_SLEEP_BYTES": "1MiB",
    "GPULOCK_RESIDENT": "0",
    "GPULOCK_ACQUIRE_TIMEOUT": "5",
    "GPULOCK_MAX_BATCH": "16",
    "PYTHONPATH": os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p),
}


@pytest.fixture(scope="module", params=["batched", "unbatched"])
def svc(make_service, request):
    """The service with dynamic batching (its default) and without (one lease per request)."""
    env = {**ENV, "GPULOCK_BATCH": "true" if request.param == "batched" else "false"}
    s = make_service(f"fuzz-{request.param}", server="uvicorn", workers=1, env=env, capacity=GiB)
    s.wait_ready(1, timeout=60)
    return s


@pytest.mark.timeout(300)
def test_schemathesis(svc):
    pytest.importorskip("schemathesis")
    run = run_schemathesis(f"{svc.url}/openapi.json", "service", max_examples=50)
    assert run.returncode == 0, run.output[-20000:]
    # Examples: /v1/models/{model_id}'s (the served model); the rest have none
    assert run.phases_passed() == ["Examples", "Coverage", "Fuzzing", "Stateful"], run.output
    assert run.generated > 200, run.output


def test_schema_declares_what_the_service_answers(svc):
    """The 422 FastAPI declares was never sent (an invalid body is a 400 in OpenAI's shape);
    /metrics was declared JSON; the handler's bounds were not in the schema."""
    spec = httpx.get(f"{svc.url}/openapi.json", timeout=30).json()
    for path, item in spec["paths"].items():
        for op in item.values():
            assert "422" not in op["responses"], path
            assert op["responses"]["400"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/OpenAIErrorResponse"
            }, path
    emb = spec["paths"]["/v1/embeddings"]["post"]["responses"]
    assert {"200", "400", "404", "408", "409", "413", "500", "503", "504"} <= set(emb)
    assert emb["503"]["headers"]["Retry-After"]["required"]
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == [
        "text/plain; version=0.0.4; charset=utf-8",
        "application/openmetrics-text; version=1.0.0; charset=utf-8",
    ]
    props = spec["components"]["schemas"]["EmbeddingRequest"]["properties"]
    lists = [v for v in props["input"]["anyOf"] if v.get("type") == "array"]
    assert len(lists) == 3 and all(v["minItems"] == 1 and v["maxItems"] == 16 for v in lists)
    dims = next(v for v in props["dimensions"]["anyOf"] if v.get("type") == "integer")
    assert dims["minimum"] == dims["maximum"] == 8  # the sleep model's only
    r = httpx.get(f"{svc.url}/metrics", timeout=30)
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"


@pytest.mark.parametrize(
    "body,status",
    [
        ({"input": "x", "dimensions": 8.0}, 200),  # JSON Schema's integer includes 8.0
        ({"input": [7592.0, 2088.0]}, 200),
        ({"input": [[1.0]]}, 200),
        ({"input": "x", "dimensions": 8.5}, 400),
        ({"input": "x", "dimensions": 0}, 400),
        ({"input": []}, 400),
        ({"input": [[]]}, 400),
        ({"input": ["x"] * 17}, 413),  # over GPULOCK_MAX_BATCH (maxItems)
    ],
)
def test_values_at_the_schemas_bounds(svc, body, status):
    r = httpx.post(f"{svc.url}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == status, r.text
    if status != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
