"""GPU-memory estimates for the demo's models: bytes one request needs beyond the weights."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BertEstimator", "KvCacheEstimator"]


@dataclass(frozen=True)
class BertEstimator:
    """Bytes of GPU memory one forward pass of a BERT-style encoder needs beyond its weights,
    for ``batch`` sequences padded to ``tokens``.

    Assumption: inference mode (``torch.inference_mode()``/``no_grad``) frees each layer's
    activations before the next layer runs, so the peak is one layer's live tensors, not the sum
    over layers. One layer keeps alive at its peak:

    * hidden states in and out, Q, K, V, attention context: ``6 * B*S*H`` elements
    * the feed-forward intermediate and its activation: ``2 * B*S*I`` elements
    * attention scores and softmax probabilities: ``2 * B*A*S*S`` elements

    ``peak = e * (B*S*(6H + 2I) + 2*B*A*S^2)`` with ``e`` bytes per element, and the estimate is
    ``max(floor, ceil(safety * peak))``. ``safety`` (2.0) covers the caching allocator's
    rounding (512 B blocks under 1 MiB, 2 MiB segments above) and the tokenizer's padding;
    ``floor`` (2 MiB) is the allocator's smallest segment for large tensors. The constants of
    all-MiniLM-L6-v2 (H=384, I=1536, A=12 heads, 6 layers, fp32) come from its ``config.json``.
    On CUDA, :meth:`gpulock.fastapi.GpuLimiter.calibrate` replaces the formula by measured
    peaks.
    """

    hidden: int = 384
    intermediate: int = 1536
    heads: int = 12
    layers: int = 6
    bytes_per_element: int = 4
    safety: float = 2.0
    floor: int = 2 * 2**20

    def peak(self, batch: int, tokens: int) -> int:
        """Bytes live at one layer's peak for ``batch`` × ``tokens`` (the formula above)."""
        b, s = max(1, int(batch)), max(1, int(tokens))
        elems = b * s * (6 * self.hidden + 2 * self.intermediate) + 2 * b * self.heads * s * s
        return elems * self.bytes_per_element

    def __call__(self, batch: int, tokens: int) -> int:
        return max(self.floor, math.ceil(self.safety * self.peak(batch, tokens)))


@dataclass(frozen=True)
class KvCacheEstimator:
    """Bytes of GPU memory one generation of a decoder-only transformer needs beyond its
    weights: its KV cache at its longest, plus the activations of its largest forward pass.

    ``tokens = prompt_tokens + max_new_tokens`` (the cache's length at the end)::

        kv          = 2 (K and V) * layers * kv_heads * head_dim * e * tokens
        activations = e * (P * (4 * hidden + 2 * intermediate) + heads * P * tokens + vocab)
        estimate    = max(floor, kv + activations)

    with ``e`` bytes per element and ``P`` the prompt's tokens (the prefill is the largest
    forward pass: its hidden states, Q/K/V and MLP intermediate of one layer at a time under
    ``inference_mode``, its attention scores, and one row of logits: the prefill keeps only the
    last position's). ``floor`` (2 MiB) is the CUDA caching allocator's smallest segment for
    large tensors. The one place the service sizes a generation's lease: the shared KV-cache
    estimator replaces it when it lands."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    bytes_per_element: int = 4
    floor: int = 2 * 2**20

    def kv_bytes(self, tokens: int) -> int:
        """The KV cache of ``tokens`` positions, in bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_element * tokens

    def __call__(self, prompt_tokens: int, max_new_tokens: int) -> int:
        p = max(1, int(prompt_tokens))
        tokens = p + max(0, int(max_new_tokens))
        act = p * (4 * self.hidden + 2 * self.intermediate) + self.heads * p * tokens + self.vocab
        return max(self.floor, self.kv_bytes(tokens) + act * self.bytes_per_element)
