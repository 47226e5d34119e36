"""The numpy reference decoder against an independent float64 forward pass written here.

The float64 model below shares no code with runtime/reference.py: separate q/k/v matrices,
explicit loops over heads and experts, float64 throughout. With an fp32 KV cache the reference
must agree to fp32 accuracy; with bf16 / int8 caches to the bound the cache rounding allows.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from onegraph import reference
from onegraph.config import ModelConfig
from onegraph.quant import QuantizedMatrix
from onegraph.reference import (
    ReferenceDecoder, attention_decode, kv_dequantize_int8, kv_quantize_int8, moe_topk,
    rmsnorm, rope, rope_inv_freq,
)

# fp32 arithmetic (eps 6e-8) through a few layers: errors of 1e-7..1e-6 relative are expected;
# 1e-5 leaves room for accumulation order without hiding a real bug (which shows as >= 1e-3).
FP32_REL_L2 = 1e-5
# A bf16 KV cache rounds each K/V element to 8 significant bits (relative error <= 2^-9, RMS
# about 2^-9/sqrt(3) = 0.11%); through attention and a few layers the logits move by a few 1e-3
# (measured at most 6.8e-3 over 8 weight seeds of each test model).
BF16_KV_REL_L2 = 1.5e-2
# An int8 KV cache has absolute error <= scale/2 = max|row|/254 per element: RMS about 0.5% of
# a Gaussian row of 16..24 values; the logits move ~1e-2 (measured at most 2.3e-2, same runs).
INT8_KV_REL_L2 = 4e-2
# ROUTING: cache noise also perturbs MoE router logits: where two experts are close at the top-k
# boundary it may legitimately swap them, a discrete change that no continuous bound covers and that
# stays in the cache for every later token. MoE models are held to the bounds above while their
# routing equals the float64 run's; full MoE runs are checked against a float64 model that
# rounds its cache the same way (next bound).
# Against a float64 model that rounds K/V exactly like the cache: only fp32 arithmetic differs,
# plus the rare element whose fp32 and float64 values round to neighbouring bf16 / int8 codes
# (one code step in one element moved the logits by 8e-6 here; without one, errors are < 1e-6).
SAME_ROUNDING_REL_L2 = 1e-4
STEPS = 16          # tokens per end-to-end run: a PROMPT_LEN prompt, then greedy tokens
PROMPT_LEN = 4


# ---- tiny random models -----------------------------------------------------------------

def tiny_config(kind: str, **overrides) -> ModelConfig:
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                max_position_embeddings=512, eos_token_id=3)
    if kind == "qwen3":      # head_dim * heads (96) != hidden (64), tied embeddings
        base.update(architectures=["Qwen3ForCausalLM"], head_dim=24, tie_word_embeddings=True,
                    rope_theta=1_000_000.0)
    elif kind == "llama":    # no QK-norm, untied lm_head, linear rope scaling
        base.update(architectures=["LlamaForCausalLM"], head_dim=16, tie_word_embeddings=False,
                    rope_theta=10_000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    elif kind == "qwen3_moe":  # layer 0 dense via mlp_only_layers, layers 1-2 MoE
        base.update(architectures=["Qwen3MoeForCausalLM"], head_dim=16, tie_word_embeddings=False,
                    num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                    norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1)
    else:
        raise ValueError(kind)
    base.update(overrides)
    return ModelConfig.from_dict(base)


def tiny_tensors(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Random bf16 tensors: matrices ~ N(0, 1/in_features) keep every activation O(1); norm
    weights ~ 1 + N(0, 0.1^2); the embedding ~ N(0, 0.1^2), small next to the layers'
    contributions, so a tied lm_head does not just predict the input token again."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in config.tensor_shapes().items():
        if len(shape) == 1:
            t = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            t = 0.1 * rng.standard_normal(shape)
        else:
            t = rng.standard_normal(shape) / math.sqrt(shape[1])
        tensors[name] = t.astype(ml_dtypes.bfloat16)
    return tensors


# ---- the independent float64 model --------------------------------------------------------

class Float64Model:
    """Plain float64 decode; K/V kept as lists of per-token float64 arrays.

    kv_rounding="bf16" or "int8" rounds each stored K/V head vector the way the cache format
    does (bf16 nearest-even; int8 with scale = max|x| / 127, round half to even), in float64.
    """

    def __init__(self, config: ModelConfig, tensors, kv_rounding: str | None = None,
                 int8_inputs: frozenset = frozenset()):
        self.c = config
        self.kv_rounding = kv_rounding
        self.w = {name: np.asarray(t, dtype=np.float64) for name, t in tensors.items()}
        # matrices whose input is rounded to int8 per group of 32 first (q4 weights: w4a8)
        self.int8_inputs = int8_inputs
        self.keys = [[] for _ in range(config.num_hidden_layers)]
        self.values = [[] for _ in range(config.num_hidden_layers)]
        # per step: the experts chosen in each MoE layer, in selection order
        self.routing: list[tuple] = []

    def rms(self, x, weight):
        return x / np.sqrt(np.mean(x * x) + self.c.rms_norm_eps) * weight

    def rotate(self, head, pos):
        d = self.c.head_dim
        out = np.empty(d)
        for i in range(d // 2):
            angle = pos / self.c.rope_linear_factor / self.c.rope_theta ** (2 * i / d)
            c, s = math.cos(angle), math.sin(angle)
            out[i] = head[i] * c - head[i + d // 2] * s
            out[i + d // 2] = head[i + d // 2] * c + head[i] * s
        return out

    def round_kv(self, head):
        if self.kv_rounding == "bf16":
            return head.astype(ml_dtypes.bfloat16).astype(np.float64)
        if self.kv_rounding == "int8":
            scale = np.abs(head).max() / 127
            return head * 0 if scale == 0 else np.round(head / scale) * scale
        return head

    def matvec(self, name, h):
        if name not in self.int8_inputs:
            return self.w[name] @ h
        # per group of 32: scale = max|h| / 127, codes rint(h / scale), in float64
        g = np.zeros(-(-len(h) // 32) * 32)
        g[:len(h)] = h
        g = g.reshape(-1, 32)
        scale = np.abs(g).max(axis=1, keepdims=True) / 127
        rounded = np.round(g / np.where(scale == 0, 1, scale)) * scale
        return self.w[name] @ rounded.reshape(-1)[:len(h)]

    def mlp(self, prefix, h):
        gate = self.matvec(prefix + "gate_proj.weight", h)
        up = self.matvec(prefix + "up_proj.weight", h)
        return self.matvec(prefix + "down_proj.weight", gate / (1 + np.exp(-gate)) * up)

    def step(self, token):
        c, w = self.c, self.w
        d, nh, nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        pos = len(self.keys[0])
        routing = []
        x = w["model.embed_tokens.weight"][token].copy()
        for layer in range(c.num_hidden_layers):
            p = f"model.layers.{layer}."
            h = self.rms(x, w[p + "input_layernorm.weight"])
            q_all = self.matvec(p + "self_attn.q_proj.weight", h)
            k_all = self.matvec(p + "self_attn.k_proj.weight", h)
            v_all = self.matvec(p + "self_attn.v_proj.weight", h)
            qs = [q_all[i * d:(i + 1) * d] for i in range(nh)]
            ks = [k_all[i * d:(i + 1) * d] for i in range(nkv)]
            vs = [v_all[i * d:(i + 1) * d] for i in range(nkv)]
            if c.has_qk_norm:
                qs = [self.rms(q, w[p + "self_attn.q_norm.weight"]) for q in qs]
                ks = [self.rms(k, w[p + "self_attn.k_norm.weight"]) for k in ks]
            qs = [self.rotate(q, pos) for q in qs]
            ks = [self.rotate(k, pos) for k in ks]
            self.keys[layer].append([self.round_kv(k) for k in ks])
            self.values[layer].append([self.round_kv(v) for v in vs])
            heads_out = []
            for head in range(nh):
                kv_head = head * nkv // nh
                scores = np.array([qs[head] @ self.keys[layer][t][kv_head] for t in range(pos + 1)]) / math.sqrt(d)
                probs = np.exp(scores - scores.max())
                probs /= probs.sum()
                heads_out.append(sum(probs[t] * self.values[layer][t][kv_head] for t in range(pos + 1)))
            x = x + self.matvec(p + "self_attn.o_proj.weight", np.concatenate(heads_out))
            h = self.rms(x, w[p + "post_attention_layernorm.weight"])
            if c.is_moe_layer(layer):
                router = w[p + "mlp.gate.weight"] @ h
                probs = np.exp(router - router.max())
                probs /= probs.sum()
                ranked = sorted(range(c.num_experts), key=lambda e: (-probs[e], e))
                chosen = ranked[:c.num_experts_per_tok]
                routing.append(tuple(chosen))
                weights = [probs[e] for e in chosen]
                if c.norm_topk_prob:
                    weights = [wt / sum(weights) for wt in weights]
                x = x + sum(wt * self.mlp(f"{p}mlp.experts.{e}.", h) for e, wt in zip(chosen, weights))
            else:
                x = x + self.mlp(p + "mlp.", h)
        self.routing.append(tuple(routing))
        h = self.rms(x, w["model.norm.weight"])
        if c.tie_word_embeddings and "lm_head.weight" not in w:
            return w["model.embed_tokens.weight"] @ h
        return self.matvec("lm_head.weight", h)


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# name -> (config, weight seed). The MoE seeds are ones where neither quantized cache changes the
# routing within STEPS tokens (about a quarter of the seeds tried; see ROUTING above), so that
# the bounds cover whole runs.
MODELS = {
    "qwen3": (lambda: tiny_config("qwen3"), 1),
    "llama": (lambda: tiny_config("llama"), 2),
    "qwen3_moe_norm": (lambda: tiny_config("qwen3_moe", norm_topk_prob=True), 4),
    "qwen3_moe_nonorm": (lambda: tiny_config("qwen3_moe", norm_topk_prob=False), 3),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    """The model, and the float64 model's greedy run: a random PROMPT_LEN-token prompt, then
    its own greedy tokens up to STEPS tokens; its logits and MoE routing at every step."""
    make_config, seed = MODELS[request.param]
    config = make_config()
    tensors = tiny_tensors(config, seed)
    f64 = Float64Model(config, tensors)
    tokens = [int(t) for t in np.random.default_rng(seed).integers(0, config.vocab_size, PROMPT_LEN)]
    expected = [f64.step(t) for t in tokens]
    while len(tokens) < STEPS:
        tokens.append(int(np.argmax(expected[-1])))
        expected.append(f64.step(tokens[-1]))
    return config, tensors, tokens, expected, f64.routing


def run_recording_routing(dec, tokens, monkeypatch):
    """Feed tokens to dec; returns the logits per step and the experts each MoE layer chose."""
    calls = []
    topk = reference.moe_topk

    def recording_topk(*args):
        experts, weights = topk(*args)
        calls.append((dec.position, tuple(int(e) for e in experts)))
        return experts, weights

    monkeypatch.setattr(reference, "moe_topk", recording_topk)
    logits = [dec.step(t) for t in tokens]
    routing = [tuple(experts for step, experts in calls if step == i) for i in range(len(tokens))]
    return logits, routing


def greedy_tokens(logits):
    """The tokens greedy decoding picks after the prompt (the prompt's last step onwards).

    The runs below are fed the float64 model's greedy tokens, so equal lists mean the decoder
    would generate exactly the float64 model's continuation. With a quantized cache (relative
    error ~1e-2) a flip needs a top-2 margin of about 1% of the logits' norm; the fixed seeds
    here have none, and a flip on another seed would not by itself be a bug."""
    return [int(np.argmax(l)) for l in logits[PROMPT_LEN - 1:]]


# ---- end to end against float64 ------------------------------------------------------------

def test_fp32_kv_matches_float64(model, monkeypatch):
    config, tensors, tokens, expected, expected_routing = model
    dec = ReferenceDecoder(config, tensors, kv_dtype="fp32", max_seq_len=32)
    ours, routing = run_recording_routing(dec, tokens, monkeypatch)
    errors = [rel_l2(a, b) for a, b in zip(ours, expected)]
    assert max(errors) < FP32_REL_L2, errors
    if config.is_moe:
        assert routing == expected_routing
    assert greedy_tokens(ours) == greedy_tokens(expected)
    assert dec.position == len(tokens)


@pytest.mark.parametrize("kv_dtype,bound", [("bf16", BF16_KV_REL_L2), ("int8", INT8_KV_REL_L2)])
def test_quantized_kv_within_bound_of_exact_float64(model, kv_dtype, bound, monkeypatch):
    config, tensors, tokens, expected, expected_routing = model
    dec = ReferenceDecoder(config, tensors, kv_dtype=kv_dtype, max_seq_len=32)
    ours, routing = run_recording_routing(dec, tokens, monkeypatch)
    errors = [rel_l2(a, b) for a, b in zip(ours, expected)]
    # steps before the routing first differs (all of them for dense models)
    same = next((i for i, (a, b) in enumerate(zip(routing, expected_routing)) if a != b), STEPS)
    assert same == STEPS or config.is_moe
    assert same >= STEPS // 2, f"routing differs from step {same}: choose another seed"
    assert max(errors[:same]) < bound, errors
    assert greedy_tokens(ours[:same]) == greedy_tokens(expected[:same])


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_quantized_kv_matches_float64_with_same_rounding(model, kv_dtype, monkeypatch):
    config, tensors, tokens, _, _ = model
    f64 = Float64Model(config, tensors, kv_rounding=kv_dtype)
    expected = [f64.step(t) for t in tokens]
    dec = ReferenceDecoder(config, tensors, kv_dtype=kv_dtype, max_seq_len=32)
    ours, routing = run_recording_routing(dec, tokens, monkeypatch)
    errors = [rel_l2(a, b) for a, b in zip(ours, expected)]
    assert max(errors) < SAME_ROUNDING_REL_L2, errors
    assert routing == f64.routing
    assert greedy_tokens(ours) == greedy_tokens(expected)


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3_moe"])
@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_weights_widened_when_used_equal_weights_widened_up_front(kind, weights):
    """The decoder keeps the tensors it is given and widens each matrix to fp32 when a GEMV uses
    it. Widening is exact and each GEMV is the same fp32 matmul over the same contiguous matrix,
    so the logits are bit for bit those of a decoder given every weight already as fp32 (int8:
    the dequantized values, which the int8 GEMV multiplies by)."""
    from onegraph.quant import WeightScheme, quantize_stream
    config = tiny_config(kind)
    tensors = tiny_tensors(config, seed=8)
    if weights != "bf16":
        tensors = dict(quantize_stream(config, tensors.items(), WeightScheme.make(weights)))
    up_front = {n: t.dequantize() if isinstance(t, QuantizedMatrix) else t.astype(np.float32)
                for n, t in tensors.items()}
    lazy = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=8)
    wide = ReferenceDecoder(config, up_front, kv_dtype="int8", max_seq_len=8)
    q_proj = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert lazy.layers[0].qkv_proj.parts[0] is q_proj  # held as given, not copied
    for t in (3, 1, 4, 1, 5):
        np.testing.assert_array_equal(lazy.step(t), wide.step(t))


def test_moe_model_uses_moe_and_dense_layers():
    config = tiny_config("qwen3_moe")
    assert [config.is_moe_layer(l) for l in range(3)] == [False, True, True]


def test_prefill_equals_steps(model):
    config, tensors, tokens, _, _ = model
    a = ReferenceDecoder(config, tensors, max_seq_len=32)
    b = ReferenceDecoder(config, tensors, max_seq_len=32)
    for t in tokens[:8]:
        last = a.step(t)
    np.testing.assert_array_equal(b.prefill(tokens[:8]), last)
    assert b.position == a.position == 8
    np.testing.assert_array_equal(a.kv_cache.k[:, :8], b.kv_cache.k[:, :8])


def test_reset_starts_a_fresh_sequence():
    config = tiny_config("qwen3")
    tensors = tiny_tensors(config, seed=3)
    dec = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=16)
    first = [dec.step(t) for t in (5, 6, 7)]
    dec.step(8)
    dec.reset()
    assert dec.position == 0
    again = [dec.step(t) for t in (5, 6, 7)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


# ---- state: position and validation ------------------------------------------------------

def test_position_advances_only_after_every_layer_wrote():
    config = tiny_config("qwen3_moe")
    dec = ReferenceDecoder(config, tiny_tensors(config, seed=4), max_seq_len=8)
    seen = []
    write = dec.kv_cache.write

    def recording_write(layer, position, k, v):
        seen.append((layer, position, dec.position))
        write(layer, position, k, v)

    dec.kv_cache.write = recording_write
    dec.step(1)
    dec.step(2)
    L = config.num_hidden_layers
    assert seen == [(l, 0, 0) for l in range(L)] + [(l, 1, 1) for l in range(L)]
    assert dec.position == 2


def _state(dec):
    return dec.position, [a.copy() for a in dec.kv_cache.arrays()]


def _assert_same_state(dec, state):
    position, arrays = state
    assert dec.position == position
    for before, now in zip(arrays, dec.kv_cache.arrays()):
        assert before.tobytes() == now.tobytes()


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_bad_token_raises_and_changes_nothing(kv_dtype):
    config = tiny_config("qwen3")
    dec = ReferenceDecoder(config, tiny_tensors(config, seed=5), kv_dtype=kv_dtype, max_seq_len=8)
    dec.prefill([1, 2, 3])
    state = _state(dec)
    for bad in (-1, config.vocab_size, 10**9, 1.5, "7", True):
        with pytest.raises(ValueError):
            dec.step(bad)
        _assert_same_state(dec, state)
    with pytest.raises(ValueError, match="vocabulary"):
        dec.prefill([4, 5, config.vocab_size])   # a bad last token: nothing of the others runs
    _assert_same_state(dec, state)
    with pytest.raises(ValueError):
        dec.prefill([])
    _assert_same_state(dec, state)


def test_full_cache_raises_and_changes_nothing():
    config = tiny_config("llama")
    dec = ReferenceDecoder(config, tiny_tensors(config, seed=6), kv_dtype="int8", max_seq_len=4)
    dec.prefill([1, 2])
    state = _state(dec)
    with pytest.raises(ValueError, match="KV cache full"):
        dec.prefill([3, 4, 5])                   # 2 + 3 > 4: refused before the first token
    _assert_same_state(dec, state)
    dec.prefill([3, 4])
    assert dec.position == 4
    state = _state(dec)
    with pytest.raises(ValueError, match="KV cache full"):
        dec.step(5)
    _assert_same_state(dec, state)


def test_constructor_rejects_bad_input():
    config = tiny_config("qwen3")
    tensors = tiny_tensors(config, seed=7)
    with pytest.raises(ValueError, match="kv_dtype"):
        ReferenceDecoder(config, tensors, kv_dtype="fp8")
    with pytest.raises(ValueError, match="max_seq_len"):
        ReferenceDecoder(config, tensors, max_seq_len=0)
    broken = dict(tensors)
    del broken["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_norm.weight"):
        ReferenceDecoder(config, broken)
    broken = dict(tensors)
    broken["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1]
    with pytest.raises(ValueError, match=r"up_proj.*\(96, 64\).*\(95, 64\)"):
        ReferenceDecoder(config, broken)


# ---- the kernels, one by one ---------------------------------------------------------------

def test_rmsnorm():
    rng = np.random.default_rng(10)
    x = (3.0 * rng.standard_normal((5, 37))).astype(np.float32)
    w = (1.0 + 0.1 * rng.standard_normal(37)).astype(np.float32)
    x64 = x.astype(np.float64)
    expected = x64 / np.sqrt((x64 ** 2).mean(axis=-1, keepdims=True) + 1e-6) * w
    got = rmsnorm(x, w, 1e-6)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-7)
    # the zero vector stays zero (eps keeps the division finite)
    np.testing.assert_array_equal(rmsnorm(np.zeros(8, np.float32), np.ones(8, np.float32), 1e-6), 0)


@pytest.mark.parametrize("head_dim,theta,factor", [(16, 10_000.0, 1.0), (24, 1_000_000.0, 1.0), (128, 1_000_000.0, 4.0)])
def test_rope_matches_complex_rotation(head_dim, theta, factor):
    rng = np.random.default_rng(head_dim)
    x = rng.standard_normal((3, head_dim)).astype(np.float32)
    inv_freq = rope_inv_freq(head_dim, theta, factor)
    exact = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim) / factor
    np.testing.assert_allclose(inv_freq, exact, rtol=2e-7)
    half = head_dim // 2
    pairs = x[:, :half].astype(np.float64) + 1j * x[:, half:].astype(np.float64)
    for pos in (0, 1, 7, 1000, 4095):
        got = rope(x, pos, inv_freq)
        assert got.dtype == np.float32
        # Closed form with the contract's fp32 angle float32(pos) * inv_freq: tests the rotation.
        angle = (np.float32(pos) * inv_freq).astype(np.float64)
        rotated = pairs * np.exp(1j * angle)
        np.testing.assert_allclose(got, np.concatenate([rotated.real, rotated.imag], axis=1), rtol=0, atol=2e-6)
        # Rotation keeps each pair's length.
        np.testing.assert_allclose(np.abs(got[:, :half] + 1j * got[:, half:]), np.abs(pairs), rtol=1e-6)
    np.testing.assert_array_equal(rope(x, 0, inv_freq), x)
    # against float64 angles pos / factor / theta^(2i/d) for small positions
    for pos in (1, 5, 31):
        rotated = pairs * np.exp(1j * pos * exact)
        np.testing.assert_allclose(rope(x, pos, inv_freq), np.concatenate([rotated.real, rotated.imag], axis=1), atol=1e-5)


def test_int8_round_trip_error_at_most_half_a_step():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((50, 4, 24)) * rng.uniform(1e-3, 1e3, (50, 4, 1))).astype(np.float32)
    q, scale = kv_quantize_int8(x)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (50, 4)
    np.testing.assert_array_equal(scale, np.abs(x).max(axis=-1) / np.float32(127))
    assert np.all(np.abs(q).max(axis=-1) == 127)              # the largest element maps to +-127
    err = np.abs(kv_dequantize_int8(q, scale) - x)
    assert np.all(err <= scale[..., None] / 2 * (1 + 1e-6))


def test_int8_zero_row_and_ties_to_even():
    q, scale = kv_quantize_int8(np.zeros((2, 8), np.float32))
    assert np.all(q == 0) and np.all(scale == 0)
    np.testing.assert_array_equal(kv_dequantize_int8(q, scale), 0)
    # max 7.9375 = 127 / 16 -> scale = 1/16 exactly, so x / scale lands exactly on halves
    halves = np.array([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5, 126.5, 127.0]) / 16
    q, scale = kv_quantize_int8(halves.astype(np.float32))
    assert scale == np.float32(1 / 16)
    np.testing.assert_array_equal(q, [0, 2, 2, 4, 0, -2, -2, -4, 126, 127])
    # one zero row next to a non-zero row: only the zero row is zeroed
    q, scale = kv_quantize_int8(np.array([[0, 0], [1, -2]], np.float32))
    np.testing.assert_array_equal(q, [[0, 0], [64, -127]])


def test_moe_topk_order_ties_and_renormalization():
    logits = np.array([0.5, 2.0, -1.0, 2.0, 1.0, 2.0], np.float32)
    p = np.exp(logits.astype(np.float64) - 2.0)
    p /= p.sum()
    experts, weights = moe_topk(logits, 4, norm_topk_prob=False)
    assert experts.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_array_equal(experts, [1, 3, 5, 4])       # three-way tie -> lower ids first
    np.testing.assert_allclose(weights, p[[1, 3, 5, 4]], rtol=1e-6)
    experts, weights = moe_topk(logits, 2, norm_topk_prob=True)
    np.testing.assert_array_equal(experts, [1, 3])
    np.testing.assert_allclose(weights, [0.5, 0.5], rtol=1e-6)
    experts, weights = moe_topk(logits, 3, norm_topk_prob=True)
    np.testing.assert_allclose(weights.sum(), 1.0, rtol=1e-6)
    # descending order for random logits; large logits do not overflow (max subtracted)
    rng = np.random.default_rng(12)
    logits = (rng.standard_normal(128) * 30 + 500).astype(np.float32)
    experts, weights = moe_topk(logits, 8, norm_topk_prob=False)
    np.testing.assert_array_equal(experts, np.argsort(-logits, kind="stable")[:8])
    assert np.all(np.diff(weights) <= 0) and np.all(np.isfinite(weights))


def test_attention_decode_gqa_mapping():
    rng = np.random.default_rng(13)
    n_heads, n_kv, d, length = 6, 2, 8, 5
    q = rng.standard_normal((n_heads, d)).astype(np.float32)
    k = rng.standard_normal((length, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((length, n_kv, d)).astype(np.float32)
    got = attention_decode(q, k, v)
    for h in range(n_heads):
        kv = h * n_kv // n_heads                                    # heads 0-2 -> 0, 3-5 -> 1
        s = k[:, kv].astype(np.float64) @ q[h] / math.sqrt(d)
        pr = np.exp(s - s.max())
        pr /= pr.sum()
        np.testing.assert_allclose(got[h], pr @ v[:, kv], rtol=1e-5, atol=1e-6)
    # one visible row: the output is that row's value
    np.testing.assert_allclose(attention_decode(q, k[:1], v[:1]), v[0, np.arange(n_heads) * n_kv // n_heads], rtol=1e-6)


def test_bf16_kv_cache_rounds_to_nearest_even():
    config = tiny_config("llama")
    dec = ReferenceDecoder(config, tiny_tensors(config, seed=14), kv_dtype="bf16", max_seq_len=4)
    exact = ReferenceDecoder(config, tiny_tensors(config, seed=14), kv_dtype="fp32", max_seq_len=4)
    dec.step(9)
    exact.step(9)
    assert dec.kv_cache.k.dtype == ml_dtypes.bfloat16
    # layer 0 sees the same input in both (later layers see the bf16 cache's effect)
    for cache, ref in ((dec.kv_cache.k, exact.kv_cache.k), (dec.kv_cache.v, exact.kv_cache.v)):
        np.testing.assert_array_equal(cache[0, 0].astype(np.float32),
                                      ref[0, 0].astype(ml_dtypes.bfloat16).astype(np.float32))
