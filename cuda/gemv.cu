// gemv.cu — the GEMV dispatch over every weight format (kernels.cuh: gemv_plan, launch_gemv,
// gemv_input_smem_bytes): bf16 to gemv_bf16.cu, int8 to gemv_int8.cu, q4 to gemv_q4.cu.
#include "gemv.cuh"

namespace og {
namespace {

const void *gemv_kernel_for(GemvMode mode, int warps, int format, int unroll) {
    if (format == OG_WEIGHTS_INT8)
        return int8_kernel_for(mode, warps, kQuantStages);  // the default; gemv_plan may widen
    if (format != OG_WEIGHTS_BF16) return nullptr;
    return bf16_kernel_for(mode, warps, unroll);
}

int gemv_tasks(GemvMode mode, int rows, int format) {
    if (format != OG_WEIGHTS_BF16)  // 16 rows (SwiGLU: 8 outputs) per task
        return mode == kGemvNormSwiglu ? ceil_div(rows / 2, 8) : ceil_div(rows, kQuantTaskRows);
    return mode == kGemvNormSwiglu ? rows / 2 : ceil_div(rows, 2);
}


// Shared memory of a launch: the staged input, plus the norm weights for bf16 norm modes.
size_t gemv_smem_bytes(GemvMode mode, int cols, int format) {
    const size_t input = gemv_input_smem_bytes(cols, format);
    return format == OG_WEIGHTS_BF16 && mode_has_norm(mode) ? 2 * input : input;
}

}  // namespace

size_t gemv_input_smem_bytes(int cols, int format) {
    if (format == OG_WEIGHTS_Q4) return gemv_q4_smem_bytes(cols);
    if (format == OG_WEIGHTS_BF16) return (size_t)round_up(cols, kRowAlignElems) * sizeof(float);
    // hi + lo fp16 per column, whole k-blocks (4 chunks), then the load ring
    return (size_t)round_up(cols, 4 * weight_values_per_chunk(format)) * 2 * sizeof(__half) +
           int8_ring_bytes();
}

cudaError_t gemv_plan(GemvMode mode, int rows, int cols, GemvPlan *plan, int format, bool bulk_stream) {
    if (format == OG_WEIGHTS_Q4) return gemv_q4_plan(mode, rows, cols, plan, bulk_stream);
    const int unroll = bf16_unroll(cols);
    if (gemv_kernel_for(mode, kGemvMaxWarps, format, unroll) == nullptr || rows <= 0 || cols <= 0 ||
        plan == nullptr || (mode == kGemvNormSwiglu && rows % 2 != 0))
        return cudaErrorInvalidValue;
    int sm_count = 0;
    OG_CUDA_RETURN_IF(current_sm_count(&sm_count));
    // Fewer warps per block when the matrix has few rows, so that about three quarters of the
    // SMs get a block (a block stages x once, and every block of a grid adds to the time its
    // launch and its end take, so larger blocks are cheaper when there is work).
    const int tasks = gemv_tasks(mode, rows, format);
    const int blocks_wanted = 3 * sm_count / 4;
    int warps = kGemvMaxWarps;
    // Quantized: a block of 8 warps per 16-row task (the warps split its columns).
    while (format == OG_WEIGHTS_BF16 && warps > 2 && ceil_div(tasks, warps) < blocks_wanted) warps /= 2;
    const void *kernel = gemv_kernel_for(mode, warps, format, unroll);
    size_t smem_bytes = gemv_smem_bytes(mode, cols, format);
    int stages = format == OG_WEIGHTS_BF16 ? 0 : kQuantStages;
    OG_CUDA_RETURN_IF(allow_dynamic_smem(kernel, smem_bytes));
    int blocks_per_sm = 0;
    OG_CUDA_RETURN_IF(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &blocks_per_sm, kernel, warps * kWarpSize, smem_bytes));
    if (blocks_per_sm <= 0) return cudaErrorInvalidConfiguration;
    if (format != OG_WEIGHTS_BF16) {
        // A configuration's blocks per SM (0 where it does not fit or the opt-in is refused).
        const size_t input_smem = smem_bytes - int8_ring_bytes();
        auto blocks_of = [&](int w, int s, size_t *smem) {
            *smem = input_smem + int8_ring_bytes(s, w);
            const void *k = int8_kernel_for(mode, w, s);
            int blocks = 0;
            if (allow_dynamic_smem(k, *smem) != cudaSuccess ||
                cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k, w * kWarpSize, *smem) != cudaSuccess)
                blocks = 0;
            (void)cudaGetLastError();  // a refused configuration is not an error
            return blocks;
        };
        // Where the default fits only two blocks of 8 warps per SM (a large staged input) and a
        // wide warp keeps kQuantWideMinKBlocks k-blocks of a task, one wide block of 16 warps
        // when it fits: the same warps, more k-blocks in flight.
        const int n_kblocks = ceil_div(ceil_div(cols, weight_values_per_chunk(format)), 4);
        size_t wide_smem = 0;
        if (blocks_per_sm <= 2 && n_kblocks >= kQuantWideWarps * kQuantWideMinKBlocks &&
            blocks_of(kQuantWideWarps, kQuantWideStages, &wide_smem) >= 1) {
            warps = kQuantWideWarps;
            stages = kQuantWideStages;
            smem_bytes = wide_smem;
        }
        kernel = int8_kernel_for(mode, warps, stages);
        OG_CUDA_RETURN_IF(allow_dynamic_smem(kernel, smem_bytes));
        OG_CUDA_RETURN_IF(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &blocks_per_sm, kernel, warps * kWarpSize, smem_bytes));
        if (blocks_per_sm <= 0) return cudaErrorInvalidConfiguration;
    }
    const int needed = format == OG_WEIGHTS_BF16 ? ceil_div(tasks, warps) : tasks;
    plan->grid = needed < blocks_per_sm * sm_count ? needed : blocks_per_sm * sm_count;
    plan->warps = warps;
    plan->unroll = unroll;
    plan->stages = stages;
    plan->smem_bytes = (int)smem_bytes;
    plan->format = format;
    return cudaSuccess;
}


// The bf16 kernel's parameters for n vectors x_j = args.x + j * x_stride -> y_j (n = 1: the
// decode body's GEMV).
static GemvParams bf16_params(GemvMode mode, const GemvArgs &args, int rows, int cols, int n,
                              int64_t x_stride, int64_t y_stride) {
    GemvParams p;
    p.weight = static_cast<const __nv_bfloat16 *>(args.w.data);
    p.x = args.x;
    p.norm_weight = args.norm_weight;
    p.y = args.y;
    p.normed_out = args.normed_out;
    p.rows = rows;
    p.cols = cols;
    p.ld = padded_cols(cols);
    p.n_tasks = gemv_tasks(mode, rows, OG_WEIGHTS_BF16);
    p.out_rows = mode == kGemvNormSwiglu ? rows / 2 : rows;
    p.eps = args.eps;
    p.residual_settled = mode == kGemvResidual && n == 1 && args.residual_settled;
    p.nv = n;
    p.x_stride = x_stride;
    p.y_stride = y_stride;
    return p;
}

cudaError_t launch_gemv(GemvMode mode, const GemvPlan &plan, const GemvArgs &args,
                        cudaStream_t stream, bool pdl) {
    if (plan.grid <= 0) return cudaErrorInvalidConfiguration;
    if (args.w.format != plan.format) return cudaErrorInvalidValue;
    // Row counts of a GEMV fit in int (gemv_plan's shapes); only stacked experts need int64.
    if (args.w.rows < 1 || args.w.rows > INT32_MAX || args.w.cols < 1) return cudaErrorInvalidValue;
    const int rows = (int)args.w.rows, cols = args.w.cols;
    if (args.w.format == OG_WEIGHTS_Q4) return launch_gemv_q4(mode, plan, args, stream, pdl);
    if (args.w.format != OG_WEIGHTS_BF16) {
        if (args.w.scales == nullptr) return cudaErrorInvalidValue;
        QuantGemvParams q;
        q.weight = static_cast<const uint8_t *>(args.w.data);
        q.scales = static_cast<const float *>(args.w.scales);
        q.x = args.x;
        q.norm_weight = args.norm_weight;
        q.y = args.y;
        q.normed_out = args.normed_out;
        q.rows = rows;
        q.cols = cols;
        set_int8_row_layout(q, cols);
        q.n_tasks = gemv_tasks(mode, rows, args.w.format);
        q.out_rows = mode == kGemvNormSwiglu ? rows / 2 : rows;
        q.eps = args.eps;
        q.selected = nullptr;
        q.tasks_per_expert = 0;
        return launch_int8(mode, plan, stream, pdl, q);
    }
    const GemvParams p = bf16_params(mode, args, rows, cols, 1, 0, 0);
    return launch_bf16(mode, plan.warps, plan.unroll, dim3(plan.grid), plan.smem_bytes, stream, pdl, p);
}

// Shared memory of the multi-vector instance over n vectors: n staged inputs (+ the norm weights).
static size_t gemv_multi_smem_bytes(GemvMode mode, int cols, int n) {
    const size_t input = gemv_input_smem_bytes(cols, OG_WEIGHTS_BF16);
    return (n + (mode_has_norm(mode) ? 1 : 0)) * input;
}

cudaError_t gemv_multi_plan(GemvMode mode, const GemvPlan &single, int rows, int cols,
                            GemvMultiPlan *plan) {
    if (plan == nullptr || single.grid <= 0 || rows <= 0 || cols <= 0) return cudaErrorInvalidValue;
    plan->single = single;
    for (int &g : plan->grid) g = 0;
    if (single.format != OG_WEIGHTS_BF16) return cudaSuccess;  // per-vector launches
    int sm_count = 0;
    OG_CUDA_RETURN_IF(current_sm_count(&sm_count));
    const int needed = ceil_div(gemv_tasks(mode, rows, OG_WEIGHTS_BF16), single.warps);
    // Per n, the blocks of n's instance (bf16_instance) that fit with n staged inputs: fewer
    // vectors, more blocks per SM (and more weight loads in flight). The largest n of an
    // instance whose inputs fit a block sets that kernel's shared-memory limit; larger n run as
    // per-vector launches (not an error). Neither the grid nor the instance changes a vector's
    // arithmetic (a warp computes whole rows, every block stages and norms the whole input, and
    // each vector has its own accumulators); the block size and unroll do, so they are the
    // single plan's.
    bool limit_set[kGemvMaxVectors + 1] = {};
    for (int n = kGemvMaxVectors; n >= 2; --n) {
        const int nv = bf16_instance(n);
        const void *kernel = bf16_kernel_for(mode, single.warps, single.unroll, nv);
        if (kernel == nullptr) return cudaErrorInvalidValue;
        const size_t smem = gemv_multi_smem_bytes(mode, cols, n);
        int blocks_per_sm = 0;
        if ((!limit_set[nv] && allow_dynamic_smem(kernel, smem) != cudaSuccess) ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel,
                                                          single.warps * kWarpSize, smem) != cudaSuccess ||
            blocks_per_sm <= 0) {
            (void)cudaGetLastError();  // too large for a block
            continue;
        }
        limit_set[nv] = true;
        plan->grid[n] = needed < blocks_per_sm * sm_count ? needed : blocks_per_sm * sm_count;
    }
    return cudaSuccess;
}

cudaError_t launch_gemv_multi(GemvMode mode, const GemvMultiPlan &plan, const GemvArgs &args, int n,
                              int64_t x_stride, int64_t y_stride, cudaStream_t stream, bool pdl) {
    if (n < 1 || n > kGemvMaxVectors) return cudaErrorInvalidValue;
    if (n == 1 || plan.grid[n] <= 0) {
        for (int j = 0; j < n; ++j) {
            GemvArgs one = args;
            one.x = args.x + (size_t)j * x_stride;
            one.y = args.y + (size_t)j * y_stride;
            if (args.normed_out != nullptr) one.normed_out = args.normed_out + (size_t)j * x_stride;
            one.residual_settled = false;
            OG_CUDA_RETURN_IF(launch_gemv(mode, plan.single, one, stream, pdl));
        }
        return cudaSuccess;
    }
    if (args.w.format != OG_WEIGHTS_BF16) return cudaErrorInvalidValue;
    if (args.w.rows < 1 || args.w.rows > INT32_MAX || args.w.cols < 1) return cudaErrorInvalidValue;
    const int rows = (int)args.w.rows, cols = args.w.cols;
    const GemvParams p = bf16_params(mode, args, rows, cols, n, x_stride, y_stride);
    return launch_bf16(mode, plan.single.warps, plan.single.unroll, dim3(plan.grid[n]),
                       (int)gemv_multi_smem_bytes(mode, cols, n), stream, pdl, p);
}


}  // namespace og
