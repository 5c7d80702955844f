"""The error table (gpulock_common.wire) walked through every surface, on real servers: for
each answer of each shared error, the broker answers its status, code and fields; the SDK
raises the same class back with the same fields and status; the CLI through the broker
reads the same class and exits as it does for that error met on Redis itself; and the FastAPI
integration answers the status and reason the table gives a lease taken on a client's behalf.

The error is raised where each server meets it: by the broker's pool status (the HTTP route,
its error mapping, the SDK and the CLI are the real ones), and by the limiter's pool acquire
(its admission, job and answer are the real ones), as test_fastapi_max_ttl.py does."""

from __future__ import annotations

import typer
from gpulock_broker.outcomes import NotYours
from gpulock_common.errors import AuthError, GpuLockError, LeaseLost
from gpulock_common.wire import ANSWERS, Answer, served

import gpulock_client
from gpulock.cli import main
from gpulock.cli.broker import BrokerAdmin
from gpulock.cli.common import Target, error_exit

from support.apps import Running, one_route_app
from support.errors import POOL, sample

from ._support import LIMITED_TOKEN, USER_TOKEN, client

LEASE_ID = "cd" * 16


def _raise(e: BaseException):
    async def raising(*args, **kwargs):
        raise e

    return raising


def _exit_for(e: GpuLockError, url: str) -> int:
    """The CLI's exit status for ``e`` met on its own (as from Redis)."""
    try:
        error_exit(e, Target("broker", url), POOL)
    except typer.Exit as x:
        return int(x.exit_code)
    raise AssertionError("error_exit returned")


def _meet(a: Answer, broker, monkeypatch) -> tuple[str, GpuLockError]:
    """Make the broker meet ``a``'s error on ``GET /v1/pools/gpu-e``; the token to ask with and
    the error as the core (or the broker itself) raised it."""
    if (a.cls, a.code) == (AuthError, "forbidden"):  # a pool outside the token's: no raise
        return LIMITED_TOKEN, AuthError("this token may not use pool 'gpu-e'")
    if (a.cls, a.code) == (LeaseLost, "not_found"):  # the lease of another token
        monkeypatch.setattr(broker, "status", _raise(NotYours(LEASE_ID)))
        return USER_TOKEN, LeaseLost(LEASE_ID, "no such lease for this token")
    e = sample(a.cls)
    monkeypatch.setattr(broker, "status", _raise(e))
    return USER_TOKEN, e


def test_broker_sdk_and_cli_answer_and_read_back_every_row(broker_srv, monkeypatch, capsys):
    seen = []
    for a in ANSWERS:
        token, e = _meet(a, broker_srv.broker, monkeypatch)
        row = f"{a.cls.__name__} {a.status} {a.code}"

        # the broker: the row's status and code, the exception's fields
        with client(broker_srv.url, token) as c:
            r = c.get(f"/v1/pools/{POOL}")
        assert r.status_code == a.status, (row, r.status_code, r.text)
        detail = r.json()["detail"]
        if a.cls.__name__ == "InvalidArgument":  # the shape of the schema's own refusals
            assert detail == [{"loc": ["body"], "msg": str(e), "type": "value_error"}], row
        else:
            assert detail["error"] == a.code, (row, detail)
            assert {f: detail[f] for f in a.fields} == a.body(e), (row, detail)
        if a.status == 503:
            assert r.headers["retry-after"] == "1", (row, r.headers)

        # the SDK: the same class, fields and status
        with gpulock_client.Pool(broker_srv.url, POOL, token=token) as p:
            try:
                p.status()
            except GpuLockError as back:
                got = back
            else:
                raise AssertionError(f"{row}: the SDK raised nothing")
        assert type(got) is a.cls and got.status == a.status, (row, got)
        assert a.body(got) == a.body(e), (row, a.body(got), a.body(e))

        # the CLI through the broker: the same class, and the exit status of that error
        monkeypatch.setenv("GPULOCK_TOKEN", token)
        b = BrokerAdmin(broker_srv.url)
        try:
            b.call("GET", f"/v1/pools/{POOL}", POOL)
        except GpuLockError as back:
            got = back
        else:
            raise AssertionError(f"{row}: the CLI raised nothing")
        finally:
            b.close()
        assert type(got) is a.cls and a.body(got) == a.body(e), (row, got)
        capsys.readouterr()
        code = main(["--broker-url", broker_srv.url, "status", POOL])
        err = capsys.readouterr().err
        assert code == _exit_for(e, broker_srv.url) != 0, (row, code, err)
        assert err.startswith("gpulock: error: "), (row, err)
        monkeypatch.undo()
        seen.append((a.cls, a.code))
    assert seen == [(a.cls, a.code) for a in ANSWERS]


async def test_the_fastapi_integration_answers_every_shared_error_as_served(redis_srv, monkeypatch):
    """The status and reason of :func:`served` (the reason is the service's ``code``, rendered
    here by the service's own error shape); a 503 says when to retry."""
    from gpulock_service.openai_errors import install_openai_errors

    app, gpu = one_route_app(redis_srv.url, POOL, acquire_timeout=5, reaper_interval=600)
    install_openai_errors(app)
    classes = list(dict.fromkeys(a.cls for a in ANSWERS))
    async with Running(app) as c:
        assert gpu.backend.pool is not None
        for cls in classes:
            monkeypatch.setattr(gpu.backend.pool, "acquire", _raise(sample(cls)))
            r = await c.post("/sync", json={})
            status, reason = served(cls)
            assert r.status_code == status, (cls.__name__, r.status_code, r.text)
            assert r.json()["error"]["code"] == reason, (cls.__name__, r.text)
            assert (status == 503) == ("retry-after" in r.headers), (cls.__name__, r.headers)
        st = await gpu.backend.pool.status()
        assert (st.used, st.lease_count, st.waiter_count) == (0, 0, 0)  # nothing was held
