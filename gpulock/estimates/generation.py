"""What a decoder's generation needs of GPU memory beyond its weights: its KV cache and the
largest activations of one step, in bytes, and how a lease can follow it as it grows.

No I/O, and torch is never imported: a shape comes from plain numbers or from any object with
a Hugging Face config's attributes (``transformers.PretrainedConfig``, read by
:meth:`DecoderShape.from_config`). docs/SERVICE.md, "Sizing a generation", gives the formula,
its sources and the trade-off between the two growth modes.

The formula, with ``L`` layers, ``Hkv`` key/value heads of ``D`` elements each, ``e`` bytes per
element, ``B`` sequences in the batch, ``P`` prompt tokens, ``T`` tokens in all (prompt and
generated), ``H`` the hidden size, ``I`` the MLP's intermediate size, ``A`` attention heads and
``V`` the vocabulary::

    kv per token  = 2 · L · Hkv · D · e                     (K and V of every layer)
    kv            = kv per token · T · B
    activation    = 4 · B · V                               (fp32 logits, last position)
                  + e · B · P · (2H + 3I)                   (prefill: residual, normed input,
                                                             gate, up and their product)
                  + 2 · e · B · A · max(P², T)              (attention scores and softmax:
                                                             P × P in the prefill, 1 × T a step)
    generation    = ceil((kv + activation) / 2 MiB) · 2 MiB (the allocator's segments)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gpulock.errors import InvalidArgument

__all__ = ["SEGMENT", "DecoderShape", "GenerationPlan", "Growth", "bytes_per_element"]

SEGMENT = 2 * 2**20
"""Bytes: the CUDA caching allocator's segment for large blocks; estimates round up to it."""

_DTYPE_BYTES = {
    "float64": 8,
    "double": 8,
    "fp64": 8,
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "fp8": 1,
    "int8": 1,
    "uint8": 1,
}


def bytes_per_element(dtype: Any) -> int:
    """Bytes of one element of ``dtype``: a ``torch.dtype`` (read by its name, torch is not
    imported), a name such as ``"float16"``, ``"torch.bfloat16"`` or ``"fp8"``, or an int
    1, 2, 4 or 8 (bytes).

    Raises:
        InvalidArgument: an unknown name or a size other than 1, 2, 4, 8.
    """
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype in (1, 2, 4, 8):
            return dtype
        raise InvalidArgument(f"dtype: bytes per element must be 1, 2, 4 or 8; got {dtype!r}")
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name in _DTYPE_BYTES:
        return _DTYPE_BYTES[name]
    raise InvalidArgument(
        f"dtype: not a floating-point dtype this estimate knows ({', '.join(sorted(_DTYPE_BYTES))}"
        f", or bytes 1/2/4/8); got {dtype!r}"
    )


def _count(name: str, value: Any, *, minimum: int = 1) -> int:
    """``value`` as an int ≥ ``minimum``; raises InvalidArgument naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"{name} must be an integer >= {minimum}; got {value!r}")
    return value


def _field(config: Any, *names: str) -> Any:
    """The first of ``names`` that ``config`` has with a value other than None, else None."""
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return None


def _config_dtype(config: Any) -> Any:
    """A config's dtype: ``dtype`` (transformers 5) or ``torch_dtype`` (4.x), read from the
    object's own attributes first so that transformers 5's deprecated alias is not touched."""
    own = getattr(config, "__dict__", {})
    for n in ("dtype", "torch_dtype"):
        if own.get(n) is not None:
            return own[n]
    return _field(config, "dtype", "torch_dtype")


@dataclass(frozen=True)
class DecoderShape:
    """The numbers of a decoder-only transformer that its generation's bytes depend on.

    Attributes: ``layers`` (L), ``kv_heads`` (Hkv: key/value heads, fewer than ``heads``
    under grouped-query attention), ``head_dim`` (D, elements), ``bytes_per_element`` (e: 2
    for fp16/bf16), ``hidden`` (H), ``heads`` (A: query heads), ``intermediate`` (I: the MLP's
    width), ``vocab`` (V). All positive ints.

    Raises (on construction):
        InvalidArgument: a value that is not a positive int, naming it.
    """

    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_element: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int

    def __post_init__(self) -> None:
        for name in (
            "layers",
            "kv_heads",
            "head_dim",
            "bytes_per_element",
            "hidden",
            "heads",
            "intermediate",
            "vocab",
        ):
            _count(name, getattr(self, name))
        bytes_per_element(self.bytes_per_element)  # 1, 2, 4 or 8

    @classmethod
    def from_config(cls, config: Any, *, dtype: Any = None) -> DecoderShape:
        """The shape of a Hugging Face config (``transformers.PretrainedConfig`` or any object
        with its attributes; a multimodal config's ``get_text_config()`` is read).

        Fields read: ``num_hidden_layers`` (GPT-2: ``n_layer``), ``num_attention_heads``
        (``n_head``), ``num_key_value_heads`` (absent: as many as the attention heads),
        ``hidden_size`` (``n_embd``), ``head_dim`` (absent or None: hidden / heads),
        ``intermediate_size`` (``n_inner``; None: 4 × hidden, GPT-2's), ``vocab_size``, and
        ``dtype`` / ``torch_dtype`` unless ``dtype`` is given (it overrides the config's, e.g.
        ``torch.float16`` when the model is loaded in fp16).

        Raises:
            InvalidArgument: a field missing or not a positive int, or no dtype known.
        """
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers = _field(text, "num_hidden_layers", "n_layer")
        heads = _field(text, "num_attention_heads", "n_head")
        hidden = _field(text, "hidden_size", "n_embd")
        for name, v in (("num_hidden_layers", layers), ("num_attention_heads", heads)):
            _count(f"config.{name}", v)
        _count("config.hidden_size", hidden)
        kv_heads = _field(text, "num_key_value_heads")
        kv_heads = heads if kv_heads is None else kv_heads
        head_dim = _field(text, "head_dim")
        if head_dim is None:
            if hidden % heads:
                raise InvalidArgument(
                    f"config: hidden_size {hidden} is not a multiple of num_attention_heads "
                    f"{heads} and head_dim is not set"
                )
            head_dim = hidden // heads
        intermediate = _field(text, "intermediate_size", "n_inner")
        intermediate = 4 * hidden if intermediate is None else intermediate
        vocab = _field(text, "vocab_size")
        if dtype is None:
            dtype = _config_dtype(text)
            if dtype is None:
                dtype = _config_dtype(config)
        if dtype is None:
            raise InvalidArgument(
                "config: no dtype (config.dtype / torch_dtype is None); pass dtype=, "
                "e.g. dtype='float16'"
            )
        return cls(
            layers=_count("config.num_hidden_layers", layers),
            kv_heads=_count("config.num_key_value_heads", kv_heads),
            head_dim=_count("config.head_dim", head_dim),
            bytes_per_element=bytes_per_element(dtype),
            hidden=hidden,
            heads=heads,
            intermediate=_count("config.intermediate_size", intermediate),
            vocab=_count("config.vocab_size", vocab),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token of one sequence takes: 2 · L · Hkv · D · e."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_element

    def kv_bytes(self, tokens: int, batch: int = 1) -> int:
        """Bytes of KV cache for ``batch`` sequences of ``tokens`` cached positions each.

        After generating G new tokens from a prompt of P, Hugging Face's cache holds P + G − 1
        positions (the last token is not fed back); :meth:`generation_bytes` counts P + G.

        Raises:
            InvalidArgument: ``tokens`` < 0 or ``batch`` < 1.
        """
        return (
            self.kv_bytes_per_token * _count("tokens", tokens, minimum=0) * _count("batch", batch)
        )

    def activation_bytes(self, prompt_tokens: int, total_tokens: int, batch: int = 1) -> int:
        """Bytes of the largest live activations of one forward pass of the generation, the
        KV cache not included: 4·B·V + e·B·P·(2H + 3I) + 2·e·B·A·max(P², T) for a prompt of
        ``prompt_tokens`` (P) growing to ``total_tokens`` (T) cached positions.

        An upper bound: the attention and MLP peaks are added though they come one after the
        other, and fused attention (SDPA, FlashAttention) never holds the scores.

        Raises:
            InvalidArgument: ``prompt_tokens`` < 1, ``total_tokens`` < ``prompt_tokens`` or
                ``batch`` < 1.
        """
        p = _count("prompt_tokens", prompt_tokens)
        t = _count("total_tokens", total_tokens, minimum=p)
        b = _count("batch", batch)
        e = self.bytes_per_element
        logits = 4 * b * self.vocab
        mlp = e * b * p * (2 * self.hidden + 3 * self.intermediate)
        scores = 2 * e * b * self.heads * max(p * p, t)
        return logits + mlp + scores

    def generation_bytes(self, prompt_tokens: int, new_tokens: int, batch: int = 1) -> int:
        """Bytes to lease for generating ``new_tokens`` after a prompt of ``prompt_tokens``,
        ``batch`` sequences: KV cache of P + G tokens plus :meth:`activation_bytes`, rounded up
        to :data:`SEGMENT` (2 MiB).

        Raises:
            InvalidArgument: ``prompt_tokens`` < 1, ``new_tokens`` < 0 or ``batch`` < 1.
        """
        p = _count("prompt_tokens", prompt_tokens)
        total = p + _count("new_tokens", new_tokens, minimum=0)
        raw = self.kv_bytes(total, batch) + self.activation_bytes(p, total, batch)
        return -(-raw // SEGMENT) * SEGMENT


@dataclass(frozen=True)
class Growth:
    """How a generation's lease follows its KV cache.

    * ``reserve_max`` (:meth:`reserve_max`): the first lease covers all ``max_new_tokens``;
      never resized. A stream never waits once admitted, but its lease holds bytes its cache
      reaches only at the end (or never, when it stops early).
    * ``grow`` (:meth:`grow`): the first lease covers ``first`` new tokens; then before each
      chunk of ``step`` tokens the lease grows to cover it. Leases hold about what caches use,
      so more streams fit; a growth may wait, or be refused, mid-stream.

    Raises (on construction):
        InvalidArgument: an unknown mode, or for ``grow`` a ``first`` or ``step`` < 1.
    """

    mode: Literal["reserve_max", "grow"] = "reserve_max"
    first: int = 0  # grow: new tokens the first lease covers (C)
    step: int = 0  # grow: new tokens each growth adds (N)

    def __post_init__(self) -> None:
        if self.mode == "grow":
            _count("first", self.first)
            _count("step", self.step)
        elif self.mode != "reserve_max":
            raise InvalidArgument(f"mode must be 'reserve_max' or 'grow'; got {self.mode!r}")

    @classmethod
    def reserve_max(cls) -> Growth:
        """Lease prompt + max_new_tokens up front."""
        return cls("reserve_max")

    @classmethod
    def grow(cls, first: int = 64, step: int = 64) -> Growth:
        """Lease prompt + ``first`` new tokens, then grow by ``step`` tokens at a time."""
        return cls("grow", first, step)

    def covered(self, generated: int, max_new_tokens: int) -> int:
        """New tokens the lease must cover to go on from ``generated`` tokens generated (0 at
        the start), at most ``max_new_tokens``: the end of the chunk that ``generated`` is in.
        Grow: chunk ends C, C + N, C + 2N, ...; reserve_max: ``max_new_tokens``.

        Raises:
            InvalidArgument: ``generated`` outside [0, ``max_new_tokens``].
        """
        m = _count("max_new_tokens", max_new_tokens, minimum=0)
        g = _count("generated", generated, minimum=0)
        if g > m:
            raise InvalidArgument(f"generated must be <= max_new_tokens {m}; got {g}")
        if self.mode == "reserve_max":
            return m
        if g < self.first:
            return min(m, self.first)
        return min(m, self.first + ((g - self.first) // self.step + 1) * self.step)


@dataclass(frozen=True)
class GenerationPlan:
    """The lease sizes of one generation: ``batch`` sequences of ``prompt_tokens`` generating
    up to ``max_new_tokens`` on ``shape``, the lease following ``growth``.

    Use: acquire :meth:`size_for` (0); before generating from ``g`` tokens, grow the lease to
    :meth:`size_for` (g) when that is more than it holds, and generate up to
    :meth:`chunk_end` (g)::

        plan = GenerationPlan(shape, prompt_tokens=n, max_new_tokens=512, growth=Growth.grow())
        lease = pool.acquire(plan.size_for(0))
        g = 0
        while g < plan.max_new_tokens:
            if plan.size_for(g) > lease.amount:
                lease.resize(plan.size_for(g))
            end = plan.chunk_end(g)
            ...  # generate tokens g+1 .. end (stop at EOS: break)
            g = end

    Raises (on construction):
        InvalidArgument: ``prompt_tokens`` or ``batch`` < 1, ``max_new_tokens`` < 0.
    """

    shape: DecoderShape
    prompt_tokens: int
    max_new_tokens: int
    batch: int = 1
    growth: Growth = field(default_factory=Growth.reserve_max)

    def __post_init__(self) -> None:
        _count("prompt_tokens", self.prompt_tokens)
        _count("max_new_tokens", self.max_new_tokens, minimum=0)
        _count("batch", self.batch)

    def chunk_end(self, generated: int) -> int:
        """New tokens generated at the end of the chunk ``generated`` is in (see
        :meth:`Growth.covered`)."""
        return self.growth.covered(generated, self.max_new_tokens)

    def size_for(self, generated: int) -> int:
        """Bytes the lease must hold to generate on from ``generated`` tokens to
        :meth:`chunk_end` (``generated``): :meth:`DecoderShape.generation_bytes` of that many
        new tokens. Never less than for a smaller ``generated``."""
        return self.shape.generation_bytes(
            self.prompt_tokens, self.chunk_end(generated), self.batch
        )

    @property
    def max_size(self) -> int:
        """Bytes of the whole generation, all ``max_new_tokens``: what reserve_max leases."""
        return self.shape.generation_bytes(self.prompt_tokens, self.max_new_tokens, self.batch)

    def schedule(self) -> list[tuple[int, int]]:
        """Every (generated, bytes) at which the lease must (re)size: (0, first size), then
        one entry per chunk whose size is larger than the last."""
        out = [(0, self.size_for(0))]
        g = self.chunk_end(0)
        while g < self.max_new_tokens:
            size = self.size_for(g)
            if size > out[-1][1]:
                out.append((g, size))
            g = self.chunk_end(g)
        return out
