// stream_probe.cu — how fast a decode GEMV's weight stream can read HBM, per access pattern, on the
// qwen3-8b matrices' shapes (bf16, rows x cols). Each pattern reads a fresh copy of the matrix per
// launch (copies laid one after another over more than the L2), launches captured in one graph;
// the rate is the matrix's bytes per launch time. Patterns:
//   linear U       grid-stride 16-byte loads, U in flight a thread, no arithmetic
//   gemv U         the library's bf16 GEMV loop (cuda/gemv_bf16.cu): a warp owns a pair of rows,
//                  lane l reads chunks l, l + 32, ... U a row a step, then its dot products with x
//                  staged in shared memory; the next step's loads wait for this step's arithmetic
//   gemv-db U      the same arithmetic, the loads of a warp's next step (of the same task or the
//                  next) issued before this step's dot products (two register sets)
//   gemv-swiglu U  the gemv loop with the SwiGLU mode's pairs (row i and row rows/2 + i)
// nvcc -arch=sm_90 -O3 -std=c++17 -o /tmp/stream_probe scripts/stream_probe.cu && /tmp/stream_probe
#include <cuda_bf16.h>
#include <cstdint>
#include <cstring>

#include "probe_common.cuh"

using probe::dot8;
using probe::warp_sum;

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

template <int U>
__global__ void __launch_bounds__(kThreads) read_linear(const uint4 *__restrict__ w, size_t n, unsigned *out) {
    const size_t stride = (size_t)gridDim.x * kThreads;
    unsigned acc = 0;
    for (size_t base = blockIdx.x * (size_t)kThreads + threadIdx.x; base < n; base += stride * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const size_t i = base + u * stride;
            v[u] = i < n ? __ldcs(w + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;   // keeps the loads
}

struct Gemv {
    const __nv_bfloat16 *w;
    const float *x;
    float *y;
    int rows, cols, n_tasks;
    bool swiglu;
};

__device__ __forceinline__ void rows_of(const Gemv &p, int task, int &r0, int &r1) {
    if (p.swiglu) {
        r0 = task;
        r1 = task + p.rows / 2;
    } else {
        r0 = 2 * task;
        r1 = min(r0 + 1, p.rows - 1);
    }
}

template <int U>
__device__ __forceinline__ void load(const Gemv &p, int r0, int r1, int base, int n_chunks, uint4 (&a)[U],
                                     uint4 (&b)[U]) {
    const uint4 *w0 = reinterpret_cast<const uint4 *>(p.w + (size_t)r0 * p.cols);
    const uint4 *w1 = reinterpret_cast<const uint4 *>(p.w + (size_t)r1 * p.cols);
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int c = base + u * 32;
        if (c < n_chunks) {
            a[u] = __ldcs(w0 + c);
            b[u] = __ldcs(w1 + c);
        } else {
            a[u] = make_uint4(0, 0, 0, 0);
            b[u] = a[u];
        }
    }
}

template <int U>
__device__ __forceinline__ void fold(const float4 *xs4, int base, int n_chunks, int lane, const uint4 (&a)[U],
                                     const uint4 (&b)[U], float &acc0, float &acc1) {
    const int swap = (lane >> 2) & 1;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int c = base + u * 32;
        if (c < n_chunks) {
            const float4 f = xs4[2 * c + swap], s = xs4[2 * c + 1 - swap];
            const float4 xa = swap ? s : f, xb = swap ? f : s;
            acc0 = dot8(a[u], xa, xb, acc0);
            acc1 = dot8(b[u], xa, xb, acc1);
        }
    }
}

__device__ __forceinline__ void stage(const Gemv &p, float4 *xs4) {
    const float4 *x4 = reinterpret_cast<const float4 *>(p.x);
    for (int i = threadIdx.x; i < p.cols / 4; i += kThreads) xs4[i] = x4[i];
    __syncthreads();
}

// The library's loop (DB = false) or its double-buffered form (DB = true).
template <int U, bool DB>
__global__ void __launch_bounds__(kThreads) gemv(const Gemv p) {
    extern __shared__ float4 xs4[];
    const int lane = threadIdx.x & 31;
    const int n_chunks = p.cols / 8;
    const int steps = (n_chunks + 32 * U - 1) / (32 * U);   // steps a task
    const int task_stride = gridDim.x * kWarps;
    const int first_task = blockIdx.x * kWarps + threadIdx.x / 32;
    uint4 a0[U], b0[U];
    int r0 = 0, r1 = 0;
    if (first_task < p.n_tasks) {
        rows_of(p, first_task, r0, r1);
        load<U>(p, r0, r1, lane, n_chunks, a0, b0);
    }
    stage(p, xs4);
    if (!DB) {
        for (int task = first_task; task < p.n_tasks; task += task_stride) {
            const bool first = task == first_task;
            if (!first) rows_of(p, task, r0, r1);
            float acc0 = 0.f, acc1 = 0.f;
            for (int base = lane; base < n_chunks; base += 32 * U) {
                if (!first || base != lane) load<U>(p, r0, r1, base, n_chunks, a0, b0);
                fold<U>(xs4, base, n_chunks, lane, a0, b0, acc0, acc1);
            }
            acc0 = warp_sum(acc0);
            acc1 = warp_sum(acc1);
            if (lane == 0) p.y[r0] = acc0, p.y[r1] = acc1;
        }
        return;
    }
    // Flat over (task, step): item j's loads go out before item j - 1's dot products.
    uint4 a1[U], b1[U];
    float acc0 = 0.f, acc1 = 0.f;
    int task = first_task, step = 0;
    auto advance = [&](int &t, int &s) {
        if (++s == steps) s = 0, t += task_stride;
    };
    auto finish = [&](int t) {
        int q0, q1;
        rows_of(p, t, q0, q1);
        const float s0 = warp_sum(acc0), s1 = warp_sum(acc1);
        if (lane == 0) p.y[q0] = s0, p.y[q1] = s1;
        acc0 = acc1 = 0.f;
    };
    // The current item's weights are in (a, b): the next item's loads go into (na, nb) first.
    auto item = [&](const uint4 (&a)[U], const uint4 (&b)[U], uint4 (&na)[U], uint4 (&nb)[U]) {
        int nt = task, ns = step;
        advance(nt, ns);
        if (nt < p.n_tasks) {
            int q0, q1;
            rows_of(p, nt, q0, q1);
            load<U>(p, q0, q1, lane + ns * 32 * U, n_chunks, na, nb);
        }
        fold<U>(xs4, lane + step * 32 * U, n_chunks, lane, a, b, acc0, acc1);
        if (step == steps - 1) finish(task);
        task = nt, step = ns;
    };
    while (task < p.n_tasks) {
        item(a0, b0, a1, b1);
        if (task >= p.n_tasks) break;
        item(a1, b1, a0, b0);
    }
}

struct Shape {
    const char *name;
    int rows, cols;
};

}  // namespace

int main(int argc, char **argv) {
    int dev = 0, sms = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const double copy_bw = probe::copy_bandwidth();
    printf("copy bandwidth %.3f TB/s (bytes read + written)\n", copy_bw * 1e-12);
    const Shape shapes[] = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 24576, 4096},
                            {"down", 4096, 12288}, {"lm_head", 151936, 4096}};
    const size_t pool_bytes = 3ull << 30;
    void *pool;
    CK(cudaMalloc(&pool, pool_bytes));
    CK(cudaMemset(pool, 0x3c, pool_bytes));   // bf16 ~0.0115: finite products
    float *x, *y;
    unsigned *sink;
    CK(cudaMalloc(&x, 12288 * sizeof(float)));
    CK(cudaMalloc(&y, 160000 * sizeof(float)));
    CK(cudaMalloc(&sink, 4));
    CK(cudaMemset(x, 0x3c, 12288 * sizeof(float)));   // 0.0115 each
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    for (const Shape &s : shapes) {
        const size_t bytes = (size_t)s.rows * s.cols * 2;
        const int copies = (int)std::max<size_t>(1, std::min<size_t>(16, pool_bytes / bytes));
        const int launches = std::max(8, copies);
        auto run = [&](const char *pattern, auto launch_one) {
            cudaGraphExec_t g = probe::capture_graph(stream, [&](cudaStream_t st) {
                for (int i = 0; i < launches; ++i)
                    launch_one(st, static_cast<const char *>(pool) + (size_t)(i % copies) * bytes);
            });
            CK(cudaGraphLaunch(g, stream));
            std::vector<float> ms;
            for (int r = 0; r < 7; ++r) ms.push_back(probe::elapsed_ms(stream, [&] { CK(cudaGraphLaunch(g, stream)); }));
            std::sort(ms.begin(), ms.end());
            const double us = ms[3] * 1e3 / launches;
            printf("%-8s %-14s %9.2f us %7.3f TB/s %6.1f%% of copy\n", s.name, pattern, us, bytes / (us * 1e-6) * 1e-12,
                   100.0 * bytes / (us * 1e-6) / copy_bw);
            CK(cudaGraphExecDestroy(g));
        };
        auto linear = [&](auto kernel, const char *label) {
            int per_sm = 0;
            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
            run(label, [&](cudaStream_t st, const char *w) {
                kernel<<<per_sm * sms, kThreads, 0, st>>>(reinterpret_cast<const uint4 *>(w), bytes / 16, sink);
                CK(cudaGetLastError());
            });
        };
        linear(read_linear<4>, "linear 4");
        linear(read_linear<8>, "linear 8");
        linear(read_linear<16>, "linear 16");
        std::vector<float> first_y;   // each variant's outputs on copy 0 against the first's
        auto gemv_run = [&](auto kernel, const char *label, bool swiglu) {
            const int smem = s.cols * 4;
            CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
            int per_sm = 0;
            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
            const int tasks = s.rows / 2;
            const int grid = std::min((tasks + kWarps - 1) / kWarps, per_sm * sms);
            run(label, [&](cudaStream_t st, const char *w) {
                Gemv p{reinterpret_cast<const __nv_bfloat16 *>(w), x, y, s.rows, s.cols, tasks, swiglu};
                kernel<<<grid, kThreads, smem, st>>>(p);
                CK(cudaGetLastError());
            });
            CK(cudaMemsetAsync(y, 0xff, s.rows * sizeof(float), stream));
            Gemv p{reinterpret_cast<const __nv_bfloat16 *>(pool), x, y, s.rows, s.cols, tasks, swiglu};
            kernel<<<grid, kThreads, smem, stream>>>(p);
            CK(cudaGetLastError());
            std::vector<float> out(s.rows);
            CK(cudaMemcpyAsync(out.data(), y, s.rows * sizeof(float), cudaMemcpyDeviceToHost, stream));
            CK(cudaStreamSynchronize(stream));
            if (first_y.empty()) first_y = out;
            if (memcmp(out.data(), first_y.data(), out.size() * sizeof(float)) != 0)
                printf("%-8s %-14s OUTPUTS DIFFER from the first variant's\n", s.name, label);
        };
        gemv_run(gemv<8, false>, "gemv 8", false);
        gemv_run(gemv<12, false>, "gemv 12", false);
        gemv_run(gemv<4, true>, "gemv-db 4", false);
        gemv_run(gemv<8, true>, "gemv-db 8", false);
        if (s.rows == 24576) {
            gemv_run(gemv<8, false>, "gemv-swiglu 8", true);
            gemv_run(gemv<8, true>, "gemv-swiglu-db 8", true);
        }
    }
    CK(cudaDeviceSynchronize());
    printf("done\n");
    return 0;
}
