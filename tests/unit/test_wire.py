"""The error table (gpulock_common.wire): every shared error has one answer, no two answers or
statuses read back ambiguously, each answer reads back as its class with its fields, and a
server that took a lease on its client's behalf never blames the client for it. Without a
server: tests/broker/test_error_table.py walks the table through the real surfaces."""

from __future__ import annotations

from pathlib import Path

import gpulock_common.errors as errors
import pytest
from gpulock_common.wire import (
    ANSWERS,
    SERVED_STATUS,
    answer_for,
    error_from_reply,
    reply_message,
    served,
)

from support.errors import POOL, sample

SHARED = [getattr(errors, n) for n in errors.__all__]
LOCAL_ONLY = {errors.GpuLockError, errors.PoolClosed}  # never cross HTTP


def test_every_shared_error_but_the_local_ones_has_an_answer():
    assert {a.cls for a in ANSWERS} == set(SHARED) - LOCAL_ONLY
    for cls in LOCAL_ONLY:
        assert answer_for(cls) is None, cls
    assert answer_for(ValueError("x")) is None


def test_no_reply_reads_back_two_ways():
    pairs = [(a.status, a.code) for a in ANSWERS]
    assert len(pairs) == len(set(pairs)), pairs
    reads = [s for a in ANSWERS for s in a.reads]
    assert len(reads) == len(set(reads)), reads
    first = {}
    for a in ANSWERS:
        first.setdefault(a.cls, a)
    for a in ANSWERS:  # a class's other answers carry what its answer carries
        assert a.fields == first[a.cls].fields, a


@pytest.mark.parametrize("a", ANSWERS, ids=lambda a: f"{a.cls.__name__}-{a.status}-{a.code}")
def test_each_answer_reads_back_as_its_class_with_its_fields(a):
    e = sample(a.cls)
    assert answer_for(e, a.code) is a
    body = {"detail": {"error": a.code, "message": str(e), **a.body(e)}}
    back = error_from_reply(a.status, body, POOL)
    assert type(back) is a.cls and back.status == a.status, (back, a)
    assert a.body(back) == a.body(e), (a.body(back), a.body(e))
    assert str(e) in str(back)


def test_a_subclass_answers_as_its_nearest_shared_class():
    class Deleting(errors.BackendUnavailable):
        pass

    assert answer_for(Deleting("x")) is answer_for(errors.BackendUnavailable)
    assert answer_for(errors.RoomExceeded) is not answer_for(errors.CapacityExceeded)
    assert answer_for(errors.AuthError, "forbidden").status == 403  # type: ignore[union-attr]
    assert answer_for(errors.AuthError, "nope") is None


@pytest.mark.parametrize("cls", sorted(set(SHARED) - LOCAL_ONLY, key=lambda c: c.__name__))
def test_served_never_blames_the_client_for_the_servers_lease(cls):
    """A server that took the lease on its client's behalf answers 413 (the request's size) and
    503 (overload) as the lease API does; any other 4xx of the lease API becomes its own 5xx."""
    a = answer_for(cls)
    status, reason = served(cls)
    assert status == SERVED_STATUS.get(a.status, a.status)
    assert status in (413, 500, 503), (cls, status)
    assert reason == (a.reason or a.code)


def test_served_keeps_the_reasons_the_service_published():
    """docs/SERVICE.md lists these as the service's ``code``; users match them."""
    assert served(errors.CapacityExceeded) == (413, "capacity")
    assert served(errors.RoomExceeded) == (413, "capacity")
    assert served(errors.QuotaExceeded) == (413, "quota")
    assert served(errors.QueueFull) == (503, "queue_full")
    assert served(errors.AcquireTimeout) == (503, "queue_timeout")
    assert served(errors.LeaseLost) == (503, "lease_lost")
    assert served(errors.BackendUnavailable) == (503, "backend")
    assert served(errors.PoolNotFound) == (503, "backend")
    assert served(errors.InvalidArgument) == (500, "invalid_argument")
    with pytest.raises(LookupError):
        served(errors.PoolClosed)


@pytest.mark.parametrize(
    "status, body, cls, text",
    [
        (401, {"detail": {"error": "whatever", "message": "m"}}, errors.AuthError, "m"),
        (403, None, errors.AuthError, "HTTP 403"),
        (
            422,
            {"detail": [{"loc": ["body", "amount"], "msg": "bad"}]},
            errors.InvalidArgument,
            "amount: bad",
        ),
        (
            400,
            {"detail": {"error": "invalid_json", "message": "not JSON"}},
            errors.InvalidArgument,
            "not JSON",
        ),
        (
            413,
            {"detail": {"error": "request_too_large", "message": "m"}},
            errors.CapacityExceeded,
            "m",
        ),
        (410, {"detail": {"message": "gone"}}, errors.LeaseLost, "gone"),
        (502, None, errors.BackendUnavailable, f"pool {POOL!r}: HTTP 502"),
        (
            503,
            {"detail": {"error": "queue_full", "message": "m", "queue_length": 2}},
            errors.QueueFull,
            "m",
        ),
        (504, {"detail": "upstream timed out"}, errors.BackendUnavailable, "upstream timed out"),
    ],
)
def test_replies_of_no_exact_answer_read_by_status(status, body, cls, text):
    e = error_from_reply(status, body, POOL)
    assert type(e) is cls and e.status == status and text in str(e), (e, cls)


def test_queue_full_reads_back_when_to_retry_the_estimate_and_the_bound():
    """A queue_full 503's retry_after, estimated_wait_s and max_waiters are the SDK's
    QueueFull.retry_after, .estimated_wait and .max_waiters (None where the body has none: a
    broker older than them, or no measured drain rate); the core's own QueueFull, raised from
    Redis, has no answer to read them from."""
    body = {
        "detail": {
            "error": "queue_full",
            "message": "queue is full (2 waiting, max_waiters=2)",
            "queue_length": 2,
            "max_waiters": 2,
            "retry_after": 3,
            "estimated_wait_s": 2.25,
        }
    }
    e = error_from_reply(503, body, POOL)
    assert type(e) is errors.QueueFull and e.status == 503 and e.pool == POOL
    assert (e.queue_length, e.max_waiters, e.retry_after, e.estimated_wait) == (2, 2, 3.0, 2.25)
    assert isinstance(e.retry_after, float)
    old = {"detail": {"error": "queue_full", "message": "m", "queue_length": 2}}
    e = error_from_reply(503, old, POOL)
    assert (e.queue_length, e.max_waiters, e.retry_after, e.estimated_wait) == (2, None, None, None)
    core = errors.QueueFull(POOL, 2, 2)
    assert (core.max_waiters, core.retry_after, core.estimated_wait) == (2, None, None)
    assert "max_waiters=2" in str(core)


@pytest.mark.parametrize("status", [404, 409, 418, 500])
def test_a_reply_no_answer_reads_is_unexpected(status):
    """404 without a code is a route the broker does not have (a wrong URL, an older broker),
    not a lost lease; 409 is the broker's own (pool_in_use), read where it is asked for."""
    e = error_from_reply(status, {"detail": "Not Found"}, POOL)
    assert type(e) is errors.GpuLockError and e.status == status
    assert str(e) == f"pool {POOL!r}: unexpected HTTP {status}: Not Found"
    assert str(error_from_reply(status, None)) == f"unexpected HTTP {status}: HTTP {status}"


def test_reply_message():
    assert reply_message(500, {"detail": {"error": "x", "message": "m"}}) == "m"
    assert reply_message(500, {"detail": {"error": "x"}}) == "{'error': 'x'}"
    assert reply_message(500, {"detail": "plain"}) == "plain"
    assert reply_message(500, "<html>") == "HTTP 500"


def test_the_docs_table_is_the_code_table():
    """docs/MULTIHOST.md shows the table to operators: each class's row, as the code has it."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "MULTIHOST.md").read_text()
    rows: dict[type, list] = {}
    for a in ANSWERS:
        rows.setdefault(a.cls, []).append(a)
    for cls, rs in rows.items():
        answers = ", ".join(f"**{a.status}** `{a.code}`" for a in rs)
        fields = ", ".join(f"`{f}`" for f in rs[0].fields) or "—"
        reads = ", ".join(str(s) for a in rs for s in a.reads) or "—"
        status, reason = served(cls)
        row = f"| `{cls.__name__}` | {answers} | {fields} | {reads} | **{status}** `{reason}` |"
        assert row in text, row
