"""gpulock.estimates.generation: the KV-cache formula on known models' numbers, its parts, the
two growth modes, bad input, and (on CPU, with a real tiny transformers model) the formula's KV
term against the cache's actual tensors after generating."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from gpulock.errors import InvalidArgument
from gpulock.estimates import SEGMENT, DecoderShape, GenerationPlan, Growth, bytes_per_element

MiB = 2**20

# Llama-2-7B's config.json: 32 layers, 32 heads (no GQA), hidden 4096, MLP 11008, vocab 32000
LLAMA2_7B = dict(
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    hidden_size=4096,
    intermediate_size=11008,
    vocab_size=32000,
    torch_dtype="float16",
)
# Llama-3-8B's: 32 layers, 32 query heads, 8 key/value heads (GQA), MLP 14336, vocab 128256
LLAMA3_8B = dict(
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    hidden_size=4096,
    intermediate_size=14336,
    vocab_size=128256,
    torch_dtype="bfloat16",
)


def test_llama2_7b_is_half_a_mib_per_token() -> None:
    s = DecoderShape.from_config(SimpleNamespace(**LLAMA2_7B))
    assert (s.layers, s.kv_heads, s.head_dim, s.bytes_per_element) == (32, 32, 128, 2)
    assert s.kv_bytes_per_token == 524288 == MiB // 2  # 2 · 32 · 32 · 128 · 2
    assert s.kv_bytes(4096, batch=2) == 4 * 2**30


def test_llama3_8b_gqa_is_128_kib_per_token() -> None:
    s = DecoderShape.from_config(SimpleNamespace(**LLAMA3_8B))
    assert (s.kv_heads, s.head_dim) == (8, 128)
    assert s.kv_bytes_per_token == 131072  # 2 · 32 · 8 · 128 · 2


def test_gpt2_style_names_and_defaults() -> None:
    """GPT-2's n_layer / n_head / n_embd, no num_key_value_heads (one per head), no head_dim
    (n_embd / n_head), n_inner None (4 × n_embd); fp32."""
    cfg = SimpleNamespace(n_layer=12, n_head=12, n_embd=768, n_inner=None, vocab_size=50257)
    s = DecoderShape.from_config(cfg, dtype="float32")
    assert (s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate) == (12, 12, 12, 64, 3072)
    assert s.kv_bytes_per_token == 2 * 12 * 12 * 64 * 4 == 73728


def test_explicit_head_dim_wins_and_dtype_overrides() -> None:
    """A config whose head_dim is not hidden / heads (Gemma-style) and a dtype argument that
    overrides the config's."""
    cfg = SimpleNamespace(**dict(LLAMA3_8B, head_dim=256))
    assert DecoderShape.from_config(cfg).head_dim == 256
    assert DecoderShape.from_config(cfg, dtype="float32").bytes_per_element == 4


def test_generation_bytes_formula_and_rounding() -> None:
    """kv + activation, rounded up to 2 MiB segments; the activation term term by term."""
    s = DecoderShape.from_config(SimpleNamespace(**LLAMA2_7B))
    P, G, B = 100, 28, 2
    kv = 524288 * (P + G) * B
    act = 4 * B * 32000 + 2 * B * P * (2 * 4096 + 3 * 11008) + 2 * 2 * B * 32 * max(P * P, P + G)
    assert s.activation_bytes(P, P + G, B) == act
    got = s.generation_bytes(P, G, B)
    assert got % SEGMENT == 0 and got - SEGMENT < kv + act <= got
    # a long generation from a short prompt: the decode step's 1 × T scores exceed P²
    assert s.activation_bytes(10, 1000) == 4 * 32000 + 2 * 10 * 41216 + 2 * 2 * 32 * 1000


def test_growth_modes() -> None:
    s = DecoderShape.from_config(SimpleNamespace(**LLAMA2_7B))
    grow = GenerationPlan(s, prompt_tokens=100, max_new_tokens=200, growth=Growth.grow(64, 50))
    assert [grow.chunk_end(g) for g in (0, 63, 64, 113, 114, 164, 200)] == [
        64,
        64,
        114,
        114,
        164,
        200,
        200,
    ]
    assert [g for g, _ in grow.schedule()] == [0, 64, 114, 164]
    assert grow.size_for(0) == s.generation_bytes(100, 64)
    assert grow.schedule()[-1][1] == grow.max_size == s.generation_bytes(100, 200)
    sizes = [grow.size_for(g) for g in range(201)]
    assert sizes == sorted(sizes)  # never shrinks as the stream goes on
    whole = GenerationPlan(s, prompt_tokens=100, max_new_tokens=200)
    assert whole.growth == Growth.reserve_max()
    assert whole.schedule() == [(0, whole.max_size)]
    assert {whole.size_for(g) for g in range(201)} == {whole.max_size}
    # a first chunk longer than the generation covers it all at once
    short = GenerationPlan(s, 100, 32, growth=Growth.grow(64, 64))
    assert short.schedule() == [(0, short.max_size)]


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: bytes_per_element("int4"), "'int4'"),
        (lambda: bytes_per_element(3), "got 3"),
        (lambda: bytes_per_element(True), "True"),
        (lambda: DecoderShape(32, 0, 128, 2, 4096, 32, 11008, 32000), "kv_heads"),
        (lambda: DecoderShape(32, 32, 128, 3, 4096, 32, 11008, 32000), "got 3"),
        (
            lambda: DecoderShape.from_config(SimpleNamespace(**dict(LLAMA2_7B, torch_dtype=None))),
            "dtype",
        ),
        (
            lambda: DecoderShape.from_config(
                SimpleNamespace(n_layer=2, n_head=3, n_embd=64, vocab_size=9), dtype=2
            ),
            "multiple",
        ),
        (
            lambda: DecoderShape.from_config(
                SimpleNamespace(n_head=4, n_embd=64, vocab_size=9), dtype=2
            ),
            "num_hidden_layers",
        ),
        (lambda: Growth("grow", 0, 64), "first"),
        (lambda: Growth("lazy"), "'lazy'"),
        (lambda: Growth.grow().covered(65, 64), "got 65"),
        (lambda: GenerationPlan(DecoderShape(1, 1, 1, 2, 1, 1, 1, 1), 0, 5), "prompt_tokens"),
        (lambda: DecoderShape(1, 1, 1, 2, 1, 1, 1, 1).activation_bytes(10, 9), "total_tokens"),
    ],
)
def test_bad_input_names_the_value(call, words: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        call()
    assert words in str(e.value)


def test_importing_it_loads_no_torch() -> None:
    code = (
        "import json, sys, gpulock.estimates\n"
        "print(json.dumps(sorted({k.split('.')[0] for k in sys.modules})))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    loaded = set(json.loads(r.stdout.splitlines()[-1]))
    assert not loaded & {"torch", "transformers", "numpy"}, loaded


@pytest.mark.parametrize("kv_heads", [4, 2])  # plain multi-head, and grouped-query attention
def test_kv_term_equals_a_real_models_cache(kv_heads: int) -> None:
    """A tiny random Llama on CPU generates T tokens greedily from a batch of prompts; the
    bytes of its returned cache's key and value tensors equal kv_bytes of the positions it
    holds (P + T − 1: the last token is not fed back), and generation_bytes counts P + T."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        intermediate_size=96,
        vocab_size=101,
        max_position_embeddings=256,
        dtype="float32",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    shape = DecoderShape.from_config(model.config)
    assert shape.kv_bytes_per_token == 2 * 3 * kv_heads * 16 * 4
    B, P, T = 2, 7, 11
    ids = torch.randint(3, 101, (B, P))
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=T,
            min_new_tokens=T,
            do_sample=False,
            return_dict_in_generate=True,
            use_cache=True,
        )
    assert out.sequences.shape == (B, P + T)
    tensors = [t for t in _cache_tensors(out.past_key_values)]
    assert len(tensors) == 2 * cfg.num_hidden_layers
    assert {tuple(t.shape) for t in tensors} == {(B, kv_heads, P + T - 1, 16)}
    actual = sum(t.nelement() * t.element_size() for t in tensors)
    assert actual == shape.kv_bytes(P + T - 1, batch=B)
    assert shape.generation_bytes(P, T, B) >= shape.kv_bytes(P + T, batch=B) > actual


def _cache_tensors(cache):
    """Every key and value tensor of a transformers cache (a Cache object of layers, or the
    legacy tuple of (key, value) per layer)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            yield layer.keys
            yield layer.values
        return
    for k, v in cache:
        yield k
        yield v
