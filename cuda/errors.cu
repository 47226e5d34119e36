// errors.cu — og_last_error's message (one per thread) and the helpers every file reports
// errors through (common.cuh): set_error, cuda_failure, require_device; and two device queries
// the kernels' launchers share.
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <string>

#include "common.cuh"
#include "onegraph.h"

namespace og {

// ---- errors ---------------------------------------------------------------------------
namespace {
thread_local std::string t_last_error;
}

og_status set_error(og_status status, const char *fmt, ...) {
    char buffer[1024];
    va_list args;
    va_start(args, fmt);
    vsnprintf(buffer, sizeof buffer, fmt, args);
    va_end(args);
    t_last_error = buffer;
    return status;
}

og_status cuda_failure(cudaError_t err, const char *what, const char *file, int line) {
    (void)cudaGetLastError();  // clear a non-sticky error so later calls are not blamed
    const char *base = strrchr(file, '/');
    return set_error(err == cudaErrorMemoryAllocation ? OG_E_OUT_OF_MEMORY : OG_E_CUDA,
                     "%s failed: %s (%s:%d)", what, cudaGetErrorString(err),
                     base ? base + 1 : file, line);
}

og_status require_device(void) {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return set_error(OG_E_NO_DEVICE, "no CUDA device: %s", cudaGetErrorString(err));
    }
    if (count <= 0) return set_error(OG_E_NO_DEVICE, "no CUDA device: the driver reports none");
    return OG_OK;
}

cudaError_t allow_dynamic_smem(const void *kernel, size_t smem_bytes) {
    // Both limits (48 KB without opting in, the device's opt-in maximum) cover static plus
    // dynamic shared memory of a block: 48 KB of dynamic memory beside a kernel's own static
    // arrays needs the opt-in too.
    cudaFuncAttributes attrs;
    OG_CUDA_RETURN_IF(cudaFuncGetAttributes(&attrs, kernel));
    if (smem_bytes + attrs.sharedSizeBytes <= 48 * 1024) return cudaSuccess;
    int device = 0, optin = 0;
    OG_CUDA_RETURN_IF(cudaGetDevice(&device));
    OG_CUDA_RETURN_IF(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    const size_t dynamic_limit = (size_t)optin - attrs.sharedSizeBytes;
    if (smem_bytes > dynamic_limit) return cudaErrorInvalidValue;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dynamic_limit);
}

cudaError_t current_sm_count(int *sm_count) {
    int device = 0;
    OG_CUDA_RETURN_IF(cudaGetDevice(&device));
    return cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, device);
}

}  // namespace og

using namespace og;

extern "C" {

OG_API const char *og_last_error(void) { return t_last_error.c_str(); }

// packed_file.c reports its errors through here (declared in packed_file.h).
void og_set_last_error_message(const char *message) {
    t_last_error = message != nullptr ? message : "";
}

}  // extern "C"
