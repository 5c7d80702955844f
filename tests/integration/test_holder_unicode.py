"""Holder metadata that JSON in UTF-8 cannot carry (a lone surrogate such as ``"\\ud800"``, as
a value or as a key) is refused with InvalidArgument naming it, and nothing is stored: stored,
it made every later status read that renders it fail (the broker's GET answered 500 for as
long as the lease lived)."""

from __future__ import annotations

import json

import pytest

from gpulock import InvalidArgument
from gpulock.protocol.args import decode_meta
from support.pools import GiB, snapshot

BAD_HOLDERS = [
    {"x": "\ud800"},
    {"\ud800": 1},
    {"x": "ok\udfff"},
    {"x": ["\ud800"]},
    {"x": {"y": "\udc00"}},
]


@pytest.mark.parametrize("holder", BAD_HOLDERS, ids=ascii)
async def test_lone_surrogate_in_holder_is_invalid_argument_async(make_apool, rclient, holder):
    pool = make_apool(capacity=8 * GiB)
    await pool.configure(8 * GiB)
    before = snapshot(rclient)
    with pytest.raises(InvalidArgument) as ei:
        await pool.acquire(GiB, holder=holder, timeout=1)
    key = next(iter(holder))
    assert ascii(key)[1:-1] in str(ei.value) and "Unicode" in str(ei.value), str(ei.value)
    assert snapshot(rclient) == before
    st = await pool.status()
    assert st.lease_count == 0 and st.waiter_count == 0


def test_lone_surrogate_in_holder_is_invalid_argument_sync(make_pool, rclient):
    pool = make_pool(capacity=8 * GiB)
    pool.configure(8 * GiB)
    before = snapshot(rclient)
    for holder in BAD_HOLDERS:
        with pytest.raises(InvalidArgument, match="Unicode"):
            pool.acquire(GiB, holder=holder, timeout=1)
    assert snapshot(rclient) == before


async def test_valid_unicode_holders_still_work(make_apool):
    pool = make_apool(capacity=8 * GiB)
    await pool.configure(8 * GiB)
    holder = {"emoji": "\U0001f600", "café": "naïve", "cjk": "\u4e2d"}
    async with pool.lease(GiB, holder=holder, timeout=5):
        st = await pool.status()
        got = st.leases[0].holder
        assert {k: got[k] for k in holder} == holder
        json.dumps(st.to_dict(), ensure_ascii=False).encode("utf-8")


def test_metadata_stored_before_the_check_decodes_printable():
    # written by an older version (or by hand): status renders it, escaped, instead of failing
    d = decode_meta('{"x":"\\ud800","\\uD801":1,"ok":"\\ud83d\\ude00"}')
    json.dumps(d, ensure_ascii=False).encode("utf-8")
    assert d["x"] == "\\ud800" and d["ok"] == "\U0001f600"
