// staging_probe.cu — where a block's staging of its input after the PDL wait spends its cycles,
// warp by warp, and how its loads compare with a lone L2 hit.
//
// Why: broadcast_probe.cu has a block of 8 warps staging a 576-float vector (one 16-byte load a
// thread) in about 1,100 SM cycles, and latency_probe.cu one dependent L2 load right after the
// wait in about 330: the first load after the wait is an ordinary L2 hit. This probe splits the
// staging: every warp's lane 0 reads the SM clock when its wait returns (t0), when its loads have
// arrived (t1), when its squares are summed over the warp and stored (t2) and after the block's
// barrier and sum (t3). Per block, relative to the block's first t0: the spread of the warps' wait
// returns, the warps' load times, and the block's end of staging. The chain, the vectors and the
// writes are broadcast_probe's (one copy).
// Arms, each a load kind and a place for the trigger that lets the next kernel launch:
//   load kinds  all      every warp stages its share, 16-byte loads (the library's stage_x)
//               all_cg   the same with L2-only loads (ld.global.cg)
//               warp0    warp 0 stages everything while the others wait at the barrier
//               lane0    lane 0 of each warp loads one float (L2-only), as latency_probe does
//               lane0_pre  the same with the vector's address read from the kernel's parameters
//                        before the wait (latency_probe's is), not after it
//               scalar   each warp loads 32 consecutive floats, 4 bytes a lane (L2-only)
//   trigger     after    griddepcontrol.launch_dependents right after the wait (the library's
//                        GEMVs without a norm; broadcast_probe's and latency_probe's chains)
//               before   before the wait (the library's norm GEMVs)
//               late     after the staging, before the writes
//               none     never (the next kernel launches when this one ends)
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

enum Load { kAll, kAllCg, kWarp0, kLane0, kLane0Pre, kScalar, kLoads };
enum Trigger { kAfter, kBefore, kLate, kNone, kTriggers };
const char *const kLoadNames[kLoads] = {"all", "all_cg", "warp0", "lane0", "lane0_pre", "scalar"};
const char *const kTriggerNames[kTriggers] = {"after", "before", "late", "none"};

struct Params {
    const float *in;     // vector k [n]
    float *out;          // vector k + 1
    long long *clocks;   // [grid][kWarps][kClocks], or null
    int n, trigger;
};

// The clock, read only after v is computed (an empty asm that takes v keeps the order).
__device__ __forceinline__ long long clock_after(float v) {
    asm volatile("" ::"f"(v));
    return clock64();
}

template <bool kL2Only>
__device__ __forceinline__ float4 load4(const float4 *p) {
    return kL2Only ? __ldcg(p) : *p;
}

// Float4s first, first + step, ... (S of them, all in flight at once) of x4 into xs; their
// squares summed into sq. Returns the clock when the loads have arrived.
template <int S, bool kL2Only>
__device__ __forceinline__ long long stage(const float4 *x4, int n4, int first, int step, float4 *xs, float &sq) {
    float4 v[S];
#pragma unroll
    for (int k = 0; k < S; ++k) {
        const int i = first + k * step;
        v[k] = i < n4 ? load4<kL2Only>(x4 + i) : make_float4(0.f, 0.f, 0.f, 0.f);
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

// The load kind is a template parameter: a switch over it at run time would put an indexed
// constant load (its jump table) between the wait and the loads.
template <int LOAD>
__global__ void __launch_bounds__(kThreads, 1) stage_kernel(Params p) {
    __shared__ float4 xs[kMaxN / 4];
    __shared__ float sums[kWarps];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float *in = p.in;
    // lane0_pre: a branch on the address before the wait makes the compiler read it there.
    if (LOAD == kLane0Pre && in == nullptr) return;
    if (p.trigger == kBefore) pdl_launch_dependents();
    pdl_wait();
    if (p.trigger == kAfter) pdl_launch_dependents();
    const long long t0 = clock64();
    const float4 *x4 = reinterpret_cast<const float4 *>(in);
    const int n4 = p.n / 4;
    float sq = 0.f;
    long long t1 = t0;
    if constexpr (LOAD == kAll) {
        t1 = stage<kMaxN / 4 / kThreads, false>(x4, n4, threadIdx.x, kThreads, xs, sq);
    } else if constexpr (LOAD == kAllCg) {
        t1 = stage<kMaxN / 4 / kThreads, true>(x4, n4, threadIdx.x, kThreads, xs, sq);
    } else if constexpr (LOAD == kWarp0) {
        if (warp == 0) t1 = stage<1024 / 4 / 32, false>(x4, n4, lane, 32, xs, sq);  // vectors up to 1,024 floats
    } else if constexpr (LOAD == kLane0 || LOAD == kLane0Pre) {
        if (lane == 0) {
            const float v = __ldcg(in + warp * 32);
            sq = v * v;
            t1 = clock_after(sq);
        }
    } else {
        const float v = __ldcg(in + (warp * 32 + lane) % p.n);
        sq = v * v;
        t1 = clock_after(sq);
    }
    sq = probe::warp_sum(sq);
    if (lane == 0) sums[warp] = sq;
    const long long t2 = clock_after(sq);
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += sums[w];
    const long long t3 = clock_after(total);
    if (p.trigger == kLate) pdl_launch_dependents();
    if (lane == 0 && p.clocks) {
        long long *c = p.clocks + ((size_t)blockIdx.x * kWarps + warp) * kClocks;
        c[0] = t0;
        c[1] = t1;
        c[2] = t2;
        c[3] = t3;
    }
    // This block's share of the next vector (element i by block i % grid); bounded values. The
    // arms that load a few floats stage nothing: their next vector comes from the sum alone.
    const float scale = rsqrtf(total / (float)p.n + 1e-6f);
    constexpr bool staged = LOAD == kAll || LOAD == kAllCg || LOAD == kWarp0;
    const float *xsf = reinterpret_cast<const float *>(xs);
    for (int i = blockIdx.x + gridDim.x * threadIdx.x; i < p.n; i += gridDim.x * kThreads)
        p.out[i] = staged ? 0.5f * xsf[i] * scale + 0.25f : 0.25f + 1e-3f * scale;
}

// Medians over the blocks of: the last warp's wait return, the median warp's load time and the
// last warp's, the last warp's sum stored, the block's staging done; all cycles after the block's
// first wait return.
struct Result {
    int n, grid, load, trigger;
    double us_kernel;
    long long wait_spread, load_median, load_last, summed_last, done;
};

long long median(std::vector<long long> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

Result run_case(cudaStream_t stream, float *buf, long long *clocks, int n, int grid, int load, int trigger,
                int iters) {
    constexpr int kTraced = kKernels / 2;
    void (*const kernels[kLoads])(Params) = {stage_kernel<kAll>,   stage_kernel<kAllCg>,     stage_kernel<kWarp0>,
                                             stage_kernel<kLane0>, stage_kernel<kLane0Pre>, stage_kernel<kScalar>};
    const cudaGraphExec_t ge = probe::capture_graph(stream, [&](cudaStream_t st) {
        for (int k = 0; k < kKernels; ++k) {
            Params p{buf + (k % 2) * kMaxN, buf + ((k + 1) % 2) * kMaxN, k == kTraced ? clocks : nullptr, n,
                     trigger};
            probe::launch_chained(kernels[load], grid, kThreads, st, k > 0, p);
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
            if (cw[1] != cw[0]) loads.push_back(cw[1] - cw[0]);  // warps that loaded: the others keep t1 = t0
            last_load = std::max(last_load, cw[1] - first);
            last_sum = std::max(last_sum, cw[2] - first);
        }
        if (loads.empty()) loads.push_back(0);
        spread.push_back(last_wait - first);
        load_med.push_back(median(loads));
        load_last.push_back(last_load);
        summed.push_back(last_sum);
        done.push_back(cb[3] - first);
    }
    return {n, grid, load, trigger, ms * 1e3 / kKernels, median(spread), median(load_med), median(load_last),
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
    printf("%6s %5s %7s %8s %10s %12s %12s %12s %12s %12s\n", "N", "grid", "load", "trigger", "us/kernel",
           "wait spread", "load (warp)", "loads done", "sums stored", "staged");
    std::vector<Result> results;
    for (int n : {576, 1024, 4096}) {
        for (int load = 0; load < kLoads; ++load) {
            for (int trigger = 0; trigger < kTriggers; ++trigger) {
                if (n == 4096 && (load == kWarp0 || trigger != kAfter)) continue;
                const Result r = run_case(stream, buf, clocks, n, sms, load, trigger, iters);
                printf("%6d %5d %7s %8s %10.3f %12lld %12lld %12lld %12lld %12lld\n", n, sms, kLoadNames[load],
                       kTriggerNames[trigger], r.us_kernel, r.wait_spread, r.load_median, r.load_last,
                       r.summed_last, r.done);
                results.push_back(r);
            }
        }
    }
    if (json && !probe::write_cases_json(json, prop, kKernels, iters, results, [](FILE *f, const Result &r) {
            fprintf(f,
                    "\"n\": %d, \"grid\": %d, \"load\": \"%s\", \"trigger\": \"%s\", \"us_per_kernel\": %.4f, "
                    "\"wait_spread\": %lld, \"load_warp_median\": %lld, \"loads_done\": %lld, \"sums_stored\": %lld, "
                    "\"staged\": %lld",
                    r.n, r.grid, kLoadNames[r.load], kTriggerNames[r.trigger], r.us_kernel, r.wait_spread,
                    r.load_median, r.load_last, r.summed_last, r.done);
        }))
        return 1;
    CK(cudaStreamDestroy(stream));
    CK(cudaFree(buf));
    CK(cudaFree(clocks));
    return 0;
}
