// rope_kv.cuh — the per-head steps that turn the fused QKV GEMV's output into a rotated query
// and a new KV-cache row: QK-norm, RoPE, and the row's encoding in the cache element type.
// Warp-level device functions; attention.cu's kernel runs them in its prologue (the body has
// no separate QK-norm / RoPE / KV-write kernel). rope_kv.cu holds the host-side RoPE table.
//
// rmsnorm over head_dim: x * (1 / sqrt(mean(x^2) + eps)) * w (skipped when w is NULL); the sum
//   of squares is a chain per lane over dims lane, lane + 32, ... then a warp butterfly.
// rope (rotate-half): angle_i = float(position) * inv_freq[i], i < hd/2, sincosf;
//   out[i]      = fma(x[i], cos, -(x[i + hd/2] * sin))
//   out[i+hd/2] = fma(x[i + hd/2], cos, x[i] * sin)
// Cache element types: fp32; bf16 (round to nearest even); int8 with one fp32 scale per
// (row, head): scale = max|x| / 127, q = rint(x / scale) clamped to [-127, 127], q = 0 when
// scale == 0 (as runtime/reference.py's kv_quantize_int8).
#pragma once

#include <math.h>

#include "kernels.cuh"

namespace og {

constexpr int kMaxHeadDim = 256;
constexpr int kHeadSlots = kMaxHeadDim / kWarpSize;       // values of one head per lane
constexpr int kPairSlots = kMaxHeadDim / 2 / kWarpSize;   // rotation pairs per lane

// What a head's QK-norm and RoPE need besides the head: the norm weights of dims lane + 32k and
// the rotation's sin/cos for pairs lane + 32k at `position`. Weights and the position only, so
// a kernel computes them before waiting on the kernel that writes the head.
struct RopeAngles {
    float sin_a[kPairSlots], cos_a[kPairSlots];
};
__device__ __forceinline__ void rope_angles(const float *inv_freq, int hd, int position, int lane,
                                            RopeAngles &r) {
    const float pos = (float)position;
#pragma unroll
    for (int k = 0; k < kPairSlots; ++k) {
        const int i = lane + k * kWarpSize;
        r.sin_a[k] = 0.f;
        r.cos_a[k] = 1.f;
        if (i < hd / 2) sincosf(__fmul_rn(pos, inv_freq[i]), &r.sin_a[k], &r.cos_a[k]);  // fp32 angle
    }
}
__device__ __forceinline__ void norm_weights(const float *norm_w, int hd, int lane,
                                             float (&w)[kHeadSlots]) {
#pragma unroll
    for (int k = 0; k < kHeadSlots; ++k) {
        const int i = lane + k * kWarpSize;
        w[k] = norm_w != nullptr && i < hd ? norm_w[i] : 0.f;
    }
}

// One warp: head[0, hd) = rope(rmsnorm(src) * w) in shared memory (no norm when has_norm is
// false). src may be global. Ends with __syncwarp(): the whole head is visible to the warp.
__device__ __forceinline__ void warp_norm_rope(const float *src, bool has_norm,
                                               const float (&w)[kHeadSlots], float eps,
                                               const RopeAngles &angles, int hd, float *head,
                                               int lane) {
    float x[kHeadSlots];
    float sum_sq = 0.f;
#pragma unroll
    for (int k = 0; k < kHeadSlots; ++k) {
        const int i = lane + k * kWarpSize;
        x[k] = i < hd ? src[i] : 0.f;
        sum_sq = fmaf(x[k], x[k], sum_sq);
    }
    if (has_norm) {
        const float total = warp_sum(sum_sq);
        const float inv_rms = 1.0f / sqrtf(total / (float)hd + eps);
#pragma unroll
        for (int k = 0; k < kHeadSlots; ++k) x[k] = __fmul_rn(__fmul_rn(x[k], inv_rms), w[k]);
    }
#pragma unroll
    for (int k = 0; k < kHeadSlots; ++k) {
        const int i = lane + k * kWarpSize;
        if (i < hd) head[i] = x[k];
    }
    __syncwarp();
    // Each lane owns whole pairs (i, i + half), so rotating in place is safe. Rounding pinned
    // (a product, then a fused multiply-add), whatever the context.
    const int half = hd / 2;
#pragma unroll
    for (int k = 0; k < kPairSlots; ++k) {
        const int i = lane + k * kWarpSize;
        if (i < half) {
            const float x1 = head[i];
            const float x2 = head[i + half];
            head[i] = fmaf(x1, angles.cos_a[k], -__fmul_rn(x2, angles.sin_a[k]));
            head[i + half] = fmaf(x2, angles.cos_a[k], __fmul_rn(x1, angles.sin_a[k]));
        }
    }
    __syncwarp();
}

// One warp: encode values[0, hd) (shared or global) as a cache row of element type KV into
// row_s (shared, the row's bytes) and, when dst is not NULL, into the cache row dst; for int8
// the scale goes to *scale_s and, when dst is not NULL, to *scale_dst. Ends with __syncwarp().
template <int KV>
__device__ __forceinline__ void warp_encode_row(const float *values, int hd, void *row_s,
                                                float *scale_s, void *dst, float *scale_dst,
                                                int lane) {
    if constexpr (KV == OG_KV_F32) {
        for (int i = lane; i < hd; i += kWarpSize) {
            const float v = values[i];
            static_cast<float *>(row_s)[i] = v;
            if (dst != nullptr) static_cast<float *>(dst)[i] = v;
        }
    } else if constexpr (KV == OG_KV_BF16) {
        for (int i = lane; i < hd; i += kWarpSize) {
            const __nv_bfloat16 b = __float2bfloat16_rn(values[i]);
            static_cast<__nv_bfloat16 *>(row_s)[i] = b;
            if (dst != nullptr) static_cast<__nv_bfloat16 *>(dst)[i] = b;
        }
    } else {
        float amax = 0.f;
        for (int i = lane; i < hd; i += kWarpSize) amax = fmaxf(amax, fabsf(values[i]));
        amax = warp_max(amax);
        const float scale = amax / 127.0f;
        for (int i = lane; i < hd; i += kWarpSize) {
            int q = 0;
            if (scale > 0.f) {  // scale underflows to 0 only for an all-(near-)zero row
                q = __float2int_rn(values[i] / scale);
                q = max(-127, min(127, q));
            }
            static_cast<int8_t *>(row_s)[i] = (int8_t)q;
            if (dst != nullptr) static_cast<int8_t *>(dst)[i] = (int8_t)q;
        }
        if (lane == 0) {
            *scale_s = scale;
            if (dst != nullptr) *scale_dst = scale;
        }
    }
    __syncwarp();
}

// Store the new K and V rows of KV head kv_head at `position` into block `block` of the paged
// cache (row kv_head * page_size + position % page_size of each page), encoded as above. The
// decode KV-write kernel and prefill's per-row kernel share it so both write identical bytes.
__device__ __forceinline__ void warp_store_kv_row(const KvPages &kv, int kv_dtype, int block,
                                                  int position, int kv_head, int hd,
                                                  const float *k_src, const float *v_src,
                                                  void *row_s, float *scale_s, int lane) {
    const int64_t block_offset = (int64_t)block * kv.block_stride;
    const int64_t row = (int64_t)kv_head * kv.page_size + position % kv.page_size;
    const int64_t row_bytes = (int64_t)hd * (kv_dtype == OG_KV_F32 ? 4 : kv_dtype == OG_KV_BF16 ? 2 : 1);
    char *k_row = kv.k + block_offset + row * row_bytes;
    char *v_row = kv.v + block_offset + row * row_bytes;
    if (kv_dtype == OG_KV_F32) {
        warp_encode_row<OG_KV_F32>(k_src, hd, row_s, scale_s, k_row, nullptr, lane);
        warp_encode_row<OG_KV_F32>(v_src, hd, row_s, scale_s, v_row, nullptr, lane);
    } else if (kv_dtype == OG_KV_BF16) {
        warp_encode_row<OG_KV_BF16>(k_src, hd, row_s, scale_s, k_row, nullptr, lane);
        warp_encode_row<OG_KV_BF16>(v_src, hd, row_s, scale_s, v_row, nullptr, lane);
    } else {
        float *k_scale = reinterpret_cast<float *>(kv.k_scales + block_offset) + row;
        float *v_scale = reinterpret_cast<float *>(kv.v_scales + block_offset) + row;
        warp_encode_row<OG_KV_INT8>(k_src, hd, row_s, scale_s, k_row, k_scale, lane);
        warp_encode_row<OG_KV_INT8>(v_src, hd, row_s, scale_s, v_row, v_scale, lane);
    }
}

}  // namespace og
