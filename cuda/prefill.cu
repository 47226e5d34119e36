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
//   swiglu_rows         act[r, i] = split(silu(gate) * up), silu(g) = g / (1 + exp(-g))
//   dequant_split       a quantized weight matrix -> split(q * scale) [rows, padded_cols] bf16
//                       hi + lo (pad columns 0), for the GEMMs of quantized dense weights
//   moe_group_entries   per expert, the chunk's (row, slot) selections of it, in ascending order:
//                       the row lists of the experts' grouped GEMMs (gemm.cu)
//   moe_combine_rows    x[r] += the weighted sum of row r's expert outputs, selection order
//
// prefill_attention: grid (query tiles of BQ rows, n_heads), 256 threads as 16 x 16. A block
// walks the keys [0, p0 + its last row] in tiles of BK rows aligned to position 0, reading each
// key row through the block table and dequantizing it into shared memory as fp32 (K transposed,
// V as is). Scores are the fp32 dot products of decode attention (the query . dequantized K in
// head-dim order, divided by sqrt(hd)); the softmax is the online (flash) form in fp32: per row
// a running max m and sum l, the output rescaled by exp(m_old - m_new) at each tile; masked keys
// (beyond the row's position) get -inf. out = o / l, split (hi, lo) for the o_proj GEMM. The
// head dim is padded with zeros to HD = 64, 128 or 256 in shared memory. Scores differ from
// decode attention's only in the softmax's summation order (decode sums per split, then combines).
#include <math.h>

#include "prefill.cuh"
#include "quant.cuh"
#include "rope_kv.cuh"

namespace og {
namespace {

constexpr int kRowThreads = 256;
constexpr int kAttnThreads = 256;

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

__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_rows_split_kernel(const float *x, const float *weight, float eps, int hidden,
                              __nv_bfloat16 *out, __nv_bfloat16 *out_lo, int ld) {
    __shared__ float scratch[kRowThreads / kWarpSize];
    const int row = blockIdx.x;
    const float *xr = x + (size_t)row * hidden;
    float sum_sq = 0.f;
    for (int i = threadIdx.x; i < hidden; i += kRowThreads) sum_sq = fmaf(xr[i], xr[i], sum_sq);
    const float total = block_sum<kRowThreads>(sum_sq, scratch);
    const float inv_rms = 1.0f / sqrtf(total / (float)hidden + eps);
    __nv_bfloat16 *dst = out + (size_t)row * ld, *dst_lo = out_lo + (size_t)row * ld;
    for (int i = threadIdx.x; i < ld; i += kRowThreads)
        store_split(i < hidden ? xr[i] * inv_rms * weight[i] : 0.f, dst + i, dst_lo + i);
}

__global__ void __launch_bounds__(kRowThreads)
    swiglu_rows_kernel(const float *gate_up, int inter, int n_rows, __nv_bfloat16 *out,
                       __nv_bfloat16 *out_lo, int ld) {
    const int64_t total = (int64_t)n_rows * ld;
    for (int64_t idx = (int64_t)blockIdx.x * kRowThreads + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * kRowThreads) {
        const int row = (int)(idx / ld), i = (int)(idx % ld);
        float v = 0.f;
        if (i < inter) {
            const float gate = gate_up[(size_t)row * 2 * inter + i];
            const float up = gate_up[(size_t)row * 2 * inter + inter + i];
            v = gate / (1.0f + expf(-gate)) * up;
        }
        store_split(v, out + idx, out_lo + idx);
    }
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

// ---- causal attention over the cache -----------------------------------------------------
struct PrefillAttnParams {
    const float *q;              // row r, head h at q[r * q_ld + h * hd] (normed, rotated)
    int q_ld;
    __nv_bfloat16 *out;          // [n, out_ld]: head h at columns [h * hd, (h + 1) * hd), hi
    __nv_bfloat16 *out_lo;       // [n, out_ld]: ... and lo (store_split)
    int out_ld;
    KvPages kv;
    const int32_t *table_row;
    int n, p0, n_heads, n_kv_heads, hd;
    float sqrt_hd;
};

template <int N>
__device__ __forceinline__ void load_smem(float (&v)[N], const float *p) {
    if constexpr (N == 4) {
        const float4 t = *reinterpret_cast<const float4 *>(p);
        v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
    } else if constexpr (N == 2) {
        const float2 t = *reinterpret_cast<const float2 *>(p);
        v[0] = t.x, v[1] = t.y;
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = p[i];
    }
}

// Reductions over the 16 threads of a row group (lanes l and l ^ 8, 4, 2, 1 of one warp).
__device__ __forceinline__ float row_max16(float v) {
#pragma unroll
    for (int offset = 8; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
    return v;
}
__device__ __forceinline__ float row_sum16(float v) {
#pragma unroll
    for (int offset = 8; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
    return v;
}

template <int KV>
__device__ __forceinline__ float load_kv_elem(const char *row, int d) {
    if constexpr (KV == OG_KV_F32) return reinterpret_cast<const float *>(row)[d];
    else if constexpr (KV == OG_KV_BF16) return bf16_bits_to_float(reinterpret_cast<const uint16_t *>(row)[d]);
    else return (float)reinterpret_cast<const int8_t *>(row)[d];
}

template <int HD, int BQ, int BK>
struct AttnShape {
    static constexpr int kQt = BQ + 4, kKt = BK + 4, kPt = BQ + 4;  // padded transposed rows
    static constexpr size_t kBytes =
        (size_t)BK * (sizeof(int64_t) + 2 * sizeof(float)) +
        sizeof(float) * ((size_t)HD * kQt + (size_t)HD * kKt + (size_t)BK * HD + (size_t)BK * kPt);
};

template <int HD, int BQ, int BK, int KV>
__global__ void __launch_bounds__(kAttnThreads) prefill_attention_kernel(const PrefillAttnParams p) {
    using Shape = AttnShape<HD, BQ, BK>;
    constexpr int RQ = BQ / 16, RK = BK / 16, DQ = HD / 64, RD = 4 * DQ;
    constexpr int QT = Shape::kQt, KT = Shape::kKt, PT = Shape::kPt;
    constexpr int kElemBytes = KV == OG_KV_F32 ? 4 : KV == OG_KV_BF16 ? 2 : 1;
    extern __shared__ float4 attn_smem4[];
    // row offsets [BK] int64 | K scales [BK] | V scales [BK] | Q^T [HD][QT] | K^T [HD][KT] |
    // V [BK][HD] | P^T [BK][PT]
    int64_t *row_off = reinterpret_cast<int64_t *>(attn_smem4);
    float *k_scale = reinterpret_cast<float *>(row_off + BK);
    float *v_scale = k_scale + BK;
    float *qt = v_scale + BK;
    float *kt = qt + HD * QT;
    float *vs = kt + HD * KT;
    float *pt = vs + BK * HD;

    const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
    const int q_tile = (int)gridDim.x - 1 - (int)blockIdx.x;  // the longest tiles start first
    const int head = blockIdx.y;
    const int kv_head = head / (p.n_heads / p.n_kv_heads);
    const int hd = p.hd;
    const int row0 = q_tile * BQ;
    const int rows_here = min(BQ, p.n - row0);
    const int last_pos = p.p0 + row0 + rows_here - 1;
    const int n_keys = last_pos + 1;
    const KvPages &kv = p.kv;

    for (int i = tid; i < BQ * HD; i += kAttnThreads) {
        const int r = i / HD, d = i % HD;
        float v = 0.f;
        if (r < rows_here && d < hd) v = p.q[(size_t)(row0 + r) * p.q_ld + (size_t)head * hd + d];
        qt[d * QT + r] = v;
    }
    int pos[RQ];
    float m_run[RQ], l_run[RQ], o[RQ][RD];
#pragma unroll
    for (int i = 0; i < RQ; ++i) {
        pos[i] = min(p.p0 + row0 + ty * RQ + i, last_pos);  // rows past the chunk: any valid row
        m_run[i] = -INFINITY;
        l_run[i] = 0.f;
#pragma unroll
        for (int e = 0; e < RD; ++e) o[i][e] = 0.f;
    }

    for (int key0 = 0; key0 < n_keys; key0 += BK) {
        __syncthreads();  // the previous tile's K, V, P are read by everyone (and Q is staged)
        for (int c = tid; c < BK; c += kAttnThreads) {
            const int t = key0 + c;
            int64_t offset = -1;
            float ks = 0.f, vsc = 0.f;
            if (t < n_keys) {
                const int chunk = t / kv.page_size;
                const int block = p.table_row[chunk];
                const int row = kv_head * kv.page_size + (t - chunk * kv.page_size);
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
        for (int i = tid; i < BK * HD; i += kAttnThreads) {
            const int c = i / HD, d = i % HD;
            const int64_t offset = row_off[c];
            float k_val = 0.f, v_val = 0.f;
            if (offset >= 0 && d < hd) {
                k_val = load_kv_elem<KV>(kv.k + offset, d);
                v_val = load_kv_elem<KV>(kv.v + offset, d);
                if constexpr (KV == OG_KV_INT8) {
                    k_val *= k_scale[c];
                    v_val *= v_scale[c];
                }
            }
            kt[d * KT + c] = k_val;
            vs[c * HD + d] = v_val;
        }
        __syncthreads();

        // scores of rows ty*RQ + i, keys tx*RK + j: fmaf chain over the head dim in order
        float s[RQ][RK];
#pragma unroll
        for (int i = 0; i < RQ; ++i)
#pragma unroll
            for (int j = 0; j < RK; ++j) s[i][j] = 0.f;
#pragma unroll 4
        for (int d = 0; d < hd; ++d) {
            float qv[RQ], kv_[RK];
            load_smem(qv, qt + d * QT + ty * RQ);
            load_smem(kv_, kt + d * KT + tx * RK);
#pragma unroll
            for (int i = 0; i < RQ; ++i)
#pragma unroll
                for (int j = 0; j < RK; ++j) s[i][j] = fmaf(qv[i], kv_[j], s[i][j]);
        }
        // online softmax per row; key 0 is visible to every row, so m is finite after tile 0
#pragma unroll
        for (int i = 0; i < RQ; ++i) {
            float tile_max = -INFINITY;
#pragma unroll
            for (int j = 0; j < RK; ++j) {
                const int t = key0 + tx * RK + j;
                s[i][j] = t <= pos[i] ? s[i][j] / p.sqrt_hd : -INFINITY;
                tile_max = fmaxf(tile_max, s[i][j]);
            }
            tile_max = row_max16(tile_max);
            const float m_new = fmaxf(m_run[i], tile_max);
            const float alpha = expf(m_run[i] - m_new);
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < RK; ++j) {
                const float e = expf(s[i][j] - m_new);
                s[i][j] = e;
                sum += e;
            }
            sum = row_sum16(sum);
            l_run[i] = l_run[i] * alpha + sum;
            m_run[i] = m_new;
#pragma unroll
            for (int e = 0; e < RD; ++e) o[i][e] *= alpha;
#pragma unroll
            for (int j = 0; j < RK; ++j) pt[(tx * RK + j) * PT + ty * RQ + i] = s[i][j];
        }
        __syncthreads();

        // o[rows ty*RQ + i, dims kq*64 + tx*4 + e] += P . V
#pragma unroll 2
        for (int c = 0; c < BK; ++c) {
            float pr[RQ];
            load_smem(pr, pt + c * PT + ty * RQ);
#pragma unroll
            for (int kq = 0; kq < DQ; ++kq) {
                const float4 v = *reinterpret_cast<const float4 *>(vs + c * HD + kq * 64 + tx * 4);
#pragma unroll
                for (int i = 0; i < RQ; ++i) {
                    o[i][kq * 4 + 0] = fmaf(pr[i], v.x, o[i][kq * 4 + 0]);
                    o[i][kq * 4 + 1] = fmaf(pr[i], v.y, o[i][kq * 4 + 1]);
                    o[i][kq * 4 + 2] = fmaf(pr[i], v.z, o[i][kq * 4 + 2]);
                    o[i][kq * 4 + 3] = fmaf(pr[i], v.w, o[i][kq * 4 + 3]);
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < RQ; ++i) {
        const int r = ty * RQ + i;
        if (r >= rows_here) continue;
        const size_t offset = (size_t)(row0 + r) * p.out_ld + (size_t)head * hd;
#pragma unroll
        for (int kq = 0; kq < DQ; ++kq)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int d = kq * 64 + tx * 4 + e;
                if (d < hd) store_split(o[i][kq * 4 + e] / l_run[i], p.out + offset + d, p.out_lo + offset + d);
            }
    }
    // The pad columns after the last head (read by the o_proj GEMM against zero weights).
    const int q_cols = p.n_heads * hd, pad = p.out_ld - q_cols;
    if (head == 0 && pad > 0)
        for (int i = tid; i < rows_here * pad; i += kAttnThreads) {
            const size_t offset = (size_t)(row0 + i / pad) * p.out_ld + q_cols + i % pad;
            p.out[offset] = p.out_lo[offset] = __float2bfloat16_rn(0.f);
        }
}

template <int HD, int BQ, int BK, int KV>
cudaError_t launch_attention_shape(const PrefillAttnParams &p, cudaStream_t stream) {
    const auto kernel = prefill_attention_kernel<HD, BQ, BK, KV>;
    const size_t smem = AttnShape<HD, BQ, BK>::kBytes;
    OG_CUDA_RETURN_IF(allow_dynamic_smem((const void *)kernel, smem));
    const dim3 grid(ceil_div(p.n, BQ), p.n_heads);
    return launch_kernel(kernel, grid, dim3(kAttnThreads), smem, stream, false, p);
}

template <int KV>
cudaError_t launch_attention_kv(const PrefillAttnParams &p, cudaStream_t stream) {
    if (p.hd <= 64) return launch_attention_shape<64, 64, 64, KV>(p, stream);
    if (p.hd <= 128) return launch_attention_shape<128, 64, 32, KV>(p, stream);
    return launch_attention_shape<256, 32, 32, KV>(p, stream);
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
// q4: the bf16 scale of the column's group of 32; q4 byte c / 2 holds column c in its low
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
                const float scale = bf16_bits_to_float(
                    static_cast<const uint16_t *>(scales)[(size_t)r * scales_per_row + c / kQ4Group]);
                w = (float)((nibble ^ 8) - 8) * scale;
            }
        }
        store_split(w, hi + i, lo + i);
    }
}

// y (= or +=) a . w for a dense weight matrix in any format: bf16 as is; int8 / q4 dequantized
// into the scratch's w_hi + w_lo, then y = a . w_hi (split a as given) + a_hi . w_lo.
cudaError_t gemm_weights(GemmArgs args, const PrefillMatrix &w, const PrefillScratch &s,
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
                                        false, data, w.scales, w.rows, w.cols, ld, row_bytes, spr,
                                        s.w_hi, s.w_lo));
    else if (w.format == OG_WEIGHTS_Q4)
        OG_CUDA_RETURN_IF(launch_kernel(dequant_split_kernel<OG_WEIGHTS_Q4>, grid, block, 0, stream,
                                        false, data, w.scales, w.rows, w.cols, ld, row_bytes, spr,
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
                                    s.narrow, s.narrow_lo, ldH));
    OG_CUDA_RETURN_IF(launch_gemm_bf16(GemmArgs{s.narrow, s.narrow_lo, ldH, w.router, ldH,
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
                                    n_entries, s.moe_act, s.moe_act_lo, ldIm));
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
                                        s.narrow_lo, ldH));
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
        attn.sqrt_hd = (float)sqrt((double)m.hd);  // as decode attention
        OG_CUDA_RETURN_IF(launch_prefill_attention(attn, m.kv_dtype, stream));
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
                GemvArgs router = {w.router, m.E, H, x_row, w.post_attention_layernorm, m.eps,
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
                                            m.eps, H, s.narrow, s.narrow_lo, ldH));
            OG_CUDA_RETURN_IF(gemm_weights(GemmArgs{s.narrow, s.narrow_lo, ldH, nullptr, ldH,
                                                    s.wide, 2 * I, n, 2 * I, ldH, false},
                                           w.gate_up, s, stream));
            OG_CUDA_RETURN_IF(launch_kernel(swiglu_rows_kernel, dim3(row_grid((int64_t)n * ldI)),
                                            row_block, 0, stream, false, (const float *)s.wide, I, n,
                                            s.narrow, s.narrow_lo, ldI));
            OG_CUDA_RETURN_IF(gemm_weights(
                GemmArgs{s.narrow, s.narrow_lo, ldI, nullptr, ldI, s.x, H, n, H, ldI, true}, w.down,
                s, stream));
        }
    }
    return cudaSuccess;
}

}  // namespace og
