"""The service's OpenAPI schema, built without serving (building the app does no I/O): no 422
anywhere, OpenAI's error model, and the handler's bounds in the request schema, read from the
model and the settings (a text-only model's schema takes no token ids)."""

from __future__ import annotations

import pytest

pytest.importorskip("gpulock_service")

from gpulock_service.app import create_app  # noqa: E402
from gpulock_service.settings import Settings  # noqa: E402


class TextOnly:
    name = "text-only"
    dimensions = 3

    def load(self, device: str) -> None:
        pass

    def embed(self, texts: list[str]) -> list[list[float]]:
        return [[0.0] * 3 for _ in texts]

    def estimate_bytes(self, batch: int, tokens: int) -> int:
        return 1


def text_only(settings):
    return TextOnly()


def _schema(monkeypatch, **env):
    for k, v in {"GPULOCK_REDIS_URL": "redis://127.0.0.1:1/0", **env}.items():
        monkeypatch.setenv(k, v)
    return create_app(Settings()).openapi()


def test_sleep_model_schema(monkeypatch):
    s = _schema(monkeypatch, GPULOCK_MODEL="sleep", GPULOCK_MAX_BATCH="5")
    assert "HTTPValidationError" not in s["components"]["schemas"]
    for item in s["paths"].values():
        for op in item.values():
            assert "422" not in op["responses"] and "400" in op["responses"]
    inp = s["components"]["schemas"]["EmbeddingRequest"]["properties"]["input"]["anyOf"]
    assert [v.get("maxItems") for v in inp] == [None, 5, 5, 5]
    assert inp[2]["items"] == {"type": "integer", "minimum": 0}  # no vocabulary bound
    assert inp[3]["items"]["minItems"] == 1


def test_text_only_model_takes_no_token_ids(monkeypatch):
    s = _schema(monkeypatch, GPULOCK_MODEL=f"{__name__}:text_only")
    props = s["components"]["schemas"]["EmbeddingRequest"]["properties"]
    assert props["input"]["anyOf"] == [
        {"type": "string"},
        {"items": {"type": "string"}, "type": "array", "minItems": 1, "maxItems": 256},
    ]
    dims = [v for v in props["dimensions"]["anyOf"] if v.get("type") == "integer"]
    assert dims == [{"type": "integer", "minimum": 3, "maximum": 3}]
