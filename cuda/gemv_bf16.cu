// gemv_bf16.cu — weight matrix x fp32 vector over bf16 weights, the kernel that carries most of
// decode's memory traffic in a bf16 model (int8 weights: gemv_int8.cu; q4: gemv_q4.cu; the
// dispatch over formats: gemv.cu). Modes (kernels.cuh):
// plain, RMSNorm fused in front, residual add, and RMSNorm + gate/up + SwiGLU.
//
//   weight: [rows, ld] bf16, ld = padded_cols(cols) (zeros in the pad columns)
//   x:      [cols] fp32, staged in shared memory as [ld] (zeros in the pad), normalized
//           there when the mode has a norm:  n[i] = x[i] * (1 / sqrt(mean(x^2) + eps)) * w[i]
//   y:      [rows] fp32 (or [rows / 2] for SwiGLU)
//
// Work split: 8, 4 or 2 warps per block (fewer for matrices with few rows, so that every
// SM gets blocks); a warp owns a task = a pair of rows
// (r, r+1), or for SwiGLU the pair (gate row i, up row I + i), so the two rows share
// every shared-memory read of x. Lane l reads 16-byte chunks l, l+32, ... of both rows,
// U = 4, 8 or 12 chunks of each in flight per step (chosen from the row length, so a row of
// up to 3072 columns is one step), accumulates in fp32 in chunk order and the warp reduces
// with shuffles. The grid is at most what fits on the GPU at once and warps stride over the
// tasks, so each block stages x once. The residual modes read a task's two y values as the task
// begins, so that its end does not wait on an L2 round trip; with a settled residual
// (GemvArgs::residual_settled, one vector) the first task's before the PDL wait, as the q4
// kernel does. No L2 prefetch of a warp's next task's rows: the rows in flight would exceed L2
// and be evicted before use. The weights do not depend on earlier kernels, so before
// waiting on the previous kernel (PDL) each warp loads its first step of its first task into
// registers, and norm modes stage the norm weights: after the wait, only x's staging (and its
// norm) stands before the arithmetic. The rest of those rows is not prefetched into L2 there:
// L2 prefetches compete with the loads the running kernels wait for.
#include "gemv.cuh"
#include "trace.cuh"

namespace og {

// ---- OG_Q4_TRACE: per-block timestamps (build.py --trace; scripts/q4_trace.py --weights bf16) --
// The diagnostic build's record of every block of this kernel, as the q4 kernel's (trace.cuh's
// GEMV_TRACE_*): its start, the PDL wait's return, its staged input (nothing is quantized: the
// record's t_quant is taken there too) and its last warp's end, into a ring read with
// og_bf16_trace_read(). The normal build has none of it.
#ifdef OG_Q4_TRACE
__device__ GemvTraceRecord g_bf16_trace[kGemvTraceRecords];
__device__ unsigned g_bf16_trace_count;
#endif

namespace {


__device__ __forceinline__ float dot8(uint4 w, float4 xa, float4 xb, float acc) {
    acc = fmaf(bf16_lo(w.x), xa.x, acc);
    acc = fmaf(bf16_hi(w.x), xa.y, acc);
    acc = fmaf(bf16_lo(w.y), xa.z, acc);
    acc = fmaf(bf16_hi(w.y), xa.w, acc);
    acc = fmaf(bf16_lo(w.z), xb.x, acc);
    acc = fmaf(bf16_hi(w.z), xb.y, acc);
    acc = fmaf(bf16_lo(w.w), xb.z, acc);
    acc = fmaf(bf16_hi(w.w), xb.w, acc);
    return acc;
}

// Rows of task `task`: (r0, r1). r1 == r0 for the last task of an odd row count.
template <int MODE>
__device__ __forceinline__ void task_rows(const GemvParams &p, int task, int &r0, int &r1) {
    if (MODE == kGemvNormSwiglu) {
        r0 = task;
        r1 = task + p.out_rows;
    } else {
        r0 = 2 * task;
        r1 = min(r0 + 1, p.rows - 1);
    }
}

// Issue the loads of U 16-byte chunks of rows w0 and w1 for lane chunks base, base + 32, ...
template <int U>
__device__ __forceinline__ void load_chunks(const uint4 *w0, const uint4 *w1, int base,
                                            int n_chunks, uint4 (&v0)[U], uint4 (&v1)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int c = base + u * kWarpSize;
        if (c < n_chunks) {
            v0[u] = __ldcs(w0 + c);
            v1[u] = __ldcs(w1 + c);
        } else {
            v0[u] = make_uint4(0u, 0u, 0u, 0u);
            v1[u] = v0[u];
        }
    }
}

// Norm modes: vector vec's staged x (xs, [cols]) becomes x * inv_rms * w there, and in
// normed_out from block 0.
__device__ __forceinline__ void normalize_x(const GemvParams &p, int vec, float *xs, float inv_rms,
                                            const float *w_smem, int threads) {
    const bool write_normed = p.normed_out != nullptr && blockIdx.x == 0;
    for (int i = threadIdx.x; i < p.cols; i += threads) {
        const float n = xs[i] * inv_rms * w_smem[i];
        xs[i] = n;
        if (write_normed) p.normed_out[(size_t)vec * p.x_stride + i] = n;
    }
}

// Stage vector vec's x into x_smem4 + vec * ld / 4 (zeros in the pad columns so that
// 0-weight * pad stays 0) and, in norm modes, normalize it there (and into normed_out from block
// 0). Thread t takes the float4s t, t + threads, ... in that order and sums their squares in
// that order; the block sum is block_sum's. The caller's barrier makes x_smem visible.
template <int MODE, int kThreads>
__device__ __forceinline__ void stage_x(const GemvParams &p, int vec, float4 *x_smem4,
                                        const float *w_smem, float *scratch) {
    const float *x = p.x + (size_t)vec * p.x_stride;
    float4 *xs4 = x_smem4 + (size_t)vec * (p.ld / 4);
    float *xs = reinterpret_cast<float *>(xs4);
    float sum_sq = 0.f;
    // With cols % 4 == 0 a float4 is either wholly inside x or wholly pad (ld is a multiple of 8).
    if (p.cols % 4 == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0) {
        const float4 *x4 = reinterpret_cast<const float4 *>(x);
        const int cols4 = p.cols / 4;
        const int n4 = p.ld / 4;
        // All of a thread's loads in flight at once (a 2-warp block stages 2048-3072
        // columns: 8-12 per thread), then stored and summed in index order.
        constexpr int kStage = 12;
        for (int first = threadIdx.x; first < n4; first += kThreads * kStage) {
            float4 v[kStage];
#pragma unroll
            for (int k = 0; k < kStage; ++k) {
                const int i = first + k * kThreads;
                v[k] = i < cols4 ? x4[i] : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int k = 0; k < kStage; ++k) {
                const int i = first + k * kThreads;
                if (i < n4) {
                    xs4[i] = v[k];
                    sum_sq = fmaf(v[k].x, v[k].x, sum_sq);
                    sum_sq = fmaf(v[k].y, v[k].y, sum_sq);
                    sum_sq = fmaf(v[k].z, v[k].z, sum_sq);
                    sum_sq = fmaf(v[k].w, v[k].w, sum_sq);
                }
            }
        }
    } else {
#pragma unroll 4
        for (int i = threadIdx.x; i < p.ld; i += kThreads) {
            const float v = i < p.cols ? x[i] : 0.f;
            xs[i] = v;
            sum_sq = fmaf(v, v, sum_sq);
        }
    }
    if (mode_has_norm(MODE)) {
        // block_sum ends with a barrier: every staged element is visible below.
        const float total = block_sum<kThreads>(sum_sq, scratch);
        normalize_x(p, vec, xs, 1.0f / sqrtf(total / (float)p.cols + p.eps), w_smem, kThreads);
    }
}

// stage_x for nv vectors at once, with every vector's arithmetic stage_x's (the same float4s
// per thread, summed in the same order; the same block sum): the loads of all vectors are in
// flight together and one reduction serves all of them, instead of a load round trip and three
// barriers per vector. Inputs stage_x's fast path does not take go vector by vector through it.
template <int MODE, int kThreads, int NV>
__device__ __forceinline__ void stage_x_multi(const GemvParams &p, int nv, float4 *x_smem4,
                                              const float *w_smem, float *scratch) {
    constexpr int kWarps = kThreads / kWarpSize;
    const bool aligned = p.cols % 4 == 0 && (p.x_stride % 4) == 0 && (reinterpret_cast<uintptr_t>(p.x) & 15) == 0;
    if (!aligned) {
        for (int vec = 0; vec < nv; ++vec) stage_x<MODE, kThreads>(p, vec, x_smem4, w_smem, scratch);
        return;
    }
    const int cols4 = p.cols / 4;
    const int n4 = p.ld / 4;
    float sum_sq[NV];
#pragma unroll
    for (int vec = 0; vec < NV; ++vec) sum_sq[vec] = 0.f;
    constexpr int kStage = 2;   // per vector: NV * kStage float4s in flight per thread
    for (int first = threadIdx.x; first < n4; first += kThreads * kStage) {
        float4 v[NV][kStage];
#pragma unroll
        for (int vec = 0; vec < NV; ++vec) {
            const float4 *x4 = reinterpret_cast<const float4 *>(p.x + (size_t)vec * p.x_stride);
#pragma unroll
            for (int k = 0; k < kStage; ++k) {
                const int i = first + k * kThreads;
                v[vec][k] = vec < nv && i < cols4 ? x4[i] : make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
#pragma unroll
        for (int vec = 0; vec < NV; ++vec) {
            if (vec >= nv) continue;
            float4 *xs4 = x_smem4 + (size_t)vec * n4;
#pragma unroll
            for (int k = 0; k < kStage; ++k) {
                const int i = first + k * kThreads;
                if (i < n4) {
                    xs4[i] = v[vec][k];
                    sum_sq[vec] = fmaf(v[vec][k].x, v[vec][k].x, sum_sq[vec]);
                    sum_sq[vec] = fmaf(v[vec][k].y, v[vec][k].y, sum_sq[vec]);
                    sum_sq[vec] = fmaf(v[vec][k].z, v[vec][k].z, sum_sq[vec]);
                    sum_sq[vec] = fmaf(v[vec][k].w, v[vec][k].w, sum_sq[vec]);
                }
            }
        }
    }
    if (mode_has_norm(MODE)) {
        // block_sum per vector: the warp's butterfly, then the warps' sums in warp order.
        __shared__ float sums[NV][kWarps];
        __shared__ float inv_rms[NV];
#pragma unroll
        for (int vec = 0; vec < NV; ++vec) {
            const float w = warp_sum(sum_sq[vec]);
            if (vec < nv && (threadIdx.x & 31) == 0) sums[vec][threadIdx.x >> 5] = w;
        }
        __syncthreads();
        if (threadIdx.x < nv) {
            float total = 0.f;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) total += sums[threadIdx.x][w];
            inv_rms[threadIdx.x] = 1.0f / sqrtf(total / (float)p.cols + p.eps);
        }
        __syncthreads();
        for (int vec = 0; vec < nv; ++vec)
            normalize_x(p, vec, reinterpret_cast<float *>(x_smem4 + (size_t)vec * n4), inv_rms[vec],
                        w_smem, kThreads);
    }
}

// NV: 1 (the decode body), or 2, 4, kGemvMaxVectors (the verify body: p.nv <= NV vectors, each x
// p.x_stride floats after the one before, each y p.y_stride floats). Each vector's arithmetic is
// the NV = 1 code's: its own staging and RMSNorm sum over the same threads, the same chunk order
// per lane and the same shuffle reduction; only the weights are loaded once for all of them.
template <int MODE, int WARPS, int U, int NV>
__global__ void __launch_bounds__(WARPS * kWarpSize) gemv_bf16_kernel(const GemvParams p) {
    constexpr int kThreads = WARPS * kWarpSize;
    GEMV_TRACE_START();
    const int nv = NV == 1 ? 1 : p.nv;
    extern __shared__ float4 x_smem4[];              // [nv][ld / 4], then norm modes: w [ld / 4]
    float *x_smem = reinterpret_cast<float *>(x_smem4);
    float *w_smem = x_smem + (size_t)nv * p.ld;
    __shared__ float scratch[WARPS];

    const int warp = threadIdx.x / kWarpSize;
    const int lane = threadIdx.x % kWarpSize;
    const int n_chunks = p.ld / 8;                   // 16-byte chunks per row
    const int task_stride = gridDim.x * WARPS;
    int task = blockIdx.x * WARPS + warp;

    // Weights do not depend on earlier kernels: before waiting for the previous kernel, load
    // this warp's first U chunks per lane of its first two rows into registers and stage the
    // norm weights.
    uint4 v0[U], v1[U];
    int r0 = 0, r1 = 0;
    // The residual modes' y values of the current task (one vector; lane 0).
    float res0 = 0.f, res1 = 0.f;
    constexpr bool kEarlyResidual = MODE == kGemvResidual && NV == 1;
    if (task < p.n_tasks) {
        task_rows<MODE>(p, task, r0, r1);
        load_chunks<U>(reinterpret_cast<const uint4 *>(p.weight + (size_t)r0 * p.ld),
                       reinterpret_cast<const uint4 *>(p.weight + (size_t)r1 * p.ld), lane,
                       n_chunks, v0, v1);
        if (kEarlyResidual && p.residual_settled && lane == 0) {
            res0 = __ldcg(p.y + r0);
            res1 = __ldcg(p.y + r1);
        }
    }
    if (mode_has_norm(MODE)) {
        for (int i = threadIdx.x; i < p.cols; i += kThreads) w_smem[i] = __ldg(p.norm_weight + i);
    }
    GEMV_TRACE_SLOT(g_bf16_trace_count);
    pdl_wait_then_launch<MODE == kGemvNorm>();
    GEMV_TRACE_WAITED();

    if constexpr (NV == 1) {
        stage_x<MODE, kThreads>(p, 0, x_smem4, w_smem, scratch);
    } else {
        stage_x_multi<MODE, kThreads, NV>(p, nv, x_smem4, w_smem, scratch);
    }
    __syncthreads();
    GEMV_TRACE_QUANTIZED();
    GEMV_TRACE_STAGED(g_bf16_trace);
    GEMV_TRACE_WEIGHTS(g_bf16_trace, v0[0].x);

    // Bank-conflict-free reads of x: a quarter-warp's 8 lanes read 8 chunks of 32 bytes
    // in two 16-byte halves; lanes 4..7 of each quarter take their halves in the other
    // order so the 8 accesses of one instruction cover 128 distinct bytes.
    const int swap_halves = (lane >> 2) & 1;

    for (bool first = true; task < p.n_tasks; task += task_stride, first = false) {
        if (!first) task_rows<MODE>(p, task, r0, r1);
        if (kEarlyResidual && (!first || !p.residual_settled) && lane == 0) {
            res0 = __ldcg(p.y + r0);
            res1 = __ldcg(p.y + r1);
        }
        const uint4 *w0 = reinterpret_cast<const uint4 *>(p.weight + (size_t)r0 * p.ld);
        const uint4 *w1 = reinterpret_cast<const uint4 *>(p.weight + (size_t)r1 * p.ld);
        float acc0[NV], acc1[NV];
#pragma unroll
        for (int vec = 0; vec < NV; ++vec) acc0[vec] = 0.f, acc1[vec] = 0.f;
        for (int base = lane; base < n_chunks; base += kWarpSize * U) {
            if (!first || base != lane) load_chunks<U>(w0, w1, base, n_chunks, v0, v1);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = base + u * kWarpSize;
                if (c < n_chunks) {
#pragma unroll
                    for (int vec = 0; vec < NV; ++vec) {
                        if (vec < nv) {
                            const float4 *xs4 = x_smem4 + (size_t)vec * (p.ld / 4);
                            const float4 first_half = xs4[2 * c + swap_halves];
                            const float4 second_half = xs4[2 * c + 1 - swap_halves];
                            const float4 xa = swap_halves ? second_half : first_half;
                            const float4 xb = swap_halves ? first_half : second_half;
                            acc0[vec] = dot8(v0[u], xa, xb, acc0[vec]);
                            acc1[vec] = dot8(v1[u], xa, xb, acc1[vec]);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int vec = 0; vec < NV; ++vec) {
            if (vec < nv) {
                const float a0 = warp_sum(acc0[vec]);
                const float a1 = warp_sum(acc1[vec]);
                float *y = p.y + (size_t)vec * p.y_stride;
                if (lane == 0) {
                    if (MODE == kGemvNormSwiglu) {
                        const float silu = a0 / (1.0f + expf(-a0));
                        y[task] = silu * a1;
                    } else if (kEarlyResidual) {
                        y[r0] = res0 + a0;
                        if (r1 != r0) y[r1] = res1 + a1;
                    } else if (MODE == kGemvResidual) {
                        y[r0] += a0;
                        if (r1 != r0) y[r1] += a1;
                    } else {
                        y[r0] = a0;
                        if (r1 != r0) y[r1] = a1;
                    }
                }
            }
        }
    }
    GEMV_TRACE_END(g_bf16_trace);
}

template <int MODE, int WARPS, int NV>
const void *bf16_kernel_of(int unroll) {
    switch (unroll) {
        case 4: return (const void *)gemv_bf16_kernel<MODE, WARPS, 4, NV>;
        case 8: return (const void *)gemv_bf16_kernel<MODE, WARPS, 8, NV>;
        case 12: return (const void *)gemv_bf16_kernel<MODE, WARPS, 12, NV>;
    }
    return nullptr;
}

template <int WARPS, int NV>
const void *bf16_kernel_of(GemvMode mode, int unroll) {
    switch (mode) {
        case kGemvPlain: return bf16_kernel_of<kGemvPlain, WARPS, NV>(unroll);
        case kGemvNorm: return bf16_kernel_of<kGemvNorm, WARPS, NV>(unroll);
        case kGemvResidual: return bf16_kernel_of<kGemvResidual, WARPS, NV>(unroll);
        case kGemvNormSwiglu: return bf16_kernel_of<kGemvNormSwiglu, WARPS, NV>(unroll);
    }
    return nullptr;
}

template <int NV>
const void *bf16_kernel_nv(GemvMode mode, int warps, int unroll) {
    switch (warps) {
        case 2: return bf16_kernel_of<2, NV>(mode, unroll);
        case 4: return bf16_kernel_of<4, NV>(mode, unroll);
        case 8: return bf16_kernel_of<8, NV>(mode, unroll);
    }
    return nullptr;
}

}  // namespace

// bf16: chunks per lane in flight U = 4, 8 or 12 (the smallest that holds a whole row when one
// does, else 8), so that rows up to 3072 columns take one round of loads per task.
int bf16_unroll(int cols) {
    const int per_lane = ceil_div(ceil_div(padded_cols(cols), 8), kWarpSize);
    return per_lane <= 4 ? 4 : per_lane <= 8 ? 8 : per_lane <= 12 ? 12 : 8;
}

int bf16_instance(int n) { return n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : kGemvMaxVectors; }

const void *bf16_kernel_for(GemvMode mode, int warps, int unroll, int nv) {
    switch (nv) {
        case 1: return bf16_kernel_nv<1>(mode, warps, unroll);
        case 2: return bf16_kernel_nv<2>(mode, warps, unroll);
        case 4: return bf16_kernel_nv<4>(mode, warps, unroll);
        case kGemvMaxVectors: return bf16_kernel_nv<kGemvMaxVectors>(mode, warps, unroll);
    }
    return nullptr;
}

cudaError_t launch_bf16(GemvMode mode, int warps, int unroll, dim3 grid, int smem, cudaStream_t stream,
                        bool pdl, const GemvParams &p) {
    if (p.nv < 1 || p.nv > kGemvMaxVectors) return cudaErrorInvalidValue;
    // Every instance is a void(GemvParams) kernel: the one bf16_kernel_for names is launched.
    const void *kernel = bf16_kernel_for(mode, warps, unroll, bf16_instance(p.nv));
    if (kernel == nullptr) return cudaErrorInvalidConfiguration;
    return launch_kernel(reinterpret_cast<void (*)(GemvParams)>(kernel), grid, dim3(warps * kWarpSize), smem,
                         stream, pdl, p);
}

}  // namespace og

#ifdef OG_Q4_TRACE
OG_TRACE_READERS(bf16, og::g_bf16_trace, og::g_bf16_trace_count)
#endif
