// quant.cuh — quantized weight matrices on the device (int8 per row, q4 in groups of 32): the
// layouts, the dequantization of a 32-bit word of int8 codes into exact fp16 pairs, which the
// int8 GEMV's tensor-core kernel (gemv.cu: dense projections and MoE experts) feeds to
// mma.sync as its A operand, and the streaming weight load both quantized GEMVs use (q4 codes
// meet the int8-quantized input in dp4a instead: gemv_q4.cu).
//
// Device layouts (the rules that produce them: onegraph.h "weight formats", runtime/quant.py):
//   OG_WEIGHTS_BF16  data [rows, round_up(cols, 8)] bf16                   scales none
//   OG_WEIGHTS_INT8  data [rows, round_up(cols, 16)] int8 (two's compl.)  scales [rows] fp32
//   OG_WEIGHTS_Q4    data [rows, ceil(cols / 32) * 16] packed bytes       scales [rows, ceil(cols / 32)] e5m3
// Every row starts 16-byte aligned, so one 16-byte load reads 8 bf16, 16 int8 or 32 q4 values;
// for q4 one such "chunk" is exactly one scale group. Pad columns hold zeros (int8) or any
// nibble (q4): they meet zeros in the staged input vector.
//
// Dequantizing without integer-to-float conversions: one LOP3 lays two codes into the mantissas
// of an fp16 pair with the exponent of 1024, where the fp16 spacing is exactly 1, then one
// packed fp16 subtract removes the offset exactly:
//   (w & 0x00FF00FF) ^ 0x64806480 = half2(1024 + 128 + q0, 1024 + 128 + q2); - 1152 -> q
// (flipping the code's sign bit with the xor turns two's complement into offset binary). Every
// step is exact, so each fp16 value is the integer code itself.
#pragma once

#include <cuda_fp16.h>

#include "common.cuh"

namespace og {

constexpr int kQ4Group = 32;  // columns per q4 scale (= values per 16-byte chunk)

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
    return format == OG_WEIGHTS_INT8 ? 4 : format == OG_WEIGHTS_Q4 ? 1 : 0;
}

// ---- q4 group scales: e5m3 --------------------------------------------------------
// A q4 scale is stored in one byte: an unsigned 8-bit float made of the bits 14..7 of an
// fp16 (5 exponent bits, bias 15; 3 mantissa bits; subnormals below 2^-14; 0xF8 inf, above it
// NaN). Every e5m3 value is exact in bf16, fp16 and fp32, and q * scale (4 bits by 4 bits) is
// exact in fp32. og_set_weight takes the scales as bf16 and stores e5m3(scale), rounded to
// nearest even (runtime/quant.py q4_scale_codes does the same in numpy); the scales
// runtime/quant.py writes are e5m3 values already, so for them this is exact. One byte instead
// of two: a q4 row is 17 bytes per 32 weights instead of 18.
constexpr uint8_t kE5m3Nan = 0xFF;
// bf16 bits -> e5m3 code, the nearest value (ties to even, one rounding from the value itself;
// from 63488, halfway past the largest finite value 61440, 0xF8: inf; NaN 0xFF); false for a
// negative scale (the code is then 0).
inline bool q4_scale_code(uint16_t bf16_bits, uint8_t *code) {
    *code = 0;
    const uint32_t bits = (uint32_t)bf16_bits << 16, mag = bits & 0x7FFFFFFFu;
    if (mag > 0x7F800000u) {
        *code = kE5m3Nan;
        return true;
    }
    if (bits != mag && mag != 0) return false;
    const uint32_t exp8 = mag >> 23;
    if (exp8 == 0) return true;  // zero, or an fp32 subnormal: 0
    if (exp8 >= 113) {           // an e5m3 normal: the exponent rebased, 20 mantissa bits dropped
        const uint32_t x = mag - (112u << 23);
        const uint32_t c = (x + 0x7FFFFu + ((x >> 20) & 1u)) >> 20;
        *code = (uint8_t)(c > 0xF8u ? 0xF8u : c);  // from 0xF8 on: inf
        return true;
    }
    // An e5m3 subnormal (below 2^-14): the value in steps of 2^-17 is sig * 2^(exp8 - 133).
    const uint32_t sig = (mag & 0x7FFFFFu) | 0x800000u, shift = 133u - exp8;  // shift >= 21
    if (shift > 24) return true;  // below half a step: 0
    const uint32_t q = sig >> shift, rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    *code = (uint8_t)(q + (rem > half || (rem == half && (q & 1u)) ? 1u : 0u));
    return true;
}
// The e5m3 codes of n bf16 q4 scales, for the test entry points (og_set_weight refuses a
// negative scale first; here it becomes 0).
inline void q4_scale_codes(const void *bf16_scales, size_t n, uint8_t *codes) {
    const uint16_t *bits = static_cast<const uint16_t *>(bf16_scales);
    for (size_t i = 0; i < n; ++i) q4_scale_code(bits[i], codes + i);
}
__device__ __forceinline__ float q4_scale_value(uint32_t code) {
    return __half2float(__ushort_as_half((unsigned short)(code << 7)));
}

// ---- dequantization -------------------------------------------------------------
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

__device__ __forceinline__ uint32_t half2_as_u32(__half2 h) {
    uint32_t u;
    memcpy(&u, &h, sizeof u);
    return u;
}

// d += A . B for one m16n8k16 tile (fp16 inputs, fp32 accumulation).
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The codes of one 32-bit word of int8 codes as exact fp16 pairs (low half first): (q0, q2), (q1, q3).
__device__ __forceinline__ void word_pairs(uint32_t w, __half2 (&h)[2]) {
    const __half2 offset = half2_bits(0x64806480u);                        // 1152, 1152
    h[0] = __hsub2(as_half2(and_xor(w, 0x00FF00FFu, 0x64806480u)), offset);
    h[1] = __hsub2(as_half2(and_xor(w >> 8, 0x00FF00FFu, 0x64806480u)), offset);
}

// ---- the q4 GEMV's input rule (runtime/quant.py quantize_input_q8) ------------------------
// Per group of 32 input values with max |v| = amax: code rint(v * (127 / amax)) (0 where amax
// = 0), scale amax / 127, NaN when the group holds an inf or NaN. gemv_q4.cu (the decode GEMV)
// and prefill.cu (the batched GEMMs' q4 inputs) both round with these, so the two paths and the
// numpy reference give the same codes for the same fp32 values.
__device__ __forceinline__ bool q8_finite(float v) { return fabsf(v) <= 3.402823466e38f; }  // false for inf, NaN
__device__ __forceinline__ float q8_inverse(float amax) { return amax > 0.f ? 127.f / amax : 0.f; }
__device__ __forceinline__ int q8_code(float v, float inverse) { return __float2int_rn(__fmul_rn(v, inverse)); }
__device__ __forceinline__ float q8_scale(float amax, bool finite) {
    return finite ? amax / 127.f : __int_as_float(0x7fffffff);
}

// The L2 policy of a weight stream: its lines are the first evicted. A token reads every
// weight once (GBs), while the KV cache rows, the activations and the norm weights are read
// again within the step or by the next one; streamed at the normal priority, the weights push
// them out of L2, and the attention's rows and each GEMV's input then come from DRAM.
// The bf16 GEMV's streaming loads (__ldcs) mark their lines the same way.
__device__ __forceinline__ uint64_t l2_evict_first() {
    uint64_t policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// Weights are read once per token: no L1 allocation, 256-byte L2 fetches (rows stream), lines
// evicted first (policy: l2_evict_first()).
__device__ __forceinline__ uint4 load_weight_chunk(const uint4 *p, uint64_t policy) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p), "l"(policy));
    return r;
}

}  // namespace og
