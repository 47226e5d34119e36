// attention.cu — decode attention (one query token) over the KV cache, split-KV with a
// fixed grid so that a captured graph serves every position.
//
//   q:        [n_heads, hd] fp32 (normed and rotated by rope_kv.cu)
//   K, V:     the paged pool (kernels.cuh, KvPages): row t of KV head g is row
//             g * page + t % page of the K / V page (fp32 / bf16 / int8; int8 with a scale
//             page [n_kv, page] fp32) in block table[t / page], where table is row
//             step->seq_slot of the block tables
//   out:      [n_heads, hd] fp32
//   visible length len = position + 1 (read from the device step record)
//   score[t] = (q . dequant(K[t])) / sqrt(hd); p = softmax(score) (fp32, max
//   subtracted); out = sum_t p[t] * dequant(V[t]); dequant(int8) = q_int8 * scale.
//   GQA: query head h reads KV head h * n_kv / n_heads, i.e. the G = n_heads / n_kv
//   consecutive query heads of a KV head share it.
//
// Grid (n_kv, n_splits), 128 threads. Block (g, s) covers positions [s*S, s*S + S) of KV
// head g for all G of its query heads, so K and V are read once. Splits at or beyond len
// return at once. A block computes its scores (one thread per position; the thread also
// looks up the row's block, and keeps the row's byte offset and V scale in shared memory
// for the V pass), a softmax per head (one warp per head) and o = sum p * V (warps split
// positions, lanes split hd),
// then writes o, max and sum as a partial. The last of the n_active = ceil(len / S)
// blocks of a KV head to finish (an atomic counter, reset by that block) combines the
// partials in split order — the same arithmetic whichever block is last, so results
// are bit-identical run to run. When n_active == 1 the block writes out directly.
#include <math.h>

#include "kernels.cuh"

namespace og {
namespace {

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / kWarpSize;
constexpr int kHeadGroup = 8;  // query heads accumulated together in registers

struct AttnParams {
    AttentionArgs a;
    int split_len, n_splits;
    float sqrt_hd;  // scores are divided by it, as in the reference
};

// Load N consecutive cache elements starting at element idx (N-aligned) as fp32.
template <int KV, int N>
__device__ __forceinline__ void load_dequant(const void *base, size_t idx, float scale,
                                             float (&out)[N]) {
    if constexpr (KV == OG_KV_F32) {
        const float *p = static_cast<const float *>(base) + idx;
        if constexpr (N % 4 == 0) {
#pragma unroll
            for (int k = 0; k < N / 4; ++k) {
                const float4 v = reinterpret_cast<const float4 *>(p)[k];
                out[4 * k] = v.x;
                out[4 * k + 1] = v.y;
                out[4 * k + 2] = v.z;
                out[4 * k + 3] = v.w;
            }
        } else if constexpr (N == 2) {
            const float2 v = *reinterpret_cast<const float2 *>(p);
            out[0] = v.x;
            out[1] = v.y;
        } else {
            out[0] = p[0];
        }
    } else if constexpr (KV == OG_KV_BF16) {
        const uint16_t *p = static_cast<const uint16_t *>(base) + idx;
        if constexpr (N % 8 == 0) {
#pragma unroll
            for (int k = 0; k < N / 8; ++k) {
                const uint4 w = reinterpret_cast<const uint4 *>(p)[k];
                out[8 * k] = bf16_lo(w.x);
                out[8 * k + 1] = bf16_hi(w.x);
                out[8 * k + 2] = bf16_lo(w.y);
                out[8 * k + 3] = bf16_hi(w.y);
                out[8 * k + 4] = bf16_lo(w.z);
                out[8 * k + 5] = bf16_hi(w.z);
                out[8 * k + 6] = bf16_lo(w.w);
                out[8 * k + 7] = bf16_hi(w.w);
            }
        } else if constexpr (N == 4) {
            const uint2 w = *reinterpret_cast<const uint2 *>(p);
            out[0] = bf16_lo(w.x);
            out[1] = bf16_hi(w.x);
            out[2] = bf16_lo(w.y);
            out[3] = bf16_hi(w.y);
        } else if constexpr (N == 2) {
            const uint32_t w = *reinterpret_cast<const uint32_t *>(p);
            out[0] = bf16_lo(w);
            out[1] = bf16_hi(w);
        } else {
            out[0] = bf16_bits_to_float(p[0]);
        }
    } else {
        const int8_t *p = static_cast<const int8_t *>(base) + idx;
        if constexpr (N % 8 == 0) {
#pragma unroll
            for (int k = 0; k < N / 8; ++k) {
                const uint2 w = reinterpret_cast<const uint2 *>(p)[k];
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    out[8 * k + b] = (float)(int8_t)(w.x >> (8 * b)) * scale;
                    out[8 * k + 4 + b] = (float)(int8_t)(w.y >> (8 * b)) * scale;
                }
            }
        } else if constexpr (N == 4) {
            const uint32_t w = *reinterpret_cast<const uint32_t *>(p);
#pragma unroll
            for (int b = 0; b < 4; ++b) out[b] = (float)(int8_t)(w >> (8 * b)) * scale;
        } else if constexpr (N == 2) {
            const uint32_t w = *reinterpret_cast<const uint16_t *>(p);
            out[0] = (float)(int8_t)(w) * scale;
            out[1] = (float)(int8_t)(w >> 8) * scale;
        } else {
            out[0] = (float)p[0] * scale;
        }
    }
}

// HD: head_dim when it is 64, 128 or 256 (vector loads, unrolled); 0 = any even head_dim.
template <int KV, int HD>
__global__ void __launch_bounds__(kAttnThreads) attention_split_kernel(const AttnParams p) {
    extern __shared__ float4 smem4[];
    __shared__ int is_last_block;
    const AttentionArgs &a = p.a;
    const int hd = HD > 0 ? HD : a.head_dim;
    const int group = a.n_heads / a.n_kv_heads;
    const int S = p.split_len;
    // Shared memory: row offsets [S] (int64: bytes from a page of block 0 to the row, the
    // same for K and V) | V scales [S] | q [G, hd] | scores [G, S] | reduce [warps, 8, hd]
    // | stats [G, 2] | combine factors [G, n_splits]. S is a multiple of 32, so q stays
    // 16-byte aligned.
    int64_t *row_offset_s = reinterpret_cast<int64_t *>(smem4);
    float *v_scale_s = reinterpret_cast<float *>(row_offset_s + S);
    float *q_s = v_scale_s + S;
    float *scores = q_s + group * hd;
    float *reduce = scores + group * S;
    float *stats = reduce + kAttnWarps * kHeadGroup * hd;
    float *factors = stats + 2 * group;

    const int tid = threadIdx.x;
    const int warp = tid / kWarpSize;
    const int lane = tid % kWarpSize;
    const int kv_head = blockIdx.x;
    const int split = blockIdx.y;
    const int head0 = kv_head * group;

    pdl_wait();
    pdl_launch_dependents();

    const int len = max(1, min(a.step->position + 1, a.max_seq_len));
    const int begin = split * S;
    if (begin >= len) return;
    const int n = min(S, len - begin);
    const int n_active = ceil_div(len, S);
    const KvPages &kv = a.kv;
    const int table_row = a.step->seq_slot * kv.max_blocks_per_seq;
    constexpr int kElemBytes = KV == OG_KV_F32 ? 4 : KV == OG_KV_BF16 ? 2 : 1;

    for (int i = tid; i < group * hd; i += kAttnThreads) q_s[i] = a.q[(size_t)head0 * hd + i];
    __syncthreads();

    // ---- scores: one thread per position ------------------------------------------------
    for (int t = tid; t < n; t += kAttnThreads) {
        const int position = begin + t;
        const int chunk = position / kv.page_size;
        const int block = kv.block_tables[table_row + chunk];  // written by this step's layer 0
        const int row = kv_head * kv.page_size + (position - chunk * kv.page_size);
        const int64_t block_offset = (int64_t)block * kv.block_stride;
        const int64_t row_offset = block_offset + (int64_t)row * (hd * kElemBytes);
        row_offset_s[t] = row_offset;
        const char *k_row = kv.k + row_offset;
        float k_scale = 1.f;
        if constexpr (KV == OG_KV_INT8) {
            k_scale = reinterpret_cast<const float *>(kv.k_scales + block_offset)[row];
            v_scale_s[t] = reinterpret_cast<const float *>(kv.v_scales + block_offset)[row];
        }
        for (int hg = 0; hg < group; hg += kHeadGroup) {
            float acc[kHeadGroup];
#pragma unroll
            for (int j = 0; j < kHeadGroup; ++j) acc[j] = 0.f;
            if constexpr (HD > 0) {
#pragma unroll
                for (int c = 0; c < HD / 8; ++c) {
                    float k8[8];
                    load_dequant<KV, 8>(k_row, c * 8, k_scale, k8);
#pragma unroll
                    for (int j = 0; j < kHeadGroup; ++j) {
                        if (hg + j < group) {
                            const float4 *qv =
                                reinterpret_cast<const float4 *>(q_s + (hg + j) * HD + c * 8);
                            const float4 qa = qv[0], qb = qv[1];
                            float s = acc[j];
                            s = fmaf(qa.x, k8[0], s);
                            s = fmaf(qa.y, k8[1], s);
                            s = fmaf(qa.z, k8[2], s);
                            s = fmaf(qa.w, k8[3], s);
                            s = fmaf(qb.x, k8[4], s);
                            s = fmaf(qb.y, k8[5], s);
                            s = fmaf(qb.z, k8[6], s);
                            s = fmaf(qb.w, k8[7], s);
                            acc[j] = s;
                        }
                    }
                }
            } else {
                for (int d = 0; d < hd; ++d) {
                    float k1[1];
                    load_dequant<KV, 1>(k_row, d, k_scale, k1);
#pragma unroll
                    for (int j = 0; j < kHeadGroup; ++j)
                        if (hg + j < group) acc[j] = fmaf(q_s[(hg + j) * hd + d], k1[0], acc[j]);
                }
            }
#pragma unroll
            for (int j = 0; j < kHeadGroup; ++j)
                if (hg + j < group) scores[(hg + j) * S + t] = acc[j] / p.sqrt_hd;
        }
    }
    __syncthreads();

    // ---- softmax numerators per head: one warp per head ---------------------------------
    for (int j = warp; j < group; j += kAttnWarps) {
        float *s_j = scores + j * S;
        float m = -INFINITY;
        for (int t = lane; t < n; t += kWarpSize) m = fmaxf(m, s_j[t]);
        m = warp_max(m);
        float l = 0.f;
        for (int t = lane; t < n; t += kWarpSize) {
            const float e = expf(s_j[t] - m);
            s_j[t] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) {
            stats[2 * j] = m;
            stats[2 * j + 1] = l;
        }
    }
    __syncthreads();

    // ---- o = sum_t p[t] * V[t]: warps split positions, lanes split hd -------------------
    float *partial_o = a.partials;                                      // [n_heads, n_splits, hd]
    float *partial_m = a.partials + (size_t)a.n_heads * p.n_splits * hd;  // [n_heads, n_splits]
    float *partial_l = partial_m + (size_t)a.n_heads * p.n_splits;        // [n_heads, n_splits]
    for (int hg = 0; hg < group; hg += kHeadGroup) {
        const int heads_here = min(kHeadGroup, group - hg);
        if constexpr (HD > 0) {
            constexpr int kPerLane = HD / kWarpSize;
            float acc[kHeadGroup][kPerLane];
#pragma unroll
            for (int j = 0; j < kHeadGroup; ++j)
#pragma unroll
                for (int e = 0; e < kPerLane; ++e) acc[j][e] = 0.f;
#pragma unroll 2
            for (int t = warp; t < n; t += kAttnWarps) {
                const char *v_row = kv.v + row_offset_s[t];
                const float v_scale = KV == OG_KV_INT8 ? v_scale_s[t] : 1.f;
                float v[kPerLane];
                load_dequant<KV, kPerLane>(v_row, lane * kPerLane, v_scale, v);
#pragma unroll
                for (int j = 0; j < kHeadGroup; ++j) {
                    if (j < heads_here) {
                        const float pj = scores[(hg + j) * S + t];
#pragma unroll
                        for (int e = 0; e < kPerLane; ++e) acc[j][e] = fmaf(pj, v[e], acc[j][e]);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < kHeadGroup; ++j)
                if (j < heads_here)
#pragma unroll
                    for (int e = 0; e < kPerLane; ++e)
                        reduce[(warp * kHeadGroup + j) * HD + lane * kPerLane + e] = acc[j][e];
        } else {
            constexpr int kMaxPerLane = 256 / kWarpSize;
            float acc[kHeadGroup][kMaxPerLane];
#pragma unroll
            for (int j = 0; j < kHeadGroup; ++j)
#pragma unroll
                for (int e = 0; e < kMaxPerLane; ++e) acc[j][e] = 0.f;
            for (int t = warp; t < n; t += kAttnWarps) {
                const char *v_row = kv.v + row_offset_s[t];
                const float v_scale = KV == OG_KV_INT8 ? v_scale_s[t] : 1.f;
#pragma unroll
                for (int e = 0; e < kMaxPerLane; ++e) {
                    const int d = lane + e * kWarpSize;
                    if (d < hd) {
                        float v1[1];
                        load_dequant<KV, 1>(v_row, d, v_scale, v1);
#pragma unroll
                        for (int j = 0; j < kHeadGroup; ++j)
                            if (j < heads_here)
                                acc[j][e] = fmaf(scores[(hg + j) * S + t], v1[0], acc[j][e]);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < kHeadGroup; ++j)
#pragma unroll
                for (int e = 0; e < kMaxPerLane; ++e) {
                    const int d = lane + e * kWarpSize;
                    if (j < heads_here && d < hd) reduce[(warp * kHeadGroup + j) * hd + d] = acc[j][e];
                }
        }
        __syncthreads();
        for (int i = tid; i < heads_here * hd; i += kAttnThreads) {
            const int j = i / hd;
            const int d = i - j * hd;
            float o = 0.f;
#pragma unroll
            for (int w = 0; w < kAttnWarps; ++w) o += reduce[(w * kHeadGroup + j) * hd + d];
            const int head = head0 + hg + j;
            if (n_active == 1)
                a.out[(size_t)head * hd + d] = o / stats[2 * (hg + j) + 1];
            else
                partial_o[((size_t)head * p.n_splits + split) * hd + d] = o;
        }
        __syncthreads();
    }
    if (n_active == 1) return;

    // ---- publish the partial; the last block of this KV head combines -------------------
    for (int j = tid; j < group; j += kAttnThreads) {
        partial_m[(size_t)(head0 + j) * p.n_splits + split] = stats[2 * j];
        partial_l[(size_t)(head0 + j) * p.n_splits + split] = stats[2 * j + 1];
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        const unsigned previous = atomicAdd(&a.counters[kv_head], 1u);
        is_last_block = previous + 1u == (unsigned)n_active;
    }
    __syncthreads();
    if (!is_last_block) return;
    __threadfence();

    // factors[j, s] = exp(m_s - M); stats[2j + 1] = L = sum_s l_s * factors[j, s]
    for (int j = warp; j < group; j += kAttnWarps) {
        const size_t base = (size_t)(head0 + j) * p.n_splits;
        float m = -INFINITY;
        for (int s = lane; s < n_active; s += kWarpSize) m = fmaxf(m, __ldcg(partial_m + base + s));
        m = warp_max(m);
        float l = 0.f;
        for (int s = lane; s < n_active; s += kWarpSize) {
            const float f = expf(__ldcg(partial_m + base + s) - m);
            factors[j * p.n_splits + s] = f;
            l = fmaf(__ldcg(partial_l + base + s), f, l);
        }
        l = warp_sum(l);
        if (lane == 0) stats[2 * j + 1] = l;
    }
    __syncthreads();
    for (int i = tid; i < group * hd; i += kAttnThreads) {
        const int j = i / hd;
        const int d = i - j * hd;
        const size_t head = (size_t)head0 + j;
        float o = 0.f;
        for (int s = 0; s < n_active; ++s)
            o = fmaf(factors[j * p.n_splits + s],
                     __ldcg(partial_o + (head * p.n_splits + s) * hd + d), o);
        a.out[head * hd + d] = o / stats[2 * j + 1];
    }
    if (tid == 0) a.counters[kv_head] = 0u;
}

template <int KV>
const void *kernel_for_dim(int head_dim) {
    switch (head_dim) {
        case 64: return (const void *)attention_split_kernel<KV, 64>;
        case 128: return (const void *)attention_split_kernel<KV, 128>;
        case 256: return (const void *)attention_split_kernel<KV, 256>;
        default: return (const void *)attention_split_kernel<KV, 0>;
    }
}

const void *attention_kernel_for(int kv_dtype, int head_dim) {
    switch (kv_dtype) {
        case OG_KV_F32: return kernel_for_dim<OG_KV_F32>(head_dim);
        case OG_KV_BF16: return kernel_for_dim<OG_KV_BF16>(head_dim);
        case OG_KV_INT8: return kernel_for_dim<OG_KV_INT8>(head_dim);
    }
    return nullptr;
}

size_t attention_smem_bytes(int group, int head_dim, int split_len, int n_splits) {
    const size_t floats = (size_t)group * head_dim + (size_t)group * split_len +
                          (size_t)kAttnWarps * kHeadGroup * head_dim + 2 * (size_t)group +
                          (size_t)group * n_splits;
    return floats * sizeof(float) + (size_t)split_len * (sizeof(int64_t) + sizeof(float));
}

}  // namespace

cudaError_t attention_plan(int n_heads, int n_kv_heads, int head_dim, int max_seq_len,
                           int kv_dtype, int split_len, AttentionPlan *plan) {
    if (plan == nullptr || n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 ||
        head_dim <= 0 || head_dim > 256 || head_dim % 2 != 0 || max_seq_len <= 0 ||
        split_len < 0)
        return cudaErrorInvalidValue;
    const void *kernel = attention_kernel_for(kv_dtype, head_dim);
    if (kernel == nullptr) return cudaErrorInvalidValue;
    const int group = n_heads / n_kv_heads;
    if (split_len == 0) {
        // About four blocks per SM when the whole cache is visible.
        int sm_count = 0;
        OG_CUDA_RETURN_IF(current_sm_count(&sm_count));
        const int target_splits = ceil_div(4 * sm_count, n_kv_heads);
        split_len = ceil_div(max_seq_len, target_splits);
    }
    split_len = (int)round_up(split_len < 32 ? 32 : split_len, 32);
    int device = 0, smem_optin = 0;
    OG_CUDA_RETURN_IF(cudaGetDevice(&device));
    OG_CUDA_RETURN_IF(
        cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    const size_t smem_limit = (size_t)smem_optin - 64;  // the static is_last_block flag
    size_t smem = attention_smem_bytes(group, head_dim, split_len,
                                       ceil_div(max_seq_len, split_len));
    while (smem > smem_limit && split_len > 32) {
        split_len -= 32;
        smem = attention_smem_bytes(group, head_dim, split_len, ceil_div(max_seq_len, split_len));
    }
    if (smem > smem_limit) return cudaErrorInvalidValue;
    OG_CUDA_RETURN_IF(allow_dynamic_smem(kernel, smem));
    plan->split_len = split_len;
    plan->n_splits = ceil_div(max_seq_len, split_len);
    plan->smem_bytes = (int)smem;
    return cudaSuccess;
}

size_t attention_partial_floats(int n_heads, int head_dim, const AttentionPlan &plan) {
    return (size_t)n_heads * plan.n_splits * (head_dim + 2);
}

cudaError_t launch_attention(const AttentionArgs &args, const AttentionPlan &plan,
                             cudaStream_t stream, bool pdl) {
    if (plan.split_len <= 0 || plan.n_splits <= 0) return cudaErrorInvalidConfiguration;
    if (args.kv.page_size <= 0 || args.kv.block_tables == nullptr) return cudaErrorInvalidValue;
    AttnParams p;
    p.a = args;
    p.split_len = plan.split_len;
    p.n_splits = plan.n_splits;
    p.sqrt_hd = (float)sqrt((double)args.head_dim);
    const dim3 grid(args.n_kv_heads, plan.n_splits), block(kAttnThreads);
    const size_t smem = plan.smem_bytes;
#define OG_ATTN_CASE(KV, HD)                                                                \
    return launch_kernel(attention_split_kernel<KV, HD>, grid, block, smem, stream, pdl, p)
#define OG_ATTN_DIMS(KV)                          \
    switch (args.head_dim) {                      \
        case 64: OG_ATTN_CASE(KV, 64);            \
        case 128: OG_ATTN_CASE(KV, 128);          \
        case 256: OG_ATTN_CASE(KV, 256);          \
        default: OG_ATTN_CASE(KV, 0);             \
    }
    switch (args.kv_dtype) {
        case OG_KV_F32: OG_ATTN_DIMS(OG_KV_F32);
        case OG_KV_BF16: OG_ATTN_DIMS(OG_KV_BF16);
        case OG_KV_INT8: OG_ATTN_DIMS(OG_KV_INT8);
    }
#undef OG_ATTN_DIMS
#undef OG_ATTN_CASE
    return cudaErrorInvalidValue;
}

}  // namespace og
