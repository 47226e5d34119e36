// latency_probe.cu — how long one load takes right after a PDL wait, against the same kind of
// load before it, and what the difference is made of.
//
// Why: broadcast_probe.cu found that a block staging a vector the kernel before it wrote takes
// 1,000-1,400 SM cycles whatever the copies, the blocks an SM or the vector's length: a latency,
// not a queue. One L2 hit is a few hundred cycles. This probe times single dependent loads (thread
// 0 of every block, each load's address depending on the previous load's value, the clock read
// after the value is used) in a chain of K kernels:
//   before the wait  far_fresh   a line of another allocation, on a 2 MB page this kernel's
//                                predecessor did not touch (kernel k reads page k)
//                    near        a line 1 MB after the vectors, in their allocation, never written
//   after the wait   new_1       a line of the vector the kernel before wrote
//                    new_2       another line of that vector
//                    near_2      another never-written line beside the vectors
//                    far_same    another line of the page far_fresh read (its translation warm)
//                    far_other   a line of a page no kernel near this one reads
// All of them are L2 hits from the second replay on (2.5 MB of lines in all). The kernel's
// blocks then write their share of the next vector, as a GEMV writes its rows: element i by
// block i % grid (interleaved) or a contiguous range a block (chunked). Arms: with PDL (the
// library's chain) and without (each kernel starts after the one before ends).
//
// nvcc -arch=sm_90 -O3 -std=c++17 -o /tmp/latency_probe scripts/latency_probe.cu
// /tmp/latency_probe [--iters N] [--json PATH]
#include <cstdint>

#include "probe_common.cuh"

using probe::pdl_launch_dependents;
using probe::pdl_wait;

namespace {

constexpr int kThreads = 256;
constexpr int kKernels = 150;
constexpr int kWords = 1024;                 // the vector: 4 KB, 32 lines
constexpr size_t kPageWords = (2u << 20) / 4;
constexpr size_t kNearOffsetWords = (1u << 20) / 4;
constexpr int kLineWords = 32;
constexpr int kPoints = 7;
const char *const kPointNames[kPoints] = {"far_fresh", "near", "new_1", "new_2", "near_2", "far_same", "far_other"};

struct Params {
    const unsigned *in;     // vector k [kWords]
    unsigned *out;          // vector k + 1
    const unsigned *near;   // kNearOffsetWords after the vectors' base: never written in the chain
    const unsigned *far;    // [kKernels] pages of kPageWords
    long long *cycles;      // [grid][kPoints], or null
    int kernel, chunked;
};

__device__ __forceinline__ unsigned load_cg(const unsigned *p) {
    unsigned v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// One timed load: its address depends on the value the previous load returned (dep is 0 unless a
// value equals the never-stored magic), and the clock is read only after the value is used.
__device__ __forceinline__ long long timed(const unsigned *p, unsigned &dep) {
    const long long t0 = clock64();
    const unsigned v = load_cg(p + dep);
    asm volatile("add.u32 %0, %0, %1;" : "+r"(dep) : "r"(v == 0x9e3779b9u ? 1u : 0u));
    return clock64() - t0;
}

__global__ void __launch_bounds__(kThreads, 1) chain_kernel(Params p) {
    long long c[kPoints];
    unsigned dep = 0;
    const int b = blockIdx.x;
    const size_t page = (size_t)p.kernel * kPageWords;
    const size_t other = (size_t)((p.kernel + kKernels / 2) % kKernels) * kPageWords;
    const size_t line = (size_t)b * kLineWords;   // a block's own lines: 132-396 of a page's 16,384
    if (threadIdx.x == 0) {
        c[0] = timed(p.far + page + line, dep);
        c[1] = timed(p.near + line, dep);
    }
    pdl_wait();
    pdl_launch_dependents();
    if (threadIdx.x == 0) {
        c[2] = timed(p.in + (b % (kWords / kLineWords)) * kLineWords, dep);
        c[3] = timed(p.in + ((b + 16) % (kWords / kLineWords)) * kLineWords, dep);
        c[4] = timed(p.near + (size_t)gridDim.x * kLineWords + line, dep);
        c[5] = timed(p.far + page + (size_t)gridDim.x * kLineWords + line, dep);
        c[6] = timed(p.far + other + 2 * (size_t)gridDim.x * kLineWords + line, dep);
        if (p.cycles) {
            for (int k = 0; k < kPoints; ++k) p.cycles[(size_t)b * kPoints + k] = c[k];
        }
    }
    // The block's share of the next vector (dep keeps thread 0's loads).
    const int g = gridDim.x;
    if (p.chunked) {
        const int per = (kWords + g - 1) / g;
        for (int i = b * per + threadIdx.x; i < min(kWords, (b + 1) * per); i += kThreads) p.out[i] = i + dep;
    } else {
        for (int i = b + g * threadIdx.x; i < kWords; i += g * kThreads) p.out[i] = i + dep;
    }
}

struct Result {
    int grid;
    bool pdl, chunked;
    double us_kernel;
    long long median[kPoints], largest[kPoints];
};

Result run_case(cudaStream_t stream, unsigned *vecs, const unsigned *far, long long *cycles, int grid, bool pdl,
                bool chunked, int iters) {
    constexpr int kTraced = kKernels / 2;
    const cudaGraphExec_t ge = probe::capture_graph(stream, [&](cudaStream_t st) {
        for (int k = 0; k < kKernels; ++k) {
            Params p{vecs + (k % 2) * kWords, vecs + ((k + 1) % 2) * kWords, vecs + kNearOffsetWords, far,
                     k == kTraced ? cycles : nullptr, k, chunked ? 1 : 0};
            probe::launch_chained(chain_kernel, grid, kThreads, st, pdl && k > 0, p);
        }
    });
    const float ms = probe::ms_per_replay(ge, stream, iters);
    CK(cudaGraphExecDestroy(ge));
    std::vector<long long> cyc((size_t)grid * kPoints);
    CK(cudaMemcpy(cyc.data(), cycles, cyc.size() * sizeof(long long), cudaMemcpyDeviceToHost));
    Result r{grid, pdl, chunked, ms * 1e3 / kKernels, {}, {}};
    for (int k = 0; k < kPoints; ++k) {
        std::vector<long long> v(grid);
        for (int b = 0; b < grid; ++b) v[b] = cyc[(size_t)b * kPoints + k];
        std::sort(v.begin(), v.end());
        r.median[k] = v[grid / 2];
        r.largest[k] = v.back();
    }
    return r;
}

}  // namespace

int main(int argc, char **argv) {
    int iters = 200;
    const char *json = nullptr;
    if (!probe::parse_iters_json(argc, argv, iters, json)) return 2;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    unsigned *vecs, *far;
    long long *cycles;
    CK(cudaMalloc(&vecs, kPageWords * sizeof(unsigned)));
    CK(cudaMemset(vecs, 0, kPageWords * sizeof(unsigned)));
    CK(cudaMalloc(&far, kKernels * kPageWords * sizeof(unsigned)));
    CK(cudaMemset(far, 0, kKernels * kPageWords * sizeof(unsigned)));
    CK(cudaMalloc(&cycles, (size_t)3 * sms * kPoints * sizeof(long long)));
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    printf("latency_probe on %s (%d SMs): %d chained kernels a graph, %d replays; SM cycles of one "
           "dependent L2-only load (median over the blocks, largest in brackets)\n",
           prop.name, sms, kKernels, iters);
    printf("%5s %4s %12s %10s", "grid", "PDL", "writes", "us/kernel");
    for (int k = 0; k < kPoints; ++k) printf(" %16s", kPointNames[k]);
    printf("\n");
    std::vector<Result> results;
    for (int grid : {sms, 2 * sms, 3 * sms}) {
        for (bool pdl : {true, false}) {
            for (bool chunked : {false, true}) {
                const Result r = run_case(stream, vecs, far, cycles, grid, pdl, chunked, iters);
                printf("%5d %4s %12s %10.3f", grid, pdl ? "yes" : "no", chunked ? "chunked" : "interleaved",
                       r.us_kernel);
                for (int k = 0; k < kPoints; ++k) printf(" %7lld (%6lld)", r.median[k], r.largest[k]);
                printf("\n");
                results.push_back(r);
            }
        }
    }
    if (json && !probe::write_cases_json(json, prop, kKernels, iters, results, [](FILE *f, const Result &r) {
            fprintf(f, "\"grid\": %d, \"pdl\": %s, \"writes\": \"%s\", \"us_per_kernel\": %.4f", r.grid,
                    r.pdl ? "true" : "false", r.chunked ? "chunked" : "interleaved", r.us_kernel);
            for (int k = 0; k < kPoints; ++k)
                fprintf(f, ", \"%s\": [%lld, %lld]", kPointNames[k], r.median[k], r.largest[k]);
        }))
        return 1;
    CK(cudaStreamDestroy(stream));
    CK(cudaFree(vecs));
    CK(cudaFree(far));
    CK(cudaFree(cycles));
    return 0;
}
