// rope_kv_testing.cu — per-head QK-norm, rotary embedding and the KV-cache write as a standalone
// kernel (testing library only: og_test_qk_norm_rope_kv and its paged form).
//
//   qkv:   [n_heads*hd | n_kv*hd | n_kv*hd] fp32, the fused QKV GEMV's output
//   grid:  n_heads + n_kv blocks of one warp; block b < n_heads owns query head b, block
//          n_heads + h owns KV head h (its k and its v)
//   query head:  q = rope(rmsnorm(q) * q_norm)             written back in place
//   KV head:     k = rope(rmsnorm(k) * k_norm), v as is    stored at row `position` of the
//                sequence, in block step->row_block of the paged pool (kernels.cuh, KvPages):
//                row kv_head * page + position % page of the layer's K and V pages there
//   table:       the first KV head's block also stores step->row_block into the sequence's
//                block-table entry position / page (when table_update is set)
//
// The arithmetic is rope_kv.cuh's, which the decode body runs inside its attention kernel
// (attention.cu): the two produce the same bits, so this kernel is the reference the fused
// prologue is tested against. A warp per head: a head is at most 256 values.
#include "kernels.cuh"
#include "rope_kv.cuh"

namespace og {
namespace {

__global__ void __launch_bounds__(kWarpSize) qk_norm_rope_kv_kernel(const RopeKvArgs a) {
    __shared__ float head[kMaxHeadDim];
    __shared__ float4 row_bytes_s[kMaxHeadDim * 4 / 16];  // the encoded row (unused here)
    __shared__ float scale_s;
    const int lane = threadIdx.x;
    const int hd = a.head_dim;
    const int q_size = a.n_heads * hd;
    const int kv_size = a.n_kv_heads * hd;
    const bool is_query = (int)blockIdx.x < a.n_heads;
    const int kv_head = (int)blockIdx.x - a.n_heads;
    // The norm weights, the RoPE table and the step record (written before the body's first
    // kernel) do not depend on the previous kernel.
    const int position = a.step->position;
    const float *norm_w = is_query ? a.q_norm : a.k_norm;
    float w[kHeadSlots];
    norm_weights(norm_w, hd, lane, w);
    RopeAngles angles;
    rope_angles(a.inv_freq, hd, position, lane, angles);
    pdl_wait();
    pdl_launch_dependents();

    float *src = is_query ? a.qkv + (size_t)blockIdx.x * hd : a.qkv + q_size + (size_t)kv_head * hd;
    warp_norm_rope(src, norm_w != nullptr, w, a.eps, angles, hd, head, lane);
    if (is_query) {
        for (int i = lane; i < hd; i += kWarpSize) src[i] = head[i];
        return;
    }
    // Unreachable through og_begin_step's checks; never write outside the pool.
    const KvPages &kv = a.kv;
    const int block = a.step->row_block;
    if (position < 0 || position >= a.max_seq_len || block < 0 || block >= kv.n_blocks) return;
    const int chunk = position / kv.page_size;
    if (a.table_update != nullptr && kv_head == 0 && lane == 0)
        a.table_update[(size_t)a.step->seq_slot * kv.max_blocks_per_seq + chunk] = block;

    warp_store_kv_row(kv, a.kv_dtype, block, position, kv_head, hd, head,
                      a.qkv + q_size + kv_size + (size_t)kv_head * hd, row_bytes_s, &scale_s, lane);
}

}  // namespace

cudaError_t launch_qk_norm_rope_kv(const RopeKvArgs &args, cudaStream_t stream, bool pdl) {
    if (args.head_dim <= 0 || args.head_dim > kMaxHeadDim || args.head_dim % 2 != 0 ||
        args.kv.page_size <= 0)
        return cudaErrorInvalidValue;
    const dim3 grid(args.n_heads + args.n_kv_heads), block(kWarpSize);
    return launch_kernel(qk_norm_rope_kv_kernel, grid, block, 0, stream, pdl, args);
}

}  // namespace og
