// kv_blocks.cu — block operations on the paged KV pool: zeroing a list of blocks.
//
//   pool:     [n_blocks, block_stride] bytes; a block packs several segments (every layer's
//             K page, V page and, for int8, K and V scale pages) at fixed offsets
//   segment:  {offset_bytes, page_bytes}; page_bytes <= block_stride - offset_bytes
//   zeroing:  for every listed block b and every segment s, the bytes
//             [b * block_stride + s.offset, b * block_stride + s.offset + s.page_bytes)
//
// The start of a block's page steps by the block stride, not by the page size: with packed
// blocks the page is smaller than the block, so stepping by the page would land inside
// other segments and, for the last block, past the end of the pool (the bug of seed 001).
// Only pages are cleared; padding between segments is never touched.
//
// Grid: a grid-stride loop over (block, segment) pairs, one CUDA block per pair at a time;
// its threads store 16-byte words over the 16-byte-aligned middle of the page and single
// bytes over the unaligned head and tail (pages of any alignment, e.g. the seed's int32
// page at a 12-byte offset).
#include "kernels.cuh"

namespace og {
namespace {

constexpr int kZeroThreads = 256;
constexpr int kZeroMaxGrid = 4096;

__device__ __forceinline__ void zero_bytes(char *p, int64_t n) {
    const int64_t head = min(n, (int64_t)((16 - ((uintptr_t)p & 15)) & 15));
    for (int64_t i = threadIdx.x; i < head; i += kZeroThreads) p[i] = 0;
    uint4 *words = reinterpret_cast<uint4 *>(p + head);
    const int64_t n_words = (n - head) >> 4;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int64_t i = threadIdx.x; i < n_words; i += kZeroThreads) words[i] = zero;
    char *tail = p + head + (n_words << 4);
    const int64_t rest = n - head - (n_words << 4);
    for (int64_t i = threadIdx.x; i < rest; i += kZeroThreads) tail[i] = 0;
}

__global__ void __launch_bounds__(kZeroThreads) zero_blocks_kernel(const ZeroBlocksArgs a) {
    const int64_t pairs = (int64_t)a.n_ids * a.n_segments;
    for (int64_t w = blockIdx.x; w < pairs; w += gridDim.x) {
        const int id_index = (int)(w / a.n_segments);
        const int seg = (int)(w - (int64_t)id_index * a.n_segments);
        const int32_t block = a.block_ids[id_index];
        if (block < 0 || block >= a.n_blocks) continue;  // the host validates; never write outside
        const KvSegment s = a.segments[seg];
        zero_bytes(a.base + (int64_t)block * a.block_stride + s.offset_bytes, s.page_bytes);
    }
}

}  // namespace

cudaError_t launch_zero_blocks(const ZeroBlocksArgs &args, cudaStream_t stream) {
    if (args.n_ids < 0 || args.n_segments < 0 || args.block_stride < 0) return cudaErrorInvalidValue;
    const int64_t pairs = (int64_t)args.n_ids * args.n_segments;
    if (pairs == 0) return cudaSuccess;
    const int grid = (int)(pairs < kZeroMaxGrid ? pairs : kZeroMaxGrid);
    return launch_kernel(zero_blocks_kernel, dim3(grid), dim3(kZeroThreads), 0, stream, false,
                         args);
}

}  // namespace og
