"""GPU-memory estimates for the demo's embedding model: bytes one request needs beyond the
weights (a generation's: :mod:`gpulock.estimates`, shared with library users)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BertEstimator"]


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
