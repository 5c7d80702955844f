#!/usr/bin/env python
"""A/B of the hand-off chain (core.py's harness) for two gpulock versions in one run.

    python benchmarks/ab_handoff.py --base HEAD~1 --mode sync --n 10 --rounds 3

Side A is the ``--base`` commit (``git archive`` into a temporary folder), side B the working
tree. Each round runs core.py's chain of ``--n`` waiters (``--mode`` sync or async) once per
side, alternating which goes first, with the chain's worker processes importing that side's
gpulock (PYTHONPATH), on one private Redis. Reported per side: the medians over rounds of the
chain's p50 / p99 (release returns -> held, ms), of p50 from the release call, and of
hand-offs/s. Benchmark tool only; nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import redis  # noqa: E402

import core  # noqa: E402
from ab import export, pypath  # noqa: E402
from gpulock.embedded import RedisProcess, find_server_binary  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD")
    ap.add_argument("--mode", default="sync", choices=("sync", "async"))
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=0.7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cfg = dict(core.FULL, windows=a.windows, window_s=a.window_s, warm_s=0.3)
    load0 = os.getloadavg()
    res: dict[str, list[dict]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="gpulock-abh-") as tmp:
        export(a.base, Path(tmp))
        paths = {"A": pypath(Path(tmp)), "B": pypath(HERE.parent)}
        with RedisProcess(find_server_binary("redis")) as rp:
            c = redis.Redis.from_url(rp.url, **core.CLIENT_KW)
            for r in range(a.rounds):
                for s in ("A", "B") if r % 2 == 0 else ("B", "A"):
                    os.environ["PYTHONPATH"] = paths[s]  # the chain workers' gpulock
                    out = core.run_chain(rp.url, c, a.mode, a.n, cfg)
                    res[s].append(out)
    load1 = os.getloadavg()
    print(
        f"A = {a.base}, B = working tree; {a.mode} chain, {a.n} waiters, {a.rounds} rounds; "
        f"load avg {load0[0]:.2f} -> {load1[0]:.2f}"
    )
    summary = {}
    for s, outs in res.items():
        m = {
            k: statistics.median(o[k] for o in outs)
            for k in ("p50_ms", "p99_ms", "full_p50_ms", "handoffs_per_s")
        }
        summary[s] = m
        print(
            f"{s}: p50 {m['p50_ms']:.3f}  p99 {m['p99_ms']:.3f} ms (release returns -> held); "
            f"p50 {m['full_p50_ms']:.3f} from the call; {m['handoffs_per_s']:.0f} hand-offs/s"
        )
    if a.json:
        for outs in res.values():
            for o in outs:
                o.pop("samples_ms", None)
        Path(a.json).write_text(json.dumps({"summary": summary, "runs": res}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
