"""docs/SERVICE.md's FastAPI examples ("Use it in your own FastAPI app" and "Streams: the lease
held until the last chunk") run as written, one after the other in one module as a reader would
paste them, against a real Redis: only the Redis URL is changed and ``model``, the reader's own
model, is a stand-in. Each route answers: a plain def, an ``async def`` with ``Depends``, a
server-sent-events stream and a plain text stream."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

DOC = Path(__file__).resolve().parents[2] / "docs" / "SERVICE.md"


class Model:
    """The reader's model: text in, text out."""

    def generate(self, texts: list[str]) -> list[str]:
        return [t.upper() for t in texts]

    def embed(self, texts: list[str]) -> list[list[float]]:
        return [[float(len(t))] for t in texts]

    def generate_stream(self, texts: list[str]):
        for t in texts:
            yield t + " "


def _examples() -> list[str]:
    text = DOC.read_text()
    part = text[text.index("## Use it in your own FastAPI app") : text.index("### Priorities")]
    return re.findall(r"```python\n(.*?)```", part, re.S)


@pytest.mark.timeout(60)
def test_the_fastapi_examples_run_as_written(redis_proc1):
    blocks = _examples()
    assert len(blocks) == 3, "the section's examples moved: update this test"
    ns: dict = {"model": Model(), "__name__": "docs_example"}
    for i, block in enumerate(blocks):
        code = block.replace("redis://localhost:6379/0", redis_proc1.url)
        exec(compile(code, f"docs/SERVICE.md example {i + 1}", "exec"), ns)
    with TestClient(ns["app"]) as c:
        r = c.post("/generate", json={"texts": ["a"]})
        assert r.status_code == 200 and r.json() == {"out": ["A"]}, r.text
        r = c.post("/embed", json={"texts": ["ab"]})
        assert r.status_code == 200 and r.json() == {"vectors": [[2.0]]}, r.text
        r = c.post("/generate-stream", json={"texts": ["a", "b"]})
        assert r.status_code == 200, r.text
        assert r.text == 'data: {"token":"a "}\n\ndata: {"token":"b "}\n\ndata: [DONE]\n\n'
        r = c.post("/generate-text", json={"texts": ["a", "b"]})
        assert r.status_code == 200 and r.text == "a b ", r.text
