"""The service's generation routes in a trace (docs/TRACING.md): the ``gpulock.call`` span of a
generation carries OpenTelemetry's ``gen_ai.*`` attributes (system, operation, request model,
max tokens, usage, finish reason), whole and streamed; in-process, the tiny model on CPU, a
real Redis, the spans collected in memory (:mod:`support.tracing`)."""

from __future__ import annotations

import json

import pytest
from support.apps import Running
from support.waiting import async_wait_until

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("transformers")
from support.tracing import memory_spans  # noqa: E402 - needs the SDK

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def exporter():
    with memory_spans() as e:
        yield e


def _gen_ai(span) -> dict:
    return {k: v for k, v in span.attributes.items() if k.startswith("gen_ai.")}


async def test_a_generations_call_span_carries_the_gen_ai_attributes(redis_proc1, exporter):
    from gpulock_service.app import create_app
    from gpulock_service.settings import Settings

    settings = Settings(
        redis_url=redis_proc1.url,
        pool="tr-gen",
        capacity="64MiB",
        configure="set",
        model="sleep",
        sleep_seconds=0.0,
        sleep_bytes="1MiB",
        generation_model="tiny",
        resident="0",
        executor_threads=2,
        reaper_interval=0.1,
        dashboard=False,
    )
    app = create_app(settings)
    exporter.clear()

    def calls() -> list:
        return [
            s
            for s in exporter.get_finished_spans()
            if s.name == "gpulock.call" and s.attributes.get("gpulock.route") == "generation"
        ]

    async with Running(app) as c:
        await async_wait_until(
            lambda: app.state.limiter.readiness()[0], timeout=180, what="the models loaded"
        )
        hello = [{"role": "user", "content": "Say something about GPU memory."}]
        r = await c.post(
            "/v1/chat/completions", json={"messages": hello, "max_tokens": 6, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        whole = await async_wait_until(lambda: calls(), timeout=60, what="the call span")
        assert len(whole) == 1
        assert _gen_ai(whole[0]) == {
            "gen_ai.system": "gpulock",
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": "gpulock-tiny-llama",
            "gen_ai.request.max_tokens": 6,
            "gen_ai.usage.input_tokens": usage["prompt_tokens"],
            "gen_ai.usage.output_tokens": usage["completion_tokens"],
            "gen_ai.response.finish_reasons": (r.json()["choices"][0]["finish_reason"],),
        }
        assert whole[0].attributes["gpulock.pool"] == "tr-gen"

        exporter.clear()
        r = await c.post(
            "/v1/completions",
            json={
                "prompt": "GPU memory is",
                "max_tokens": 5,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert r.status_code == 200, r.text
        events = [
            json.loads(line[len("data: ") :])
            for line in r.text.splitlines()
            if line.startswith("data: {")
        ]
        usage = events[-1]["usage"]
        finish = next(e["choices"][0]["finish_reason"] for e in reversed(events) if e["choices"])
        streamed = await async_wait_until(lambda: calls(), timeout=60, what="the stream's span")
        assert len(streamed) == 1
        assert _gen_ai(streamed[0]) == {
            "gen_ai.system": "gpulock",
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": "gpulock-tiny-llama",
            "gen_ai.request.max_tokens": 5,
            "gen_ai.usage.input_tokens": usage["prompt_tokens"],
            "gen_ai.usage.output_tokens": usage["completion_tokens"],
            "gen_ai.response.finish_reasons": (finish,),
        }
