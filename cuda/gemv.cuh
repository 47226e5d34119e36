// gemv.cuh — what the GEMV files share: the bf16 kernel (gemv_bf16.cu), the int8 kernels
// (gemv_int8.cu, with the MoE experts' int8 launchers) and the dispatch over every format
// (gemv.cu: gemv_plan, launch_gemv; q4 in gemv_q4.cu). Not part of kernels.cuh's interface.
#pragma once

#include "kernels.cuh"
#include "quant.cuh"

namespace og {

// ---- bf16 (gemv_bf16.cu) --------------------------------------------------------------------
constexpr int kGemvMaxWarps = 8;

struct GemvParams {
    const __nv_bfloat16 *weight;
    const float *x;
    const float *norm_weight;
    float *y;
    float *normed_out;
    int rows, cols, ld, n_tasks, out_rows;
    float eps;
    int residual_settled;    // kGemvResidual, one vector: y may be read before the PDL wait
    int nv;                  // vectors: 1, or up to kGemvMaxVectors (the verify body)
    int64_t x_stride;        // floats from one vector's x (and normed_out) to the next's
    int64_t y_stride;        // floats from one vector's y to the next's
};

// Chunks per lane in flight for a row of `cols` columns (4, 8 or 12).
int bf16_unroll(int cols);
// The instance a launch of n vectors runs: the kernel holds accumulators for NV = 1, 2, 4 or
// kGemvMaxVectors vectors (the fewest that hold n), so a launch of few vectors keeps the
// registers, and the blocks per SM, of a small instance.
int bf16_instance(int n);
// The bf16 kernel for a mode, block size (2, 4 or 8 warps), unroll and instance NV
// (bf16_instance; nullptr for other values).
const void *bf16_kernel_for(GemvMode mode, int warps, int unroll, int nv = 1);
// Launch that kernel (the instance of p.nv vectors) on grid with smem bytes of dynamic shared
// memory.
cudaError_t launch_bf16(GemvMode mode, int warps, int unroll, dim3 grid, int smem, cudaStream_t stream,
                        bool pdl, const GemvParams &p);

// ---- int8 (gemv_int8.cu) --------------------------------------------------------------------
constexpr int kQuantTaskRows = 16;    // the mma's M
constexpr int kQuantWarps = 8;        // per block: a 16-row task's columns split 8 ways
// A fifth mode beside GemvMode's four, for the MoE experts (moe.cu): gate/up + SwiGLU of the
// top_k selected experts over the shared normed x, act[j, i] = silu(gate_e[i] . x) *
// (up_e[i] . x), e = selected[j]; the weights hold 2I rows per expert (gate, then up).
constexpr int kQuantMoeGateUp = 4;
constexpr int kQuantKBlocks = 4;      // MoE down: k-blocks per warp in registers (2 x 4 x 16 bytes per lane)

struct QuantGemvParams {
    const uint8_t *weight;
    const float *scales;      // [rows] row scales
    const float *x;
    const float *norm_weight;
    float *y;
    float *normed_out;
    int rows, cols, n_chunks, n_kblocks, n_tasks, out_rows;
    int64_t row_bytes;
    float eps;
    const int32_t *selected;  // kQuantMoeGateUp: the experts chosen for this token [top_k]
    int tasks_per_expert;     // kQuantMoeGateUp: ceil(I / 8)
};

// The load ring. A warp's share of a task is often only 8 k-blocks (16 rows x 4096 columns
// over 8 warps): loaded into registers, waited for, computed and reduced before the next task's
// loads went out, the loads stood idle through every compute and reduction. Instead the weights
// stream through shared memory by cp.async, kQuantStages k-blocks per lane, and a warp keeps
// kQuantStages - 1 of them in flight while it computes one, straight across its tasks. Each lane
// copies and later reads only its own slots (cp.async.wait_group makes a thread's own copies
// visible to it), so the ring needs no barrier:
//   ring_w [kQuantStages][2 (rows g, g + 8)][threads] uint4: chunk c = 4 kb + t of each row
constexpr int kQuantStages = 6;
// Wide blocks: 16 warps split a task's k-blocks 16 ways, one block per SM, so a large staged
// input (12288 columns: 48 KB) is held once per SM and the rest of shared memory is ring:
// 16 warps x 7 k-blocks in flight against 2 blocks x 8 warps x 5 with the default. gemv_plan
// takes it where the default fits only two blocks per SM and a wide warp still gets
// kQuantWideMinKBlocks k-blocks of each task (a long input such as a down projection's); with
// fewer k-blocks a warp (4096-column inputs: 2), the wide block's split costs more than it saves.
constexpr int kQuantWideWarps = 16;
constexpr int kQuantWideStages = 8;
constexpr int kQuantWideMinKBlocks = 4;

__host__ __device__ constexpr int int8_ring_bytes(int stages = kQuantStages, int warps = kQuantWarps) {
    return stages * 2 * warps * kWarpSize * 16;
}

// An int8 matrix's row layout for `cols` columns (quant.cuh), into either kernel's params.
template <typename Params>
void set_int8_row_layout(Params &q, int cols) {
    q.n_chunks = ceil_div(cols, weight_values_per_chunk(OG_WEIGHTS_INT8));
    q.n_kblocks = ceil_div(q.n_chunks, 4);
    q.row_bytes = weight_row_bytes(OG_WEIGHTS_INT8, cols);
}

// The int8 kernel for a mode, block size and ring depth (nullptr for other ones).
const void *int8_kernel_for(GemvMode mode, int warps, int stages);
// Launch the int8 kernel of the plan (the one gemv_plan sized through int8_kernel_for).
cudaError_t launch_int8(GemvMode mode, const GemvPlan &plan, cudaStream_t stream, bool pdl,
                        const QuantGemvParams &p);

}  // namespace og
