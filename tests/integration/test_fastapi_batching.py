"""Dynamic batching (``GpuLimiter.batcher``) in-process against a real Redis: order and
per-request errors, validation before joining, the OOM split, deadlines from each request's
arrival, X-Request-ID, the memory bound on recorded histories of two workers, and (on a real
uvicorn server) a client that hangs up while its batch waits."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, HTTPException, Request, Response
from support.apps import Running
from support.history import lease_intervals, max_concurrent
from support.waiting import async_wait_until

from gpulock import AsyncPool
from gpulock.fastapi import GpuLimiter, metrics

GiB = 2**30
pytestmark = pytest.mark.timeout(60)


def _app(url: str, pool: str, *, max_wait_ms=5000.0, max_size=8, threads=1, **kw):
    kw.setdefault("capacity", 8 * GiB)
    kw.setdefault("configure", "set")
    gpu = GpuLimiter(url, pool, executor_threads=threads, **kw)
    app = FastAPI(lifespan=gpu.lifespan)
    seen: dict = {"batches": []}
    gate = threading.Event()
    gate.set()
    lock = threading.Lock()

    def run(items: list[dict]) -> list:
        with lock:
            seen["batches"].append([it["i"] for it in items])
        if any(it.get("hold") for it in items):
            assert gate.wait(30)
        if any(it.get("oom") for it in items):
            import torch

            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if any(it.get("work") for it in items):
            time.sleep(0.02)  # the model's work: the leases overlap (not for ordering)
        return [
            HTTPException(418, f"item {it['i']} failed alone")
            if it.get("fail")
            else {"i": it["i"], "x": 2 * it["i"]}
            for it in items
        ]

    def estimate(item: dict) -> int:
        if item.get("invalid"):
            raise HTTPException(422, "invalid item")
        return int(item.get("gib", 1) * GiB)

    b = gpu.batcher("b", run, estimate=estimate, max_wait_ms=max_wait_ms, max_size=max_size)

    @app.post("/b")
    async def route(body: dict, request: Request, response: Response):
        return await b.submit(body, request=request, response=response)

    return app, gpu, b, seen, gate


async def _used(url: str, pool: str) -> int:
    import redis.asyncio as aioredis

    r = aioredis.from_url(url)
    try:
        p = AsyncPool(r, pool)
        deadline = time.monotonic() + 5
        while True:
            st = await p.status(limit=0)
            if st.used == 0 or time.monotonic() > deadline:
                return st.used
            await asyncio.sleep(0.01)
    finally:
        await r.aclose()


async def _hold(c, seen) -> asyncio.Task:
    """A request that takes the only thread and holds it until the gate opens."""
    t = asyncio.ensure_future(c.post("/b", json={"i": -1, "hold": True}))
    await async_wait_until(lambda: [-1] in seen["batches"], what="the holder running")
    return t


async def _fire_in_order(c, b, bodies, **kw) -> list[asyncio.Task]:
    """Each request joins before the next is sent (their order in the batch is theirs)."""
    tasks = []
    for body in bodies:
        n = b.joined
        tasks.append(asyncio.ensure_future(c.post("/b", json=body, **kw)))
        if not body.get("invalid"):
            await async_wait_until(lambda: b.joined == n + 1, what=f"{body} joining")
        else:
            await asyncio.wait((tasks[-1],))
    return tasks


async def test_a_batch_the_resident_leases_leave_no_room_for_runs_its_requests_alone(
    redis_proc1,
):
    """The batch closed on this worker's last view of the pool, from before other workers'
    models took their resident leases (as right after a start): its 3 GiB never fit the 2 GiB
    they leave, though each 1 GiB request does. The pool refuses the batch (413) and its
    requests run one by one, each served."""
    app, gpu, b, seen, gate = _app(redis_proc1.url, "bt-room", max_size=3, reaper_interval=60)
    other = AsyncPool.from_url(redis_proc1.url, "bt-room")
    async with Running(app) as c:
        gate.clear()
        holder = await _hold(c, seen)
        models = [await other.acquire(3 * GiB, resident=True) for _ in range(2)]
        tasks = await _fire_in_order(c, b, [{"i": 0}, {"i": 1}, {"i": 2}])
        await async_wait_until(lambda: len(b._inflight) == 2, what="the batch closing (full)")
        gate.set()
        rs = [await t for t in tasks]
        assert (await holder).status_code == 200
        assert [r.status_code for r in rs] == [200, 200, 200], [r.text for r in rs]
        assert [r.json()["i"] for r in rs] == [0, 1, 2]
        assert sorted(seen["batches"][1:]) == [[0], [1], [2]]
        for lz in models:
            await lz.release()
    await other.aclose()


async def test_results_in_order_with_their_own_errors_and_invalid_never_joins(redis_proc1):
    app, gpu, b, seen, gate = _app(redis_proc1.url, "bt1", max_size=5)
    async with Running(app) as c:
        gate.clear()
        holder = await _hold(c, seen)
        bodies = [{"i": 0}, {"i": 1}, {"i": 2, "fail": True}, {"i": 3}, {"i": 4, "invalid": True}]
        bodies.append({"i": 5})
        tasks = await _fire_in_order(c, b, bodies)
        await async_wait_until(lambda: len(b._inflight) == 2, what="the batch closing (full)")
        gate.set()
        rs = [await t for t in tasks]
        assert (await holder).status_code == 200
        assert seen["batches"] == [[-1], [0, 1, 2, 3, 5]]
        for body, r in zip(bodies, rs):
            if body.get("fail"):
                assert r.status_code == 418 and r.json()["detail"] == "item 2 failed alone"
            elif body.get("invalid"):
                assert r.status_code == 422
            else:
                assert r.status_code == 200 and r.json() == {"i": body["i"], "x": 2 * body["i"]}
    assert await _used(redis_proc1.url, "bt1") == 0


async def test_a_cuda_oom_splits_the_batch_and_fails_only_the_oversized_request(redis_proc1):
    app, gpu, b, seen, gate = _app(redis_proc1.url, "bt2", max_size=4)
    oom = metrics().oom.labels("b")
    before = oom._value.get()
    async with Running(app) as c:
        gate.clear()
        holder = await _hold(c, seen)
        bodies = [{"i": 0}, {"i": 1, "oom": True}, {"i": 2}, {"i": 3}]
        tasks = await _fire_in_order(c, b, bodies)
        await async_wait_until(lambda: len(b._inflight) == 2, what="the batch closing (full)")
        gate.set()
        rs = [await t for t in tasks]
        await holder
        assert [r.status_code for r in rs] == [200, 503, 200, 200]
        assert "ran out of memory" in rs[1].json()["detail"] and "retry-after" in rs[1].headers
        assert [r.json()["x"] for r in (rs[0], rs[2], rs[3])] == [0, 4, 6]
        assert seen["batches"][1:] == [[0, 1, 2, 3], [0, 1], [0], [1], [2, 3]]
        assert b.splits == 2 and oom._value.get() == before + 1
    assert await _used(redis_proc1.url, "bt2") == 0


async def test_deadlines_count_from_each_requests_arrival(redis_proc1):
    app, gpu, b, seen, gate = _app(
        redis_proc1.url, "bt3", max_size=2, max_wait_ms=1500, acquire_timeout=2.0
    )
    async with Running(app) as c:
        gate.clear()
        holder = await _hold(c, seen)
        t0 = time.monotonic()
        (first,) = await _fire_in_order(c, b, [{"i": 0}])
        # the second arrives 1 s after the first; the batch of both waits for the thread
        await async_wait_until(lambda: time.monotonic() - t0 > 1.0, what="a second passing")
        (second,) = await _fire_in_order(c, b, [{"i": 1}])
        r0 = await first  # its own 2 s ran out: 503, while the batch (and the second) waits
        assert r0.status_code == 503 and "within 2.0s" in r0.json()["detail"], r0.text
        assert not second.done()
        gate.set()
        r1 = await second
        assert r1.status_code == 200 and r1.json() == {"i": 1, "x": 2}
        await holder
        assert seen["batches"] == [[-1], [1]], "the request that left was dropped from its batch"
    assert await _used(redis_proc1.url, "bt3") == 0


async def test_x_request_id_runs_alone_and_replays(redis_proc1):
    app, gpu, b, seen, gate = _app(redis_proc1.url, "bt4", max_wait_ms=1)
    async with Running(app) as c:
        h = {"X-Request-ID": "batch-rid-1"}
        r1 = await c.post("/b", json={"i": 7}, headers=h)
        r2 = await c.post("/b", json={"i": 7}, headers=h)
        assert r1.status_code == r2.status_code == 200
        assert r1.json() == r2.json() == {"i": 7, "x": 14}
        # (joined while the first's release was on its way, or answered from the stored result)
        assert seen["batches"] == [[7]], "it ran once"
        r3 = await c.post("/b", json={"i": 8}, headers=h)
        assert r3.status_code == 409  # the same id with other arguments


async def test_two_workers_batching_never_exceed_the_pool(redis_proc1, tmp_path):
    cap = 4 * GiB
    apps = [
        _app(
            redis_proc1.url,
            "bt5",
            max_wait_ms=5,
            max_size=8,
            threads=2,
            capacity=cap,
            acquire_timeout=30,
            reaper_interval=0.05,
            history_file=str(tmp_path / f"h{k}"),
        )
        for k in range(2)
    ]
    async with Running(apps[0][0]) as c0, Running(apps[1][0]) as c1:
        rs = await asyncio.gather(
            *(
                (c0, c1)[i % 2].post("/b", json={"i": i, "work": True, "gib": 0.5 + (i % 3) * 0.5})
                for i in range(60)
            )
        )
        assert [r.status_code for r in rs] == [200] * 60, [
            r.text for r in rs if r.status_code != 200
        ]
        assert [r.json()["i"] for r in rs] == list(range(60))
    events = []
    for p in tmp_path.glob("h*.jsonl"):
        events += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    leases = lease_intervals(events, routes={"b"})
    peak, _ = max_concurrent([(t0, t1, a) for t0, t1, a, _ in leases])
    assert peak <= cap, (peak, cap)
    sizes = [len(x) for a in apps for x in a[3]["batches"]]
    assert sum(sizes) == 60 and max(sizes) > 1, sizes  # they did batch
    assert len(leases) == sum(len(a[3]["batches"]) for a in apps)  # one lease a batch
    assert await _used(redis_proc1.url, "bt5") == 0


def test_a_client_that_hangs_up_is_dropped_from_its_waiting_batch(redis_proc1):
    import socket

    import uvicorn

    from support.ports import free_port

    app, gpu, b, seen, gate = _app(redis_proc1.url, "bt6", max_size=3)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    t = threading.Thread(target=server.run, daemon=True)
    t.start()

    def until(pred, what):
        deadline = time.monotonic() + 10
        while not pred():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.005)

    def open_post(body):
        raw = json.dumps(body).encode()
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(
            f"POST /b HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        return s

    waiting = metrics().disconnected.labels("b", "waiting")
    socks: list = []
    try:
        until(lambda: server.started, "the server")
        url = f"http://127.0.0.1:{port}"
        gate.clear()
        hold: dict = {}
        ht = threading.Thread(
            target=lambda: hold.setdefault(
                "r", httpx.post(url + "/b", json={"i": -1, "hold": True}, timeout=30)
            )
        )
        ht.start()
        until(lambda: [-1] in seen["batches"], "the holder running")
        base = b.joined
        for i in range(3):
            socks.append(open_post({"i": i}))
            until(lambda: b.joined == base + i + 1, f"request {i} joining")
        until(
            lambda: any(len(x.entries) == 3 and x.job.phase == "slot" for x in list(b._inflight)),
            "the batch of three waiting for the thread",
        )
        before = waiting._value.get()
        socks[1].close()
        until(lambda: waiting._value.get() == before + 1, "the hang-up noticed")
        gate.set()
        answers = []
        for i in (0, 2):
            socks[i].settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                chunk = socks[i].recv(65536)
                if not chunk:
                    break
                data += chunk
            answers.append(data)
        ht.join(30)
        assert hold["r"].status_code == 200
        assert all(a.startswith(b"HTTP/1.1 200") for a in answers), answers
        assert seen["batches"] == [[-1], [0, 2]], "the one that left did not run"
    finally:
        for s in socks:
            s.close()
        server.should_exit = True
        t.join(10)


async def test_stop_answers_the_requests_of_a_forming_batch_at_once(redis_proc1):
    app, gpu, b, seen, gate = _app(redis_proc1.url, "bt7", acquire_timeout=30)
    async with Running(app) as c:
        gate.clear()
        holder = await _hold(c, seen)
        tasks = await _fire_in_order(c, b, [{"i": 0}, {"i": 1}])  # open: the thread is busy
        stopping = asyncio.ensure_future(gpu.stop(grace_s=10))
        rs = [await t for t in tasks]
        gate.set()
        await stopping
        for r in rs:
            assert r.status_code == 503 and "shutting down" in r.json()["detail"], r.text
        assert (await holder).status_code == 200
        assert seen["batches"] == [[-1]]


async def test_a_retry_reaching_a_worker_with_the_other_batch_setting_replays(redis_proc1):
    """The service fingerprints a request alike batched or not: a retry with the same
    X-Request-ID on a worker with the other GPULOCK_BATCH gets the stored result, not 409."""
    from gpulock_service.app import create_app
    from gpulock_service.settings import Settings

    def svc(batch: bool):
        return create_app(
            Settings(
                redis_url=redis_proc1.url,
                pool="bt8",
                capacity="4GiB",
                configure="set",
                model="sleep",
                sleep_seconds=0.0,
                sleep_bytes="1MiB",
                resident="0",
                batch=batch,
                reaper_interval=0.05,
            )
        )

    on, off = svc(True), svc(False)
    async with Running(on) as c_on, Running(off) as c_off:
        for app in (on, off):
            await async_wait_until(lambda: app.state.limiter.readiness()[0], what="ready")
        body, h = {"input": ["a", "bb"]}, {"X-Request-ID": "cross-setting-1"}
        first = await c_on.post("/v1/embeddings", json=body, headers=h)
        again = await c_off.post("/v1/embeddings", json=body, headers=h)
        assert first.status_code == again.status_code == 200, again.text
        assert again.headers.get("x-idempotent-replay") == "true"
        assert again.json() == first.json()
        other = await c_off.post("/v1/embeddings", json={"input": ["c"]}, headers=h)
        assert other.status_code == 409


async def test_requests_behind_a_waiting_batch_time_out_with_their_own_503(redis_proc1):
    """The second request's batch grows behind the first's (which waits for the thread);
    when the first's deadline drops it, the second's batch closes and waits in turn: each
    gets its own 503 with Retry-After at its own deadline, and neither runs."""
    app, gpu, b, seen, gate = _app(
        redis_proc1.url, "bt9", max_wait_ms=1, acquire_timeout=1.0, reaper_interval=0.05
    )
    async with Running(app) as c:
        gate.clear()
        holder = await _hold(c, seen)
        (first,) = await _fire_in_order(c, b, [{"i": 0}])
        await async_wait_until(lambda: len(b._inflight) == 2, what="its batch waiting")
        (second,) = await _fire_in_order(c, b, [{"i": 1}])  # behind it: the batch grows
        r0, r1 = await first, await second
        gate.set()
        await holder
        for r in (r0, r1):  # (the second's batch may not even have closed by its deadline)
            detail = r.json()["detail"]
            assert r.status_code == 503 and ("within 1.0s" in detail or "in time" in detail)
            assert int(r.headers["retry-after"]) >= 1 and "x-queue-position" in r.headers
        assert seen["batches"] == [[-1]], "neither ran"
    assert await _used(redis_proc1.url, "bt9") == 0


async def test_a_batched_requests_503_names_its_own_bytes_and_the_batchs_apart(redis_proc1):
    """The 503 of a request whose batch was not granted in time named the whole batch's bytes
    as the request's ("no GPU memory for 5.0GiB" to a request of 2 GiB); it names the
    request's own now, and the batch's labelled as such."""
    app, gpu, b, seen, gate = _app(
        redis_proc1.url, "bt10", max_size=2, max_wait_ms=3000, acquire_timeout=3.0
    )
    pool = AsyncPool.from_url(redis_proc1.url, "bt10")
    async with Running(app) as c:
        gate.clear()
        holder = await _hold(c, seen)  # the only thread, and 1 GiB of the 8
        tasks = await _fire_in_order(c, b, [{"i": 0, "gib": 2}, {"i": 1, "gib": 3}])
        await async_wait_until(lambda: len(b._inflight) == 2, what="the batch closing (full)")
        lease = await pool.acquire(7 * GiB, timeout=5)  # the rest: the batch can only queue
        gate.set()
        r0, r1 = [await t for t in tasks]
        assert (await holder).status_code == 200
        for r, own in ((r0, "2.0GiB"), (r1, "3.0GiB")):
            assert r.status_code == 503, r.text
            assert r.json()["detail"].startswith(
                f"no GPU memory for {own} (this request's own; the batch it waited in needs "
                f"5.0GiB in all)"
            ), r.text
        assert seen["batches"] == [[-1]], "the batch never ran"
        await lease.release()
    await pool.aclose()
    assert await _used(redis_proc1.url, "bt10") == 0
