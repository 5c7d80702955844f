"""gpulock_common.tracing's helpers that gpulock.fastapi's batch span is built from (a root
span with links, its ids as text, a fresh context for a block, an exception recorded), read
from an in-memory exporter; and each a no-op without a recording provider."""

from __future__ import annotations

import pytest
from support.tracing import memory_spans

from gpulock_common import tracing as tr

pytest.importorskip("opentelemetry.sdk")


def test_a_root_span_links_its_members_and_names_its_ids():
    from opentelemetry import trace

    with memory_spans() as exporter:
        with tr.span("outer") as outer:
            member = tr.current_span()
            assert member is outer
            sp = tr.start_span(
                "root", {"a": 1, "b": None}, context=tr.root_context(), links=[member, None]
            )
        trace_id, span_id = tr.span_ids(sp)
        ctx = sp.get_span_context()
        assert (trace_id, span_id) == (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
        with tr.span("elsewhere"):
            with tr.use(sp, tr.root_context()):
                assert tr.current_span() is sp
                with tr.span("child"):
                    pass
            assert tr.current_span().name == "elsewhere"
        tr.record_error(sp, ValueError("x" * 300))
        sp.end()
        done = {s.name: s for s in exporter.get_finished_spans()}
    root, child = done["root"], done["child"]
    assert root.parent is None and root.context.trace_id != outer.get_span_context().trace_id
    assert dict(root.attributes) == {"a": 1}
    assert [lk.context for lk in root.links] == [outer.get_span_context()]
    assert child.parent.span_id == root.context.span_id
    assert root.status.status_code == trace.StatusCode.ERROR
    assert root.status.description == "x" * 200
    assert [e.name for e in root.events] == ["exception"]


def test_nothing_without_a_recording_provider():
    assert not tr.recording()
    assert tr.current_span() is None
    assert tr.start_span("x", links=[None]) is None
    with tr.use(None, tr.root_context()) as s:
        assert s is None
    tr.record_error(None, ValueError("x"))
