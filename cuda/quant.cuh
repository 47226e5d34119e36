// quant.cuh — quantized weight matrices on the device (int8 per row, q4 in groups of 32): the
// layouts, the dequantization of a word of codes into exact fp16 pairs (shared by the dense
// GEMV's tensor-core path in gemv.cu and the MoE experts in moe.cu), and the MoE experts'
// fp32 dot products.
//
// Device layouts (the rules that produce them: onegraph.h "weight formats", runtime/quant.py):
//   OG_WEIGHTS_BF16  data [rows, round_up(cols, 8)] bf16                   scales none
//   OG_WEIGHTS_INT8  data [rows, round_up(cols, 16)] int8 (two's compl.)  scales [rows] fp32
//   OG_WEIGHTS_Q4    data [rows, ceil(cols / 32) * 16] packed bytes       scales [rows, ceil(cols / 32)] bf16
// Every row starts 16-byte aligned, so one 16-byte load reads 8 bf16, 16 int8 or 32 q4 values;
// for q4 one such "chunk" is exactly one scale group. Pad columns hold zeros (int8) or any
// nibble (q4): they meet zeros in the staged input vector.
//
// Dequantizing on the fly, without integer-to-float conversions (those run at a quarter of the
// fp32 rate): one LOP3 lays two codes into the mantissas of an fp16 pair with the exponent of
// 1024, where the fp16 spacing is exactly 1, then one packed fp16 subtract (or fma, for codes
// sitting four bits up) removes the offset exactly and a conversion to fp32 feeds the fp32 fma:
//   int8:  (w & 0x00FF00FF) ^ 0x64806480 = half2(1024 + 128 + q0, 1024 + 128 + q2); - 1152 -> q
//   q4:    (w & 0x000F000F) ^ 0x64086408 = half2(1024 + 8 + q0, 1024 + 8 + q4);     - 1032 -> q
//          (w & 0x00F000F0) ^ 0x64806480 = half2(1024 + 16 (8 + q1), ...); * 1/16 - 72 -> q
// (flipping the code's sign bit with the xor turns two's complement into offset binary). Every
// step is exact, so the fp32 value is the integer code itself.
//
// Input vectors are staged in shared memory as fp32 with a per-chunk swizzle: a chunk's F float4s
// (F = 16-byte weight chunk's values / 4) are stored at chunk * F + (j ^ key(chunk)). A warp's lanes
// read consecutive chunks, and the key spreads the 8 lanes of each quarter-warp over all 32 banks
// (without it, lanes 64 or 128 bytes apart share banks: 4- or 8-way conflicts). key depends only on
// chunk % 8, i.e. on the lane, for the loops that stride chunks by 32.
#pragma once

#include <cuda_fp16.h>

#include "common.cuh"

namespace og {

constexpr int kQ4Group = 32;  // columns per q4 scale (= values per 16-byte chunk)

template <int FMT>
struct QuantFormat;
template <>
struct QuantFormat<OG_WEIGHTS_INT8> {
    static constexpr int kValuesPerChunk = 16;
};
template <>
struct QuantFormat<OG_WEIGHTS_Q4> {
    static constexpr int kValuesPerChunk = 32;
};

// Values per 16-byte chunk of a row.
__host__ __device__ constexpr int weight_values_per_chunk(int format) {
    return format == OG_WEIGHTS_Q4 ? 32 : format == OG_WEIGHTS_INT8 ? 16 : 8;
}
// Bytes of one stored row of a [rows, cols] matrix (a multiple of 16).
__host__ __device__ inline int64_t weight_row_bytes(int format, int64_t cols) {
    const int64_t chunks = (cols + weight_values_per_chunk(format) - 1) / weight_values_per_chunk(format);
    return chunks * 16;
}
// Scales per row and their element size (0 for bf16).
__host__ __device__ inline int64_t weight_scales_per_row(int format, int64_t cols) {
    return format == OG_WEIGHTS_INT8 ? 1 : format == OG_WEIGHTS_Q4 ? (cols + kQ4Group - 1) / kQ4Group : 0;
}
__host__ __device__ constexpr int weight_scale_bytes(int format) {
    return format == OG_WEIGHTS_INT8 ? 4 : format == OG_WEIGHTS_Q4 ? 2 : 0;
}

// ---- staging of the input vector ---------------------------------------------------------
template <int FMT>
__device__ __forceinline__ int swizzle_key(int chunk) {
    return FMT == OG_WEIGHTS_Q4 ? (chunk & 7) : ((chunk >> 1) & 3);
}
// Physical float4 slot of logical float4 `i` of the staged vector.
template <int FMT>
__device__ __forceinline__ int swizzled_float4(int i) {
    constexpr int F = QuantFormat<FMT>::kValuesPerChunk / 4;
    const int chunk = i / F;
    return chunk * F + ((i % F) ^ swizzle_key<FMT>(chunk));
}

// Stage src[0, n) into dst (n_float4 float4s, zeros past n), swizzled; returns this thread's
// sum of squares of the values it staged. Threads tid, tid + NT, ... each take one float4.
template <int FMT, int NT>
__device__ __forceinline__ float stage_vector(float4 *dst, const float *src, int n, int n_float4,
                                              int tid) {
    float sum_sq = 0.f;
    const bool vec = (n % 4 == 0) && ((reinterpret_cast<uintptr_t>(src) & 15) == 0);
    for (int i = tid; i < n_float4; i += NT) {
        float4 v;
        if (vec) {
            v = 4 * i < n ? reinterpret_cast<const float4 *>(src)[i] : make_float4(0.f, 0.f, 0.f, 0.f);
        } else {
            v.x = 4 * i + 0 < n ? src[4 * i + 0] : 0.f;
            v.y = 4 * i + 1 < n ? src[4 * i + 1] : 0.f;
            v.z = 4 * i + 2 < n ? src[4 * i + 2] : 0.f;
            v.w = 4 * i + 3 < n ? src[4 * i + 3] : 0.f;
        }
        dst[swizzled_float4<FMT>(i)] = v;
        sum_sq = fmaf(v.x, v.x, sum_sq);
        sum_sq = fmaf(v.y, v.y, sum_sq);
        sum_sq = fmaf(v.z, v.z, sum_sq);
        sum_sq = fmaf(v.w, v.w, sum_sq);
    }
    return sum_sq;
}

// ---- dequantizing dot products -------------------------------------------------------------
// (a & b) ^ c in one LOP3.
__device__ __forceinline__ uint32_t and_xor(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
__device__ __forceinline__ __half2 as_half2(uint32_t u) {
    __half2 h;
    memcpy(&h, &u, sizeof h);
    return h;
}
__device__ __forceinline__ __half2 half2_bits(uint32_t u) { return as_half2(u); }

__device__ __forceinline__ uint32_t word_of(const uint4 &v, int k) {
    return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// The codes of one 32-bit word as exact fp16 pairs (low half first):
//   int8: (q0, q2), (q1, q3);   q4: (q0, q4), (q1, q5), (q2, q6), (q3, q7)
// where q4 byte j holds code 2j in its low nibble and 2j + 1 in its high nibble.
__device__ __forceinline__ void word_pairs(uint32_t w, __half2 (&h)[2]) {  // int8
    const __half2 offset = half2_bits(0x64806480u);                        // 1152, 1152
    h[0] = __hsub2(as_half2(and_xor(w, 0x00FF00FFu, 0x64806480u)), offset);
    h[1] = __hsub2(as_half2(and_xor(w >> 8, 0x00FF00FFu, 0x64806480u)), offset);
}
__device__ __forceinline__ void word_pairs(uint32_t w, __half2 (&h)[4]) {  // q4
    const __half2 offset = half2_bits(0x64086408u);                        // 1032, 1032
    const __half2 sixteenth = half2_bits(0x2C002C00u);                     // 1/16
    const __half2 minus72 = half2_bits(0xD480D480u);                       // -72
    const uint32_t w8 = w >> 8;
    h[0] = __hsub2(as_half2(and_xor(w, 0x000F000Fu, 0x64086408u)), offset);
    h[1] = __hfma2(as_half2(and_xor(w, 0x00F000F0u, 0x64806480u)), sixteenth, minus72);
    h[2] = __hsub2(as_half2(and_xor(w8, 0x000F000Fu, 0x64086408u)), offset);
    h[3] = __hfma2(as_half2(and_xor(w8, 0x00F000F0u, 0x64806480u)), sixteenth, minus72);
}

// acc + the 4 int8 codes of w . x (element order), one fma per element.
__device__ __forceinline__ float int8_word_dot(uint32_t w, float4 x, float acc) {
    __half2 h[2];
    word_pairs(w, h);
    acc = fmaf(__low2float(h[0]), x.x, acc);
    acc = fmaf(__low2float(h[1]), x.y, acc);
    acc = fmaf(__high2float(h[0]), x.z, acc);
    acc = fmaf(__high2float(h[1]), x.w, acc);
    return acc;
}

// acc + the 8 q4 codes of w . (xa, xb) (element order), one fma per element.
__device__ __forceinline__ float q4_word_dot(uint32_t w, float4 xa, float4 xb, float acc) {
    __half2 h[4];
    word_pairs(w, h);
    acc = fmaf(__low2float(h[0]), xa.x, acc);
    acc = fmaf(__low2float(h[1]), xa.y, acc);
    acc = fmaf(__low2float(h[2]), xa.z, acc);
    acc = fmaf(__low2float(h[3]), xa.w, acc);
    acc = fmaf(__high2float(h[0]), xb.x, acc);
    acc = fmaf(__high2float(h[1]), xb.y, acc);
    acc = fmaf(__high2float(h[2]), xb.z, acc);
    acc = fmaf(__high2float(h[3]), xb.w, acc);
    return acc;
}

// For R rows sharing one staged chunk of the input (xc: the chunk's swizzled float4s, key its
// swizzle key): acc[r] + w[r] . x over the chunk's values, one fma chain per row in element
// order. For q4 the caller passes acc = 0 and scales the group's sum; for int8 the chain runs on
// through the row and the row scale comes last.
template <int FMT, int R>
__device__ __forceinline__ void chunk_dots(const uint4 (&w)[R], const float4 *xc, int key,
                                           float (&acc)[R]) {
    if (FMT == OG_WEIGHTS_Q4) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float4 xa = xc[(2 * k) ^ key];
            const float4 xb = xc[(2 * k + 1) ^ key];
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = q4_word_dot(word_of(w[r], k), xa, xb, acc[r]);
        }
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float4 x = xc[k ^ key];
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = int8_word_dot(word_of(w[r], k), x, acc[r]);
        }
    }
}

// Weights are read once per token: no L1 allocation, 256-byte L2 fetches (rows stream).
__device__ __forceinline__ uint4 load_weight_chunk(const uint4 *p);
__device__ __forceinline__ float load_bf16_scale(const uint16_t *p);

// y[r] = row r . x for R rows of one quantized matrix, by one warp (every lane gets y):
//   row[r]    the row's first byte (16-byte aligned; n_chunks chunks of 16 bytes)
//   scale[r]  int8: the row's fp32 scale; q4: the row's first bf16 group scale
//   x_smem    the input staged by stage_vector<FMT> (n_chunks chunks, swizzled)
// Lane l reads chunks l, l + 32, ..., U chunks of each row in flight (16 bytes each). int8: one
// fp32 fma chain per row and lane through its chunks, the warp sum times the row scale; q4: per
// chunk (= group) a chain of 32 fmas from zero, acc = fma(group scale, chain, acc), warp sum.
template <int FMT, int R, int U>
__device__ __forceinline__ void rows_dot(const uint8_t *const (&row)[R], const void *const (&scale)[R],
                                         int n_chunks, const float4 *x_smem, int lane,
                                         float (&y)[R]) {
    constexpr int F = QuantFormat<FMT>::kValuesPerChunk / 4;
    const int key = swizzle_key<FMT>(lane);  // = the key of every chunk this lane reads
    float row_scale[R];                      // int8: issued with the first weights, used last
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        row_scale[r] = FMT == OG_WEIGHTS_INT8 ? __ldg(static_cast<const float *>(scale[r])) : 1.f;
        acc[r] = 0.f;
    }
    for (int base = lane; base < n_chunks; base += kWarpSize * U) {
        uint4 v[U][R];
        float group_scale[U][R];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = base + u * kWarpSize;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (c < n_chunks) {
                    v[u][r] = load_weight_chunk(reinterpret_cast<const uint4 *>(row[r]) + c);
                    group_scale[u][r] = FMT == OG_WEIGHTS_Q4
                        ? load_bf16_scale(static_cast<const uint16_t *>(scale[r]) + c) : 0.f;
                } else {
                    v[u][r] = make_uint4(0u, 0u, 0u, 0u);
                    group_scale[u][r] = 0.f;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = base + u * kWarpSize;
            if (c < n_chunks) {
                if (FMT == OG_WEIGHTS_Q4) {
                    float g[R];
#pragma unroll
                    for (int r = 0; r < R; ++r) g[r] = 0.f;
                    chunk_dots<FMT, R>(v[u], x_smem + c * F, key, g);
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[r] = fmaf(group_scale[u][r], g[r], acc[r]);
                } else {
                    chunk_dots<FMT, R>(v[u], x_smem + c * F, key, acc);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        y[r] = warp_sum(acc[r]);
        if (FMT == OG_WEIGHTS_INT8) y[r] *= row_scale[r];
    }
}

__device__ __forceinline__ uint4 load_weight_chunk(const uint4 *p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
__device__ __forceinline__ float load_bf16_scale(const uint16_t *p) {
    return __uint_as_float((uint32_t)__ldg(p) << 16);
}

}  // namespace og
