// coop_pdl_probe.cu — can a kernel be launched both cooperative (all blocks resident at once, so
// a barrier across blocks cannot deadlock) and with PDL (programmatic stream serialization),
// inside a captured graph, and does its part before griddepcontrol.wait still overlap the
// kernel before it? Kernel A spins 20 µs on every SM; kernel B (one 512-thread block per SM,
// room beside A's) records its start, its wait's return and its pass through a barrier on a
// global counter. Standalone (not part of the library):
//   nvcc -arch=sm_90 -O2 -o /tmp/coop_pdl_probe scripts/coop_pdl_probe.cu && /tmp/coop_pdl_probe
// Results on an H200: docs/journal.md (twelfth session).
#include <cstdio>
#include <cuda_runtime.h>

__device__ __forceinline__ unsigned long long now() {
    unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t;
}
struct Rec { unsigned long long a_start, a_end, b_start, b_wait, b_sync; };

__global__ void kernel_a(Rec *r, int spin_ns, int stagger_ns) {
    unsigned long long t0 = now();
    if (threadIdx.x == 0) r[blockIdx.x].a_start = t0;
    asm volatile("griddepcontrol.launch_dependents;");
    while (now() - t0 < (unsigned long long)(spin_ns + stagger_ns * blockIdx.x)) {}
    __syncthreads();
    if (threadIdx.x == 0) r[blockIdx.x].a_end = now();
}
__global__ void kernel_b(Rec *r, unsigned *counter, unsigned target) {
    unsigned long long t0 = now();
    asm volatile("griddepcontrol.wait;" ::: "memory");
    unsigned long long t1 = now();
    // a grid barrier on a counter: only safe when every block is resident (cooperative)
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counter, 1u);
        while (atomicAdd(counter, 0u) < target) {}
    }
    __syncthreads();
    if (threadIdx.x == 0) { r[blockIdx.x].b_start = t0; r[blockIdx.x].b_wait = t1; r[blockIdx.x].b_sync = now(); }
}

static void check(cudaError_t e, const char *what) {
    if (e != cudaSuccess) { printf("%s: %s\n", what, cudaGetErrorString(e)); }
}

// smem_bytes: dynamic shared memory of each kernel's blocks; above half an SM's, a block of B
// cannot sit beside a block of A. stagger_ns: A's block i spins i * stagger_ns longer.
int run(bool coop, bool pdl, bool graph, int blocks_b, int smem_bytes = 0, int stagger_ns = 0) {
    Rec *r; unsigned *counter;
    int sms = 0; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaMalloc(&r, sizeof(Rec) * 1024); cudaMemset(r, 0, sizeof(Rec) * 1024);
    cudaMalloc(&counter, 4); cudaMemset(counter, 0, 4);
    cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaGraph_t g = nullptr; cudaGraphExec_t ge = nullptr;
    if (graph) check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "begin capture");
    if (smem_bytes > 48 * 1024) {
        cudaFuncSetAttribute(kernel_a, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
        cudaFuncSetAttribute(kernel_b, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    }
    kernel_a<<<sms, 512, smem_bytes, s>>>(r, 20000, stagger_ns);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks_b); cfg.blockDim = dim3(512); cfg.stream = s; cfg.dynamicSmemBytes = smem_bytes;
    cudaLaunchAttribute attrs[2]; int n = 0;
    if (pdl) { attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization; attrs[n].val.programmaticStreamSerializationAllowed = 1; ++n; }
    if (coop) { attrs[n].id = cudaLaunchAttributeCooperative; attrs[n].val.cooperative = 1; ++n; }
    cfg.attrs = attrs; cfg.numAttrs = n;
    cudaError_t le = cudaLaunchKernelEx(&cfg, kernel_b, r, counter, (unsigned)blocks_b);
    printf("coop=%d pdl=%d graph=%d blocks_b=%d smem=%d stagger=%d: launch %s\n", coop, pdl, graph, blocks_b,
           smem_bytes, stagger_ns, cudaGetErrorString(le));
    if (graph) {
        check(cudaStreamEndCapture(s, &g), "end capture");
        if (g) check(cudaGraphInstantiate(&ge, g, 0), "instantiate");
        if (ge) { check(cudaGraphLaunch(ge, s), "graph launch"); }
    }
    check(cudaStreamSynchronize(s), "sync");
    Rec h[1024]; cudaMemcpy(h, r, sizeof(Rec) * 1024, cudaMemcpyDeviceToHost);
    unsigned long long base = ~0ull, a_end = 0, a_first_end = ~0ull, b_first = ~0ull, b_last_start = 0, b_wait_min = ~0ull, b_sync_max = 0;
    for (int i = 0; i < sms; ++i) { if (h[i].a_start && h[i].a_start < base) base = h[i].a_start; if (h[i].a_end > a_end) a_end = h[i].a_end;
                                  if (h[i].a_end && h[i].a_end < a_first_end) a_first_end = h[i].a_end; }
    for (int i = 0; i < blocks_b; ++i) {
        if (!h[i].b_start) continue;
        if (h[i].b_start < b_first) b_first = h[i].b_start;
        if (h[i].b_start > b_last_start) b_last_start = h[i].b_start;
        if (h[i].b_wait < b_wait_min) b_wait_min = h[i].b_wait;
        if (h[i].b_sync > b_sync_max) b_sync_max = h[i].b_sync;
    }
    auto us = [&](unsigned long long t) { return t ? (double)(t - base) / 1e3 : -1.0; };
    printf("  A first end %.2f, last end %.2f | B first start %.2f, last start %.2f, first wait return %.2f, last past barrier %.2f\n",
           us(a_first_end), us(a_end), us(b_first), us(b_last_start), us(b_wait_min), us(b_sync_max));
    if (ge) cudaGraphExecDestroy(ge);
    if (g) cudaGraphDestroy(g);
    cudaStreamDestroy(s); cudaFree(r); cudaFree(counter);
    cudaGetLastError();
    return 0;
}

int main() {
    int sms = 0; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    for (int graph = 0; graph < 2; ++graph) {
        run(false, true, graph, sms);        // PDL only (the body today), no co-residency promise
        run(true, false, graph, sms);        // cooperative only
        run(true, true, graph, sms);         // both
    }
    // B cannot sit beside A (each block takes over half an SM's shared memory) and A's blocks
    // end over 132 * 50 ns = 6.6 µs: does a cooperative B wait for A's last block?
    for (int coop = 0; coop < 2; ++coop) run(coop, true, true, sms, 160 * 1024, 50);
    return 0;
}
