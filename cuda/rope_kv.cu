// rope_kv.cu — per-head QK-norm, rotary embedding and the KV-cache write, fused.
//
//   qkv:   [n_heads*hd | n_kv*hd | n_kv*hd] fp32, the fused QKV GEMV's output
//   grid:  n_heads + n_kv blocks; block b < n_heads owns query head b, block
//          n_heads + h owns KV head h (its k and its v)
//   query head:  q = rope(rmsnorm(q) * q_norm)             written back in place
//   KV head:     k = rope(rmsnorm(k) * k_norm), v as is    stored at row `position` of the
//                sequence, in block step->row_block of the paged pool (kernels.cuh, KvPages):
//                row kv_head * page + position % page of the layer's K and V pages there
//   table:       the first KV head's block also stores step->row_block into the sequence's
//                block-table entry position / page (when table_update is set), so that the
//                attention that follows reads the row's block through the table
//
// rmsnorm over head_dim: x * (1 / sqrt(mean(x^2) + eps)) (skipped when q_norm is NULL).
// rope (rotate-half): angle_i = float(position) * inv_freq[i], i < hd/2, sincosf;
//   out[i]      = x[i] * cos - x[i + hd/2] * sin
//   out[i+hd/2] = x[i + hd/2] * cos + x[i] * sin
// Cache element types: fp32; bf16 (round to nearest even); int8 with one fp32 scale per
// (row, head): scale = max|x| / 127, q = rint(x / scale) clamped to [-127, 127],
// q = 0 when scale == 0 (as runtime/reference.py's kv_quantize_int8).
#include <math.h>

#include "kernels.cuh"

namespace og {
namespace {

constexpr int kRopeThreads = 128;
constexpr int kMaxHeadDim = 256;

__device__ __forceinline__ void store_cache_row(const float *values, int head_dim, int kv_dtype,
                                                void *cache_row, float *scale_out,
                                                float *scratch) {
    if (kv_dtype == OG_KV_F32) {
        float *dst = static_cast<float *>(cache_row);
        for (int i = threadIdx.x; i < head_dim; i += kRopeThreads) dst[i] = values[i];
    } else if (kv_dtype == OG_KV_BF16) {
        __nv_bfloat16 *dst = static_cast<__nv_bfloat16 *>(cache_row);
        for (int i = threadIdx.x; i < head_dim; i += kRopeThreads)
            dst[i] = __float2bfloat16_rn(values[i]);
    } else {
        float amax = 0.f;
        for (int i = threadIdx.x; i < head_dim; i += kRopeThreads)
            amax = fmaxf(amax, fabsf(values[i]));
        amax = block_max<kRopeThreads>(amax, scratch);
        const float scale = amax / 127.0f;
        int8_t *dst = static_cast<int8_t *>(cache_row);
        for (int i = threadIdx.x; i < head_dim; i += kRopeThreads) {
            int q = 0;
            if (scale > 0.f) {  // scale underflows to 0 only for an all-(near-)zero row
                q = __float2int_rn(values[i] / scale);
                q = max(-127, min(127, q));
            }
            dst[i] = (int8_t)q;
        }
        if (threadIdx.x == 0 && scale_out != nullptr) *scale_out = scale;
    }
}

__global__ void __launch_bounds__(kRopeThreads) qk_norm_rope_kv_kernel(const RopeKvArgs a) {
    __shared__ float head[kMaxHeadDim];
    __shared__ float scratch[kRopeThreads / kWarpSize];
    pdl_wait();
    pdl_launch_dependents();

    const int hd = a.head_dim;
    const int half = hd / 2;
    const int q_size = a.n_heads * hd;
    const int kv_size = a.n_kv_heads * hd;
    const bool is_query = (int)blockIdx.x < a.n_heads;
    const int kv_head = (int)blockIdx.x - a.n_heads;
    float *src = is_query ? a.qkv + (size_t)blockIdx.x * hd : a.qkv + q_size + (size_t)kv_head * hd;
    const float *norm_weight = is_query ? a.q_norm : a.k_norm;
    const int position = a.step->position;

    float sum_sq = 0.f;
    for (int i = threadIdx.x; i < hd; i += kRopeThreads) {
        const float v = src[i];
        head[i] = v;
        sum_sq = fmaf(v, v, sum_sq);
    }
    if (norm_weight != nullptr) {
        const float total = block_sum<kRopeThreads>(sum_sq, scratch);
        const float inv_rms = 1.0f / sqrtf(total / (float)hd + a.eps);
        for (int i = threadIdx.x; i < hd; i += kRopeThreads)
            head[i] = head[i] * inv_rms * norm_weight[i];
    }
    __syncthreads();

    // Rotate pairs (i, i + half); each thread owns whole pairs, so in place is safe.
    const float pos = (float)position;
    for (int i = threadIdx.x; i < half; i += kRopeThreads) {
        float sin_a, cos_a;
        sincosf(pos * a.inv_freq[i], &sin_a, &cos_a);
        const float x1 = head[i];
        const float x2 = head[i + half];
        head[i] = x1 * cos_a - x2 * sin_a;
        head[i + half] = x2 * cos_a + x1 * sin_a;
    }
    __syncthreads();

    if (is_query) {
        for (int i = threadIdx.x; i < hd; i += kRopeThreads) src[i] = head[i];
        return;
    }
    // Unreachable through og_begin_step's checks; never write outside the pool.
    const KvPages &kv = a.kv;
    const int block = a.step->row_block;
    if (position < 0 || position >= a.max_seq_len || block < 0 || block >= kv.n_blocks) return;
    const int chunk = position / kv.page_size;
    if (a.table_update != nullptr && kv_head == 0 && threadIdx.x == 0)
        a.table_update[(size_t)a.step->seq_slot * kv.max_blocks_per_seq + chunk] = block;

    const size_t block_offset = (size_t)block * kv.block_stride;
    const size_t row = (size_t)kv_head * kv.page_size + (position - chunk * kv.page_size);
    const size_t elem_bytes = a.kv_dtype == OG_KV_F32 ? 4 : a.kv_dtype == OG_KV_BF16 ? 2 : 1;
    char *k_row = kv.k + block_offset + row * hd * elem_bytes;
    char *v_row = kv.v + block_offset + row * hd * elem_bytes;
    float *k_scale = kv.k_scales ? reinterpret_cast<float *>(kv.k_scales + block_offset) + row : nullptr;
    float *v_scale = kv.v_scales ? reinterpret_cast<float *>(kv.v_scales + block_offset) + row : nullptr;
    store_cache_row(head, hd, a.kv_dtype, k_row, k_scale, scratch);
    __syncthreads();  // head[] is reused for v
    const float *v_src = a.qkv + q_size + kv_size + (size_t)kv_head * hd;
    for (int i = threadIdx.x; i < hd; i += kRopeThreads) head[i] = v_src[i];
    __syncthreads();
    store_cache_row(head, hd, a.kv_dtype, v_row, v_scale, scratch);
}

}  // namespace

void rope_inv_freq(int head_dim, double theta, double linear_factor, float *inv_freq) {
    // Same steps as runtime/reference.py: float64 power, cast, then an fp32 division.
    const float factor = (float)linear_factor;
    for (int i = 0; i < head_dim / 2; ++i) {
        const double exponent = (double)(2 * i) / (double)head_dim;
        inv_freq[i] = (float)(1.0 / pow(theta, exponent)) / factor;
    }
}

cudaError_t launch_qk_norm_rope_kv(const RopeKvArgs &args, cudaStream_t stream, bool pdl) {
    if (args.head_dim <= 0 || args.head_dim > kMaxHeadDim || args.head_dim % 2 != 0 ||
        args.kv.page_size <= 0)
        return cudaErrorInvalidValue;
    const dim3 grid(args.n_heads + args.n_kv_heads), block(kRopeThreads);
    return launch_kernel(qk_norm_rope_kv_kernel, grid, block, 0, stream, pdl, args);
}

}  // namespace og
