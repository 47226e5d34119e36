// common.cuh — shared pieces of the onegraph CUDA library: size helpers, bf16 unpacking,
// deterministic warp/block reductions, programmatic-dependent-launch (PDL) hooks, a launch
// helper, and the host-side error reporting used by every file (errors.cu defines it).
//
// Conventions of the library:
//   - Weight matrices are bf16, row-major [rows, ld] with ld = round_up(cols, 8): every row
//     starts 16-byte aligned and the pad columns hold zeros.
//   - Activations are fp32, accumulation is fp32, reductions run in a fixed order so a
//     result is bit-identical run to run (no float atomics anywhere).
//   - Per-token values (token id, position) are read on the device from og_step_record.
//   - Every launcher takes a cudaStream_t and returns the cudaError_t of the launch.
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stddef.h>
#include <stdint.h>

#include "onegraph.h"

namespace og {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Matrix rows are padded to a multiple of this many bf16 elements (16 bytes).
constexpr int kRowAlignElems = 8;

__host__ __device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ __forceinline__ int64_t round_up(int64_t a, int64_t b) {
    return (a + b - 1) / b * b;
}
// Elements per stored row of a bf16 matrix with `cols` columns.
__host__ __device__ __forceinline__ int padded_cols(int cols) {
    return (int)round_up(cols, kRowAlignElems);
}

// ---- weight matrices ------------------------------------------------------------------
// A weight matrix on the device in one of the OG_WEIGHTS_* formats; row layouts and scales in
// quant.cuh. The one description of a matrix for every consumer: the decode GEMVs, the MoE
// experts (E matrices stacked row-wise: rows = E * rows per expert) and prefill's GEMMs. The
// bytes belong to the engine's arena; kernels only read them.
struct WeightMatrix {
    const void *data = nullptr;    // [rows, row bytes(format, cols)]
    const void *scales = nullptr;  // bf16: none; int8: [rows] fp32; q4: [rows, ceil(cols / 32)] e5m3
    int format = OG_WEIGHTS_BF16;
    int64_t rows = 0;
    int cols = 0;
};

// ---- bf16 ---------------------------------------------------------------------------
// A 32-bit word holds two bf16 values; the element at the lower address is the low half.
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) {
    return __uint_as_float(((uint32_t)b) << 16);
}

// ---- reductions (fixed order: deterministic) ------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
    return v;
}
// Sum over the block of NT threads; every thread gets the same value. scratch holds
// NT/32 floats. Begins and ends with a barrier so scratch can be reused right away.
template <int NT>
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    static_assert(NT % kWarpSize == 0, "block size must be a multiple of 32");
    v = warp_sum(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < NT / kWarpSize; ++w) total += scratch[w];
    __syncthreads();
    return total;
}
template <int NT>
__device__ __forceinline__ float block_max(float v, float *scratch) {
    v = warp_max(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = scratch[0];
#pragma unroll
    for (int w = 1; w < NT / kWarpSize; ++w) total = fmaxf(total, scratch[w]);
    __syncthreads();
    return total;
}

// ---- programmatic dependent launch ----------------------------------------------------
// Every kernel calls pdl_wait() before it touches memory an earlier kernel writes (or
// reads), so with or without the PDL launch attribute the stream order is kept. With the
// attribute, a kernel's launch and the work before pdl_wait() (loading its first weights)
// overlap the tail of the previous kernel. Without it both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// The wait, and the next kernel's launch. kEarly (the GEMVs that norm their input): the next
// kernel may launch before this one waits. After the QKV projection that is the attention
// kernel, whose work before its own wait (the step record, the block table, the K/V rows of
// earlier steps: a chain of dependent loads) reads nothing this kernel or the one before writes;
// after the router and the lm_head, the top-k and the argmax / sampling kernels, which do nothing
// before their wait. A successor's pdl_wait() still waits for this kernel, which waits for the
// one before.
template <bool kEarly>
__device__ __forceinline__ void pdl_wait_then_launch() {
    if constexpr (kEarly) pdl_launch_dependents();
    pdl_wait();
    if constexpr (!kEarly) pdl_launch_dependents();
}

// ---- cp.async (sm_80+): global -> shared without registers ------------------------------
__device__ __forceinline__ uint32_t smem_address(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared; src_bytes = 0 fills the destination with zeros (src not read).
__device__ __forceinline__ void cp_async_16(void *dst, const void *src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)),
                 "l"(src), "r"(src_bytes)
                 : "memory");
}
// 4 bytes global -> shared at address dst (smem_address; src 4-byte aligned), the first src_bytes (0, 2 or 4) of them read,
// the rest zero-filled.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst),
                 "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Launch `kernel` with the PDL attribute when pdl is true; returns the launch status.
template <typename... KernelArgs, typename... Args>
inline cudaError_t launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                                 size_t smem_bytes, cudaStream_t stream, bool pdl,
                                 Args &&...args) {
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem_bytes;
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = pdl ? attribute : nullptr;
    config.numAttrs = pdl ? 1 : 0;
    cudaError_t err = cudaLaunchKernelEx(&config, kernel, static_cast<Args &&>(args)...);
    if (err != cudaSuccess) return err;
    return cudaGetLastError();
}

// Raise a kernel's dynamic shared-memory limit when it needs more than the default 48 KB
// (smem_bytes plus the kernel's static arrays); the engine's plans and moe.cu's launchers.
// The limit is set to the device's opt-in maximum so that engines of different shapes
// never lower each other's limit.
cudaError_t allow_dynamic_smem(const void *kernel, size_t smem_bytes);

// Number of multiprocessors of the current device.
cudaError_t current_sm_count(int *sm_count);

// ---- host-side error reporting (errors.cu) -------------------------------------------
// Record a printf-style message as this thread's og_last_error() and return status.
og_status set_error(og_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
// Record "<what> failed: <cuda error string> (<file>:<line>)", clear the non-sticky CUDA
// error, and return OG_E_OUT_OF_MEMORY for allocation failures, OG_E_CUDA otherwise.
og_status cuda_failure(cudaError_t err, const char *what, const char *file, int line);
// OG_OK when a CUDA device is usable, else OG_E_NO_DEVICE with the driver's reason.
og_status require_device(void);

}  // namespace og

// Check a CUDA call inside a function returning og_status.
#define OG_CUDA_TRY(call)                                                              \
    do {                                                                               \
        cudaError_t og_err_ = (call);                                                  \
        if (og_err_ != cudaSuccess) return ::og::cuda_failure(og_err_, #call, __FILE__, \
                                                              __LINE__);               \
    } while (0)

// Check a CUDA call inside a launcher returning cudaError_t.
#define OG_CUDA_RETURN_IF(call)                  \
    do {                                         \
        cudaError_t og_err_ = (call);            \
        if (og_err_ != cudaSuccess) return og_err_; \
    } while (0)
