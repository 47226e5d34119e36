// gemv.cu — weight matrix x fp32 vector, the kernel that carries almost all of decode's
// memory traffic, for bf16 weights (first kernel below) and int8 / q4 weights (second kernel,
// dequantizing on the fly with quant.cuh). Modes (kernels.cuh): plain, RMSNorm fused in front,
// residual add, and RMSNorm + gate/up + SwiGLU.
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
// tasks, so each block stages x once. (Pulling a warp's next task's rows into L2 ahead was
// tried: 8B 198 -> 186 tok/s, lm_head 76 -> 85 µs: the rows in flight exceed L2 and get evicted
// before use.) The weights do not depend on earlier kernels, so before
// waiting on the previous kernel (PDL) each warp loads its first step of its first task into
// registers and pulls the rest of those rows into L2, and norm modes stage the norm weights:
// after the wait, only x's staging (and its norm) stands before the arithmetic.
#include "kernels.cuh"
#include "quant.cuh"

namespace og {
namespace {

constexpr int kGemvMaxWarps = 8;

struct GemvParams {
    const __nv_bfloat16 *weight;
    const float *x;
    const float *norm_weight;
    float *y;
    float *normed_out;
    int rows, cols, ld, n_tasks, out_rows;
    float eps;
};

__host__ __device__ constexpr bool mode_has_norm(int mode) {
    return mode == kGemvNorm || mode == kGemvNormSwiglu;
}

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

template <int MODE, int WARPS, int U>
__global__ void __launch_bounds__(WARPS * kWarpSize) gemv_bf16_kernel(const GemvParams p) {
    constexpr int kThreads = WARPS * kWarpSize;
    extern __shared__ float4 x_smem4[];              // [ld / 4], then norm modes: w [ld / 4]
    float *x_smem = reinterpret_cast<float *>(x_smem4);
    float *w_smem = x_smem + p.ld;
    __shared__ float scratch[WARPS];

    const int warp = threadIdx.x / kWarpSize;
    const int lane = threadIdx.x % kWarpSize;
    const int n_chunks = p.ld / 8;                   // 16-byte chunks per row
    const int task_stride = gridDim.x * WARPS;
    int task = blockIdx.x * WARPS + warp;

    // Weights do not depend on earlier kernels: before waiting for the previous kernel, load
    // this warp's first U chunks per lane of its first two rows into registers, pull the rest
    // of those rows into L2, and stage the norm weights.
    uint4 v0[U], v1[U];
    int r0 = 0, r1 = 0;
    if (task < p.n_tasks) {
        task_rows<MODE>(p, task, r0, r1);
        load_chunks<U>(reinterpret_cast<const uint4 *>(p.weight + (size_t)r0 * p.ld),
                       reinterpret_cast<const uint4 *>(p.weight + (size_t)r1 * p.ld), lane,
                       n_chunks, v0, v1);
        const int first_bytes = kWarpSize * U * 16;  // what the registers hold of a row
        const int row_bytes = p.ld * 2;
        if (lane == 0 && row_bytes > first_bytes) {
            const uint32_t rest = (uint32_t)(row_bytes - first_bytes);
            prefetch_l2(reinterpret_cast<const char *>(p.weight + (size_t)r0 * p.ld) + first_bytes, rest);
            if (r1 != r0)
                prefetch_l2(reinterpret_cast<const char *>(p.weight + (size_t)r1 * p.ld) + first_bytes, rest);
        }
    }
    if (mode_has_norm(MODE)) {
        for (int i = threadIdx.x; i < p.cols; i += kThreads) w_smem[i] = __ldg(p.norm_weight + i);
    }
    pdl_wait();
    pdl_launch_dependents();

    // Stage x (zeros in the pad columns so that 0-weight * pad stays 0). With cols % 4 == 0
    // a float4 is either wholly inside x or wholly pad (ld is a multiple of 8).
    float sum_sq = 0.f;
    if (p.cols % 4 == 0 && (reinterpret_cast<uintptr_t>(p.x) & 15) == 0) {
        const float4 *x4 = reinterpret_cast<const float4 *>(p.x);
        const int cols4 = p.cols / 4;
        const int n4 = p.ld / 4;
        // All of a thread's loads in flight at once (a 2-warp block stages 2048-3072 columns:
        // 8-12 per thread), then stored and summed in index order.
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
                    x_smem4[i] = v[k];
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
            const float v = i < p.cols ? p.x[i] : 0.f;
            x_smem[i] = v;
            sum_sq = fmaf(v, v, sum_sq);
        }
    }
    if (mode_has_norm(MODE)) {
        // block_sum ends with a barrier: every staged element is visible below.
        const float total = block_sum<kThreads>(sum_sq, scratch);
        const float inv_rms = 1.0f / sqrtf(total / (float)p.cols + p.eps);
        const bool write_normed = p.normed_out != nullptr && blockIdx.x == 0;
        for (int i = threadIdx.x; i < p.cols; i += kThreads) {
            const float n = x_smem[i] * inv_rms * w_smem[i];
            x_smem[i] = n;
            if (write_normed) p.normed_out[i] = n;
        }
    }
    __syncthreads();

    // Bank-conflict-free reads of x: a quarter-warp's 8 lanes read 8 chunks of 32 bytes
    // in two 16-byte halves; lanes 4..7 of each quarter take their halves in the other
    // order so the 8 accesses of one instruction cover 128 distinct bytes.
    const int swap_halves = (lane >> 2) & 1;

    for (bool first = true; task < p.n_tasks; task += task_stride, first = false) {
        if (!first) task_rows<MODE>(p, task, r0, r1);
        const uint4 *w0 = reinterpret_cast<const uint4 *>(p.weight + (size_t)r0 * p.ld);
        const uint4 *w1 = reinterpret_cast<const uint4 *>(p.weight + (size_t)r1 * p.ld);
        float acc0 = 0.f, acc1 = 0.f;
        for (int base = lane; base < n_chunks; base += kWarpSize * U) {
            if (!first || base != lane) load_chunks<U>(w0, w1, base, n_chunks, v0, v1);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = base + u * kWarpSize;
                if (c < n_chunks) {
                    const float4 first_half = x_smem4[2 * c + swap_halves];
                    const float4 second_half = x_smem4[2 * c + 1 - swap_halves];
                    const float4 xa = swap_halves ? second_half : first_half;
                    const float4 xb = swap_halves ? first_half : second_half;
                    acc0 = dot8(v0[u], xa, xb, acc0);
                    acc1 = dot8(v1[u], xa, xb, acc1);
                }
            }
        }
        acc0 = warp_sum(acc0);
        acc1 = warp_sum(acc1);
        if (lane == 0) {
            if (MODE == kGemvNormSwiglu) {
                const float silu = acc0 / (1.0f + expf(-acc0));
                p.y[task] = silu * acc1;
            } else if (MODE == kGemvResidual) {
                p.y[r0] += acc0;
                if (r1 != r0) p.y[r1] += acc1;
            } else {
                p.y[r0] = acc0;
                if (r1 != r0) p.y[r1] = acc1;
            }
        }
    }
}

// ---- int8 / q4 -------------------------------------------------------------------------------
// Same modes, staging and grid-stride task loop as the bf16 kernel; what differs:
//   - a task is kQuantRows = 4 rows (SwiGLU: gate rows i, i+1 and up rows I+i, I+i+1), so each
//     staged input value read from shared memory feeds four rows (a 16-byte chunk carries 16 or
//     32 values: with two rows, reading x would cost 4-8 shared-memory bytes per weight byte);
//   - lane l reads chunks l, l + 32, ... of every row, kQuantUnroll chunks of each of the 4 rows
//     in flight (16 x 16 bytes per lane), and sums as quant.cuh's rows_dot says;
//   - the staged input is swizzled per chunk (quant.cuh) so the 16-byte shared loads of a
//     quarter-warp hit distinct banks.
constexpr int kQuantRows = 4;
// 4: a warp keeps 8 KB in flight. With 2 (4 KB), the 8B shape's int8 GEMVs read 1.5-2.7 TB/s
// in ncu: eight such warps per SM cover too little of the DRAM latency. Same per-lane chunk
// order whatever the unroll, so the sums are unchanged.
constexpr int kQuantUnroll = 4;

struct QuantGemvParams {
    const uint8_t *weight;
    const void *scales;
    const float *x;
    const float *norm_weight;
    float *y;
    float *normed_out;
    int rows, cols, n_chunks, n_tasks, out_rows, scales_per_row;
    int64_t row_bytes;
    float eps;
};

// The task's rows (clamped to the matrix) and which outputs it owns.
template <int MODE>
__device__ __forceinline__ void quant_task_rows(const QuantGemvParams &p, int task,
                                                int (&row)[kQuantRows], int &first_out,
                                                int &n_out) {
    if (MODE == kGemvNormSwiglu) {
        first_out = 2 * task;
        n_out = min(2, p.out_rows - first_out);
        const int second = first_out + n_out - 1;
        row[0] = first_out;
        row[1] = second;
        row[2] = p.out_rows + first_out;
        row[3] = p.out_rows + second;
    } else {
        first_out = kQuantRows * task;
        n_out = min(kQuantRows, p.rows - first_out);
#pragma unroll
        for (int r = 0; r < kQuantRows; ++r) row[r] = first_out + min(r, n_out - 1);
    }
}

template <int FMT, int MODE, int WARPS>
__global__ void __launch_bounds__(WARPS * kWarpSize) gemv_quant_kernel(const QuantGemvParams p) {
    constexpr int kThreads = WARPS * kWarpSize;
    constexpr int F = QuantFormat<FMT>::kValuesPerChunk / 4;  // float4s per chunk
    constexpr int R = kQuantRows;
    extern __shared__ float4 x_smem4[];              // [n_chunks * F], swizzled
    __shared__ float scratch[WARPS];

    const int warp = threadIdx.x / kWarpSize;
    const int lane = threadIdx.x % kWarpSize;
    const int task_stride = gridDim.x * WARPS;
    int task = blockIdx.x * WARPS + warp;

    // Weights do not depend on earlier kernels: pull this warp's first rows into L2.
    if (task < p.n_tasks && lane < R) {
        int row[R], first_out, n_out;
        quant_task_rows<MODE>(p, task, row, first_out, n_out);
        int my_row = row[0];
        bool distinct = true;
#pragma unroll
        for (int r = 1; r < R; ++r) {
            if (lane == r) {
                my_row = row[r];
                distinct = row[r] != row[r - 1];
            }
        }
        if (distinct) prefetch_l2(p.weight + (size_t)my_row * p.row_bytes, (uint32_t)p.row_bytes);
    }
    pdl_wait();
    pdl_launch_dependents();

    const int n_float4 = p.n_chunks * F;
    const float sum_sq = stage_vector<FMT, kThreads>(x_smem4, p.x, p.cols, n_float4, threadIdx.x);
    if (mode_has_norm(MODE)) {
        // block_sum ends with a barrier: every staged element is visible below.
        const float total = block_sum<kThreads>(sum_sq, scratch);
        const float inv_rms = 1.0f / sqrtf(total / (float)p.cols + p.eps);
        const bool write_normed = p.normed_out != nullptr && blockIdx.x == 0;
        float *x_smem = reinterpret_cast<float *>(x_smem4);
        for (int i = threadIdx.x; i < p.cols; i += kThreads) {
            float &slot = x_smem[4 * swizzled_float4<FMT>(i >> 2) + (i & 3)];
            const float n = slot * inv_rms * p.norm_weight[i];
            slot = n;
            if (write_normed) p.normed_out[i] = n;
        }
    }
    __syncthreads();

    for (; task < p.n_tasks; task += task_stride) {
        int row[R], first_out, n_out;
        quant_task_rows<MODE>(p, task, row, first_out, n_out);
        const uint8_t *row_ptr[R];
        const void *scale_ptr[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            row_ptr[r] = p.weight + (size_t)row[r] * p.row_bytes;
            scale_ptr[r] = static_cast<const char *>(p.scales) +
                           (size_t)row[r] * p.scales_per_row * weight_scale_bytes(FMT);
        }
        float acc[R];
        rows_dot<FMT, R, kQuantUnroll>(row_ptr, scale_ptr, p.n_chunks, x_smem4, lane, acc);
        if (lane == 0) {
            if (MODE == kGemvNormSwiglu) {
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    if (k < n_out) {
                        const float gate = acc[k], up = acc[2 + k];
                        const float silu = gate / (1.0f + expf(-gate));
                        p.y[first_out + k] = silu * up;
                    }
                }
            } else {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (r < n_out) {
                        if (MODE == kGemvResidual) p.y[first_out + r] += acc[r];
                        else p.y[first_out + r] = acc[r];
                    }
                }
            }
        }
    }
}

template <int FMT, int MODE>
const void *quant_kernel_for(int warps) {
    switch (warps) {
        case 2: return (const void *)gemv_quant_kernel<FMT, MODE, 2>;
        case 4: return (const void *)gemv_quant_kernel<FMT, MODE, 4>;
        case 8: return (const void *)gemv_quant_kernel<FMT, MODE, 8>;
    }
    return nullptr;
}

template <int FMT>
const void *quant_kernel_for(GemvMode mode, int warps) {
    switch (mode) {
        case kGemvPlain: return quant_kernel_for<FMT, kGemvPlain>(warps);
        case kGemvNorm: return quant_kernel_for<FMT, kGemvNorm>(warps);
        case kGemvResidual: return quant_kernel_for<FMT, kGemvResidual>(warps);
        case kGemvNormSwiglu: return quant_kernel_for<FMT, kGemvNormSwiglu>(warps);
    }
    return nullptr;
}

template <int FMT, int MODE>
cudaError_t launch_quant(int warps, dim3 grid, int smem, cudaStream_t stream, bool pdl,
                         const QuantGemvParams &p) {
    const dim3 block(warps * kWarpSize);
    switch (warps) {
        case 2: return launch_kernel(gemv_quant_kernel<FMT, MODE, 2>, grid, block, smem, stream, pdl, p);
        case 4: return launch_kernel(gemv_quant_kernel<FMT, MODE, 4>, grid, block, smem, stream, pdl, p);
        case 8: return launch_kernel(gemv_quant_kernel<FMT, MODE, 8>, grid, block, smem, stream, pdl, p);
    }
    return cudaErrorInvalidConfiguration;
}

template <int FMT>
cudaError_t launch_quant(GemvMode mode, int warps, dim3 grid, int smem, cudaStream_t stream,
                         bool pdl, const QuantGemvParams &p) {
    switch (mode) {
        case kGemvPlain: return launch_quant<FMT, kGemvPlain>(warps, grid, smem, stream, pdl, p);
        case kGemvNorm: return launch_quant<FMT, kGemvNorm>(warps, grid, smem, stream, pdl, p);
        case kGemvResidual: return launch_quant<FMT, kGemvResidual>(warps, grid, smem, stream, pdl, p);
        case kGemvNormSwiglu:
            return launch_quant<FMT, kGemvNormSwiglu>(warps, grid, smem, stream, pdl, p);
    }
    return cudaErrorInvalidValue;
}

// ---- dispatch ------------------------------------------------------------------------------------
// bf16: chunks per lane in flight U = 4, 8 or 12 (the smallest that holds a whole row when one
// does, else 8), so that rows up to 3072 columns take one round of loads per task.
int bf16_unroll(int cols) {
    const int per_lane = ceil_div(ceil_div(padded_cols(cols), 8), kWarpSize);
    return per_lane <= 4 ? 4 : per_lane <= 8 ? 8 : per_lane <= 12 ? 12 : 8;
}

template <int MODE, int WARPS>
const void *bf16_kernel_for(int unroll) {
    switch (unroll) {
        case 4: return (const void *)gemv_bf16_kernel<MODE, WARPS, 4>;
        case 8: return (const void *)gemv_bf16_kernel<MODE, WARPS, 8>;
        case 12: return (const void *)gemv_bf16_kernel<MODE, WARPS, 12>;
    }
    return nullptr;
}

template <int WARPS>
const void *gemv_kernel_for(GemvMode mode, int unroll) {
    switch (mode) {
        case kGemvPlain: return bf16_kernel_for<kGemvPlain, WARPS>(unroll);
        case kGemvNorm: return bf16_kernel_for<kGemvNorm, WARPS>(unroll);
        case kGemvResidual: return bf16_kernel_for<kGemvResidual, WARPS>(unroll);
        case kGemvNormSwiglu: return bf16_kernel_for<kGemvNormSwiglu, WARPS>(unroll);
    }
    return nullptr;
}

const void *gemv_kernel_for(GemvMode mode, int warps, int format, int unroll) {
    if (format == OG_WEIGHTS_INT8) return quant_kernel_for<OG_WEIGHTS_INT8>(mode, warps);
    if (format == OG_WEIGHTS_Q4) return quant_kernel_for<OG_WEIGHTS_Q4>(mode, warps);
    if (format != OG_WEIGHTS_BF16) return nullptr;
    switch (warps) {
        case 2: return gemv_kernel_for<2>(mode, unroll);
        case 4: return gemv_kernel_for<4>(mode, unroll);
        case 8: return gemv_kernel_for<8>(mode, unroll);
    }
    return nullptr;
}

int gemv_tasks(GemvMode mode, int rows, int format) {
    if (format != OG_WEIGHTS_BF16)  // kQuantRows rows (SwiGLU: 2 outputs) per task
        return mode == kGemvNormSwiglu ? ceil_div(rows / 2, 2) : ceil_div(rows, kQuantRows);
    return mode == kGemvNormSwiglu ? rows / 2 : ceil_div(rows, 2);
}

template <int MODE, int WARPS>
cudaError_t launch_bf16(int unroll, dim3 grid, int smem, cudaStream_t stream, bool pdl,
                        const GemvParams &p) {
    const dim3 block(WARPS * kWarpSize);
    switch (unroll) {
        case 4: return launch_kernel(gemv_bf16_kernel<MODE, WARPS, 4>, grid, block, smem, stream, pdl, p);
        case 8: return launch_kernel(gemv_bf16_kernel<MODE, WARPS, 8>, grid, block, smem, stream, pdl, p);
        case 12: return launch_kernel(gemv_bf16_kernel<MODE, WARPS, 12>, grid, block, smem, stream, pdl, p);
    }
    return cudaErrorInvalidConfiguration;
}

template <int WARPS>
cudaError_t launch_warps(GemvMode mode, int unroll, dim3 grid, int smem, cudaStream_t stream,
                         bool pdl, const GemvParams &p) {
    switch (mode) {
        case kGemvPlain: return launch_bf16<kGemvPlain, WARPS>(unroll, grid, smem, stream, pdl, p);
        case kGemvNorm: return launch_bf16<kGemvNorm, WARPS>(unroll, grid, smem, stream, pdl, p);
        case kGemvResidual: return launch_bf16<kGemvResidual, WARPS>(unroll, grid, smem, stream, pdl, p);
        case kGemvNormSwiglu:
            return launch_bf16<kGemvNormSwiglu, WARPS>(unroll, grid, smem, stream, pdl, p);
    }
    return cudaErrorInvalidValue;
}

// Shared memory of a launch: the staged input, plus the norm weights for bf16 norm modes.
size_t gemv_smem_bytes(GemvMode mode, int cols, int format) {
    const size_t input = gemv_input_smem_bytes(cols, format);
    return format == OG_WEIGHTS_BF16 && mode_has_norm(mode) ? 2 * input : input;
}

}  // namespace

size_t gemv_input_smem_bytes(int cols, int format) {
    const int per_chunk = format == OG_WEIGHTS_BF16 ? kRowAlignElems : weight_values_per_chunk(format);
    return (size_t)round_up(cols, per_chunk) * sizeof(float);
}

cudaError_t gemv_plan(GemvMode mode, int rows, int cols, GemvPlan *plan, int format) {
    const int unroll = bf16_unroll(cols);
    if (gemv_kernel_for(mode, kGemvMaxWarps, format, unroll) == nullptr || rows <= 0 || cols <= 0 ||
        plan == nullptr || (mode == kGemvNormSwiglu && rows % 2 != 0))
        return cudaErrorInvalidValue;
    int sm_count = 0;
    OG_CUDA_RETURN_IF(current_sm_count(&sm_count));
    // Fewer warps per block when the matrix has few rows, so that about two blocks land on
    // every SM (a block stages x once, so larger blocks are cheaper when there is work).
    const int tasks = gemv_tasks(mode, rows, format);
    // Quantized formats aim at one block per SM rather than two: their weights are 2-3.5x
    // smaller, so every block's staging of x (an L2 read of the whole input) weighs more.
    const int blocks_wanted = format == OG_WEIGHTS_BF16 ? 2 * sm_count : sm_count;
    int warps = kGemvMaxWarps;
    while (warps > 2 && ceil_div(tasks, warps) < blocks_wanted) warps /= 2;
    const void *kernel = gemv_kernel_for(mode, warps, format, unroll);
    const size_t smem_bytes = gemv_smem_bytes(mode, cols, format);
    OG_CUDA_RETURN_IF(allow_dynamic_smem(kernel, smem_bytes));
    int blocks_per_sm = 0;
    OG_CUDA_RETURN_IF(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &blocks_per_sm, kernel, warps * kWarpSize, smem_bytes));
    if (blocks_per_sm <= 0) return cudaErrorInvalidConfiguration;
    const int needed = ceil_div(tasks, warps);
    plan->grid = needed < blocks_per_sm * sm_count ? needed : blocks_per_sm * sm_count;
    plan->warps = warps;
    plan->unroll = unroll;
    plan->smem_bytes = (int)smem_bytes;
    plan->format = format;
    return cudaSuccess;
}

cudaError_t launch_gemv(GemvMode mode, const GemvPlan &plan, const GemvArgs &args,
                        cudaStream_t stream, bool pdl) {
    if (plan.grid <= 0) return cudaErrorInvalidConfiguration;
    if (args.format != plan.format) return cudaErrorInvalidValue;
    if (args.format != OG_WEIGHTS_BF16) {
        if (args.scales == nullptr) return cudaErrorInvalidValue;
        QuantGemvParams q;
        q.weight = static_cast<const uint8_t *>(args.weight);
        q.scales = args.scales;
        q.x = args.x;
        q.norm_weight = args.norm_weight;
        q.y = args.y;
        q.normed_out = args.normed_out;
        q.rows = args.rows;
        q.cols = args.cols;
        q.n_chunks = ceil_div(args.cols, weight_values_per_chunk(args.format));
        q.n_tasks = gemv_tasks(mode, args.rows, args.format);
        q.out_rows = mode == kGemvNormSwiglu ? args.rows / 2 : args.rows;
        q.scales_per_row = (int)weight_scales_per_row(args.format, args.cols);
        q.row_bytes = weight_row_bytes(args.format, args.cols);
        q.eps = args.eps;
        const dim3 grid(plan.grid);
        if (args.format == OG_WEIGHTS_INT8)
            return launch_quant<OG_WEIGHTS_INT8>(mode, plan.warps, grid, plan.smem_bytes, stream, pdl, q);
        return launch_quant<OG_WEIGHTS_Q4>(mode, plan.warps, grid, plan.smem_bytes, stream, pdl, q);
    }
    GemvParams p;
    p.weight = static_cast<const __nv_bfloat16 *>(args.weight);
    p.x = args.x;
    p.norm_weight = args.norm_weight;
    p.y = args.y;
    p.normed_out = args.normed_out;
    p.rows = args.rows;
    p.cols = args.cols;
    p.ld = padded_cols(args.cols);
    p.n_tasks = gemv_tasks(mode, args.rows, OG_WEIGHTS_BF16);
    p.out_rows = mode == kGemvNormSwiglu ? args.rows / 2 : args.rows;
    p.eps = args.eps;
    const dim3 grid(plan.grid);
    switch (plan.warps) {
        case 2: return launch_warps<2>(mode, plan.unroll, grid, plan.smem_bytes, stream, pdl, p);
        case 4: return launch_warps<4>(mode, plan.unroll, grid, plan.smem_bytes, stream, pdl, p);
        case 8: return launch_warps<8>(mode, plan.unroll, grid, plan.smem_bytes, stream, pdl, p);
    }
    return cudaErrorInvalidConfiguration;
}

}  // namespace og
