// moe_testing.cu — the og_test_moe_* entry points of moe_testing.h (testing library only): host
// arrays in, one MoE launcher of moe.cu on a private stream, host arrays out.
#include <vector>

#include "kernels.cuh"
#include "moe.cuh"
#include "moe_testing.h"
#include "quant.cuh"

namespace {

// Device buffer freed on every path out of a test entry point.
struct DeviceBuffer {
    void *ptr = nullptr;
    DeviceBuffer() = default;
    DeviceBuffer(const DeviceBuffer &) = delete;
    DeviceBuffer &operator=(const DeviceBuffer &) = delete;
    ~DeviceBuffer() {
        if (ptr) cudaFree(ptr);
    }
    cudaError_t upload(const void *src, size_t bytes) {
        cudaError_t err = cudaMalloc(&ptr, bytes);
        if (err != cudaSuccess) {
            ptr = nullptr;
            return err;
        }
        return cudaMemcpy(ptr, src, bytes, cudaMemcpyHostToDevice);
    }
    template <typename T>
    T *as() const { return static_cast<T *>(ptr); }
};

struct TestStream {
    cudaStream_t s = nullptr;
    TestStream() = default;
    TestStream(const TestStream &) = delete;
    TestStream &operator=(const TestStream &) = delete;
    ~TestStream() {
        if (s) cudaStreamDestroy(s);
    }
};

og_status to_status(cudaError_t err) {
    if (err == cudaSuccess) return OG_OK;
    if (err == cudaErrorInvalidValue) return OG_E_INVALID_ARGUMENT;
    return OG_E_CUDA;
}

#define OG_TRY(expr)                                   \
    do {                                               \
        cudaError_t og_try_err_ = (expr);              \
        if (og_try_err_ != cudaSuccess) return OG_E_CUDA; \
    } while (0)

bool experts_in_range(const int32_t *sel, int top_k, int num_experts) {
    for (int j = 0; j < top_k; ++j)
        if (sel[j] < 0 || sel[j] >= num_experts) return false;
    return true;
}

}  // namespace

extern "C" OG_API og_status og_test_moe_topk(const float *logits, int E, int top_k, int norm,
                                             int32_t *sel_out, float *w_out) {
    if (!logits || !sel_out || !w_out) return OG_E_INVALID_ARGUMENT;
    if (E < 1 || E > kMaxExperts || top_k < 1 || top_k > kMaxTopK || top_k > E)
        return OG_E_INVALID_ARGUMENT;
    DeviceBuffer d_logits, d_sel, d_w;
    OG_TRY(d_logits.upload(logits, sizeof(float) * E));
    OG_TRY(d_sel.upload(sel_out, sizeof(int32_t) * top_k));  // incoming (poisoned) contents
    OG_TRY(d_w.upload(w_out, sizeof(float) * top_k));
    TestStream stream;
    OG_TRY(cudaStreamCreateWithFlags(&stream.s, cudaStreamNonBlocking));
    og_status st = to_status(launch_moe_topk(d_logits.as<float>(), E, top_k, norm,
                                             d_sel.as<int32_t>(), d_w.as<float>(), stream.s));
    if (st != OG_OK) return st;
    OG_TRY(cudaStreamSynchronize(stream.s));
    OG_TRY(cudaMemcpy(sel_out, d_sel.ptr, sizeof(int32_t) * top_k, cudaMemcpyDeviceToHost));
    OG_TRY(cudaMemcpy(w_out, d_w.ptr, sizeof(float) * top_k, cudaMemcpyDeviceToHost));
    return OG_OK;
}

extern "C" OG_API og_status og_test_moe_gate_up_swiglu(const uint16_t *gate_up_bf16, int E,
                                                       int H, int I, const float *x,
                                                       const int32_t *sel, int top_k,
                                                       float *act_out) {
    if (!gate_up_bf16 || !x || !sel || !act_out) return OG_E_INVALID_ARGUMENT;
    if (E < 1 || H < 1 || I < 1 || top_k < 1 || top_k > kMaxTopK) return OG_E_INVALID_ARGUMENT;
    if (!experts_in_range(sel, top_k, E)) return OG_E_INVALID_ARGUMENT;
    const size_t stride = ((size_t)H + 7) / 8 * 8;
    DeviceBuffer d_w, d_x, d_sel, d_act;
    OG_TRY(d_w.upload(gate_up_bf16, sizeof(uint16_t) * (size_t)E * 2 * I * stride));
    OG_TRY(d_x.upload(x, sizeof(float) * H));
    OG_TRY(d_sel.upload(sel, sizeof(int32_t) * top_k));
    OG_TRY(d_act.upload(act_out, sizeof(float) * (size_t)top_k * I));
    TestStream stream;
    OG_TRY(cudaStreamCreateWithFlags(&stream.s, cudaStreamNonBlocking));
    og_status st = to_status(launch_moe_gate_up_swiglu(
        d_w.as<__nv_bfloat16>(), d_x.as<float>(), d_sel.as<int32_t>(), top_k, H, I,
        d_act.as<float>(), stream.s));
    if (st != OG_OK) return st;
    OG_TRY(cudaStreamSynchronize(stream.s));
    OG_TRY(cudaMemcpy(act_out, d_act.ptr, sizeof(float) * (size_t)top_k * I,
                      cudaMemcpyDeviceToHost));
    return OG_OK;
}

extern "C" OG_API og_status og_test_moe_down(const uint16_t *down_bf16, int E, int H, int I,
                                             const float *act, const int32_t *sel,
                                             const float *w, int top_k, float *x_inout) {
    if (!down_bf16 || !act || !sel || !w || !x_inout) return OG_E_INVALID_ARGUMENT;
    if (E < 1 || H < 1 || I < 1 || top_k < 1 || top_k > kMaxTopK) return OG_E_INVALID_ARGUMENT;
    if (!experts_in_range(sel, top_k, E)) return OG_E_INVALID_ARGUMENT;
    const size_t stride = ((size_t)I + 7) / 8 * 8;
    DeviceBuffer d_w, d_act, d_sel, d_sw, d_x;
    OG_TRY(d_w.upload(down_bf16, sizeof(uint16_t) * (size_t)E * H * stride));
    OG_TRY(d_act.upload(act, sizeof(float) * (size_t)top_k * I));
    OG_TRY(d_sel.upload(sel, sizeof(int32_t) * top_k));
    OG_TRY(d_sw.upload(w, sizeof(float) * top_k));
    OG_TRY(d_x.upload(x_inout, sizeof(float) * H));
    TestStream stream;
    OG_TRY(cudaStreamCreateWithFlags(&stream.s, cudaStreamNonBlocking));
    og_status st = to_status(launch_moe_down_weighted_residual(
        d_w.as<__nv_bfloat16>(), d_act.as<float>(), d_sel.as<int32_t>(), d_sw.as<float>(),
        top_k, H, I, d_x.as<float>(), stream.s));
    if (st != OG_OK) return st;
    OG_TRY(cudaStreamSynchronize(stream.s));
    OG_TRY(cudaMemcpy(x_inout, d_x.ptr, sizeof(float) * H, cudaMemcpyDeviceToHost));
    return OG_OK;
}

namespace {

// Upload quantized rows given in og_set_weight's layout into the device layout.
cudaError_t upload_quant_rows(DeviceBuffer &b, DeviceBuffer &s, int format, const void *data,
                              const void *scales, long long rows, int cols) {
    const size_t pitch = (size_t)og::weight_row_bytes(format, cols);
    const size_t src_row = format == OG_WEIGHTS_INT8 ? (size_t)cols : pitch;
    cudaError_t err = cudaMalloc(&b.ptr, rows * pitch);
    if (err != cudaSuccess) {
        b.ptr = nullptr;
        return err;
    }
    err = cudaMemset(b.ptr, 0, rows * pitch);
    if (err != cudaSuccess) return err;
    err = cudaMemcpy2D(b.ptr, pitch, data, src_row, src_row, rows, cudaMemcpyHostToDevice);
    if (err != cudaSuccess) return err;
    const size_t scale_bytes = (size_t)(rows * og::weight_scales_per_row(format, cols) *
                                        og::weight_scale_bytes(format));
    if (format != OG_WEIGHTS_Q4) return s.upload(scales, scale_bytes);
    std::vector<uint8_t> codes(scale_bytes);  // q4 scales arrive as bf16, as og_set_weight takes them
    og::q4_scale_codes(scales, scale_bytes, codes.data());
    return s.upload(codes.data(), scale_bytes);
}

bool quant_format(int32_t f) { return f == OG_WEIGHTS_INT8 || f == OG_WEIGHTS_Q4; }

}  // namespace

extern "C" OG_API og_status og_test_moe_gate_up_swiglu_quant(int32_t format, const void *weights,
                                                             const void *scales, int E, int H,
                                                             int I, const float *x,
                                                             const int32_t *sel, int top_k,
                                                             float *act_out) {
    if (!quant_format(format) || !weights || !scales || !x || !sel || !act_out)
        return OG_E_INVALID_ARGUMENT;
    if (E < 1 || H < 1 || I < 1 || top_k < 1 || top_k > kMaxTopK) return OG_E_INVALID_ARGUMENT;
    if (!experts_in_range(sel, top_k, E)) return OG_E_INVALID_ARGUMENT;
    DeviceBuffer d_w, d_s, d_x, d_sel, d_act;
    OG_TRY(upload_quant_rows(d_w, d_s, format, weights, scales, (long long)E * 2 * I, H));
    OG_TRY(d_x.upload(x, sizeof(float) * H));
    OG_TRY(d_sel.upload(sel, sizeof(int32_t) * top_k));
    OG_TRY(d_act.upload(act_out, sizeof(float) * (size_t)top_k * I));
    TestStream stream;
    OG_TRY(cudaStreamCreateWithFlags(&stream.s, cudaStreamNonBlocking));
    og::WeightMatrix w;
    w.data = d_w.ptr, w.scales = d_s.ptr, w.format = format, w.rows = (int64_t)E * 2 * I, w.cols = H;
    og_status st = to_status(launch_moe_gate_up_swiglu(w, d_x.as<float>(), d_sel.as<int32_t>(),
                                                       top_k, H, I, d_act.as<float>(), stream.s,
                                                       false));
    if (st != OG_OK) return st;
    OG_TRY(cudaStreamSynchronize(stream.s));
    OG_TRY(cudaMemcpy(act_out, d_act.ptr, sizeof(float) * (size_t)top_k * I,
                      cudaMemcpyDeviceToHost));
    return OG_OK;
}

extern "C" OG_API og_status og_test_moe_down_quant(int32_t format, const void *weights,
                                                   const void *scales, int E, int H, int I,
                                                   const float *act, const int32_t *sel,
                                                   const float *w, int top_k, float *x_inout) {
    if (!quant_format(format) || !weights || !scales || !act || !sel || !w || !x_inout)
        return OG_E_INVALID_ARGUMENT;
    if (E < 1 || H < 1 || I < 1 || top_k < 1 || top_k > kMaxTopK) return OG_E_INVALID_ARGUMENT;
    if (!experts_in_range(sel, top_k, E)) return OG_E_INVALID_ARGUMENT;
    DeviceBuffer d_w, d_s, d_act, d_sel, d_sw, d_x;
    OG_TRY(upload_quant_rows(d_w, d_s, format, weights, scales, (long long)E * H, I));
    OG_TRY(d_act.upload(act, sizeof(float) * (size_t)top_k * I));
    OG_TRY(d_sel.upload(sel, sizeof(int32_t) * top_k));
    OG_TRY(d_sw.upload(w, sizeof(float) * top_k));
    OG_TRY(d_x.upload(x_inout, sizeof(float) * H));
    TestStream stream;
    OG_TRY(cudaStreamCreateWithFlags(&stream.s, cudaStreamNonBlocking));
    og::WeightMatrix down;
    down.data = d_w.ptr, down.scales = d_s.ptr, down.format = format;
    down.rows = (int64_t)E * H, down.cols = I;
    og_status st = to_status(launch_moe_down_weighted_residual(
        down, d_act.as<float>(), d_sel.as<int32_t>(), d_sw.as<float>(), top_k, H, I,
        d_x.as<float>(), stream.s, false));
    if (st != OG_OK) return st;
    OG_TRY(cudaStreamSynchronize(stream.s));
    OG_TRY(cudaMemcpy(x_inout, d_x.ptr, sizeof(float) * H, cudaMemcpyDeviceToHost));
    return OG_OK;
}
