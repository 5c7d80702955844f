"""The token loop: a causal LM's next tokens over its KV cache, greedy or sampled, ``chunk``
forward passes per ``next()``. Blocking, torch only (no HTTP, no lease): run each ``next()``
in the integration's executor, under the generation's lease.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SEED_MAX", "SEED_MIN", "Sampling", "token_chunks"]

#: the seeds ``torch.Generator.manual_seed`` takes (a negative one is read modulo 2**64)
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens. ``max_tokens``: most tokens generated; ``temperature`` 0: greedy
    (the most likely token), above 0: sampled from ``softmax(logits / temperature)`` cut to
    the ``top_p`` nucleus, with a ``torch.Generator`` seeded by ``seed`` (random when None;
    :data:`SEED_MIN` to :data:`SEED_MAX`); ``chunk``: forward passes per step."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    chunk: int = 4


def token_chunks(
    model: Any,
    prompt_ids: Sequence[int],
    sampling: Sampling,
    *,
    device: str = "cpu",
    eos_ids: Sequence[int] = (),
    suppress_ids: Sequence[int] = (),
    cache_arg: str = "past_key_values",
    keep_last_logits: bool = True,
) -> Iterator[list[int]]:
    """Lists of new token ids, at most ``sampling.chunk`` each, ``sampling.max_tokens`` in
    all; ends early after an ``eos_ids`` token (not returned). The first step runs the prompt
    (prefill), each later forward pass one token over the cache. ``suppress_ids`` are never
    picked. ``cache_arg``: the model's keyword for the cache (``cache`` in recent
    transformers, ``past_key_values`` before); ``keep_last_logits``: the model takes
    ``logits_to_keep=1`` (the prefill computes one row of logits, not one per prompt token).
    Each step runs under ``torch.inference_mode()`` on its own, so steps may run in different
    threads."""
    import torch

    if not prompt_ids:
        raise ValueError("a generation needs at least one prompt token")
    gen: Any = None
    if sampling.temperature > 0:
        gen = torch.Generator(device=device)
        gen.manual_seed(sampling.seed if sampling.seed is not None else random.getrandbits(63))
    eos = set(int(i) for i in eos_ids)
    suppress = torch.tensor(sorted(set(suppress_ids)), dtype=torch.long, device=device)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    cache: Any = None
    n = 0
    extra = {"logits_to_keep": 1} if keep_last_logits else {}
    while n < sampling.max_tokens:
        out_ids: list[int] = []
        with torch.inference_mode():
            for _ in range(min(sampling.chunk, sampling.max_tokens - n)):
                kw = {cache_arg: cache} if cache is not None else {}
                out = model(input_ids=ids, use_cache=True, **kw, **extra)
                cache = out[cache_arg] if cache_arg in out else out["past_key_values"]
                logits = out.logits[0, -1].float()
                if suppress.numel():
                    logits[suppress] = float("-inf")
                tok = _pick(torch, logits, sampling, gen)
                if tok in eos:
                    if out_ids:
                        yield out_ids
                    return
                out_ids.append(tok)
                n += 1
                ids = torch.tensor([[tok]], dtype=torch.long, device=device)
        yield out_ids


def _pick(torch: Any, logits: Any, sampling: Sampling, gen: Any) -> int:
    """The next token: the argmax at temperature 0, else a draw from the nucleus."""
    if sampling.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        p, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(p, dim=-1) - p > sampling.top_p  # keeps at least the first
        p[outside] = 0.0
        return int(order[torch.multinomial(p, 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))
