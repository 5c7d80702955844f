"""A local Hugging Face causal-LM folder, served for generation: :class:`CausalLM`.

The folder is what ``save_pretrained`` writes (``config.json``, the weights, the tokenizer);
the model loads through ``AutoModelForCausalLM.from_pretrained`` and the tokenizer through
``AutoTokenizer.from_pretrained``, offline. ``tiny`` names the service's default model
(:mod:`.tiny`, random weights: meaningless text), built on first use.

Importing this module imports neither torch nor transformers: :meth:`CausalLM.load` does, in
the worker, in a thread.
"""

from __future__ import annotations

import glob
import inspect
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gpulock.estimates import DecoderShape

from .decode import Sampling, token_chunks
from .text import Piece, pieces
from .tiny import CHAT_TEMPLATE, TINY_DESCRIPTION, TINY_NAME, tiny_model_dir

__all__ = ["CausalLM", "TINY", "TOKENIZER_FILES", "tokenizer_problem"]

#: the setting's value that names the default model
TINY = "tiny"

#: the files that hold a tokenizer's vocabulary, one of which ``save_pretrained`` writes for
#: each kind of tokenizer transformers has: a fast tokenizer's ``tokenizer.json``, a
#: SentencePiece model, a BPE or WordPiece vocabulary, a tiktoken file
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece*.model",
    "vocab.json",
    "vocab.txt",
    "*.tiktoken",
)


def tokenizer_problem(folder: str | Path) -> str | None:
    """Why ``folder`` holds no tokenizer, or None: none of :data:`TOKENIZER_FILES` is there
    with content (a model folder saved without its tokenizer, from which transformers
    builds an empty one, of one token, that makes no tokens of any text). Reads only the
    folder's listing and the files' sizes."""
    for pattern in TOKENIZER_FILES:
        for f in glob.glob(os.path.join(glob.escape(str(folder)), pattern)):
            if os.path.isfile(f) and os.path.getsize(f) > 0:
                return None
    return (
        f"{str(folder)!r} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} with content "
        f"(save the model's tokenizer into it: tokenizer.save_pretrained(PATH))"
    )


class CausalLM:
    """One causal LM, loaded once per worker. ``spec``: :data:`TINY` or a folder's path;
    ``name``: the id it is served as (default: ``gpulock-tiny-llama``, or the folder's name).

    Attributes (after :meth:`load`): ``context`` (most tokens, prompt and completion, the
    model takes: its ``max_position_embeddings``), ``shape`` (what its generations' bytes
    depend on, :class:`gpulock.estimates.DecoderShape` from the loaded model's config and its
    weights' dtype), ``device``."""

    def __init__(self, spec: str, name: str | None = None):
        self.spec = spec.strip()
        self.tiny = self.spec == TINY
        self.name = name or (
            TINY_NAME if self.tiny else Path(self.spec).expanduser().resolve().name
        )
        self.description = (
            TINY_DESCRIPTION if self.tiny else f"a local Hugging Face causal LM ({self.spec})"
        )
        self.device = "cpu"
        self.path: Path | None = None
        self.context = 0
        self.shape: DecoderShape | None = None
        self._model: Any = None
        self._tok: Any = None
        self._eos: list[int] = []
        self._suppress: list[int] = []
        self._cache_arg = "past_key_values"
        self._keep_last = False

    # ---- loading (in a thread) -------------------------------------------------------------
    def folder(self) -> Path:
        """The model's folder (the tiny model's is built first if missing)."""
        if self.path is None:
            self.path = tiny_model_dir() if self.tiny else Path(self.spec).expanduser().resolve()
        return self.path

    def resident_hint(self) -> int:
        """The weights' size in bytes (the files ``*.safetensors`` / ``*.bin``)."""
        files = glob.glob(str(self.folder() / "*.safetensors")) or glob.glob(
            str(self.folder() / "*.bin")
        )
        return sum(os.path.getsize(f) for f in files)

    def load(self, device: str) -> None:
        """Load the tokenizer and the weights onto ``device`` (``cpu``, ``cuda:N``). Raises
        ValueError for a folder without a tokenizer (:func:`tokenizer_problem`), or whose
        tokenizer is empty (one token or none)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        path = str(self.folder())
        problem = tokenizer_problem(path)
        if problem:
            raise ValueError(f"the generative model's folder {problem}")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        if len(tok) <= 1:
            raise ValueError(
                f"the tokenizer of the generative model's folder {path!r} is empty (a "
                f"vocabulary of {len(tok)}): it makes no tokens of any text; save the model's "
                f"tokenizer into it (tokenizer.save_pretrained(PATH))"
            )
        if getattr(tok, "chat_template", None) is None:
            tok.chat_template = CHAT_TEMPLATE
        model: Any = AutoModelForCausalLM.from_pretrained(path)
        model = model.to(device).eval()
        cfg = model.config
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_last = "logits_to_keep" in params
        gc = getattr(model, "generation_config", None)
        eos = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        self._eos = [eos] if isinstance(eos, int) else list(eos or [])
        self._suppress = list(getattr(gc, "suppress_tokens", None) or [])
        # the shared estimate (gpulock.estimates), sized in the dtype the weights were loaded in
        self.shape = DecoderShape.from_config(cfg, dtype=next(model.parameters()).dtype)
        self.context = int(getattr(cfg, "max_position_embeddings", 0) or 2048)
        self.device = device
        self._tok = tok
        self._model = model

    # ---- prompts (no model needed; tokenizer loaded) ---------------------------------------
    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat prompt: ``messages`` (``role``, ``content``) rendered by the tokenizer's
        chat template (or a plain ``role: content`` per line when it has none), tokenized."""
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def text_ids(self, text: str) -> list[int]:
        """A completion prompt, tokenized as the tokenizer does by default."""
        return list(self._tok(text)["input_ids"])

    @property
    def vocab_size(self) -> int:
        return int(len(self._tok))

    def decode(self, ids: Sequence[int]) -> str:
        return str(
            self._tok.decode(
                list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
        )

    # ---- the pure step ---------------------------------------------------------------------
    def generate(
        self, prompt_ids: Sequence[int], sampling: Sampling, stops: Sequence[str] = ()
    ) -> Iterator[Piece]:
        """The generation of ``prompt_ids``: text pieces, each ``next()`` running up to
        ``sampling.chunk`` forward passes (blocking), the last piece with its finish reason."""
        assert self._model is not None, "model not loaded"
        chunks = token_chunks(
            self._model,
            prompt_ids,
            sampling,
            device=self.device,
            eos_ids=self._eos,
            suppress_ids=self._suppress,
            cache_arg=self._cache_arg,
            keep_last_logits=self._keep_last,
        )
        return pieces(
            chunks, self.decode, max_tokens=sampling.max_tokens, stops=stops, context=prompt_ids
        )
