// moe.cu — the mixture-of-experts FFN of one Qwen3-MoE decode step (batch 1), on the GPU.
//
// What it computes, for one token whose normed hidden state is x_normed [H] fp32:
//   launch_moe_topk:    p = softmax(router_logits [E]) in fp32; the top_k largest p in
//                       descending order (ties -> lower expert index) -> selected_experts
//                       [top_k] int32, selected_weights [top_k] fp32 (divided by their sum,
//                       summed in selection order, when norm_topk_prob).
//   launch_moe_gate_up_swiglu:
//                       act [top_k, I] fp32, act[j,i] = silu(gate_e[i].x) * (up_e[i].x),
//                       e = selected_experts[j], silu(g) = g / (1 + expf(-g)).
//                       gate_up_weights bf16 [E, 2I, round_up(H, 8)] (gate rows, then up).
//   launch_moe_down_weighted_residual:
//                       x [H] += sum over j in selection order of w_j * (down_e[r] . act[j]).
//                       down_weights bf16 [E, H, round_up(I, 8)].
// Rows are padded with zeros to a multiple of 8 elements so that every row starts on a
// 16-byte boundary and each thread can read 8 bf16 with one 16-byte load.
//
// Design (batch-1 decode is bound by weight bandwidth: at the 30B-A3B shape, H = 2048,
// I = 768, top_k = 8, one layer's experts read 8 x 3 x 768 x 2048 x 2 B = 75.5 MB per token,
// 50.3 MB in gate/up and 25.2 MB in down):
//   - One warp per output (gate/up pair, or down row), lanes striding over 16-byte chunks
//     so that a warp reads 512 contiguous bytes per load instruction. Each lane keeps
//     several loads in flight (gate and up rows together; several experts together in
//     down) and the next item's first loads are issued before the current item's shuffle
//     reduction, and the block's first loads before the shared-memory staging (in down,
//     before the PDL wait: its expert ids are the top-k kernel's, two launches back). In
//     gate/up, x (the router GEMV's, two launches back) is staged before the wait.
//   - The vector a row is dotted with (x for gate/up, act for down) is staged once per
//     block in shared memory, split into low and high 16-byte halves of each 8-element
//     chunk so that a warp's 16-byte shared loads hit distinct banks.
//   - Grids are persistent (at most what fits on the device at once, balanced so that
//     every warp does the same number of items) and depend only on the shapes and the
//     device, never on the token's expert ids, which the kernels read on the device:
//     a captured graph replays unchanged.
//   - Every output is computed by one warp in a fixed order (per lane in chunk order,
//     then an xor-butterfly across lanes; experts combined in selection order), with no
//     atomics: results are bit-identical from run to run and between graph replay and
//     direct launch.
// Expert ids are trusted: the launchers do not know E, and launch_moe_topk only produces
// ids in [0, E).
#include "kernels.cuh"
#include "moe.cuh"
#include "quant.cuh"
#include "trace.cuh"

#include <vector>

#include <climits>
#include <cstddef>
#include <mutex>

namespace {

constexpr int kThreads = 256;      // gate/up and down blocks
constexpr int kWarps = kThreads / 32;
constexpr int kGateUpUnroll = 4;   // 16-byte chunks per lane per batch, for gate and for up
// 8. Holding a whole row in flight for every expert at once (a 30B-A3B row: 8 experts x 3
// chunks per lane) needs 180 registers, one block per SM, which hides less latency.
constexpr int kDownDepth = 8;      // 16-byte loads per lane per batch in down
constexpr unsigned kFullMask = 0xffffffffu;

// ---- OG_Q4_TRACE: per-block timestamps (build.py --trace; scripts/q4_trace.py) -------------
// The trace build's record of every block of the top-k, the bf16 gate/up and the bf16 down
// kernels (trace.cuh's GemvTraceRecord, with these modes beside the GEMVs' 0-4): its start, the
// PDL wait's return, its input staged (top-k: the probabilities) and its last warp's end, read
// with og_moe_trace_read(). The normal build has none of it.
#ifdef OG_Q4_TRACE
constexpr int kTraceTopk = 5, kTraceGateUp = 6, kTraceDown = 7;
using og::GemvTraceRecord;
using og::kGemvTraceRecords;
using og::trace_now;
using og::trace_sm;
__device__ GemvTraceRecord g_moe_trace[kGemvTraceRecords];
__device__ unsigned g_moe_trace_count;
#endif

// Weights are read once per token: skip L1 (keep it for the staged vectors' neighbours),
// ask L2 to fetch whole 256-byte sectors groups, since a warp streams rows anyway, and mark
// the lines evicted first (quant.cuh l2_evict_first: the KV cache and activations stay).
__device__ __forceinline__ uint4 load_weights(const uint4 *p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p), "l"(og::l2_evict_first()));
    return r;
}

// acc + (8 bf16 in w) . (lo, hi), one fma per element in element order. A bf16 is the
// high half of an fp32: element 2k is the low 16 bits of word k (little endian).
__device__ __forceinline__ float dot8(uint4 w, float4 lo, float4 hi, float acc) {
    acc = fmaf(__uint_as_float(w.x << 16), lo.x, acc);
    acc = fmaf(__uint_as_float(w.x & 0xffff0000u), lo.y, acc);
    acc = fmaf(__uint_as_float(w.y << 16), lo.z, acc);
    acc = fmaf(__uint_as_float(w.y & 0xffff0000u), lo.w, acc);
    acc = fmaf(__uint_as_float(w.z << 16), hi.x, acc);
    acc = fmaf(__uint_as_float(w.z & 0xffff0000u), hi.y, acc);
    acc = fmaf(__uint_as_float(w.w << 16), hi.z, acc);
    acc = fmaf(__uint_as_float(w.w & 0xffff0000u), hi.w, acc);
    return acc;
}

// Xor butterfly: every lane ends with the same bits (each step adds the same two values,
// and fp32 addition is commutative), so any lane may write the result.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
    return v;
}

// ---- top-k ------------------------------------------------------------------------------

// A slot's rank in the selection, as an unsigned key: the probability's bits + 2 (a
// probability is >= +0, so its bits order as its value does), 1 for NaN (below every
// probability, so that the order is total and an index is always a real expert), 0 for a
// slot past E or already picked.
__device__ __forceinline__ unsigned topk_key(float p) {
    return p != p ? 1u : __float_as_uint(p) + 2u;
}
__device__ __forceinline__ float topk_value(unsigned key) {
    return key >= 2u ? __uint_as_float(key - 2u) : __int_as_float(0x7fffffff);
}

// One warp. Lane l owns logits l, l + 32, ... (VPL of them, in registers, indexed only
// by unrolled constants). k rounds of a warp argmax over the unpicked probabilities: the
// largest key by one warp reduction (redux.sync), then the lowest index among the slots
// that hold it by a second (ties go to the lower expert).
template <int VPL>
__global__ void __launch_bounds__(32)
moe_topk_kernel(const float *__restrict__ logits, int num_experts, int top_k, int norm,
                int32_t *__restrict__ selected, float *__restrict__ weights) {
    const int lane = threadIdx.x;
    logits += (size_t)blockIdx.x * num_experts;  // block b: row b of a batch (prefill)
    selected += (size_t)blockIdx.x * top_k;
    weights += (size_t)blockIdx.x * top_k;
    GEMV_TRACE_START();
    GEMV_TRACE_SLOT(g_moe_trace_count);
    og::pdl_wait();  // the router GEMV's logits
    GEMV_TRACE_WAITED();
    og::pdl_launch_dependents();
    float p[VPL];
    unsigned unavailable = 0;  // bit v: slot v is past E
    float m = -INFINITY;
#pragma unroll
    for (int v = 0; v < VPL; ++v) {
        const int i = lane + 32 * v;
        if (i < num_experts) {
            p[v] = logits[i];
            m = fmaxf(m, p[v]);
        } else {
            p[v] = 0.0f;
            unavailable |= 1u << v;
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, off));
    float s = 0.0f;
#pragma unroll
    for (int v = 0; v < VPL; ++v) {
        if (!(unavailable & (1u << v))) {
            p[v] = expf(p[v] - m);
            s += p[v];
        }
    }
    s = warp_sum(s);
    // Selection is judged on these fp32 probabilities (what the reference ranks), not
    // on the logits: two logits may differ while their probabilities round equal.
#pragma unroll
    for (int v = 0; v < VPL; ++v) p[v] = p[v] / s;
    GEMV_TRACE_QUANTIZED();
    TRACE_STAGED_AS(g_moe_trace, logits, kTraceTopk, num_experts, top_k, 1);

    unsigned key[VPL];
#pragma unroll
    for (int v = 0; v < VPL; ++v)
        key[v] = (unavailable & (1u << v)) ? 0u : topk_key(p[v]);
    int my_index = 0;      // lane r keeps round r's winner
    unsigned my_key = 0u;
    for (int r = 0; r < top_k; ++r) {
        unsigned best = key[0];
        int best_v = 0;
#pragma unroll
        for (int v = 1; v < VPL; ++v) {  // ascending index within the lane: ties to the lower
            if (key[v] > best) {
                best = key[v];
                best_v = v;
            }
        }
        const unsigned top = __reduce_max_sync(kFullMask, best);
        const unsigned mine = best == top ? (unsigned)(lane + 32 * best_v) : UINT_MAX;
        const int bi = (int)__reduce_min_sync(kFullMask, mine);
        // top_k <= E, so a real expert always remains: top > 0 and bi < E here.
        if (lane == r) {
            my_index = bi;
            my_key = top;
        }
        if (lane == (bi & 31)) {
#pragma unroll
            for (int v = 0; v < VPL; ++v)
                if (v == (bi >> 5)) key[v] = 0u;
        }
    }
    float my_weight = topk_value(my_key);
    if (norm) {
        float total = 0.0f;  // selection order, the same on every lane
        for (int r = 0; r < top_k; ++r) total += __shfl_sync(kFullMask, my_weight, r);
        my_weight = my_weight / total;
    }
    if (lane < top_k) {
        selected[lane] = my_index;
        weights[lane] = my_weight;
    }
    GEMV_TRACE_END(g_moe_trace);
}

// ---- gate/up + SwiGLU -----------------------------------------------------------------------

template <int U>
__global__ void __launch_bounds__(kThreads)
moe_gate_up_swiglu_kernel(const __nv_bfloat16 *__restrict__ weights,
                          const float *__restrict__ x, const int32_t *__restrict__ selected,
                          int top_k, int hidden, int inter, float *__restrict__ act) {
    extern __shared__ float4 smem[];
    const int nch = (hidden + 7) >> 3;  // 16-byte chunks per weight row (= padded H / 8)
    float4 *x_lo = smem;                // x[8c .. 8c+3]
    float4 *x_hi = smem + nch;          // x[8c+4 .. 8c+7]
    const int lane = threadIdx.x & 31;
    const int pairs = top_k * inter;
    const int stride = gridDim.x * kWarps;
    const uint4 *base = reinterpret_cast<const uint4 *>(weights);
    GEMV_TRACE_START();

    uint4 wg[U], wu[U];
    const uint4 *g_row = base;
    const uint4 *u_row = base;
    auto locate = [&](int pair) {
        const int j = pair / inter;
        const int i = pair - j * inter;
        const int e = __ldg(selected + j);
        g_row = base + ((size_t)e * 2 * inter + i) * nch;
        u_row = g_row + (size_t)inter * nch;
    };
    auto load = [&](int c0) {
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int c = c0 + lane + 32 * k;
            if (c < nch) {
                wg[k] = load_weights(g_row + c);
                wu[k] = load_weights(u_row + c);
            } else {
                wg[k] = make_uint4(0u, 0u, 0u, 0u);
                wu[k] = make_uint4(0u, 0u, 0u, 0u);
            }
        }
    };

    // Before the wait: x_normed, the router GEMV's, is settled. Its writer is two launches
    // back, and the top-k kernel between lets this one launch only after its own wait has
    // returned. Only selected, the top-k kernel's output, needs the wait.
    // Zeros past H: the weights' pad columns are zero, and 0 * 0 keeps the sums exact.
    for (int c = threadIdx.x; c < nch; c += kThreads) {
        float v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int h = 8 * c + k;
            v[k] = h < hidden ? x[h] : 0.0f;
        }
        x_lo[c] = make_float4(v[0], v[1], v[2], v[3]);
        x_hi[c] = make_float4(v[4], v[5], v[6], v[7]);
    }
    GEMV_TRACE_SLOT(g_moe_trace_count);
    og::pdl_wait();  // selected comes from the top-k kernel
    GEMV_TRACE_WAITED();
    og::pdl_launch_dependents();
    int p = blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (p < pairs) {
        locate(p);
        load(0);
    }
    __syncthreads();
    GEMV_TRACE_QUANTIZED();
    TRACE_STAGED_AS(g_moe_trace, weights, kTraceGateUp, pairs, hidden, kWarps);

    while (p < pairs) {
        float ag = 0.0f, au = 0.0f;
        for (int c0 = 0;;) {
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const int c = c0 + lane + 32 * k;
                if (c < nch) {
                    const float4 lo = x_lo[c];
                    const float4 hi = x_hi[c];
                    ag = dot8(wg[k], lo, hi, ag);
                    au = dot8(wu[k], lo, hi, au);
                }
            }
            c0 += 32 * U;
            if (c0 >= nch) break;
            load(c0);
        }
        const int next = p + stride;
        if (next < pairs) {  // next pair's loads overlap this pair's reduction
            locate(next);
            load(0);
        }
        ag = warp_sum(ag);
        au = warp_sum(au);
        if (lane == 0) act[p] = ag / (1.0f + expf(-ag)) * au;
        p = next;
    }
    GEMV_TRACE_END(g_moe_trace);
}

// ---- down + weighted residual ----------------------------------------------------------------

// Work of one row, flattened: item q = (expert j, lane chunk t), q = j * cpl + t, where a
// lane's t-th chunk of a row is c = lane + 32 t and cpl = ceil(chunks / 32). Batches of D
// items are loaded together, so loads from several experts are in flight at once, and
// consumed in q order: an expert's dot is complete (and reduced across the warp) at its
// last item, and added to y in selection order.
template <int D>
__global__ void __launch_bounds__(kThreads)
moe_down_kernel(const __nv_bfloat16 *__restrict__ weights, const float *__restrict__ act,
                const int32_t *__restrict__ selected, const float *__restrict__ sel_weights,
                int top_k, int hidden, int inter, float *__restrict__ x) {
    extern __shared__ float4 smem[];
    const int nch = (inter + 7) >> 3;  // 16-byte chunks per row (= padded I / 8)
    const int n = top_k * nch;
    float4 *a_lo = smem;      // [top_k][nch]: act[j][8c .. 8c+3]
    float4 *a_hi = smem + n;  // [top_k][nch]: act[j][8c+4 .. 8c+7]
    const int lane = threadIdx.x & 31;
    const int cpl = (nch + 31) >> 5;
    const int items = top_k * cpl;
    const int stride = gridDim.x * kWarps;
    const uint4 *base = reinterpret_cast<const uint4 *>(weights);
    const size_t expert_chunks = (size_t)hidden * nch;
    GEMV_TRACE_START();
    // Before the wait: selected and sel_weights (the top-k kernel's) and x (the O
    // projection's) are settled. Their writers are two or more launches back, and the gate/up
    // kernel between lets this one launch only after its own wait has returned. Only act,
    // gate/up's output, needs the wait. Lane j holds expert j's id and weight (top_k <= 32);
    // items fetch them by shuffle.
    const int e_lane = lane < top_k ? selected[lane] : 0;
    const float w_lane = lane < top_k ? sel_weights[lane] : 0.0f;

    uint4 w[D];
    auto load = [&](int row, int q0) {
        int j = q0 / cpl;
        int t = q0 - j * cpl;
        const uint4 *row_base = base + (size_t)row * nch;
#pragma unroll
        for (int k = 0; k < D; ++k) {
            const int e = __shfl_sync(kFullMask, e_lane, j & 31);
            const int c = lane + 32 * t;
            if (q0 + k < items && c < nch)
                w[k] = load_weights(row_base + (size_t)e * expert_chunks + c);
            else
                w[k] = make_uint4(0u, 0u, 0u, 0u);
            if (++t == cpl) {
                t = 0;
                ++j;
            }
        }
    };

    // A row begins with its first weights in flight and (lane 0) its residual read: the first
    // row across the wait and while act is staged, the next ones while the last is reduced.
    float x_r = 0.0f;  // lane 0: the row's residual
    auto begin_row = [&](int row) {
        if (row < hidden) {
            load(row, 0);
            if (lane == 0) x_r = x[row];
        }
    };
    int r = blockIdx.x * kWarps + (threadIdx.x >> 5);
    begin_row(r);
    GEMV_TRACE_SLOT(g_moe_trace_count);
    og::pdl_wait();  // act comes from the gate/up kernel
    GEMV_TRACE_WAITED();
    og::pdl_launch_dependents();
    for (int q = threadIdx.x; q < n; q += kThreads) {
        const int j = q / nch;
        const int c = q - j * nch;
        const float *src = act + (size_t)j * inter;
        float v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int i = 8 * c + k;
            v[k] = i < inter ? src[i] : 0.0f;  // pad: finite zeros against zero weights
        }
        a_lo[q] = make_float4(v[0], v[1], v[2], v[3]);
        a_hi[q] = make_float4(v[4], v[5], v[6], v[7]);
    }
    __syncthreads();
    GEMV_TRACE_QUANTIZED();
    TRACE_STAGED_AS(g_moe_trace, weights, kTraceDown, hidden, inter, kWarps);

    while (r < hidden) {
        float y = 0.0f, acc = 0.0f;
        for (int q0 = 0;;) {
            int j = q0 / cpl;
            int t = q0 - j * cpl;
#pragma unroll
            for (int k = 0; k < D; ++k) {
                if (q0 + k < items) {  // warp-uniform
                    const int c = lane + 32 * t;
                    if (c < nch) acc = dot8(w[k], a_lo[j * nch + c], a_hi[j * nch + c], acc);
                    if (t == cpl - 1) {  // expert j complete: warp-uniform
                        const float s = warp_sum(acc);
                        const float wj = __shfl_sync(kFullMask, w_lane, j);
                        // Explicit roundings: w_j * s, then + y, as the reference does.
                        y = __fadd_rn(y, __fmul_rn(wj, s));
                        acc = 0.0f;
                    }
                }
                if (++t == cpl) {
                    t = 0;
                    ++j;
                }
            }
            q0 += D;
            if (q0 >= items) break;
            load(r, q0);
        }
        const int next = r + stride;
        const float x_prev = x_r;
        begin_row(next);  // overlaps the store below
        if (lane == 0) x[r] = __fadd_rn(x_prev, y);
        r = next;
    }
    GEMV_TRACE_END(g_moe_trace);
}

// ---- launch helpers ---------------------------------------------------------------------------

struct OccupancyEntry {
    const void *fn;
    int device;
    size_t smem;
    int blocks_per_sm;
};
std::mutex g_launch_mutex;
OccupancyEntry g_occupancy[32];
int g_occupancy_next = 0;

// A persistent grid for work_warps warp-sized items: no more blocks than fit on the device
// at once, and as few as keep every warp at the same number of rounds. Host queries only
// (no stream work), so this is safe while the stream is being captured.
cudaError_t persistent_grid(const void *fn, size_t smem, long long work_warps, int *grid) {
    int device = 0, sms = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    int per_sm = -1;
    {
        std::lock_guard<std::mutex> lock(g_launch_mutex);
        for (const OccupancyEntry &o : g_occupancy)
            if (o.fn == fn && o.device == device && o.smem == smem) per_sm = o.blocks_per_sm;
        if (per_sm < 0) {  // first launch of this shape: the shared-memory opt-in, then occupancy
            err = og::allow_dynamic_smem(fn, smem);
            if (err != cudaSuccess) return err;
            err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kThreads, smem);
            if (err != cudaSuccess) return err;
            g_occupancy[g_occupancy_next] = OccupancyEntry{fn, device, smem, per_sm};
            g_occupancy_next = (g_occupancy_next + 1) % 32;
        }
    }
    if (per_sm < 1) return cudaErrorInvalidConfiguration;
    const long long max_blocks = (long long)sms * per_sm;
    const long long work_blocks = (work_warps + kWarps - 1) / kWarps;
    const long long rounds = (work_blocks + max_blocks - 1) / max_blocks;
    *grid = (int)((work_blocks + rounds - 1) / rounds);
    return cudaSuccess;
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

}  // namespace

// ---- launchers --------------------------------------------------------------------------------

cudaError_t launch_moe_topk(const float *router_logits, int num_experts, int top_k,
                            int norm_topk_prob, int32_t *selected_experts,
                            float *selected_weights, cudaStream_t stream, bool pdl) {
    return launch_moe_topk_rows(router_logits, 1, num_experts, top_k, norm_topk_prob,
                                selected_experts, selected_weights, stream, pdl);
}

cudaError_t launch_moe_topk_rows(const float *router_logits, int n_rows, int num_experts,
                                 int top_k, int norm_topk_prob, int32_t *selected_experts,
                                 float *selected_weights, cudaStream_t stream, bool pdl) {
    if (!router_logits || !selected_experts || !selected_weights) return cudaErrorInvalidValue;
    if (n_rows < 1 || n_rows > INT_MAX / 2) return cudaErrorInvalidValue;
    if (num_experts < 1 || num_experts > kMaxExperts) return cudaErrorInvalidValue;
    if (top_k < 1 || top_k > kMaxTopK || top_k > num_experts) return cudaErrorInvalidValue;
    const int norm = norm_topk_prob ? 1 : 0;
    const auto kernel = num_experts <= 32    ? &moe_topk_kernel<1>
                        : num_experts <= 64  ? &moe_topk_kernel<2>
                        : num_experts <= 128 ? &moe_topk_kernel<4>
                        : num_experts <= 256 ? &moe_topk_kernel<8>
                                             : &moe_topk_kernel<16>;
    return og::launch_kernel(kernel, dim3(n_rows), dim3(32), 0, stream, pdl, router_logits,
                             num_experts, top_k, norm, selected_experts, selected_weights);
}

cudaError_t launch_moe_gate_up_swiglu(const __nv_bfloat16 *gate_up_weights,
                                      const float *x_normed, const int32_t *selected_experts,
                                      int top_k, int hidden, int moe_inter, float *act,
                                      cudaStream_t stream, bool pdl) {
    if (!gate_up_weights || !x_normed || !selected_experts || !act) return cudaErrorInvalidValue;
    if (!aligned16(gate_up_weights)) return cudaErrorInvalidValue;
    if (top_k < 1 || top_k > kMaxTopK || hidden < 1 || moe_inter < 1) return cudaErrorInvalidValue;
    if ((long long)top_k * moe_inter > INT_MAX) return cudaErrorInvalidValue;
    const int nch = (hidden + 7) / 8;
    const size_t smem = (size_t)2 * nch * sizeof(float4);
    const void *fn = reinterpret_cast<const void *>(&moe_gate_up_swiglu_kernel<kGateUpUnroll>);
    int grid = 0;
    cudaError_t err = persistent_grid(fn, smem, (long long)top_k * moe_inter, &grid);
    if (err != cudaSuccess) return err;
    return og::launch_kernel(&moe_gate_up_swiglu_kernel<kGateUpUnroll>, dim3(grid), dim3(kThreads),
                             smem, stream, pdl, gate_up_weights, x_normed, selected_experts, top_k,
                             hidden, moe_inter, act);
}

cudaError_t launch_moe_down_weighted_residual(const __nv_bfloat16 *down_weights,
                                              const float *act,
                                              const int32_t *selected_experts,
                                              const float *selected_weights, int top_k,
                                              int hidden, int moe_inter, float *x,
                                              cudaStream_t stream, bool pdl) {
    if (!down_weights || !act || !selected_experts || !selected_weights || !x)
        return cudaErrorInvalidValue;
    if (!aligned16(down_weights)) return cudaErrorInvalidValue;
    if (top_k < 1 || top_k > kMaxTopK || hidden < 1 || moe_inter < 1) return cudaErrorInvalidValue;
    const int nch = (moe_inter + 7) / 8;
    const size_t smem = (size_t)2 * top_k * nch * sizeof(float4);
    const void *fn = reinterpret_cast<const void *>(&moe_down_kernel<kDownDepth>);
    int grid = 0;
    cudaError_t err = persistent_grid(fn, smem, hidden, &grid);
    if (err != cudaSuccess) return err;
    return og::launch_kernel(&moe_down_kernel<kDownDepth>, dim3(grid), dim3(kThreads), smem,
                             stream, pdl, down_weights, act, selected_experts, selected_weights,
                             top_k, hidden, moe_inter, x);
}

namespace {

bool valid_quant_args(const og::WeightMatrix &w, int top_k, int hidden, int inter) {
    return w.data != nullptr && w.scales != nullptr && aligned16(w.data) && top_k >= 1 &&
           top_k <= kMaxTopK && hidden >= 1 && inter >= 1 &&
           (long long)top_k * inter <= INT_MAX;
}

}  // namespace

cudaError_t launch_moe_gate_up_swiglu(const og::WeightMatrix &gate_up, const float *x_normed,
                                      const int32_t *selected_experts, int top_k, int hidden,
                                      int moe_inter, float *act, cudaStream_t stream, bool pdl) {
    if (gate_up.format == OG_WEIGHTS_BF16)
        return launch_moe_gate_up_swiglu(static_cast<const __nv_bfloat16 *>(gate_up.data),
                                         x_normed, selected_experts, top_k, hidden, moe_inter,
                                         act, stream, pdl);
    if (!x_normed || !selected_experts || !act || !valid_quant_args(gate_up, top_k, hidden, moe_inter))
        return cudaErrorInvalidValue;
    // int8 / q4: the quantized GEMV's tensor-core kernels (gemv_int8.cu, gemv_q4.cu)
    return og::launch_moe_gate_up_quant(gate_up.format, gate_up.data, gate_up.scales, x_normed,
                                        selected_experts, top_k, hidden, moe_inter, act, stream,
                                        pdl);
}

cudaError_t launch_moe_down_weighted_residual(const og::WeightMatrix &down, const float *act,
                                              const int32_t *selected_experts,
                                              const float *selected_weights, int top_k,
                                              int hidden, int moe_inter, float *x,
                                              cudaStream_t stream, bool pdl) {
    if (down.format == OG_WEIGHTS_BF16)
        return launch_moe_down_weighted_residual(static_cast<const __nv_bfloat16 *>(down.data),
                                                 act, selected_experts, selected_weights, top_k,
                                                 hidden, moe_inter, x, stream, pdl);
    if (!act || !selected_experts || !selected_weights || !x ||
        !valid_quant_args(down, top_k, hidden, moe_inter))
        return cudaErrorInvalidValue;
    // int8 / q4: the quantized GEMV's tensor-core kernels (gemv_int8.cu, gemv_q4.cu), experts summed in order
    return og::launch_moe_down_quant(down.format, down.data, down.scales, act, selected_experts,
                                     selected_weights, top_k, hidden, moe_inter, x, stream, pdl);
}

#ifdef OG_Q4_TRACE
OG_TRACE_READERS(moe, g_moe_trace, g_moe_trace_count)
#endif
