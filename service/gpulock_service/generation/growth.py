"""A generation's steps under a lease that follows its KV cache: what to lease first
(:func:`step_bytes` of 0), and before each step whether the lease must grow, by the sizes of a
:class:`gpulock.estimates.GenerationPlan` (reserve_max: all of ``max_tokens`` up front, so it
never grows; grow: by chunks of tokens). No I/O and no lease: the caller passes what the lease
holds and how to grow it (:func:`leased_steps`).

A step (one ``next()`` of the model's pieces) makes up to ``chunk`` new tokens
(``GPULOCK_GENERATION_CHUNK_TOKENS``), so before the step that starts at ``g`` tokens generated
the lease must cover the step's last token: ``size_for(min(g + chunk, max_tokens) - 1)``. A
growth chunk need not be a multiple of the step: a step that crosses a chunk's end grows the
lease to the chunk after it first.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator

from gpulock.estimates import GenerationPlan

from .text import Piece

__all__ = ["leased_steps", "step_bytes"]


def step_bytes(sizes: GenerationPlan, generated: int, chunk: int) -> int:
    """Bytes the lease must hold to run the step that starts at ``generated`` tokens generated
    (0: the first, with the prefill) and makes up to ``chunk`` tokens. Raises InvalidArgument
    (from ``sizes``) for ``generated`` outside [0, ``max_new_tokens``]."""
    last = max(generated, min(generated + chunk, sizes.max_new_tokens) - 1)
    return sizes.size_for(last)


def leased_steps(
    steps: Iterator[Piece],
    sizes: GenerationPlan,
    chunk: int,
    *,
    held: Callable[[], int],
    grow: Callable[[int], None],
    check: Callable[[], None],
) -> Generator[Piece, None, None]:
    """The pieces of ``steps`` (each ``next()`` up to ``chunk`` new tokens, the last piece the
    finish), each step run after ``check()`` (it raises to end the generation: the lease lost,
    the client gone) and, when the step needs more bytes (:func:`step_bytes`) than ``held()``,
    after ``grow(bytes)`` (it raises to end the generation: a growth refused or timed out).
    ``steps`` is closed when this ends, however it ends (no more forward passes)."""
    generated = 0
    try:
        while True:
            check()
            if generated < sizes.max_new_tokens:
                need = step_bytes(sizes, generated, chunk)
                if need > held():
                    grow(need)
            try:
                piece = next(steps)
            except StopIteration:
                return
            generated += piece.tokens
            yield piece
    finally:
        close = getattr(steps, "close", None)
        if close is not None:
            close()
