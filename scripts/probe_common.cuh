// probe_common.cuh — what the standalone probes (scripts/*_probe.cu) share: on the host the CUDA
// error check that ends the program, event timing, a stream's work captured as a graph, the copy
// bandwidth they quote rates against, and a comma list of integers from the command line; for the
// chain probes (broadcast, latency, staging: graphs of kernels chained by programmatic dependent
// launch) the launch, the replay timing, the command line and the JSON; on the device the
// programmatic-dependent-launch instructions and a bf16 GEMV's arithmetic as the library's kernel
// does it (cuda/gemv_bf16.cu).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(call)                                                                                   \
    do {                                                                                           \
        const cudaError_t err_ = (call);                                                           \
        if (err_ != cudaSuccess) {                                                                 \
            fprintf(stderr, "CUDA error: %s\n  at %s:%d: %s\n", #call, __FILE__, __LINE__,         \
                    cudaGetErrorString(err_));                                                     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

namespace probe {

// ms between two events on `stream` around what work() enqueues there.
template <class Work>
float elapsed_ms(cudaStream_t stream, Work work) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventRecord(e0, stream));
    work();
    CK(cudaEventRecord(e1, stream));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return ms;
}

// What enqueue(stream) enqueues, captured and instantiated as one graph.
template <class Enqueue>
cudaGraphExec_t capture_graph(cudaStream_t stream, Enqueue enqueue) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    enqueue(stream);
    CK(cudaStreamEndCapture(stream, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphDestroy(g));
    return ge;
}

// kernel<<<grid, block, 0, stream>>>(args...), with programmatic dependent launch when pdl: the
// kernel may start before the one before it on the stream ends, and waits for it with pdl_wait().
template <class... Params, class... Args>
void launch_chained(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, bool pdl,
                    Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// ms a replay of ge over iters replays on stream, after 20 to warm up.
inline float ms_per_replay(cudaGraphExec_t ge, cudaStream_t stream, int iters) {
    for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(ge, stream));
    return elapsed_ms(stream, [&] {
               for (int i = 0; i < iters; ++i) CK(cudaGraphLaunch(ge, stream));
           }) / iters;
}

// The chain probes' command line, [--iters N] [--json PATH]; false (after the usage line) on
// anything else.
inline bool parse_iters_json(int argc, char **argv, int &iters, const char *&json) {
    for (int i = 1; i < argc; ++i) {
        if (std::string(argv[i]) == "--iters" && i + 1 < argc) iters = atoi(argv[++i]);
        else if (std::string(argv[i]) == "--json" && i + 1 < argc) json = argv[++i];
        else {
            printf("usage: %s [--iters N] [--json PATH]\n", argv[0]);
            return false;
        }
    }
    return true;
}

// The chain probes' JSON: {"device", "sms", "kernels", "replays", "cases": [...]}, one case an
// element of results, its fields written by row(f, result). False (and a line) where path cannot
// be written.
template <class Result, class Row>
bool write_cases_json(const char *path, const cudaDeviceProp &prop, int kernels, int replays,
                      const std::vector<Result> &results, Row row) {
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "cannot write %s\n", path);
        return false;
    }
    fprintf(f, "{\"device\": \"%s\", \"sms\": %d, \"kernels\": %d, \"replays\": %d, \"cases\": [\n", prop.name,
            prop.multiProcessorCount, kernels, replays);
    for (size_t i = 0; i < results.size(); ++i) {
        fprintf(f, "  {");
        row(f, results[i]);
        fprintf(f, "}%s\n", i + 1 < results.size() ? "," : "");
    }
    fprintf(f, "]}\n");
    fclose(f);
    return true;
}

// Device-to-device copy bandwidth, bytes read + written, over a 1 GiB copy.
inline double copy_bandwidth() {
    const size_t bytes = 1ull << 30;
    void *src, *dst;
    CK(cudaMalloc(&src, bytes));
    CK(cudaMalloc(&dst, bytes));
    CK(cudaMemset(src, 1, bytes));
    CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, 0));
    const int reps = 5;
    const float ms = elapsed_ms(0, [&] {
        for (int i = 0; i < reps; ++i) CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, 0));
    });
    CK(cudaFree(src));
    CK(cudaFree(dst));
    return 2.0 * bytes * reps / (ms * 1e-3);
}

// Programmatic dependent launch: wait for the kernel before (its writes are then visible), and
// let the kernel after launch.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// bf16 halves of a 32-bit word as fp32.
__device__ __forceinline__ float bf_lo(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(unsigned v) { return __uint_as_float(v & 0xffff0000u); }
// acc + 8 bf16 weights . 8 fp32 inputs, in order.
__device__ __forceinline__ float dot8(uint4 w, float4 a, float4 b, float acc) {
    acc = __fmaf_rn(bf_lo(w.x), a.x, acc);
    acc = __fmaf_rn(bf_hi(w.x), a.y, acc);
    acc = __fmaf_rn(bf_lo(w.y), a.z, acc);
    acc = __fmaf_rn(bf_hi(w.y), a.w, acc);
    acc = __fmaf_rn(bf_lo(w.z), b.x, acc);
    acc = __fmaf_rn(bf_hi(w.z), b.y, acc);
    acc = __fmaf_rn(bf_lo(w.w), b.z, acc);
    acc = __fmaf_rn(bf_hi(w.w), b.w, acc);
    return acc;
}
// Butterflies: every lane ends with the same value (a + b == b + a), in every warp alike.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// "64,512" -> {64, 512}; an empty item reads as 0.
inline std::vector<int> parse_ints(const std::string &list) {
    std::vector<int> out;
    for (size_t p = 0; p <= list.size();) {
        const size_t q = std::min(list.find(',', p), list.size());
        out.push_back(atoi(list.substr(p, q - p).c_str()));
        p = q + 1;
    }
    return out;
}

}  // namespace probe
