// embed.cu — embedding gather, the first kernel of the body.
//
//   x[i] = float(table[token, i]),  i < hidden
//   table: [vocab, padded_cols(hidden)] bf16; token read from the device step record, or for a
//   chained step (OG_TOKEN_PREVIOUS_ARGMAX) from the previous step's argmax on the device.
//
// One thread per 8 columns (one 16-byte load); the pad columns are read but not written.
#include "kernels.cuh"

namespace og {
namespace {

constexpr int kEmbedThreads = 128;

__global__ void __launch_bounds__(kEmbedThreads)
    embedding_kernel(const __nv_bfloat16 *__restrict__ table, int vocab, int hidden,
                     const og_step_record *__restrict__ step, const NextToken *previous,
                     float *__restrict__ x) {
    pdl_wait();
    pdl_launch_dependents();
    const int chunk = blockIdx.x * kEmbedThreads + threadIdx.x;
    const int col = chunk * 8;
    if (col >= hidden) return;
    int token = step->token;
    if (token == OG_TOKEN_PREVIOUS_ARGMAX && previous != nullptr) token = __ldcg(&previous->token);
    if (token < 0 || token >= vocab) {
        // Unreachable through og_begin_step; make a bad record visible, never read out of range.
        for (int k = 0; k < 8 && col + k < hidden; ++k) x[col + k] = __int_as_float(0x7fc00000);
        return;
    }
    const size_t ld = (size_t)padded_cols(hidden);
    const uint4 w = *reinterpret_cast<const uint4 *>(table + (size_t)token * ld + col);
    const float v[8] = {bf16_lo(w.x), bf16_hi(w.x), bf16_lo(w.y), bf16_hi(w.y),
                        bf16_lo(w.z), bf16_hi(w.z), bf16_lo(w.w), bf16_hi(w.w)};
    if (col + 8 <= hidden) {
        float4 *dst = reinterpret_cast<float4 *>(x + col);
        dst[0] = make_float4(v[0], v[1], v[2], v[3]);
        dst[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k)
            if (col + k < hidden) x[col + k] = v[k];
    }
}

}  // namespace

cudaError_t launch_embedding(const __nv_bfloat16 *table, int vocab, int hidden,
                             const og_step_record *step, const NextToken *previous, float *x,
                             cudaStream_t stream, bool pdl) {
    const int chunks = ceil_div(hidden, 8);
    const int grid = ceil_div(chunks, kEmbedThreads);
    return launch_kernel(embedding_kernel, dim3(grid), dim3(kEmbedThreads), 0, stream, pdl,
                         table, vocab, hidden, step, previous, x);
}

}  // namespace og
