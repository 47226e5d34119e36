// prefill.cuh — the batched prompt pass (og_prefill): the tensor-core GEMM (gemm.cu) and the
// per-chunk layer loop with its row-wise kernels (prefill.cu).
//
// A chunk of n prompt tokens (n <= the scratch's chunk rows) at positions [p0, p0 + n) of the
// selected sequence runs every layer in one pass, as the decode body runs one token:
//   x [n, H] = embed(tokens)
//   per layer:  normed2  = split(rmsnorm(x))                       [n, ldH]   bf16 hi + lo
//               qkv      = normed2 . W_qkv^T                       [n, qkv_rows] fp32 (GEMM)
//               per (row, head): QK-norm + RoPE at p0 + row; K/V quantized into the paged cache
//               attn2    = split(causal attention over cache rows [0, p0 + row])  [n, ldQ]
//               x       += attn2 . W_o^T                           (GEMM, residual)
//               dense:   normed2 = split(rmsnorm(x)); gate_up = normed2 . W_gu^T (GEMM);
//                        act2 = split(silu(gate) * up); x += act2 . W_down^T (GEMM, residual)
//               MoE:     normed2 = split(rmsnorm(x)); logits = normed2 . W_router^T (GEMM);
//                        top-k per row (the decode body's kernel); each expert's entries
//                        (rows that chose it) gathered into one grouped GEMM for gate|up,
//                        split(SwiGLU), one for down; x[row] += the weighted sum of the row's
//                        experts in selection order (the decode body's roundings). Quantized
//                        experts: per row, the decode body's MoE kernels.
// The caller then runs the decode body's final RMSNorm + lm_head GEMV on row n - 1 of x.
//
// Numerics (vs the decode body, which keeps every activation fp32): the GEMM inputs — the
// normed hidden state, the attention output and the SwiGLU activation — are written as an
// unevaluated sum of two bf16 values, x = hi + lo with hi = bf16(x), lo = bf16(x - hi) (round
// to nearest even; x - hi is exact in fp32), so the tensor cores can multiply them:
// |x - (hi + lo)| <= 2^-8 |x - hi| <= 2^-16 |x|, rms ~2^-18.5 relative (bf16 alone: 2^-8 at
// most, rms ~2^-9). Weights are bf16 on both paths, bf16 x bf16 products are exact in fp32,
// and the GEMM sums w.hi and w.lo in two fp32 accumulators (each in a fixed k order), then
// y = sum_hi + sum_lo. Each GEMM output y = sum_k w_k x_k thus differs from the decode path's
// by at most 2^-16 * sum_k |w_k x_k| plus the two paths' fp32 summation errors (at most
// ~depth * 2^-24 * sum_k |w_k x_k| each, typically ~sqrt(depth) * 2^-24): ~2^-18 relative
// typical (rel. L2), the size of what the fp32 summation order alone moves. QK-norm, RoPE and
// the K/V encoding run rope_kv.cuh's device functions (the decode body's own code: a warp per
// head, the same sums and roundings), so equal qkv values give equal K/V bits; RMSNorm,
// softmax and the residual stream stay fp32. The attention runs on the tensor cores too: the
// query and the softmax weights split hi + lo like the GEMM inputs, K/V codes exact in bf16
// (fp32 K/V split), the scales applied per key as decode attention applies them. Where a row's
// fp32 values still differ from the decode body's (by the bound above), a bf16 or int8 K/V
// element can round the other way: rel. L2 of a K/V row ~sqrt(delta * u) for a relative move
// delta and the element rounding u (2^-8 for bf16), ~1e-4 for delta ~2^-18 (~3e-3 when the
// activations were rounded to bf16 alone).
// Quantized dense weights (int8 / q4): before each GEMM the matrix is dequantized (w = q *
// scale in fp32: exact for q4, one rounding for int8) and split like the activations into
// bf16 w_hi + w_lo (exact for q4, whose w has at most 12 significant bits; within 2^-16 for
// int8), in a scratch matrix of the largest dense shape; y = (a_hi + a_lo) . w_hi + a_hi . w_lo,
// two GEMMs (the a_lo . w_lo term, below 2^-16 of each product, is left out). A q4 matrix's
// input is first rounded to int8 per group of 32, in fp32 before the split (the decode q4
// GEMV's rule, gemv_q4.cu): in the norm and SwiGLU row kernels, and for the attention output,
// which then goes through fp32 (over the q columns it has read) and split_rows_kernel.
// Every row's arithmetic is independent of the chunking (GEMM k-order fixed, attention key
// tiles aligned to absolute position 0), so any chunk size gives bit-identical results.
#pragma once

#include <vector>

#include "kernels.cuh"
#include "moe.cuh"

namespace og {

// ---- gemm.cu ------------------------------------------------------------------------
// y[m, n] (= or +=) sum_k a[m, k] * w[n, k] for m < rows, n < cols, k < depth:
//   a [rows, lda] bf16 (activations), w [cols, ldw] bf16 (a weight matrix, rows padded),
//   y [rows, ldy] fp32. depth must be a multiple of 8 (16-byte chunks) and <= lda, ldw; lda
//   and ldw multiples of 8; a, a_lo and w 16-byte aligned. Columns [depth_used, depth) of a,
//   a_lo and w must be finite (the library's pad columns are zeros).
//   a_lo: NULL, or the low half of a split operand [rows, lda] (a + a_lo): then
//   y = sum_k a w + sum_k a_lo w, two fp32 sums in the same k order, added last.
struct GemmArgs {
    const __nv_bfloat16 *a;
    const __nv_bfloat16 *a_lo;
    int lda;
    const __nv_bfloat16 *w;
    int ldw;
    float *y;
    int ldy;
    int rows, cols, depth;
    bool accumulate;              // y += instead of y =
    // Gathered / scattered rows and groups (the MoE experts, prefill.cu). Group z = blockIdx.z
    // multiplies rows a_rows[z * index_stride + m] / a_row_div of a (a_lo) by the matrix at
    // w + z * w_group_stride into rows y_rows[z * index_stride + m] of y, for m < group_rows[z]
    // (device counts; `rows` bounds them). Unset: one group, a row m -> y row m.
    const int32_t *a_rows = nullptr;
    int a_row_div = 1;
    const int32_t *y_rows = nullptr;
    const int32_t *group_rows = nullptr;
    int groups = 1;
    int64_t w_group_stride = 0;
    int index_stride = 0;
};
cudaError_t launch_gemm_bf16(const GemmArgs &args, cudaStream_t stream);

// c += a (16 x 16, row) * b (16 x 8, col), bf16 inputs, fp32 accumulators (the GEMM and the
// prefill attention). Lane (g, t) = (lane / 4, lane % 4) holds a: rows g, g + 8 x columns
// 2t, 2t + 1 (a[0], a[1]) and 2t + 8, 2t + 9 (a[2], a[3]); b: rows (k) 2t, 2t + 1 (b0) and
// 2t + 8, 2t + 9 (b1) of column g; c: rows g (c[0], c[1]) and g + 8 (c[2], c[3]) x columns
// 2t, 2t + 1. Each 32-bit register holds two bf16, the lower index in the low half.
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- prefill.cu ---------------------------------------------------------------------
struct PrefillLayer {
    bool is_moe = false;
    const float *input_layernorm = nullptr;           // [H]
    const float *post_attention_layernorm = nullptr;  // [H]
    const float *q_norm = nullptr, *k_norm = nullptr; // [hd] or NULL
    WeightMatrix qkv;                                 // [qkv_rows, H]
    WeightMatrix o_proj;                              // [H, q_size]
    WeightMatrix gate_up;                             // dense: [2I, H]
    WeightMatrix down;                                // dense: [H, I]
    WeightMatrix router;                              // MoE: [E, H] bf16
    WeightMatrix expert_gate_up, expert_down;         // MoE: [E * 2Im, H], [E * H, Im]
    KvPages kv;                                       // the layer's pages
};

// Device scratch for one chunk of `chunk` rows (allocated once, in the engine's arena).
struct PrefillScratch {
    int chunk = 0;
    int32_t *tokens = nullptr;         // [chunk]
    float *x = nullptr;                // [chunk, H]          the residual stream
    float *wide = nullptr;             // [chunk, prefill_wide_cols]  qkv, then gate|up
    __nv_bfloat16 *narrow = nullptr;   // [chunk, prefill_narrow_cols] GEMM inputs: hi = bf16(x)
    __nv_bfloat16 *narrow_lo = nullptr;// [chunk, prefill_narrow_cols] and lo = bf16(x - hi)
    __nv_bfloat16 *w_hi = nullptr;     // quantized dense weights only: [prefill_weight_elems]
    __nv_bfloat16 *w_lo = nullptr;     // one dequantized matrix as bf16 hi + lo, rows padded
    // MoE layers with bf16 experts (NULL otherwise: such layers go row by row). An entry is
    // one (row, slot) selection, entry = row * top_k + slot.
    float *moe_logits = nullptr;       // [chunk, E]           router logits
    int32_t *moe_selected = nullptr;   // [chunk, top_k]       experts, selection order
    float *moe_weights = nullptr;      // [chunk, top_k]       their weights
    int32_t *moe_entries = nullptr;    // [E, chunk]           expert e's entries, ascending
    int32_t *moe_counts = nullptr;     // [E]                  how many
    float *moe_out = nullptr;          // [chunk * top_k, max(2 Im, H)]  gate|up, then down
    __nv_bfloat16 *moe_act = nullptr;  // [chunk * top_k, ldIm] split(SwiGLU), hi
    __nv_bfloat16 *moe_act_lo = nullptr;  //                   and lo
};
inline int prefill_wide_cols(int qkv_rows, int intermediate) {
    return qkv_rows > 2 * intermediate ? qkv_rows : 2 * intermediate;
}
// Elements of the largest dense matrix [rows, padded_cols(cols)] of a layer.
inline size_t prefill_weight_elems(int hidden, int q_size, int qkv_rows, int intermediate) {
    const size_t m[] = {(size_t)qkv_rows * padded_cols(hidden), (size_t)hidden * padded_cols(q_size),
                        (size_t)2 * intermediate * padded_cols(hidden),
                        (size_t)hidden * padded_cols(intermediate > 0 ? intermediate : 1)};
    size_t most = 0;
    for (size_t v : m) most = v > most ? v : most;
    return most;
}
inline int prefill_narrow_cols(int hidden, int q_size, int intermediate) {
    const int a = padded_cols(hidden), b = padded_cols(q_size), c = padded_cols(intermediate > 0 ? intermediate : 1);
    return a > b ? (a > c ? a : c) : (b > c ? b : c);
}

struct PrefillModel {
    int V, H, I, n_heads, n_kv, hd, max_seq, kv_dtype;
    int E, top_k, Im, norm_topk_prob;
    float eps;
    const __nv_bfloat16 *embed_tokens;    // [V, ldH]
    const float *inv_freq;                // [hd / 2]
    std::vector<PrefillLayer> layers;
    // MoE layers reuse the decode body's router plan and buffers, one row at a time.
    GemvPlan plan_router;
    float *router_logits = nullptr, *moe_normed = nullptr, *selected_weights = nullptr,
          *moe_act = nullptr;
    int32_t *selected_experts = nullptr;
    PrefillScratch scratch;
};

// Enqueue one chunk: rows [0, n) of scratch.tokens (already on the device) at positions
// [p0, p0 + n). table_row: the sequence's block-table row on the device, holding the blocks of
// rows [0, p0 + n). Leaves the final hidden states in scratch.x. No synchronization.
cudaError_t enqueue_prefill_chunk(const PrefillModel &m, const int32_t *table_row, int n, int p0,
                                  cudaStream_t stream);

}  // namespace og
