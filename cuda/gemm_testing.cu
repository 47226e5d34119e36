// gemm_testing.cu — og_test_gemm and og_test_gemm_grouped (onegraph_testing.h; testing library
// only): host arrays in, the prefill GEMM of gemm.cu, host arrays out.
#include <vector>

#include "onegraph_testing.h"
#include "prefill.cuh"
#include "reliability.cuh"
namespace {
struct DeviceBuffers {  // released on every path out of og_test_gemm(_grouped)
    void *a = nullptr, *a_lo = nullptr, *w = nullptr, *y = nullptr, *index = nullptr;
    ~DeviceBuffers() {
        og::device_free(a);
        og::device_free(a_lo);
        og::device_free(w);
        og::device_free(y);
        og::device_free(index);
    }
};
}  // namespace

extern "C" OG_API og_status og_test_gemm(const uint16_t *a, const uint16_t *a_lo,
                                         const uint16_t *w, int32_t rows, int32_t cols,
                                         int32_t depth, int32_t accumulate, float *y) {
    using namespace og;
    if (a == nullptr || w == nullptr || y == nullptr || rows <= 0 || cols <= 0 || depth <= 0 ||
        rows > (1 << 20) || cols > (1 << 20) || depth > (1 << 20) ||
        (accumulate != 0 && accumulate != 1))
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_test_gemm: NULL array or bad size (rows=%d cols=%d depth=%d accumulate=%d)",
                         rows, cols, depth, accumulate);
    og_status status = require_device();
    if (status != OG_OK) return status;
    const int ld = padded_cols(depth);
    const size_t a_bytes = (size_t)rows * ld * 2, w_bytes = (size_t)cols * ld * 2;
    const size_t y_bytes = (size_t)rows * cols * sizeof(float);
    DeviceBuffers d;
    OG_CUDA_TRY(device_alloc(&d.a, a_bytes));
    if (a_lo != nullptr) OG_CUDA_TRY(device_alloc(&d.a_lo, a_bytes));
    OG_CUDA_TRY(device_alloc(&d.w, w_bytes));
    OG_CUDA_TRY(device_alloc(&d.y, y_bytes));
    OG_CUDA_TRY(cudaMemset(d.a, 0, a_bytes));  // pad columns are zeros, as in the library
    OG_CUDA_TRY(cudaMemset(d.w, 0, w_bytes));
    OG_CUDA_TRY(cudaMemcpy2D(d.a, (size_t)ld * 2, a, (size_t)depth * 2, (size_t)depth * 2, rows,
                             cudaMemcpyHostToDevice));
    if (a_lo != nullptr) {
        OG_CUDA_TRY(cudaMemset(d.a_lo, 0, a_bytes));
        OG_CUDA_TRY(cudaMemcpy2D(d.a_lo, (size_t)ld * 2, a_lo, (size_t)depth * 2, (size_t)depth * 2,
                                 rows, cudaMemcpyHostToDevice));
    }
    OG_CUDA_TRY(cudaMemcpy2D(d.w, (size_t)ld * 2, w, (size_t)depth * 2, (size_t)depth * 2, cols,
                             cudaMemcpyHostToDevice));
    // y in: the accumulation input, or the caller's poison (never read when accumulate == 0)
    OG_CUDA_TRY(cudaMemcpy(d.y, y, y_bytes, cudaMemcpyHostToDevice));
    const GemmArgs args = {static_cast<const __nv_bfloat16 *>(d.a),
                           static_cast<const __nv_bfloat16 *>(d.a_lo), ld,
                           static_cast<const __nv_bfloat16 *>(d.w), ld, static_cast<float *>(d.y),
                           cols, rows, cols, ld, accumulate != 0};
    OG_CUDA_TRY(launch_gemm_bf16(args, 0));
    OG_CUDA_TRY(cudaDeviceSynchronize());
    OG_CUDA_TRY(cudaMemcpy(y, d.y, y_bytes, cudaMemcpyDeviceToHost));
    return OG_OK;
}

extern "C" OG_API og_status og_test_gemm_grouped(const uint16_t *a, int32_t a_total, const uint16_t *w,
                                                 int32_t groups, int32_t cols, int32_t depth,
                                                 const int32_t *counts, const int32_t *a_rows,
                                                 int32_t a_row_div, const int32_t *y_rows,
                                                 int32_t stride, int32_t y_total, float *y) {
    using namespace og;
    if (a == nullptr || w == nullptr || y == nullptr || counts == nullptr || a_rows == nullptr ||
        y_rows == nullptr || a_total <= 0 || a_total > (1 << 20) || groups <= 0 || groups > 4096 ||
        cols <= 0 || cols > (1 << 16) || depth <= 0 || depth > (1 << 16) || a_row_div <= 0 ||
        stride <= 0 || stride > (1 << 20) || y_total <= 0 || y_total > (1 << 20))
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_test_gemm_grouped: NULL array or bad size (a_total=%d groups=%d cols=%d "
                         "depth=%d a_row_div=%d stride=%d y_total=%d)",
                         a_total, groups, cols, depth, a_row_div, stride, y_total);
    for (int z = 0; z < groups; ++z) {
        if (counts[z] < 0 || counts[z] > stride)
            return set_error(OG_E_INVALID_ARGUMENT, "og_test_gemm_grouped: counts[%d]=%d is outside [0, %d]",
                             z, counts[z], stride);
        for (int m = 0; m < counts[z]; ++m) {
            const int64_t i = (int64_t)z * stride + m;
            if (a_rows[i] < 0 || a_rows[i] / a_row_div >= a_total || y_rows[i] < 0 || y_rows[i] >= y_total)
                return set_error(OG_E_INVALID_ARGUMENT,
                                 "og_test_gemm_grouped: entry %lld names a row %d (a) / %d (y) outside "
                                 "[0, %d) / [0, %d)", (long long)i, a_rows[i] / a_row_div, y_rows[i],
                                 a_total, y_total);
        }
    }
    og_status status = require_device();
    if (status != OG_OK) return status;
    const int ld = padded_cols(depth);
    const size_t a_bytes = (size_t)a_total * ld * 2, w_bytes = (size_t)groups * cols * ld * 2;
    const size_t y_bytes = (size_t)y_total * cols * sizeof(float);
    const size_t list_elems = (size_t)groups * stride;
    DeviceBuffers d;
    OG_CUDA_TRY(device_alloc(&d.a, a_bytes));
    OG_CUDA_TRY(device_alloc(&d.w, w_bytes));
    OG_CUDA_TRY(device_alloc(&d.y, y_bytes));
    OG_CUDA_TRY(device_alloc(&d.index, (groups + 2 * list_elems) * sizeof(int32_t)));
    OG_CUDA_TRY(cudaMemset(d.a, 0, a_bytes));  // pad columns are zeros, as in the library
    OG_CUDA_TRY(cudaMemset(d.w, 0, w_bytes));
    OG_CUDA_TRY(cudaMemcpy2D(d.a, (size_t)ld * 2, a, (size_t)depth * 2, (size_t)depth * 2, a_total,
                             cudaMemcpyHostToDevice));
    OG_CUDA_TRY(cudaMemcpy2D(d.w, (size_t)ld * 2, w, (size_t)depth * 2, (size_t)depth * 2,
                             (size_t)groups * cols, cudaMemcpyHostToDevice));
    OG_CUDA_TRY(cudaMemcpy(d.y, y, y_bytes, cudaMemcpyHostToDevice));
    int32_t *d_counts = static_cast<int32_t *>(d.index), *d_a_rows = d_counts + groups,
            *d_y_rows = d_a_rows + list_elems;
    OG_CUDA_TRY(cudaMemcpy(d_counts, counts, groups * sizeof(int32_t), cudaMemcpyHostToDevice));
    OG_CUDA_TRY(cudaMemcpy(d_a_rows, a_rows, list_elems * sizeof(int32_t), cudaMemcpyHostToDevice));
    OG_CUDA_TRY(cudaMemcpy(d_y_rows, y_rows, list_elems * sizeof(int32_t), cudaMemcpyHostToDevice));
    GemmArgs args = {static_cast<const __nv_bfloat16 *>(d.a), nullptr, ld,
                     static_cast<const __nv_bfloat16 *>(d.w), ld, static_cast<float *>(d.y), cols,
                     stride, cols, ld, false};
    args.a_rows = d_a_rows;
    args.a_row_div = a_row_div;
    args.y_rows = d_y_rows;
    args.group_rows = d_counts;
    args.groups = groups;
    args.w_group_stride = (int64_t)cols * ld;
    args.index_stride = stride;
    OG_CUDA_TRY(launch_gemm_bf16(args, 0));
    OG_CUDA_TRY(cudaDeviceSynchronize());
    OG_CUDA_TRY(cudaMemcpy(y, d.y, y_bytes, cudaMemcpyDeviceToHost));
    return OG_OK;
}
