// kernels.cuh — launchers of the decode body's kernels (all but the MoE ones, which are
// in moe.cuh). One family per file:
//   embed.cu      embedding gather                       table[token] (bf16) -> x (fp32)
//   gemv.cu       GEMV over bf16, int8 or q4 weights (quant.cuh), optionally with the
//                 RMSNorm of its input fused in front, a residual add, or the gate/up SwiGLU
//                 pair fused behind
//   rope_kv.cu    per-head QK-norm + RoPE + K/V quantization into the cache row
//   attention.cu  split-KV decode attention with the combine done by each KV head's
//                 last finishing block
// Each launcher takes a cudaStream_t and returns the cudaError_t of its launch. `pdl`
// adds the programmatic-dependent-launch attribute (see common.cuh).
#pragma once

#include "common.cuh"

namespace og {

// ---- embed.cu -----------------------------------------------------------------------
// x[i] = float(table[step->token, i]) for i < hidden. table: [vocab, padded_cols(hidden)].
// A token outside [0, vocab) (never after og_begin_step's check) yields x = NaN.
cudaError_t launch_embedding(const __nv_bfloat16 *table, int vocab, int hidden,
                             const og_step_record *step, float *x, cudaStream_t stream,
                             bool pdl);

// ---- gemv.cu ------------------------------------------------------------------------
enum GemvMode : int {
    // y[r] = W[r] . x
    kGemvPlain = 0,
    // n = rmsnorm(x) * norm_weight; y[r] = W[r] . n; block 0 also writes n to normed_out
    // when it is not NULL (the MoE experts read it).
    kGemvNorm = 1,
    // y[r] += W[r] . x   (x and y are distinct buffers)
    kGemvResidual = 2,
    // n = rmsnorm(x) * norm_weight; W holds 2*I rows (gate rows [0, I), up rows [I, 2I));
    // y[i] = silu(W[i] . n) * (W[I + i] . n) for i < I, silu(g) = g / (1 + exp(-g)).
    kGemvNormSwiglu = 3,
};

struct GemvArgs {
    const void *weight;           // format's layout (quant.cuh); bf16: [rows, padded_cols(cols)]
    int rows;                     // rows of weight (2*I for kGemvNormSwiglu)
    int cols;
    const float *x;               // [cols]
    const float *norm_weight;     // [cols] (norm modes)
    float eps;                    // RMSNorm epsilon (norm modes)
    float *y;                     // [rows], or [rows / 2] for kGemvNormSwiglu
    float *normed_out;            // optional [cols] (kGemvNorm)
    const void *scales = nullptr; // int8: [rows] fp32; q4: [rows, ceil(cols / 32)] bf16
    int format = OG_WEIGHTS_BF16; // OG_WEIGHTS_*; must equal the plan's
};

// Launch geometry, fixed by the matrix shape: a grid no larger than what is resident at
// once; each warp walks its rows with a grid stride.
struct GemvPlan {
    int grid = 0;
    int warps = 0;                // per block: 8, 4 or 2
    int smem_bytes = 0;
    int format = OG_WEIGHTS_BF16;
};

// Plan a GEMV on the current device (occupancy query, shared-memory limit). Call once
// per shape outside stream capture.
cudaError_t gemv_plan(GemvMode mode, int rows, int cols, GemvPlan *plan,
                      int format = OG_WEIGHTS_BF16);
// Shared memory the GEMV's staged input needs: cols rounded up to the format's chunk, in fp32.
size_t gemv_input_smem_bytes(int cols, int format);
cudaError_t launch_gemv(GemvMode mode, const GemvPlan &plan, const GemvArgs &args,
                        cudaStream_t stream, bool pdl);

// ---- rope_kv.cu ---------------------------------------------------------------------
// inv_freq[i] = float(1 / theta^(2i / head_dim)) / float(linear_factor): the power in
// float64, the division by the 'linear' rope_scaling factor in fp32 (as the reference).
void rope_inv_freq(int head_dim, double theta, double linear_factor, float *inv_freq);

struct RopeKvArgs {
    float *qkv;                   // [n_heads*hd | n_kv*hd | n_kv*hd]; q rewritten in place
    const float *q_norm;          // [hd] or NULL (no QK-norm; then k_norm is NULL too)
    const float *k_norm;          // [hd] or NULL
    float eps;
    const float *inv_freq;        // [hd / 2]
    const og_step_record *step;   // position = the cache row written
    int n_heads, n_kv_heads, head_dim, max_seq_len, kv_dtype;
    void *k_cache, *v_cache;      // [n_kv, max_seq_len, hd] of kv_dtype
    float *k_scales, *v_scales;   // [n_kv, max_seq_len] (OG_KV_INT8 only, else unused)
};
// Grid: one block per query head and per KV head. Query heads: QK-norm, RoPE, in place.
// KV heads: QK-norm + RoPE of k, then k and v (v as is) stored at row `position`.
cudaError_t launch_qk_norm_rope_kv(const RopeKvArgs &args, cudaStream_t stream, bool pdl);

// ---- attention.cu -------------------------------------------------------------------
struct AttentionPlan {
    int split_len = 0;            // positions per split (multiple of 32)
    int n_splits = 0;             // ceil(max_seq_len / split_len)
    int smem_bytes = 0;
};
// split_len 0: chosen from max_seq_len and the SM count (about two blocks per SM at full
// context); otherwise rounded up to a multiple of 32. Fails with cudaErrorInvalidValue
// when the shape needs more shared memory than a block can have.
cudaError_t attention_plan(int n_heads, int n_kv_heads, int head_dim, int max_seq_len,
                           int kv_dtype, int split_len, AttentionPlan *plan);
// Size of the scratch the launch needs: partial outputs and softmax statistics.
size_t attention_partial_floats(int n_heads, int head_dim, const AttentionPlan &plan);

struct AttentionArgs {
    const float *q;               // [n_heads * hd], normed and rotated
    const void *k_cache, *v_cache;    // [n_kv, max_seq_len, hd] of kv_dtype
    const float *k_scales, *v_scales; // [n_kv, max_seq_len] (OG_KV_INT8)
    const og_step_record *step;   // visible length = position + 1
    int n_heads, n_kv_heads, head_dim, max_seq_len, kv_dtype;
    float *partials;              // attention_partial_floats(...) floats
    unsigned *counters;           // [n_kv_heads], zero before the first launch; each launch
                                  // leaves them zero again
    float *out;                   // [n_heads * hd]
};
cudaError_t launch_attention(const AttentionArgs &args, const AttentionPlan &plan,
                             cudaStream_t stream, bool pdl);

}  // namespace og
