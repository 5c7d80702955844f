"""The service's own Prometheus series, beside gpulock.fastapi's (created on first
use, in the worker, so prometheus-client's multiprocess mode sums them over workers):

* ``gpulock_embedding_input_tokens``: histogram of tokens per request (all its inputs, after
  truncation to ``GPULOCK_MAX_TOKENS``; text counted by the model's tokenizer, token ids as
  their ids): what ``usage.prompt_tokens`` answers; its ``_sum`` is the tokens served;
* ``gpulock_embedding_inputs``: histogram of inputs per request (the batch a client sends);
* ``gpulock_generations_total{finish_reason}``: generations ended, by how: ``stop`` (a stop
  sequence or the model's end token), ``length`` (``max_tokens``), ``cancelled`` (the client
  hung up mid-stream), ``error`` (an error event ended the stream);
* ``gpulock_generated_tokens_total``: tokens of the generations answered (what
  ``usage.completion_tokens`` answers, summed; a cancelled stream's: those sent before the
  hang-up);
* ``gpulock_generation_growths_total{outcome}``: growths of a generation's lease
  (``GPULOCK_GENERATION_GROWTH=grow``), by outcome: ``granted``, ``resize_refused`` (the
  deadlock rule refused it: the generation ended), ``growth_timeout`` (not granted within
  ``GPULOCK_ACQUIRE_TIMEOUT``: the generation ended).
"""

from __future__ import annotations

from typing import Any

_TOKEN_BUCKETS = tuple(float(4**k) for k in range(0, 9))  # 1 .. 65536
_INPUT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

_made: dict[str, Any] = {}


def observe_request(inputs: int, tokens: int) -> None:
    """Record one request of ``inputs`` inputs and ``tokens`` tokens."""
    if "tokens" not in _made:
        from prometheus_client import Histogram

        _made["tokens"] = Histogram(
            "gpulock_embedding_input_tokens",
            "Input tokens per embeddings request (after truncation)",
            buckets=_TOKEN_BUCKETS,
        )
        _made["inputs"] = Histogram(
            "gpulock_embedding_inputs",
            "Inputs per embeddings request",
            buckets=_INPUT_BUCKETS,
        )
    _made["tokens"].observe(tokens)
    _made["inputs"].observe(inputs)


def observe_generation(finish_reason: str, tokens: int) -> None:
    """Record one generation that ended for ``finish_reason`` after ``tokens`` tokens."""
    if "generations" not in _made:
        from prometheus_client import Counter

        _made["generations"] = Counter(
            "gpulock_generations",
            "Generations ended, by finish reason (stop, length, cancelled, error)",
            ["finish_reason"],
        )
        _made["generated"] = Counter("gpulock_generated_tokens", "Tokens generated")
    _made["generations"].labels(finish_reason).inc()
    _made["generated"].inc(tokens)


def observe_growth(outcome: str) -> None:
    """Record one growth of a generation's lease that ended with ``outcome`` (``granted``,
    ``resize_refused``, ``growth_timeout``)."""
    if "growths" not in _made:
        from prometheus_client import Counter

        _made["growths"] = Counter(
            "gpulock_generation_growths",
            "Growths of a generation's lease, by outcome (granted, resize_refused, growth_timeout)",
            ["outcome"],
        )
    _made["growths"].labels(outcome).inc()
