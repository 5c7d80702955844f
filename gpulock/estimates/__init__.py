"""Byte estimates for GPU work, without I/O and without importing torch: what to lease.

:mod:`gpulock.estimates.generation`: a decoder's KV cache and a generation's bytes, with the
two ways a generation's lease can follow it (all up front, or grown chunk by chunk).
:mod:`gpulock.estimates.wait`: how long a queued request will wait, from the pool's drain rate
and the bytes ahead of it."""

from gpulock.estimates.generation import (
    SEGMENT,
    DecoderShape,
    GenerationPlan,
    Growth,
    bytes_per_element,
)
from gpulock.estimates.wait import DrainRate, wait_seconds, wait_seconds_at_tail

__all__ = [
    "SEGMENT",
    "DecoderShape",
    "DrainRate",
    "GenerationPlan",
    "Growth",
    "bytes_per_element",
    "wait_seconds",
    "wait_seconds_at_tail",
]
