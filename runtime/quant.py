"""Weight quantization at load time: int8 per output row and 4-bit in groups of 32 (numpy).

Formats (cuda/onegraph.h, "weight formats", is the other half of this contract)
-------------------------------------------------------------------------------
Every rule below runs in fp32 on the fp32 value of the bf16 weight (bf16 -> fp32 is exact),
with numpy's correctly rounded fp32 division and np.rint (round half to even), so the same
weights always give the same bytes.

``int8`` — symmetric, one fp32 scale per output row:
    scale[r] = max_c |w[r, c]| / 127                    (fp32 division)
    q[r, c]  = rint(w[r, c] / scale[r])  in [-127, 127]  (fp32 division; q = 0 where scale == 0)
    w'       = float32(q) * scale[r]                     (the dequantized weight)
  Data: int8 [rows, cols], two's complement. Scale: fp32 [rows]. The GPU computes
  scale[r] * sum_c q[r, c] x[c]; the reference sum_c (q[r, c] * scale[r]) x[c]: the same number up
  to fp32 rounding. A row's scale costs 4 bytes beside cols bytes of data (0.1% at 4096 columns).

``q4`` — symmetric 4-bit, one e5m3 scale per group of 32 consecutive columns of a row:
    scale[r, g] = e5m3(bf16(max_{c in g} |w[r, c]| / 7))  (fp32 division, rounded to bf16, then
                                                          to e5m3; each rounding RNE)
    q[r, c]     = clip(rint(w[r, c] / scale[r, g]), -7, 7)  (fp32 division by the scale's value;
                                                          q = 0 where scale == 0)
    w'          = float32(q) * float32(scale[r, g])      (exact: 4 bits x 4 bits fits in fp32)
  e5m3 is an unsigned 8-bit float, the bits 14..7 of an fp16: 5 exponent bits (bias 15), 3
  mantissa bits, subnormals below 2^-14 (q4_scale_codes). Every e5m3 value is exact in bf16, so
  og_set_weight still takes the scales as bf16 (the values above); the library stores the
  one-byte code: 17 bytes per 32 weights instead of 18, 5.6% less to read per token. Given any
  other bf16 scale, the library and dequantize_q4 both round it to e5m3 first.
  What the rounded scale costs: the step moves by at most 2^-4 relative, either way, and the
  codes are chosen against the rounded step, so every weight is still within half a step. On
  Gaussian weights the relative RMS error goes from 9.70% (a bf16 scale) to 9.76%. The group's
  largest magnitude lands on +-7 or, when the scale rounded down, on at most 7.47 -> +-7:
  nothing is clipped.
  Why [-7, 7] and not [-8, 7]: symmetric about zero, the group's largest magnitude maps to +-7
  whatever its sign (no sign-dependent rule) and nothing is clipped, so every weight is within
  half a step of its value; the 16th code (-8) would only refine the negative side. The kernels
  accept -8 (a plain two's-complement nibble) but this quantizer never writes it.
  Why a float scale of few mantissa bits: q * scale is exact in fp32, so the GPU and the
  reference agree on every dequantized weight bit for bit whatever order they multiply in.
  Packing: a group is 16 bytes; byte j holds columns 2j (low nibble) and 2j+1 (high nibble),
  each a two's-complement 4-bit q. A row is ceil(cols / 32) groups: columns past ``cols`` in the
  last group are padding with q = 0 (the matrix is padded, never rejected). Data: uint8
  [rows, ceil(cols / 32) * 16]; scale: bf16 [rows, ceil(cols / 32)] holding e5m3 values.

The input of a q4 GEMV (``quantize_input_q8``) — what the GPU's q4 kernel multiplies the codes by
(cuda/gemv_q4.cu: integer dot products, dp4a): the input vector x (fp32, after the RMSNorm in
the norm-fused GEMVs) in the same groups of 32 columns as the weight row, symmetric int8:
    amax     = max_{c in g} |x[c]|
    scale[g] = amax / 127                        (fp32 division)
    q[c]     = rint(x[c] * (127 / amax))          (fp32 division, then fp32 product; 0 where amax = 0)
  so |q| <= 127 and a group's dot product is scale_w[r, g] * scale[g] * sum_c q_w[r, c] q[c],
  the integer sum exact. A group holding a NaN or an infinity gets scale NaN (the GEMV's output
  is then NaN, as with unquantized inputs). The rounding is uniform in +-scale/2 per element
  (rms scale / sqrt(12), scale = max / 127 of the group): a GEMV's output moves by ~0.5%
  relative (rel. L2) on Gaussian data, against ~10% from the q4 weights themselves
  (tests/test_quant.py measures both: 0.56% and 10.3%).

What is quantized (``quantize``): "dense" = attention q/k/v/o and the dense FFN gate/up/down;
"experts" = the MoE experts' gate/up/down; "all" = both. The embedding table, the norms and the
MoE router (mlp.gate: small, and it decides which experts run) stay as loaded; the lm_head only
with ``quantize_lm_head`` (for tied embeddings a quantized copy named ``lm_head.weight`` is made
from the embedding table, which itself stays bf16 for the gather).
"""
from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

WEIGHT_FORMATS = ("bf16", "int8", "q4")
QUANTIZE_CLASSES = ("all", "dense", "experts")
Q4_GROUP = 32             # columns per q4 scale
Q4_GROUP_BYTES = Q4_GROUP // 2
INT8_MAX = 127
Q4_MAX = 7
SCALE_SUFFIX = ".scale"   # og_set_weight name of a quantized matrix's scales: "<name>.scale"

_F32 = np.float32
_BF16 = np.dtype(ml_dtypes.bfloat16)
_ROW_BLOCK = 2048         # rows per numpy pass: bounds the fp32 temporaries (~2048 x cols x 4 B)


@dataclass(frozen=True)
class QuantizedMatrix:
    """A quantized [rows, cols] weight: ``data`` and ``scale`` as og_set_weight takes them.

    int8: data int8 [rows, cols], scale fp32 [rows].
    q4:   data uint8 [rows, groups * 16] (packed), scale bf16 [rows, groups] (e5m3 values),
          groups = ceil(cols / 32).
    """
    format: str
    shape: tuple[int, int]
    data: np.ndarray
    scale: np.ndarray

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def dequantize(self, rows: slice | None = None) -> np.ndarray:
        """w' [rows, cols] fp32 (optionally a slice of the rows), exactly as the GPU sees it."""
        rows = rows or slice(None)
        if self.format == "int8":
            return dequantize_int8(self.data[rows], self.scale[rows])
        return dequantize_q4(self.data[rows], self.scale[rows], self.shape[1])


# ---- int8 per row ---------------------------------------------------------------------------

def _as_f32(w: np.ndarray, name: str) -> np.ndarray:
    w32 = np.asarray(w, dtype=_F32)
    if w32.ndim != 2:
        raise ValueError(f"{name}: only matrices are quantized, got shape {w32.shape}")
    if w32.size and not np.isfinite(w32).all():
        bad = np.argwhere(~np.isfinite(w32))[0]
        raise ValueError(f"{name}: weight [{bad[0]}, {bad[1]}] is {w32[tuple(bad)]}: cannot quantize a "
                         f"non-finite value")
    return w32


def quantize_int8(w: np.ndarray, name: str = "weight") -> QuantizedMatrix:
    """[rows, cols] bf16 or fp32 -> int8 with one fp32 scale per row (module docstring)."""
    w = np.asarray(w)
    rows, cols = w.shape
    q = np.empty((rows, cols), np.int8)
    scale = np.empty(rows, _F32)
    for r0 in range(0, rows, _ROW_BLOCK):
        block = _as_f32(w[r0:r0 + _ROW_BLOCK], name)
        s = (np.max(np.abs(block), axis=1) / _F32(INT8_MAX)).astype(_F32)
        divisor = np.where(s == 0, _F32(1), s)[:, None]
        qb = np.rint(block / divisor)
        qb[s == 0] = 0
        q[r0:r0 + _ROW_BLOCK] = np.clip(qb, -INT8_MAX, INT8_MAX)
        scale[r0:r0 + _ROW_BLOCK] = s
    return QuantizedMatrix("int8", (rows, cols), q, scale)


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """q [rows, cols] int8, scale [rows] fp32 -> float32(q) * scale [rows, cols] fp32."""
    return q.astype(_F32) * np.asarray(scale, _F32)[:, None]


# ---- q4 in groups of 32 ----------------------------------------------------------------------

def q4_groups(cols: int) -> int:
    return -(-cols // Q4_GROUP)


def q4_scale_codes(scale: np.ndarray) -> np.ndarray:
    """bf16 (or fp32) scales -> their e5m3 codes uint8, as the library stores them (quant.cuh
    q4_scale_code, the same integer steps): the nearest e5m3 value, ties to even, in one rounding
    from the fp32 value; from 63488 (halfway past the largest finite value, 61440) 0xF8, inf;
    NaN 0xFF. ValueError for a negative scale (the library refuses it too)."""
    s = np.asarray(scale).astype(_F32)
    if (s < 0).any():
        bad = np.argwhere(s < 0)[0]
        raise ValueError(f"q4 scale {tuple(int(i) for i in bad)} is negative: {s[tuple(bad)]}")
    mag = s.view(np.uint32) & np.uint32(0x7FFFFFFF)
    exp8 = (mag >> 23).astype(np.int64)
    mag = mag.astype(np.int64)
    # e5m3 normals (exp8 >= 113): rebase the exponent, drop 20 mantissa bits (ties to even).
    x = mag - (112 << 23)
    normal = np.minimum((x + 0x7FFFF + ((x >> 20) & 1)) >> 20, 0xF8)
    # e5m3 subnormals: the value in steps of 2^-17 is sig * 2^(exp8 - 133), shift >= 21.
    sig = (mag & 0x7FFFFF) | 0x800000
    shift = np.clip(133 - exp8, 1, 40)
    q = sig >> shift
    rem = sig & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & (q & 1 == 1)))
    sub = np.where(shift > 24, 0, sub)
    codes = np.where(exp8 >= 113, normal, np.where(exp8 == 0, 0, sub))
    codes = np.where(mag > 0x7F800000, 0xFF, codes)
    return codes.astype(np.uint8)


def q4_scale_values(codes: np.ndarray) -> np.ndarray:
    """e5m3 codes uint8 -> their values fp32 (exact)."""
    return (np.asarray(codes, np.uint8).astype(np.uint16) << np.uint16(7)).view(np.float16).astype(_F32)


def e5m3(scale: np.ndarray) -> np.ndarray:
    """Scales rounded to e5m3 as the library rounds them, fp32."""
    return q4_scale_values(q4_scale_codes(scale))


def quantize_q4(w: np.ndarray, name: str = "weight") -> QuantizedMatrix:
    """[rows, cols] bf16 or fp32 -> packed 4-bit codes with one e5m3 scale (held as bf16) per 32
    columns."""
    w = np.asarray(w)
    rows, cols = w.shape
    groups = q4_groups(cols)
    data = np.empty((rows, groups * Q4_GROUP_BYTES), np.uint8)
    scale = np.empty((rows, groups), _BF16)
    for r0 in range(0, rows, _ROW_BLOCK):
        block = _as_f32(w[r0:r0 + _ROW_BLOCK], name)
        n = block.shape[0]
        padded = np.zeros((n, groups * Q4_GROUP), _F32)     # pad columns are 0 -> q = 0
        padded[:, :cols] = block
        g = padded.reshape(n, groups, Q4_GROUP)
        s32 = e5m3((np.max(np.abs(g), axis=2) / _F32(Q4_MAX)).astype(_F32).astype(_BF16))
        s = s32.astype(_BF16)  # exact
        divisor = np.where(s32 == 0, _F32(1), s32)[:, :, None]
        q = np.clip(np.rint(g / divisor), -Q4_MAX, Q4_MAX).astype(np.int8)
        q[s32 == 0] = 0
        data[r0:r0 + n] = pack_q4(q.reshape(n, groups * Q4_GROUP))
        scale[r0:r0 + n] = s
    return QuantizedMatrix("q4", (rows, cols), data, scale)


def pack_q4(q: np.ndarray) -> np.ndarray:
    """q int [rows, 2k] in [-8, 7] -> uint8 [rows, k]: byte j = (q[2j] & 15) | (q[2j+1] & 15) << 4."""
    u = np.asarray(q).astype(np.uint8) & np.uint8(0x0F)
    return (u[:, 0::2] | (u[:, 1::2] << np.uint8(4))).astype(np.uint8)


def unpack_q4(data: np.ndarray) -> np.ndarray:
    """uint8 [rows, k] -> int8 [rows, 2k]: the two's-complement nibbles, low nibble first."""
    data = np.asarray(data, np.uint8)
    out = np.empty((data.shape[0], 2 * data.shape[1]), np.int8)
    out[:, 0::2] = ((data & 0x0F).astype(np.int8) ^ 8) - 8
    out[:, 1::2] = ((data >> 4).astype(np.int8) ^ 8) - 8
    return out


def dequantize_q4(data: np.ndarray, scale: np.ndarray, cols: int) -> np.ndarray:
    """Packed data [rows, groups * 16], bf16 scale [rows, groups] -> q * e5m3(scale) [rows, cols]
    fp32 (the scale as the library stores it; quantize_q4's scales are e5m3 values already)."""
    q = unpack_q4(data).astype(_F32)                               # [rows, groups * 32]
    s = np.repeat(e5m3(scale), Q4_GROUP, axis=1)                   # [rows, groups * 32]
    return (q * s)[:, :cols]


def quantize_input_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x fp32 [cols] -> (q int8 [groups * 32], scale fp32 [groups]), the q4 GEMV's input (module
    docstring); columns past ``cols`` are zeros. A group with a non-finite value gets scale NaN."""
    x = np.asarray(x, dtype=_F32)
    cols = x.shape[-1]
    groups = q4_groups(cols)
    padded = np.zeros(groups * Q4_GROUP, _F32)
    padded[:cols] = x
    g = padded.reshape(groups, Q4_GROUP)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        finite = np.isfinite(g).all(axis=1)
        amax = np.max(np.abs(np.where(np.isfinite(g), g, _F32(0))), axis=1).astype(_F32)
        scale = np.where(finite, amax / _F32(INT8_MAX), _F32(np.nan)).astype(_F32)
        inv = np.where(amax > 0, _F32(INT8_MAX) / np.where(amax > 0, amax, _F32(1)), _F32(0)).astype(_F32)
        q = np.rint(np.where(np.isfinite(g), g, _F32(0)) * inv[:, None])
    return q.astype(np.int8).reshape(-1), scale


def dequantize_input_q8(x: np.ndarray) -> np.ndarray:
    """x fp32 [cols] -> float32(q) * scale [cols]: the values the q4 GEMV multiplies by (up to
    the fp32 rounding of that product; the kernel keeps q and the scales apart)."""
    cols = np.asarray(x).shape[-1]
    q, scale = quantize_input_q8(x)
    return (q.astype(_F32) * np.repeat(scale, Q4_GROUP))[:cols]


def quantize(w: np.ndarray, fmt: str, name: str = "weight") -> QuantizedMatrix:
    if fmt == "int8":
        return quantize_int8(w, name)
    if fmt == "q4":
        return quantize_q4(w, name)
    raise ValueError(f"weight format {fmt!r} is not a quantized format (int8, q4)")


# ---- which tensors, and a quantizing tensor stream ---------------------------------------------

_DENSE_SUFFIXES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                   "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                   "mlp.down_proj.weight")


def tensor_class(name: str) -> str | None:
    """"dense", "experts", "lm_head" or None (stays as loaded: embedding, norms, router)."""
    if name == "lm_head.weight":
        return "lm_head"
    if not name.startswith("model.layers."):
        return None
    if ".mlp.experts." in name:
        return "experts"
    return "dense" if name.endswith(_DENSE_SUFFIXES) else None


@dataclass(frozen=True)
class WeightScheme:
    """The format of each class of matrices (og_config.weights_dense / _experts / _lm_head)."""
    dense: str = "bf16"
    experts: str = "bf16"
    lm_head: str = "bf16"

    @classmethod
    def make(cls, weights: str = "bf16", quantize: str = "all", quantize_lm_head: bool = False) -> "WeightScheme":
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights={weights!r} is not one of {WEIGHT_FORMATS}")
        if quantize not in QUANTIZE_CLASSES:
            raise ValueError(f"quantize={quantize!r} is not one of {QUANTIZE_CLASSES}")
        return cls(dense=weights if quantize in ("all", "dense") else "bf16",
                   experts=weights if quantize in ("all", "experts") else "bf16",
                   lm_head=weights if quantize_lm_head else "bf16")

    @property
    def is_bf16(self) -> bool:
        return self.dense == self.experts == self.lm_head == "bf16"

    def format_of(self, name: str) -> str:
        cls = tensor_class(name)
        return "bf16" if cls is None else getattr(self, cls)

    def label(self) -> str:
        """Short name: "bf16", "q4" (dense and experts), "q4:experts", "int8:dense"; "+lm" when
        the lm_head is quantized too."""
        if self.dense == self.experts:
            base = self.dense
        elif self.dense == "bf16":
            base = f"{self.experts}:experts"
        elif self.experts == "bf16":
            base = f"{self.dense}:dense"
        else:
            base = f"{self.dense}:dense,{self.experts}:experts"
        return base + ("+lm" if self.lm_head != "bf16" else "")


Tensor = np.ndarray | QuantizedMatrix


def quantize_stream(config, tensors: Iterable[tuple[str, Tensor]], scheme: WeightScheme,
                    workers: int | None = None) -> Iterator[tuple[str, Tensor]]:
    """(name, array) pairs -> the same pairs with the scheme's matrices as QuantizedMatrix, in order.

    A matrix that arrives quantized already (a stream this function made, kept to build another
    engine from) passes through when its format is the one the scheme names for it; any other
    format is a ValueError naming the tensor. With a tied embedding and a quantized lm_head,
    ("lm_head.weight", quantized copy of the embedding) ends the stream unless the stream
    carried an lm_head of its own. Tensors are quantized on a thread pool (numpy releases the
    GIL) with a bounded look-ahead, so memory stays a few tensors deep."""
    if scheme.is_bf16:
        yield from tensors
        return

    def work(item):
        name, array = item
        fmt = scheme.format_of(name)
        if isinstance(array, QuantizedMatrix):
            if array.format != fmt:
                raise ValueError(f"tensor '{name}' arrives quantized as {array.format}, but the "
                                 f"weights {scheme.label()} make it {fmt}")
            return name, array
        return name, array if fmt == "bf16" else quantize(array, fmt, name)

    tied_copy = scheme.lm_head != "bf16" and config.tie_word_embeddings
    embedding, has_lm_head = None, False  # the embedding is kept only for a tied copy
    workers = workers or min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque = deque()
        for item in tensors:
            if tied_copy and item[0] == "model.embed_tokens.weight":
                embedding = item[1]
            has_lm_head |= item[0] == "lm_head.weight"
            pending.append(pool.submit(work, item))
            if len(pending) > 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    if embedding is not None and not has_lm_head:
        yield "lm_head.weight", quantize(embedding, scheme.lm_head, "lm_head.weight")
