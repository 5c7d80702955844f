#!/usr/bin/env python
"""How often a cancellation is lost by the Redis client, and whether gpulock's stop still ends.

    python benchmarks/lost_cancellation.py --tries 400

On a private Redis: ``--tries`` times, a task loops on one command (``GET`` through redis-py's
asyncio client, with the socket timeout gpulock sets) and is cancelled after a random 0-3 ms.
Counted: tries in which the task was still running 0.2 s after its one cancel (the client lost
the cancellation), and, for each, whether :func:`gpulock_common.aio.stop_tasks` ended it.
Prints one line with the Python and redis-py versions. Measurement tool only; the tests in
``tests/unit/test_aio.py`` and ``tests/integration/test_lost_cancellation.py`` pin the behaviour.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys

import redis
import redis.asyncio as aioredis
from gpulock_common.aio import stop_tasks

from gpulock._async import _CLIENT_DEFAULTS
from gpulock.embedded import RedisProcess, find_server_binary


async def _run(url: str, tries: int) -> tuple[int, int]:
    r = aioredis.from_url(url, **_CLIENT_DEFAULTS)
    await r.get("x")

    async def loop() -> None:
        while True:
            await asyncio.sleep(0)
            await r.get("x")

    lost = stopped = 0
    for _ in range(tries):
        t = asyncio.ensure_future(loop())
        await asyncio.sleep(random.random() * 0.003)
        t.cancel()
        done, _ = await asyncio.wait({t}, timeout=0.2)
        if not done:
            lost += 1
            await asyncio.wait_for(stop_tasks([t], resend_s=0.05), 10)
            stopped += t.done()
    await r.aclose()
    return lost, stopped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tries", type=int, default=400)
    a = ap.parse_args(argv)
    with RedisProcess(find_server_binary("redis")) as rp:
        lost, stopped = asyncio.run(_run(rp.url, a.tries))
    py = sys.version.split()[0]
    print(
        f"python {py}, redis-py {redis.__version__}: {lost} of {a.tries} cancellations lost "
        f"({100 * lost / a.tries:.0f} %); stop_tasks ended {stopped} of them"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
