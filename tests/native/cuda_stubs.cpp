// cuda_stubs.cpp — the CUDA runtime entry points cuda/kv_pool.cu uses, on host memory, for
// tests/native/kv_pool_host.cu. g_fail_memcpy = 1 makes the next copy fail.
#include <cstring>
#include <cuda_runtime_api.h>
int g_fail_memcpy = 0;
extern "C" {
void **__cudaRegisterFatBinary(void *) { static void *h; return &h; }
void __cudaRegisterFatBinaryEnd(void **) {}
void __cudaUnregisterFatBinary(void **) {}
char __cudaInitModule(void **) { return 0; }
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind, cudaStream_t) {
    if (g_fail_memcpy) { g_fail_memcpy = 0; return cudaErrorInvalidValue; }
    memmove(dst, src, n); return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
}

