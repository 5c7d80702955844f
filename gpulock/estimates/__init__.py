"""Byte estimates for GPU work, without I/O and without importing torch: what to lease.

:mod:`gpulock.estimates.generation`: a decoder's KV cache and a generation's bytes, with the
two ways a generation's lease can follow it (all up front, or grown chunk by chunk)."""

from gpulock.estimates.generation import (
    SEGMENT,
    DecoderShape,
    GenerationPlan,
    Growth,
    bytes_per_element,
)

__all__ = ["SEGMENT", "DecoderShape", "GenerationPlan", "Growth", "bytes_per_element"]
