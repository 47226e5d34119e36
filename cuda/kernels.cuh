// kernels.cuh — launchers of the decode body's kernels (all but the MoE ones, which are
// in moe.cuh). One family per file:
//   embed.cu      embedding gather                       table[token] (bf16) -> x (fp32)
//   gemv.cu       GEMV over bf16, int8 or q4 weights (quant.cuh), optionally with the
//                 RMSNorm of its input fused in front, a residual add, or the gate/up SwiGLU
//                 pair fused behind: the dispatch; the kernels are in gemv_bf16.cu,
//                 gemv_int8.cu and gemv_q4.cu
//   rope_kv.cu    the RoPE frequency table; rope_kv_testing.cu (testing library) the per-head
//                 QK-norm + RoPE + K/V write as a standalone kernel (the body runs the same
//                 per-head code, rope_kv.cuh, inside attention.cu)
//   attention.cu  decode attention over the paged cache on a fixed grid (chunks spread over
//                 blocks, partials combined by each KV head's last finishing block); in the
//                 body with QK-norm + RoPE + the new K/V row's write fused in front
//   kv_blocks.cu  KV block ops: zeroing a list of blocks across every segment of the pool
//   argmax.cu     the greedy next token: argmax over the logits, on the device
// Each launcher takes a cudaStream_t and returns the cudaError_t of its launch. `pdl`
// adds the programmatic-dependent-launch attribute (see common.cuh).
#pragma once

#include "common.cuh"

namespace og {

// ---- embed.cu -----------------------------------------------------------------------
// x[i] = float(table[token, i]) for i < hidden. table: [vocab, padded_cols(hidden)]. token =
// step->token, or previous->token when it is OG_TOKEN_PREVIOUS_ARGMAX (a chained step: the
// argmax of the step before, on the device; previous may be NULL otherwise). A token outside
// [0, vocab) (never after og_begin_step's check) yields x = NaN.
struct NextToken;
cudaError_t launch_embedding(const __nv_bfloat16 *table, int vocab, int hidden,
                             const og_step_record *step, const NextToken *previous, float *x,
                             cudaStream_t stream, bool pdl);

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
// The modes that RMSNorm their input first.
__host__ __device__ constexpr bool mode_has_norm(int mode) {
    return mode == kGemvNorm || mode == kGemvNormSwiglu;
}

struct GemvArgs {
    WeightMatrix w;               // [rows, cols] (2*I rows for kGemvNormSwiglu); format = the plan's
    const float *x;               // [cols]
    const float *norm_weight;     // [cols] (norm modes)
    float eps;                    // RMSNorm epsilon (norm modes)
    float *y;                     // [rows], or [rows / 2] for kGemvNormSwiglu
    float *normed_out;            // optional [cols] (kGemvNorm)
    // kGemvResidual: y's last writer is two or more kernels back in the stream, so the q4 and
    // bf16 kernels may read y before their PDL wait (the bf16 kernel for one vector). Why that
    // is safe: every kernel of the body triggers its dependents only after its own wait, so
    // this kernel's blocks start only after every block of the kernel right before it has
    // passed that wait, which returns once the kernel before that has completed and its writes
    // are visible.
    bool residual_settled = false;
};

// Launch geometry, fixed by the matrix shape: a grid no larger than what is resident at
// once; each warp walks its rows with a grid stride.
struct GemvPlan {
    int grid = 0;
    int warps = 0;                // per block: 8, 4 or 2
    int unroll = 4;               // bf16: 16-byte chunks per row per lane in flight (4, 8, 12)
    int stages = 0;               // int8 / q4: k-blocks per lane in the load ring (gemv.cu)
    int smem_bytes = 0;
    int format = OG_WEIGHTS_BF16;
    int stream = 0;               // q4: kQ4StreamRegisters or kQ4StreamBulk (gemv_q4.cu)
};
// How a q4 GEMV streams its weights: each warp's loads into two register slots, or the SM's
// copy engine into a shared-memory ring (for the long streams: the planner's bulk_stream).
constexpr int kQ4StreamRegisters = 0;
constexpr int kQ4StreamBulk = 1;

// ---- GEMV over several vectors (the verify body) ----
// y_j = W . x_j for j < n <= kGemvMaxVectors, each y_j bit-identical to launch_gemv's result
// for x_j alone: bf16 weights on the multi-vector instance of the kernel (the weights read once
// for all n; same warps and unroll as the single plan, so the same per-vector arithmetic); where
// that does not apply (int8 / q4 weights, or n staged inputs beyond a block's shared memory) one
// launch_gemv per vector. Strides in floats; every x_j (and normed_out_j) x_stride after the
// one before, every y_j y_stride; x_stride keeps each x_j 16-byte aligned as the single x is.
constexpr int kGemvMaxVectors = 9;
struct GemvMultiPlan {
    GemvPlan single;              // the one-vector plan (the decode body's)
    int grid[kGemvMaxVectors + 1] = {};  // per n, the multi-vector instance's grid; 0: per-vector launches
};
cudaError_t gemv_multi_plan(GemvMode mode, const GemvPlan &single, int rows, int cols,
                            GemvMultiPlan *plan);
cudaError_t launch_gemv_multi(GemvMode mode, const GemvMultiPlan &plan, const GemvArgs &args, int n,
                              int64_t x_stride, int64_t y_stride, cudaStream_t stream, bool pdl);

// Plan a GEMV on the current device (occupancy query, shared-memory limit). Call once
// per shape outside stream capture.
// bulk_stream: a q4 plan takes the copy-engine stream where the shape allows (other formats
// ignore it).
cudaError_t gemv_plan(GemvMode mode, int rows, int cols, GemvPlan *plan,
                      int format = OG_WEIGHTS_BF16, bool bulk_stream = false);
// Shared memory the GEMV's staged input needs: cols rounded up to the format's chunk, in fp32.
size_t gemv_input_smem_bytes(int cols, int format);
cudaError_t launch_gemv(GemvMode mode, const GemvPlan &plan, const GemvArgs &args,
                        cudaStream_t stream, bool pdl);
// The MoE experts' gate/up + SwiGLU for int8 / q4 experts (moe.cu), on the quantized GEMV's
// tensor-core kernel: act[j, i] = silu(gate_e[i] . x) * (up_e[i] . x), e = selected[j], for
// j < top_k, i < inter; weights/scales in the layout of moe.cuh (2 * inter rows per expert).
cudaError_t launch_moe_gate_up_quant(int format, const void *weights, const void *scales,
                                     const float *x_normed, const int32_t *selected, int top_k,
                                     int hidden, int inter, float *act, cudaStream_t stream,
                                     bool pdl);
// ... and down: x[r] += sum over j in selection order of sel_weights[j] * (down_e[r] . act[j]),
// e = selected[j] (top_k <= 32), with explicit roundings w_j * s_j then + y as moe.cuh states.
cudaError_t launch_moe_down_quant(int format, const void *weights, const void *scales,
                                  const float *act, const int32_t *selected,
                                  const float *sel_weights, int top_k, int hidden, int inter,
                                  float *x, cudaStream_t stream, bool pdl);

// ---- gemv_q4.cu: q4 weights x the input quantized to int8 per group of 32 (w4a8, dp4a) ----
// gemv_plan, launch_gemv, gemv_input_smem_bytes and the two MoE launchers above route q4 here.
size_t gemv_q4_smem_bytes(int cols);
cudaError_t gemv_q4_plan(GemvMode mode, int rows, int cols, GemvPlan *plan, bool bulk_stream);
cudaError_t launch_gemv_q4(GemvMode mode, const GemvPlan &plan, const GemvArgs &args,
                           cudaStream_t stream, bool pdl);
cudaError_t launch_moe_gate_up_q4(const void *weights, const void *scales, const float *x_normed,
                                  const int32_t *selected, int top_k, int hidden, int inter,
                                  float *act, cudaStream_t stream, bool pdl);
cudaError_t launch_moe_down_q4(const void *weights, const void *scales, const float *act,
                               const int32_t *selected, const float *sel_weights, int top_k,
                               int hidden, int inter, float *x, cudaStream_t stream, bool pdl);

// ---- the paged KV cache (laid out by kv_pool.h) --------------------------------------
// The cache is a pool of fixed-size blocks. A block is packed: it holds, for every layer,
// a K page [n_kv, page_size, hd] and a V page of the KV element type and (int8 only) a K
// and a V scale page [n_kv, page_size] fp32, each at a fixed byte offset inside the block.
// So the distance from one block to the next (block_stride) is larger than any one page.
// Row t of KV head h of a sequence lives in block b = table[t / page_size], at row
// h * page_size + t % page_size of each page of that block.
struct KvPages {
    char *k, *v;                  // the layer's K and V page in block 0 of the pool
    char *k_scales, *v_scales;    // its scale pages in block 0 (OG_KV_INT8), else NULL
    int64_t block_stride;         // bytes from a block to the next
    int page_size;                // rows per block
    int n_blocks;                 // blocks in the pool
    const int32_t *block_tables;  // [max_sequences, max_blocks_per_seq] block ids; a step
                                  // reads row step->seq_slot
    int max_blocks_per_seq;
};

// One segment of a packed block: bytes [offset_bytes, offset_bytes + page_bytes) of every
// block of the pool hold one page (a layer's K, V, K scales or V scales).
struct KvSegment {
    int64_t offset_bytes;
    int64_t page_bytes;
};

// ---- rope_kv.cu, rope_kv_testing.cu ---------------------------------------------------
// inv_freq[i] = float(1 / theta^(2i / head_dim)) / float(linear_factor): the power in
// float64, the division by the 'linear' rope_scaling factor in fp32 (as the reference).
void rope_inv_freq(int head_dim, double theta, double linear_factor, float *inv_freq);

struct RopeKvArgs {
    float *qkv;                   // [n_heads*hd | n_kv*hd | n_kv*hd]; q rewritten in place
    const float *q_norm;          // [hd] or NULL (no QK-norm; then k_norm is NULL too)
    const float *k_norm;          // [hd] or NULL
    float eps;
    const float *inv_freq;        // [hd / 2]
    const og_step_record *step;   // position = the row written, into block step->row_block
    int n_heads, n_kv_heads, head_dim, max_seq_len, kv_dtype;
    KvPages kv;                   // the layer's pages; kv.block_tables is not read
    int32_t *table_update;        // NULL, or the block tables: entry position / page_size of
                                  // row step->seq_slot is set to step->row_block
};
// One warp per query head and per KV head. Query heads: QK-norm, RoPE, in place. KV heads:
// QK-norm + RoPE of k, then k and v (v as is) stored at row `position` of block
// step->row_block (nothing is stored when the position or the block is out of range). The
// decode body does not launch it (its attention kernel runs the same steps): it is the
// reference the kernel tests hold the fused prologue against, in the testing library only.
#ifdef OG_TESTING
cudaError_t launch_qk_norm_rope_kv(const RopeKvArgs &args, cudaStream_t stream, bool pdl);
#endif

// ---- attention.cu -------------------------------------------------------------------
struct AttentionPlan {
    int split_len = 0;            // rows per chunk (a multiple of 32)
    int n_splits = 0;             // ceil(max_seq_len / split_len): chunks at full context
    int n_blocks = 0;             // blocks per (KV head, head group); block b takes chunks b,
                                  // b + n_blocks, ...
    int head_group = 0;           // query heads accumulated together in registers (HG)
    int head_groups = 0;          // ceil(n_heads / n_kv_heads / HG): blocks side by side per chunk
    bool tensor_cores = false;    // the fold on the tensor cores (attention.cu kMmaFold)
    bool short_tiles = false;     // the short band's tiles: half the rows a warp (int8, 64 dims)
    int smem_bytes = 0;
};
// Which plan attention_plan makes (the engine's two attention bands, engine.cuh; the testing
// ABI's band argument takes the same values):
//   kBandShort: the CUDA cores, with tiles of half the long band's rows a warp for int8 rows of
//     64 dims (a short context spreads over more of a block's warps), and with the default chunk
//     the narrowest head group that still gives every chunk of max_seq_len rows a block of its
//     own;
//   kBandLong: a KV head's query heads in one group, folded on the tensor cores where a group of
//     4 or 8 int8 rows of 128 dims makes them win (docs/performance.md), else the widest group
//     on the CUDA cores;
//   kBandLongTensorCores: the same on the tensor cores wherever that fold is compiled (int8 rows
//     of 128 dims, groups of 2, 4 or 8);
//   kBandLongCudaCores: the same, never on the tensor cores.
enum AttentionBand : int { kBandShort = 0, kBandLong = 1, kBandLongTensorCores = 2, kBandLongCudaCores = 3 };
// split_len 0: the kernel's default chunk (one tile per warp); otherwise rounded up to a
// multiple of 32. n_blocks: one wave of blocks over the KV heads, at most n_splits. Fails with
// cudaErrorInvalidValue when the shape needs more shared memory than a block can have.
cudaError_t attention_plan(int n_heads, int n_kv_heads, int head_dim, int max_seq_len,
                           int kv_dtype, int split_len, AttentionBand band, AttentionPlan *plan);
// Size of the scratch a launch of `rows` rows needs: partial outputs and softmax statistics.
size_t attention_partial_floats(int n_heads, int head_dim, const AttentionPlan &plan, int rows = 1);
// Entries of AttentionArgs::counters: one per (row, KV head, head group).
int attention_counters(int n_kv_heads, const AttentionPlan &plan, int rows = 1);
// The most rows one launch takes (AttentionArgs::n_rows): the verify body's positions.
constexpr int kAttnMaxRows = OG_MAX_VERIFY;

struct AttentionArgs {
    // Fused mode (qkv != NULL: the body): q and the new K/V row come from the QKV GEMV's
    // output, with rope_kv.cu's arithmetic: QK-norm (q_norm / k_norm, or both NULL), RoPE at
    // step->position (inv_freq [hd / 2]); k and v are stored at row `position` of block
    // step->row_block (nothing is stored when the position or the block is out of range) and
    // attention reads that row as stored.
    const float *qkv;             // [n_heads*hd | n_kv*hd | n_kv*hd], or NULL
    const float *q_norm;
    const float *k_norm;
    float eps;
    const float *inv_freq;
    int32_t *table_update;        // NULL, or the block tables: entry position / page_size of
                                  // row step->seq_slot is set to step->row_block
    float *q_out;                 // NULL, or [n_heads * hd]: receives the rotated q (tests)
    // Attention only (qkv == NULL): q [n_heads * hd], normed and rotated.
    const float *q;
    KvPages kv;                   // the layer's pages, read through row step->seq_slot of
                                  // kv.block_tables
    const og_step_record *step;   // visible length = position + 1
    int n_heads, n_kv_heads, head_dim, max_seq_len, kv_dtype;
    float *partials;              // attention_partial_floats(...) floats
    unsigned *counters;           // [attention_counters(...)], zero before the first launch;
                                  // each launch leaves them zero again
    float *out;                   // [n_heads * hd]
    // Rows (grid z, fused mode): n_rows consecutive positions of one sequence, step[0 ..
    // n_rows), row j's qkv at qkv + j * qkv_stride and its out at out + j * out_stride, its
    // partials and counters after row j - 1's. Row j attends to rows 0..j of the launch from
    // the rows' own qkv (encoded in shared memory exactly as they are stored) and to earlier
    // positions from the cache, so each row's result is a one-row launch's at its position
    // once the rows before it are stored. Row j stores only its own K/V row.
    int n_rows = 1;
    int64_t qkv_stride = 0, out_stride = 0;
};
cudaError_t launch_attention(const AttentionArgs &args, const AttentionPlan &plan,
                             cudaStream_t stream, bool pdl);

// ---- kv_blocks.cu -------------------------------------------------------------------
struct ZeroBlocksArgs {
    char *base;                   // block 0 of the pool
    int64_t block_stride;         // bytes from a block to the next
    int n_blocks;                 // blocks in the pool (ids outside [0, n_blocks) are skipped)
    const KvSegment *segments;    // [n_segments], device memory
    int n_segments;
    const int32_t *block_ids;     // [n_ids], device memory
    int n_ids;
};
// One launch zeroes every segment's page of every listed block: for block b and segment s
// the bytes [base + b * block_stride + s.offset_bytes, ... + s.page_bytes). Blocks step by
// the block stride, never by the page size (a packed block's segments are smaller than
// the block), and nothing outside a page is written. Any byte alignment. No launch when
// there is nothing to zero.
cudaError_t launch_zero_blocks(const ZeroBlocksArgs &args, cudaStream_t stream);

// ---- argmax.cu ----------------------------------------------------------------------
// The step's greedy result, as the body copies it to the host (8 bytes).
struct NextToken {
    int32_t token;  // argmax of the logits: the lowest id among equal maxima, a NaN first
    float logit;    // its logit (NaN when any logit is NaN)
};
constexpr int kArgmaxMaxBlocks = 256;
// Blocks (= NextToken partials) the argmax of n logits takes: at most kArgmaxMaxBlocks.
int argmax_partials(int n);
// *out = the argmax of logits[0, n); partials: argmax_partials(n) entries of scratch;
// ticket: a counter that is 0 before the launch (zeroed memory) and 0 again after it.
cudaError_t launch_argmax(const float *logits, int n, NextToken *partials, unsigned *ticket, NextToken *out,
                          cudaStream_t stream, bool pdl);
// The argmax of each of `rows` rows of n logits, ld floats apart, in one launch: row y's
// result in out[y]; it takes the partials and ticket after row y - 1's (rows * argmax_partials(n)
// partials, rows tickets).
cudaError_t launch_argmax_rows(const float *logits, int n, int rows, int64_t ld, NextToken *partials,
                               unsigned *tickets, NextToken *out, cudaStream_t stream, bool pdl);

}  // namespace og
