/*
 * onegraph_testing.h — kernel-level test entry points of libonegraph.
 *
 * Each og_test_* function takes host arrays, allocates device buffers, copies the inputs
 * up, launches one kernel family exactly as the decode body does, synchronizes, copies
 * the outputs back, frees everything and returns an og_status (og_last_error() says why
 * on failure; OG_E_NO_DEVICE without a GPU). They exist so the tests can hold every
 * kernel against a numpy reference over awkward sizes; they are not part of the stable
 * ABI (no version promise) and are not fast.
 *
 * bf16 arrays are passed as uint16 bit patterns. Matrices are passed unpadded
 * ([rows, cols] contiguous); the entry points pad rows to the library's layout.
 */
#ifndef ONEGRAPH_TESTING_H
#define ONEGRAPH_TESTING_H

#include <stdint.h>

#include "onegraph.h"

#ifdef __cplusplus
extern "C" {
#endif

/* x[i] = float(table[token, i]); table [vocab, hidden] bf16, x [hidden]. The token is
 * read from a device step record, as in the body. */
OG_API og_status og_test_embedding(const uint16_t *table, int32_t vocab, int32_t hidden,
                                   int32_t token, float *x);

/* The body's greedy argmax (OG_OUTPUT_NEXT_TOKEN) over logits [n], launched `launches` times on
 * the same buffers (each launch must agree with the first: OG_E_CORRUPTED otherwise): *token,
 * *logit as og_next_token gives them. */
OG_API og_status og_test_argmax(const float *logits, int32_t n, int32_t launches, int32_t *token,
                                float *logit);

/* y[r] = W[r] . x;  W [rows, cols] bf16, x [cols], y [rows]. */
OG_API og_status og_test_gemv(const uint16_t *weight, int32_t rows, int32_t cols,
                              const float *x, float *y);

/* n = x * (1 / sqrt(mean(x^2) + eps)) * norm_weight;  y[r] = W[r] . n.
 * normed (may be NULL) receives n [cols]. */
OG_API og_status og_test_gemv_rmsnorm(const uint16_t *weight, int32_t rows, int32_t cols,
                                      const float *x, const float *norm_weight, float eps,
                                      float *y, float *normed);

/* y[r] += W[r] . x  (y is input and output). */
OG_API og_status og_test_gemv_residual(const uint16_t *weight, int32_t rows, int32_t cols,
                                       const float *x, float *y);

/* n = rmsnorm(x) * norm_weight; gate_up [2 * inter, cols] bf16 (gate rows then up rows);
 * act[i] = silu(gate[i] . n) * (up[i] . n), silu(g) = g / (1 + exp(-g)); act [inter]. */
OG_API og_status og_test_gemv_rmsnorm_swiglu(const uint16_t *gate_up, int32_t inter,
                                             int32_t cols, const float *x,
                                             const float *norm_weight, float eps, float *act);

/* The GEMV over quantized weights (format OG_WEIGHTS_INT8 or OG_WEIGHTS_Q4), weight and scales
 * as og_set_weight takes them (onegraph.h "weight formats"): int8 data [rows, cols] + fp32
 * scales [rows]; q4 packed data [rows, ceil(cols / 32) * 16] bytes + bf16 scale bits [rows,
 * ceil(cols / 32)]. mode: the kernels.cuh GemvMode (0 plain: y = W x; 1 RMSNorm in front,
 * normed may be NULL; 2 residual, y in/out; 3 RMSNorm + gate/up + SwiGLU: rows = 2 * inter
 * (gate rows then up rows), y [inter]). norm_weight and eps are read in modes 1 and 3. */
OG_API og_status og_test_gemv_quant(int32_t format, int32_t mode, const void *weight,
                                    const void *scales, int32_t rows, int32_t cols,
                                    const float *x, const float *norm_weight, float eps,
                                    float *y, float *normed, int32_t bulk_stream);

/* Which weight stream a q4 GEMV plan of this shape takes (0: register slots, 1: the copy
 * engine's bulk copies into shared memory) when the bulk stream is asked for or not. */
OG_API og_status og_test_gemv_q4_stream(int32_t mode, int32_t rows, int32_t cols, int32_t bulk_stream,
                                        int32_t *stream);

/* How many warps og_test_gemv_quant's plan splits each row's k-blocks over for this shape (8, or
 * 16 where a large staged input makes one wide block per SM the better fit): its summation
 * order, for the tests' error bound. */
OG_API og_status og_test_gemv_quant_split(int32_t format, int32_t mode, int32_t rows,
                                          int32_t cols, int32_t *warps);

/* The RoPE table the engine uploads: inv_freq[i] = float(1 / theta^(2i/hd)) / float(factor),
 * i < head_dim / 2, the power in float64. Host only (no device needed). */
OG_API og_status og_test_rope_inv_freq(int32_t head_dim, double theta, double linear_factor,
                                       float *inv_freq);

/* QK-norm + RoPE + KV write for one token at `position`.
 *   qkv       [n_heads*hd + 2*n_kv*hd] in/out: the q part is replaced by the normed,
 *             rotated q; the k and v parts are left as they were.
 *   q_norm, k_norm  [hd] each, or both NULL (no QK-norm, as for Llama).
 *   inv_freq  [hd / 2] (og_test_rope_inv_freq).
 *   k_cache, v_cache  [n_kv, max_seq_len, hd] of kv_dtype (f32 / bf16 bits / int8),
 *             in/out: only row `position` of each head should change.
 *   k_scales, v_scales [n_kv, max_seq_len] fp32 in/out (OG_KV_INT8; NULL otherwise). */
OG_API og_status og_test_qk_norm_rope_kv(float *qkv, int32_t n_heads, int32_t n_kv_heads,
                                         int32_t head_dim, const float *q_norm,
                                         const float *k_norm, float eps, const float *inv_freq,
                                         int32_t position, int32_t max_seq_len,
                                         int32_t kv_dtype, void *k_cache, void *v_cache,
                                         float *k_scales, float *v_scales);

/* The attention plan the kernels take for this shape (split_len 0: the engine's chunking) in
 * the engine's short band (band 0) or long band (1; 2: on the tensor cores wherever that fold
 * is compiled, 3: never on them; cuda/kernels.cuh AttentionBand): the query heads a block
 * folds together (head_group), blocks per (KV head, head group) (n_blocks), rows per chunk
 * (split_len_out), and whether the fold runs on the tensor cores (tensor_cores: 1) or the
 * CUDA cores (0). The attention entry points below take the plan of their band. */
OG_API og_status og_test_attention_plan(int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                                       int32_t max_seq_len, int32_t kv_dtype, int32_t split_len,
                                       int32_t band, int32_t *head_group, int32_t *n_blocks,
                                       int32_t *split_len_out, int32_t *tensor_cores);

/* Decode attention of one query over the first visible_len rows of a KV cache.
 *   q [n_heads * hd]; caches and scales as for og_test_qk_norm_rope_kv (scales NULL
 *   unless OG_KV_INT8); out [n_heads * hd].
 *   split_len: positions per split block, 0 = what the engine would choose; it is rounded
 *   up to a multiple of 32. *split_len_out and *n_splits_out (each may be NULL) receive
 *   the split length and split count used.
 *   Fails with OG_E_CUDA if the kernel leaves its split counters non-zero. */
OG_API og_status og_test_attention(const float *q, const void *k_cache, const void *v_cache,
                                   const float *k_scales, const float *v_scales,
                                   int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                                   int32_t max_seq_len, int32_t kv_dtype, int32_t visible_len,
                                   int32_t split_len, int32_t band, float *out,
                                   int32_t *split_len_out, int32_t *n_splits_out);

/* The prefill GEMM (cuda/gemm.cu): y[m, n] (= or, with accumulate = 1, +=) sum_k a[m, k] *
 * w[n, k]; a [rows, depth] bf16, w [cols, depth] bf16 (rows padded to a multiple of 8 with
 * zeros, as in the library), y [rows, cols] fp32 (input too when accumulating). a_lo: NULL,
 * or [rows, depth] bf16, the low half of a split operand (a = a + a_lo, the form og_prefill
 * multiplies: y = sum_k a w + sum_k a_lo w, two fp32 sums). */
OG_API og_status og_test_gemm(const uint16_t *a, const uint16_t *a_lo, const uint16_t *w,
                              int32_t rows, int32_t cols, int32_t depth, int32_t accumulate,
                              float *y);

/* Its grouped form (the MoE experts of a prefill chunk): for group z < groups and m <
 * counts[z], y[y_rows[z * stride + m], n] = sum_k a[a_rows[z * stride + m] / a_row_div, k] *
 * w[z, n, k]. a [a_total, depth] bf16, w [groups, cols, depth] bf16, y [y_total, cols] fp32
 * (in/out: rows no group names keep the caller's values); counts[z] <= stride; every index in
 * range (checked on the host first). */
OG_API og_status og_test_gemm_grouped(const uint16_t *a, int32_t a_total, const uint16_t *w,
                                      int32_t groups, int32_t cols, int32_t depth,
                                      const int32_t *counts, const int32_t *a_rows,
                                      int32_t a_row_div, const int32_t *y_rows, int32_t stride,
                                      int32_t y_total, float *y);

/* ---- reliability hooks (cuda/reliability.cu; test-only, process-wide) ----------------
 * They let tests inject faults and look for damage; a program never needs them. */

/* Fail the n-th device or pinned allocation the library makes from now on (n = 0: the
 * next one) as if the device were out of memory; n = -1 disarms. Counts every engine
 * allocation (og_init's and any later one), on every thread. */
OG_API og_status og_test_fail_allocation_at(int32_t n);

/* Allocation counters (each pointer may be NULL): *calls = device and pinned allocations
 * attempted since the library was loaded (injected failures included); *device_live /
 * *pinned_live = allocations not yet released, *_bytes_live their sizes. */
OG_API og_status og_test_allocation_counts(int64_t *calls, int64_t *device_live,
                                           int64_t *pinned_live, uint64_t *device_bytes_live,
                                           uint64_t *pinned_bytes_live);

/* Make og_enqueue perform an illegal call while its stream is being captured, for the
 * next `count` captures (enqueues on a stream that is not capturing are unaffected and do
 * not count). kind:
 *   OG_TEST_CAPTURE_FAULT_NONE    disarm
 *   OG_TEST_CAPTURE_FAULT_MALLOC  cudaMalloc, checked: og_enqueue returns its error
 *                                 (OG_E_CUDA naming cudaMalloc; the capture is invalidated)
 *   OG_TEST_CAPTURE_FAULT_SYNC    cudaStreamSynchronize of the capturing stream, result
 *                                 ignored: the capture is invalidated and the body's next
 *                                 CUDA call (or the end of the capture) fails */
#define OG_TEST_CAPTURE_FAULT_NONE   0
#define OG_TEST_CAPTURE_FAULT_MALLOC 1
#define OG_TEST_CAPTURE_FAULT_SYNC   2
OG_API og_status og_test_set_capture_fault(int32_t kind, int32_t count);

/* Guard bands: og_init fills 256 bytes before and after each guarded buffer (the KV block
 * pool "kv_pool" and the block tables "kv_tables") with a known pattern. og_check_guards synchronizes the
 * engine's stream and compares them: OG_OK, or OG_E_CORRUPTED with a message naming the
 * buffer, the side and the first changed byte. Call it between steps (not while a graph
 * launched on another stream is in flight). */
OG_API og_status og_check_guards(og_engine *e);

/* Test only: flip one byte of a guard band: the last byte before `buffer` (after = 0) or
 * the first byte after it (after = 1). OG_E_INVALID_ARGUMENT for an unknown buffer name
 * (the message lists the guarded ones). */
OG_API og_status og_test_corrupt_guard(og_engine *e, const char *buffer, int32_t after);

/* Test only (diagnostics): leave the kernels of the given kinds out of every body enqueued from
 * now on (og_enqueue, og_run; a graph captured earlier keeps what it holds), so that a benchmark
 * can time a step without them: a kind's cost inside the graph is the difference. The logits
 * are then meaningless. kinds: a mask of OG_TEST_OMIT_*; 0 restores the whole body. */
#define OG_TEST_OMIT_QKV       1  /* RMSNorm + QKV projection */
#define OG_TEST_OMIT_ATTENTION 2  /* QK-norm + RoPE + KV write + attention */
#define OG_TEST_OMIT_O_PROJ    4  /* output projection + residual */
#define OG_TEST_OMIT_FFN_IN    8  /* dense: RMSNorm + gate/up + SwiGLU; MoE: router, top-k, experts' gate/up */
#define OG_TEST_OMIT_FFN_OUT  16  /* dense: down + residual; MoE: experts' down + weighted residual */
#define OG_TEST_OMIT_LM_HEAD  32  /* final RMSNorm + lm_head */
OG_API og_status og_test_set_omit(og_engine *e, int32_t kinds);

/* ---- the paged KV cache ---------------------------------------------------------------
 * A test pool is [n_blocks, block_stride] bytes; every block holds one layer's K page
 * [n_kv, page_size, hd] at byte k_offset, its V page at v_offset and, for OG_KV_INT8, scale
 * pages [n_kv, page_size] fp32 at k_scales_offset / v_scales_offset (ignored otherwise);
 * pages must lie inside the block, 16-byte aligned. Row t of KV head h is row
 * h * page_size + t % page_size of the pages of block block_table[t / page_size]. */

/* og_test_attention over a paged pool: the same kernel, reading through block_table
 * [n_table] (n_table * page_size >= max_seq_len). With the same split_len, the output is
 * bit-identical to og_test_attention over the same rows stored contiguously. */
OG_API og_status og_test_attention_paged(const float *q, const void *pool, int64_t block_stride,
                                         int32_t n_blocks, int32_t page_size, int64_t k_offset,
                                         int64_t v_offset, int64_t k_scales_offset,
                                         int64_t v_scales_offset, const int32_t *block_table,
                                         int32_t n_table, int32_t n_heads, int32_t n_kv_heads,
                                         int32_t head_dim, int32_t max_seq_len, int32_t kv_dtype,
                                         int32_t visible_len, int32_t split_len, int32_t band,
                                         float *out);

/* og_test_qk_norm_rope_kv writing into a paged pool (in/out): the row `position` goes to
 * block row_block, and entry position / page_size of row seq_slot of block_tables
 * [n_tables, max_blocks_per_seq] (in/out) is set to row_block, as the body does. A row_block
 * outside [0, n_blocks) stores nothing. */
OG_API og_status og_test_qk_norm_rope_kv_paged(
    float *qkv, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, const float *q_norm,
    const float *k_norm, float eps, const float *inv_freq, int32_t position, int32_t max_seq_len,
    int32_t kv_dtype, void *pool, int64_t block_stride, int32_t n_blocks, int32_t page_size,
    int64_t k_offset, int64_t v_offset, int64_t k_scales_offset, int64_t v_scales_offset,
    int32_t seq_slot, int32_t row_block, int32_t *block_tables, int32_t n_tables,
    int32_t max_blocks_per_seq);

/* The body's attention kernel with its fused prologue, over a paged pool: QK-norm + RoPE of
 * qkv at `position` and the new K/V row stored exactly as og_test_qk_norm_rope_kv_paged does
 * (qkv, pool and block_tables in/out as there; the body's kernel shares that one's per-head
 * code), then attention of the rotated q over rows [0, position] of sequence seq_slot, the new
 * row taken as stored. split_len as for og_test_attention (0 = the engine's choice). out
 * [n_heads * hd]. With the same split_len, out is bit-identical to og_test_attention_paged over
 * the q and the pool this call returns. */
OG_API og_status og_test_attention_fused(
    float *qkv, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, const float *q_norm,
    const float *k_norm, float eps, const float *inv_freq, int32_t position, int32_t max_seq_len,
    int32_t kv_dtype, void *pool, int64_t block_stride, int32_t n_blocks, int32_t page_size,
    int64_t k_offset, int64_t v_offset, int64_t k_scales_offset, int64_t v_scales_offset,
    int32_t seq_slot, int32_t row_block, int32_t *block_tables, int32_t n_tables,
    int32_t max_blocks_per_seq, int32_t split_len, int32_t band, float *out);

/* The block-zeroing kernel on a host buffer (in/out) of backing_bytes: the pool starts at
 * byte pool_offset (the bytes around it are guard regions the kernel must not touch) and
 * has n_blocks blocks of block_stride bytes; segment s is the page [segment_offsets[s],
 * + segment_page_bytes[s]) of each block (any byte alignment). Zeroes the pages of the
 * listed blocks in one launch. */
OG_API og_status og_test_zero_blocks(void *backing, uint64_t backing_bytes, uint64_t pool_offset,
                                     int64_t block_stride, int32_t n_blocks,
                                     const int64_t *segment_offsets,
                                     const int64_t *segment_page_bytes, int32_t n_segments,
                                     const int32_t *block_ids, int32_t n_ids);

/* The engine's block allocator (cuda/kv_pool.h) alone, on the host: no device needed.
 * Blocks are handed out 0, 1, 2, ... from a fresh allocator; a released block is handed out
 * next (a stack). Errors: OG_E_POOL_EXHAUSTED (allocate with no free block),
 * OG_E_INVALID_ARGUMENT (a block outside [0, n_blocks), or retain / release of a free block:
 * a double free). */
typedef struct og_test_allocator og_test_allocator;
OG_API og_status og_test_allocator_create(int32_t n_blocks, og_test_allocator **out);
OG_API og_status og_test_allocator_destroy(og_test_allocator *a);
OG_API og_status og_test_allocator_allocate(og_test_allocator *a, int32_t *block);
OG_API og_status og_test_allocator_retain(og_test_allocator *a, int32_t block);
/* *freed (may be NULL) = 1 when the count reached 0 and the block went back to the free list. */
OG_API og_status og_test_allocator_release(og_test_allocator *a, int32_t block, int32_t *freed);
/* *count = the block's reference count, 0 free, -1 outside the pool. */
OG_API og_status og_test_allocator_refcount(og_test_allocator *a, int32_t block, int32_t *count);
OG_API og_status og_test_allocator_free_count(og_test_allocator *a, int32_t *count);
/* `blocks` must list exactly the free blocks, each once; they are handed out in that order. */
OG_API og_status og_test_allocator_set_free_order(og_test_allocator *a, const int32_t *blocks,
                                                  int32_t count);

/* The same hook on an engine's pool: its free blocks are handed out in this order (to build
 * block tables that are deliberately non-contiguous and out of order). */
OG_API og_status og_test_kv_set_free_order(og_engine *e, const int32_t *blocks, int32_t count);

/* Inspection of an engine, for tests and diagnostics. */

/* Copy the engine's whole KV block pool (og_stats.kv_cache_bytes = n_blocks * block stride
 * bytes; layout in og_kv_segments) into the caller's host_dst (synchronous: the engine's stream
 * is drained first). OG_E_INVALID_ARGUMENT if host_dst is NULL or capacity_bytes is too small. */
OG_API og_status og_test_copy_kv_cache(og_engine *e, void *host_dst, uint64_t capacity_bytes);

/* *record = a copy of the pinned step record of slot 0, the one og_begin_step fills and the
 * body copies to the device (so a test can check that a refused call left it unchanged). */
OG_API og_status og_test_step_record(og_engine *e, og_step_record *record);

/* Zero every page of the listed blocks of the engine's pool now (one kernel launch of the
 * kernel that zeroes released blocks; the ids are checked first: OG_E_INVALID_ARGUMENT for an
 * id outside the pool, nothing zeroed), synchronously. */
OG_API og_status og_test_kv_zero_blocks(og_engine *e, const int32_t *blocks, int32_t count);

/* The decode body's sampling stage (cuda/sample.cu, OG_OUTPUT_SAMPLED) run n times on the same
 * logits [vocab] with the same generated-token counts [vocab] (NULL: none; no draw adds to them)
 * and parameters, draw k at row positions[k] (the Philox key): tokens[k], values[k] (the token's
 * log-probability; the greedy path's value for temperature 0). top [OG_MAX_LOGPROBS] (may be
 * NULL) and *n_top (may be NULL): the last draw's top log-probabilities. Logits with a NaN or
 * +inf (or all -inf): OG_E_NONFINITE_LOGITS, tokens OG_TOKEN_NONFINITE. */
OG_API og_status og_test_sample(const float *logits, int32_t vocab, const int32_t *counts,
                                const og_sampling_params *params, const int32_t *positions,
                                int32_t n, int32_t *tokens, float *values, og_top_logprob *top,
                                int32_t *n_top);

#ifdef __cplusplus
}
#endif
#endif /* ONEGRAPH_TESTING_H */
