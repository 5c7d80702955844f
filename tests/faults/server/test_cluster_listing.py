"""Listing every pool while shards of a real Redis Cluster / Valkey cluster are down (started
here: 5 masters, no replicas, so a shard stays down): one master killed with ``kill -9``
(connections refused), one stopped with SIGSTOP (connections accepted, no answer ever).

``gpulock status``, ``pool list`` (text and ``--json``) and ``top --once``, the broker's
``GET /v1/pools`` and ``/dashboard`` (data and page), and the view the service's dashboard
draws list the pools of the three masters that answer, name the two that do not (node, slot
range, why) and answer within the listing's bound; the CLI exits 69.

The master of slot 0 stays up: redis-py's cluster clients send their keyless commands (and
the key lookups of FCALL) to it, so while it hangs a client waits for it however the
listing is made (docs/CLUSTER.md, "Listing while a shard is down").
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from broker._support import ADMIN_TOKEN, USER_TOKEN, BrokerServer, client
from support.browser import Browser
from support.cluster import Cluster, start_cluster
from support.procs import gpulock_argv, proc_state
from support.waiting import wait_until

from gpulock import AsyncPool, Pool
from gpulock._async import _CLIENT_DEFAULTS
from gpulock.transport.connect import async_client
from gpulock.transport.cluster import ready
from gpulock.dashboard.view import dashboard_view
from gpulock.admin.listing import LIST_TIMEOUT_S
from gpulock.cli import EXIT_UNAVAILABLE

pytestmark = pytest.mark.timeout(180)

DEAD, HUNG = 1, 3  # masters[1] killed, masters[3] stopped; 0, 2 and 4 answer


@dataclass
class Down:
    cluster: Cluster
    names: list[str]  # names[i]: a pool on masters[i]
    broker: BrokerServer
    shards: list[dict]  # the two down shards as a listing names them (error checked apart)

    @property
    def up(self) -> list[str]:
        """The pools of the masters that answer, sorted (as listed)."""
        return sorted(n for i, n in enumerate(self.names) if i not in (DEAD, HUNG))


@pytest.fixture(scope="module")
def down(server_binary):
    c = start_cluster(server_binary, masters=5, replicas=0)
    broker = None
    try:
        names = [ns[0] for ns in c.names_by_master("gpu-")]
        for n in names:
            with Pool.from_url(c.url, n) as p:
                p.configure(100)
        slots = {
            port: [lo, hi]
            for lo, hi, (_, port, *_), *_ in c.client(c.masters[0]).execute_command(
                "CLUSTER", "SLOTS"
            )
        }
        c.masters[DEAD].kill()
        c.masters[HUNG].pause()
        wait_until(lambda: proc_state(c.masters[HUNG].pid) == "T", 10, "the master stopped")
        shards = [
            {"node": f"{m.host}:{m.port}", "slots": [slots[m.port]]}
            for m in (c.masters[DEAD], c.masters[HUNG])
        ]
        # A broker started while the shards are down. (One that ran before the fault keeps
        # calling the down shards' pools until its next listing; redis-py's asyncio cluster
        # client then drops every connection on each refused one, which stalls the other
        # shards' calls too: the cluster's fault tests, not this listing's.)
        broker = BrokerServer(c.url, backend_timeout=3.0).start()
        down = Down(c, names, broker, shards)
        with client(broker.url, USER_TOKEN) as user:  # its client has read the cluster
            wait_until(
                lambda: user.get(f"/v1/pools/{down.up[0]}").status_code == 200,
                30,
                "the broker to read a pool",
            )
        yield down
    finally:
        c.masters[HUNG].resume()
        if broker is not None:
            broker.stop()
        c.stop()


def check_shards(got: list[dict], want: list[dict]) -> None:
    """``got`` names the down shards of ``want``: refused (the killed one), silent (the
    stopped one, cut off at the bound)."""
    assert [{"node": u["node"], "slots": u["slots"]} for u in got] == want, got
    assert "connecting to" in got[0]["error"], got[0]
    assert got[1]["error"] == f"no answer within {LIST_TIMEOUT_S:g} s", got[1]


def run_all(argvs: list[list[str]], env: dict) -> tuple[list[subprocess.CompletedProcess], float]:
    """Run the commands at once; their results and the seconds until the last ended."""
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(a, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for a in argvs
    ]
    out = []
    for a, p in zip(argvs, procs):
        try:
            o, e = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(a, p.returncode, o, e))
    return out, time.monotonic() - t0


def cli_env(**kw: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    return {**env, "COLUMNS": "200", **kw}


def test_cli_lists_the_pools_that_answer_and_names_the_shards_that_do_not(down):
    url = down.cluster.url  # every master a seed, the down ones too
    commands = [
        ["status"],
        ["status", "--json"],
        ["pool", "list"],
        ["pool", "list", "--json"],
        ["top", "--once"],
    ]
    runs, took = run_all([[*gpulock_argv(), "--redis-url", url, *c] for c in commands], cli_env())
    text_status, json_status, text_list, json_list, top = runs
    for r in runs:
        assert r.returncode == EXIT_UNAVAILABLE, (r.args, r.stdout, r.stderr)
        assert "partial answer" in r.stderr, r.stderr
        for u in down.shards:  # each down shard named: master and slot range
            assert f"{u['node']} (slots {u['slots'][0][0]}-{u['slots'][0][1]})" in r.stderr
    for r in (json_status, json_list):
        d = json.loads(r.stdout)
        assert [p["pool"] for p in d["pools"]] == down.up, r.stdout
        check_shards(d["unreachable"], down.shards)
    assert [ln.split()[0] for ln in text_list.stdout.splitlines()] == down.up
    shown = [ln.split()[1].rstrip(":") for ln in text_status.stdout.splitlines() if ln]
    assert shown == down.up, text_status.stdout
    for u in down.shards:
        assert f"shard {u['node']} unreachable" in top.stdout, top.stdout
    assert all(n in top.stdout for n in down.up)
    assert not any(down.names[i] in top.stdout for i in (DEAD, HUNG))
    # the five at once, each a Python start plus the listing's bound: far from redis-py's
    # retries on the stopped master (about a minute before this listing existed)
    assert took < 30, took


def test_the_broker_answers_200_naming_the_shards_that_do_not_answer(
    down, server_binary, default_binary, tmp_path
):
    b = down.broker

    def get(path: str, token: str) -> httpx.Response:
        with client(b.url, token) as c:
            return c.get(path)

    with ThreadPoolExecutor(3) as ex:  # at once: each waits the listing's bound
        listed = ex.submit(get, "/v1/pools", USER_TOKEN)
        viewed = ex.submit(get, "/dashboard/data", ADMIN_TOKEN)
        # the CLI through the broker: the same partial answer, the same exit status
        cli = ex.submit(
            run_all,
            [[*gpulock_argv(), "--broker-url", b.url, "pool", "list", "--json"]],
            cli_env(GPULOCK_TOKEN=USER_TOKEN),
        )
        for r in (listed.result(), viewed.result()):
            assert r.status_code == 200, r.text
            assert [p["pool"] for p in r.json()["pools"]] == down.up
            check_shards(r.json()["unreachable"], down.shards)
        (r,), _ = cli.result()
    assert r.returncode == EXIT_UNAVAILABLE, r.stderr
    assert [p["pool"] for p in json.loads(r.stdout)["pools"]] == down.up
    check_shards(json.loads(r.stdout)["unreachable"], down.shards)
    if server_binary != default_binary:
        return  # the page is the same whatever the server: drawn once, in Chromium
    with Browser(tmp_path) as br:
        page = br.new_page(f"{b.url}/dashboard#token={ADMIN_TOKEN}")
        js = """(function () {
          var st = document.getElementById('status');
          if (!st) return null;  // not loaded yet
          return {state: st.getAttribute('data-state'),
            shards: Array.from(document.querySelectorAll('section.shard.unreachable'))
                    .map(function (s) { return [s.getAttribute('data-node'), s.innerText]; }),
            pools: Array.from(document.querySelectorAll('section.pool'))
                   .map(function (s) { return s.getAttribute('data-pool'); })};
        })()"""
        seen = wait_until(
            lambda: (v := page.evaluate(js)) and v["state"] == "partial" and v,
            60,
            "the page to show the partial view",
            interval=0.2,
        )
        assert seen["pools"] == down.up
        assert [n for n, _ in seen["shards"]] == [u["node"] for u in down.shards]
        for (_, text), u in zip(seen["shards"], down.shards):
            assert f"slots {u['slots'][0][0]}–{u['slots'][0][1]}" in text, text
        page.screenshot(tmp_path / "partial.png")


async def test_the_view_of_one_pool_names_its_shard_when_it_does_not_answer(down):
    """As the service's dashboard draws its pool (one per service, on a client that knew the
    cluster): the pool's status and history read within a bound, then its shard named once
    a listing finds it unreachable."""
    seeds = [m for i, m in enumerate(down.cluster.masters) if i not in (DEAD, HUNG)]
    url = "redis+cluster://" + ",".join(f"{m.host}:{m.port}" for m in seeds)

    async def view(name: str) -> dict:
        redis = async_client(url, **_CLIENT_DEFAULTS)
        pool = AsyncPool(redis, name)

        async def status(n: str, limit: int):
            return await pool.status(limit=limit)

        try:
            await ready(redis)  # a service's client has read the cluster long before
            return await dashboard_view(redis, [name], status, read_timeout=2.0)
        finally:
            await pool.aclose()
            await redis.aclose()

    up, dead, hung = await asyncio.gather(*(view(down.names[i]) for i in (0, DEAD, HUNG)))
    assert [p["pool"] for p in up["pools"]] == [down.names[0]] and up["unreachable"] == [], up
    for v, i, u in ((dead, DEAD, down.shards[0]), (hung, HUNG, down.shards[1])):
        assert v["pools"] == [] and list(v["errors"]) == [down.names[i]], v
        assert [{"node": x["node"], "slots": x["slots"]} for x in v["unreachable"]] == [u], v
