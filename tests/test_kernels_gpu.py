"""The library's non-MoE kernels, one family at a time, against float64 references written
here: embedding gather, bf16 GEMV (plain, RMSNorm fused in front, residual, RMSNorm + gate/up
+ SwiGLU), QK-norm + RoPE + KV-cache write, split-KV decode attention.

Each kernel runs through its test entry point (cuda/onegraph_testing.h via
tests/capi_testing.py, the testing library): inputs uploaded, one launch as the decode body makes it,
synchronize, outputs downloaded. Sizes are awkward on purpose: columns that are not multiples
of the 8-element row padding, single rows, one KV head, every GQA ratio, visible lengths at
split boundaries. Inputs are fresh random numbers (never zeros); outputs are NaN-poisoned
before each launch and cache rows the kernel must not touch are poisoned too, so an element
written or read where it should not be shows up.

Tolerance, stated once: |got - ref| <= (depth + SLACK) * U * scale, the first-order bound of
a floating-point sum evaluated with at most `depth` roundings per term, where U = 2^-24 (fp32
unit roundoff), `scale` = the sum of the absolute values of the terms, `depth` follows each
kernel's summation order (see the helpers), and SLACK covers the elementwise fp32 steps
(expf, sqrtf, divisions: a few ulp each). The reference is float64 on the same
(bf16-rounded, int8-dequantized) inputs. A real bug (a dropped chunk, a wrong row or head, a
pad read as data, a missed position) moves results by far more than these bounds.
int8 KV quantization must match runtime/reference.py's kv_quantize_int8 exactly (same q,
same scale bits) for the same fp32 input.
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from gpu_support import require_gpu
from onegraph import capi
import capi_testing as ct
from onegraph.reference import kv_quantize_int8, rope_inv_freq

pytestmark = pytest.mark.gpu

U = 2.0 ** -24
SLACK = 16
BF16_U = 2.0 ** -8  # bf16 unit roundoff (8 significant bits)


@pytest.fixture(scope="module", autouse=True)
def _gpu():
    require_gpu()
    ct.load()


def rng_for(*key) -> np.random.Generator:
    """A generator seeded from the test's parameters (stable across processes)."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def random_bf16(rng, shape, scale=1.0):
    """(bits, exact fp64 values) of a random bf16 array."""
    bits = ct.bf16_bits(rng.standard_normal(shape).astype(np.float32) * np.float32(scale))
    return bits, ct.bf16_to_f32(bits).astype(np.float64)


def gemv_depth(cols: int) -> int:
    """GEMV summation depth: each lane chains 8 fmas per 16-byte chunk over
    ceil(chunks / 32) chunks, then a 5-level warp butterfly."""
    chunks = math.ceil(cols / 8)
    return 8 * math.ceil(chunks / 32) + 5


def sumsq_depth(n: int, threads: int = 64) -> int:
    """Block sum of squares: a per-thread chain (blocks of 64 threads or more), a warp
    butterfly, then at most 8 warps in sequence."""
    return math.ceil(n / threads) + 5 + 8


def assert_within(got, ref, tol, what):
    got = np.asarray(got, dtype=np.float64)
    assert not np.isnan(got).any(), f"{what}: NaN in output (unwritten element?)"
    err = np.abs(got - ref)
    bad = err > tol
    if bad.any():
        i = np.flatnonzero(bad.ravel())[0]
        pytest.fail(f"{what}: {bad.sum()} of {bad.size} elements out of tolerance; first at flat "
                    f"index {i}: got {got.ravel()[i]!r}, want {ref.ravel()[i]!r}, "
                    f"|err| {err.ravel()[i]:.3g} > tol {np.broadcast_to(tol, err.shape).ravel()[i]:.3g}")


def ref_rmsnorm(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


# ---- embedding -----------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", [1, 7, 8, 13, 100, 1000, 4097])
def test_embedding_gather_is_exact(hidden):
    rng = rng_for("embed", hidden)
    vocab = 5
    bits, values = random_bf16(rng, (vocab, hidden))
    for token in (0, 2, vocab - 1):
        x = ct.embedding(bits, token)
        np.testing.assert_array_equal(x, values[token].astype(np.float32))


# ---- greedy argmax (OG_OUTPUT_NEXT_TOKEN) ---------------------------------------------------
def argmax_cases(n, rng):
    """Logit vectors of length n whose argmax tests one rule each (numpy.argmax decides)."""
    base = rng.standard_normal(n).astype(np.float32)
    cases = {"random": base}
    if n > 1:
        tied = base.copy()  # equal maxima far apart (other blocks): the lowest id wins
        for i in (n - 1, n // 2, n // 3 + 1):
            tied[i] = 9.0
        cases["ties"] = tied
        last = base.copy()
        last[-1] = 50.0
        cases["last"] = last
        nan = base.copy()  # NaN counts as the largest: the first NaN wins, even against +inf
        nan[0] = np.inf
        nan[n - 1] = np.nan
        nan[(2 * n) // 3] = np.nan
        cases["nan"] = nan
    cases["all -inf"] = np.full(n, -np.inf, np.float32)
    cases["all equal"] = np.full(n, -3.5, np.float32)
    cases["signed zeros"] = np.where(np.arange(n) % 2 == 0, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    return cases


@pytest.mark.parametrize("n", [1, 2, 255, 2047, 2048, 2049, 151936, 256 * 2048 + 77])
def test_argmax_matches_numpy(n):
    rng = rng_for("argmax", n)
    for name, logits in argmax_cases(n, rng).items():
        token, logit = ct.argmax(logits, launches=3)  # the ticket must reset between launches
        want = int(np.argmax(logits))
        assert token == want, f"{name}: token {token}, numpy {want}"
        assert np.array_equal(np.float32(logit), logits[want], equal_nan=True), name


# ---- GEMV ------------------------------------------------------------------------------------
GEMV_SHAPES = [  # (rows, cols)
    (1, 1), (1, 7), (2, 8), (3, 13), (17, 100), (64, 257), (1000, 1000), (5, 4100),
    (4096, 1024),        # qwen3-0.6b fused QKV
    (64, 12289),         # x needs more than 48 KB of shared memory (opt-in limit)
    (20001, 64),         # more row pairs than resident warps: the grid-stride loop
]


@pytest.mark.parametrize("rows,cols", GEMV_SHAPES)
def test_gemv_plain(rows, cols):
    rng = rng_for("gemv", rows, cols)
    bits, w = random_bf16(rng, (rows, cols))
    x = rng.standard_normal(cols).astype(np.float32)
    y = ct.gemv(bits, x)
    terms = w * x.astype(np.float64)
    assert_within(y, terms.sum(axis=1), (gemv_depth(cols) + SLACK) * U * np.abs(terms).sum(axis=1),
                  f"gemv {rows}x{cols}")
    np.testing.assert_array_equal(ct.gemv(bits, x), y)  # bit-identical rerun


@pytest.mark.parametrize("rows,cols", GEMV_SHAPES)
def test_gemv_residual(rows, cols):
    rng = rng_for("gemv_residual", rows, cols)
    bits, w = random_bf16(rng, (rows, cols))
    x = rng.standard_normal(cols).astype(np.float32)
    y0 = rng.standard_normal(rows).astype(np.float32)
    y = ct.gemv_residual(bits, x, y0)
    terms = w * x.astype(np.float64)
    ref = y0.astype(np.float64) + terms.sum(axis=1)
    tol = (gemv_depth(cols) + SLACK) * U * (np.abs(terms).sum(axis=1) + np.abs(y0))
    assert_within(y, ref, tol, f"gemv+residual {rows}x{cols}")


@pytest.mark.parametrize("rows,cols", GEMV_SHAPES)
def test_gemv_rmsnorm(rows, cols):
    rng = rng_for("gemv_norm", rows, cols)
    bits, w = random_bf16(rng, (rows, cols))
    x = (rng.standard_normal(cols) * 3.0).astype(np.float32)
    norm_w = (1.0 + 0.5 * rng.standard_normal(cols)).astype(np.float32)
    eps = 1e-6
    y, normed = ct.gemv_rmsnorm(bits, x, norm_w, eps)
    n_ref = ref_rmsnorm(x, norm_w.astype(np.float64), eps)
    norm_depth = sumsq_depth(cols) + SLACK
    assert_within(normed, n_ref, norm_depth * U * np.abs(n_ref), f"rmsnorm n={cols}")
    terms = w * n_ref
    tol = (gemv_depth(cols) + norm_depth + SLACK) * U * np.abs(terms).sum(axis=1)
    assert_within(y, terms.sum(axis=1), tol, f"rmsnorm+gemv {rows}x{cols}")


@pytest.mark.parametrize("inter,cols", [(1, 1), (1, 7), (3, 13), (100, 1000), (37, 4100),
                                        (3072, 1024), (8, 12289)])
def test_gemv_rmsnorm_swiglu(inter, cols):
    rng = rng_for("swiglu", inter, cols)
    bits, w = random_bf16(rng, (2 * inter, cols), scale=2.0 / math.sqrt(cols))  # gate ~ N(0, 4)
    x = rng.standard_normal(cols).astype(np.float32)
    norm_w = (1.0 + 0.5 * rng.standard_normal(cols)).astype(np.float32)
    eps = 1e-5
    act = ct.gemv_rmsnorm_swiglu(bits, x, norm_w, eps)
    n_ref = ref_rmsnorm(x, norm_w.astype(np.float64), eps)
    gate_terms, up_terms = w[:inter] * n_ref, w[inter:] * n_ref
    g, u = gate_terms.sum(axis=1), up_terms.sum(axis=1)
    silu = g / (1.0 + np.exp(-g))
    ref = silu * u
    depth = gemv_depth(cols) + sumsq_depth(cols) + SLACK
    dg = depth * U * np.abs(gate_terms).sum(axis=1)
    du = depth * U * np.abs(up_terms).sum(axis=1)
    tol = 1.1 * dg * np.abs(u) + np.abs(silu) * du + SLACK * U * np.abs(ref)  # |silu'| <= 1.1
    assert_within(act, ref, tol, f"rmsnorm+gate/up+swiglu inter={inter} cols={cols}")


# ---- QK-norm + RoPE + KV write ---------------------------------------------------------------
KV_DTYPES = [ct.OG_KV_F32, ct.OG_KV_BF16, ct.OG_KV_INT8]
KV_NAMES = {ct.OG_KV_F32: "f32", ct.OG_KV_BF16: "bf16", ct.OG_KV_INT8: "int8"}


def poisoned_cache(rng, kv_dtype, n_kv, max_seq, hd):
    """(k, v, k_scales, v_scales) filled with values that must not change (NaN where the
    element type has one)."""
    shape = (n_kv, max_seq, hd)
    if kv_dtype == ct.OG_KV_F32:
        return np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32), None, None
    if kv_dtype == ct.OG_KV_BF16:
        return np.full(shape, 0x7FC1, np.uint16), np.full(shape, 0x7FC1, np.uint16), None, None
    k = rng.integers(-128, 128, shape, dtype=np.int8)
    v = rng.integers(-128, 128, shape, dtype=np.int8)
    return k, v, np.full(shape[:2], np.nan, np.float32), np.full(shape[:2], np.nan, np.float32)


def same_bits(a, b) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def ref_rope(x, position, inv_freq):
    """x [heads, hd] float64; the angle is the fp32 product, as on the device."""
    angle = (np.float32(position) * inv_freq).astype(np.float64)
    cos, sin = np.cos(angle), np.sin(angle)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    pair_scale = np.concatenate([np.abs(x1) + np.abs(x2)] * 2, axis=-1)
    return out, pair_scale


ROPE_CASES = [  # (n_heads, n_kv, head_dim, max_seq_len, positions)
    (4, 2, 64, 9, (0, 1, 7, 8)),
    (8, 1, 128, 5, (0, 3, 4)),
    (2, 2, 16, 3, (0, 2)),
    (6, 3, 40, 4, (1, 3)),
    (2, 1, 256, 2, (1,)),
    (5, 1, 24, 4, (0, 3)),
    (6, 3, 20, 3, (2,)),
    (2, 1, 64, 32768, (32767,)),  # large angles: sincosf's slow range reduction
]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=lambda k: KV_NAMES[k])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qknorm", "noqknorm"])
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"h{c[0]}kv{c[1]}d{c[2]}")
def test_qk_norm_rope_kv(case, qk_norm, kv_dtype):
    n_heads, n_kv, hd, max_seq, positions = case
    rng = rng_for("rope", case, qk_norm, kv_dtype)
    inv_freq = rope_inv_freq(hd, 1e6 if hd != 16 else 1e4, 1.0)
    eps = 1e-6
    q_size, kv_size = n_heads * hd, n_kv * hd
    for position in positions:
        qkv = (rng.standard_normal(q_size + 2 * kv_size) * 2.0).astype(np.float32)
        q_norm = (1.0 + 0.3 * rng.standard_normal(hd)).astype(np.float32) if qk_norm else None
        k_norm = (1.0 + 0.3 * rng.standard_normal(hd)).astype(np.float32) if qk_norm else None
        k0, v0, ks0, vs0 = poisoned_cache(rng, kv_dtype, n_kv, max_seq, hd)
        qkv_out, k, v, ks, vs = ct.qk_norm_rope_kv(qkv, n_heads, n_kv, hd, q_norm, k_norm, eps,
                                                   inv_freq, position, k0, v0, ks0, vs0, kv_dtype)
        what = f"position {position}"
        # Other cache rows and the k/v parts of qkv are untouched.
        others = [r for r in range(max_seq) if r != position]
        assert same_bits(k[:, others], k0[:, others]) and same_bits(v[:, others], v0[:, others]), what
        if kv_dtype == ct.OG_KV_INT8:
            assert same_bits(ks[:, others], ks0[:, others]) and same_bits(vs[:, others], vs0[:, others])
        assert same_bits(qkv_out[q_size:], qkv[q_size:]), what

        q_in = qkv[:q_size].reshape(n_heads, hd).astype(np.float64)
        k_in = qkv[q_size:q_size + kv_size].reshape(n_kv, hd).astype(np.float64)
        v_in = qkv[q_size + kv_size:].reshape(n_kv, hd)
        depth = sumsq_depth(hd, threads=128) + SLACK
        if qk_norm:
            q_in = ref_rmsnorm(q_in, q_norm.astype(np.float64), eps)
            k_in = ref_rmsnorm(k_in, k_norm.astype(np.float64), eps)
        q_ref, q_scale = ref_rope(q_in, position, inv_freq)
        k_ref, k_scale = ref_rope(k_in, position, inv_freq)
        assert_within(qkv_out[:q_size].reshape(n_heads, hd), q_ref, depth * U * q_scale, f"q {what}")

        k_row, v_row = k[:, position], v[:, position]
        k_tol = depth * U * k_scale
        if kv_dtype == ct.OG_KV_F32:
            assert_within(k_row, k_ref, k_tol, f"k {what}")
            assert same_bits(v_row, v_in), f"v {what}: f32 cache must hold v exactly"
        elif kv_dtype == ct.OG_KV_BF16:
            assert_within(ct.bf16_to_f32(k_row), k_ref, k_tol + BF16_U * np.abs(k_ref), f"k {what}")
            assert same_bits(v_row, ct.bf16_bits(v_in)), f"v {what}: not round-to-nearest-even bf16"
        else:
            q_want, s_want = kv_quantize_int8(v_in)
            assert same_bits(v_row, q_want), f"v {what}: int8 values differ from the reference"
            assert same_bits(vs[:, position], s_want), f"v {what}: int8 scales differ"
            amax = np.abs(k_ref).max(axis=1)
            # |amax error| <= 2 * the element bound (|x1| + |x2| <= 2 max|k|), plus the division
            assert_within(ks[:, position], amax / 127, (2 * depth + SLACK) * U * amax / 127,
                          f"k scale {what}")
            deq = k_row.astype(np.float64) * ks[:, position, None]
            assert_within(deq, k_ref, (0.5 + 1e-4) * ks[:, position, None] + k_tol,
                          f"k int8 {what}")
        if position == 0 and not qk_norm:
            # At angle 0 the rotation is exact: k is stored from the raw input.
            k_raw = qkv[q_size:q_size + kv_size].reshape(n_kv, hd)
            if kv_dtype == ct.OG_KV_INT8:
                q_want, s_want = kv_quantize_int8(k_raw)
                assert same_bits(k_row, q_want) and same_bits(ks[:, 0], s_want), "k int8 at 0"
            elif kv_dtype == ct.OG_KV_BF16:
                assert same_bits(k_row, ct.bf16_bits(k_raw)), "k bf16 at 0"
            else:
                assert same_bits(k_row, k_raw), "k f32 at 0"


def test_int8_quantization_of_a_zero_row():
    # A head whose k and v are all zero: q = 0 and scale = 0, as the reference.
    n_heads, n_kv, hd = 2, 1, 16
    qkv = np.ones((n_heads + 2 * n_kv) * hd, np.float32)
    qkv[n_heads * hd:] = 0.0
    k0, v0, ks0, vs0 = poisoned_cache(np.random.default_rng(1), ct.OG_KV_INT8, n_kv, 2, hd)
    _, k, v, ks, vs = ct.qk_norm_rope_kv(qkv, n_heads, n_kv, hd, None, None, 1e-6,
                                         rope_inv_freq(hd, 1e4), 1, k0, v0, ks0, vs0, ct.OG_KV_INT8)
    assert (k[:, 1] == 0).all() and (v[:, 1] == 0).all()
    assert ks[0, 1] == 0.0 and vs[0, 1] == 0.0


# ---- attention ------------------------------------------------------------------------------
ATTN_SHAPES = [  # (n_heads, n_kv, head_dim): GQA ratios 1, 2, 4, 8, 16 and 5; head_dim
    # 64 / 128 / 256 take the vector path, others (the tiny test models' 16, 20, 24) the
    # generic one
    (4, 4, 64), (8, 4, 128), (16, 4, 128), (8, 1, 64), (16, 1, 128), (6, 2, 40), (4, 2, 256),
    (5, 1, 24), (6, 3, 20), (6, 2, 16),
]


def random_cache(rng, kv_dtype, n_kv, max_seq, hd, visible_len):
    """(k, v, k_scales, v_scales, k_values, v_values): random rows [0, visible_len), poison
    after; *_values are the fp32-dequantized rows as float64 (what the kernel must read)."""
    shape = (n_kv, max_seq, hd)
    k_scales = v_scales = None
    if kv_dtype == ct.OG_KV_F32:
        k = rng.standard_normal(shape).astype(np.float32)
        v = rng.standard_normal(shape).astype(np.float32)
        k[:, visible_len:] = np.nan
        v[:, visible_len:] = np.nan
        kv, vv = k, v
    elif kv_dtype == ct.OG_KV_BF16:
        k = ct.bf16_bits(rng.standard_normal(shape).astype(np.float32))
        v = ct.bf16_bits(rng.standard_normal(shape).astype(np.float32))
        k[:, visible_len:] = 0x7FC1
        v[:, visible_len:] = 0x7FC1
        kv, vv = ct.bf16_to_f32(k), ct.bf16_to_f32(v)
    else:
        k = rng.integers(-127, 128, shape, dtype=np.int8)
        v = rng.integers(-127, 128, shape, dtype=np.int8)
        k_scales = rng.uniform(0.005, 0.02, shape[:2]).astype(np.float32)
        v_scales = rng.uniform(0.5, 2.0, shape[:2]).astype(np.float32) / 127
        k_scales[:, visible_len:] = np.nan
        v_scales[:, visible_len:] = np.nan
        kv = k.astype(np.float32) * k_scales[..., None]  # fp32 products, as on the device
        vv = v.astype(np.float32) * v_scales[..., None]
    return k, v, k_scales, v_scales, kv.astype(np.float64), vv.astype(np.float64)


def ref_attention(q, k_values, v_values, n_heads, visible_len, split_len, v_scales=None):
    """(out [n_heads * hd] float64, tolerance) for the first visible_len rows. v_scales
    [n_kv, rows] (int8 V): the tolerance of the fold on the tensor cores, whose weights p *
    v_scale are fp16 pairs (hi + lo) scaled to their head's largest: a weight below 2^-38 of that
    largest reads as zero, which may be all of an element whose larger rows hold code 0."""
    n_kv, _, hd = k_values.shape
    group = n_heads // n_kv
    q = q.astype(np.float64).reshape(n_heads, hd)
    out = np.empty((n_heads, hd))
    tol = np.empty((n_heads, hd))
    for h in range(n_heads):
        kv_head = h // group
        k = k_values[kv_head, :visible_len]
        v = v_values[kv_head, :visible_len]
        terms = k * q[h]
        scores = terms.sum(axis=1) / math.sqrt(hd)
        p = np.exp(scores - scores.max())
        p /= p.sum()
        out[h] = p @ v
        # score error: a chain of hd fmas per score; softmax doubles it (score and max);
        # the p.V sums and the split combine add at most visible_len + n_splits roundings.
        score_err = (hd + SLACK) * U * (np.abs(terms).sum(axis=1) / math.sqrt(hd)).max()
        n_splits = math.ceil(visible_len / split_len)
        rel = 2 * score_err + (visible_len + n_splits + SLACK) * U
        tol[h] = rel * (p @ np.abs(v)) + 1e-30
        if v_scales is not None:
            tol[h] += visible_len * 2.0 ** -38 * 127 * (p * v_scales[kv_head, :visible_len]).max()
    return out.ravel(), tol.ravel()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=lambda k: KV_NAMES[k])
@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}")
def test_attention_split_boundaries(shape, kv_dtype):
    n_heads, n_kv, hd = shape
    max_seq, split = 200, 32  # 7 splits, the last one partial
    rng = rng_for("attn", shape, kv_dtype)
    for visible_len in (1, 2, 31, 32, 33, 64, 65, 199, 200):
        k, v, ks, vs, kv, vv = random_cache(rng, kv_dtype, n_kv, max_seq, hd, visible_len)
        q = rng.standard_normal(n_heads * hd).astype(np.float32)
        out, used_split, n_splits = ct.attention(q, k, v, ks, vs, n_heads, visible_len, split, kv_dtype)
        assert used_split == split and n_splits == math.ceil(max_seq / split)
        ref, tol = ref_attention(q, kv, vv, n_heads, visible_len, split)
        assert_within(out, ref, tol, f"attention len={visible_len}")
        again, _, _ = ct.attention(q, k, v, ks, vs, n_heads, visible_len, split, kv_dtype)
        assert same_bits(again, out), f"len={visible_len}: not bit-identical run to run"


# The plans' kinds (capi_testing BAND_*) and the groups of query heads a KV head whose int8 rows
# of 128 dims each folds on the tensor cores.
BANDS = {ct.BAND_SHORT: (), ct.BAND_LONG: (4, 8), ct.BAND_LONG_TC: (2, 4, 8), ct.BAND_LONG_CUDA: ()}
BAND_NAMES = {ct.BAND_SHORT: "short-band", ct.BAND_LONG: "long-band", ct.BAND_LONG_TC: "long-band-tc",
              ct.BAND_LONG_CUDA: "long-band-cuda"}


@pytest.mark.parametrize("band", list(BANDS), ids=lambda b: BAND_NAMES[b])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=lambda k: KV_NAMES[k])
@pytest.mark.parametrize("n_heads,n_kv", [(16, 8), (32, 8), (32, 4)], ids=["0.6b", "8b", "30b-a3b"])
def test_attention_full_context_engine_split(n_heads, n_kv, kv_dtype, band):
    # The qwen3-0.6b, 8B and 30B-A3B attention shapes over a full 4096-row cache, split length
    # as the engine picks, in either attention band. In the long band the 8B and 30B-A3B
    # shapes' int8 rows fold on the tensor cores (a KV head's 4 or 8 query heads in one group),
    # and the 0.6b shape's 2 too where the band asks for the tensor cores wherever compiled;
    # everything else on the CUDA cores.
    hd, max_seq = 128, 4096
    plan = ct.attention_plan(n_heads, n_kv, hd, max_seq, kv_dtype, band=band)
    tensor_cores = kv_dtype == ct.OG_KV_INT8 and n_heads // n_kv in BANDS[band]
    assert plan["tensor_cores"] == tensor_cores, plan
    assert not tensor_cores or plan["head_group"] == n_heads // n_kv, plan
    rng = rng_for("attn_full", n_heads, n_kv, kv_dtype)
    for visible_len in (max_seq, 1000, 1):
        k, v, ks, vs, kv, vv = random_cache(rng, kv_dtype, n_kv, max_seq, hd, visible_len)
        q = rng.standard_normal(n_heads * hd).astype(np.float32)
        out, split, n_splits = ct.attention(q, k, v, ks, vs, n_heads, visible_len, 0, kv_dtype, band=band)
        assert split % 32 == 0 and split * n_splits >= max_seq > split * (n_splits - 1)
        ref, tol = ref_attention(q, kv, vv, n_heads, visible_len, split)
        assert_within(out, ref, tol, f"attention len={visible_len} split={split}")


@pytest.mark.parametrize("n_heads", [8, 16, 32], ids=["group-2", "group-4", "group-8"])
def test_attention_tensor_cores_across_scales(n_heads):
    # The tensor-core fold scales q and the weights p * v_scale per head by powers of two into
    # fp16's range: query heads 10^-3 .. 10^3 apart, and V scales growing 10^6-fold down the
    # rows (each new tile lowers the weights' scale and rescales the sums) or shrinking, against
    # the float64 reference within the CUDA cores' error bound plus the fp16 weights' floor
    # (ref_attention). Groups of 2, 4 and 8 query heads a KV head.
    n_kv, hd, max_seq, split = 4, 128, 600, 64
    plan = ct.attention_plan(n_heads, n_kv, hd, max_seq, ct.OG_KV_INT8, split, band=ct.BAND_LONG_TC)
    assert plan["tensor_cores"] and plan["head_group"] == n_heads // n_kv, plan
    rng = rng_for("attn_tc_scales", n_heads)
    head_scale = np.repeat(10.0 ** rng.uniform(-3, 3, n_heads), hd).astype(np.float32)
    for order in (1, -1):
        for visible_len in (1, 17, 255, 600):
            k, v, ks, vs, _, _ = random_cache(rng, ct.OG_KV_INT8, n_kv, max_seq, hd, visible_len)
            vs[:, :visible_len] *= np.logspace(-3, 3, visible_len)[::order].astype(np.float32)
            kv = k.astype(np.float32) * ks[..., None]
            vv = v.astype(np.float32) * vs[..., None]
            q = (rng.standard_normal(n_heads * hd) * head_scale).astype(np.float32)
            out, used_split, _ = ct.attention(q, k, v, ks, vs, n_heads, visible_len, split, ct.OG_KV_INT8,
                                              band=ct.BAND_LONG_TC)
            assert used_split == split
            ref, tol = ref_attention(q, kv.astype(np.float64), vv.astype(np.float64), n_heads, visible_len, split,
                                     v_scales=vs.astype(np.float64))
            assert_within(out, ref, tol, f"attention len={visible_len} order={order}")


# A cache no longer than a few chunks (the engine's chunking, head_dim 64 or 128): the plan gives
# each query head blocks of its own (head group 1) where that still leaves a block per chunk; a
# long cache keeps the widest group. (n_heads, n_kv, hd): the 8B, 0.6b, 30B-A3B and SmolLM2-135M
# attention shapes.
SHORT_CACHE_SHAPES = [(32, 8, 128), (16, 8, 128), (32, 4, 128), (8, 1, 128), (9, 3, 64)]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=lambda k: KV_NAMES[k])
@pytest.mark.parametrize("n_heads,n_kv,hd", SHORT_CACHE_SHAPES)
def test_attention_short_cache_head_group_one(n_heads, n_kv, hd, kv_dtype):
    max_seq = 97  # the default bench's cache: 32 prompt + 64 decoded rows
    plan = ct.attention_plan(n_heads, n_kv, hd, max_seq, kv_dtype, band=ct.BAND_SHORT)
    assert plan["head_group"] == 1, plan
    long_plan = ct.attention_plan(n_heads, n_kv, hd, 8192 + 16, kv_dtype, band=ct.BAND_SHORT)
    assert long_plan["head_group"] > 1 or n_heads == n_kv, long_plan
    rng = rng_for("attn_short", n_heads, n_kv, hd, kv_dtype)
    for visible_len in (1, 31, 64, 97):
        k, v, ks, vs, kv, vv = random_cache(rng, kv_dtype, n_kv, max_seq, hd, visible_len)
        q = rng.standard_normal(n_heads * hd).astype(np.float32)
        out, split, _ = ct.attention(q, k, v, ks, vs, n_heads, visible_len, 0, kv_dtype, band=ct.BAND_SHORT)
        ref, tol = ref_attention(q, kv, vv, n_heads, visible_len, split)
        assert_within(out, ref, tol, f"attention len={visible_len} head group 1")
        again, _, _ = ct.attention(q, k, v, ks, vs, n_heads, visible_len, 0, kv_dtype, band=ct.BAND_SHORT)
        assert same_bits(again, out), f"len={visible_len}: not bit-identical run to run"


@pytest.mark.parametrize("kv_dtype,hd,ratio", [(ct.OG_KV_INT8, 64, 2), (ct.OG_KV_INT8, 128, 1), (ct.OG_KV_BF16, 64, 1)],
                         ids=["int8-64", "int8-128", "bf16-64"])
def test_short_band_tiles(kv_dtype, hd, ratio):
    # The default chunk is a tile a warp. The short band folds int8 rows of 64 dims in tiles of
    # half the long band's rows, so its chunk is half as long; other formats and head dims keep
    # the long band's tiles (test_attention_short_cache_head_group_one checks the results).
    short = ct.attention_plan(9, 3, hd, 4096, kv_dtype, band=ct.BAND_SHORT)["split_len"]
    long = ct.attention_plan(9, 3, hd, 4096, kv_dtype, band=ct.BAND_LONG_CUDA)["split_len"]
    assert long == ratio * short, (short, long)


def test_attention_rejects_bad_arguments():
    q = np.ones(8, np.float32)
    k = np.ones((1, 4, 8), np.float32)
    with pytest.raises(capi.LibraryError) as err:
        ct.attention(q, k, k, None, None, 1, 5, 0, ct.OG_KV_F32)  # visible_len > max_seq_len
    assert err.value.status == capi.OG_E_INVALID_ARGUMENT
