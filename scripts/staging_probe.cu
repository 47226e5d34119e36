// staging_probe.cu — where a block's staging of its input after the PDL wait spends its cycles,
// warp by warp.
//
// Why: broadcast_probe.cu has a block of 8 warps staging a 576-float vector (one 16-byte load a
// thread) in about 1,100 SM cycles, and latency_probe.cu one dependent L2 load right after the
// wait in about 330: the first load after the wait is an ordinary L2 hit. This probe splits the
// staging: every warp's lane 0 reads the SM clock when its wait returns (t0), when its loads have
// arrived (t1), when its squares are summed over the warp and stored (t2) and after the block's
// barrier and sum (t3). Per block, relative to the block's first t0: the spread of the warps' wait
// returns, the warps' load times, and the block's end of staging. Arms: every warp stages its
// share (the library's stage_x), or warp 0 stages everything while the others wait at the
// barrier. The chain, the vectors and the writes are broadcast_probe's (one copy).
//
// nvcc -arch=sm_90 -O3 -std=c++17 -o /tmp/staging_probe scripts/staging_probe.cu
// /tmp/staging_probe [--iters N] [--json PATH]
#include <cstdint>

#include "probe_common.cuh"

using probe::pdl_launch_dependents;
using probe::pdl_wait;

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kKernels = 150;
constexpr int kMaxN = 4096;
constexpr int kClocks = 4;

struct Params {
    const float *in;     // vector k [n]
    float *out;          // vector k + 1
    long long *clocks;   // [grid][kWarps][kClocks], or null
    int n, one_warp;
};

// The clock, read only after v is computed (an empty asm that takes v keeps the order).
__device__ __forceinline__ long long clock_after(float v) {
    asm volatile("" ::"f"(v));
    return clock64();
}

// Float4s first, first + step, ... (S of them, all in flight at once) of x4 into xs; their
// squares summed into sq. Returns the clock when the loads have arrived.
template <int S>
__device__ __forceinline__ long long stage(const float4 *x4, int n4, int first, int step, float4 *xs, float &sq) {
    float4 v[S];
#pragma unroll
    for (int k = 0; k < S; ++k) {
        const int i = first + k * step;
        v[k] = i < n4 ? x4[i] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int k = 0; k < S; ++k)
        sq = fmaf(v[k].x, v[k].x, fmaf(v[k].y, v[k].y, fmaf(v[k].z, v[k].z, fmaf(v[k].w, v[k].w, sq))));
    const long long t = clock_after(sq);
#pragma unroll
    for (int k = 0; k < S; ++k) {
        const int i = first + k * step;
        if (i < n4) xs[i] = v[k];
    }
    return t;
}

__global__ void __launch_bounds__(kThreads, 1) stage_kernel(Params p) {
    __shared__ float4 xs[kMaxN / 4];
    __shared__ float sums[kWarps];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    pdl_wait();
    pdl_launch_dependents();
    const long long t0 = clock64();
    const float4 *x4 = reinterpret_cast<const float4 *>(p.in);
    const int n4 = p.n / 4;
    float sq = 0.f;
    long long t1 = t0;
    if (!p.one_warp) {
        t1 = stage<kMaxN / 4 / kThreads>(x4, n4, threadIdx.x, kThreads, xs, sq);
    } else if (warp == 0) {
        t1 = stage<1024 / 4 / 32>(x4, n4, lane, 32, xs, sq);   // one warp: vectors up to 1,024 floats
    }
    sq = probe::warp_sum(sq);
    if (lane == 0) sums[warp] = sq;
    const long long t2 = clock_after(sq);
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += sums[w];
    const long long t3 = clock_after(total);
    if (lane == 0 && p.clocks) {
        long long *c = p.clocks + ((size_t)blockIdx.x * kWarps + warp) * kClocks;
        c[0] = t0;
        c[1] = t1;
        c[2] = t2;
        c[3] = t3;
    }
    // This block's share of the next vector (element i by block i % grid); bounded values.
    const float scale = rsqrtf(total / (float)p.n + 1e-6f);
    const float *xsf = reinterpret_cast<const float *>(xs);
    for (int i = blockIdx.x + gridDim.x * threadIdx.x; i < p.n; i += gridDim.x * kThreads)
        p.out[i] = 0.5f * xsf[i] * scale + 0.25f;
}

// Medians over the blocks of: the last warp's wait return, the median warp's load time and the
// last warp's, the last warp's sum stored, the block's staging done; all cycles after the block's
// first wait return.
struct Result {
    int n, grid;
    bool one_warp;
    double us_kernel;
    long long wait_spread, load_median, load_last, summed_last, done;
};

long long median(std::vector<long long> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

Result run_case(cudaStream_t stream, float *buf, long long *clocks, int n, int grid, bool one_warp, int iters) {
    constexpr int kTraced = kKernels / 2;
    const cudaGraphExec_t ge = probe::capture_graph(stream, [&](cudaStream_t st) {
        for (int k = 0; k < kKernels; ++k) {
            Params p{buf + (k % 2) * kMaxN, buf + ((k + 1) % 2) * kMaxN, k == kTraced ? clocks : nullptr, n,
                     one_warp ? 1 : 0};
            probe::launch_chained(stage_kernel, grid, kThreads, st, k > 0, p);
        }
    });
    const float ms = probe::ms_per_replay(ge, stream, iters);
    CK(cudaGraphExecDestroy(ge));
    std::vector<long long> c((size_t)grid * kWarps * kClocks);
    CK(cudaMemcpy(c.data(), clocks, c.size() * sizeof(long long), cudaMemcpyDeviceToHost));
    std::vector<long long> spread, load_med, load_last, summed, done;
    for (int b = 0; b < grid; ++b) {
        const long long *cb = c.data() + (size_t)b * kWarps * kClocks;
        long long first = cb[0], last_wait = cb[0], last_load = 0, last_sum = 0;
        std::vector<long long> loads;
        for (int w = 0; w < kWarps; ++w) {
            first = std::min(first, cb[w * kClocks]);
            last_wait = std::max(last_wait, cb[w * kClocks]);
        }
        for (int w = 0; w < kWarps; ++w) {
            const long long *cw = cb + w * kClocks;
            if (!one_warp || w == 0) loads.push_back(cw[1] - cw[0]);
            last_load = std::max(last_load, cw[1] - first);
            last_sum = std::max(last_sum, cw[2] - first);
        }
        spread.push_back(last_wait - first);
        load_med.push_back(median(loads));
        load_last.push_back(last_load);
        summed.push_back(last_sum);
        done.push_back(cb[3] - first);
    }
    return {n, grid, one_warp, ms * 1e3 / kKernels, median(spread), median(load_med), median(load_last),
            median(summed), median(done)};
}

}  // namespace

int main(int argc, char **argv) {
    int iters = 200;
    const char *json = nullptr;
    if (!probe::parse_iters_json(argc, argv, iters, json)) return 2;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    float *buf;
    long long *clocks;
    CK(cudaMalloc(&buf, 2 * kMaxN * sizeof(float)));
    CK(cudaMemset(buf, 0, 2 * kMaxN * sizeof(float)));
    CK(cudaMalloc(&clocks, (size_t)2 * sms * kWarps * kClocks * sizeof(long long)));
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    printf("staging_probe on %s (%d SMs): %d chained kernels a graph (PDL), %d threads a block, %d replays;\n"
           "SM cycles after a block's first wait return, medians over the blocks\n",
           prop.name, sms, kKernels, kThreads, iters);
    printf("%6s %5s %9s %10s %12s %12s %12s %12s %12s\n", "N", "grid", "staging", "us/kernel", "wait spread",
           "load (warp)", "loads done", "sums stored", "staged");
    std::vector<Result> results;
    for (int n : {576, 1024, 4096}) {
        for (int grid : {sms, 2 * sms}) {
            for (bool one_warp : {false, true}) {
                if (one_warp && n > 1024) continue;
                const Result r = run_case(stream, buf, clocks, n, grid, one_warp, iters);
                printf("%6d %5d %9s %10.3f %12lld %12lld %12lld %12lld %12lld\n", n, grid,
                       one_warp ? "warp 0" : "all warps", r.us_kernel, r.wait_spread, r.load_median, r.load_last,
                       r.summed_last, r.done);
                results.push_back(r);
            }
        }
    }
    if (json && !probe::write_cases_json(json, prop, kKernels, iters, results, [](FILE *f, const Result &r) {
            fprintf(f,
                    "\"n\": %d, \"grid\": %d, \"staging\": \"%s\", \"us_per_kernel\": %.4f, \"wait_spread\": %lld, "
                    "\"load_warp_median\": %lld, \"loads_done\": %lld, \"sums_stored\": %lld, \"staged\": %lld",
                    r.n, r.grid, r.one_warp ? "warp0" : "all", r.us_kernel, r.wait_spread, r.load_median,
                    r.load_last, r.summed_last, r.done);
        }))
        return 1;
    CK(cudaStreamDestroy(stream));
    CK(cudaFree(buf));
    CK(cudaFree(clocks));
    return 0;
}
