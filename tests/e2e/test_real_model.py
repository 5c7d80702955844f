"""The real service: all-MiniLM-L6-v2 on CPU, 4 gunicorn workers started with ``--preload``,
a small pool (four 128 MiB resident leases and room for about two requests of 64 sentences).

* embeddings in the OpenAI shape, 384 dimensions, meaningful;
* c06 — ``--preload`` and fork: every worker answers its requests, the gunicorn master has no
  torch/CUDA library mapped and no Redis connection (each worker connects after the fork);
* 503 with Retry-After and X-Queue-Position under overload;
* /metrics agrees with what the test observed;
* kill -9 one worker mid-request: gunicorn replaces it, its leases are reaped within the ttl,
  the other requests go on.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import math
import os
import signal
import struct
import time

import httpx
import pytest
import redis
from support.history import cuda_intervals, lease_intervals, max_overlap
from support.pools import MiB
from support.procs import alive

TTL = 5.0
RESIDENT = 128 * MiB
CAPACITY = 4 * RESIDENT + 180 * MiB
ENV = {
    "GPULOCK_MODEL": "minilm",
    "GPULOCK_RESIDENT": str(RESIDENT),
    "GPULOCK_TTL": str(TTL),
    "GPULOCK_ACQUIRE_TIMEOUT": "3",
    "GPULOCK_INFERENCE_TIMEOUT": "60",
    "GPULOCK_EXECUTOR_THREADS": "2",
    "GPULOCK_STARTUP_TIMEOUT": "5",
    "GPULOCK_PARK_TIMEOUT": "0",
}
SEEN: collections.Counter = collections.Counter()  # statuses of /v1/embeddings this module saw


# Each test's timeout counts its own body (func_only): the module's service, four workers
# loading MiniLM, starts in the first test's setup and has its own bound (wait_ready, 240 s);
# on a loaded machine it took longer than that first test's 60 s.
@pytest.fixture(scope="module")
def svc(make_service, e2e_redis):
    s = make_service("minilm", workers=4, env=ENV, capacity=CAPACITY, preload=True)
    s.wait_ready(4, timeout=240)
    return s


def _post(c: httpx.Client, body: dict, **kw) -> httpx.Response:
    r = c.post("/v1/embeddings", json=body, **kw)
    SEEN[r.status_code] += 1
    return r


def _cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(
        sum(x * x for x in a) * sum(y * y for y in b)
    )


@pytest.mark.timeout(60, func_only=True)
def test_token_id_input_embeds_as_its_text(svc):
    from gpulock_service.models import MiniLM

    text = "A cat sits on the mat."
    ids = MiniLM().tokenizer()(text)["input_ids"]  # [CLS] ... [SEP], as a client would send
    assert ids[0] == 101 and ids[-1] == 102
    with httpx.Client(base_url=svc.url, timeout=30) as c:
        plain = _post(c, {"input": text})
        nested = _post(c, {"input": [ids, ids[1:-1]]})
        flat = _post(c, {"input": ids})
        for r in (plain, nested, flat):
            assert r.status_code == 200, r.text
        want = plain.json()["data"][0]["embedding"]
        assert len(nested.json()["data"]) == 2 and len(flat.json()["data"]) == 1
        for v in (
            *(d["embedding"] for d in nested.json()["data"]),
            flat.json()["data"][0]["embedding"],
        ):
            assert _cos(v, want) > 0.999
        assert nested.json()["usage"]["prompt_tokens"] == 2 * len(ids) - 2  # counted as ids
        assert flat.json()["usage"]["prompt_tokens"] == len(ids)
        bad = _post(c, {"input": [[101, 30522, 102]]})  # the vocabulary is 0..30521
        assert bad.status_code == 400, bad.text
        err = bad.json()["error"]
        assert err["param"] == "input" and "input[0][1] = 30522" in err["message"], err
        assert "0 to 30521" in err["message"]


@pytest.mark.timeout(60, func_only=True)
def test_embeddings_openai_shape(svc):
    texts = [
        "A cat sits on the mat.",
        "A kitten is sitting on a rug.",
        "Quarterly revenue exceeded expectations.",
    ]
    with httpx.Client(base_url=svc.url, timeout=30) as c:
        r = _post(c, {"input": texts, "model": "all-MiniLM-L6-v2"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == "all-MiniLM-L6-v2"
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        vecs = [d["embedding"] for d in body["data"]]
        assert all(len(v) == 384 for v in vecs)
        assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-3 for v in vecs)
        assert _cos(vecs[0], vecs[1]) > _cos(vecs[0], vecs[2]) + 0.3
        assert (
            body["usage"]["prompt_tokens"] > 10
            and body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"]
        )
        assert "gpulock-wait" in r.headers["server-timing"]
        one = _post(c, {"input": texts[0]})
        assert one.status_code == 200 and len(one.json()["data"]) == 1
        assert max(abs(a - b) for a, b in zip(one.json()["data"][0]["embedding"], vecs[0])) < 1e-4
        b64 = _post(c, {"input": texts, "encoding_format": "base64"})
        assert b64.status_code == 200
        raw = base64.b64decode(b64.json()["data"][2]["embedding"])
        assert max(abs(a - b) for a, b in zip(struct.unpack("<384f", raw), vecs[2])) < 1e-4
        too_many = c.post("/v1/embeddings", json={"input": ["x"] * 300})
        assert too_many.status_code == 413 and "256" in too_many.json()["error"]["message"]
        assert c.post("/v1/embeddings", json={"input": []}).status_code == 400
        assert c.get("/v1/models").json()["data"][0]["id"] == "all-MiniLM-L6-v2"


@pytest.mark.timeout(90, func_only=True)
def test_oversized_bodies_are_refused_before_parsing_and_long_texts_are_cheap(svc):
    """The body is parsed on the worker's event loop, which also runs the lease heartbeats:
    a body over GPULOCK_MAX_REQUEST_BYTES (16 MiB) is a 413 before anyone parses it (by
    Content-Length, or counted as a chunked body arrives), and a long text under the limit is
    refused as over the model's context, or with "truncate" counted as max_tokens, without
    tokenizing its megabytes. The worker stays ready: no lease
    was lost to a stalled loop."""
    with httpx.Client(base_url=svc.url, timeout=60) as c:
        big = {"input": ["word " * (4 * 2**20)]}  # 20 MiB in one string
        r = c.post("/v1/embeddings", json=big)
        assert (
            r.status_code == 413 and "GPULOCK_MAX_REQUEST_BYTES" in r.json()["error"]["message"]
        ), r.text
        assert "16.0MiB" in r.json()["error"]["message"]

        def chunks():
            yield b'{"input": ["'
            for _ in range(20):
                yield b"word " * 2**18  # 1.25 MiB per chunk, no Content-Length
            yield b'"]}'

        r = c.post("/v1/embeddings", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "more than" in r.json()["error"]["message"], r.text

        # 14 MB in one text, under the body limit: the model reads only its first 256 word
        # pieces, and neither the estimate nor the model may tokenize the rest (that took 15 s
        # and 8 GB of RSS, and got a worker OOM-killed, before texts were cut to 256 x 32 chars).
        # It is refused (over the context: it was embedded cut, without a word), at once...
        long = "the quick brown fox jumps over the lazy dog " * 320_000
        t0 = time.monotonic()
        r = _post(c, {"input": ["short text", long]})
        took = time.monotonic() - t0
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "input[1]" in err["message"], err
        # counted in its first 8,192 characters (cut back to a space): 1,677 word pieces
        assert "context of 256 tokens" in err["message"] and "1677 tokens" in err["message"]
        assert took < 10, f"refusing a 14 MB text took {took:.1f}s"
        # ... and embedded from its first 256 word pieces when the request asks for that
        t0 = time.monotonic()
        r = _post(c, {"input": [long, "short text"], "truncate": True})
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 256 + len("short text".split()) + 2
        prefix = _post(c, {"input": [long[: 256 * 32]], "truncate": True})
        assert (
            max(
                abs(a - b)
                for a, b in zip(
                    r.json()["data"][0]["embedding"], prefix.json()["data"][0]["embedding"]
                )
            )
            < 1e-4
        )
        assert took < 10, f"a 14 MB text took {took:.1f}s"
        for _ in range(4):
            assert c.get("/ready").status_code == 200


@pytest.mark.timeout(60, func_only=True)
def test_bad_input_is_a_4xx_never_a_500(svc):
    with httpx.Client(base_url=svc.url, timeout=30) as c:

        def raw(body: str):
            return c.post(
                "/v1/embeddings",
                content=body.encode(),
                headers={"content-type": "application/json"},
            )

        r = raw(
            '{"input": "hi", "dimensions": NaN}'
        )  # Python's JSON parser takes NaN; JSON cannot echo it
        assert r.status_code == 400 and ("NaN" in r.text or "nan" in r.text), r.text
        r = raw('{"input": ["ok", "\\ud800"]}')  # a JSON escape of a lone surrogate
        assert r.status_code == 400 and "input[1]" in r.json()["error"]["message"], r.text
        r = c.post("/v1/embeddings", json={"input": "hi", "model": "text-embedding-3-small"})
        assert r.status_code == 404 and "all-MiniLM-L6-v2" in r.json()["error"]["message"]
        assert _post(c, {"input": "hi", "model": "all-MiniLM-L6-v2"}).status_code == 200
        # A lone surrogate in a field that fails validation: the 400 (OpenAI's status for an
        # invalid body) echoes it back, escaped.
        for body in (
            '{"input":"hi","encoding_format":"\\ud800"}',
            '{"input":["ok",5,"\\ud800"]}',
            '{"input":{"\\ud800":1}}',
            '{"input":"hi","user":["\\ud800"]}',
            '{"input":"hi","dimensions":"\\ud800"}',
        ):
            r = raw(body)
            assert r.status_code == 400, (body, r.status_code, r.text)
            field = json.loads(body.replace("\\ud800", "?"))
            assert r.json()["error"]["param"] == list(field)[-1], (body, r.text)  # the bad one
        r = raw('{"input":"hi","dimensions":true}')  # a boolean is not a number of dimensions
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions", r.text
        assert c.get("/health").status_code == 200


@pytest.mark.timeout(90, func_only=True)
def test_c06_preload_fork(svc, e2e_redis):
    master = svc.proc.pid
    workers = svc.worker_pids()
    assert len(workers) == 4
    with open(f"/proc/{master}/maps") as f:
        maps = f.read()
    assert "libtorch" not in maps and "libcuda" not in maps and "libc10" not in maps, (
        "the gunicorn master must not load torch (CUDA before fork breaks the workers)"
    )
    for w in workers:
        with open(f"/proc/{w}/maps") as f:
            assert "libtorch" in f.read(), "each worker loads torch itself, after the fork"
    # Every worker answers (a new connection per request lands on any worker).
    seen: dict[int, int] = {}
    deadline = time.monotonic() + 60
    while set(seen) != set(workers) and time.monotonic() < deadline:
        with httpx.Client(base_url=svc.url, timeout=30) as c:
            r = _post(c, {"input": ["first request in each worker"]})
        assert r.status_code == 200, r.text
        seen[int(r.headers["x-worker-pid"])] = r.status_code
    assert set(seen) == set(workers)
    # Redis connections belong to the workers; none was made by the master before fork.
    rc = redis.Redis.from_url(e2e_redis.url)
    try:
        names = [c.get("name", "") for c in rc.client_list()]
    finally:
        rc.close()
    ours = [n for n in names if n.startswith("gpulock-service-")]
    pids = {int(n.rsplit("-", 1)[1]) for n in ours}
    assert set(workers) <= pids and master not in pids


@pytest.mark.timeout(120, func_only=True)
def test_overload_answers_503_with_retry_after(svc):
    sentences = [
        f"Sentence number {i} about the weather, the markets and the news today." for i in range(64)
    ]

    async def flood():
        async with httpx.AsyncClient(
            base_url=svc.url, timeout=60, limits=httpx.Limits(max_connections=64)
        ) as c:

            async def one():
                r = await c.post("/v1/embeddings", json={"input": sentences})
                SEEN[r.status_code] += 1
                return r

            return await asyncio.gather(*(one() for _ in range(64)))

    rs = asyncio.run(flood())
    codes = collections.Counter(r.status_code for r in rs)
    assert set(codes) <= {200, 503} and codes[200] >= 2 and codes[503] >= 1, codes
    for r in rs:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            assert int(r.headers["x-queue-position"]) >= 1
            assert "queue position" in r.json()["error"]["message"]
    ras = {int(r.headers["retry-after"]) for r in rs if r.status_code == 503}
    positions = {int(r.headers["x-queue-position"]) for r in rs if r.status_code == 503}
    assert len(positions) >= 2
    events = svc.history()
    peak, _ = max_overlap(lease_intervals(events))
    assert peak <= CAPACITY
    peak_cuda, _ = max_overlap(cuda_intervals(events))
    assert peak_cuda <= CAPACITY - 4 * RESIDENT
    print("503 Retry-After values:", sorted(ras), "positions:", sorted(positions))


@pytest.mark.timeout(60, func_only=True)
def test_metrics_agree_with_what_the_test_saw(svc):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # quiescent: nothing queued, only the resident leases
        st = svc.status()
        if st.waiter_count == 0 and st.used == 4 * RESIDENT:
            break
        time.sleep(0.2)
    m, st = svc.metrics(), svc.status()
    for status, n in SEEN.items():
        if status in (200, 503):
            assert m.get(f"gpulock_requests_total{{route=embeddings,status={status}}}", 0) == n, (
                status,
                n,
            )
    assert m[f"gpulock_pool_capacity_bytes{{pool={svc.pool}}}"] == st.capacity == CAPACITY
    assert m[f"gpulock_pool_used_bytes{{pool={svc.pool}}}"] == st.used == 4 * RESIDENT
    assert m[f"gpulock_pool_leases{{pool={svc.pool}}}"] == st.lease_count == 4
    assert m[f"gpulock_pool_waiters{{pool={svc.pool}}}"] == st.waiter_count == 0
    assert m["gpulock_grants_total{route=embeddings}"] == SEEN[200]
    assert m["gpulock_acquire_timeouts_total{route=embeddings}"] == SEEN[503]
    assert m["gpulock_workers_ready"] == 4


@pytest.mark.timeout(240, func_only=True)
def test_kill_9_worker_mid_request(svc):
    svc.wait_ready(4, timeout=60)
    g = svc.status()
    reaped0 = g.reaped_leases
    long = [
        f"A longer sentence, number {i}, to keep the worker busy for a moment or two."
        for i in range(48)
    ]

    async def run():
        if True:

            async def one(i):  # a client that retries 503s after Retry-After, as clients should
                await asyncio.sleep(
                    0.01 * i
                )  # own connection, 10 ms apart: spread over the workers
                async with httpx.AsyncClient(base_url=svc.url, timeout=60) as c:
                    for _ in range(20):
                        try:
                            r = await c.post("/v1/embeddings", json={"input": long})
                        except httpx.HTTPError as e:
                            return type(e).__name__
                        if r.status_code != 503:
                            return r.status_code
                        await asyncio.sleep(float(r.headers["retry-after"]))
                    return 503

            tasks = [asyncio.create_task(one(i)) for i in range(8)]
            victim = None
            deadline = time.monotonic() + 30
            while (
                victim is None and time.monotonic() < deadline
            ):  # a worker inside its CUDA section
                await asyncio.sleep(0.05)
                ev = svc.history()
                ended = {e["lease_id"] for e in ev if e["e"] == "cuda_end"}
                running = [e for e in ev if e["e"] == "cuda_start" and e["lease_id"] not in ended]
                if running:
                    victim = running[-1]["pid"]
            assert victim is not None, "no request reached its CUDA section"
            os.kill(victim, signal.SIGKILL)
            t_kill = time.time()
            dies_at = svc.expiries_of(victim, t_kill)
            read_at = time.time()
            return victim, read_at, dies_at, await asyncio.gather(*tasks)

    victim, read_at, dies_at, outcomes = asyncio.run(run())
    # A dead holder renews nothing: its leases expire at most a ttl after the last command it
    # sent ran on Redis, which was before expiries_of returned (it waited for the process to be
    # gone and for Redis to run what it had sent). Not "a ttl after t_kill": a renewal already
    # sent at the kill may run later than t_kill on a loaded machine.
    assert max(dies_at.values()) <= read_at + TTL
    lost = [o for o in outcomes if isinstance(o, str)]  # the victim's clients lost their connection
    assert lost, outcomes
    assert [o for o in outcomes if not isinstance(o, str)] == [200] * (8 - len(lost)), (
        outcomes
    )  # others went on
    # Its leases (resident + request) expire at most a ttl after the kill (server clock:
    # dies_at, above) and are reaped then. Polled from now: the requests above may have
    # taken longer than that on a loaded machine (a wall-clock bound here was a chance failure).
    deadline = time.monotonic() + TTL + 30
    st = svc.status()
    while any(lz.holder.get("pid") == victim for lz in st.leases):
        assert time.monotonic() < deadline, "the dead worker's leases were not reaped"
        time.sleep(0.1)
        st = svc.status()
    assert st.reaped_leases - reaped0 >= 2
    assert not alive(victim)
    # gunicorn starts a replacement; the service goes on.
    deadline = time.monotonic() + 30
    while (
        len(svc.worker_pids()) != 4 or victim in svc.worker_pids()
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(svc.worker_pids()) == 4 and victim not in svc.worker_pids()
    codes = []
    deadline = time.monotonic() + 30
    while 200 not in codes and time.monotonic() < deadline:  # new connections: any worker, the
        r = httpx.post(
            svc.url + "/v1/embeddings", json={"input": ["still serving"]}, timeout=30
        )  # new one
        codes.append(r.status_code)  # may still be loading its model (503 not ready)
        if r.status_code != 200:
            assert r.status_code == 503 and "retry-after" in r.headers
            time.sleep(0.2)
    assert 200 in codes, codes
    events = svc.history()
    peak, _ = max_overlap(lease_intervals(events, killed={victim: dies_at}))
    assert peak <= CAPACITY
