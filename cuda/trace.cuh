// trace.cuh — pieces shared by the diagnostic trace build (build.py --trace, -DOG_Q4_TRACE;
// scripts/q4_trace.py): the per-block clock and SM id, and the host side that reads and clears
// a ring of records (a __device__ array and its __device__ counter, in the including file).
#pragma once
#if defined(OG_Q4_TRACE) && !defined(OG_TESTING)
#error "the trace build is a testing build: build.py --trace defines OG_TESTING too"
#endif
#ifdef OG_Q4_TRACE
#include <cuda_runtime.h>

namespace og {

__device__ __forceinline__ unsigned long long trace_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// %globaltimer read only once the 32-bit word `word` (a register a load fills) has arrived: the
// read is predicated on a test of the word, so it cannot be issued before the load completes.
__device__ __forceinline__ unsigned long long trace_now_after(unsigned word) {
    unsigned long long t;
    asm volatile(
        "{ .reg .pred p; setp.ne.u32 p, %1, 0x9e3779b9; @p mov.u64 %0, %%globaltimer;"
        " @!p mov.u64 %0, 1; }"
        : "=l"(t)
        : "r"(word));
    return t;
}
__device__ __forceinline__ int trace_sm() {
    int s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}

// A GEMV block's record (the q4 and bf16 kernels): the launch's weight pointer identifies the
// launch; the block's start, the PDL wait's return, the q4 input's quantization (the bf16
// kernel: its staging), the staged input, its last warp's end and (the bf16 kernel; 0 elsewhere)
// when thread 0's first weights, loaded before the wait, had arrived, in %globaltimer ns; then
// thread 0's SM clock (clock64: cycles, finer than %globaltimer's steps) at its wait's return,
// past the staging and at its warp's end.
struct GemvTraceRecord {
    unsigned long long weight, t_start, t_wait, t_quant, t_staged, t_end, t_weights;
    long long c_wait, c_staged, c_end;
    int mode, rows, cols, block, sm, warps;
};
constexpr unsigned kGemvTraceRecords = 1u << 16;

// Copy up to max_records of the ring's records (the newest N if it wrapped) to `records`;
// returns how many, or -1 on a CUDA error.
template <typename Record, unsigned N>
int trace_ring_read(const Record (&ring)[N], const unsigned &count_symbol, void *records, int max_records) {
    unsigned count = 0;
    if (cudaDeviceSynchronize() != cudaSuccess ||
        cudaMemcpyFromSymbol(&count, count_symbol, sizeof count) != cudaSuccess)
        return -1;
    int n = (int)(count < N ? count : N);
    if (n > max_records) n = max_records;
    if (cudaMemcpyFromSymbol(records, ring, (size_t)n * sizeof(Record)) != cudaSuccess) return -1;
    return n;
}
inline int trace_ring_reset(const unsigned &count_symbol) {
    const unsigned zero = 0;
    return cudaMemcpyToSymbol(count_symbol, &zero, sizeof zero) == cudaSuccess ? 0 : -1;
}

}  // namespace og

// A GEMV kernel's trace points (the q4 and bf16 kernels), recording into `ring` (a
// GemvTraceRecord ring of kGemvTraceRecords, its counter `count`). The kernel names its
// parameters p, its mode MODE, its warps per block WARPS and its lane `lane`. The record slot
// is taken by GEMV_TRACE_SLOT just before the PDL wait, while the block waits anyway (after the
// staging its round trip would count in the staging's figure) and after the weight loads are
// issued: thread 0 waits for the atomic's result (every block's goes to one counter), and at the
// start its warp would issue its loads only after that. GEMV_TRACE_QUANTIZED marks the end of
// the q4 input's quantization; a kernel without one marks it at its staging.
#define GEMV_TRACE_START()                                     \
    const unsigned long long trace_start = trace_now();        \
    __shared__ unsigned trace_slot
#define GEMV_TRACE_SLOT(count) \
    if (threadIdx.x == 0) trace_slot = atomicAdd(&count, 1u) % kGemvTraceRecords
#define GEMV_TRACE_WAITED()                              \
    const unsigned long long trace_wait = trace_now(); \
    const long long trace_c_wait = clock64()
#define GEMV_TRACE_QUANTIZED() const unsigned long long trace_quant = trace_now()
#define GEMV_TRACE_STAGED(ring) TRACE_STAGED_AS(ring, p.weight, MODE, p.rows, p.cols, WARPS)
// The same record for a kernel with other names for its launch's identity and shape (moe.cu).
#define TRACE_STAGED_AS(ring, weight, mode, rows, cols, warps)                                         \
    if (threadIdx.x == 0) {                                                                            \
        ring[trace_slot] = GemvTraceRecord{(unsigned long long)(weight), trace_start, trace_wait,      \
                                           trace_quant, trace_now(), 0ull, 0ull, trace_c_wait,         \
                                           clock64(), 0ll, (mode), (rows), (cols),                     \
                                           (int)blockIdx.x, trace_sm(), (warps)};                      \
    }                                                                                                  \
    __syncthreads()
// Thread 0's first weights (`word`: a register its pre-wait loads fill) arrived, after the staging.
#define GEMV_TRACE_WEIGHTS(ring, word) \
    if (threadIdx.x == 0) ring[trace_slot].t_weights = trace_now_after(word)
// Thread 0 reads its clock before its atomic, so that c_end does not count the atomic's issue.
#define GEMV_TRACE_END(ring)                                                 \
    if (threadIdx.x == 0) ring[trace_slot].c_end = clock64();                \
    if (lane == 0) atomicMax(&ring[trace_slot].t_end, trace_now())

// The trace build's two readers of a ring, og_<name>_trace_read and og_<name>_trace_reset (no
// header: scripts/q4_trace.py calls them through ctypes); at file scope, after the ring.
#define OG_TRACE_READERS(name, ring, count)                                                                  \
    extern "C" __attribute__((visibility("default"))) int og_##name##_trace_read(void *records, int max_records) { \
        return og::trace_ring_read(ring, count, records, max_records);                                         \
    }                                                                                                          \
    extern "C" __attribute__((visibility("default"))) int og_##name##_trace_reset(void) {                       \
        return og::trace_ring_reset(count);                                                                    \
    }
#else
#define GEMV_TRACE_START() (void)0
#define GEMV_TRACE_SLOT(count) (void)0
#define GEMV_TRACE_WAITED() (void)0
#define GEMV_TRACE_QUANTIZED() (void)0
#define GEMV_TRACE_STAGED(ring) (void)0
#define GEMV_TRACE_WEIGHTS(ring, word) (void)0
#define TRACE_STAGED_AS(ring, weight, mode, rows, cols, warps) (void)0
#define GEMV_TRACE_END(ring) (void)0
#endif
