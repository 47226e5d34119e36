"""ctypes binding of cuda/onegraph_testing.h (the kernel test entry points), one to one,
plus thin numpy wrappers the kernel tests call.

The entry points live in the testing library, libonegraph_testing.so (``build.py --testing``:
the product's sources compiled with -DOG_TESTING plus cuda/*testing*.cu); the product library
has none of them. An engine handle belongs to the library that made it, so the engine and the
hooks must come from the same library: importing this module points $ONEGRAPH_LIB at the
testing library (unless it is set already) before `onegraph.capi.load_library()` loads one,
and the tests (tests/conftest.py) and the diagnostic scripts import it first.

Each C declaration is repeated as a comment above its binding; argtypes and restype are
set once, in `_bind`. Failures raise `capi.LibraryError` with the library's message.
The wrappers fill every output with NaN before the call unless the caller passes its own
buffer, so an element a kernel fails to write shows up.
"""
from __future__ import annotations

import ctypes
import functools
import os
from ctypes import POINTER, c_double, c_float, c_int32, c_int64, c_uint16, c_uint64, c_void_p

import numpy as np

from onegraph import capi

TESTING_LIB_NAME = "libonegraph_testing.so"
TESTING_LIBRARY = os.path.join(capi.PACKAGE_LIB_DIR, TESTING_LIB_NAME)
os.environ.setdefault("ONEGRAPH_LIB", TESTING_LIBRARY)

OG_KV_F32, OG_KV_BF16, OG_KV_INT8 = capi.OG_KV_F32, capi.OG_KV_BF16, capi.OG_KV_INT8
KV_NUMPY_DTYPES = {OG_KV_F32: np.float32, OG_KV_BF16: np.uint16, OG_KV_INT8: np.int8}

_bound: dict = {}  # binder -> the library with that binder's functions declared


def _declare(lib: ctypes.CDLL, name: str, *argtypes) -> None:
    """Declare the og_status function `name`: int32 result, these argument types."""
    f = getattr(lib, name)
    f.restype = c_int32
    f.argtypes = list(argtypes)


def _bound_library(binder) -> ctypes.CDLL:
    """The library with `binder`'s declarations made (once; raises capi.LibraryUnavailable)."""
    if binder not in _bound:
        lib = capi.load_library()
        if not hasattr(lib, "og_test_embedding"):
            raise capi.LibraryUnavailable(
                f"{capi.library_path()} has no og_test_* entry points: the tests need the testing "
                f"library ({TESTING_LIB_NAME}, 'python build.py --testing'), loaded before any engine")
        binder(lib)
        _bound[binder] = lib
    return _bound[binder]


def _bind(lib: ctypes.CDLL) -> None:
    fn = functools.partial(_declare, lib)
    P_f32, P_u16, P_i32 = POINTER(c_float), POINTER(c_uint16), POINTER(c_int32)

    # og_status og_test_embedding(const uint16_t *table, int32_t vocab, int32_t hidden,
    #                             int32_t token, float *x);
    fn("og_test_embedding", P_u16, c_int32, c_int32, c_int32, P_f32)
    # og_status og_test_argmax(const float *logits, int32_t n, int32_t launches, int32_t *token,
    #                          float *logit);
    fn("og_test_argmax", P_f32, c_int32, c_int32, P_i32, P_f32)
    # og_status og_test_gemv(const uint16_t *weight, int32_t rows, int32_t cols,
    #                        const float *x, float *y);
    fn("og_test_gemv", P_u16, c_int32, c_int32, P_f32, P_f32)
    # og_status og_test_gemv_rmsnorm(const uint16_t *weight, int32_t rows, int32_t cols,
    #                                const float *x, const float *norm_weight, float eps,
    #                                float *y, float *normed);
    fn("og_test_gemv_rmsnorm", P_u16, c_int32, c_int32, P_f32, P_f32, c_float, P_f32, P_f32)
    # og_status og_test_gemv_residual(const uint16_t *weight, int32_t rows, int32_t cols,
    #                                 const float *x, float *y);
    fn("og_test_gemv_residual", P_u16, c_int32, c_int32, P_f32, P_f32)
    # og_status og_test_gemv_rmsnorm_swiglu(const uint16_t *gate_up, int32_t inter,
    #                                       int32_t cols, const float *x,
    #                                       const float *norm_weight, float eps, float *act);
    fn("og_test_gemv_rmsnorm_swiglu", P_u16, c_int32, c_int32, P_f32, P_f32, c_float, P_f32)
    # og_status og_test_gemv_quant(int32_t format, int32_t mode, const void *weight,
    #                              const void *scales, int32_t rows, int32_t cols,
    #                              const float *x, const float *norm_weight, float eps,
    #                              float *y, float *normed, int32_t bulk_stream);
    fn("og_test_gemv_quant", c_int32, c_int32, c_void_p, c_void_p, c_int32, c_int32, P_f32, P_f32,
       c_float, P_f32, P_f32, c_int32)
    # og_status og_test_gemv_q4_stream(int32_t mode, int32_t rows, int32_t cols, int32_t bulk_stream,
    #                                  int32_t *stream);
    fn("og_test_gemv_q4_stream", c_int32, c_int32, c_int32, c_int32, P_i32)
    # og_status og_test_gemv_quant_split(int32_t format, int32_t mode, int32_t rows, int32_t cols,
    #                                    int32_t *warps);
    fn("og_test_gemv_quant_split", c_int32, c_int32, c_int32, c_int32, P_i32)
    # og_status og_test_gemm(const uint16_t *a, const uint16_t *a_lo, const uint16_t *w,
    #                        int32_t rows, int32_t cols, int32_t depth, int32_t accumulate,
    #                        float *y);
    fn("og_test_gemm", P_u16, P_u16, P_u16, c_int32, c_int32, c_int32, c_int32, P_f32)
    # og_status og_test_gemm_grouped(const uint16_t *a, int32_t a_total, const uint16_t *w,
    #     int32_t groups, int32_t cols, int32_t depth, const int32_t *counts, const int32_t *a_rows,
    #     int32_t a_row_div, const int32_t *y_rows, int32_t stride, int32_t y_total, float *y);
    fn("og_test_gemm_grouped", P_u16, c_int32, P_u16, c_int32, c_int32, c_int32, P_i32, P_i32,
       c_int32, P_i32, c_int32, c_int32, P_f32)
    # og_status og_test_rope_inv_freq(int32_t head_dim, double theta, double linear_factor,
    #                                 float *inv_freq);
    fn("og_test_rope_inv_freq", c_int32, c_double, c_double, P_f32)
    # og_status og_test_qk_norm_rope_kv(float *qkv, int32_t n_heads, int32_t n_kv_heads,
    #                                   int32_t head_dim, const float *q_norm,
    #                                   const float *k_norm, float eps, const float *inv_freq,
    #                                   int32_t position, int32_t max_seq_len,
    #                                   int32_t kv_dtype, void *k_cache, void *v_cache,
    #                                   float *k_scales, float *v_scales);
    fn("og_test_qk_norm_rope_kv", P_f32, c_int32, c_int32, c_int32, P_f32, P_f32, c_float,
       P_f32, c_int32, c_int32, c_int32, c_void_p, c_void_p, P_f32, P_f32)
    # og_status og_test_attention_plan(int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
    #                                  int32_t max_seq_len, int32_t kv_dtype, int32_t split_len,
    #                                  int32_t band, int32_t *head_group, int32_t *n_blocks,
    #                                  int32_t *split_len_out, int32_t *tensor_cores);
    fn("og_test_attention_plan", c_int32, c_int32, c_int32, c_int32, c_int32, c_int32, c_int32, P_i32, P_i32,
       P_i32, P_i32)
    # og_status og_test_attention(const float *q, const void *k_cache, const void *v_cache,
    #                             const float *k_scales, const float *v_scales,
    #                             int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
    #                             int32_t max_seq_len, int32_t kv_dtype, int32_t visible_len,
    #                             int32_t split_len, int32_t band, float *out,
    #                             int32_t *split_len_out, int32_t *n_splits_out);
    fn("og_test_attention", P_f32, c_void_p, c_void_p, P_f32, P_f32, c_int32, c_int32, c_int32,
       c_int32, c_int32, c_int32, c_int32, c_int32, P_f32, P_i32, P_i32)
    P_i64 = POINTER(c_int64)
    # og_status og_test_attention_paged(const float *q, const void *pool, int64_t block_stride,
    #                                   int32_t n_blocks, int32_t page_size, int64_t k_offset,
    #                                   int64_t v_offset, int64_t k_scales_offset,
    #                                   int64_t v_scales_offset, const int32_t *block_table,
    #                                   int32_t n_table, int32_t n_heads, int32_t n_kv_heads,
    #                                   int32_t head_dim, int32_t max_seq_len, int32_t kv_dtype,
    #                                   int32_t visible_len, int32_t split_len, int32_t band,
    #                                   float *out);
    fn("og_test_attention_paged", P_f32, c_void_p, c_int64, c_int32, c_int32, c_int64, c_int64,
       c_int64, c_int64, P_i32, c_int32, c_int32, c_int32, c_int32, c_int32, c_int32, c_int32,
       c_int32, c_int32, P_f32)
    # og_status og_test_qk_norm_rope_kv_paged(
    #     float *qkv, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, const float *q_norm,
    #     const float *k_norm, float eps, const float *inv_freq, int32_t position, int32_t max_seq_len,
    #     int32_t kv_dtype, void *pool, int64_t block_stride, int32_t n_blocks, int32_t page_size,
    #     int64_t k_offset, int64_t v_offset, int64_t k_scales_offset, int64_t v_scales_offset,
    #     int32_t seq_slot, int32_t row_block, int32_t *block_tables, int32_t n_tables,
    #     int32_t max_blocks_per_seq);
    fn("og_test_qk_norm_rope_kv_paged", P_f32, c_int32, c_int32, c_int32, P_f32, P_f32, c_float,
       P_f32, c_int32, c_int32, c_int32, c_void_p, c_int64, c_int32, c_int32, c_int64, c_int64,
       c_int64, c_int64, c_int32, c_int32, P_i32, c_int32, c_int32)
    # og_status og_test_attention_fused(
    #     float *qkv, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, const float *q_norm,
    #     const float *k_norm, float eps, const float *inv_freq, int32_t position, int32_t max_seq_len,
    #     int32_t kv_dtype, void *pool, int64_t block_stride, int32_t n_blocks, int32_t page_size,
    #     int64_t k_offset, int64_t v_offset, int64_t k_scales_offset, int64_t v_scales_offset,
    #     int32_t seq_slot, int32_t row_block, int32_t *block_tables, int32_t n_tables,
    #     int32_t max_blocks_per_seq, int32_t split_len, int32_t band, float *out);
    fn("og_test_attention_fused", P_f32, c_int32, c_int32, c_int32, P_f32, P_f32, c_float,
       P_f32, c_int32, c_int32, c_int32, c_void_p, c_int64, c_int32, c_int32, c_int64, c_int64,
       c_int64, c_int64, c_int32, c_int32, P_i32, c_int32, c_int32, c_int32, c_int32, P_f32)
    # og_status og_test_zero_blocks(void *backing, uint64_t backing_bytes, uint64_t pool_offset,
    #                               int64_t block_stride, int32_t n_blocks,
    #                               const int64_t *segment_offsets,
    #                               const int64_t *segment_page_bytes, int32_t n_segments,
    #                               const int32_t *block_ids, int32_t n_ids);
    fn("og_test_zero_blocks", c_void_p, c_uint64, c_uint64, c_int64, c_int32, P_i64, P_i64, c_int32,
       P_i32, c_int32)
    # og_status og_test_allocator_create(int32_t n_blocks, og_test_allocator **out);
    fn("og_test_allocator_create", c_int32, POINTER(c_void_p))
    # og_status og_test_allocator_destroy(og_test_allocator *a);
    fn("og_test_allocator_destroy", c_void_p)
    # og_status og_test_allocator_allocate(og_test_allocator *a, int32_t *block);
    fn("og_test_allocator_allocate", c_void_p, P_i32)
    # og_status og_test_allocator_retain(og_test_allocator *a, int32_t block);
    fn("og_test_allocator_retain", c_void_p, c_int32)
    # og_status og_test_allocator_release(og_test_allocator *a, int32_t block, int32_t *freed);
    fn("og_test_allocator_release", c_void_p, c_int32, P_i32)
    # og_status og_test_allocator_refcount(og_test_allocator *a, int32_t block, int32_t *count);
    fn("og_test_allocator_refcount", c_void_p, c_int32, P_i32)
    # og_status og_test_allocator_free_count(og_test_allocator *a, int32_t *count);
    fn("og_test_allocator_free_count", c_void_p, P_i32)
    # og_status og_test_allocator_set_free_order(og_test_allocator *a, const int32_t *blocks,
    #                                            int32_t count);
    fn("og_test_allocator_set_free_order", c_void_p, P_i32, c_int32)
    # og_status og_test_kv_set_free_order(og_engine *e, const int32_t *blocks, int32_t count);
    fn("og_test_kv_set_free_order", c_void_p, P_i32, c_int32)
    # og_status og_test_copy_kv_cache(og_engine *e, void *host_dst, uint64_t capacity_bytes);
    fn("og_test_copy_kv_cache", capi.Handle, c_void_p, c_uint64)
    # og_status og_test_step_record(og_engine *e, og_step_record *record);
    fn("og_test_step_record", capi.Handle, POINTER(capi.OgStepRecord))
    # og_status og_test_kv_zero_blocks(og_engine *e, const int32_t *blocks, int32_t count);
    fn("og_test_kv_zero_blocks", capi.Handle, P_i32, c_int32)
    # og_status og_test_sample(const float *logits, int32_t vocab, const int32_t *counts,
    #                          const og_sampling_params *params, const int32_t *positions,
    #                          int32_t n, int32_t *tokens, float *values, og_top_logprob *top,
    #                          int32_t *n_top);
    fn("og_test_sample", P_f32, c_int32, P_i32, POINTER(capi.OgSamplingParams), P_i32, c_int32, P_i32,
       P_f32, POINTER(capi.OgTopLogprob), P_i32)


def load() -> ctypes.CDLL:
    """The library with the og_test_* functions bound (raises capi.LibraryUnavailable)."""
    return _bound_library(_bind)


def _check(status: int, call: str) -> None:
    capi.check(status, call)


# ---- numpy helpers ----------------------------------------------------------------------
def _array(a, dtype) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=dtype)


def _p(a: np.ndarray | None, ctype):
    return None if a is None else a.ctypes.data_as(POINTER(ctype))


def _vp(a: np.ndarray | None):
    return None if a is None else c_void_p(a.ctypes.data)


def _out(shape, dtype=np.float32, fill=np.nan) -> np.ndarray:
    return np.full(shape, fill, dtype=dtype)


def bf16_bits(values) -> np.ndarray:
    """float -> bf16 bit patterns (uint16), round to nearest even (NaN stays NaN)."""
    f = np.ascontiguousarray(values, dtype=np.float32)
    bits = f.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(f)
    out[nan] = 0x7FC0
    return out


def bf16_to_f32(bits) -> np.ndarray:
    """bf16 bit patterns (uint16) -> exact float32 values."""
    b = np.ascontiguousarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


def embedding(table_bits: np.ndarray, token: int) -> np.ndarray:
    table_bits = _array(table_bits, np.uint16)
    vocab, hidden = table_bits.shape
    x = _out(hidden)
    _check(load().og_test_embedding(_p(table_bits, c_uint16), vocab, hidden, token, _p(x, c_float)),
           "og_test_embedding")
    return x


def argmax(logits: np.ndarray, launches: int = 1) -> tuple[int, float]:
    """(token, logit) of the body's device argmax over logits [n]."""
    logits = _array(logits, np.float32)
    token, logit = c_int32(), c_float()
    _check(load().og_test_argmax(_p(logits, c_float), logits.size, launches, ctypes.byref(token),
                                 ctypes.byref(logit)), "og_test_argmax")
    return token.value, logit.value


def sample(logits: np.ndarray, params, positions, counts=None, seed: int | None = None):
    """The body's sampling stage (cuda/sample.cu) on logits [V] with sampling.SamplingParams
    `params` (seed overrides params.seed), once per row of positions [n], with the same counts
    [V] (None: none): (tokens [n] int32, values [n] float32, the last draw's top log-probabilities
    as ((id, logprob), ...))."""
    logits = _array(logits, np.float32)
    positions = _array(positions, np.int32).reshape(-1)
    counts = None if counts is None else _array(counts, np.int32)
    seed = params.seed if seed is None else seed
    p = capi.OgSamplingParams(seed=int(seed or 0), temperature=params.temperature, top_k=int(params.top_k),
                              top_p=params.top_p, min_p=params.min_p,
                              repetition_penalty=params.repetition_penalty,
                              presence_penalty=params.presence_penalty,
                              frequency_penalty=params.frequency_penalty, logprobs=int(params.logprobs))
    tokens = np.full(positions.size, -1, np.int32)
    values = _out(positions.size)
    top = (capi.OgTopLogprob * capi.OG_MAX_LOGPROBS)()
    n_top = c_int32()
    _check(load().og_test_sample(_p(logits, c_float), logits.size, _p(counts, c_int32), ctypes.byref(p),
                                 _p(positions, c_int32), positions.size, _p(tokens, c_int32),
                                 _p(values, c_float), top, ctypes.byref(n_top)), "og_test_sample")
    return tokens, values, tuple((top[j].token, top[j].logprob) for j in range(n_top.value))


def gemv(weight_bits: np.ndarray, x: np.ndarray) -> np.ndarray:
    weight_bits, x = _array(weight_bits, np.uint16), _array(x, np.float32)
    rows, cols = weight_bits.shape
    y = _out(rows)
    _check(load().og_test_gemv(_p(weight_bits, c_uint16), rows, cols, _p(x, c_float), _p(y, c_float)),
           "og_test_gemv")
    return y


def gemm(a_bits: np.ndarray, w_bits: np.ndarray, y: np.ndarray | None = None,
         a_lo_bits: np.ndarray | None = None) -> np.ndarray:
    """The prefill GEMM: a [rows, depth] bf16 bits . w [cols, depth] bf16 bits^T -> [rows, cols]
    fp32, added to y when it is given (else into a NaN-poisoned buffer). a_lo_bits (same shape
    as a): the low half of a split operand, a + a_lo (the form og_prefill multiplies)."""
    a_bits, w_bits = _array(a_bits, np.uint16), _array(w_bits, np.uint16)
    (rows, depth), (cols, depth_w) = a_bits.shape, w_bits.shape
    if depth != depth_w:
        raise ValueError(f"gemm: a has {depth} columns, w has {depth_w}")
    a_lo = None
    if a_lo_bits is not None:
        a_lo_bits = _array(a_lo_bits, np.uint16)
        if a_lo_bits.shape != a_bits.shape:
            raise ValueError(f"gemm: a_lo has shape {a_lo_bits.shape}, a {a_bits.shape}")
        a_lo = _p(a_lo_bits, c_uint16)
    out = _out((rows, cols)) if y is None else _array(y, np.float32).copy()
    _check(load().og_test_gemm(_p(a_bits, c_uint16), a_lo, _p(w_bits, c_uint16), rows, cols, depth,
                               0 if y is None else 1, _p(out, c_float)), "og_test_gemm")
    return out


def gemm_grouped(a_bits: np.ndarray, w_bits: np.ndarray, counts, a_rows: np.ndarray, a_row_div: int,
                 y_rows: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The grouped GEMM (MoE experts): a [a_total, depth] bf16 bits, w [groups, cols, depth] bf16
    bits, counts [groups], a_rows / y_rows [groups, stride] (entries past a group's count are not
    read), y [y_total, cols] fp32 (rows no group names come back as given)."""
    a_bits, w_bits = _array(a_bits, np.uint16), _array(w_bits, np.uint16)
    counts = _array(counts, np.int32)
    a_rows, y_rows = _array(a_rows, np.int32), _array(y_rows, np.int32)
    (a_total, depth), (groups, cols, depth_w) = a_bits.shape, w_bits.shape
    if depth != depth_w or counts.shape != (groups,) or a_rows.shape != y_rows.shape or \
            a_rows.shape[0] != groups:
        raise ValueError(f"gemm_grouped: shapes a {a_bits.shape}, w {w_bits.shape}, counts {counts.shape}, "
                         f"a_rows {a_rows.shape}, y_rows {y_rows.shape} do not agree")
    out = _array(y, np.float32).copy()
    _check(load().og_test_gemm_grouped(_p(a_bits, c_uint16), a_total, _p(w_bits, c_uint16), groups, cols,
                                       depth, _p(counts, c_int32), _p(a_rows, c_int32), a_row_div,
                                       _p(y_rows, c_int32), a_rows.shape[1], out.shape[0], _p(out, c_float)),
           "og_test_gemm_grouped")
    return out


def bf16_split(values) -> tuple[np.ndarray, np.ndarray]:
    """float32 -> (hi, lo) bf16 bit patterns with hi = bf16(x), lo = bf16(x - hi), both round
    to nearest even: the split form og_prefill gives its GEMMs (cuda/prefill.cuh)."""
    f = np.ascontiguousarray(values, dtype=np.float32)
    hi = bf16_bits(f)
    hi_f = bf16_to_f32(hi)
    with np.errstate(invalid="ignore"):
        rest = np.where(np.isinf(hi_f), np.float32(0), f - hi_f)  # hi = +-inf: lo = 0
    return hi, bf16_bits(rest)


def gemv_rmsnorm(weight_bits: np.ndarray, x: np.ndarray, norm_weight: np.ndarray, eps: float):
    """-> (y, normed)."""
    weight_bits, x = _array(weight_bits, np.uint16), _array(x, np.float32)
    norm_weight = _array(norm_weight, np.float32)
    rows, cols = weight_bits.shape
    y, normed = _out(rows), _out(cols)
    _check(load().og_test_gemv_rmsnorm(_p(weight_bits, c_uint16), rows, cols, _p(x, c_float),
                                       _p(norm_weight, c_float), eps, _p(y, c_float),
                                       _p(normed, c_float)),
           "og_test_gemv_rmsnorm")
    return y, normed


def gemv_residual(weight_bits: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """-> y + W x (y is not modified)."""
    weight_bits, x = _array(weight_bits, np.uint16), _array(x, np.float32)
    out = np.array(y, dtype=np.float32, copy=True, order="C")
    rows, cols = weight_bits.shape
    _check(load().og_test_gemv_residual(_p(weight_bits, c_uint16), rows, cols, _p(x, c_float),
                                        _p(out, c_float)),
           "og_test_gemv_residual")
    return out


def gemv_rmsnorm_swiglu(gate_up_bits: np.ndarray, x: np.ndarray, norm_weight: np.ndarray,
                        eps: float) -> np.ndarray:
    gate_up_bits, x = _array(gate_up_bits, np.uint16), _array(x, np.float32)
    norm_weight = _array(norm_weight, np.float32)
    rows, cols = gate_up_bits.shape
    inter = rows // 2
    act = _out(inter)
    _check(load().og_test_gemv_rmsnorm_swiglu(_p(gate_up_bits, c_uint16), inter, cols,
                                              _p(x, c_float), _p(norm_weight, c_float), eps,
                                              _p(act, c_float)),
           "og_test_gemv_rmsnorm_swiglu")
    return act


GEMV_MODES = {"plain": 0, "norm": 1, "residual": 2, "norm_swiglu": 3}


def gemv_quant(qm, mode: str, x: np.ndarray, norm_weight=None, eps: float = 0.0, y=None,
               bulk_stream: bool = False):
    """The quantized GEMV on a onegraph.quant.QuantizedMatrix `qm` -> (y, normed).

    y: the residual's input for mode "residual" (not modified); normed (the normalized input) is
    None unless mode is "norm" or "norm_swiglu". For "norm_swiglu" qm holds 2 * inter rows (gate
    then up) and y has inter entries. bulk_stream: a q4 plan takes the copy-engine stream where
    the shape allows (gemv_q4_stream says whether it does)."""
    fmt = capi.WEIGHT_FORMATS[qm.format]
    rows, cols = qm.shape
    data = np.ascontiguousarray(qm.data)
    scales = np.ascontiguousarray(qm.scale).view(np.uint8)
    x = _array(x, np.float32)
    norm_weight = None if norm_weight is None else _array(norm_weight, np.float32)
    out_len = rows // 2 if mode == "norm_swiglu" else rows
    out = np.array(y, dtype=np.float32, copy=True, order="C") if mode == "residual" else _out(out_len)
    normed = _out(cols) if mode in ("norm", "norm_swiglu") else None
    _check(load().og_test_gemv_quant(fmt, GEMV_MODES[mode], _vp(data), _vp(scales), rows, cols,
                                     _p(x, c_float), _p(norm_weight, c_float), eps, _p(out, c_float),
                                     _p(normed, c_float), int(bulk_stream)),
           "og_test_gemv_quant")
    return out, normed


Q4_STREAMS = ("registers", "bulk")


def gemv_q4_stream(mode: str, rows: int, cols: int, bulk_stream: bool) -> str:
    """The weight stream a q4 GEMV plan of this shape takes: "registers" or "bulk"."""
    stream = c_int32(-1)
    _check(load().og_test_gemv_q4_stream(GEMV_MODES[mode], rows, cols, int(bulk_stream), ctypes.byref(stream)),
           "og_test_gemv_q4_stream")
    return Q4_STREAMS[stream.value]


def gemv_quant_split(fmt: str, mode: str, rows: int, cols: int) -> int:
    """The warps the quantized GEMV's plan splits a row's k-blocks over for this shape."""
    warps = c_int32(0)
    _check(load().og_test_gemv_quant_split(capi.WEIGHT_FORMATS[fmt], GEMV_MODES[mode], rows, cols,
                                            ctypes.byref(warps)),
           "og_test_gemv_quant_split")
    return warps.value


def rope_inv_freq(head_dim: int, theta: float, linear_factor: float = 1.0) -> np.ndarray:
    out = _out(head_dim // 2)
    _check(load().og_test_rope_inv_freq(head_dim, theta, linear_factor, _p(out, c_float)),
           "og_test_rope_inv_freq")
    return out


def qk_norm_rope_kv(qkv, n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps, inv_freq,
                    position, k_cache, v_cache, k_scales=None, v_scales=None, kv_dtype=OG_KV_F32):
    """Runs on copies; -> (qkv, k_cache, v_cache, k_scales, v_scales) after the kernel.

    Caches are [n_kv, max_seq_len, head_dim] arrays of KV_NUMPY_DTYPES[kv_dtype]; scales
    [n_kv, max_seq_len] fp32 (int8 only)."""
    qkv = np.array(qkv, dtype=np.float32, copy=True, order="C")
    dtype = KV_NUMPY_DTYPES[kv_dtype]
    k_cache = np.array(k_cache, dtype=dtype, copy=True, order="C")
    v_cache = np.array(v_cache, dtype=dtype, copy=True, order="C")
    max_seq_len = k_cache.shape[1]
    if kv_dtype == OG_KV_INT8:
        k_scales = np.array(k_scales, dtype=np.float32, copy=True, order="C")
        v_scales = np.array(v_scales, dtype=np.float32, copy=True, order="C")
    else:
        k_scales = v_scales = None
    q_norm = None if q_norm is None else _array(q_norm, np.float32)
    k_norm = None if k_norm is None else _array(k_norm, np.float32)
    inv_freq = _array(inv_freq, np.float32)
    _check(load().og_test_qk_norm_rope_kv(_p(qkv, c_float), n_heads, n_kv_heads, head_dim,
                                          _p(q_norm, c_float), _p(k_norm, c_float), eps,
                                          _p(inv_freq, c_float), position, max_seq_len, kv_dtype,
                                          _vp(k_cache), _vp(v_cache), _p(k_scales, c_float),
                                          _p(v_scales, c_float)),
           "og_test_qk_norm_rope_kv")
    return qkv, k_cache, v_cache, k_scales, v_scales


# The attention entry points below take the plan of the engine's long band by default (the
# tensor-core fold for groups of 4 and 8), of its short band with band=BAND_SHORT; BAND_LONG_TC
# puts the long band on the tensor cores wherever that fold is compiled (groups of 2 too), and
# BAND_LONG_CUDA keeps it on the CUDA cores (cuda/kernels.cuh AttentionBand).
BAND_SHORT, BAND_LONG, BAND_LONG_TC, BAND_LONG_CUDA = 0, 1, 2, 3
def attention_plan(n_heads, n_kv, head_dim, max_seq_len, kv_dtype=OG_KV_F32, split_len=0,
                   band=BAND_LONG) -> dict:
    """The attention plan for this shape: head_group, n_blocks, split_len, tensor_cores (bool)."""
    hg, nb, split, tc = c_int32(0), c_int32(0), c_int32(0), c_int32(0)
    _check(load().og_test_attention_plan(n_heads, n_kv, head_dim, max_seq_len, kv_dtype, split_len,
                                         band, ctypes.byref(hg), ctypes.byref(nb), ctypes.byref(split),
                                         ctypes.byref(tc)),
           "og_test_attention_plan")
    return {"head_group": hg.value, "n_blocks": nb.value, "split_len": split.value,
            "tensor_cores": bool(tc.value)}


def attention(q, k_cache, v_cache, k_scales, v_scales, n_heads, visible_len, split_len=0,
              kv_dtype=OG_KV_F32, band=BAND_LONG):
    """-> (out [n_heads * head_dim], split_len used, n_splits)."""
    dtype = KV_NUMPY_DTYPES[kv_dtype]
    q = _array(q, np.float32)
    k_cache, v_cache = _array(k_cache, dtype), _array(v_cache, dtype)
    n_kv, max_seq_len, head_dim = k_cache.shape
    if kv_dtype == OG_KV_INT8:
        k_scales, v_scales = _array(k_scales, np.float32), _array(v_scales, np.float32)
    else:
        k_scales = v_scales = None
    out = _out(n_heads * head_dim)
    used_split, n_splits = c_int32(0), c_int32(0)
    _check(load().og_test_attention(_p(q, c_float), _vp(k_cache), _vp(v_cache),
                                    _p(k_scales, c_float), _p(v_scales, c_float), n_heads, n_kv,
                                    head_dim, max_seq_len, kv_dtype, visible_len, split_len,
                                    band, _p(out, c_float), ctypes.byref(used_split),
                                    ctypes.byref(n_splits)),
           "og_test_attention")
    return out, used_split.value, n_splits.value


# ---- reliability hooks (onegraph_testing.h, cuda/reliability.cu; test-only) ----------------
OG_TEST_CAPTURE_FAULT_NONE, OG_TEST_CAPTURE_FAULT_MALLOC, OG_TEST_CAPTURE_FAULT_SYNC = 0, 1, 2
CAPTURE_FAULTS = {"none": OG_TEST_CAPTURE_FAULT_NONE, "malloc": OG_TEST_CAPTURE_FAULT_MALLOC,
                  "sync": OG_TEST_CAPTURE_FAULT_SYNC}

def _bind_reliability(lib: ctypes.CDLL) -> None:
    from ctypes import c_char_p, c_int64, c_uint64
    fn = functools.partial(_declare, lib)

    # og_status og_test_fail_allocation_at(int32_t n);
    fn("og_test_fail_allocation_at", c_int32)
    # og_status og_test_allocation_counts(int64_t *calls, int64_t *device_live,
    #                                     int64_t *pinned_live, uint64_t *device_bytes_live,
    #                                     uint64_t *pinned_bytes_live);
    fn("og_test_allocation_counts", POINTER(c_int64), POINTER(c_int64), POINTER(c_int64),
       POINTER(c_uint64), POINTER(c_uint64))
    # og_status og_test_set_capture_fault(int32_t kind, int32_t count);
    fn("og_test_set_capture_fault", c_int32, c_int32)
    # og_status og_check_guards(og_engine *e);
    fn("og_check_guards", capi.Handle)
    # og_status og_test_corrupt_guard(og_engine *e, const char *buffer, int32_t after);
    fn("og_test_corrupt_guard", capi.Handle, c_char_p, c_int32)
    # og_status og_test_set_omit(og_engine *e, int32_t kinds);
    fn("og_test_set_omit", capi.Handle, c_int32)


def reliability() -> ctypes.CDLL:
    """The library with the reliability hooks bound (raises capi.LibraryUnavailable)."""
    return _bound_library(_bind_reliability)


def fail_allocation_at(n: int) -> None:
    """Fail the n-th device/pinned allocation from now (0 = the next); -1 disarms."""
    _check(reliability().og_test_fail_allocation_at(n), "og_test_fail_allocation_at")


def allocation_counts() -> dict:
    """{"calls", "device_live", "pinned_live", "device_bytes_live", "pinned_bytes_live"}."""
    from ctypes import c_int64, c_uint64
    calls, device, pinned = c_int64(), c_int64(), c_int64()
    device_bytes, pinned_bytes = c_uint64(), c_uint64()
    _check(reliability().og_test_allocation_counts(ctypes.byref(calls), ctypes.byref(device),
                                                   ctypes.byref(pinned), ctypes.byref(device_bytes),
                                                   ctypes.byref(pinned_bytes)),
           "og_test_allocation_counts")
    return {"calls": calls.value, "device_live": device.value, "pinned_live": pinned.value,
            "device_bytes_live": device_bytes.value, "pinned_bytes_live": pinned_bytes.value}


def set_capture_fault(kind: str, count: int = 1) -> None:
    """Make og_enqueue's next `count` captures make an illegal call: kind in CAPTURE_FAULTS."""
    _check(reliability().og_test_set_capture_fault(CAPTURE_FAULTS[kind], count), "og_test_set_capture_fault")


def check_guards(handle) -> None:
    """Raise capi.LibraryError (OG_E_CORRUPTED, naming the band) unless every guard is intact."""
    _check(reliability().og_check_guards(handle), "og_check_guards")


def corrupt_guard(handle, buffer: str, after: bool) -> None:
    """Flip one byte of the guard band before (after=False) or after (after=True) `buffer`."""
    _check(reliability().og_test_corrupt_guard(handle, buffer.encode(), int(after)), "og_test_corrupt_guard")


# og_test_set_omit's kinds (onegraph_testing.h)
OMIT_KINDS = {"qkv": 1, "attention": 2, "o_proj": 4, "ffn_in": 8, "ffn_out": 16, "lm_head": 32}


def set_omit(handle, kinds) -> None:
    """Leave these kernel kinds (names of OMIT_KINDS) out of bodies enqueued from now on."""
    mask = 0
    for kind in kinds:
        if kind not in OMIT_KINDS:
            raise ValueError(f"unknown kernel kind {kind!r}; expected one of {sorted(OMIT_KINDS)}")
        mask |= OMIT_KINDS[kind]
    _check(reliability().og_test_set_omit(handle, mask), "og_test_set_omit")


# ---- the paged KV cache --------------------------------------------------------------------

def _pages(offsets: dict):
    return (offsets["k"], offsets["v"], offsets.get("k_scales", -1), offsets.get("v_scales", -1))


def attention_paged(q, pool: np.ndarray, block_stride: int, page_size: int, offsets: dict,
                    block_table, n_heads: int, n_kv_heads: int, head_dim: int, max_seq_len: int,
                    visible_len: int, split_len: int = 0, kv_dtype=OG_KV_F32,
                    band: int = BAND_LONG) -> np.ndarray:
    """Attention through a paged pool (uint8 [n_blocks * block_stride]); offsets: byte offsets
    of the layer's pages in a block, keys "k", "v" (and "k_scales", "v_scales" for int8)."""
    q = _array(q, np.float32)
    pool = np.ascontiguousarray(pool, dtype=np.uint8)
    table = _array(block_table, np.int32)
    out = _out(n_heads * head_dim)
    _check(load().og_test_attention_paged(_p(q, c_float), _vp(pool), block_stride,
                                          pool.size // block_stride, page_size, *_pages(offsets),
                                          _p(table, c_int32), table.size, n_heads, n_kv_heads,
                                          head_dim, max_seq_len, kv_dtype, visible_len, split_len,
                                          band, _p(out, c_float)),
           "og_test_attention_paged")
    return out


def _paged_row_inputs(qkv, pool, block_tables, q_norm, k_norm, inv_freq):
    """The paged row entry points' inputs as C arrays: copies of qkv (fp32), the pool (bytes) and
    the block tables (int32) for the kernel to write; the norm weights (or None) and inv_freq."""
    return (np.array(qkv, dtype=np.float32, copy=True, order="C"),
            np.array(pool, dtype=np.uint8, copy=True, order="C"),
            np.array(block_tables, dtype=np.int32, copy=True, order="C"),
            None if q_norm is None else _array(q_norm, np.float32),
            None if k_norm is None else _array(k_norm, np.float32),
            _array(inv_freq, np.float32))


def qk_norm_rope_kv_paged(qkv, n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps, inv_freq, position,
                          max_seq_len, pool, block_stride, page_size, offsets, seq_slot, row_block,
                          block_tables, kv_dtype=OG_KV_F32):
    """Runs on copies; -> (qkv, pool, block_tables) after the kernel. block_tables: int32
    [n_tables, max_blocks_per_seq]."""
    qkv, pool, tables, q_norm, k_norm, inv_freq = _paged_row_inputs(qkv, pool, block_tables, q_norm,
                                                                     k_norm, inv_freq)
    _check(load().og_test_qk_norm_rope_kv_paged(
        _p(qkv, c_float), n_heads, n_kv_heads, head_dim, _p(q_norm, c_float), _p(k_norm, c_float), eps,
        _p(inv_freq, c_float), position, max_seq_len, kv_dtype, _vp(pool), block_stride,
        pool.size // block_stride, page_size, *_pages(offsets), seq_slot, row_block, _p(tables, c_int32),
        tables.shape[0], tables.shape[1]),
        "og_test_qk_norm_rope_kv_paged")
    return qkv, pool, tables


def attention_fused(qkv, n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps, inv_freq, position,
                    max_seq_len, pool, block_stride, page_size, offsets, seq_slot, row_block,
                    block_tables, split_len=0, kv_dtype=OG_KV_F32, band=BAND_LONG):
    """The body's fused attention kernel on copies; -> (out [n_heads * head_dim], qkv, pool,
    block_tables) after the kernel (qkv's q part replaced by the rotated q)."""
    qkv, pool, tables, q_norm, k_norm, inv_freq = _paged_row_inputs(qkv, pool, block_tables, q_norm,
                                                                     k_norm, inv_freq)
    out = _out(n_heads * head_dim)
    _check(load().og_test_attention_fused(
        _p(qkv, c_float), n_heads, n_kv_heads, head_dim, _p(q_norm, c_float), _p(k_norm, c_float), eps,
        _p(inv_freq, c_float), position, max_seq_len, kv_dtype, _vp(pool), block_stride,
        pool.size // block_stride, page_size, *_pages(offsets), seq_slot, row_block, _p(tables, c_int32),
        tables.shape[0], tables.shape[1], split_len, band, _p(out, c_float)),
        "og_test_attention_fused")
    return out, qkv, pool, tables


def zero_blocks(backing: np.ndarray, pool_offset: int, block_stride: int, n_blocks: int,
                segments, block_ids) -> np.ndarray:
    """The zeroing kernel on a copy of `backing` (any dtype; addressed in bytes); segments:
    (offset_bytes, page_bytes) pairs. -> the copy after the launch."""
    out = np.array(backing, copy=True, order="C")
    raw = out.view(np.uint8).reshape(-1)
    offsets = np.array([s[0] for s in segments], dtype=np.int64)
    pages = np.array([s[1] for s in segments], dtype=np.int64)
    ids = _array(block_ids, np.int32)
    _check(load().og_test_zero_blocks(_vp(raw), raw.size, pool_offset, block_stride, n_blocks,
                                      _p(offsets, c_int64), _p(pages, c_int64), offsets.size,
                                      _p(ids, c_int32), ids.size),
           "og_test_zero_blocks")
    return out


class BlockAllocator:
    """The library's block allocator (cuda/kv_pool.h) on the host, through og_test_allocator_*.
    Errors raise capi.LibraryError (OG_E_POOL_EXHAUSTED, OG_E_INVALID_ARGUMENT)."""

    def __init__(self, n_blocks: int):
        self._lib = load()
        self._handle = c_void_p()
        _check(self._lib.og_test_allocator_create(n_blocks, ctypes.byref(self._handle)),
               "og_test_allocator_create")

    def allocate(self) -> int:
        block = c_int32(-1)
        _check(self._lib.og_test_allocator_allocate(self._handle, ctypes.byref(block)),
               "og_test_allocator_allocate")
        return block.value

    def retain(self, block: int) -> None:
        _check(self._lib.og_test_allocator_retain(self._handle, block), "og_test_allocator_retain")

    def release(self, block: int) -> bool:
        """-> whether the block went back to the free list."""
        freed = c_int32(-1)
        _check(self._lib.og_test_allocator_release(self._handle, block, ctypes.byref(freed)),
               "og_test_allocator_release")
        return bool(freed.value)

    def refcount(self, block: int) -> int:
        count = c_int32(-2)
        _check(self._lib.og_test_allocator_refcount(self._handle, block, ctypes.byref(count)),
               "og_test_allocator_refcount")
        return count.value

    @property
    def free_count(self) -> int:
        count = c_int32(-1)
        _check(self._lib.og_test_allocator_free_count(self._handle, ctypes.byref(count)),
               "og_test_allocator_free_count")
        return count.value

    def set_free_order(self, blocks) -> None:
        ids = _array(blocks, np.int32)
        _check(self._lib.og_test_allocator_set_free_order(self._handle, _p(ids, c_int32), ids.size),
               "og_test_allocator_set_free_order")

    def close(self) -> None:
        if self._handle:
            self._lib.og_test_allocator_destroy(self._handle)
            self._handle = c_void_p()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def kv_set_free_order(handle, blocks) -> None:
    """og_test_kv_set_free_order on an engine handle (GpuSession.handle)."""
    ids = _array(blocks, np.int32)
    _check(load().og_test_kv_set_free_order(handle, _p(ids, c_int32), ids.size), "og_test_kv_set_free_order")


# ---- inspection of an engine ------------------------------------------------------------------

def kv_cache_bytes(session) -> bytes:
    """The whole KV block pool of a GpuSession's engine (og_stats.kv_cache_bytes bytes), read back
    after its stream drained: tests compare it before and after a refused call."""
    n = session.stats()["kv_cache_bytes"]
    buf = (ctypes.c_uint8 * n)()
    _check(load().og_test_copy_kv_cache(session.handle, buf, n), "og_test_copy_kv_cache")
    return bytes(buf)


def step_record(handle) -> tuple[int, int, int, int]:
    """(token, position, seq_slot, row_block) of the engine's pinned step record of slot 0."""
    record = capi.OgStepRecord()
    _check(load().og_test_step_record(handle, ctypes.byref(record)), "og_test_step_record")
    return record.token, record.position, record.seq_slot, record.row_block


def kv_zero_blocks(handle, blocks) -> None:
    """og_test_kv_zero_blocks: zero the listed blocks of an engine's pool now."""
    ids = _array(blocks, np.int32)
    _check(load().og_test_kv_zero_blocks(handle, _p(ids, c_int32), ids.size), "og_test_kv_zero_blocks")
