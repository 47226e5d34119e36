// conditional_probe.cu — what does it cost a layer to let one captured graph pick a kernel by
// the context length (say, an attention kernel for short caches and another for long ones), set
// on the device each token, against a chain of kernels with programmatic dependent launch (PDL)?
// Standalone experiment, not part of the library.
//
//   build: nvcc -arch=sm_90 -O3 -std=c++17 -o /tmp/conditional_probe scripts/conditional_probe.cu
//   run:   /tmp/conditional_probe [--layers 30] [--iters 300]
//
// A "layer" is three dependent kernels: pre (a stand-in for the QKV projection), attention, post
// (the O projection). Each kernel is the calibrated boundary of the persistent probe: grid = SM
// count, 256 threads; it signals its dependents at entry, waits on its predecessor
// (griddepcontrol.wait), reads the previous kernel's output ([SMs] floats) from L2, sums it over
// the block and writes one float a block. The attention step computes sum * 2 for a long cache,
// sum * 3 for a short one, so the output says which one ran. A first kernel (`select`) reads the
// context length from device memory, as the library's first kernel reads the step record, and
// where the variant has conditional nodes sets each layer's condition (cudaGraphSetConditional).
// Variants, one graph of `layers` layers each, captured from a stream:
//   pdl          pre, attention, post with the PDL attribute; the attention kernel reads the
//                length and multiplies by 2 or 3 itself (one kernel serving both: today's body)
//   pdl_both     pre, attention_long, attention_short, post, all PDL: each attention kernel works
//                only for its own kind of cache and otherwise waits on its predecessor and ends
//                (it must wait: a kernel that ends before its predecessor would let the next
//                kernel's wait return early)
//   if_else      pre (PDL), an IF/ELSE conditional node (its two bodies each one attention
//                kernel), post launched without PDL (an edge from a conditional node is a full
//                dependency)
//   switch       the same with a SWITCH node of two bodies
//   if_else_pdl  as if_else, but post launched with the PDL attribute, to see what capture does
//                with a programmatic edge after a conditional node (reported if refused)
// Each runs with a short and a long cache (the length in device memory, changed between
// replays). Prints µs a layer per variant and cache, the difference against `pdl`, whether the
// output equals `pdl`'s for the same cache (bit for bit), and how many of the graph's edges
// capture made programmatic: PASS / FAIL, exit code 1 on FAIL.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "probe_common.cuh"

using probe::elapsed_ms;
using probe::pdl_launch_dependents;
using probe::pdl_wait;

namespace {

constexpr int kThreads = 256;
constexpr int kLongAfter = 4096;  // a cache longer than this takes the "long" kernel
constexpr int kMaxLayers = 128;

// Sum of in[0..n) over the block (fixed order: each thread strided, then a tree), times factor,
// written to out[blockIdx.x].
__device__ void step_body(const float *in, float *out, int n, float factor) {
    __shared__ float part[kThreads];
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += kThreads) s += __ldcg(in + i);
    part[threadIdx.x] = s;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = part[0] * factor * (1.f / 1024.f) + (float)blockIdx.x;
}

__global__ void step_kernel(const float *in, float *out, int n) {
    pdl_launch_dependents();
    pdl_wait();
    step_body(in, out, n, 1.f);
}
// The attention stand-in. kind 0: picks its factor from the length (one kernel for both);
// kind 1: works only for a long cache; kind 2: only for a short one (else waits and ends);
// kind 3 / 4: the long / short kernel as a conditional node's body (no check: a body run for
// the wrong cache gives the wrong output).
__global__ void attention_kernel(const float *in, float *out, int n, const int *ctx, int kind) {
    pdl_launch_dependents();
    const bool long_cache = kind == 3 || (kind != 4 && *ctx > kLongAfter);  // written before the launch
    pdl_wait();
    if ((kind == 1 && !long_cache) || (kind == 2 && long_cache)) return;
    step_body(in, out, n, long_cache ? 2.f : 3.f);
}
// The graph's first kernel: the input, and each layer's condition (value 1: long cache).
__global__ void select_kernel(const float *x_in, float *out, int n, const int *ctx,
                              const cudaGraphConditionalHandle *handles, int n_handles) {
    const unsigned long_cache = *ctx > kLongAfter ? 1u : 0u;
    if (blockIdx.x == 0 && threadIdx.x < n_handles) cudaGraphSetConditional(handles[threadIdx.x], long_cache);
    step_body(x_in, out, n, 1.f);
}

enum Kind { kPdl, kPdlBoth, kIfElse, kSwitch, kIfElsePdl };
const char *kNames[] = {"pdl", "pdl_both", "if_else", "switch", "if_else_pdl"};

struct Bufs {
    float *x_in, *a, *b;   // [sms] each: the chain alternates a -> b -> a ...
    int *ctx;
    cudaGraphConditionalHandle *handles;  // [layers], device copy
    int sms;
};

// One block of kThreads a multiprocessor on stream s; pdl: with the programmatic-serialization
// attribute (attr must outlive the launch).
cudaLaunchConfig_t grid_config(const Bufs &b, cudaStream_t s, bool pdl, cudaLaunchAttribute *attr) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(b.sms);
    cfg.blockDim = dim3(kThreads);
    cfg.stream = s;
    *attr = cudaLaunchAttribute{};
    attr->id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr->val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cfg;
}
cudaError_t launch_step(bool pdl, cudaStream_t s, const Bufs &b, const float *in, float *out) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = grid_config(b, s, pdl, &attr);
    return cudaLaunchKernelEx(&cfg, step_kernel, in, out, b.sms);
}
cudaError_t launch_attention(int kind, bool pdl, cudaStream_t s, const Bufs &b, const float *in, float *out) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = grid_config(b, s, pdl, &attr);
    return cudaLaunchKernelEx(&cfg, attention_kernel, in, out, b.sms, (const int *)b.ctx, kind);
}

#define TRY(call)                                                                        \
    do {                                                                                 \
        const cudaError_t e_ = (call);                                                   \
        if (e_ != cudaSuccess) {                                                         \
            snprintf(why, sizeof why, "%s: %s", #call, cudaGetErrorString(e_));          \
            return e_;                                                                   \
        }                                                                                \
    } while (0)
char why[512];

// Capture the variant's graph. The output of the last kernel is *result.
cudaError_t build(Kind kind, int layers, const Bufs &b, cudaStream_t s, cudaStream_t side, cudaGraph_t *graph_out,
                  cudaGraphExec_t *exec, float **result, int *programmatic_edges) {
    cudaGraph_t graph = nullptr;
    std::vector<cudaGraphConditionalHandle> handles(layers);
    TRY(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    cudaStreamCaptureStatus status;
    cudaGraph_t capturing = nullptr;
    const bool conditional = kind == kIfElse || kind == kSwitch || kind == kIfElsePdl;
    if (conditional) {
        TRY(cudaStreamGetCaptureInfo(s, &status, nullptr, &capturing, nullptr, nullptr, nullptr));
        for (int l = 0; l < layers; ++l) TRY(cudaGraphConditionalHandleCreate(&handles[l], capturing, 0, 0));
    }
    {
        cudaLaunchAttribute attr;
        const cudaLaunchConfig_t cfg = grid_config(b, s, false, &attr);
        TRY(cudaLaunchKernelEx(&cfg, select_kernel, (const float *)b.x_in, b.a, b.sms, (const int *)b.ctx,
                               (const cudaGraphConditionalHandle *)b.handles, conditional ? layers : 0));
    }
    float *cur = b.a, *nxt = b.b;
    auto advance = [&]() { std::swap(cur, nxt); };
    bool after_conditional = false;
    for (int l = 0; l < layers; ++l) {
        TRY(launch_step(!after_conditional, s, b, cur, nxt));
        advance();
        after_conditional = false;
        if (kind == kPdl) {
            TRY(launch_attention(0, true, s, b, cur, nxt));
            advance();
        } else if (kind == kPdlBoth) {
            // Both write nxt; only the one for this cache does, so the output is as one kernel's.
            TRY(launch_attention(1, true, s, b, cur, nxt));
            TRY(launch_attention(2, true, s, b, cur, nxt));
            advance();
        } else {
            const cudaGraphNode_t *deps = nullptr;
            const cudaGraphEdgeData *edges = nullptr;
            size_t n_deps = 0;
            TRY(cudaStreamGetCaptureInfo(s, &status, nullptr, &capturing, &deps, &edges, &n_deps));
            cudaGraphNodeParams p{};
            p.type = cudaGraphNodeTypeConditional;
            p.conditional.handle = handles[l];
            p.conditional.type = kind == kSwitch ? cudaGraphCondTypeSwitch : cudaGraphCondTypeIf;
            p.conditional.size = 2;
            cudaGraphNode_t node;
            TRY(cudaGraphAddNode(&node, capturing, deps, edges, n_deps, &p));
            TRY(cudaStreamUpdateCaptureDependencies(s, &node, nullptr, 1, cudaStreamSetCaptureDependencies));
            // IF: body 0 when the condition is non-zero (long), body 1 otherwise; SWITCH: body n
            // when the condition is n (0 short, 1 long).
            for (int body = 0; body < 2; ++body) {
                const bool long_body = kind == kSwitch ? body == 1 : body == 0;
                TRY(cudaStreamBeginCaptureToGraph(side, p.conditional.phGraph_out[body], nullptr, nullptr, 0,
                                                  cudaStreamCaptureModeRelaxed));
                TRY(launch_attention(long_body ? 3 : 4, false, side, b, cur, nxt));
                cudaGraph_t body_graph;
                TRY(cudaStreamEndCapture(side, &body_graph));
            }
            advance();
            after_conditional = kind != kIfElsePdl;
        }
        TRY(launch_step(!after_conditional, s, b, cur, nxt));
        advance();
        after_conditional = false;
    }
    TRY(cudaStreamEndCapture(s, &graph));
    // The handles' values reach select_kernel through memory written after the capture (a
    // synchronous copy may not run inside one).
    if (conditional)
        TRY(cudaMemcpy(b.handles, handles.data(), sizeof(cudaGraphConditionalHandle) * layers,
                       cudaMemcpyHostToDevice));
    *graph_out = graph;  // destroyed by the caller after the executable graph
    // How many of the top-level graph's edges capture made programmatic (PDL): shows whether a
    // PDL launch after a conditional node kept its overlap or became a full dependency.
    size_t n_edges = 0;
    TRY(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &n_edges));
    std::vector<cudaGraphNode_t> from(n_edges), to(n_edges);
    std::vector<cudaGraphEdgeData> data(n_edges);
    TRY(cudaGraphGetEdges(graph, from.data(), to.data(), data.data(), &n_edges));
    *programmatic_edges = 0;
    for (const cudaGraphEdgeData &e : data) *programmatic_edges += e.type == cudaGraphDependencyTypeProgrammatic;
    TRY(cudaGraphInstantiate(exec, graph, 0));
    *result = cur;
    return cudaSuccess;
}

}  // namespace

int main(int argc, char **argv) {
    int layers = 30, iters = 300;
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--layers") && i + 1 < argc) layers = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--layers N (1-%d)] [--iters N]\n", argv[0], kMaxLayers);
            return 2;
        }
    }
    if (layers < 1 || layers > kMaxLayers || layers > kThreads || iters < 1) {
        fprintf(stderr, "usage: %s [--layers N (1-%d)] [--iters N]\n", argv[0], kMaxLayers);
        return 2;
    }
    int device = 0;
    CK(cudaGetDevice(&device));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, device));
    Bufs b{};
    b.sms = prop.multiProcessorCount;
    CK(cudaMalloc(&b.x_in, b.sms * sizeof(float)));
    CK(cudaMalloc(&b.a, b.sms * sizeof(float)));
    CK(cudaMalloc(&b.b, b.sms * sizeof(float)));
    CK(cudaMalloc(&b.ctx, sizeof(int)));
    CK(cudaMalloc(&b.handles, kMaxLayers * sizeof(cudaGraphConditionalHandle)));
    std::vector<float> x(b.sms);
    for (int i = 0; i < b.sms; ++i) x[i] = (float)((i * 37) % 101) / 7.f;
    CK(cudaMemcpy(b.x_in, x.data(), b.sms * sizeof(float), cudaMemcpyHostToDevice));
    cudaStream_t s, side;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    printf("%s, %d SMs; %d layers of 3 dependent kernels (grid %d x %d), %d replays a figure\n", prop.name, b.sms,
           layers, b.sms, kThreads, iters);
    printf("  %-12s %-6s %10s %12s  %s\n", "variant", "cache", "us/layer", "vs pdl", "output");
    bool ok = true;
    std::vector<float> reference[2];
    double ref_us[2] = {0, 0};
    for (int k = kPdl; k <= kIfElsePdl; ++k) {
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        float *result = nullptr;
        int programmatic = 0;
        // Each variant's handles live in its own graph; b.handles is rewritten after its capture.
        if (build((Kind)k, layers, b, s, side, &graph, &exec, &result, &programmatic) != cudaSuccess) {
            if (graph != nullptr) cudaGraphDestroy(graph);
            for (cudaStream_t t : {side, s}) {  // a capture the failure left open
                cudaStreamCaptureStatus st;
                if (cudaStreamIsCapturing(t, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone) {
                    cudaGraph_t g = nullptr;
                    cudaStreamEndCapture(t, &g);
                    if (g != nullptr && t == s) cudaGraphDestroy(g);
                }
            }
            (void)cudaGetLastError();
            printf("  %-12s not run: %s\n", kNames[k], why);
            if (k != kIfElsePdl) ok = false;  // the last one may legitimately be refused
            continue;
        }
        for (int c = 0; c < 2; ++c) {
            const int ctx = c ? 32768 : 128;
            CK(cudaMemcpy(b.ctx, &ctx, sizeof ctx, cudaMemcpyHostToDevice));
            for (int w = 0; w < 10; ++w) CK(cudaGraphLaunch(exec, s));
            CK(cudaStreamSynchronize(s));
            const double ms = elapsed_ms(s, [&] {
                for (int it = 0; it < iters; ++it) CK(cudaGraphLaunch(exec, s));
            });
            const double us = ms * 1e3 / iters / layers;
            std::vector<float> out(b.sms);
            CK(cudaMemcpy(out.data(), result, b.sms * sizeof(float), cudaMemcpyDeviceToHost));
            bool same = true;
            if (k == kPdl) {
                reference[c] = out;
                ref_us[c] = us;
            } else {
                same = !reference[c].empty() && memcmp(out.data(), reference[c].data(), b.sms * sizeof(float)) == 0;
                ok = ok && same;
            }
            char diff[32] = "-";
            if (k != kPdl) snprintf(diff, sizeof diff, "%+.3f us", us - ref_us[c]);
            printf("  %-12s %-6s %10.3f %12s  %s\n", kNames[k], c ? "long" : "short", us, diff,
                   k == kPdl ? "reference" : same ? "same" : "DIFFERENT");
        }
        printf("  %-12s %d of its edges programmatic\n", kNames[k], programmatic);
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
    }
    printf("\n%s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
}
