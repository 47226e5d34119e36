// testing.cu — the og_test_* entry points of onegraph_testing.h: host arrays in, one
// kernel family launched as the body launches it, host arrays out.
//
// Output arrays are copied to the device before the launch as well, so a caller that
// fills them with NaN sees any element a kernel failed to write.
#include <string.h>

#include <new>
#include <vector>

#include "kernels.cuh"
#include "kv_pool.h"
#include "onegraph_testing.h"
#include "quant.cuh"
#include "sample.cuh"

using namespace og;

namespace {

// A device allocation freed when it goes out of scope (so early returns do not leak).
struct DeviceBuffer {
    void *ptr = nullptr;
    DeviceBuffer() = default;
    DeviceBuffer(const DeviceBuffer &) = delete;
    DeviceBuffer &operator=(const DeviceBuffer &) = delete;
    ~DeviceBuffer() {
        if (ptr) cudaFree(ptr);
    }
    template <class T>
    T *as() const {
        return static_cast<T *>(ptr);
    }
};

og_status alloc(DeviceBuffer &b, size_t bytes) {
    OG_CUDA_TRY(cudaMalloc(&b.ptr, bytes > 0 ? bytes : 1));
    return OG_OK;
}

og_status alloc_copy(DeviceBuffer &b, const void *host, size_t bytes) {
    og_status s = alloc(b, bytes);
    if (s != OG_OK) return s;
    if (host != nullptr && bytes > 0) OG_CUDA_TRY(cudaMemcpy(b.ptr, host, bytes, cudaMemcpyHostToDevice));
    return OG_OK;
}

og_status copy_back(void *host, const DeviceBuffer &b, size_t bytes) {
    if (host != nullptr && bytes > 0) OG_CUDA_TRY(cudaMemcpy(host, b.ptr, bytes, cudaMemcpyDeviceToHost));
    return OG_OK;
}

// Upload a [rows, cols] bf16 matrix into the library's [rows, padded_cols(cols)] layout.
og_status upload_matrix(DeviceBuffer &b, const uint16_t *host, int rows, int cols) {
    const size_t ld = (size_t)padded_cols(cols);
    og_status s = alloc(b, (size_t)rows * ld * 2);
    if (s != OG_OK) return s;
    OG_CUDA_TRY(cudaMemset(b.ptr, 0, (size_t)rows * ld * 2));
    OG_CUDA_TRY(cudaMemcpy2D(b.ptr, ld * 2, host, (size_t)cols * 2, (size_t)cols * 2, rows,
                             cudaMemcpyHostToDevice));
    return OG_OK;
}

og_status upload_step(DeviceBuffer &b, int32_t token, int32_t position) {
    og_step_record record = {};
    record.token = token;
    record.position = position;
    return alloc_copy(b, &record, sizeof record);
}

og_status finish_launch(cudaError_t launch_err, const char *what) {
    if (launch_err != cudaSuccess) return cuda_failure(launch_err, what, __FILE__, __LINE__);
    OG_CUDA_TRY(cudaDeviceSynchronize());
    return OG_OK;
}

size_t kv_elem_bytes(int kv_dtype) {
    return kv_dtype == OG_KV_F32 ? 4 : kv_dtype == OG_KV_BF16 ? 2 : 1;
}


// A contiguous cache [n_kv, max_seq_len, hd] as the paged kernels see it: one block whose
// page holds max_seq_len rows, a one-entry block table {0}.
KvPages contiguous_pages(void *k, void *v, float *k_scales, float *v_scales, int max_seq_len,
                         const int32_t *table_dev) {
    KvPages p = {};
    p.k = static_cast<char *>(k);
    p.v = static_cast<char *>(v);
    p.k_scales = reinterpret_cast<char *>(k_scales);
    p.v_scales = reinterpret_cast<char *>(v_scales);
    p.block_stride = 0;
    p.page_size = max_seq_len;
    p.n_blocks = 1;
    p.block_tables = table_dev;
    p.max_blocks_per_seq = 1;
    return p;
}

// The pool pages of a paged test call: offsets inside each block; scales -1 unless int8.
og_status paged_pages(const char *fn, char *pool, int64_t block_stride, int32_t n_blocks,
                      int32_t page_size, int32_t n_kv_heads, int32_t head_dim, int32_t kv_dtype,
                      int64_t k_offset, int64_t v_offset, int64_t k_scales_offset,
                      int64_t v_scales_offset, const int32_t *table_dev, int32_t n_table,
                      KvPages *out) {
    const bool int8 = kv_dtype == OG_KV_INT8;
    const int64_t value_page = (int64_t)n_kv_heads * page_size * head_dim * kv_elem_bytes(kv_dtype);
    const int64_t scale_page = (int64_t)n_kv_heads * page_size * 4;
    auto inside = [&](int64_t offset, int64_t bytes) {
        return offset >= 0 && offset + bytes <= block_stride && offset % 16 == 0;
    };
    if (n_blocks <= 0 || page_size <= 0 || n_table <= 0 || block_stride % 16 != 0 ||
        !inside(k_offset, value_page) ||
        !inside(v_offset, value_page) ||
        (int8 && (!inside(k_scales_offset, scale_page) || !inside(v_scales_offset, scale_page))))
        return set_error(OG_E_INVALID_ARGUMENT,
                         "%s: a page is outside its block (or not 16-byte aligned), the block "
                         "stride is not a multiple of 16, or a size is not positive",
                         fn);
    KvPages p = {};
    p.k = pool + k_offset;
    p.v = pool + v_offset;
    p.k_scales = int8 ? pool + k_scales_offset : nullptr;
    p.v_scales = int8 ? pool + v_scales_offset : nullptr;
    p.block_stride = block_stride;
    p.page_size = page_size;
    p.n_blocks = n_blocks;
    p.block_tables = table_dev;
    p.max_blocks_per_seq = n_table;
    *out = p;
    return OG_OK;
}

#define OG_TRY(expr)                      \
    do {                                  \
        const og_status og_s_ = (expr);   \
        if (og_s_ != OG_OK) return og_s_; \
    } while (0)

bool attention_shape_ok(int n_heads, int n_kv_heads, int head_dim, int max_seq_len, int kv_dtype,
                        int visible_len, int split_len) {
    return n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0 && head_dim > 0 &&
           head_dim % 2 == 0 && head_dim <= 256 && max_seq_len > 0 && visible_len >= 1 &&
           visible_len <= max_seq_len && split_len >= 0 &&
           (kv_dtype == OG_KV_F32 || kv_dtype == OG_KV_BF16 || kv_dtype == OG_KV_INT8);
}

// The attention kernel's split counters, one per (KV head, head group), must be back at zero.
og_status check_counters_reset(const char *fn, const DeviceBuffer &d_counters, int n,
                               const AttentionPlan &plan) {
    std::vector<unsigned> counters(n);
    OG_TRY(copy_back(counters.data(), d_counters, counters.size() * sizeof(unsigned)));
    for (int i = 0; i < n; ++i)
        if (counters[i] != 0)
            return set_error(OG_E_CUDA,
                             "%s: split counter of KV head %d, head group %d is %u after the "
                             "launch (must be reset to 0)",
                             fn, i / plan.head_groups, i % plan.head_groups, counters[i]);
    return OG_OK;
}

// Attention of q over the cache `kv` (already on the device) at visible_len rows, as the body
// launches it; checks that the split counters are left at zero.
og_status run_attention(const char *fn, const float *q, const KvPages &kv, int n_heads,
                        int n_kv_heads, int head_dim, int max_seq_len, int kv_dtype,
                        int visible_len, int split_len, AttentionBand band, float *out,
                        int32_t *split_len_out, int32_t *n_splits_out) {
    AttentionPlan plan;
    OG_CUDA_TRY(attention_plan(n_heads, n_kv_heads, head_dim, max_seq_len, kv_dtype, split_len,
                               band, &plan));
    const size_t q_len = (size_t)n_heads * head_dim;
    DeviceBuffer d_q, d_step, d_partials, d_counters, d_out;
    OG_TRY(alloc_copy(d_q, q, q_len * 4));
    OG_TRY(upload_step(d_step, 0, visible_len - 1));
    const size_t partial_bytes = attention_partial_floats(n_heads, head_dim, plan) * 4;
    OG_TRY(alloc(d_partials, partial_bytes));
    OG_CUDA_TRY(cudaMemset(d_partials.ptr, 0xff, partial_bytes));  // NaN: unread if unwritten
    const size_t counter_bytes = (size_t)attention_counters(n_kv_heads, plan) * sizeof(unsigned);
    OG_TRY(alloc(d_counters, counter_bytes));
    OG_CUDA_TRY(cudaMemset(d_counters.ptr, 0, counter_bytes));
    OG_TRY(alloc_copy(d_out, out, q_len * 4));
    AttentionArgs a = {};
    a.q = d_q.as<float>();
    a.kv = kv;
    a.step = d_step.as<og_step_record>();
    a.n_heads = n_heads;
    a.n_kv_heads = n_kv_heads;
    a.head_dim = head_dim;
    a.max_seq_len = max_seq_len;
    a.kv_dtype = kv_dtype;
    a.partials = d_partials.as<float>();
    a.counters = d_counters.as<unsigned>();
    a.out = d_out.as<float>();
    OG_TRY(finish_launch(launch_attention(a, plan, 0, false), "launch_attention"));
    OG_TRY(copy_back(out, d_out, q_len * 4));
    OG_TRY(check_counters_reset(fn, d_counters, attention_counters(n_kv_heads, plan), plan));
    if (split_len_out != nullptr) *split_len_out = plan.split_len;
    if (n_splits_out != nullptr) *n_splits_out = plan.n_splits;
    return OG_OK;
}

// The body's fused attention kernel (QK-norm + RoPE + KV write + attention) as the body
// launches it, on device buffers the caller set up in `a` (qkv, cache, step). The rotated q
// goes to q_host [n_heads * hd], the attention output to out; checks that the split counters
// are left at zero.
og_status run_fused(const char *fn, AttentionArgs a, int split_len, AttentionBand band, float *q_host,
                    float *out) {
    AttentionPlan plan;
    OG_CUDA_TRY(attention_plan(a.n_heads, a.n_kv_heads, a.head_dim, a.max_seq_len, a.kv_dtype,
                               split_len, band, &plan));
    const size_t q_len = (size_t)a.n_heads * a.head_dim;
    DeviceBuffer d_partials, d_counters, d_out, d_q;
    const size_t partial_bytes = attention_partial_floats(a.n_heads, a.head_dim, plan) * 4;
    OG_TRY(alloc(d_partials, partial_bytes));
    OG_CUDA_TRY(cudaMemset(d_partials.ptr, 0xff, partial_bytes));  // NaN: unread if unwritten
    const size_t counter_bytes = (size_t)attention_counters(a.n_kv_heads, plan) * sizeof(unsigned);
    OG_TRY(alloc(d_counters, counter_bytes));
    OG_CUDA_TRY(cudaMemset(d_counters.ptr, 0, counter_bytes));
    OG_TRY(alloc(d_out, q_len * 4));
    OG_CUDA_TRY(cudaMemset(d_out.ptr, 0xff, q_len * 4));
    OG_TRY(alloc(d_q, q_len * 4));
    OG_CUDA_TRY(cudaMemset(d_q.ptr, 0xff, q_len * 4));
    a.q = nullptr;
    a.q_out = d_q.as<float>();
    a.partials = d_partials.as<float>();
    a.counters = d_counters.as<unsigned>();
    a.out = d_out.as<float>();
    OG_TRY(finish_launch(launch_attention(a, plan, 0, false), "launch_attention"));
    OG_TRY(copy_back(q_host, d_q, q_len * 4));
    OG_TRY(copy_back(out, d_out, q_len * 4));
    return check_counters_reset(fn, d_counters, attention_counters(a.n_kv_heads, plan), plan);
}

og_status gemv_common(const char *fn, GemvMode mode, const uint16_t *weight, int rows, int cols,
                      const float *x, const float *norm_weight, float eps, float *y,
                      int y_len, float *normed) {
    if (weight == nullptr || x == nullptr || y == nullptr || rows <= 0 || cols <= 0 ||
        (mode_has_norm(mode) && norm_weight == nullptr))
        return set_error(OG_E_INVALID_ARGUMENT, "%s: NULL array or non-positive size", fn);
    OG_TRY(require_device());
    DeviceBuffer d_w, d_x, d_norm, d_y, d_normed;
    OG_TRY(upload_matrix(d_w, weight, rows, cols));
    OG_TRY(alloc_copy(d_x, x, (size_t)cols * 4));
    if (norm_weight != nullptr) OG_TRY(alloc_copy(d_norm, norm_weight, (size_t)cols * 4));
    OG_TRY(alloc_copy(d_y, y, (size_t)y_len * 4));
    if (normed != nullptr) OG_TRY(alloc_copy(d_normed, normed, (size_t)cols * 4));
    GemvPlan plan;
    OG_CUDA_TRY(gemv_plan(mode, rows, cols, &plan));
    WeightMatrix w;
    w.data = d_w.ptr, w.rows = rows, w.cols = cols;
    const GemvArgs args = {w, d_x.as<float>(), d_norm.as<float>(), eps, d_y.as<float>(),
                           d_normed.as<float>()};
    OG_TRY(finish_launch(launch_gemv(mode, plan, args, 0, false), "launch_gemv"));
    OG_TRY(copy_back(y, d_y, (size_t)y_len * 4));
    if (normed != nullptr) OG_TRY(copy_back(normed, d_normed, (size_t)cols * 4));
    return OG_OK;
}

// Upload a quantized matrix given in og_set_weight's layout into the device layout (int8 rows
// padded to 16 bytes with zeros; q4 rows are already whole 16-byte groups).
og_status upload_quant_matrix(DeviceBuffer &b, int format, const void *host, int rows, int cols) {
    const size_t pitch = (size_t)weight_row_bytes(format, cols);
    const size_t src_row = format == OG_WEIGHTS_INT8 ? (size_t)cols : pitch;
    og_status s = alloc(b, (size_t)rows * pitch);
    if (s != OG_OK) return s;
    OG_CUDA_TRY(cudaMemset(b.ptr, 0, (size_t)rows * pitch));
    OG_CUDA_TRY(cudaMemcpy2D(b.ptr, pitch, host, src_row, src_row, rows, cudaMemcpyHostToDevice));
    return OG_OK;
}

}  // namespace

extern "C" {

OG_API og_status og_test_gemv_quant(int32_t format, int32_t mode, const void *weight,
                                    const void *scales, int32_t rows, int32_t cols,
                                    const float *x, const float *norm_weight, float eps,
                                    float *y, float *normed, int32_t bulk_stream) {
    const GemvMode m = static_cast<GemvMode>(mode);
    if ((format != OG_WEIGHTS_INT8 && format != OG_WEIGHTS_Q4) || mode < kGemvPlain ||
        mode > kGemvNormSwiglu)
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_gemv_quant: format=%d mode=%d", format, mode);
    if (weight == nullptr || scales == nullptr || x == nullptr || y == nullptr || rows <= 0 ||
        cols <= 0 || (mode_has_norm(m) && norm_weight == nullptr) ||
        (m == kGemvNormSwiglu && rows % 2 != 0))
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_gemv_quant: NULL array or bad size");
    OG_TRY(require_device());
    const int y_len = m == kGemvNormSwiglu ? rows / 2 : rows;
    const size_t scale_bytes =
        (size_t)rows * weight_scales_per_row(format, cols) * weight_scale_bytes(format);
    DeviceBuffer d_w, d_s, d_x, d_norm, d_y, d_normed;
    OG_TRY(upload_quant_matrix(d_w, format, weight, rows, cols));
    std::vector<uint8_t> q4_codes;  // q4 scales arrive as bf16, as og_set_weight takes them
    if (format == OG_WEIGHTS_Q4) {
        q4_codes.resize(scale_bytes);
        q4_scale_codes(scales, scale_bytes, q4_codes.data());
    }
    OG_TRY(alloc_copy(d_s, format == OG_WEIGHTS_Q4 ? q4_codes.data() : scales, scale_bytes));
    OG_TRY(alloc_copy(d_x, x, (size_t)cols * 4));
    if (norm_weight != nullptr) OG_TRY(alloc_copy(d_norm, norm_weight, (size_t)cols * 4));
    OG_TRY(alloc_copy(d_y, y, (size_t)y_len * 4));
    if (normed != nullptr) OG_TRY(alloc_copy(d_normed, normed, (size_t)cols * 4));
    GemvPlan plan;
    OG_CUDA_TRY(gemv_plan(m, rows, cols, &plan, format, bulk_stream != 0));
    WeightMatrix w;
    w.data = d_w.ptr, w.scales = d_s.ptr, w.format = format, w.rows = rows, w.cols = cols;
    const GemvArgs args = {w, d_x.as<float>(), d_norm.as<float>(), eps, d_y.as<float>(),
                           d_normed.as<float>()};
    OG_TRY(finish_launch(launch_gemv(m, plan, args, 0, false), "launch_gemv"));
    OG_TRY(copy_back(y, d_y, (size_t)y_len * 4));
    if (normed != nullptr) OG_TRY(copy_back(normed, d_normed, (size_t)cols * 4));
    return OG_OK;
}

OG_API og_status og_test_gemv_quant_split(int32_t format, int32_t mode, int32_t rows,
                                          int32_t cols, int32_t *warps) {
    if ((format != OG_WEIGHTS_INT8 && format != OG_WEIGHTS_Q4) || mode < kGemvPlain ||
        mode > kGemvNormSwiglu || warps == nullptr || rows <= 0 || cols <= 0)
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_gemv_quant_split: format=%d mode=%d rows=%d cols=%d",
                         format, mode, rows, cols);
    OG_TRY(require_device());
    GemvPlan plan;
    OG_CUDA_TRY(gemv_plan(static_cast<GemvMode>(mode), rows, cols, &plan, format));
    *warps = plan.warps;
    return OG_OK;
}

OG_API og_status og_test_gemv_q4_stream(int32_t mode, int32_t rows, int32_t cols, int32_t bulk_stream,
                                        int32_t *stream) {
    if (mode < kGemvPlain || mode > kGemvNormSwiglu || stream == nullptr || rows <= 0 || cols <= 0 ||
        (mode == kGemvNormSwiglu && rows % 2 != 0))
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_gemv_q4_stream: mode=%d rows=%d cols=%d", mode, rows,
                         cols);
    OG_TRY(require_device());
    GemvPlan plan;
    OG_CUDA_TRY(gemv_plan(static_cast<GemvMode>(mode), rows, cols, &plan, OG_WEIGHTS_Q4, bulk_stream != 0));
    *stream = plan.stream;
    return OG_OK;
}

OG_API og_status og_test_embedding(const uint16_t *table, int32_t vocab, int32_t hidden,
                                   int32_t token, float *x) {
    if (table == nullptr || x == nullptr || vocab <= 0 || hidden <= 0)
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_embedding: NULL array or non-positive size");
    if (token < 0 || token >= vocab)
        return set_error(OG_E_TOKEN_OUT_OF_RANGE, "og_test_embedding: token %d outside [0, %d)",
                         token, vocab);
    OG_TRY(require_device());
    DeviceBuffer d_table, d_step, d_x;
    OG_TRY(upload_matrix(d_table, table, vocab, hidden));
    OG_TRY(upload_step(d_step, token, 0));
    OG_TRY(alloc_copy(d_x, x, (size_t)hidden * 4));
    OG_TRY(finish_launch(launch_embedding(d_table.as<__nv_bfloat16>(), vocab, hidden,
                                          d_step.as<og_step_record>(), nullptr, d_x.as<float>(), 0,
                                          false),
                         "launch_embedding"));
    return copy_back(x, d_x, (size_t)hidden * 4);
}

OG_API og_status og_test_argmax(const float *logits, int32_t n, int32_t launches, int32_t *token,
                                float *logit) {
    if (logits == nullptr || token == nullptr || logit == nullptr || n <= 0 || launches <= 0)
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_argmax: NULL array, n=%d or launches=%d < 1", n,
                         launches);
    OG_TRY(require_device());
    DeviceBuffer d_logits, d_partials, d_ticket, d_out;
    OG_TRY(alloc_copy(d_logits, logits, (size_t)n * 4));
    OG_TRY(alloc(d_partials, (size_t)argmax_partials(n) * sizeof(NextToken)));
    OG_TRY(alloc(d_ticket, sizeof(unsigned)));
    OG_CUDA_TRY(cudaMemset(d_ticket.ptr, 0, sizeof(unsigned)));
    OG_TRY(alloc(d_out, sizeof(NextToken)));
    // Every launch must give the same result: the ticket is back at 0 after each.
    for (int32_t k = 0; k < launches; ++k) {
        OG_CUDA_TRY(cudaMemset(d_out.ptr, 0xFF, sizeof(NextToken)));
        OG_TRY(finish_launch(launch_argmax(d_logits.as<float>(), n, d_partials.as<NextToken>(),
                                           d_ticket.as<unsigned>(), d_out.as<NextToken>(), 0, false),
                             "launch_argmax"));
        NextToken out;
        OG_CUDA_TRY(cudaMemcpy(&out, d_out.ptr, sizeof(out), cudaMemcpyDeviceToHost));
        if (k > 0 && (out.token != *token || memcmp(&out.logit, logit, sizeof(float)) != 0))
            return set_error(OG_E_CORRUPTED, "og_test_argmax: launch %d gave token %d, launch 0 gave %d", k,
                             out.token, *token);
        *token = out.token;
        *logit = out.logit;
    }
    return OG_OK;
}

OG_API og_status og_test_gemv(const uint16_t *weight, int32_t rows, int32_t cols,
                              const float *x, float *y) {
    return gemv_common("og_test_gemv", kGemvPlain, weight, rows, cols, x, nullptr, 0.f, y, rows,
                       nullptr);
}

OG_API og_status og_test_gemv_rmsnorm(const uint16_t *weight, int32_t rows, int32_t cols,
                                      const float *x, const float *norm_weight, float eps,
                                      float *y, float *normed) {
    return gemv_common("og_test_gemv_rmsnorm", kGemvNorm, weight, rows, cols, x, norm_weight,
                       eps, y, rows, normed);
}

OG_API og_status og_test_gemv_residual(const uint16_t *weight, int32_t rows, int32_t cols,
                                       const float *x, float *y) {
    return gemv_common("og_test_gemv_residual", kGemvResidual, weight, rows, cols, x, nullptr,
                       0.f, y, rows, nullptr);
}

OG_API og_status og_test_gemv_rmsnorm_swiglu(const uint16_t *gate_up, int32_t inter,
                                             int32_t cols, const float *x,
                                             const float *norm_weight, float eps, float *act) {
    if (inter <= 0 || inter > (1 << 29))
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_gemv_rmsnorm_swiglu: inter=%d", inter);
    return gemv_common("og_test_gemv_rmsnorm_swiglu", kGemvNormSwiglu, gate_up, 2 * inter, cols,
                       x, norm_weight, eps, act, inter, nullptr);
}

OG_API og_status og_test_rope_inv_freq(int32_t head_dim, double theta, double linear_factor,
                                       float *inv_freq) {
    if (inv_freq == nullptr || head_dim <= 0 || head_dim % 2 != 0 || !(theta > 0) ||
        !(linear_factor > 0))
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_rope_inv_freq: bad argument");
    rope_inv_freq(head_dim, theta, linear_factor, inv_freq);
    return OG_OK;
}

OG_API og_status og_test_qk_norm_rope_kv(float *qkv, int32_t n_heads, int32_t n_kv_heads,
                                         int32_t head_dim, const float *q_norm,
                                         const float *k_norm, float eps, const float *inv_freq,
                                         int32_t position, int32_t max_seq_len,
                                         int32_t kv_dtype, void *k_cache, void *v_cache,
                                         float *k_scales, float *v_scales) {
    const bool int8 = kv_dtype == OG_KV_INT8;
    if (qkv == nullptr || inv_freq == nullptr || k_cache == nullptr || v_cache == nullptr ||
        n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 || head_dim <= 0 ||
        head_dim % 2 != 0 || head_dim > 256 || max_seq_len <= 0 || position < 0 ||
        position >= max_seq_len || (q_norm == nullptr) != (k_norm == nullptr) ||
        (kv_dtype != OG_KV_F32 && kv_dtype != OG_KV_BF16 && !int8) ||
        (int8 && (k_scales == nullptr || v_scales == nullptr)))
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_qk_norm_rope_kv: bad argument");
    OG_TRY(require_device());
    const size_t qkv_len = (size_t)(n_heads + 2 * n_kv_heads) * head_dim;
    const size_t rows = (size_t)n_kv_heads * max_seq_len;
    const size_t cache_bytes = rows * head_dim * kv_elem_bytes(kv_dtype);
    DeviceBuffer d_qkv, d_qn, d_kn, d_freq, d_step, d_k, d_v, d_ks, d_vs, d_table;
    OG_TRY(alloc_copy(d_qkv, qkv, qkv_len * 4));
    if (q_norm != nullptr) {
        OG_TRY(alloc_copy(d_qn, q_norm, (size_t)head_dim * 4));
        OG_TRY(alloc_copy(d_kn, k_norm, (size_t)head_dim * 4));
    }
    OG_TRY(alloc_copy(d_freq, inv_freq, (size_t)head_dim / 2 * 4));
    OG_TRY(upload_step(d_step, 0, position));
    OG_TRY(alloc_copy(d_k, k_cache, cache_bytes));
    OG_TRY(alloc_copy(d_v, v_cache, cache_bytes));
    if (int8) {
        OG_TRY(alloc_copy(d_ks, k_scales, rows * 4));
        OG_TRY(alloc_copy(d_vs, v_scales, rows * 4));
    }
    RopeKvArgs a = {};
    a.qkv = d_qkv.as<float>();
    a.q_norm = d_qn.as<float>();
    a.k_norm = d_kn.as<float>();
    a.eps = eps;
    a.inv_freq = d_freq.as<float>();
    a.step = d_step.as<og_step_record>();
    a.n_heads = n_heads;
    a.n_kv_heads = n_kv_heads;
    a.head_dim = head_dim;
    a.max_seq_len = max_seq_len;
    a.kv_dtype = kv_dtype;
    const int32_t table[1] = {0};
    OG_TRY(alloc_copy(d_table, table, sizeof table));
    a.kv = contiguous_pages(d_k.ptr, d_v.ptr, d_ks.as<float>(), d_vs.as<float>(), max_seq_len,
                            d_table.as<int32_t>());
    a.table_update = nullptr;
    OG_TRY(finish_launch(launch_qk_norm_rope_kv(a, 0, false), "launch_qk_norm_rope_kv"));
    OG_TRY(copy_back(qkv, d_qkv, qkv_len * 4));
    OG_TRY(copy_back(k_cache, d_k, cache_bytes));
    OG_TRY(copy_back(v_cache, d_v, cache_bytes));
    if (int8) {
        OG_TRY(copy_back(k_scales, d_ks, rows * 4));
        OG_TRY(copy_back(v_scales, d_vs, rows * 4));
    }
    return OG_OK;
}

OG_API og_status og_test_attention_plan(int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                                       int32_t max_seq_len, int32_t kv_dtype, int32_t split_len,
                                       int32_t band, int32_t *head_group, int32_t *n_blocks,
                                       int32_t *split_len_out, int32_t *tensor_cores) {
    if (head_group == nullptr || n_blocks == nullptr || split_len_out == nullptr || tensor_cores == nullptr)
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_attention_plan: NULL output");
    OG_TRY(require_device());
    AttentionPlan plan;
    const cudaError_t err =
        attention_plan(n_heads, n_kv_heads, head_dim, max_seq_len, kv_dtype, split_len, (AttentionBand)band, &plan);
    if (err == cudaErrorInvalidValue) {
        (void)cudaGetLastError();
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_attention_plan: heads=%d kv_heads=%d head_dim=%d "
                         "max_seq_len=%d kv_dtype=%d split_len=%d band=%d", n_heads, n_kv_heads, head_dim,
                         max_seq_len, kv_dtype, split_len, band);
    }
    OG_CUDA_TRY(err);
    *head_group = plan.head_group;
    *n_blocks = plan.n_blocks;
    *split_len_out = plan.split_len;
    *tensor_cores = plan.tensor_cores ? 1 : 0;
    return OG_OK;
}

OG_API og_status og_test_attention(const float *q, const void *k_cache, const void *v_cache,
                                   const float *k_scales, const float *v_scales,
                                   int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                                   int32_t max_seq_len, int32_t kv_dtype, int32_t visible_len,
                                   int32_t split_len, int32_t band, float *out,
                                   int32_t *split_len_out, int32_t *n_splits_out) {
    const bool int8 = kv_dtype == OG_KV_INT8;
    if (q == nullptr || k_cache == nullptr || v_cache == nullptr || out == nullptr ||
        !attention_shape_ok(n_heads, n_kv_heads, head_dim, max_seq_len, kv_dtype, visible_len,
                            split_len) ||
        (int8 && (k_scales == nullptr || v_scales == nullptr)))
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_attention: bad argument");
    OG_TRY(require_device());
    const size_t rows = (size_t)n_kv_heads * max_seq_len;
    const size_t cache_bytes = rows * head_dim * kv_elem_bytes(kv_dtype);
    DeviceBuffer d_k, d_v, d_ks, d_vs, d_table;
    OG_TRY(alloc_copy(d_k, k_cache, cache_bytes));
    OG_TRY(alloc_copy(d_v, v_cache, cache_bytes));
    if (int8) {
        OG_TRY(alloc_copy(d_ks, k_scales, rows * 4));
        OG_TRY(alloc_copy(d_vs, v_scales, rows * 4));
    }
    const int32_t table[1] = {0};
    OG_TRY(alloc_copy(d_table, table, sizeof table));
    const KvPages kv = contiguous_pages(d_k.ptr, d_v.ptr, d_ks.as<float>(), d_vs.as<float>(),
                                        max_seq_len, d_table.as<int32_t>());
    return run_attention("og_test_attention", q, kv, n_heads, n_kv_heads, head_dim, max_seq_len,
                         kv_dtype, visible_len, split_len, (AttentionBand)band, out, split_len_out,
                         n_splits_out);
}

OG_API og_status og_test_attention_paged(const float *q, const void *pool, int64_t block_stride,
                                         int32_t n_blocks, int32_t page_size, int64_t k_offset,
                                         int64_t v_offset, int64_t k_scales_offset,
                                         int64_t v_scales_offset, const int32_t *block_table,
                                         int32_t n_table, int32_t n_heads, int32_t n_kv_heads,
                                         int32_t head_dim, int32_t max_seq_len, int32_t kv_dtype,
                                         int32_t visible_len, int32_t split_len, int32_t band,
                                         float *out) {
    if (q == nullptr || pool == nullptr || block_table == nullptr || out == nullptr ||
        !attention_shape_ok(n_heads, n_kv_heads, head_dim, max_seq_len, kv_dtype, visible_len,
                            split_len) ||
        page_size <= 0 || (int64_t)n_table * page_size < max_seq_len)
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_attention_paged: bad argument");
    for (int32_t i = 0; i < n_table; ++i)
        if (block_table[i] < 0 || block_table[i] >= n_blocks)
            return set_error(OG_E_INVALID_ARGUMENT,
                             "og_test_attention_paged: block_table[%d]=%d is outside [0, %d)", i,
                             block_table[i], n_blocks);
    OG_TRY(require_device());
    const size_t pool_bytes = (size_t)block_stride * n_blocks;
    DeviceBuffer d_pool, d_table;
    OG_TRY(alloc_copy(d_pool, pool, pool_bytes));
    OG_TRY(alloc_copy(d_table, block_table, (size_t)n_table * sizeof(int32_t)));
    KvPages kv;
    OG_TRY(paged_pages("og_test_attention_paged", d_pool.as<char>(), block_stride, n_blocks,
                       page_size, n_kv_heads, head_dim, kv_dtype, k_offset, v_offset,
                       k_scales_offset, v_scales_offset, d_table.as<int32_t>(), n_table, &kv));
    return run_attention("og_test_attention_paged", q, kv, n_heads, n_kv_heads, head_dim,
                         max_seq_len, kv_dtype, visible_len, split_len, (AttentionBand)band, out, nullptr,
                         nullptr);
}

namespace {

// The inputs both paged fused entry points take (the new token's qkv, the norms, the angles,
// the step record, the pool and the block tables), checked and uploaded once.
struct PagedRowInputs {
    float *qkv;
    int32_t n_heads, n_kv_heads, head_dim;
    const float *q_norm, *k_norm;
    float eps;
    const float *inv_freq;
    int32_t position, max_seq_len, kv_dtype;
    void *pool;
    int64_t block_stride;
    int32_t n_blocks, page_size;
    int64_t k_offset, v_offset, k_scales_offset, v_scales_offset;
    int32_t seq_slot, row_block;
    int32_t *block_tables;
    int32_t n_tables, max_blocks_per_seq;
};
struct PagedRowDevice {
    DeviceBuffer qkv, q_norm, k_norm, inv_freq, step, pool, tables;
    KvPages kv;
    size_t qkv_len = 0, pool_bytes = 0, table_bytes = 0;
};

// The fields the QK-norm/RoPE/KV-write kernel's and the fused attention's arguments share,
// pointing at the uploaded inputs.
extern "C++" template <class Args>
void set_paged_row_args(Args &a, const PagedRowInputs &in, const PagedRowDevice &d) {
    a.kv = d.kv;
    a.qkv = d.qkv.as<float>();
    a.q_norm = d.q_norm.as<float>();
    a.k_norm = d.k_norm.as<float>();
    a.eps = in.eps;
    a.inv_freq = d.inv_freq.as<float>();
    a.table_update = d.tables.as<int32_t>();
    a.step = d.step.as<og_step_record>();
    a.n_heads = in.n_heads;
    a.n_kv_heads = in.n_kv_heads;
    a.head_dim = in.head_dim;
    a.max_seq_len = in.max_seq_len;
    a.kv_dtype = in.kv_dtype;
}

og_status upload_paged_row(const char *fn, const PagedRowInputs &in, PagedRowDevice &d) {
    if (in.qkv == nullptr || in.inv_freq == nullptr || in.pool == nullptr ||
        in.block_tables == nullptr || in.n_heads <= 0 || in.n_kv_heads <= 0 ||
        in.n_heads % in.n_kv_heads != 0 || in.head_dim <= 0 || in.head_dim % 2 != 0 ||
        in.head_dim > 256 || in.max_seq_len <= 0 || (in.q_norm == nullptr) != (in.k_norm == nullptr) ||
        (in.kv_dtype != OG_KV_F32 && in.kv_dtype != OG_KV_BF16 && in.kv_dtype != OG_KV_INT8) ||
        in.n_tables <= 0 || in.max_blocks_per_seq <= 0 || in.seq_slot < 0 ||
        in.seq_slot >= in.n_tables || in.page_size <= 0 ||
        (int64_t)in.max_blocks_per_seq * in.page_size < in.max_seq_len)
        return set_error(OG_E_INVALID_ARGUMENT, "%s: bad argument", fn);
    OG_TRY(require_device());
    d.qkv_len = (size_t)(in.n_heads + 2 * in.n_kv_heads) * in.head_dim;
    d.pool_bytes = (size_t)in.block_stride * in.n_blocks;
    d.table_bytes = (size_t)in.n_tables * in.max_blocks_per_seq * sizeof(int32_t);
    OG_TRY(alloc_copy(d.qkv, in.qkv, d.qkv_len * 4));
    if (in.q_norm != nullptr) {
        OG_TRY(alloc_copy(d.q_norm, in.q_norm, (size_t)in.head_dim * 4));
        OG_TRY(alloc_copy(d.k_norm, in.k_norm, (size_t)in.head_dim * 4));
    }
    OG_TRY(alloc_copy(d.inv_freq, in.inv_freq, (size_t)in.head_dim / 2 * 4));
    og_step_record record = {};
    record.position = in.position;
    record.seq_slot = in.seq_slot;
    record.row_block = in.row_block;
    OG_TRY(alloc_copy(d.step, &record, sizeof record));
    OG_TRY(alloc_copy(d.pool, in.pool, d.pool_bytes));
    OG_TRY(alloc_copy(d.tables, in.block_tables, d.table_bytes));
    return paged_pages(fn, d.pool.as<char>(), in.block_stride, in.n_blocks, in.page_size,
                       in.n_kv_heads, in.head_dim, in.kv_dtype, in.k_offset, in.v_offset,
                       in.k_scales_offset, in.v_scales_offset, d.tables.as<int32_t>(),
                       in.max_blocks_per_seq, &d.kv);
}

// The pool and the block tables back to the caller's copies.
og_status copy_back_paged(const PagedRowInputs &in, const PagedRowDevice &d) {
    OG_TRY(copy_back(in.pool, d.pool, d.pool_bytes));
    return copy_back(in.block_tables, d.tables, d.table_bytes);
}

}  // namespace

OG_API og_status og_test_qk_norm_rope_kv_paged(
    float *qkv, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, const float *q_norm,
    const float *k_norm, float eps, const float *inv_freq, int32_t position, int32_t max_seq_len,
    int32_t kv_dtype, void *pool, int64_t block_stride, int32_t n_blocks, int32_t page_size,
    int64_t k_offset, int64_t v_offset, int64_t k_scales_offset, int64_t v_scales_offset,
    int32_t seq_slot, int32_t row_block, int32_t *block_tables, int32_t n_tables,
    int32_t max_blocks_per_seq) {
    const PagedRowInputs in = {qkv, n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps, inv_freq,
                               position, max_seq_len, kv_dtype, pool, block_stride, n_blocks,
                               page_size, k_offset, v_offset, k_scales_offset, v_scales_offset,
                               seq_slot, row_block, block_tables, n_tables, max_blocks_per_seq};
    PagedRowDevice d;
    OG_TRY(upload_paged_row("og_test_qk_norm_rope_kv_paged", in, d));
    RopeKvArgs a = {};
    set_paged_row_args(a, in, d);
    OG_TRY(finish_launch(launch_qk_norm_rope_kv(a, 0, false), "launch_qk_norm_rope_kv"));
    OG_TRY(copy_back(qkv, d.qkv, d.qkv_len * 4));
    return copy_back_paged(in, d);
}

OG_API og_status og_test_attention_fused(
    float *qkv, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, const float *q_norm,
    const float *k_norm, float eps, const float *inv_freq, int32_t position, int32_t max_seq_len,
    int32_t kv_dtype, void *pool, int64_t block_stride, int32_t n_blocks, int32_t page_size,
    int64_t k_offset, int64_t v_offset, int64_t k_scales_offset, int64_t v_scales_offset,
    int32_t seq_slot, int32_t row_block, int32_t *block_tables, int32_t n_tables,
    int32_t max_blocks_per_seq, int32_t split_len, int32_t band, float *out) {
    const char *fn = "og_test_attention_fused";
    if (out == nullptr || position < 0 || position >= max_seq_len || split_len < 0)
        return set_error(OG_E_INVALID_ARGUMENT, "%s: bad argument", fn);
    const PagedRowInputs in = {qkv, n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps, inv_freq,
                               position, max_seq_len, kv_dtype, pool, block_stride, n_blocks,
                               page_size, k_offset, v_offset, k_scales_offset, v_scales_offset,
                               seq_slot, row_block, block_tables, n_tables, max_blocks_per_seq};
    PagedRowDevice d;
    OG_TRY(upload_paged_row(fn, in, d));
    AttentionArgs a = {};
    set_paged_row_args(a, in, d);
    OG_TRY(run_fused(fn, a, split_len, (AttentionBand)band, qkv, out));  // q over the first n_heads * hd of qkv
    return copy_back_paged(in, d);
}

OG_API og_status og_test_zero_blocks(void *backing, uint64_t backing_bytes, uint64_t pool_offset,
                                     int64_t block_stride, int32_t n_blocks,
                                     const int64_t *segment_offsets,
                                     const int64_t *segment_page_bytes, int32_t n_segments,
                                     const int32_t *block_ids, int32_t n_ids) {
    if (backing == nullptr || block_stride < 0 || n_blocks < 0 || n_segments < 0 || n_ids < 0 ||
        (n_segments > 0 && (segment_offsets == nullptr || segment_page_bytes == nullptr)) ||
        (n_ids > 0 && block_ids == nullptr) ||
        pool_offset + (uint64_t)block_stride * (uint64_t)n_blocks > backing_bytes)
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_zero_blocks: bad argument");
    for (int32_t s = 0; s < n_segments; ++s)
        if (segment_offsets[s] < 0 || segment_page_bytes[s] < 0 ||
            segment_offsets[s] + segment_page_bytes[s] > block_stride)
            return set_error(OG_E_INVALID_ARGUMENT,
                             "og_test_zero_blocks: segment %d [%lld, +%lld) is outside a block of "
                             "%lld bytes",
                             s, (long long)segment_offsets[s], (long long)segment_page_bytes[s],
                             (long long)block_stride);
    for (int32_t i = 0; i < n_ids; ++i)
        if (block_ids[i] < 0 || block_ids[i] >= n_blocks)
            return set_error(OG_E_INVALID_ARGUMENT,
                             "og_test_zero_blocks: block_ids[%d]=%d is outside [0, %d)", i,
                             block_ids[i], n_blocks);
    OG_TRY(require_device());
    std::vector<KvSegment> segments(n_segments);
    for (int32_t s = 0; s < n_segments; ++s)
        segments[s] = KvSegment{segment_offsets[s], segment_page_bytes[s]};
    DeviceBuffer d_backing, d_segments, d_ids;
    OG_TRY(alloc_copy(d_backing, backing, backing_bytes));
    OG_TRY(alloc_copy(d_segments, segments.data(), segments.size() * sizeof(KvSegment)));
    OG_TRY(alloc_copy(d_ids, block_ids, (size_t)n_ids * sizeof(int32_t)));
    ZeroBlocksArgs a = {};
    a.base = d_backing.as<char>() + pool_offset;
    a.block_stride = block_stride;
    a.n_blocks = n_blocks;
    a.segments = d_segments.as<KvSegment>();
    a.n_segments = n_segments;
    a.block_ids = d_ids.as<int32_t>();
    a.n_ids = n_ids;
    OG_TRY(finish_launch(launch_zero_blocks(a, 0), "launch_zero_blocks"));
    return copy_back(backing, d_backing, backing_bytes);
}

// ---- the block allocator, host only --------------------------------------------------

struct og_test_allocator {
    BlockAllocator blocks;
};

OG_API og_status og_test_allocator_create(int32_t n_blocks, og_test_allocator **out) {
    if (out == nullptr || n_blocks < 0)
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_allocator_create: bad argument");
    og_test_allocator *a = new (std::nothrow) og_test_allocator();
    if (a == nullptr) return set_error(OG_E_OUT_OF_MEMORY, "og_test_allocator_create: no memory");
    a->blocks.init(n_blocks);
    *out = a;
    return OG_OK;
}

OG_API og_status og_test_allocator_destroy(og_test_allocator *a) {
    delete a;
    return OG_OK;
}

OG_API og_status og_test_allocator_allocate(og_test_allocator *a, int32_t *block) {
    if (a == nullptr || block == nullptr)
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_allocator_allocate: NULL argument");
    return a->blocks.allocate(block);
}

OG_API og_status og_test_allocator_retain(og_test_allocator *a, int32_t block) {
    if (a == nullptr) return set_error(OG_E_INVALID_ARGUMENT, "og_test_allocator_retain: NULL");
    return a->blocks.retain(block);
}

OG_API og_status og_test_allocator_release(og_test_allocator *a, int32_t block, int32_t *freed) {
    if (a == nullptr) return set_error(OG_E_INVALID_ARGUMENT, "og_test_allocator_release: NULL");
    bool was_freed = false;
    const og_status status = a->blocks.release(block, &was_freed);
    if (status == OG_OK && freed != nullptr) *freed = was_freed ? 1 : 0;
    return status;
}

OG_API og_status og_test_allocator_refcount(og_test_allocator *a, int32_t block, int32_t *count) {
    if (a == nullptr || count == nullptr)
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_allocator_refcount: NULL argument");
    *count = a->blocks.refcount(block);
    return OG_OK;
}

OG_API og_status og_test_allocator_free_count(og_test_allocator *a, int32_t *count) {
    if (a == nullptr || count == nullptr)
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_allocator_free_count: NULL argument");
    *count = a->blocks.free_count();
    return OG_OK;
}

OG_API og_status og_test_allocator_set_free_order(og_test_allocator *a, const int32_t *blocks,
                                                  int32_t count) {
    if (a == nullptr) return set_error(OG_E_INVALID_ARGUMENT, "og_test_allocator_set_free_order: NULL");
    return a->blocks.set_free_order(blocks, count);
}

// ---- the sampling stage (sample.cu) on given logits -------------------------------------
OG_API og_status og_test_sample(const float *logits, int32_t vocab, const int32_t *counts,
                                const og_sampling_params *params, const int32_t *positions,
                                int32_t n, int32_t *tokens, float *values, og_top_logprob *top,
                                int32_t *n_top) {
    if (logits == nullptr || params == nullptr || positions == nullptr || tokens == nullptr ||
        values == nullptr || vocab <= 0 || n <= 0)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_test_sample: NULL array, vocab=%d or n=%d < 1", vocab, n);
    OG_TRY(require_device());
    // One sequence slot (0). The record's token is no id (-2): the stage neither counts it nor
    // reads a previous step's token, so every draw sees the same counts.
    og_step_record record = {};
    record.token = -2;
    DeviceBuffer d_logits, d_counts, d_params, d_step, d_z, d_state, d_out, d_results;
    OG_TRY(alloc_copy(d_logits, logits, (size_t)vocab * 4));
    OG_TRY(alloc(d_counts, (size_t)vocab * 4));
    OG_CUDA_TRY(cudaMemset(d_counts.ptr, 0, (size_t)vocab * 4));
    if (counts != nullptr)
        OG_CUDA_TRY(cudaMemcpy(d_counts.ptr, counts, (size_t)vocab * 4, cudaMemcpyHostToDevice));
    OG_TRY(alloc_copy(d_params, params, sizeof *params));
    OG_TRY(alloc_copy(d_step, &record, sizeof record));
    OG_TRY(alloc(d_z, (size_t)vocab * 4));
    OG_TRY(alloc(d_state, sizeof(SampleState)));
    OG_CUDA_TRY(cudaMemset(d_state.ptr, 0, sizeof(SampleState)));   // zero between steps
    // Zeroed as the engine's arena is: the stage writes only the ids it keeps of `top`, and the
    // whole result is copied back.
    OG_TRY(alloc(d_out, sizeof(SampledResult)));
    OG_CUDA_TRY(cudaMemset(d_out.ptr, 0, sizeof(SampledResult)));
    OG_TRY(alloc(d_results, (size_t)n * sizeof(NextToken)));
    const SampleArgs args = {d_logits.as<float>(), vocab, d_step.as<og_step_record>(),
                             d_params.as<og_sampling_params>(), nullptr, d_counts.as<int32_t>(),
                             d_z.as<float>(), d_state.as<SampleState>(), d_out.as<SampledResult>()};
    for (int32_t k = 0; k < n; ++k) {
        // The draw's row, as og_begin_step writes it into the record.
        OG_CUDA_TRY(cudaMemcpyAsync(&d_step.as<og_step_record>()->position, positions + k,
                                    sizeof(int32_t), cudaMemcpyHostToDevice, 0));
        const cudaError_t err = launch_sample(args, 0, false);
        if (err != cudaSuccess) return cuda_failure(err, "launch_sample", __FILE__, __LINE__);
        OG_CUDA_TRY(cudaMemcpyAsync(d_results.as<NextToken>() + k, d_out.ptr, sizeof(NextToken),
                                    cudaMemcpyDeviceToDevice, 0));
    }
    OG_CUDA_TRY(cudaDeviceSynchronize());
    std::vector<NextToken> results((size_t)n);
    OG_TRY(copy_back(results.data(), d_results, (size_t)n * sizeof(NextToken)));
    SampledResult last;
    OG_TRY(copy_back(&last, d_out, sizeof last));
    for (int32_t k = 0; k < n; ++k) tokens[k] = results[k].token, values[k] = results[k].logit;
    if (top != nullptr)
        for (int j = 0; j < last.n_top && j < OG_MAX_LOGPROBS; ++j) top[j] = last.top[j];
    if (n_top != nullptr) *n_top = last.next.token >= 0 ? last.n_top : 0;
    if (last.next.token == OG_TOKEN_NONFINITE)
        return set_error(OG_E_NONFINITE_LOGITS,
                         "og_test_sample: the logits hold a NaN or +inf (or overflow to +inf over "
                         "the temperature, or are all -inf)");
    if (last.next.token == OG_TOKEN_OVERFLOW)
        return set_error(OG_E_UNSUPPORTED, "og_test_sample: more than %d ids lie at the filters' cut",
                         kSampleCandidates);
    return OG_OK;
}

}  // extern "C"

