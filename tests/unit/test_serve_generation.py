"""What ``gpulock serve`` checks of ``--generation-model`` before it starts anything, and what
its banner says of generation: a folder needs a ``config.json`` and a tokenizer (a folder saved
without one made transformers build an empty tokenizer, and every chat a 500); a worker that
still finds its tokenizer empty refuses to load it; the banner names the lease's growth mode."""

from __future__ import annotations

import json

import pytest
from gpulock_service.generation.causal_lm import CausalLM, tokenizer_problem
from gpulock_service.serve import _generation_words, check_generation_model


def _config_only(folder) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 100}))


def test_a_folder_without_a_tokenizer_is_refused_naming_it(tmp_path):
    folder = tmp_path / "no-tokenizer"
    _config_only(folder)
    problem = check_generation_model(str(folder))
    assert problem is not None and str(folder) in problem, problem
    assert "has no tokenizer" in problem and "tokenizer.json" in problem, problem
    (folder / "tokenizer.json").write_text("")  # empty: still none
    assert "has no tokenizer" in (check_generation_model(str(folder)) or "")
    (folder / "vocab.txt").write_text("[PAD]\nhello\n")
    assert check_generation_model(str(folder)) is None
    assert tokenizer_problem(folder) is None
    # no config.json: the message it always gave
    missing = check_generation_model(str(tmp_path / "nope")) or ""
    assert "--generation-model must be" in missing and "nope" in missing


def test_a_worker_refuses_a_folder_without_a_tokenizer_before_loading_anything(tmp_path):
    folder = tmp_path / "no-tokenizer"
    _config_only(folder)
    with pytest.raises(ValueError, match="has no tokenizer"):
        CausalLM(str(folder)).load("cpu")


def test_a_worker_refuses_an_empty_tokenizer(tmp_path):
    """A vocabulary file that holds no vocabulary: transformers builds a tokenizer of one
    token that makes no tokens of any text."""
    pytest.importorskip("transformers")
    folder = tmp_path / "empty-vocab"
    _config_only(folder)
    (folder / "vocab.json").write_text("{}")
    (folder / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match="is empty") as e:
        CausalLM(str(folder)).load("cpu")
    assert str(folder) in str(e.value)


def test_the_banner_names_the_growth_mode():
    reserve = _generation_words("minilm", "auto")
    assert "gpulock-tiny-llama" in reserve and "GPULOCK_GENERATION_GROWTH=reserve_max" in reserve
    grow = _generation_words("sleep", "/models/m", "grow", 32)
    assert "generation: /models/m" in grow and "GPULOCK_GENERATION_GROWTH=grow" in grow
    assert "32 tokens at a time" in grow
    assert _generation_words("sleep", "auto", "grow", 32) == ""  # no generation: no words
