// prefill.cu — the batched prompt pass: one chunk of prompt tokens through every layer at once
// (the layer loop and its numerics are described in prefill.cuh). The row-wise kernels here:
//
// A GEMM input v (fp32) is stored split, as two bf16 matrices of the same shape: hi = bf16(v),
// lo = bf16(v - hi) (round to nearest even; lo = 0 where hi overflows to +-inf), see prefill.cuh.
//
//   embed_rows          x[r, :] = float(embed_tokens[tokens[r], :])
//   rmsnorm_rows_split  out[r, :] = split(x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w), pad cols 0
//   rope_kv_rows        for every row r at position p0 + r and every head, a warp running
//                       rope_kv.cuh's device functions (QK-norm, RoPE, the cache-row encoding)
//                       exactly as the decode body does: q rewritten in place, K/V encoded into
//                       the paged cache row of block table_row[position / page]; a row's K/V
//                       bits equal what the decode body writes from the same qkv values
//   prefill_attention   causal attention of the chunk's queries over cache rows [0, p0 + r]
//                       (tensor cores; see below)
//   swiglu_rows         act[r, i] = split(silu(gate) * up), silu(g) = g / (1 + exp(-g))
//   dequant_split       a quantized weight matrix -> split(q * scale) [rows, padded_cols] bf16
//                       hi + lo (pad columns 0), for the GEMMs of quantized dense weights
//   moe_group_entries   per expert, the chunk's (row, slot) selections of it, in ascending order:
//                       the row lists of the experts' grouped GEMMs (gemm.cu)
//   moe_combine_rows    x[r] += the weighted sum of row r's expert outputs, selection order
//
// prefill_attention: grid (query tiles of 64 rows, n_heads), 4 warps of 16 query rows each, on
// the tensor cores (mma.sync m16n8k16, bf16 inputs, fp32 accumulators), flash-style. A block
// walks the keys [0, p0 + its last row] in tiles of BK rows (64; 32 at head dim 256) aligned
// to position 0, reading each key row through the block table into shared memory as bf16:
// K as [key][dim], V transposed as [dim][key]. int8 codes and bf16 values are exact in bf16 (the
// int8 scales stay per key), fp32 K/V are split hi + lo. The queries are split hi + lo as the
// GEMM inputs are. A warp computes S = Q K^T for its 16 rows x BK keys (q_hi k + q_lo k, and
// + q_hi k_lo for fp32), scales as decode attention does ((q . k) * (k_scale * (1 / sqrt(hd)))
// for int8, (q . k) * (1 / sqrt(hd)) otherwise), masks keys after the row's position with -inf,
// and updates an online softmax per row (running max m and sum l; o rescaled by exp(m_old -
// m_new)). The weights p (times the key's V scale for int8) are then, as they lie in the S
// accumulators, the A operand of O += P V, split hi + lo. out = o / l, split for o_proj. The
// head dim is padded with zeros to HD = 64, 128 or 256. Against fp32 arithmetic each product
// carries the split's relative error (at most 2^-16 of its size, as the GEMMs'), and the sums
// run in the mma's order; a row's result does not depend on the other rows or on the chunking
// (a key tile after all of a warp's rows is skipped: every weight in it would be 0).
#include <math.h>

#include "prefill.cuh"
#include "quant.cuh"
#include "rope_kv.cuh"

namespace og {
namespace {

constexpr int kRowThreads = 256;

// v as hi + lo: hi = bf16(v), lo = bf16(v - hi) (exact difference; 0 when hi is +-inf).
__device__ __forceinline__ void store_split(float v, __nv_bfloat16 *hi, __nv_bfloat16 *lo) {
    const __nv_bfloat16 h = __float2bfloat16_rn(v);
    const float hf = __bfloat162float(h);
    *hi = h;
    *lo = __float2bfloat16_rn(isinf(hf) ? 0.f : __fsub_rn(v, hf));
}

__global__ void __launch_bounds__(kRowThreads)
    embed_rows_kernel(const __nv_bfloat16 *table, int vocab, int hidden, const int32_t *tokens,
                      float *x) {
    const int row = blockIdx.x;
    const int token = tokens[row];
    float *dst = x + (size_t)row * hidden;
    if (token < 0 || token >= vocab) {  // unreachable through og_prefill's checks
        for (int i = threadIdx.x; i < hidden; i += kRowThreads) dst[i] = __int_as_float(0x7fc00000);
        return;
    }
    const uint16_t *src = reinterpret_cast<const uint16_t *>(table) + (size_t)token * padded_cols(hidden);
    for (int i = threadIdx.x; i < hidden; i += kRowThreads) dst[i] = bf16_bits_to_float(src[i]);
}

// v rounded by the q4 GEMV's input rule (gemv_q4.cu, quant.quantize_input_q8) over the aligned
// group of 32 columns this warp's lanes hold (lane = column % 32; every lane calls it, columns
// past the row pass 0): rint(v * (127 / max|v|)) * (max|v| / 127), NaN for a non-finite group.
__device__ __forceinline__ float q8_round_group(float v) {
    const float amax = warp_max(fabsf(v));
    const bool finite = __all_sync(kFullMask, q8_finite(v));
    return __fmul_rn((float)q8_code(v, q8_inverse(amax)), q8_scale(amax, finite));
}

// q8: round each group of 32 columns as the q4 GEMV does (the next GEMM has q4 weights), in
// fp32 before the split, so that the batched pass starts from the decode kernels' codes.
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_rows_split_kernel(const float *x, const float *weight, float eps, int hidden,
                              __nv_bfloat16 *out, __nv_bfloat16 *out_lo, int ld, bool q8) {
    __shared__ float scratch[kRowThreads / kWarpSize];
    const int row = blockIdx.x;
    const float *xr = x + (size_t)row * hidden;
    float sum_sq = 0.f;
    for (int i = threadIdx.x; i < hidden; i += kRowThreads) sum_sq = fmaf(xr[i], xr[i], sum_sq);
    const float total = block_sum<kRowThreads>(sum_sq, scratch);
    const float inv_rms = 1.0f / sqrtf(total / (float)hidden + eps);
    __nv_bfloat16 *dst = out + (size_t)row * ld, *dst_lo = out_lo + (size_t)row * ld;
    for (int base = 0; base < ld; base += kRowThreads) {  // whole warps: q8's shuffles
        const int i = base + threadIdx.x;
        float v = i < hidden ? xr[i] * inv_rms * weight[i] : 0.f;
        if (q8) v = q8_round_group(v);
        if (i < ld) store_split(v, dst + i, dst_lo + i);
    }
}

// The row kernels below: one warp per (row, 32 columns) of a [rows, ld] output, over a
// grid-strided range. value(row, i) gives column i's fp32 value (0 in the pad columns); q8
// rounds it as rmsnorm_rows_split_kernel does (a group per warp), then it is split into hi / lo.
template <class Value>
__device__ __forceinline__ void split_row_slabs(int rows, int ld, bool q8, __nv_bfloat16 *out,
                                                __nv_bfloat16 *out_lo, Value value) {
    const int slabs = ceil_div(ld, kWarpSize), lane = threadIdx.x % kWarpSize;
    const int64_t total = (int64_t)rows * slabs;
    for (int64_t item = ((int64_t)blockIdx.x * kRowThreads + threadIdx.x) / kWarpSize; item < total;
         item += (int64_t)gridDim.x * kRowThreads / kWarpSize) {
        const int row = (int)(item / slabs), i = (int)(item % slabs) * kWarpSize + lane;
        float v = value(row, i);
        if (q8) v = q8_round_group(v);
        if (i < ld) store_split(v, out + (size_t)row * ld + i, out_lo + (size_t)row * ld + i);
    }
}

// Rows of an fp32 matrix (src [rows, src_ld], cols used) split into hi / lo [rows, ld].
__global__ void __launch_bounds__(kRowThreads)
    split_rows_kernel(const float *src, int src_ld, int cols, int rows, __nv_bfloat16 *out,
                      __nv_bfloat16 *out_lo, int ld, bool q8) {
    split_row_slabs(rows, ld, q8, out, out_lo, [=](int row, int i) {
        return i < cols ? src[(size_t)row * src_ld + i] : 0.f;
    });
}

// silu(gate) * up of gate_up [n_rows, 2 * inter] split into hi / lo [n_rows, ld].
__global__ void __launch_bounds__(kRowThreads)
    swiglu_rows_kernel(const float *gate_up, int inter, int n_rows, __nv_bfloat16 *out,
                       __nv_bfloat16 *out_lo, int ld, bool q8) {
    split_row_slabs(n_rows, ld, q8, out, out_lo, [=](int row, int i) {
        if (i >= inter) return 0.f;
        const float gate = gate_up[(size_t)row * 2 * inter + i];
        const float up = gate_up[(size_t)row * 2 * inter + inter + i];
        return gate / (1.0f + expf(-gate)) * up;
    });
}

// ---- MoE over a chunk: entries grouped by expert ---------------------------------------------
// Block e lists the entries (row * top_k + slot) whose selected expert is e, in ascending order:
// entries[e * stride + i] for i < counts[e]. A row selects an expert at most once, so a list
// holds at most n_rows <= stride entries.
__global__ void __launch_bounds__(kRowThreads)
    moe_group_entries_kernel(const int32_t *selected, int n_entries, int stride, int32_t *entries,
                             int32_t *counts) {
    __shared__ int warp_totals[kRowThreads / kWarpSize];
    const int expert = blockIdx.x, lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    int32_t *list = entries + (size_t)expert * stride;
    int base = 0;
    for (int start = 0; start < n_entries; start += kRowThreads) {
        const int i = start + threadIdx.x;
        const bool mine = i < n_entries && selected[i] == expert;
        const unsigned ballot = __ballot_sync(kFullMask, mine);
        if (lane == 0) warp_totals[warp] = __popc(ballot);
        __syncthreads();
        int before = base + __popc(ballot & ((1u << lane) - 1u)), total = 0;
        for (int w = 0; w < kRowThreads / kWarpSize; ++w) {
            if (w < warp) before += warp_totals[w];
            total += warp_totals[w];
        }
        if (mine) list[before] = i;
        base += total;
        __syncthreads();  // warp_totals is rewritten next round
    }
    if (threadIdx.x == 0) counts[expert] = base;
}

// x[r, c] += sum over slots j (selection order) of weights[r, j] * expert_out[r * top_k + j, c],
// with the decode body's roundings (moe.cu): y = 0; y = y + w_j * d_j; x = x + y.
__global__ void __launch_bounds__(kRowThreads)
    moe_combine_rows_kernel(const float *expert_out, const float *weights, int top_k, int hidden,
                            int n_rows, float *x) {
    const int64_t total = (int64_t)n_rows * hidden;
    for (int64_t idx = (int64_t)blockIdx.x * kRowThreads + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * kRowThreads) {
        const int row = (int)(idx / hidden), c = (int)(idx % hidden);
        float y = 0.f;
        for (int j = 0; j < top_k; ++j) {
            const int entry = row * top_k + j;
            y = __fadd_rn(y, __fmul_rn(weights[entry], expert_out[(size_t)entry * hidden + c]));
        }
        x[idx] = __fadd_rn(x[idx], y);
    }
}

// ---- QK-norm + RoPE + KV write, per row (rope_kv.cuh's device functions) ----------------
struct RopeRowsParams {
    float *qkv;                  // [n, qkv_ld]
    int qkv_ld;
    const float *q_norm, *k_norm;
    float eps;
    const float *inv_freq;
    int p0, n_heads, n_kv_heads, head_dim, kv_dtype;
    KvPages kv;
    const int32_t *table_row;    // blocks of the sequence
};

// grid (rows, n_heads + n_kv_heads), one warp per block: block (r, h < n_heads) owns query head
// h of row r, block (r, n_heads + g) KV head g of row r (its k and its v) — rope_kv.cu's kernel
// per row, with the row's block from the sequence's table instead of the step record.
__global__ void __launch_bounds__(kWarpSize) rope_kv_rows_kernel(const RopeRowsParams a) {
    __shared__ float head[kMaxHeadDim];
    __shared__ float4 row_bytes_s[kMaxHeadDim * 4 / 16];  // the encoded row (unused here)
    __shared__ float scale_s;
    const int lane = threadIdx.x;
    const int hd = a.head_dim;
    const int q_size = a.n_heads * hd;
    const int kv_size = a.n_kv_heads * hd;
    const int row_index = blockIdx.x;
    const bool is_query = (int)blockIdx.y < a.n_heads;
    const int kv_head = (int)blockIdx.y - a.n_heads;
    const int position = a.p0 + row_index;
    const float *norm_w = is_query ? a.q_norm : a.k_norm;
    float w[kHeadSlots];
    norm_weights(norm_w, hd, lane, w);
    RopeAngles angles;
    rope_angles(a.inv_freq, hd, position, lane, angles);

    float *qkv = a.qkv + (size_t)row_index * a.qkv_ld;
    float *src = is_query ? qkv + (size_t)blockIdx.y * hd : qkv + q_size + (size_t)kv_head * hd;
    warp_norm_rope(src, norm_w != nullptr, w, a.eps, angles, hd, head, lane);
    if (is_query) {
        for (int i = lane; i < hd; i += kWarpSize) src[i] = head[i];
        return;
    }
    const KvPages &kv = a.kv;
    const int chunk = position / kv.page_size;
    const int block = a.table_row[chunk];
    if (block < 0 || block >= kv.n_blocks) return;  // unreachable: og_prefill reserved the rows
    warp_store_kv_row(kv, a.kv_dtype, block, position, kv_head, hd, head,
                      qkv + q_size + kv_size + (size_t)kv_head * hd, row_bytes_s, &scale_s, lane);
}

// ---- causal attention over the cache (tensor cores) ----------------------------------------
struct PrefillAttnParams {
    const float *q;              // row r, head h at q[r * q_ld + h * hd] (normed, rotated)
    int q_ld;
    __nv_bfloat16 *out;          // [n, out_ld]: head h at columns [h * hd, (h + 1) * hd), hi
    __nv_bfloat16 *out_lo;       // [n, out_ld]: ... and lo (store_split)
    int out_ld;
    // Optional: o / l as fp32 here instead of split into out / out_lo (row r, head h at
    // out_f32[r * out_f32_ld + h * hd]; may be q's own buffer: a block overwrites only the q
    // rows and head it has already read). split_rows_kernel then rounds and splits it.
    float *out_f32 = nullptr;
    int out_f32_ld = 0;
    KvPages kv;
    const int32_t *table_row;
    int n, p0, n_heads, n_kv_heads, hd;
    float inv_sqrt_hd;           // (float)(1 / sqrt(hd)), as decode attention's
};

constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = kAttnWarps * kWarpSize;
constexpr int kAttnRows = 16 * kAttnWarps;  // query rows per block: 16 per warp (the mma's M)

// Two values as bf16 pairs in 32-bit mma operand words (the lower k index in the low half):
// hi = bf16(v), lo = bf16(v - hi), as store_split.
__device__ __forceinline__ uint32_t bf16_pair(__nv_bfloat16 first, __nv_bfloat16 second) {
    return (uint32_t)__bfloat16_as_ushort(first) | ((uint32_t)__bfloat16_as_ushort(second) << 16);
}
__device__ __forceinline__ void split_pair(float a, float b, uint32_t &hi, uint32_t &lo) {
    const __nv_bfloat16 a_hi = __float2bfloat16_rn(a), b_hi = __float2bfloat16_rn(b);
    const float af = __bfloat162float(a_hi), bf = __bfloat162float(b_hi);
    hi = bf16_pair(a_hi, b_hi);
    lo = bf16_pair(__float2bfloat16_rn(isinf(af) ? 0.f : __fsub_rn(a, af)),
                   __float2bfloat16_rn(isinf(bf) ? 0.f : __fsub_rn(b, bf)));
}
__device__ __forceinline__ uint32_t ld_pair(const __nv_bfloat16 *p) {  // p: an even index
    return *reinterpret_cast<const uint32_t *>(p);
}
// d += (a_hi + a_lo) . b for the B fragment at b_row (lane's column pairs at b_row and b_row + 8),
// plus a_hi . b_lo from b_row + lo_offset when B is itself split hi + lo (fp32 K/V): the split
// product both attention mmas (scores, weighted values) take, in this order.
template <bool kSplitB>
__device__ __forceinline__ void mma_split_product(float (&d)[4], const uint32_t (&a_hi)[4],
                                                  const uint32_t (&a_lo)[4],
                                                  const __nv_bfloat16 *b_row, int lo_offset) {
    const uint32_t b0 = ld_pair(b_row), b1 = ld_pair(b_row + 8);
    mma_bf16_16816(d, a_hi, b0, b1);
    mma_bf16_16816(d, a_lo, b0, b1);
    if constexpr (kSplitB) {
        const __nv_bfloat16 *b_lo = b_row + lo_offset;
        mma_bf16_16816(d, a_hi, ld_pair(b_lo), ld_pair(b_lo + 8));
    }
}
// The A fragment (16 x 16, row-major) of rows [row, row + 16), columns [col, col + 16) of a
// shared bf16 matrix with ld elements per row: lane (g, t) holds rows g and g + 8, columns
// 2t, 2t + 1 and 2t + 8, 2t + 9.
__device__ __forceinline__ void load_a_fragment(uint32_t (&a)[4], const __nv_bfloat16 *m, int ld,
                                                int row, int col, int g, int t) {
    const __nv_bfloat16 *p = m + (row + g) * ld + col + 2 * t;
    a[0] = ld_pair(p);
    a[1] = ld_pair(p + 8 * ld);
    a[2] = ld_pair(p + 8);
    a[3] = ld_pair(p + 8 * ld + 8);
}

template <int KV>
__device__ __forceinline__ float load_kv_elem(const char *row, int d) {
    if constexpr (KV == OG_KV_F32) return reinterpret_cast<const float *>(row)[d];
    else if constexpr (KV == OG_KV_BF16) return bf16_bits_to_float(reinterpret_cast<const uint16_t *>(row)[d]);
    else return (float)reinterpret_cast<const int8_t *>(row)[d];
}

// Element e of a 16-byte chunk of a K/V row (int8: 16 codes, bf16: 8, fp32: 4).
template <int KV>
__device__ __forceinline__ float chunk_elem(const uint4 &c, int e) {
    constexpr int kPerWord = KV == OG_KV_F32 ? 1 : KV == OG_KV_BF16 ? 2 : 4;
    const int word = e / kPerWord, part = e % kPerWord;
    const uint32_t w = word == 0 ? c.x : word == 1 ? c.y : word == 2 ? c.z : c.w;
    if constexpr (KV == OG_KV_F32) return __uint_as_float(w);
    else if constexpr (KV == OG_KV_BF16) return bf16_bits_to_float((uint16_t)(w >> (16 * part)));
    else return (float)(int8_t)(w >> (8 * part));
}

// Shared memory of one block (byte offsets). Rows of Q and K hold HD + 8 bf16 and rows of V^T
// BK + 8: the 8 rows of one fragment load then start 4 banks apart (conflict-free).
template <int HD, int BK, int KV>
struct AttnTiles {
    static constexpr int kParts = KV == OG_KV_F32 ? 2 : 1;  // fp32 K/V as bf16 hi + lo
    static constexpr int kQkLd = HD + 8, kVtLd = BK + 8;
    static constexpr size_t kRowOffset = 0;                                    // int64 [BK]
    static constexpr size_t kScales = kRowOffset + sizeof(int64_t) * BK;        // fp32 [2][BK]
    static constexpr size_t kQ = kScales + sizeof(float) * 2 * BK;              // bf16 [2][rows][kQkLd]
    static constexpr size_t kK = kQ + 2 * 2 * (size_t)kAttnRows * kQkLd;        // bf16 [parts][BK][kQkLd]
    static constexpr size_t kVt = kK + 2 * (size_t)kParts * BK * kQkLd;         // bf16 [parts][HD][kVtLd]
    static constexpr size_t kBytes = kVt + 2 * (size_t)kParts * HD * kVtLd;
};

template <int HD, int BK, int KV>
__global__ void __launch_bounds__(kAttnThreads) prefill_attention_kernel(const PrefillAttnParams p) {
    using Tiles = AttnTiles<HD, BK, KV>;
    constexpr int QK_LD = Tiles::kQkLd, VT_LD = Tiles::kVtLd;
    constexpr bool kSplitKv = Tiles::kParts == 2;
    constexpr int kElemBytes = KV == OG_KV_F32 ? 4 : KV == OG_KV_BF16 ? 2 : 1;
    constexpr int kScoreTiles = BK / 8, kOutTiles = HD / 8;  // n-tiles of S (keys) and O (dims)
    extern __shared__ float4 attn_smem4[];
    char *smem = reinterpret_cast<char *>(attn_smem4);
    int64_t *row_off = reinterpret_cast<int64_t *>(smem + Tiles::kRowOffset);
    float *k_scale = reinterpret_cast<float *>(smem + Tiles::kScales);
    float *v_scale = k_scale + BK;
    __nv_bfloat16 *q_hi = reinterpret_cast<__nv_bfloat16 *>(smem + Tiles::kQ);
    __nv_bfloat16 *q_lo = q_hi + kAttnRows * QK_LD;
    __nv_bfloat16 *k_tile = reinterpret_cast<__nv_bfloat16 *>(smem + Tiles::kK);   // [key][dim]
    __nv_bfloat16 *vt_tile = reinterpret_cast<__nv_bfloat16 *>(smem + Tiles::kVt); // [dim][key]
    __nv_bfloat16 *k_tile_lo = k_tile + BK * QK_LD, *vt_tile_lo = vt_tile + HD * VT_LD;  // fp32 KV

    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const int g = lane >> 2, t = lane & 3;
    const int q_tile = (int)gridDim.x - 1 - (int)blockIdx.x;  // the longest tiles start first
    const int head = blockIdx.y;
    const int kv_head = head / (p.n_heads / p.n_kv_heads);
    const int hd = p.hd;
    const int row0 = q_tile * kAttnRows;
    const int rows_here = min(kAttnRows, p.n - row0);
    const int last_pos = p.p0 + row0 + rows_here - 1;
    const int n_keys = last_pos + 1;
    const KvPages &kv = p.kv;

    for (int i = threadIdx.x; i < kAttnRows * HD; i += kAttnThreads) {
        const int r = i / HD, d = i % HD;
        float v = 0.f;
        if (r < rows_here && d < hd) v = p.q[(size_t)(row0 + r) * p.q_ld + (size_t)head * hd + d];
        store_split(v, q_hi + r * QK_LD + d, q_lo + r * QK_LD + d);
    }
    // This lane's rows: g and g + 8 of its warp's 16 (rows past the chunk: any valid position).
    const int warp_row = warp * 16;
    const int pos_g = min(p.p0 + row0 + warp_row + g, last_pos);
    const int pos_g8 = min(p.p0 + row0 + warp_row + g + 8, last_pos);
    const int warp_last_pos = min(p.p0 + row0 + warp_row + 15, last_pos);
    const float inv_sqrt_hd = p.inv_sqrt_hd;
    float m_g = -INFINITY, m_g8 = -INFINITY, l_g = 0.f, l_g8 = 0.f;
    float o[kOutTiles][4];
#pragma unroll
    for (int nt = 0; nt < kOutTiles; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;

    // K as k_tile[key][dim], V transposed as vt_tile[dim][key], bf16: int8 codes and bf16 as
    // they are (exact; the int8 scales stay per key), fp32 as hi + lo.
    auto put = [&](int c, int d, float k_val, float v_val) {
        const __nv_bfloat16 k_hi = __float2bfloat16_rn(k_val), v_hi = __float2bfloat16_rn(v_val);
        k_tile[c * QK_LD + d] = k_hi;
        vt_tile[d * VT_LD + c] = v_hi;
        if constexpr (kSplitKv) {
            k_tile_lo[c * QK_LD + d] = __float2bfloat16_rn(__fsub_rn(k_val, __bfloat162float(k_hi)));
            vt_tile_lo[d * VT_LD + c] = __float2bfloat16_rn(__fsub_rn(v_val, __bfloat162float(v_hi)));
        }
    };

    for (int key0 = 0; key0 < n_keys; key0 += BK) {
        __syncthreads();  // the previous tile is consumed (and Q is staged)
        for (int c = threadIdx.x; c < BK; c += kAttnThreads) {
            const int key = key0 + c;
            int64_t offset = -1;
            float ks = 0.f, vsc = 0.f;
            if (key < n_keys) {
                const int chunk = key / kv.page_size;
                const int block = p.table_row[chunk];
                const int row = kv_head * kv.page_size + (key - chunk * kv.page_size);
                const int64_t block_offset = (int64_t)block * kv.block_stride;
                offset = block_offset + (int64_t)row * (hd * kElemBytes);
                if constexpr (KV == OG_KV_INT8) {
                    ks = reinterpret_cast<const float *>(kv.k_scales + block_offset)[row];
                    vsc = reinterpret_cast<const float *>(kv.v_scales + block_offset)[row];
                }
            }
            row_off[c] = offset;
            k_scale[c] = ks;
            v_scale[c] = vsc;
        }
        __syncthreads();
        if (hd == HD) {  // whole rows of 16-byte chunks (head dim 64, 128 or 256)
            constexpr int kPerChunk = 16 / kElemBytes, kChunks = HD / kPerChunk;
            for (int i = threadIdx.x; i < BK * kChunks; i += kAttnThreads) {
                const int c = i / kChunks, d0 = (i % kChunks) * kPerChunk;
                const int64_t offset = row_off[c];
                uint4 k_raw = make_uint4(0, 0, 0, 0), v_raw = make_uint4(0, 0, 0, 0);
                if (offset >= 0) {
                    k_raw = *reinterpret_cast<const uint4 *>(kv.k + offset + d0 * kElemBytes);
                    v_raw = *reinterpret_cast<const uint4 *>(kv.v + offset + d0 * kElemBytes);
                }
#pragma unroll
                for (int e = 0; e < kPerChunk; ++e) put(c, d0 + e, chunk_elem<KV>(k_raw, e), chunk_elem<KV>(v_raw, e));
            }
        } else {  // any other head dim: element by element, zeros past hd
            for (int i = threadIdx.x; i < BK * HD; i += kAttnThreads) {
                const int c = i / HD, d = i % HD;
                const int64_t offset = row_off[c];
                const bool valid = offset >= 0 && d < hd;
                put(c, d, valid ? load_kv_elem<KV>(kv.k + offset, d) : 0.f,
                    valid ? load_kv_elem<KV>(kv.v + offset, d) : 0.f);
            }
        }
        __syncthreads();
        // A tile whose keys all follow the warp's rows changes nothing (every weight would be 0).
        if (key0 > warp_last_pos) continue;

        // S = Q K^T: rows g, g + 8 of the warp x keys 8 j + 2 t, + 1 (fp32 accumulators).
        float s[kScoreTiles][4];
#pragma unroll
        for (int j = 0; j < kScoreTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int d0 = 0; d0 < HD; d0 += 16) {
            uint32_t a_hi[4], a_lo[4];
            load_a_fragment(a_hi, q_hi, QK_LD, warp_row, d0, g, t);
            load_a_fragment(a_lo, q_lo, QK_LD, warp_row, d0, g, t);
#pragma unroll
            for (int j = 0; j < kScoreTiles; ++j) {
                mma_split_product<kSplitKv>(s[j], a_hi, a_lo,
                                            k_tile + (8 * j + g) * QK_LD + d0 + 2 * t, BK * QK_LD);
            }
        }
        // Scale and mask as decode attention: (q . k) * (k_scale * (1 / sqrt(hd))) for int8,
        // (q . k) * (1 / sqrt(hd)) otherwise; keys after the row's position get -inf.
        float max_g = -INFINITY, max_g8 = -INFINITY;
#pragma unroll
        for (int j = 0; j < kScoreTiles; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int c = 8 * j + 2 * t + e, key = key0 + c;
                const float scale = KV == OG_KV_INT8 ? k_scale[c] * inv_sqrt_hd : inv_sqrt_hd;
                s[j][e] = key <= pos_g ? s[j][e] * scale : -INFINITY;
                s[j][2 + e] = key <= pos_g8 ? s[j][2 + e] * scale : -INFINITY;
                max_g = fmaxf(max_g, s[j][e]);
                max_g8 = fmaxf(max_g8, s[j][2 + e]);
            }
        // A row's 4 lanes (t = 0..3) hold its BK scores: reduce over lanes l ^ 1, l ^ 2.
        max_g = fmaxf(max_g, __shfl_xor_sync(kFullMask, max_g, 1));
        max_g = fmaxf(max_g, __shfl_xor_sync(kFullMask, max_g, 2));
        max_g8 = fmaxf(max_g8, __shfl_xor_sync(kFullMask, max_g8, 1));
        max_g8 = fmaxf(max_g8, __shfl_xor_sync(kFullMask, max_g8, 2));
        // Online softmax; key 0 is visible to every row, so m is finite after tile 0.
        const float new_m_g = fmaxf(m_g, max_g), new_m_g8 = fmaxf(m_g8, max_g8);
        const float alpha_g = expf(m_g - new_m_g), alpha_g8 = expf(m_g8 - new_m_g8);
        float sum_g = 0.f, sum_g8 = 0.f;
#pragma unroll
        for (int j = 0; j < kScoreTiles; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                s[j][e] = expf(s[j][e] - new_m_g);
                s[j][2 + e] = expf(s[j][2 + e] - new_m_g8);
                sum_g += s[j][e];
                sum_g8 += s[j][2 + e];
            }
        sum_g += __shfl_xor_sync(kFullMask, sum_g, 1);
        sum_g += __shfl_xor_sync(kFullMask, sum_g, 2);
        sum_g8 += __shfl_xor_sync(kFullMask, sum_g8, 1);
        sum_g8 += __shfl_xor_sync(kFullMask, sum_g8, 2);
        l_g = l_g * alpha_g + sum_g;
        l_g8 = l_g8 * alpha_g8 + sum_g8;
        m_g = new_m_g;
        m_g8 = new_m_g8;
#pragma unroll
        for (int nt = 0; nt < kOutTiles; ++nt) {
            o[nt][0] *= alpha_g, o[nt][1] *= alpha_g;
            o[nt][2] *= alpha_g8, o[nt][3] *= alpha_g8;
        }

        // O += P V. The weights (p, times the key's V scale for int8) of score tiles 2 kk and
        // 2 kk + 1 are the A fragment of key step kk as they lie in the accumulators (keys
        // 16 kk + 2t, + 1 in a0 / a1, + 8, + 9 in a2 / a3), split hi + lo.
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            float w[2][4];  // [score tile 2 kk + h][accumulator]
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float weight = s[2 * kk + h][e];
                    w[h][e] = KV == OG_KV_INT8 ? weight * v_scale[16 * kk + 8 * h + 2 * t + e % 2] : weight;
                }
            uint32_t a_hi[4], a_lo[4];
            split_pair(w[0][0], w[0][1], a_hi[0], a_lo[0]);  // row g,     keys 2t, 2t + 1
            split_pair(w[0][2], w[0][3], a_hi[1], a_lo[1]);  // row g + 8
            split_pair(w[1][0], w[1][1], a_hi[2], a_lo[2]);  // row g,     keys 2t + 8, + 9
            split_pair(w[1][2], w[1][3], a_hi[3], a_lo[3]);  // row g + 8
#pragma unroll
            for (int nt = 0; nt < kOutTiles; ++nt) {
                mma_split_product<kSplitKv>(o[nt], a_hi, a_lo,
                                            vt_tile + (8 * nt + g) * VT_LD + 16 * kk + 2 * t, HD * VT_LD);
            }
        }
    }

    // out = o / l, split; o[nt] holds dims 8 nt + 2t, + 1 of rows g (0, 1) and g + 8 (2, 3).
    const int r_g = warp_row + g, r_g8 = warp_row + g + 8;
#pragma unroll
    for (int nt = 0; nt < kOutTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int d = 8 * nt + 2 * t + e;
            if (d >= hd) continue;
            if (p.out_f32 != nullptr) {
                if (r_g < rows_here) p.out_f32[(size_t)(row0 + r_g) * p.out_f32_ld + (size_t)head * hd + d] = o[nt][e] / l_g;
                if (r_g8 < rows_here) p.out_f32[(size_t)(row0 + r_g8) * p.out_f32_ld + (size_t)head * hd + d] = o[nt][2 + e] / l_g8;
                continue;
            }
            if (r_g < rows_here) {
                const size_t offset = (size_t)(row0 + r_g) * p.out_ld + (size_t)head * hd + d;
                store_split(o[nt][e] / l_g, p.out + offset, p.out_lo + offset);
            }
            if (r_g8 < rows_here) {
                const size_t offset = (size_t)(row0 + r_g8) * p.out_ld + (size_t)head * hd + d;
                store_split(o[nt][2 + e] / l_g8, p.out + offset, p.out_lo + offset);
            }
        }
    // The pad columns after the last head (read by the o_proj GEMM against zero weights).
    const int q_cols = p.n_heads * hd, pad = p.out_ld - q_cols;
    if (p.out_f32 == nullptr && head == 0 && pad > 0)
        for (int i = threadIdx.x; i < rows_here * pad; i += kAttnThreads) {
            const size_t offset = (size_t)(row0 + i / pad) * p.out_ld + q_cols + i % pad;
            p.out[offset] = p.out_lo[offset] = __float2bfloat16_rn(0.f);
        }
}

template <int HD, int BK, int KV>
cudaError_t launch_attention_shape(const PrefillAttnParams &p, cudaStream_t stream) {
    const auto kernel = prefill_attention_kernel<HD, BK, KV>;
    const size_t smem = AttnTiles<HD, BK, KV>::kBytes;
    OG_CUDA_RETURN_IF(allow_dynamic_smem((const void *)kernel, smem));
    const dim3 grid(ceil_div(p.n, kAttnRows), p.n_heads);
    return launch_kernel(kernel, grid, dim3(kAttnThreads), smem, stream, false, p);
}

// Key tiles of 64 rows, 32 at head dim 256 (its 128 output accumulators per lane).
template <int KV>
cudaError_t launch_attention_kv(const PrefillAttnParams &p, cudaStream_t stream) {
    if (p.hd <= 64) return launch_attention_shape<64, 64, KV>(p, stream);
    if (p.hd <= 128) return launch_attention_shape<128, 64, KV>(p, stream);
    return launch_attention_shape<256, 32, KV>(p, stream);
}

cudaError_t launch_prefill_attention(const PrefillAttnParams &p, int kv_dtype, cudaStream_t stream) {
    if (p.hd <= 0 || p.hd > kMaxHeadDim || p.n <= 0 || p.n_kv_heads <= 0 ||
        p.n_heads % p.n_kv_heads != 0 || p.kv.page_size <= 0)
        return cudaErrorInvalidValue;
    switch (kv_dtype) {
        case OG_KV_F32: return launch_attention_kv<OG_KV_F32>(p, stream);
        case OG_KV_BF16: return launch_attention_kv<OG_KV_BF16>(p, stream);
        case OG_KV_INT8: return launch_attention_kv<OG_KV_INT8>(p, stream);
    }
    return cudaErrorInvalidValue;
}

int row_grid(int64_t elements) {
    const int64_t blocks = (elements + kRowThreads - 1) / kRowThreads;
    return (int)(blocks < 4096 ? blocks : 4096);
}

// w[r, c] = q[r, c] * scale as bf16 hi + lo, c < ld (0 past cols). int8: the row's fp32 scale;
// q4: the e5m3 scale byte (quant.cuh) of the column's group of 32; q4 byte c / 2 holds column c in its low
// nibble when c is even, high when odd, as a 4-bit two's complement code.
template <int FMT>
__global__ void __launch_bounds__(kRowThreads)
dequant_split_kernel(const uint8_t *data, const void *scales, int rows, int cols, int ld,
                     int64_t row_bytes, int scales_per_row, __nv_bfloat16 *hi, __nv_bfloat16 *lo) {
    const int64_t total = (int64_t)rows * ld;
    for (int64_t i = (int64_t)blockIdx.x * kRowThreads + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * kRowThreads) {
        const int r = (int)(i / ld), c = (int)(i - (int64_t)r * ld);
        float w = 0.f;
        if (c < cols) {
            const uint8_t *row = data + (size_t)r * row_bytes;
            if (FMT == OG_WEIGHTS_INT8) {
                w = (float)(int8_t)row[c] * static_cast<const float *>(scales)[r];
            } else {
                const int nibble = c % 2 == 0 ? (row[c / 2] & 15) : (row[c / 2] >> 4);
                const float scale = q4_scale_value(
                    static_cast<const uint8_t *>(scales)[(size_t)r * scales_per_row + c / kQ4Group]);
                w = (float)((nibble ^ 8) - 8) * scale;
            }
        }
        store_split(w, hi + i, lo + i);
    }
}

// y (= or +=) a . w for a dense weight matrix in any format: bf16 as is; int8 / q4 dequantized
// into the scratch's w_hi + w_lo, then y = a . w_hi (split a as given) + a_hi . w_lo. (q4's
// input arrives rounded to int8 per group of 32, as the decode GEMV's: the callers do it.)
cudaError_t gemm_weights(GemmArgs args, const WeightMatrix &w, const PrefillScratch &s,
                         cudaStream_t stream) {
    if (w.format == OG_WEIGHTS_BF16) {
        args.w = static_cast<const __nv_bfloat16 *>(w.data);
        return launch_gemm_bf16(args, stream);
    }
    if (s.w_hi == nullptr || s.w_lo == nullptr || w.scales == nullptr) return cudaErrorInvalidValue;
    const int ld = padded_cols(w.cols);
    const int64_t row_bytes = weight_row_bytes(w.format, w.cols);
    const int spr = (int)weight_scales_per_row(w.format, w.cols);
    const dim3 grid(row_grid((int64_t)w.rows * ld)), block(kRowThreads);
    const uint8_t *data = static_cast<const uint8_t *>(w.data);
    if (w.format == OG_WEIGHTS_INT8)
        OG_CUDA_RETURN_IF(launch_kernel(dequant_split_kernel<OG_WEIGHTS_INT8>, grid, block, 0, stream,
                                        false, data, w.scales, (int)w.rows, w.cols, ld, row_bytes, spr,
                                        s.w_hi, s.w_lo));
    else if (w.format == OG_WEIGHTS_Q4)
        OG_CUDA_RETURN_IF(launch_kernel(dequant_split_kernel<OG_WEIGHTS_Q4>, grid, block, 0, stream,
                                        false, data, w.scales, (int)w.rows, w.cols, ld, row_bytes, spr,
                                        s.w_hi, s.w_lo));
    else
        return cudaErrorInvalidValue;
    args.w = s.w_hi;
    args.ldw = ld;
    OG_CUDA_RETURN_IF(launch_gemm_bf16(args, stream));
    args.a_lo = nullptr;
    args.w = s.w_lo;
    args.accumulate = true;
    return launch_gemm_bf16(args, stream);
}

}  // namespace

// The MoE FFN of a bf16-experts layer over the chunk's n rows (prefill.cuh): router GEMM,
// top-k per row, entries grouped by expert, grouped GEMMs for gate|up and down, the weighted
// sum in selection order added to x.
static cudaError_t enqueue_moe_rows(const PrefillModel &m, const PrefillLayer &w, int n,
                                    cudaStream_t stream) {
    const PrefillScratch &s = m.scratch;
    const int H = m.H, ldH = padded_cols(H), Im = m.Im, ldIm = padded_cols(Im);
    const int n_entries = n * m.top_k;
    const dim3 row_block(kRowThreads);
    OG_CUDA_RETURN_IF(launch_kernel(rmsnorm_rows_split_kernel, dim3(n), row_block, 0, stream, false,
                                    (const float *)s.x, w.post_attention_layernorm, m.eps, H,
                                    s.narrow, s.narrow_lo, ldH, false));
    OG_CUDA_RETURN_IF(launch_gemm_bf16(GemmArgs{s.narrow, s.narrow_lo, ldH,
                                                static_cast<const __nv_bfloat16 *>(w.router.data), ldH,
                                                s.moe_logits, m.E, n, m.E, ldH, false},
                                       stream));
    OG_CUDA_RETURN_IF(launch_moe_topk_rows(s.moe_logits, n, m.E, m.top_k, m.norm_topk_prob,
                                           s.moe_selected, s.moe_weights, stream, false));
    OG_CUDA_RETURN_IF(launch_kernel(moe_group_entries_kernel, dim3(m.E), row_block, 0, stream, false,
                                    (const int32_t *)s.moe_selected, n_entries, n, s.moe_entries,
                                    s.moe_counts));
    // gate|up: expert e's entries gather their rows of the normed input (entry / top_k).
    GemmArgs gate_up = {s.narrow, s.narrow_lo, ldH,
                        static_cast<const __nv_bfloat16 *>(w.expert_gate_up.data), ldH,
                        s.moe_out, 2 * Im, n, 2 * Im, ldH, false};
    gate_up.a_rows = gate_up.y_rows = s.moe_entries;
    gate_up.a_row_div = m.top_k;
    gate_up.group_rows = s.moe_counts;
    gate_up.groups = m.E;
    gate_up.w_group_stride = (int64_t)2 * Im * ldH;
    gate_up.index_stride = n;
    OG_CUDA_RETURN_IF(launch_gemm_bf16(gate_up, stream));
    OG_CUDA_RETURN_IF(launch_kernel(swiglu_rows_kernel, dim3(row_grid((int64_t)n_entries * ldIm)),
                                    row_block, 0, stream, false, (const float *)s.moe_out, Im,
                                    n_entries, s.moe_act, s.moe_act_lo, ldIm, false));
    // down: an entry's row of act, into the entry's row of moe_out.
    GemmArgs down = {s.moe_act, s.moe_act_lo, ldIm,
                     static_cast<const __nv_bfloat16 *>(w.expert_down.data), ldIm, s.moe_out, H, n,
                     H, ldIm, false};
    down.a_rows = down.y_rows = s.moe_entries;
    down.group_rows = s.moe_counts;
    down.groups = m.E;
    down.w_group_stride = (int64_t)H * ldIm;
    down.index_stride = n;
    OG_CUDA_RETURN_IF(launch_gemm_bf16(down, stream));
    return launch_kernel(moe_combine_rows_kernel, dim3(row_grid((int64_t)n * H)), row_block, 0,
                         stream, false, (const float *)s.moe_out, (const float *)s.moe_weights,
                         m.top_k, H, n, s.x);
}

cudaError_t enqueue_prefill_chunk(const PrefillModel &m, const int32_t *table_row, int n, int p0,
                                  cudaStream_t stream) {
    const PrefillScratch &s = m.scratch;
    if (n <= 0 || n > s.chunk || m.hd > kMaxHeadDim) return cudaErrorInvalidValue;
    const int H = m.H, ldH = padded_cols(H);
    const int q_size = m.n_heads * m.hd, ldQ = padded_cols(q_size);
    const int qkv_rows = q_size + 2 * m.n_kv * m.hd;
    const int I = m.I, ldI = padded_cols(I > 0 ? I : 1);
    const dim3 rows(n), row_block(kRowThreads);

    OG_CUDA_RETURN_IF(launch_kernel(embed_rows_kernel, rows, row_block, 0, stream, false,
                                    m.embed_tokens, m.V, H, (const int32_t *)s.tokens, s.x));
    for (const PrefillLayer &w : m.layers) {
        // ---- attention block ----
        OG_CUDA_RETURN_IF(launch_kernel(rmsnorm_rows_split_kernel, rows, row_block, 0, stream, false,
                                        (const float *)s.x, w.input_layernorm, m.eps, H, s.narrow,
                                        s.narrow_lo, ldH, w.qkv.format == OG_WEIGHTS_Q4));
        OG_CUDA_RETURN_IF(gemm_weights(GemmArgs{s.narrow, s.narrow_lo, ldH, nullptr, ldH, s.wide,
                                                qkv_rows, n, qkv_rows, ldH, false},
                                       w.qkv, s, stream));
        RopeRowsParams rope = {};
        rope.qkv = s.wide;
        rope.qkv_ld = qkv_rows;
        rope.q_norm = w.q_norm;
        rope.k_norm = w.k_norm;
        rope.eps = m.eps;
        rope.inv_freq = m.inv_freq;
        rope.p0 = p0;
        rope.n_heads = m.n_heads;
        rope.n_kv_heads = m.n_kv;
        rope.head_dim = m.hd;
        rope.kv_dtype = m.kv_dtype;
        rope.kv = w.kv;
        rope.table_row = table_row;
        OG_CUDA_RETURN_IF(launch_kernel(rope_kv_rows_kernel, dim3(n, m.n_heads + m.n_kv),
                                        dim3(kWarpSize), 0, stream, false, rope));
        PrefillAttnParams attn = {};
        attn.q = s.wide;
        attn.q_ld = qkv_rows;
        attn.out = s.narrow;
        attn.out_lo = s.narrow_lo;
        attn.out_ld = ldQ;
        attn.kv = w.kv;
        attn.table_row = table_row;
        attn.n = n;
        attn.p0 = p0;
        attn.n_heads = m.n_heads;
        attn.n_kv_heads = m.n_kv;
        attn.hd = m.hd;
        attn.inv_sqrt_hd = (float)(1.0 / sqrt((double)m.hd));  // as decode attention
        if (w.o_proj.format == OG_WEIGHTS_Q4) {  // rounded in fp32 (q8) before the split
            attn.out_f32 = s.wide;                 // over the q columns it has read
            attn.out_f32_ld = qkv_rows;
        }
        OG_CUDA_RETURN_IF(launch_prefill_attention(attn, m.kv_dtype, stream));
        if (attn.out_f32 != nullptr)
            OG_CUDA_RETURN_IF(launch_kernel(split_rows_kernel, dim3(row_grid((int64_t)n * ldQ)), row_block, 0,
                                            stream, false, (const float *)s.wide, qkv_rows, q_size, n,
                                            s.narrow, s.narrow_lo, ldQ, true));
        OG_CUDA_RETURN_IF(gemm_weights(
            GemmArgs{s.narrow, s.narrow_lo, ldQ, nullptr, ldQ, s.x, H, n, H, ldQ, true}, w.o_proj, s,
            stream));

        // ---- FFN block ----
        if (w.is_moe && s.moe_out != nullptr && w.expert_gate_up.format == OG_WEIGHTS_BF16 &&
            w.expert_down.format == OG_WEIGHTS_BF16) {
            OG_CUDA_RETURN_IF(enqueue_moe_rows(m, w, n, stream));
        } else if (w.is_moe) {
            // One row at a time through the decode body's MoE kernels (router GEMV with the
            // norm fused, top-k, experts) — the same arithmetic as a decode step's FFN.
            for (int r = 0; r < n; ++r) {
                float *x_row = s.x + (size_t)r * H;
                const GemvArgs router = {w.router, x_row, w.post_attention_layernorm, m.eps,
                                         m.router_logits, m.moe_normed};
                OG_CUDA_RETURN_IF(launch_gemv(kGemvNorm, m.plan_router, router, stream, false));
                OG_CUDA_RETURN_IF(launch_moe_topk(m.router_logits, m.E, m.top_k, m.norm_topk_prob,
                                                  m.selected_experts, m.selected_weights, stream));
                OG_CUDA_RETURN_IF(launch_moe_gate_up_swiglu(w.expert_gate_up, m.moe_normed,
                                                            m.selected_experts, m.top_k, H, m.Im,
                                                            m.moe_act, stream, false));
                OG_CUDA_RETURN_IF(launch_moe_down_weighted_residual(
                    w.expert_down, m.moe_act, m.selected_experts, m.selected_weights, m.top_k, H,
                    m.Im, x_row, stream, false));
            }
        } else {
            OG_CUDA_RETURN_IF(launch_kernel(rmsnorm_rows_split_kernel, rows, row_block, 0, stream,
                                            false, (const float *)s.x, w.post_attention_layernorm,
                                            m.eps, H, s.narrow, s.narrow_lo, ldH,
                                            w.gate_up.format == OG_WEIGHTS_Q4));
            OG_CUDA_RETURN_IF(gemm_weights(GemmArgs{s.narrow, s.narrow_lo, ldH, nullptr, ldH,
                                                    s.wide, 2 * I, n, 2 * I, ldH, false},
                                           w.gate_up, s, stream));
            OG_CUDA_RETURN_IF(launch_kernel(swiglu_rows_kernel, dim3(row_grid((int64_t)n * ldI)),
                                            row_block, 0, stream, false, (const float *)s.wide, I, n,
                                            s.narrow, s.narrow_lo, ldI, w.down.format == OG_WEIGHTS_Q4));
            OG_CUDA_RETURN_IF(gemm_weights(
                GemmArgs{s.narrow, s.narrow_lo, ldI, nullptr, ldI, s.x, H, n, H, ldI, true}, w.down,
                s, stream));
        }
    }
    return cudaSuccess;
}

}  // namespace og
