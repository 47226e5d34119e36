"""The numpy reference decoder: the CPU fallback path and the readable twin of the CUDA body.

One decode step reads top to bottom in ``ReferenceDecoder.step``, in the order the CUDA body
(og_enqueue) runs its kernels, with the body's buffer names:

    x = embed_tokens[token]                                   x      [hidden]
    for each layer:
        normed = rmsnorm(x, input_layernorm)                  normed [hidden]
        qkv    = gemv(W_qkv, normed)                          qkv    [q_size + 2 kv_size]
        q, k, v = split(qkv)   (+ per-head QK-norm)           q [n_heads, head_dim], k, v [n_kv, head_dim]
        q, k   = rope(q), rope(k)
        cache[layer, position] = quantize(k), quantize(v)
        attn_out = attention_decode(q, cache[layer, :position + 1])   attn_out [n_heads * head_dim]
        x     += gemv(W_o, attn_out)
        normed = rmsnorm(x, post_attention_layernorm)
        x     += dense FFN  (act = swiglu(gemv(W_gate_up, normed)); gemv(W_down, act))
                 or MoE     (router_logits -> moe_topk -> weighted sum of the selected experts)
    normed = rmsnorm(x, norm);  logits = gemv(lm_head, normed)        logits [vocab]

Numerics (DESIGN.md, "Numerics"): every activation is fp32 and every matmul is a float32 matmul
over the whole [out, in] matrix widened to fp32; RMSNorm, softmax and RoPE are in fp32. The KV
cache holds fp32, bf16 (round to nearest even) or int8 with one fp32 scale per (token, KV head);
attention uses the fp32 query against K/V dequantized on the fly. The MoE weighted sum runs in
selection order, as launch_moe_down_weighted_residual does (cuda/moe.cuh).

Weights are kept as the loader gives them (bf16 views into the mapped file, or quantized
matrices) and widened to fp32 one matrix at a time, when a GEMV uses it, into a scratch buffer
the decoder reuses: memory holds the file's pages plus one fp32 matrix, not an fp32 copy of the
model. The rule is the GPU's (GpuSession.set_weight), so the two stay comparable:
  - a matrix (ndim 2: projections, router, embedding, lm_head) is used as bf16: bf16 -> fp32 is
    exact, so the fp32 GEMV computes what the GPU's bf16-weight GEMV computes, up to the order of
    fp32 accumulation; a float16 matrix is first rounded to bf16 (nearest even), as the GPU stores
    it; a float32 matrix is used as given;
  - a vector (the norms) is widened to fp32 once (exact from bf16, float16 or fp32).
Widening is exact and each GEMV is one matmul over the same contiguous fp32 [out, in] matrix as
when the weights were widened up front, so the logits are bit for bit the same as then.

Quantized weights (runtime/quant.py: int8 per row, q4 in groups of 32) arrive as QuantizedMatrix
values and are dequantized when used, in row blocks into the same scratch buffer, with the GPU's
rule, w = float32(q) * scale: the same weight values the kernels multiply by (bit for bit for q4,
whose products q * scale are exact in fp32). For a q4 matrix gemv quantizes its input to int8
per group of 32 first (quant.quantize_input_q8), as the GPU's q4 kernel does (w4a8,
cuda/gemv_q4.cu). So GPU vs reference stays a comparison of fp32 rounding only.

The pure functions below (rmsnorm, rope, kv_quantize_int8, kv_dequantize_int8, attention_decode,
moe_topk, swiglu, gemv) are public so that GPU kernel tests can compare against them.

This module imports numpy and ml_dtypes only (no torch): it is part of the runtime.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import os

import ml_dtypes
import numpy as np

from .config import ModelConfig
from .quant import QuantizedMatrix, dequantize_input_q8

KV_DTYPES = ("fp32", "bf16", "int8")
_F32 = np.float32


# ---- kernels, as pure functions ---------------------------------------------------------

@dataclass(frozen=True)
class Q4Weights:
    """A q4 matrix's dequantized weights w fp32 [out, in]: gemv quantizes its input (w4a8)."""
    w: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape


def gemv(weight: "np.ndarray | Q4Weights", x: np.ndarray) -> np.ndarray:
    """weight [out, in] fp32 @ x [in] fp32 -> [out] fp32 (a float32 matmul: fp32 accumulation).
    For Q4Weights x is first quantized to int8 per group of 32 (quant.quantize_input_q8)."""
    if isinstance(weight, Q4Weights):
        return np.matmul(weight.w, dequantize_input_q8(x))
    return np.matmul(weight, x)


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, in fp32: x * 1/sqrt(mean(x^2) + eps) * weight.

    x [..., n] fp32, weight [n] fp32 -> [..., n] fp32. Applied to [hidden] for the layer norms
    and to [n_heads, head_dim] for Qwen3's per-head QK-norm.
    """
    x = np.asarray(x, dtype=_F32)
    mean_square = np.mean(x * x, axis=-1, keepdims=True, dtype=_F32)
    inv_rms = _F32(1.0) / np.sqrt(mean_square + _F32(eps))
    return (x * inv_rms * weight).astype(_F32, copy=False)


def rope_inv_freq(head_dim: int, theta: float, linear_factor: float = 1.0) -> np.ndarray:
    """inv_freq [head_dim / 2] fp32: 1 / theta^(2i / head_dim), computed in float64, cast to
    fp32, then divided (in fp32) by the 'linear' rope_scaling factor."""
    return _unscaled_frequencies(head_dim, theta).astype(_F32) / _F32(linear_factor)


def rope_frequency_factors(config) -> np.ndarray | None:
    """Per-frequency divisors [head_dim / 2] float64 of the rope scalings that set each frequency
    on its own, as a GGUF's rope_freqs tensor holds them; None for the default and 'linear'
    kinds. 'freq_factors' (a GGUF's): its factors. 'llama3' (Llama 3.x), Hugging Face's rule:
    with the unscaled frequency f, its wavelength w = 2 pi / f and L =
    original_max_position_embeddings, f stays where w < L / high_freq_factor, is divided by
    factor where w > L / low_freq_factor, and in between becomes (1 - s) f / factor + s f, s =
    (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor); the divisor is f over that."""
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "freq_factors":
        return np.asarray(scaling["factors"], np.float64)
    if kind != "llama3":
        return None
    inv_freq = _unscaled_frequencies(config.head_dim, config.rope_theta)
    factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2.0 * np.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1.0 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return inv_freq / np.where(medium, blended, scaled)


def _unscaled_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """1 / theta^(2i / head_dim), float64 [head_dim / 2]."""
    return 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def rope_frequencies(config) -> np.ndarray:
    """The model's inv_freq [head_dim / 2] fp32, the table the engine rotates by (uploaded with
    og_set_rope_frequencies): rope_inv_freq for the default and 'linear' kinds, else the
    unscaled frequencies over rope_frequency_factors, in float64, cast once."""
    factors = rope_frequency_factors(config)
    if factors is None:
        return rope_inv_freq(config.head_dim, config.rope_theta, config.rope_linear_factor)
    return (_unscaled_frequencies(config.head_dim, config.rope_theta) / factors).astype(_F32)


def rope(x: np.ndarray, position: int, inv_freq: np.ndarray) -> np.ndarray:
    """Rotary embedding, Hugging Face rotate-half convention, in fp32.

    x [n_heads, head_dim] fp32, inv_freq [head_dim / 2] fp32 -> [n_heads, head_dim] fp32.
    angle[i] = float32(position) * inv_freq[i];
    out[i] = x[i] cos - x[i + d/2] sin,  out[i + d/2] = x[i + d/2] cos + x[i] sin.
    """
    angle = _F32(position) * inv_freq                      # [head_dim / 2] fp32
    cos, sin = np.cos(angle), np.sin(angle)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(_F32, copy=False)


def kv_quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 with one fp32 scale per row (per (token, KV head) in the cache).

    x [..., head_dim] fp32 -> (q [..., head_dim] int8, scale [...] fp32) with
    scale = max|x| / 127 and q = round_half_even(x / scale), both fp32 divisions; q = 0 where
    scale == 0 (an all-zero row, or one so small that max|x| / 127 underflows).
    """
    x = np.asarray(x, dtype=_F32)
    scale = (np.max(np.abs(x), axis=-1) / _F32(127.0)).astype(_F32)
    zero = scale == 0
    divisor = np.where(zero, _F32(1.0), scale)[..., None]
    q = np.rint(x / divisor)                               # np.rint rounds half to even
    q[zero] = 0
    return q.astype(np.int8), scale


def kv_dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """q [..., head_dim] int8, scale [...] fp32 -> q * scale [..., head_dim] fp32."""
    return q.astype(_F32) * scale[..., None]


def attention_decode(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """One query token against the visible cache rows, grouped-query, in fp32.

    q [n_heads, head_dim], k and v [length, n_kv, head_dim] (already dequantized) -> [n_heads,
    head_dim]. Query head h reads KV head h * n_kv // n_heads. scores = q.k / sqrt(head_dim);
    softmax with the maximum subtracted; out = sum_t p_t v_t.
    """
    n_heads, head_dim = q.shape
    length, n_kv, _ = k.shape
    group = n_heads // n_kv                                # query heads per KV head
    q_grouped = q.reshape(n_kv, group, head_dim)           # heads h = kv * group + g
    scores = np.matmul(q_grouped, k.transpose(1, 2, 0))    # [n_kv, group, length]
    scores = scores / _F32(np.sqrt(head_dim))
    scores = scores - np.max(scores, axis=-1, keepdims=True)
    p = np.exp(scores)
    p = p / np.sum(p, axis=-1, keepdims=True, dtype=_F32)
    out = np.matmul(p, v.transpose(1, 0, 2))               # [n_kv, group, head_dim]
    return out.reshape(n_heads, head_dim).astype(_F32, copy=False)


def moe_topk(router_logits: np.ndarray, top_k: int, norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    """Router softmax over all experts (fp32, max subtracted), then the top_k largest
    probabilities in descending order, ties to the lower expert index; divided by their sum
    (summed in selection order) when norm_topk_prob.

    router_logits [E] fp32 -> (selected_experts [top_k] int32, selected_weights [top_k] fp32).
    """
    logits = np.asarray(router_logits, dtype=_F32)
    p = np.exp(logits - np.max(logits))
    p = p / np.sum(p, dtype=_F32)
    selected_experts = np.argsort(-p, kind="stable")[:top_k].astype(np.int32)
    selected_weights = p[selected_experts].astype(_F32)
    if norm_topk_prob:
        total = _F32(0.0)
        for w in selected_weights:                         # selection order, as the kernel sums
            total = _F32(total + w)
        selected_weights = selected_weights / total
    return selected_experts, selected_weights


def routing_gap(router_logits: np.ndarray, top_k: int) -> float:
    """How far moe_topk's decision is from a tie: the top_k-th largest router logit minus the
    next one, as a fraction of the largest |router logit| (0: the last two candidates tie).

    router_logits [E] fp32, top_k < E -> float.
    """
    ranked = np.sort(np.asarray(router_logits, dtype=_F32))[::-1]
    return float((ranked[top_k - 1] - ranked[top_k]) / np.abs(ranked).max())


def swiglu(gate_up: np.ndarray) -> np.ndarray:
    """gate_up [2I] fp32 (gate rows then up rows) -> act [I] fp32 = silu(gate) * up."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    return (gate / (_F32(1.0) + np.exp(-gate)) * up).astype(_F32, copy=False)


# ---- the KV cache ------------------------------------------------------------------------

@dataclass
class KVCache:
    """Pre-allocated per-layer K/V rows; row `position` is written by the step at that position.

    k, v       [layers, max_seq_len, n_kv, head_dim]  fp32 | bfloat16 | int8
    k_scale,   [layers, max_seq_len, n_kv]            fp32 (int8 only; None otherwise)
    v_scale
    """
    dtype: str
    k: np.ndarray
    v: np.ndarray
    k_scale: np.ndarray | None = None
    v_scale: np.ndarray | None = None

    @classmethod
    def allocate(cls, dtype: str, layers: int, max_seq_len: int, n_kv: int, head_dim: int) -> "KVCache":
        shape = (layers, max_seq_len, n_kv, head_dim)
        storage = {"fp32": _F32, "bf16": ml_dtypes.bfloat16, "int8": np.int8}[dtype]
        cache = cls(dtype, np.zeros(shape, storage), np.zeros(shape, storage))
        if dtype == "int8":
            cache.k_scale = np.zeros(shape[:3], _F32)
            cache.v_scale = np.zeros(shape[:3], _F32)
        return cache

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def arrays(self) -> list[np.ndarray]:
        """Every array of the cache: k, v, then k_scale, v_scale for int8."""
        return [a for a in (self.k, self.v, self.k_scale, self.v_scale) if a is not None]

    def copy(self) -> "KVCache":
        """An independent copy (a forked sequence on the CPU path)."""
        return KVCache(self.dtype, *(None if a is None else a.copy()
                                     for a in (self.k, self.v, self.k_scale, self.v_scale)))

    def write(self, layer: int, position: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v [n_kv, head_dim] fp32 at (layer, position) in the cache's element type."""
        if self.dtype == "int8":
            self.k[layer, position], self.k_scale[layer, position] = kv_quantize_int8(k)
            self.v[layer, position], self.v_scale[layer, position] = kv_quantize_int8(v)
        else:  # fp32 copy, or bf16 rounded to nearest even by ml_dtypes
            self.k[layer, position] = k
            self.v[layer, position] = v

    def read(self, layer: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows [0, length) of a layer, dequantized: k, v [length, n_kv, head_dim] fp32."""
        if self.dtype == "int8":
            return (kv_dequantize_int8(self.k[layer, :length], self.k_scale[layer, :length]),
                    kv_dequantize_int8(self.v[layer, :length], self.v_scale[layer, :length]))
        return (self.k[layer, :length].astype(_F32, copy=False),
                self.v[layer, :length].astype(_F32, copy=False))


# ---- weights -----------------------------------------------------------------------------

_BF16 = np.dtype(ml_dtypes.bfloat16)
_WEIGHT_DTYPES = (_BF16, np.dtype(np.float16), np.dtype(np.float32))
_DEQUANTIZE_ROWS = 256   # rows per dequantization pass: bounds its temporaries (~13 B per weight)
FP32_BUDGET_BYTES = 2 << 30   # fp32 weight copies a decoder keeps by default (ReferenceDecoder)


def fp32_budget() -> int:
    """Bytes of fp32 weight copies a ReferenceDecoder keeps: $ONEGRAPH_CPU_FP32_BUDGET_MB, else
    FP32_BUDGET_BYTES."""
    mb = os.environ.get("ONEGRAPH_CPU_FP32_BUDGET_MB")
    if mb is None:
        return FP32_BUDGET_BYTES
    try:
        return max(0, int(mb)) << 20
    except ValueError:
        raise ValueError(f"ONEGRAPH_CPU_FP32_BUDGET_MB={mb!r} must be a whole number of megabytes") from None


def _widen_into(out: np.ndarray, part) -> None:
    """Write one stored matrix part [rows, cols] into out [rows, cols] fp32 (the rule above)."""
    if isinstance(part, QuantizedMatrix):
        for r0 in range(0, part.shape[0], _DEQUANTIZE_ROWS):
            rows = slice(r0, r0 + _DEQUANTIZE_ROWS)
            out[rows] = part.dequantize(rows)
    elif part.dtype == _BF16:  # fp32 bits = bf16 bits << 16 (exact), without a temporary
        np.left_shift(part.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)
    elif part.dtype == np.float16:  # rounded to bf16 as the GPU stores it
        for r0 in range(0, part.shape[0], _DEQUANTIZE_ROWS):
            rows = slice(r0, r0 + _DEQUANTIZE_ROWS)
            out[rows] = part[rows].astype(_F32).astype(_BF16)
    else:
        out[...] = part


class Matrix:
    """A GEMV weight [rows, cols] as stored: `parts` stacked by rows (q | k | v, gate | up, or a
    single matrix), each a bf16 / float16 / fp32 array or a QuantizedMatrix, widened to fp32 only
    when used (widen). q4: every part is q4 (the scheme quantizes a fused matrix's parts alike),
    and gemv then quantizes its input (w4a8)."""

    def __init__(self, parts: Sequence):
        self.parts = tuple(parts)
        cols = {p.shape[1] for p in self.parts}
        if len(cols) != 1:
            raise ValueError(f"fused matrix parts have different column counts {sorted(cols)}")
        self.shape = (sum(p.shape[0] for p in self.parts), cols.pop())
        q4 = [isinstance(p, QuantizedMatrix) and p.format == "q4" for p in self.parts]
        if any(q4) and not all(q4):
            raise ValueError("a fused matrix mixes q4 and other formats")
        self.q4 = all(q4)
        self.kept: np.ndarray | None = None   # an fp32 copy held for good (keep_widened)

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def keep_widened(self) -> None:
        """Hold the fp32 weights from now on instead of widening them at every use."""
        self.kept = None
        self.kept = self.widen(np.empty(self.size, _F32))

    def widen(self, scratch: np.ndarray) -> "np.ndarray | Q4Weights":
        """The fp32 weights [rows, cols] (Q4Weights for q4), written into the first rows * cols
        floats of `scratch` (a flat fp32 buffer) and valid until the next widen into it; the
        kept copy instead when there is one."""
        if self.kept is not None:
            return self.kept
        w = scratch[:self.size].reshape(self.shape)
        r0 = 0
        for part in self.parts:
            _widen_into(w[r0:r0 + part.shape[0]], part)
            r0 += part.shape[0]
        return Q4Weights(w) if self.q4 else w

    def row(self, index: int) -> np.ndarray:
        """Row `index` [cols] fp32 (the embedding gather), by the same rule as widen."""
        for part in self.parts:
            if index < part.shape[0]:
                if isinstance(part, QuantizedMatrix):
                    return part.dequantize(slice(index, index + 1))[0]
                out = np.empty((1, self.shape[1]), _F32)
                _widen_into(out, part[index:index + 1])
                return out[0]
            index -= part.shape[0]
        raise IndexError(f"row {index} is outside the matrix's {self.shape[0]} rows")


@dataclass
class LayerWeights:
    """One decoder layer's weights in the GPU's fused layouts: GEMV weights as stored (Matrix),
    norm weights fp32."""
    input_layernorm: np.ndarray            # [hidden]
    qkv_proj: Matrix                       # [q_size + 2 kv_size, hidden]: rows q | k | v
    q_norm: np.ndarray | None              # [head_dim] (Qwen3 QK-norm; None for Llama)
    k_norm: np.ndarray | None              # [head_dim]
    o_proj: Matrix                         # [hidden, q_size]
    post_attention_layernorm: np.ndarray   # [hidden]
    # dense FFN
    gate_up_proj: Matrix | None = None     # [2 intermediate, hidden]: rows gate | up
    down_proj: Matrix | None = None        # [hidden, intermediate]
    # MoE FFN
    router: Matrix | None = None                       # mlp.gate.weight [E, hidden]
    experts_gate_up: "Sequence[Matrix] | None" = None  # E x [2 moe_inter, hidden] (gate | up)
    experts_down: "Sequence[Matrix] | None" = None     # E x [hidden, moe_inter]


def _vector(t) -> np.ndarray:
    """A norm weight as fp32 (exact from bf16, float16 or fp32)."""
    return np.ascontiguousarray(t, dtype=_F32)


def _check_tensors(config: ModelConfig, tensors: Mapping[str, np.ndarray]) -> None:
    missing = [name for name in config.tensor_shapes() if name not in tensors]
    if missing:
        raise ValueError(f"{len(missing)} required tensor(s) missing, first: '{missing[0]}'")
    for name, shape in config.tensor_shapes().items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor '{name}': expected shape {shape}, got {tuple(t.shape)}")
        if isinstance(t, QuantizedMatrix):
            continue
        if t.dtype not in _WEIGHT_DTYPES:
            raise ValueError(f"tensor '{name}': expected dtype bfloat16, float16 or float32, got {t.dtype}")


def _load_weights(config: ModelConfig, tensors: Mapping[str, np.ndarray]):
    def matrix(*names: str) -> Matrix:  # rows of names stacked
        return Matrix([tensors[n] for n in names])

    layers = []
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        w = LayerWeights(
            input_layernorm=_vector(tensors[p + "input_layernorm.weight"]),
            qkv_proj=matrix(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                            p + "self_attn.v_proj.weight"),
            q_norm=_vector(tensors[p + "self_attn.q_norm.weight"]) if config.has_qk_norm else None,
            k_norm=_vector(tensors[p + "self_attn.k_norm.weight"]) if config.has_qk_norm else None,
            o_proj=matrix(p + "self_attn.o_proj.weight"),
            post_attention_layernorm=_vector(tensors[p + "post_attention_layernorm.weight"]),
        )
        if config.is_moe_layer(layer):
            w.router = matrix(p + "mlp.gate.weight")
            E, expert = config.num_experts, f"{p}mlp.experts."
            w.experts_gate_up = [matrix(f"{expert}{e}.gate_proj.weight", f"{expert}{e}.up_proj.weight")
                                 for e in range(E)]
            w.experts_down = [matrix(f"{expert}{e}.down_proj.weight") for e in range(E)]
        else:
            w.gate_up_proj = matrix(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            w.down_proj = matrix(p + "mlp.down_proj.weight")
        layers.append(w)
    embed_tokens = matrix("model.embed_tokens.weight")                     # [vocab, hidden]
    # A tied model's quantized lm_head is a separate tensor (quant.quantize_stream makes it).
    tied = config.tie_word_embeddings and "lm_head.weight" not in tensors
    lm_head = embed_tokens if tied else matrix("lm_head.weight")            # [vocab, hidden]
    return embed_tokens, layers, _vector(tensors["model.norm.weight"]), lm_head


# ---- the decoder -------------------------------------------------------------------------

class ReferenceDecoder:
    """Batch-1 decode in numpy with the CUDA body's arithmetic.

    tensors: every tensor of ``config.tensor_shapes()`` by Hugging Face name, as
    ml_dtypes.bfloat16 or float32 arrays (extra names are ignored). kv_dtype: "fp32", "bf16" or
    "int8". max_seq_len: rows of the KV cache (the most tokens one sequence can hold).
    The tensors are kept (not copied): widened to fp32 per matrix when used (module docstring),
    except that the first matrices whose fp32 copies fit in fp32_budget_bytes keep them, since
    widening at every use costs far more than the GEMV itself (default FP32_BUDGET_BYTES, or
    $ONEGRAPH_CPU_FP32_BUDGET_MB; 0: widen every matrix at every use, the least memory).
    """

    def __init__(self, config: ModelConfig, tensors: Mapping[str, np.ndarray],
                 kv_dtype: str = "fp32", max_seq_len: int = 4096, fp32_budget_bytes: int | None = None):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype={kv_dtype!r} is not supported; supported: {KV_DTYPES}")
        if not isinstance(max_seq_len, (int, np.integer)) or max_seq_len <= 0:
            raise ValueError(f"max_seq_len={max_seq_len!r} must be a positive integer")
        _check_tensors(config, tensors)
        self.config = config
        self.kv_dtype = kv_dtype
        self.max_seq_len = int(max_seq_len)
        self.embed_tokens, self.layers, self.norm, self.lm_head = _load_weights(config, tensors)
        # One fp32 buffer of the largest GEMV weight, each matrix widened into it when used.
        matrices = [self.lm_head] + [m for w in self.layers for m in (
            w.qkv_proj, w.o_proj, w.gate_up_proj, w.down_proj, w.router,
            *(w.experts_gate_up or ()), *(w.experts_down or ())) if m is not None]
        self._scratch = np.empty(max(m.size for m in matrices), _F32)
        budget = fp32_budget() if fp32_budget_bytes is None else fp32_budget_bytes
        for m in sorted(matrices, key=lambda m: m.size):   # small ones first: most matrices per byte
            if 4 * m.size > budget:
                break
            m.keep_widened()
            budget -= 4 * m.size
        self.inv_freq = rope_frequencies(config)
        self.kv_cache = KVCache.allocate(kv_dtype, config.num_hidden_layers, self.max_seq_len,
                                         config.num_key_value_heads, config.head_dim)
        self._position = 0

    @property
    def position(self) -> int:
        """Tokens in the KV cache = the row the next step writes."""
        return self._position

    def reset(self) -> None:
        """Start a new sequence. Old rows stay in memory but are never read (attention reads
        rows [0, position])."""
        self._position = 0

    # -- several sequences on one decoder (the Engine's CPU path) --
    def save_sequence(self) -> tuple[KVCache, int]:
        """The current sequence's state, (KV cache, position), for load_sequence."""
        return self.kv_cache, self._position

    def load_sequence(self, state: tuple[KVCache, int] | None = None) -> None:
        """Make `state` (from save_sequence) the current sequence; None starts an empty one
        with a cache of its own."""
        if state is None:
            cfg = self.config
            state = (KVCache.allocate(self.kv_dtype, cfg.num_hidden_layers, self.max_seq_len,
                                      cfg.num_key_value_heads, cfg.head_dim), 0)
        self.kv_cache, self._position = state

    def step(self, token: int) -> np.ndarray:
        """Decode one token at `position`; returns logits [vocab] fp32 and advances position."""
        self._check_room(1)
        self._check_token(token)
        return self._forward(int(token), want_logits=True)

    def prefill(self, tokens: Iterable[int]) -> np.ndarray:
        """Feed tokens one by one (decode arithmetic, so results equal step() calls); returns the
        logits of the last. Every token and the capacity are checked before anything runs."""
        tokens = list(tokens)
        if not tokens:
            raise ValueError("prefill needs at least one token")
        self._check_room(len(tokens))
        for t in tokens:
            self._check_token(t)
        for t in tokens[:-1]:
            self._forward(int(t), want_logits=False)   # lm_head skipped: nobody reads it
        return self._forward(int(tokens[-1]), want_logits=True)

    def verify(self, tokens: Iterable[int]) -> np.ndarray:
        """The verify step of speculative decoding: feed tokens (the last accepted token and the
        drafts) at rows position .. position + n - 1, one decode step each (so each row's logits
        are exactly step()'s); returns their logits [n, vocab] and advances position by n. The
        caller keeps the rows it accepts with truncate(). Checked before anything runs."""
        tokens = list(tokens)
        if not tokens:
            raise ValueError("verify needs at least one token")
        self._check_room(len(tokens))
        for t in tokens:
            self._check_token(t)
        return np.stack([self._forward(int(t), want_logits=True) for t in tokens])

    def truncate(self, length: int) -> None:
        """Keep the first `length` rows (0 <= length <= position): the rollback of rejected
        drafts. Later rows stay in memory but are never read (attention reads rows [0,
        position]); the next step overwrites them."""
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or not 0 <= length <= self._position:
            raise ValueError(f"truncate: length {length!r} is outside 0..{self._position} (rows held)")
        self._position = int(length)

    # -- validation (before any state changes) --
    def _check_token(self, token) -> None:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            raise ValueError(f"token {token!r} must be an integer id")
        if not 0 <= token < self.config.vocab_size:
            raise ValueError(f"token {token} is outside the vocabulary 0..{self.config.vocab_size - 1}")

    def _check_room(self, count: int) -> None:
        if self._position + count > self.max_seq_len:
            raise ValueError(
                f"KV cache full: position {self._position} + {count} token(s) exceeds max_seq_len {self.max_seq_len}")

    # -- the body --
    def _gemv(self, weight: Matrix, x: np.ndarray) -> np.ndarray:
        """weight @ x [rows] fp32, the weight widened into the scratch buffer first."""
        return gemv(weight.widen(self._scratch), x)

    def _forward(self, token: int, want_logits: bool) -> np.ndarray | None:
        cfg = self.config
        n_heads, n_kv, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = cfg.q_size, cfg.kv_size
        eps = cfg.rms_norm_eps
        position = self._position

        x = self.embed_tokens.row(token)                                 # [hidden]
        for layer, w in enumerate(self.layers):
            # ---- attention ----
            normed = rmsnorm(x, w.input_layernorm, eps)                  # [hidden]
            qkv = self._gemv(w.qkv_proj, normed)                         # [q_size + 2 kv_size]
            q = qkv[:q_size].reshape(n_heads, head_dim)                  # [n_heads, head_dim]
            k = qkv[q_size:q_size + kv_size].reshape(n_kv, head_dim)     # [n_kv, head_dim]
            v = qkv[q_size + kv_size:].reshape(n_kv, head_dim)           # [n_kv, head_dim]
            if cfg.has_qk_norm:
                q = rmsnorm(q, w.q_norm, eps)
                k = rmsnorm(k, w.k_norm, eps)
            q = rope(q, position, self.inv_freq)
            k = rope(k, position, self.inv_freq)
            self.kv_cache.write(layer, position, k, v)
            k_rows, v_rows = self.kv_cache.read(layer, position + 1)     # [position + 1, n_kv, head_dim]
            attn_out = attention_decode(q, k_rows, v_rows).reshape(q_size)  # [n_heads * head_dim]
            x += self._gemv(w.o_proj, attn_out)

            # ---- feed-forward ----
            normed = rmsnorm(x, w.post_attention_layernorm, eps)         # [hidden]
            if w.router is None:
                act = swiglu(self._gemv(w.gate_up_proj, normed))         # [intermediate]
                x += self._gemv(w.down_proj, act)
            else:
                router_logits = self._gemv(w.router, normed)             # [E]
                selected_experts, selected_weights = moe_topk(           # [top_k], [top_k]
                    router_logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
                y = np.zeros_like(x)                                     # [hidden]
                for e, weight in zip(selected_experts, selected_weights):  # selection order
                    act = swiglu(self._gemv(w.experts_gate_up[e], normed))  # [moe_inter]
                    y += weight * self._gemv(w.experts_down[e], act)
                x += y

        # Every layer has written its row: only now does the visible length advance.
        self._position = position + 1
        if not want_logits:
            return None
        normed = rmsnorm(x, self.norm, eps)                              # [hidden]
        logits = self._gemv(self.lm_head, normed)                        # [vocab]
        return logits
