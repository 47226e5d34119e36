// icache_probe.cu — what straight-line code costs when an SM's instruction cache does not hold it.
// A decode step runs each of a layer's kernels once per SM per layer, one warp or two per
// scheduler, so every instruction on its critical path is fetched again unless the cache kept it.
//
//   nvcc -O3 -arch=sm_90 -o /tmp/icache_probe scripts/icache_probe.cu && /tmp/icache_probe
//
// One warp per SM sub-partition (a block of 128 threads per SM) runs a body of N FFMAs (8 independent
// chains: about one a cycle once fetched) twice in a row, clock64 around each pass; cycles a
// FFMA, averaged over the warps. K kernels of N FFMAs each (different code) launched in turn show
// whether one kernel's code survives the others' (the K = 2 and 4 rows).
#include <cstdio>
#include <vector>
#include <cuda_runtime.h>

template <int N, int K = 0>
__global__ void __launch_bounds__(128) body(float *out, long long *cycles, float seed) {
    float a[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) a[i] = seed + threadIdx.x + i;
    long long t[3];
#pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {
        __syncwarp();
        t[pass] = clock64();
#pragma unroll
        for (int i = 0; i < N; ++i) a[i & 7] = fmaf(a[i & 7], 1.0001f + K * 0.0001f, (float)(i & 15) * 0.5f);
        __syncwarp();
        t[pass + 1] = clock64();
        if (a[0] == 12345.f) seed += 1.f;  // keep the pass
    }
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) s += a[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if ((threadIdx.x & 31) == 0) {
        const int w = blockIdx.x * 4 + threadIdx.x / 32;
        cycles[2 * w] = t[1] - t[0];
        cycles[2 * w + 1] = t[2] - t[1];
    }
}

// K kernels of N FFMAs each (different code), launched in turn, three rounds: the first pass of
// kernel 0 in each round after its other K - 1 ran.
template <int N, int K>
void run(float *out, long long *d_cycles, int blocks) {
    std::vector<long long> h(2 * blocks * 4);
    for (int rep = 0; rep < 3; ++rep) {
        if (K > 1) body<N, 1><<<blocks, 128>>>(out, d_cycles, 1.f);
        if (K > 2) body<N, 2><<<blocks, 128>>>(out, d_cycles, 1.f);
        if (K > 3) body<N, 3><<<blocks, 128>>>(out, d_cycles, 1.f);
        body<N, 0><<<blocks, 128>>>(out, d_cycles, 1.f);
        cudaMemcpy(h.data(), d_cycles, sizeof(long long) * h.size(), cudaMemcpyDeviceToHost);
        double c0 = 0, c1 = 0;
        for (int w = 0; w < blocks * 4; ++w) c0 += h[2 * w], c1 += h[2 * w + 1];
        c0 /= blocks * 4; c1 /= blocks * 4;
        printf("K=%d x N=%5d FFMAs (%6d B of code) round %d: first pass %7.0f cycles (%.2f a FFMA), second %7.0f (%.2f)\n",
               K, N, K * N * 16, rep, c0, c0 / N, c1, c1 / N);
    }
}

int main() {
    float *out; long long *cyc;
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaMalloc(&out, sms * 128 * 4); cudaMalloc(&cyc, 2 * sms * 4 * 8);
    run<512, 1>(out, cyc, sms);
    run<2048, 1>(out, cyc, sms);
    run<3072, 1>(out, cyc, sms);
    run<4096, 1>(out, cyc, sms);
    run<6144, 1>(out, cyc, sms);
    run<1024, 2>(out, cyc, sms);
    run<1024, 4>(out, cyc, sms);
    run<2048, 2>(out, cyc, sms);
    run<2048, 4>(out, cyc, sms);
    run<4096, 2>(out, cyc, sms);
    cudaError_t e = cudaDeviceSynchronize();
    printf("%s\n", cudaGetErrorString(e));
}
