// argmax.cu — the greedy next token on the device: the argmax of the logits [V], by numpy's
// rule (the lowest index among equal maxima; a NaN counts as larger than every number, so the
// first NaN wins). A step whose output is the next token (og_set_output) then copies one
// NextToken (8 bytes) to the host instead of the logits' 4V bytes (608 KB for Qwen3's 151,936
// ids), and the host does no argmax of its own.
//
// One launch, two levels (per row y of the launch's rows, grid y): block b reduces the slice [b * per_block, (b + 1) * per_block) to
// one candidate (value, index); the last block to finish (a ticket counter, which that block
// resets for the next step) reduces the candidates. "Before" below is a total order on the
// candidates, so the result depends neither on which block finishes last nor on the order in
// which the candidates meet.
#include <climits>

#include "kernels.cuh"

namespace og {
namespace {

constexpr int kArgmaxThreads = 256;
constexpr int kArgmaxPerBlock = 2048;  // logits a block reduces (8 a thread), at least

// Does candidate a come before candidate b? (NaN first, then larger values, then lower ids.)
__device__ __forceinline__ bool argmax_before(float av, int ai, float bv, int bi) {
    const bool a_nan = av != av, b_nan = bv != bv;
    if (a_nan != b_nan) return a_nan;
    if (!a_nan && av != bv) return av > bv;
    return ai < bi;
}

// The block's first candidate, in every thread. An empty candidate is (-inf, INT_MAX): any
// logit, -inf included, comes before it.
__device__ __forceinline__ void block_argmax(float &value, int &index, float *scratch_value,
                                             int *scratch_index) {
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    constexpr int kWarps = kArgmaxThreads / kWarpSize;
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
        const float v = __shfl_xor_sync(kFullMask, value, offset);
        const int i = __shfl_xor_sync(kFullMask, index, offset);
        if (argmax_before(v, i, value, index)) value = v, index = i;
    }
    if (lane == 0) scratch_value[warp] = value, scratch_index[warp] = index;
    __syncthreads();
    value = scratch_value[0];
    index = scratch_index[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w)
        if (argmax_before(scratch_value[w], scratch_index[w], value, index))
            value = scratch_value[w], index = scratch_index[w];
}

__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_kernel(const float *__restrict__ logits, int n, int64_t ld, NextToken *partials,
                  unsigned *ticket, NextToken *out) {
    __shared__ float scratch_value[kArgmaxThreads / kWarpSize];
    __shared__ int scratch_index[kArgmaxThreads / kWarpSize];
    __shared__ bool last;
    pdl_wait();  // the logits come from the lm_head GEMV
    pdl_launch_dependents();
    // Row y: its logits, candidates, ticket and result.
    logits += blockIdx.y * ld;
    partials += (size_t)blockIdx.y * gridDim.x;
    ticket += blockIdx.y;
    out += blockIdx.y;
    const int per_block = ceil_div(n, gridDim.x);
    const int begin = blockIdx.x * per_block, end = min(n, begin + per_block);
    float value = -INFINITY;
    int index = INT_MAX;
#pragma unroll 4
    for (int i = begin + threadIdx.x; i < end; i += kArgmaxThreads) {
        const float v = logits[i];
        if (argmax_before(v, i, value, index)) value = v, index = i;
    }
    block_argmax(value, index, scratch_value, scratch_index);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = NextToken{index, value};
        __threadfence();  // the candidate is visible before the ticket says so
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    value = -INFINITY;
    index = INT_MAX;
    for (int b = threadIdx.x; b < (int)gridDim.x; b += kArgmaxThreads) {
        const float v = __ldcg(&partials[b].logit);
        const int i = __ldcg(&partials[b].token);
        if (argmax_before(v, i, value, index)) value = v, index = i;
    }
    __syncthreads();  // scratch is reused
    block_argmax(value, index, scratch_value, scratch_index);
    if (threadIdx.x == 0) {
        *out = NextToken{index, value};
        *ticket = 0u;
    }
}

}  // namespace

int argmax_partials(int n) {
    const int blocks = ceil_div(n, kArgmaxPerBlock);
    return blocks < 1 ? 1 : blocks < kArgmaxMaxBlocks ? blocks : kArgmaxMaxBlocks;
}

cudaError_t launch_argmax_rows(const float *logits, int n, int rows, int64_t ld, NextToken *partials,
                               unsigned *tickets, NextToken *out, cudaStream_t stream, bool pdl) {
    if (logits == nullptr || n < 1 || rows < 1 || (rows > 1 && ld < n) || partials == nullptr ||
        tickets == nullptr || out == nullptr)
        return cudaErrorInvalidValue;
    return launch_kernel(argmax_kernel, dim3(argmax_partials(n), rows), dim3(kArgmaxThreads), 0, stream,
                         pdl, logits, n, ld, partials, tickets, out);
}

cudaError_t launch_argmax(const float *logits, int n, NextToken *partials, unsigned *ticket, NextToken *out,
                          cudaStream_t stream, bool pdl) {
    return launch_argmax_rows(logits, n, 1, n, partials, ticket, out, stream, pdl);
}

}  // namespace og
