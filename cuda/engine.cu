// engine.cu — the C ABI of onegraph.h: configuration, device buffers, weight upload,
// the hit-only precheck, and the decode body (og_enqueue).
//
// The body reads like llama2.c's forward(): H2D step record -> embedding -> per layer
// (attention block, FFN block) -> final norm + lm_head -> D2H logits. Kernels per layer:
//   dense: [RMSNorm+QKV GEMV] [QK-norm+RoPE+KV write] [attention] [O GEMV + residual]
//          [RMSNorm+gate/up GEMV+SwiGLU] [down GEMV + residual]                      = 6
//   MoE:   the same attention block (4), then [RMSNorm+router GEMV (writes normed)]
//          [top-k] [experts gate/up+SwiGLU] [experts down, weighted sum + residual]  = 8
// plus the embedding gather and [final RMSNorm+lm_head GEMV] per token.
// On sm_90+ every kernel after the embedding is launched with programmatic dependent launch
// (kernels wait on their predecessor before touching memory, so results are unchanged);
// ONEGRAPH_PDL=0 in the environment at og_init turns it off.
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kernels.cuh"
#include "kv_pool.h"
#include "sample.cuh"
#include "moe.cuh"
#include "quant.cuh"
#include "onegraph_testing.h"
#include "packed_file.h"
#include "prefill.cuh"
#include "reliability.cuh"

namespace og {

// ---- errors ---------------------------------------------------------------------------
namespace {
thread_local std::string t_last_error;
}

og_status set_error(og_status status, const char *fmt, ...) {
    char buffer[1024];
    va_list args;
    va_start(args, fmt);
    vsnprintf(buffer, sizeof buffer, fmt, args);
    va_end(args);
    t_last_error = buffer;
    return status;
}

og_status cuda_failure(cudaError_t err, const char *what, const char *file, int line) {
    (void)cudaGetLastError();  // clear a non-sticky error so later calls are not blamed
    const char *base = strrchr(file, '/');
    return set_error(err == cudaErrorMemoryAllocation ? OG_E_OUT_OF_MEMORY : OG_E_CUDA,
                     "%s failed: %s (%s:%d)", what, cudaGetErrorString(err),
                     base ? base + 1 : file, line);
}

og_status require_device(void) {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return set_error(OG_E_NO_DEVICE, "no CUDA device: %s", cudaGetErrorString(err));
    }
    if (count <= 0) return set_error(OG_E_NO_DEVICE, "no CUDA device: the driver reports none");
    return OG_OK;
}

cudaError_t allow_dynamic_smem(const void *kernel, size_t smem_bytes) {
    // Both limits (48 KB without opting in, the device's opt-in maximum) cover static plus
    // dynamic shared memory of a block: 48 KB of dynamic memory beside a kernel's own static
    // arrays needs the opt-in too.
    cudaFuncAttributes attrs;
    OG_CUDA_RETURN_IF(cudaFuncGetAttributes(&attrs, kernel));
    if (smem_bytes + attrs.sharedSizeBytes <= 48 * 1024) return cudaSuccess;
    int device = 0, optin = 0;
    OG_CUDA_RETURN_IF(cudaGetDevice(&device));
    OG_CUDA_RETURN_IF(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    const size_t dynamic_limit = (size_t)optin - attrs.sharedSizeBytes;
    if (smem_bytes > dynamic_limit) return cudaErrorInvalidValue;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dynamic_limit);
}

cudaError_t current_sm_count(int *sm_count) {
    int device = 0;
    OG_CUDA_RETURN_IF(cudaGetDevice(&device));
    return cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, device);
}

}  // namespace og

using namespace og;

// ---- the engine -----------------------------------------------------------------------
namespace {

constexpr size_t kArenaAlign = 256;

// A weight matrix in one of the OG_WEIGHTS_* formats; layouts (row bytes, scales) in quant.cuh.
struct DeviceMatrix {
    char *data = nullptr;                      // [rows, weight_row_bytes(format, cols)]
    char *scales = nullptr;                    // int8: [rows] fp32; q4: [rows, groups] bf16
    int format = OG_WEIGHTS_BF16;
};

struct LayerWeights {
    bool is_moe = false;
    float *input_layernorm = nullptr;          // (H)
    DeviceMatrix qkv;                          // (q + 2kv, H): q_proj | k_proj | v_proj
    float *q_norm = nullptr, *k_norm = nullptr;  // (hd) each, qk_norm only
    DeviceMatrix o_proj;                       // (H, q)
    float *post_attention_layernorm = nullptr; // (H)
    DeviceMatrix gate_up;                      // dense: (2I, H): gate_proj | up_proj
    DeviceMatrix down;                         // dense: (H, I)
    __nv_bfloat16 *router = nullptr;           // MoE: (E, ldH) mlp.gate, always bf16
    DeviceMatrix expert_gate_up;               // MoE: (E * 2Im, H), expert-major
    DeviceMatrix expert_down;                  // MoE: (E * H, Im), expert-major
};

// One entry per Hugging Face tensor the config uses, in config.py's tensor_shapes order (a
// quantized matrix's "<name>.scale" right after it).
struct WeightSlot {
    enum Kind { kVector, kMatrix, kScales };
    std::string name;
    Kind kind;
    int format = OG_WEIGHTS_BF16;      // matrices and scales: the matrix's OG_WEIGHTS_*
    int64_t rows, cols;                // vectors: rows == 1, cols == length; matrices and
                                       // scales: the matrix's logical shape
    char *dst = nullptr;               // matrices: first row (pitch bytes apart); scales: first
                                       // row's scales (contiguous)
    int64_t pitch = 0;
    float *vector = nullptr;
    bool is_matrix() const { return kind == kMatrix; }
};

struct Dims {
    int V, H, I, L, n_heads, n_kv, hd, q_size, kv_size, qkv_rows, E, top_k, Im, max_seq, kv_dtype;
    int ldH, ldQ, ldI, ldIm;
    bool any_dense, any_moe;
};

// Offsets from a base address; laid out twice: to size the arena, then for real.
struct ArenaCursor {
    uintptr_t base;
    size_t used = 0;
    template <class T>
    T *take(size_t count) {
        used = (size_t)round_up((int64_t)used, kArenaAlign);
        T *p = reinterpret_cast<T *>(base + used);
        used += count * sizeof(T);
        return p;
    }
};

}  // namespace

constexpr int kStepSlots = 2;  // steps in flight at once (pipelined greedy decoding)

struct og_engine {
    og_config cfg;                       // copy; cfg.layer_is_moe points at layer_is_moe
    std::vector<uint8_t> layer_is_moe;   // [L]
    Dims d;
    int device = 0;
    bool pdl = false;
    cudaStream_t stream = nullptr;

    char *arena = nullptr;               // every device buffer below lives in it
    size_t arena_bytes = 0, weight_bytes = 0;
    // Pinned, one per step slot: two steps may be in flight (og_begin_chained_step), the second
    // begun while the first's copies may still be pending.
    og_step_record *step_host = nullptr; // [kStepSlots]
    float *logits_host = nullptr;        // pinned (V)
    og::SampledResult *next_host = nullptr;  // [kStepSlots]: the result of a next-token step
                                         // (greedy: .next only; sampled: the stage's result)
    int32_t output = OG_OUTPUT_LOGITS;   // og_set_output: what the body copies to the host

    // weights
    __nv_bfloat16 *embed_tokens = nullptr;  // (V, ldH)
    std::vector<LayerWeights> layers;
    float *final_norm = nullptr;            // (H) model.norm
    DeviceMatrix lm_head;                   // (V, H); data == embed_tokens when tied and bf16
    // KV cache: the block pool, the block tables and the sequences (kv_pool.h)
    KvPool kv;
    og::GuardSet kv_guards;              // guard bands around the pool and the block tables
    // run state (names as in runtime/reference.py)
    og_step_record *step = nullptr;      // device copy of the step record
    float *inv_freq = nullptr;           // (hd/2)
    float *x = nullptr;                  // (H) hidden state, the residual stream
    float *normed = nullptr;             // (H) RMSNorm output read by the MoE experts
    float *qkv = nullptr;                // (q + 2kv)
    float *attn_out = nullptr;           // (q)
    float *act = nullptr;                // (I) silu(gate) * up
    float *logits = nullptr;             // (V)
    og::NextToken *next_token = nullptr; // the argmax of the logits (OG_OUTPUT_NEXT_TOKEN), or
                                         // the sampled token: &sampled->next
    // ---- the sampling stage (OG_OUTPUT_SAMPLED, sample.cuh) ----
    og::SampledResult *sampled = nullptr;
    og::SampleState *sample_state = nullptr;
    float *sample_z = nullptr;           // (V) scratch
    int32_t *sample_counts = nullptr;    // (max_sequences, V) tokens generated per sequence slot
    std::vector<og_sampling_params> seq_sampling;  // per sequence slot (og_seq_set_sampling)
    int32_t result_output = OG_OUTPUT_NEXT_TOKEN;  // output of the last ended next-token step
    og::NextToken *argmax_partials = nullptr;  // (argmax_partials(V)) its per-block candidates
    unsigned *argmax_ticket = nullptr;   // its last-block counter (0 between steps)
    float *attn_partials = nullptr;      // split-KV scratch
    unsigned *attn_counters = nullptr;   // (n_kv * attention head groups)
    float *router_logits = nullptr;      // (E)
    int32_t *selected_experts = nullptr; // (top_k)
    float *selected_weights = nullptr;   // (top_k)
    float *moe_act = nullptr;            // (top_k, Im)
    PrefillScratch prefill;              // og_prefill's chunk buffers (prefill.cuh)
    int32_t test_omit = 0;               // og_test_set_omit: OG_TEST_OMIT_* kinds left out

    GemvPlan plan_qkv, plan_o, plan_gate_up, plan_down, plan_router, plan_lm_head;
    AttentionPlan plan_attention;

    std::vector<WeightSlot> slots;
    std::unordered_map<std::string, size_t> slot_index;
    std::vector<uint8_t> resident;       // per slot
    size_t n_missing = 0;

    // Steps begun and not ended, oldest first: one, or two when a chained step follows the
    // one in flight. og_end_step ends pending[0].
    struct PendingStep {
        int32_t seq, slot, position, output;
    };
    PendingStep pending[kStepSlots] = {};
    int n_pending = 0;
    int32_t result_slot = 0;             // slot of the last ended OG_OUTPUT_NEXT_TOKEN step
    og_stats stats = {};
};

namespace {

// ---- sampling state per sequence slot (sample.cuh) ----
og_sampling_params default_sampling() {
    og_sampling_params p = {};
    p.top_p = 1.f;
    p.repetition_penalty = 1.f;
    return p;  // temperature 0: greedy
}

og_status clear_counts(og_engine *e, int32_t slot) {
    OG_CUDA_TRY(cudaMemsetAsync(e->sample_counts + (size_t)slot * e->d.V, 0,
                                (size_t)e->d.V * sizeof(int32_t), e->stream));
    OG_CUDA_TRY(cudaStreamSynchronize(e->stream));
    return OG_OK;
}

std::mutex g_registry_mutex;
std::unordered_set<og_engine *> &registry() {
    static std::unordered_set<og_engine *> live;
    return live;
}

bool is_live(og_engine *e) {
    if (e == nullptr) return false;
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    return registry().count(e) != 0;
}

#define OG_CHECK_HANDLE(e)                                                            \
    do {                                                                              \
        if (!is_live(e))                                                              \
            return set_error(OG_E_INVALID_HANDLE, "%s: %s", __func__,                 \
                             (e) == nullptr ? "NULL engine handle"                    \
                                            : "not a live engine handle (already freed?)"); \
    } while (0)

og_status use_device(og_engine *e) {
    int current = -1;
    OG_CUDA_TRY(cudaGetDevice(&current));
    if (current != e->device) OG_CUDA_TRY(cudaSetDevice(e->device));
    return OG_OK;
}

const char *dtype_name(int32_t dtype) {
    switch (dtype) {
        case OG_DTYPE_F32: return "f32";
        case OG_DTYPE_BF16: return "bf16";
        case OG_DTYPE_I8: return "i8";
        case OG_DTYPE_Q4: return "q4";
    }
    return "unknown dtype";
}

std::string shape_text(int32_t ndim, const int64_t *shape) {
    std::string s = "[";
    for (int32_t i = 0; i < ndim; ++i) {
        if (i) s += ", ";
        s += std::to_string((long long)shape[i]);
    }
    return s + "]";
}

// ---- configuration -------------------------------------------------------------------
bool layer_moe(const og_config *c, int layer) {
    if (c->num_experts <= 0) return false;
    return c->layer_is_moe == nullptr ? true : c->layer_is_moe[layer] != 0;
}

og_status validate_config(const og_config *c) {
    if (c->abi_version != OG_ABI_VERSION)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_config.abi_version=%d but the library implements ABI %d "
                         "(start from og_config_default)",
                         c->abi_version, OG_ABI_VERSION);
    const struct { const char *name; int32_t value; } positive[] = {
        {"vocab_size", c->vocab_size},
        {"hidden_size", c->hidden_size},
        {"num_hidden_layers", c->num_hidden_layers},
        {"num_attention_heads", c->num_attention_heads},
        {"num_key_value_heads", c->num_key_value_heads},
        {"head_dim", c->head_dim},
        {"max_seq_len", c->max_seq_len},
    };
    for (const auto &f : positive)
        if (f.value <= 0)
            return set_error(OG_E_INVALID_ARGUMENT, "og_config.%s=%d must be positive", f.name,
                             f.value);
    if (c->num_attention_heads % c->num_key_value_heads != 0)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_config.num_key_value_heads=%d must divide num_attention_heads=%d "
                         "(grouped-query attention)",
                         c->num_key_value_heads, c->num_attention_heads);
    if (c->head_dim % 2 != 0)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_config.head_dim=%d must be even (rotary embedding rotates pairs)",
                         c->head_dim);
    if (c->head_dim > 256)
        return set_error(OG_E_UNSUPPORTED,
                         "og_config.head_dim=%d is not supported (attention supports even "
                         "head_dim up to 256)",
                         c->head_dim);
    if (!(c->rms_norm_eps > 0.f) || !isfinite(c->rms_norm_eps))
        return set_error(OG_E_INVALID_ARGUMENT, "og_config.rms_norm_eps=%g must be positive",
                         (double)c->rms_norm_eps);
    if (!(c->rope_theta > 0.f) || !isfinite(c->rope_theta))
        return set_error(OG_E_INVALID_ARGUMENT, "og_config.rope_theta=%g must be positive",
                         (double)c->rope_theta);
    if (!(c->rope_linear_factor > 0.f) || !isfinite(c->rope_linear_factor))
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_config.rope_linear_factor=%g must be positive",
                         (double)c->rope_linear_factor);
    const struct { const char *name; int32_t value; } flags[] = {
        {"qk_norm", c->qk_norm},
        {"tie_word_embeddings", c->tie_word_embeddings},
        {"norm_topk_prob", c->norm_topk_prob},
    };
    for (const auto &f : flags)
        if (f.value != 0 && f.value != 1)
            return set_error(OG_E_INVALID_ARGUMENT, "og_config.%s=%d must be 0 or 1", f.name,
                             f.value);
    if (c->kv_dtype != OG_KV_F32 && c->kv_dtype != OG_KV_BF16 && c->kv_dtype != OG_KV_INT8)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_config.kv_dtype=%d is not OG_KV_F32 (0), OG_KV_BF16 (1) or "
                         "OG_KV_INT8 (2)",
                         c->kv_dtype);
    if (c->device_ordinal < 0)
        return set_error(OG_E_INVALID_ARGUMENT, "og_config.device_ordinal=%d must be >= 0",
                         c->device_ordinal);
    const struct { const char *name; int32_t value; } formats[] = {
        {"weights_dense", c->weights_dense},
        {"weights_experts", c->weights_experts},
        {"weights_lm_head", c->weights_lm_head},
    };
    for (const auto &f : formats)
        if (f.value != OG_WEIGHTS_BF16 && f.value != OG_WEIGHTS_INT8 && f.value != OG_WEIGHTS_Q4)
            return set_error(OG_E_INVALID_ARGUMENT,
                             "og_config.%s=%d is not OG_WEIGHTS_BF16 (0), OG_WEIGHTS_INT8 (1) or "
                             "OG_WEIGHTS_Q4 (2)",
                             f.name, f.value);
    const struct { const char *name; int32_t value; } kv_fields[] = {
        {"kv_page_size", c->kv_page_size},
        {"kv_pool_blocks", c->kv_pool_blocks},
        {"kv_max_sequences", c->kv_max_sequences},
        {"prefill_chunk", c->prefill_chunk},
    };
    for (const auto &f : kv_fields)
        if (f.value < 0)
            return set_error(OG_E_INVALID_ARGUMENT, "og_config.%s=%d must be >= 0 (0: the default)",
                             f.name, f.value);
    const int64_t page = c->kv_page_size > 0 ? c->kv_page_size : kKvDefaultPageSize;
    if (page * c->num_key_value_heads > INT32_MAX)  // the kernels index a page's rows with int
        return set_error(OG_E_UNSUPPORTED,
                         "og_config.kv_page_size=%d is too large for num_key_value_heads=%d",
                         c->kv_page_size, c->num_key_value_heads);
    if (c->num_experts < 0)
        return set_error(OG_E_INVALID_ARGUMENT, "og_config.num_experts=%d must be >= 0",
                         c->num_experts);
    bool any_dense = false, any_moe = false;
    for (int l = 0; l < c->num_hidden_layers; ++l) {
        if (c->num_experts == 0 && c->layer_is_moe != nullptr && c->layer_is_moe[l] != 0)
            return set_error(OG_E_INVALID_ARGUMENT,
                             "og_config.layer_is_moe[%d]=%d but num_experts=0", l,
                             (int)c->layer_is_moe[l]);
        (layer_moe(c, l) ? any_moe : any_dense) = true;
    }
    if (any_dense && c->intermediate_size <= 0)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_config.intermediate_size=%d must be positive (some layers are dense)",
                         c->intermediate_size);
    if (any_moe) {
        if (c->num_experts_per_tok <= 0 || c->num_experts_per_tok > c->num_experts)
            return set_error(OG_E_INVALID_ARGUMENT,
                             "og_config.num_experts_per_tok=%d must be in [1, num_experts=%d]",
                             c->num_experts_per_tok, c->num_experts);
        if (c->moe_intermediate_size <= 0)
            return set_error(OG_E_INVALID_ARGUMENT,
                             "og_config.moe_intermediate_size=%d must be positive",
                             c->moe_intermediate_size);
        // The limits of moe.cu's launch_moe_topk (one warp over the router logits).
        if (c->num_experts > 512)
            return set_error(OG_E_UNSUPPORTED,
                             "og_config.num_experts=%d is not supported (at most 512)",
                             c->num_experts);
        if (c->num_experts_per_tok > 32)
            return set_error(OG_E_UNSUPPORTED,
                             "og_config.num_experts_per_tok=%d is not supported (at most 32)",
                             c->num_experts_per_tok);
    }
    return OG_OK;
}

Dims derive_dims(const og_engine *e) {
    const og_config &c = e->cfg;
    Dims d;
    d.V = c.vocab_size;
    d.H = c.hidden_size;
    d.L = c.num_hidden_layers;
    d.n_heads = c.num_attention_heads;
    d.n_kv = c.num_key_value_heads;
    d.hd = c.head_dim;
    d.q_size = d.n_heads * d.hd;
    d.kv_size = d.n_kv * d.hd;
    d.qkv_rows = d.q_size + 2 * d.kv_size;
    d.any_dense = d.any_moe = false;
    for (int l = 0; l < d.L; ++l) (e->layer_is_moe[l] ? d.any_moe : d.any_dense) = true;
    d.I = d.any_dense ? c.intermediate_size : 0;
    d.E = d.any_moe ? c.num_experts : 0;
    d.top_k = d.any_moe ? c.num_experts_per_tok : 0;
    d.Im = d.any_moe ? c.moe_intermediate_size : 0;
    d.max_seq = c.max_seq_len;
    d.kv_dtype = c.kv_dtype;
    d.ldH = padded_cols(d.H);
    d.ldQ = padded_cols(d.q_size);
    d.ldI = padded_cols(d.I > 0 ? d.I : 1);
    d.ldIm = padded_cols(d.Im > 0 ? d.Im : 1);
    return d;
}

// A [rows, cols] matrix of `format` (and its scales) from the arena.
DeviceMatrix take_matrix(ArenaCursor &a, int format, int64_t rows, int64_t cols) {
    DeviceMatrix m;
    m.format = format;
    m.data = a.take<char>((size_t)(rows * weight_row_bytes(format, cols)));
    if (format != OG_WEIGHTS_BF16)
        m.scales = a.take<char>(
            (size_t)(rows * weight_scales_per_row(format, cols) * weight_scale_bytes(format)));
    return m;
}
// Assign every device pointer from `base`; returns the arena size.
size_t layout_arena(og_engine *e, uintptr_t base) {
    const Dims &d = e->d;
    ArenaCursor a{base};
    // weights
    e->embed_tokens = a.take<__nv_bfloat16>((size_t)d.V * d.ldH);
    e->layers.assign(d.L, LayerWeights());
    for (int l = 0; l < d.L; ++l) {
        LayerWeights &w = e->layers[l];
        w.is_moe = e->layer_is_moe[l] != 0;
        w.input_layernorm = a.take<float>(d.H);
        const int dense = e->cfg.weights_dense, experts = e->cfg.weights_experts;
        w.qkv = take_matrix(a, dense, d.qkv_rows, d.H);
        if (e->cfg.qk_norm) {
            w.q_norm = a.take<float>(d.hd);
            w.k_norm = a.take<float>(d.hd);
        }
        w.o_proj = take_matrix(a, dense, d.H, d.q_size);
        w.post_attention_layernorm = a.take<float>(d.H);
        if (w.is_moe) {
            w.router = a.take<__nv_bfloat16>((size_t)d.E * d.ldH);
            w.expert_gate_up = take_matrix(a, experts, (int64_t)d.E * 2 * d.Im, d.H);
            w.expert_down = take_matrix(a, experts, (int64_t)d.E * d.H, d.Im);
        } else {
            w.gate_up = take_matrix(a, dense, 2 * (int64_t)d.I, d.H);
            w.down = take_matrix(a, dense, d.H, d.I);
        }
    }
    e->final_norm = a.take<float>(d.H);
    if (e->cfg.tie_word_embeddings && e->cfg.weights_lm_head == OG_WEIGHTS_BF16)
        e->lm_head.data = reinterpret_cast<char *>(e->embed_tokens);
    else
        e->lm_head = take_matrix(a, e->cfg.weights_lm_head, d.V, d.H);
    e->weight_bytes = (size_t)round_up((int64_t)a.used, kArenaAlign);

    // KV cache: the block pool (n_blocks, block_stride) bytes and the block tables
    // (max_sequences, max_blocks_per_seq), each between guard bands (kernels index both by
    // position); the segment table and the zeroing id scratch
    KvPool &kv = e->kv;
    const size_t pool_bytes = (size_t)kv.layout.pool_bytes();
    kv.pool = static_cast<char *>(e->kv_guards.place(
        "kv_pool", a.take<char>(GuardSet::reserve_bytes(pool_bytes)), pool_bytes));
    const size_t table_bytes =
        (size_t)kv.layout.max_sequences * kv.layout.max_blocks_per_seq * sizeof(int32_t);
    kv.tables = static_cast<int32_t *>(e->kv_guards.place(
        "kv_tables", a.take<char>(GuardSet::reserve_bytes(table_bytes)), table_bytes));
    kv.segments_dev = a.take<KvSegment>(kv.layout.segments.size());
    kv.ids_dev = a.take<int32_t>((size_t)kv.layout.n_blocks);

    // activations and scratch
    e->step = a.take<og_step_record>(1);
    e->inv_freq = a.take<float>(d.hd / 2);
    e->x = a.take<float>(d.H);
    e->normed = a.take<float>(d.H);
    e->qkv = a.take<float>(d.qkv_rows);
    e->attn_out = a.take<float>(d.q_size);
    e->act = a.take<float>(d.I > 0 ? d.I : 1);
    e->logits = a.take<float>(d.V);
    e->sampled = a.take<SampledResult>(1);
    e->next_token = &e->sampled->next;
    e->sample_state = a.take<SampleState>(1);
    e->sample_z = a.take<float>(d.V);
    e->sample_counts = a.take<int32_t>((size_t)e->kv.layout.max_sequences * d.V);
    e->argmax_partials = a.take<NextToken>(argmax_partials(d.V));
    e->argmax_ticket = a.take<unsigned>(1);
    e->attn_partials = a.take<float>(attention_partial_floats(d.n_heads, d.hd, e->plan_attention));
    e->attn_counters = a.take<unsigned>(attention_counters(d.n_kv, e->plan_attention));
    if (d.any_moe) {
        e->router_logits = a.take<float>(d.E);
        e->selected_experts = a.take<int32_t>(d.top_k);
        e->selected_weights = a.take<float>(d.top_k);
        e->moe_act = a.take<float>((size_t)d.top_k * d.Im);
    }
    // og_prefill's scratch for one chunk of rows (prefill.cuh)
    // 1024 rows by default: the prefill attention runs (rows / 64) x heads blocks, and 256-row
    // chunks (64 blocks for 16 heads) left half of an H200's 132 SMs idle.
    const int chunk = std::min(e->cfg.prefill_chunk > 0 ? e->cfg.prefill_chunk : 1024, d.max_seq);
    e->prefill.chunk = chunk;
    e->prefill.tokens = a.take<int32_t>(chunk);
    e->prefill.x = a.take<float>((size_t)chunk * d.H);
    e->prefill.wide = a.take<float>((size_t)chunk * prefill_wide_cols(d.qkv_rows, d.I));
    const size_t narrow = (size_t)chunk * prefill_narrow_cols(d.H, d.q_size, d.I);
    e->prefill.narrow = a.take<__nv_bfloat16>(narrow);     // the GEMM inputs' hi halves
    e->prefill.narrow_lo = a.take<__nv_bfloat16>(narrow);  // ... and their lo halves
    if (e->cfg.weights_dense != OG_WEIGHTS_BF16) {  // one dequantized dense matrix, hi + lo
        const size_t w = prefill_weight_elems(d.H, d.q_size, d.qkv_rows, d.any_dense ? d.I : 0);
        e->prefill.w_hi = a.take<__nv_bfloat16>(w);
        e->prefill.w_lo = a.take<__nv_bfloat16>(w);
    }
    if (d.any_moe && e->cfg.weights_experts == OG_WEIGHTS_BF16) {  // the MoE layers' grouped pass
        const size_t entries = (size_t)chunk * d.top_k;
        e->prefill.moe_logits = a.take<float>((size_t)chunk * d.E);
        e->prefill.moe_selected = a.take<int32_t>(entries);
        e->prefill.moe_weights = a.take<float>(entries);
        e->prefill.moe_entries = a.take<int32_t>((size_t)d.E * chunk);
        e->prefill.moe_counts = a.take<int32_t>(d.E);
        e->prefill.moe_out = a.take<float>(entries * std::max(2 * d.Im, d.H));
        e->prefill.moe_act = a.take<__nv_bfloat16>(entries * d.ldIm);
        e->prefill.moe_act_lo = a.take<__nv_bfloat16>(entries * d.ldIm);
    }
    return (size_t)round_up((int64_t)a.used, kArenaAlign);
}

// The tensor `name` = rows [first_row, first_row + rows) of m (cols columns); a quantized
// matrix adds "<name>.scale" for the same rows.
void add_matrix(og_engine *e, const std::string &name, int64_t rows, int64_t cols,
                const DeviceMatrix &m, int64_t first_row) {
    WeightSlot s;
    s.name = name;
    s.kind = WeightSlot::kMatrix;
    s.format = m.format;
    s.rows = rows;
    s.cols = cols;
    s.pitch = weight_row_bytes(m.format, cols);
    s.dst = m.data + first_row * s.pitch;
    e->slots.push_back(s);
    if (m.format == OG_WEIGHTS_BF16) return;
    s.name = name + ".scale";
    s.kind = WeightSlot::kScales;
    s.pitch = weight_scales_per_row(m.format, cols) * weight_scale_bytes(m.format);
    s.dst = m.scales + first_row * s.pitch;
    e->slots.push_back(std::move(s));
}

DeviceMatrix bf16_matrix(__nv_bfloat16 *data) {
    DeviceMatrix m;
    m.data = reinterpret_cast<char *>(data);
    return m;
}

void add_vector(og_engine *e, std::string name, int64_t length, float *dst) {
    WeightSlot s;
    s.name = std::move(name);
    s.kind = WeightSlot::kVector;
    s.rows = 1;
    s.cols = length;
    s.vector = dst;
    e->slots.push_back(std::move(s));
}

// The tensor table: HF name -> device region (fused layouts assembled by row offset).
void build_weight_table(og_engine *e) {
    const Dims &d = e->d;
    add_matrix(e, "model.embed_tokens.weight", d.V, d.H, bf16_matrix(e->embed_tokens), 0);
    for (int l = 0; l < d.L; ++l) {
        const LayerWeights &w = e->layers[l];
        const std::string p = "model.layers." + std::to_string(l) + ".";
        add_vector(e, p + "input_layernorm.weight", d.H, w.input_layernorm);
        add_matrix(e, p + "self_attn.q_proj.weight", d.q_size, d.H, w.qkv, 0);
        add_matrix(e, p + "self_attn.k_proj.weight", d.kv_size, d.H, w.qkv, d.q_size);
        add_matrix(e, p + "self_attn.v_proj.weight", d.kv_size, d.H, w.qkv, d.q_size + d.kv_size);
        add_matrix(e, p + "self_attn.o_proj.weight", d.H, d.q_size, w.o_proj, 0);
        if (e->cfg.qk_norm) {
            add_vector(e, p + "self_attn.q_norm.weight", d.hd, w.q_norm);
            add_vector(e, p + "self_attn.k_norm.weight", d.hd, w.k_norm);
        }
        add_vector(e, p + "post_attention_layernorm.weight", d.H, w.post_attention_layernorm);
        if (w.is_moe) {
            add_matrix(e, p + "mlp.gate.weight", d.E, d.H, bf16_matrix(w.router), 0);
            for (int x = 0; x < d.E; ++x) {
                const std::string q = p + "mlp.experts." + std::to_string(x) + ".";
                const int64_t gate_row = (int64_t)x * 2 * d.Im;
                add_matrix(e, q + "gate_proj.weight", d.Im, d.H, w.expert_gate_up, gate_row);
                add_matrix(e, q + "up_proj.weight", d.Im, d.H, w.expert_gate_up, gate_row + d.Im);
                add_matrix(e, q + "down_proj.weight", d.H, d.Im, w.expert_down, (int64_t)x * d.H);
            }
        } else {
            add_matrix(e, p + "mlp.gate_proj.weight", d.I, d.H, w.gate_up, 0);
            add_matrix(e, p + "mlp.up_proj.weight", d.I, d.H, w.gate_up, d.I);
            add_matrix(e, p + "mlp.down_proj.weight", d.H, d.I, w.down, 0);
        }
    }
    add_vector(e, "model.norm.weight", d.H, e->final_norm);
    if (!e->cfg.tie_word_embeddings || e->cfg.weights_lm_head != OG_WEIGHTS_BF16)
        add_matrix(e, "lm_head.weight", d.V, d.H, e->lm_head, 0);
    e->slot_index.reserve(e->slots.size());
    for (size_t i = 0; i < e->slots.size(); ++i) e->slot_index.emplace(e->slots[i].name, i);
    e->resident.assign(e->slots.size(), 0);
    e->n_missing = e->slots.size();
}

// Release everything; safe on a partially built engine. Errors are ignored (and cleared).
void destroy(og_engine *e) {
    if (e == nullptr) return;
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current != e->device) cudaSetDevice(e->device);
    if (e->stream) {
        cudaStreamSynchronize(e->stream);
        cudaStreamDestroy(e->stream);
    }
    device_free(e->arena);
    pinned_free(e->step_host);
    pinned_free(e->logits_host);
    pinned_free(e->next_host);
    (void)cudaGetLastError();
    delete e;
}

og_status plan_kernels(og_engine *e) {
    const Dims &d = e->d;
    int smem_optin = 0;
    OG_CUDA_TRY(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                       e->device));
    // A GEMV stages its input vector in shared memory (bf16 GEMVs with the RMSNorm fused in
    // front, whose input is the hidden state, stage the norm weights beside it).
    const struct { const char *name; int cols; size_t copies; } inputs[] = {
        {"hidden_size", d.H, 2},
        {"num_attention_heads * head_dim", d.q_size, 1},
        {"intermediate_size", d.I, 1},
    };
    const int dense = e->cfg.weights_dense;
    for (const auto &in : inputs)
        if (std::max(in.copies * gemv_input_smem_bytes(in.cols, OG_WEIGHTS_BF16),
                     gemv_input_smem_bytes(in.cols, dense)) > (size_t)smem_optin)
            return set_error(OG_E_UNSUPPORTED,
                             "og_config.%s=%d is too large: a GEMV input of %d floats does not "
                             "fit in the %d bytes of shared memory of a block",
                             in.name, in.cols, in.cols, smem_optin);
    OG_CUDA_TRY(gemv_plan(kGemvNorm, d.qkv_rows, d.H, &e->plan_qkv, dense));
    OG_CUDA_TRY(gemv_plan(kGemvResidual, d.H, d.q_size, &e->plan_o, dense));
    if (d.any_dense) {
        // The FFN's two projections stream the most bytes of a layer: a q4 one takes the
        // copy-engine stream (gemv_q4.cu; on the others it measured slower).
        OG_CUDA_TRY(gemv_plan(kGemvNormSwiglu, 2 * d.I, d.H, &e->plan_gate_up, dense, true));
        OG_CUDA_TRY(gemv_plan(kGemvResidual, d.H, d.I, &e->plan_down, dense, true));
    }
    if (d.any_moe) OG_CUDA_TRY(gemv_plan(kGemvNorm, d.E, d.H, &e->plan_router));
    OG_CUDA_TRY(gemv_plan(kGemvNorm, d.V, d.H, &e->plan_lm_head, e->cfg.weights_lm_head));
    const cudaError_t err = attention_plan(d.n_heads, d.n_kv, d.hd, d.max_seq, d.kv_dtype, 0,
                                           &e->plan_attention);
    if (err == cudaErrorInvalidValue) {
        (void)cudaGetLastError();
        return set_error(OG_E_UNSUPPORTED,
                         "og_config: attention with num_attention_heads=%d, "
                         "num_key_value_heads=%d, head_dim=%d does not fit in shared memory",
                         d.n_heads, d.n_kv, d.hd);
    }
    OG_CUDA_TRY(err);
    return OG_OK;
}

og_status init_engine(og_engine *e) {
    OG_CUDA_TRY(cudaSetDevice(e->device));
    cudaDeviceProp prop;
    OG_CUDA_TRY(cudaGetDeviceProperties(&prop, e->device));
    const char *pdl_env = getenv("ONEGRAPH_PDL");
    e->pdl = prop.major >= 9 && !(pdl_env != nullptr && strcmp(pdl_env, "0") == 0);
    e->d = derive_dims(e);
    og_status status = plan_kernels(e);
    if (status != OG_OK) return status;
    const og_config &c = e->cfg;
    const int page = c.kv_page_size > 0 ? c.kv_page_size : kKvDefaultPageSize;
    const int n_blocks = c.kv_pool_blocks > 0 ? c.kv_pool_blocks : ceil_div(c.max_seq_len, page);
    e->kv.layout = plan_kv_layout(e->d.L, e->d.n_kv, e->d.hd, e->d.kv_dtype, page, n_blocks,
                                  c.max_seq_len,
                                  c.kv_max_sequences > 0 ? c.kv_max_sequences : kKvDefaultMaxSequences);
    e->kv.kv_dtype = e->d.kv_dtype;
    e->kv.max_seq_len = e->d.max_seq;

    e->arena_bytes = layout_arena(e, 0);
    OG_CUDA_TRY(cudaStreamCreateWithFlags(&e->stream, cudaStreamNonBlocking));
    OG_CUDA_TRY(device_alloc(&e->arena, e->arena_bytes));
    layout_arena(e, reinterpret_cast<uintptr_t>(e->arena));
    // Zeros everywhere: pad columns of the weights, the KV cache, the attention counters.
    OG_CUDA_TRY(cudaMemsetAsync(e->arena, 0, e->arena_bytes, e->stream));
    OG_CUDA_TRY(e->kv_guards.fill(e->stream));
    OG_CUDA_TRY(pinned_alloc(&e->step_host, kStepSlots * sizeof(og_step_record)));
    OG_CUDA_TRY(pinned_alloc(&e->logits_host, (size_t)e->d.V * sizeof(float)));
    memset(e->step_host, 0, kStepSlots * sizeof(og_step_record));
    memset(e->logits_host, 0, (size_t)e->d.V * sizeof(float));
    OG_CUDA_TRY(pinned_alloc(&e->next_host, kStepSlots * sizeof(SampledResult)));
    memset(e->next_host, 0, kStepSlots * sizeof(SampledResult));
    for (int slot = 0; slot < kStepSlots; ++slot)
        e->next_host[slot].next = NextToken{-1, 0.f};  // no OG_OUTPUT_NEXT_TOKEN step yet
    e->seq_sampling.assign((size_t)e->kv.layout.max_sequences, default_sampling());

    std::vector<float> inv_freq(e->d.hd / 2);
    rope_inv_freq(e->d.hd, (double)e->cfg.rope_theta, (double)e->cfg.rope_linear_factor,
                  inv_freq.data());
    OG_CUDA_TRY(cudaMemcpyAsync(e->inv_freq, inv_freq.data(), inv_freq.size() * sizeof(float),
                                cudaMemcpyHostToDevice, e->stream));
    OG_CUDA_TRY(cudaStreamSynchronize(e->stream));
    status = e->kv.init(e->stream);  // sequence 0, selected; the pool is zero (memset above)
    if (status != OG_OK) return status;

    build_weight_table(e);
    e->stats.device_bytes = e->arena_bytes;
    e->stats.weight_bytes = e->weight_bytes;
    e->stats.kv_cache_bytes = (uint64_t)e->kv.layout.pool_bytes();
    return OG_OK;
}

og_status precheck(og_engine *e) {
    if (e->n_missing == 0) return OG_OK;
    for (size_t i = 0; i < e->slots.size(); ++i)
        if (!e->resident[i])
            return set_error(OG_E_MISSING_WEIGHT,
                             "weight %s is not resident (%zu of %zu required tensors missing)",
                             e->slots[i].name.c_str(), e->n_missing, e->slots.size());
    return OG_OK;
}

// Bytes of one row of a matrix as og_set_weight receives it (onegraph.h "weight formats").
int64_t source_row_bytes(const WeightSlot &s) {
    switch (s.format) {
        case OG_WEIGHTS_INT8: return s.cols;
        case OG_WEIGHTS_Q4: return weight_row_bytes(OG_WEIGHTS_Q4, s.cols);  // whole groups
    }
    return s.cols * (int64_t)sizeof(__nv_bfloat16);
}

// The dtype og_set_weight expects for slot s.
int32_t expected_dtype(const WeightSlot &s) {
    if (s.kind == WeightSlot::kScales) return s.format == OG_WEIGHTS_INT8 ? OG_DTYPE_F32 : OG_DTYPE_BF16;
    return s.format == OG_WEIGHTS_INT8 ? OG_DTYPE_I8 : s.format == OG_WEIGHTS_Q4 ? OG_DTYPE_Q4 : OG_DTYPE_BF16;
}

og_status upload(og_engine *e, const WeightSlot &s, int32_t dtype, const void *data) {
    if (s.kind == WeightSlot::kScales) {  // q4: the e5m3 codes og_set_weight made
        OG_CUDA_TRY(cudaMemcpyAsync(s.dst, data, (size_t)(s.rows * s.pitch),
                                    cudaMemcpyHostToDevice, e->stream));
    } else if (s.kind == WeightSlot::kMatrix) {
        const size_t row_bytes = (size_t)source_row_bytes(s);
        if ((int64_t)row_bytes == s.pitch) {
            OG_CUDA_TRY(cudaMemcpyAsync(s.dst, data, row_bytes * s.rows,
                                        cudaMemcpyHostToDevice, e->stream));
        } else {  // rows land at the padded stride; the pad columns keep their zeros
            OG_CUDA_TRY(cudaMemcpy2DAsync(s.dst, (size_t)s.pitch, data, row_bytes, row_bytes,
                                          s.rows, cudaMemcpyHostToDevice, e->stream));
        }
    } else {
        std::vector<float> values(s.cols);
        if (dtype == OG_DTYPE_F32) {
            memcpy(values.data(), data, values.size() * sizeof(float));
        } else {
            const uint16_t *bits = static_cast<const uint16_t *>(data);
            for (int64_t i = 0; i < s.cols; ++i) {
                const uint32_t w = (uint32_t)bits[i] << 16;
                memcpy(&values[i], &w, sizeof w);
            }
        }
        OG_CUDA_TRY(cudaMemcpyAsync(s.vector, values.data(), values.size() * sizeof(float),
                                    cudaMemcpyHostToDevice, e->stream));
    }
    OG_CUDA_TRY(cudaStreamSynchronize(e->stream));
    return OG_OK;
}

// THE BODY: one decode step, enqueued on `stream`.
og_status enqueue_body(og_engine *e, cudaStream_t stream) {
    const Dims &d = e->d;
    const og_config &c = e->cfg;
    const bool pdl = e->pdl;
    const auto keep = [e](int kind) { return (e->test_omit & kind) == 0; };  // og_test_set_omit
    // The newest begun step's slot: its pinned record in, its pinned result out.
    const int slot = e->n_pending > 0 ? e->pending[e->n_pending - 1].slot : 0;
    OG_CUDA_TRY(cudaMemcpyAsync(e->step, e->step_host + slot, sizeof(og_step_record),
                                cudaMemcpyHostToDevice, stream));
    // A chained step's token is the previous step's argmax, still in e->next_token.
    OG_CUDA_TRY(launch_embedding(e->embed_tokens, d.V, d.H, e->step, e->next_token, e->x, stream,
                                 false));

    for (int l = 0; l < d.L; ++l) {
        const LayerWeights &w = e->layers[l];
        // ---- attention block: x += o_proj(attention(rope(qkv_proj(rmsnorm(x))))) ----
        GemvArgs qkv_proj = {w.qkv.data, d.qkv_rows, d.H, e->x, w.input_layernorm,
                             c.rms_norm_eps, e->qkv, nullptr, w.qkv.scales, w.qkv.format};
        if (keep(OG_TEST_OMIT_QKV)) OG_CUDA_TRY(launch_gemv(kGemvNorm, e->plan_qkv, qkv_proj, stream, pdl));

        // QK-norm + RoPE + the K/V write of this row + attention, one kernel. Layer 0 also
        // stores the row's block into the block table; later layers read it there.
        AttentionArgs attn = {};
        attn.qkv = e->qkv;
        attn.q_norm = w.q_norm;
        attn.k_norm = w.k_norm;
        attn.eps = c.rms_norm_eps;
        attn.inv_freq = e->inv_freq;
        attn.table_update = l == 0 ? e->kv.tables : nullptr;
        attn.kv = e->kv.pages(l);
        attn.step = e->step;
        attn.n_heads = d.n_heads;
        attn.n_kv_heads = d.n_kv;
        attn.head_dim = d.hd;
        attn.max_seq_len = d.max_seq;
        attn.kv_dtype = d.kv_dtype;
        attn.partials = e->attn_partials;
        attn.counters = e->attn_counters;
        attn.out = e->attn_out;
        if (keep(OG_TEST_OMIT_ATTENTION)) OG_CUDA_TRY(launch_attention(attn, e->plan_attention, stream, pdl));

        GemvArgs o_proj = {w.o_proj.data, d.H, d.q_size, e->attn_out, nullptr, 0.f, e->x,
                           nullptr, w.o_proj.scales, w.o_proj.format};
        // x's last writer is the previous layer's FFN, three kernels back (none when omitted).
        o_proj.residual_settled = e->test_omit == 0;
        if (keep(OG_TEST_OMIT_O_PROJ)) OG_CUDA_TRY(launch_gemv(kGemvResidual, e->plan_o, o_proj, stream, pdl));

        // ---- FFN block: x += mlp(rmsnorm(x)) ----
        if (w.is_moe) {
            GemvArgs router = {w.router, d.E, d.H, e->x, w.post_attention_layernorm,
                               c.rms_norm_eps, e->router_logits, e->normed};
            const MoeExperts gate_up = {w.expert_gate_up.data, w.expert_gate_up.scales,
                                        w.expert_gate_up.format};
            const MoeExperts down = {w.expert_down.data, w.expert_down.scales,
                                     w.expert_down.format};
            if (keep(OG_TEST_OMIT_FFN_IN)) {
                OG_CUDA_TRY(launch_gemv(kGemvNorm, e->plan_router, router, stream, pdl));
                OG_CUDA_TRY(launch_moe_topk(e->router_logits, d.E, d.top_k, c.norm_topk_prob,
                                            e->selected_experts, e->selected_weights, stream, pdl));
                OG_CUDA_TRY(launch_moe_gate_up_swiglu(gate_up, e->normed, e->selected_experts,
                                                      d.top_k, d.H, d.Im, e->moe_act, stream, pdl));
            }
            if (keep(OG_TEST_OMIT_FFN_OUT))
                OG_CUDA_TRY(launch_moe_down_weighted_residual(down, e->moe_act, e->selected_experts,
                                                              e->selected_weights, d.top_k, d.H,
                                                              d.Im, e->x, stream, pdl));
        } else {
            GemvArgs gate_up = {w.gate_up.data, 2 * d.I, d.H, e->x, w.post_attention_layernorm,
                                c.rms_norm_eps, e->act, nullptr, w.gate_up.scales,
                                w.gate_up.format};
            if (keep(OG_TEST_OMIT_FFN_IN))
                OG_CUDA_TRY(launch_gemv(kGemvNormSwiglu, e->plan_gate_up, gate_up, stream, pdl));
            GemvArgs down = {w.down.data, d.H, d.I, e->act, nullptr, 0.f, e->x, nullptr,
                             w.down.scales, w.down.format};
            // x's last writer is the O projection, two kernels back (none when omitted).
            down.residual_settled = e->test_omit == 0;
            if (keep(OG_TEST_OMIT_FFN_OUT))
                OG_CUDA_TRY(launch_gemv(kGemvResidual, e->plan_down, down, stream, pdl));
        }
    }

    // ---- logits = lm_head(rmsnorm(x)) ----
    GemvArgs lm_head = {e->lm_head.data, d.V, d.H, e->x, e->final_norm, c.rms_norm_eps,
                        e->logits, nullptr, e->lm_head.scales, e->lm_head.format};
    if (keep(OG_TEST_OMIT_LM_HEAD)) OG_CUDA_TRY(launch_gemv(kGemvNorm, e->plan_lm_head, lm_head, stream, pdl));
    // ---- the one device->host copy: the logits, or only their argmax (og_set_output) ----
    if (e->output == OG_OUTPUT_NEXT_TOKEN) {
        OG_CUDA_TRY(launch_argmax(e->logits, d.V, e->argmax_partials, e->argmax_ticket,
                                  e->next_token, stream, pdl));
        OG_CUDA_TRY(cudaMemcpyAsync(e->next_host + slot, e->next_token, sizeof(NextToken),
                                    cudaMemcpyDeviceToHost, stream));
    } else if (e->output == OG_OUTPUT_SAMPLED || e->output == OG_OUTPUT_SAMPLED_LOGPROBS) {
        const SampleArgs sample = {e->logits, d.V, e->step, e->next_token, e->sample_counts,
                                   e->sample_z, e->sample_state, e->sampled};
        OG_CUDA_TRY(launch_sample(sample, stream, pdl));
        const size_t bytes = e->output == OG_OUTPUT_SAMPLED ? sizeof(NextToken) : sizeof(SampledResult);
        OG_CUDA_TRY(cudaMemcpyAsync(e->next_host + slot, e->sampled, bytes,
                                    cudaMemcpyDeviceToHost, stream));
    } else {
        OG_CUDA_TRY(cudaMemcpyAsync(e->logits_host, e->logits, (size_t)d.V * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream));
    }
    e->stats.enqueues += 1;
    e->stats.h2d_copies += 1;
    e->stats.d2h_copies += 1;
    return OG_OK;
}

// ---- og_prefill: the batched prompt pass (prefill.cu) ----------------------------------
PrefillModel prefill_model(const og_engine *e) {
    const Dims &d = e->d;
    PrefillModel m;
    m.V = d.V, m.H = d.H, m.I = d.I, m.n_heads = d.n_heads, m.n_kv = d.n_kv, m.hd = d.hd;
    m.max_seq = d.max_seq, m.kv_dtype = d.kv_dtype;
    m.E = d.E, m.top_k = d.top_k, m.Im = d.Im, m.norm_topk_prob = e->cfg.norm_topk_prob;
    m.eps = e->cfg.rms_norm_eps;
    m.embed_tokens = e->embed_tokens;
    m.inv_freq = e->inv_freq;
    m.layers.resize(d.L);
    const auto matrix = [](const DeviceMatrix &w, int rows, int cols) {
        PrefillMatrix m;
        m.data = w.data;
        m.scales = w.scales;
        m.format = w.format;
        m.rows = rows;
        m.cols = cols;
        return m;
    };
    for (int l = 0; l < d.L; ++l) {
        const LayerWeights &w = e->layers[l];
        PrefillLayer &p = m.layers[l];
        p.is_moe = w.is_moe;
        p.input_layernorm = w.input_layernorm;
        p.post_attention_layernorm = w.post_attention_layernorm;
        p.q_norm = w.q_norm;
        p.k_norm = w.k_norm;
        p.qkv = matrix(w.qkv, d.qkv_rows, d.H);
        p.o_proj = matrix(w.o_proj, d.H, d.q_size);
        if (w.is_moe) {
            p.router = w.router;
            p.expert_gate_up = {w.expert_gate_up.data, w.expert_gate_up.scales, w.expert_gate_up.format};
            p.expert_down = {w.expert_down.data, w.expert_down.scales, w.expert_down.format};
        } else {
            p.gate_up = matrix(w.gate_up, 2 * d.I, d.H);
            p.down = matrix(w.down, d.H, d.I);
        }
        p.kv = e->kv.pages(l);
    }
    m.plan_router = e->plan_router;
    m.router_logits = e->router_logits;
    m.moe_normed = e->normed;
    m.selected_weights = e->selected_weights;
    m.moe_act = e->moe_act;
    m.selected_experts = e->selected_experts;
    m.scratch = e->prefill;
    return m;
}

// The chunks, then the decode body's final RMSNorm + lm_head GEMV on the last token's row and
// the logits copy; the sequence grows only after all of it completed.
og_status run_prefill(og_engine *e, KvSequence &seq, const int32_t *tokens, int32_t n_tokens) {
    const Dims &d = e->d;
    const cudaStream_t stream = e->stream;
    const PrefillModel m = prefill_model(e);
    // Every row the chunks read or write is in the host block table (reserved); the device row
    // may lag (rows of earlier steps are stored by the body as it goes).
    int32_t *table_row = e->kv.tables + (size_t)seq.slot * e->kv.layout.max_blocks_per_seq;
    OG_CUDA_TRY(cudaMemcpyAsync(table_row, seq.blocks.data(), seq.blocks.size() * sizeof(int32_t),
                                cudaMemcpyHostToDevice, stream));
    const int chunk = e->prefill.chunk;
    for (int32_t start = 0; start < n_tokens; start += chunk) {
        const int count = std::min(chunk, n_tokens - start);
        OG_CUDA_TRY(cudaMemcpyAsync(e->prefill.tokens, tokens + start, count * sizeof(int32_t),
                                    cudaMemcpyHostToDevice, stream));
        OG_CUDA_TRY(enqueue_prefill_chunk(m, table_row, count, seq.length + start, stream));
    }
    const int last_row = (n_tokens - 1) % chunk;
    GemvArgs lm_head = {e->lm_head.data, d.V, d.H, e->prefill.x + (size_t)last_row * d.H,
                        e->final_norm, e->cfg.rms_norm_eps, e->logits, nullptr,
                        e->lm_head.scales, e->lm_head.format};
    OG_CUDA_TRY(launch_gemv(kGemvNorm, e->plan_lm_head, lm_head, stream, false));
    OG_CUDA_TRY(cudaMemcpyAsync(e->logits_host, e->logits, (size_t)d.V * sizeof(float),
                                cudaMemcpyDeviceToHost, stream));
    OG_CUDA_TRY(cudaStreamSynchronize(stream));
    seq.length += n_tokens;
    return OG_OK;
}

}  // namespace

// ---- the C ABI -------------------------------------------------------------------------
extern "C" {

OG_API int32_t og_abi_version(void) { return OG_ABI_VERSION; }

OG_API const char *og_last_error(void) { return t_last_error.c_str(); }

// packed_file.c reports its errors through here (declared in packed_file.h).
void og_set_last_error_message(const char *message) {
    t_last_error = message != nullptr ? message : "";
}

OG_API void og_config_default(og_config *cfg) {
    if (cfg == nullptr) return;
    memset(cfg, 0, sizeof *cfg);
    cfg->abi_version = OG_ABI_VERSION;
    cfg->rms_norm_eps = 1e-6f;
    cfg->rope_theta = 1e6f;
    cfg->rope_linear_factor = 1.0f;
    cfg->kv_dtype = OG_KV_INT8;
    cfg->max_seq_len = 4096;
    cfg->device_ordinal = 0;
    cfg->weights_dense = OG_WEIGHTS_BF16;
    cfg->weights_experts = OG_WEIGHTS_BF16;
    cfg->weights_lm_head = OG_WEIGHTS_BF16;
}

OG_API og_status og_device_count(int32_t *count) {
    if (count == nullptr) return set_error(OG_E_INVALID_ARGUMENT, "og_device_count: count is NULL");
    *count = 0;
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return set_error(OG_E_NO_DEVICE, "no CUDA device: %s", cudaGetErrorString(err));
    }
    if (n <= 0) return set_error(OG_E_NO_DEVICE, "no CUDA device: the driver reports none");
    *count = n;
    return OG_OK;
}

OG_API og_status og_init(const og_config *cfg, og_engine **out) {
    if (out == nullptr) return set_error(OG_E_INVALID_ARGUMENT, "og_init: out is NULL");
    *out = nullptr;
    if (cfg == nullptr) return set_error(OG_E_INVALID_ARGUMENT, "og_init: cfg is NULL");
    og_status status = validate_config(cfg);
    if (status != OG_OK) return status;
    status = require_device();
    if (status != OG_OK) return status;
    int count = 0;
    OG_CUDA_TRY(cudaGetDeviceCount(&count));
    if (cfg->device_ordinal >= count)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_config.device_ordinal=%d but there are %d CUDA devices",
                         cfg->device_ordinal, count);

    og_engine *e = new (std::nothrow) og_engine();
    if (e == nullptr) return set_error(OG_E_OUT_OF_MEMORY, "og_init: host allocation failed");
    try {
        e->cfg = *cfg;
        e->layer_is_moe.resize(cfg->num_hidden_layers);
        for (int l = 0; l < cfg->num_hidden_layers; ++l) e->layer_is_moe[l] = layer_moe(cfg, l);
        e->cfg.layer_is_moe = e->layer_is_moe.data();
        e->device = cfg->device_ordinal;
        status = init_engine(e);
    } catch (const std::bad_alloc &) {
        status = set_error(OG_E_OUT_OF_MEMORY, "og_init: host allocation failed");
    }
    if (status != OG_OK) {
        destroy(e);
        return status;
    }
    {
        std::lock_guard<std::mutex> lock(g_registry_mutex);
        registry().insert(e);
    }
    *out = e;
    return OG_OK;
}

OG_API og_status og_set_weight(og_engine *e, const char *name, int32_t dtype, int32_t ndim,
                               const int64_t *shape, const void *data) {
    OG_CHECK_HANDLE(e);
    if (name == nullptr) return set_error(OG_E_INVALID_ARGUMENT, "og_set_weight: name is NULL");
    const auto found = e->slot_index.find(name);
    if (found == e->slot_index.end())
        return set_error(OG_E_UNKNOWN_WEIGHT, "%s: not a tensor of this model's config", name);
    const size_t index = found->second;
    const WeightSlot &s = e->slots[index];
    if (ndim < 0 || (ndim > 0 && shape == nullptr))
        return set_error(OG_E_INVALID_ARGUMENT, "%s: shape is NULL or ndim=%d is negative", name,
                         ndim);
    if (dtype != OG_DTYPE_F32 && dtype != OG_DTYPE_BF16 && dtype != OG_DTYPE_I8 &&
        dtype != OG_DTYPE_Q4)
        return set_error(OG_E_INVALID_ARGUMENT, "%s: dtype=%d is not an OG_DTYPE_* value", name,
                         dtype);
    const std::string got = shape_text(ndim, shape) + " (" + dtype_name(dtype) + ")";
    if (s.kind != WeightSlot::kVector) {
        // Matrices [rows, cols]; int8 scales [rows]; q4 scales [rows, groups].
        const int64_t groups = weight_scales_per_row(s.format, s.cols);
        const bool row_scales = s.kind == WeightSlot::kScales && s.format == OG_WEIGHTS_INT8;
        const int64_t want[2] = {s.rows, s.kind == WeightSlot::kScales ? groups : s.cols};
        const int want_ndim = row_scales ? 1 : 2;
        const int32_t want_dtype = expected_dtype(s);
        if (dtype != want_dtype || ndim != want_ndim || shape[0] != want[0] ||
            (want_ndim == 2 && shape[1] != want[1]))
            return set_error(OG_E_WEIGHT_MISMATCH, "%s: expected shape %s (%s), got %s", name,
                             shape_text(want_ndim, want).c_str(), dtype_name(want_dtype),
                             got.c_str());
    } else {
        const int64_t want[1] = {s.cols};
        if ((dtype != OG_DTYPE_BF16 && dtype != OG_DTYPE_F32) || ndim != 1 || shape[0] != s.cols)
            return set_error(OG_E_WEIGHT_MISMATCH, "%s: expected shape %s (bf16 or f32), got %s",
                             name, shape_text(1, want).c_str(), got.c_str());
    }
    if (data == nullptr) return set_error(OG_E_INVALID_ARGUMENT, "%s: data is NULL", name);
    // q4 scales arrive as bf16 and are stored as e5m3 (quant.cuh): converted here, in one pass
    // that also refuses a negative scale before anything changes.
    std::vector<uint8_t> q4_codes;
    if (s.kind == WeightSlot::kScales && s.format == OG_WEIGHTS_Q4) {
        const uint16_t *bits = static_cast<const uint16_t *>(data);
        q4_codes.resize((size_t)(s.rows * s.pitch));
        for (size_t i = 0; i < q4_codes.size(); ++i)
            if (!q4_scale_code(bits[i], &q4_codes[i]))
                return set_error(OG_E_WEIGHT_MISMATCH,
                                 "%s: q4 scale [%lld, %lld] is negative (bf16 bits 0x%04x); a q4 "
                                 "scale is max|w| / 7 of its group",
                                 name, (long long)(i / s.pitch), (long long)(i % s.pitch),
                                 (unsigned)bits[i]);
        data = q4_codes.data();
    }
    og_status status = use_device(e);
    if (status != OG_OK) return status;
    status = upload(e, s, dtype, data);
    if (status != OG_OK) {
        // The device copy may be partial: the tensor no longer counts as resident.
        if (e->resident[index]) {
            e->resident[index] = 0;
            e->n_missing += 1;
        }
        return status;
    }
    if (!e->resident[index]) {
        e->resident[index] = 1;
        e->n_missing -= 1;
    }
    return OG_OK;
}

OG_API og_status og_precheck(og_engine *e) {
    OG_CHECK_HANDLE(e);
    return precheck(e);
}

OG_API og_status og_begin_step(og_engine *e, int32_t token) {
    OG_CHECK_HANDLE(e);
    if (token < 0 || token >= e->d.V)
        return set_error(OG_E_TOKEN_OUT_OF_RANGE, "token %d is outside the vocabulary [0, %d)",
                         token, e->d.V);
    const int32_t id = e->kv.current;
    KvSequence *seq = nullptr;
    if (id < 0 || e->kv.lookup(id, "og_begin_step", &seq) != OG_OK)
        return set_error(OG_E_BAD_STATE, "og_begin_step: no sequence is selected (og_seq_select)");
    const int32_t position = seq->length;
    if (position >= e->d.max_seq)
        return set_error(OG_E_CONTEXT_FULL,
                         "position %d: sequence %d is full (max_seq_len=%d); og_reset starts it "
                         "over",
                         position, id, e->d.max_seq);
    og_status status = precheck(e);
    if (status != OG_OK) return status;
    status = use_device(e);
    if (status != OG_OK) return status;
    // The only state this changes before the record: the row's block (a fresh block, or a
    // private copy of a shared one), which any later step of the sequence would take too.
    status = e->kv.reserve(id, 1, e->stream);
    if (status != OG_OK) return status;
    e->step_host[0] = og_step_record{token, position, seq->slot,
                                     seq->blocks[position / e->kv.layout.page_size],
                                     e->seq_sampling[seq->slot]};
    e->pending[0] = og_engine::PendingStep{id, 0, position, e->output};
    e->n_pending = 1;
    return OG_OK;
}

OG_API og_status og_begin_chained_step(og_engine *e, int32_t *slot) {
    OG_CHECK_HANDLE(e);
    if (slot == nullptr)
        return set_error(OG_E_INVALID_ARGUMENT, "og_begin_chained_step: slot is NULL");
    if (e->n_pending != 1)
        return set_error(OG_E_BAD_STATE,
                         "og_begin_chained_step: needs exactly one step begun and not ended "
                         "(%d are)",
                         e->n_pending);
    const og_engine::PendingStep prev = e->pending[0];
    if (prev.output == OG_OUTPUT_LOGITS || e->output == OG_OUTPUT_LOGITS)
        return set_error(OG_E_BAD_STATE,
                         "og_begin_chained_step: the token is the previous step's argmax or "
                         "sample on the device: both steps need og_set_output("
                         "OG_OUTPUT_NEXT_TOKEN or OG_OUTPUT_SAMPLED[_LOGPROBS])");
    const int32_t id = e->kv.current;
    if (id != prev.seq)
        return set_error(OG_E_BAD_STATE,
                         "og_begin_chained_step: the step in flight is on sequence %d, sequence "
                         "%d is selected",
                         prev.seq, id);
    KvSequence *seq = nullptr;
    og_status status = e->kv.lookup(id, "og_begin_chained_step", &seq);
    if (status != OG_OK) return status;
    const int32_t position = prev.position + 1;
    if (position >= e->d.max_seq)
        return set_error(OG_E_CONTEXT_FULL,
                         "position %d: sequence %d is full (max_seq_len=%d); og_reset starts it "
                         "over",
                         position, id, e->d.max_seq);
    status = precheck(e);
    if (status != OG_OK) return status;
    status = use_device(e);
    if (status != OG_OK) return status;
    // Rows prev.position (already writable) and position; a block the step in flight writes
    // is not copied again, so nothing here touches it.
    status = e->kv.reserve(id, 2, e->stream);
    if (status != OG_OK) return status;
    const int32_t next = 1 - prev.slot;
    e->step_host[next] = og_step_record{OG_TOKEN_PREVIOUS_ARGMAX, position, seq->slot,
                                        seq->blocks[position / e->kv.layout.page_size],
                                        e->seq_sampling[seq->slot]};
    e->pending[1] = og_engine::PendingStep{id, next, position, e->output};
    e->n_pending = 2;
    *slot = next;
    return OG_OK;
}

OG_API og_status og_cancel_step(og_engine *e) {
    OG_CHECK_HANDLE(e);
    if (e->n_pending == 0) return set_error(OG_E_BAD_STATE, "og_cancel_step: no step is begun");
    e->n_pending -= 1;
    return OG_OK;
}

OG_API og_status og_step_slot(og_engine *e, int32_t *slot) {
    OG_CHECK_HANDLE(e);
    if (slot == nullptr) return set_error(OG_E_INVALID_ARGUMENT, "og_step_slot: slot is NULL");
    *slot = e->n_pending > 0 ? e->pending[e->n_pending - 1].slot : 0;
    return OG_OK;
}

OG_API og_status og_enqueue(og_engine *e, void *stream) {
    OG_CHECK_HANDLE(e);
    og_status status = precheck(e);
    if (status != OG_OK) return status;
    status = use_device(e);
    if (status != OG_OK) return status;
    const cudaStream_t s = stream != nullptr ? static_cast<cudaStream_t>(stream) : e->stream;
    status = capture_fault_hook(s);  // test-only, a no-op unless armed (reliability.cuh)
    if (status != OG_OK) return status;
    return enqueue_body(e, s);
}

OG_API og_status og_run(og_engine *e) {
    OG_CHECK_HANDLE(e);
    if (e->n_pending == 0)
        return set_error(OG_E_BAD_STATE, "og_run: no step begun (call og_begin_step first)");
    og_status status = precheck(e);
    if (status != OG_OK) return status;
    status = use_device(e);
    if (status != OG_OK) return status;
    status = enqueue_body(e, e->stream);
    if (status != OG_OK) return status;
    OG_CUDA_TRY(cudaStreamSynchronize(e->stream));
    return OG_OK;
}

OG_API og_status og_end_step(og_engine *e) {
    OG_CHECK_HANDLE(e);
    if (e->n_pending == 0)
        return set_error(OG_E_BAD_STATE, "og_end_step: no step begun (call og_begin_step first)");
    const og_engine::PendingStep ended = e->pending[0];
    KvSequence *seq = nullptr;
    const og_status status = e->kv.lookup(ended.seq, "og_end_step", &seq);
    if (status != OG_OK) return status;  // unreachable: freeing a sequence cancels its steps
    seq->length += 1;
    if (ended.output != OG_OUTPUT_LOGITS) e->result_slot = ended.slot, e->result_output = ended.output;
    for (int i = 1; i < e->n_pending; ++i) e->pending[i - 1] = e->pending[i];
    e->n_pending -= 1;
    e->stats.steps += 1;
    return OG_OK;
}

OG_API og_status og_step(og_engine *e, int32_t token, const float **logits) {
    og_status status = og_begin_step(e, token);
    if (status != OG_OK) return status;
    status = og_run(e);
    if (status != OG_OK) {
        e->n_pending = 0;
        return status;
    }
    status = og_end_step(e);
    if (status != OG_OK) return status;
    if (logits != nullptr) *logits = e->logits_host;
    return OG_OK;
}

OG_API og_status og_prefill(og_engine *e, const int32_t *tokens, int32_t n_tokens,
                            float *logits) {
    OG_CHECK_HANDLE(e);
    if (tokens == nullptr || n_tokens <= 0)
        return set_error(OG_E_INVALID_ARGUMENT, "og_prefill: tokens is NULL or n_tokens=%d < 1",
                         n_tokens);
    const int32_t id = e->kv.current;
    KvSequence *seq = nullptr;
    if (id < 0 || e->kv.lookup(id, "og_prefill", &seq) != OG_OK)
        return set_error(OG_E_BAD_STATE, "og_prefill: no sequence is selected (og_seq_select)");
    for (int32_t i = 0; i < n_tokens; ++i)
        if (tokens[i] < 0 || tokens[i] >= e->d.V)
            return set_error(OG_E_TOKEN_OUT_OF_RANGE,
                             "og_prefill: tokens[%d]=%d is outside the vocabulary [0, %d)", i,
                             tokens[i], e->d.V);
    if ((int64_t)seq->length + n_tokens > e->d.max_seq)
        return set_error(OG_E_CONTEXT_FULL,
                         "og_prefill: sequence %d holds %d rows; %d more would exceed "
                         "max_seq_len=%d",
                         id, seq->length, n_tokens, e->d.max_seq);
    og_status status = precheck(e);
    if (status != OG_OK) return status;
    status = use_device(e);
    if (status != OG_OK) return status;
    status = e->kv.reserve(id, n_tokens, e->stream);  // OG_E_POOL_EXHAUSTED changes nothing
    if (status != OG_OK) return status;
    e->n_pending = 0;  // a begun step's row is no longer the sequence's next row
    status = run_prefill(e, *seq, tokens, n_tokens);
    if (status != OG_OK) return status;
    if (logits != nullptr) memcpy(logits, e->logits_host, (size_t)e->d.V * sizeof(float));
    return OG_OK;
}

OG_API og_status og_reset(og_engine *e) {
    OG_CHECK_HANDLE(e);
    if (e->kv.current < 0) return OG_OK;
    return og_seq_reset(e, e->kv.current);
}

OG_API og_status og_get_position(og_engine *e, int32_t *position) {
    OG_CHECK_HANDLE(e);
    if (position == nullptr)
        return set_error(OG_E_INVALID_ARGUMENT, "og_get_position: position is NULL");
    KvSequence *seq = nullptr;
    if (e->kv.current < 0 || e->kv.lookup(e->kv.current, "og_get_position", &seq) != OG_OK)
        return set_error(OG_E_BAD_STATE, "og_get_position: no sequence is selected");
    *position = seq->length;
    return OG_OK;
}

OG_API og_status og_step_record_ptr(og_engine *e, og_step_record **record) {
    OG_CHECK_HANDLE(e);
    if (record == nullptr)
        return set_error(OG_E_INVALID_ARGUMENT, "og_step_record_ptr: record is NULL");
    *record = e->step_host;
    return OG_OK;
}

OG_API og_status og_logits(og_engine *e, float **logits, int32_t *vocab_size) {
    OG_CHECK_HANDLE(e);
    if (logits == nullptr) return set_error(OG_E_INVALID_ARGUMENT, "og_logits: logits is NULL");
    *logits = e->logits_host;
    if (vocab_size != nullptr) *vocab_size = e->d.V;
    return OG_OK;
}

OG_API og_status og_set_output(og_engine *e, int32_t output) {
    OG_CHECK_HANDLE(e);
    if (output < OG_OUTPUT_LOGITS || output > OG_OUTPUT_SAMPLED_LOGPROBS)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_set_output: output=%d is none of OG_OUTPUT_LOGITS (%d), "
                         "OG_OUTPUT_NEXT_TOKEN (%d), OG_OUTPUT_SAMPLED (%d), "
                         "OG_OUTPUT_SAMPLED_LOGPROBS (%d)",
                         output, OG_OUTPUT_LOGITS, OG_OUTPUT_NEXT_TOKEN, OG_OUTPUT_SAMPLED,
                         OG_OUTPUT_SAMPLED_LOGPROBS);
    e->output = output;
    return OG_OK;
}

OG_API og_status og_next_token(og_engine *e, int32_t *token, float *logit) {
    OG_CHECK_HANDLE(e);
    if (token == nullptr) return set_error(OG_E_INVALID_ARGUMENT, "og_next_token: token is NULL");
    const NextToken next = e->next_host[e->result_slot].next;
    *token = next.token;
    if (logit != nullptr) *logit = next.logit;
    if (e->result_output != OG_OUTPUT_NEXT_TOKEN && next.token == OG_TOKEN_NONFINITE)
        return set_error(OG_E_NONFINITE_LOGITS,
                         "og_next_token: the sampled step's logits hold a NaN or +inf (or overflow "
                         "to +inf over the temperature, or are all -inf)");
    if (e->result_output != OG_OUTPUT_NEXT_TOKEN && next.token == OG_TOKEN_OVERFLOW)
        return set_error(OG_E_UNSUPPORTED,
                         "og_next_token: more than %d ids lie within 1/8 nat of the sampling "
                         "filters' cut (a flat distribution with top_k=0 and top_p < 1, or top_k "
                         "> %d): use a smaller top_k",
                         kSampleCandidates, kSampleCandidates);
    return OG_OK;
}

// ---- sampling parameters and counts per sequence (sample.cuh) ----
OG_API og_status og_seq_set_sampling(og_engine *e, int32_t seq, const og_sampling_params *params) {
    OG_CHECK_HANDLE(e);
    if (params == nullptr)
        return set_error(OG_E_INVALID_ARGUMENT, "og_seq_set_sampling: params is NULL");
    const og_sampling_params &p = *params;
    const char *bad = !(p.temperature >= 0.f && std::isfinite(p.temperature)) ? "temperature >= 0"
                    : p.top_k < 0 ? "top_k >= 0"
                    : !(p.top_p > 0.f && p.top_p <= 1.f) ? "top_p in (0, 1]"
                    : !(p.min_p >= 0.f && p.min_p <= 1.f) ? "min_p in [0, 1]"
                    : !(p.repetition_penalty > 0.f && std::isfinite(p.repetition_penalty)) ? "repetition_penalty > 0"
                    : !std::isfinite(p.presence_penalty) ? "a finite presence_penalty"
                    : !std::isfinite(p.frequency_penalty) ? "a finite frequency_penalty"
                    : (p.logprobs < 0 || p.logprobs > OG_MAX_LOGPROBS) ? "logprobs in [0, 20]"
                    : nullptr;
    if (bad != nullptr)
        return set_error(OG_E_INVALID_ARGUMENT, "og_seq_set_sampling: the parameters need %s", bad);
    KvSequence *found = nullptr;
    og_status status = e->kv.lookup(seq, "og_seq_set_sampling", &found);
    if (status != OG_OK) return status;
    status = use_device(e);
    if (status != OG_OK) return status;
    // New parameters start the generated-token counts over (a new generation).
    status = clear_counts(e, found->slot);
    if (status != OG_OK) return status;
    e->seq_sampling[found->slot] = p;
    return OG_OK;
}

OG_API og_status og_top_logprobs(og_engine *e, og_top_logprob *top, int32_t capacity,
                                 int32_t *count) {
    OG_CHECK_HANDLE(e);
    if (count == nullptr || (top == nullptr && capacity > 0) || capacity < 0)
        return set_error(OG_E_INVALID_ARGUMENT, "og_top_logprobs: count is NULL or top/capacity bad");
    const SampledResult &r = e->next_host[e->result_slot];
    const int n = e->result_output == OG_OUTPUT_SAMPLED_LOGPROBS && r.next.token >= 0 ? r.n_top : 0;
    for (int j = 0; j < n && j < capacity; ++j) top[j] = r.top[j];
    *count = n;
    return OG_OK;
}

OG_API og_status og_stream(og_engine *e, void **stream) {
    OG_CHECK_HANDLE(e);
    if (stream == nullptr) return set_error(OG_E_INVALID_ARGUMENT, "og_stream: stream is NULL");
    *stream = e->stream;
    return OG_OK;
}

OG_API og_status og_get_stats(og_engine *e, og_stats *stats) {
    OG_CHECK_HANDLE(e);
    if (stats == nullptr) return set_error(OG_E_INVALID_ARGUMENT, "og_get_stats: stats is NULL");
    *stats = e->stats;
    return OG_OK;
}

OG_API og_status og_copy_kv_cache(og_engine *e, void *host_dst, uint64_t capacity_bytes) {
    OG_CHECK_HANDLE(e);
    if (host_dst == nullptr)
        return set_error(OG_E_INVALID_ARGUMENT, "og_copy_kv_cache: host_dst is NULL");
    const uint64_t needed = (uint64_t)e->kv.layout.pool_bytes();
    if (capacity_bytes < needed)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_copy_kv_cache: capacity_bytes=%llu < kv_cache_bytes=%llu",
                         (unsigned long long)capacity_bytes, (unsigned long long)needed);
    const og_status status = use_device(e);
    if (status != OG_OK) return status;
    OG_CUDA_TRY(cudaStreamSynchronize(e->stream));
    char *dst = static_cast<char *>(host_dst);
    OG_CUDA_TRY(cudaMemcpyAsync(dst, e->kv.pool, (size_t)needed, cudaMemcpyDeviceToHost,
                                e->stream));
    OG_CUDA_TRY(cudaStreamSynchronize(e->stream));
    return OG_OK;
}

OG_API og_status og_free(og_engine *e) {
    if (e == nullptr) return set_error(OG_E_INVALID_HANDLE, "og_free: NULL engine handle");
    {
        std::lock_guard<std::mutex> lock(g_registry_mutex);
        if (registry().erase(e) == 0)
            return set_error(OG_E_INVALID_HANDLE,
                             "og_free: not a live engine handle (already freed?)");
    }
    destroy(e);
    return OG_OK;
}

// ---- reliability entry points (onegraph_testing.h) --------------------------------------
OG_API og_status og_check_guards(og_engine *e) {
    OG_CHECK_HANDLE(e);
    const og_status status = use_device(e);
    if (status != OG_OK) return status;
    return e->kv_guards.check(e->stream);
}

OG_API og_status og_test_corrupt_guard(og_engine *e, const char *buffer, int32_t after) {
    OG_CHECK_HANDLE(e);
    if (buffer == nullptr || (after != 0 && after != 1))
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_test_corrupt_guard: buffer is NULL or after=%d is not 0 or 1", after);
    const og_status status = use_device(e);
    if (status != OG_OK) return status;
    return e->kv_guards.corrupt(buffer, after, e->stream);
}

OG_API og_status og_test_set_omit(og_engine *e, int32_t kinds) {
    OG_CHECK_HANDLE(e);
    constexpr int32_t all = OG_TEST_OMIT_QKV | OG_TEST_OMIT_ATTENTION | OG_TEST_OMIT_O_PROJ |
                            OG_TEST_OMIT_FFN_IN | OG_TEST_OMIT_FFN_OUT | OG_TEST_OMIT_LM_HEAD;
    if ((kinds & ~all) != 0)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_test_set_omit: kinds=%d holds bits outside the OG_TEST_OMIT_* mask %d",
                         kinds, all);
    e->test_omit = kinds;
    return OG_OK;
}

// ---- sequences and the KV block pool (the work is in kv_pool.cu) -----------------------

// Steps begun on a sequence whose blocks change are no longer valid: they must be begun again.
static void cancel_step_of(og_engine *e, int32_t seq) {
    if (e->n_pending > 0 && e->pending[0].seq == seq) e->n_pending = 0;  // all on one sequence
}

#define OG_CHECK_OUT(p)                                                                      \
    do {                                                                                     \
        if ((p) == nullptr) return set_error(OG_E_INVALID_ARGUMENT, "%s: %s is NULL", __func__, #p); \
    } while (0)

OG_API og_status og_seq_create(og_engine *e, int32_t *seq) {
    OG_CHECK_HANDLE(e);
    OG_CHECK_OUT(seq);
    return e->kv.create(seq);
}

OG_API og_status og_seq_fork(og_engine *e, int32_t src, int32_t *seq) {
    OG_CHECK_HANDLE(e);
    OG_CHECK_OUT(seq);
    og_status status = use_device(e);
    if (status != OG_OK) return status;
    status = e->kv.fork(src, seq, e->stream);
    if (status != OG_OK) return status;
    // The fork continues src's generation: its sampling parameters and generated-token counts.
    KvSequence *from = nullptr, *to = nullptr;
    if (e->kv.lookup(src, "og_seq_fork", &from) != OG_OK || e->kv.lookup(*seq, "og_seq_fork", &to) != OG_OK)
        return OG_OK;  // unreachable: both were just used
    e->seq_sampling[to->slot] = e->seq_sampling[from->slot];
    const size_t row = (size_t)e->d.V * sizeof(int32_t);
    OG_CUDA_TRY(cudaMemcpyAsync(e->sample_counts + (size_t)to->slot * e->d.V,
                                e->sample_counts + (size_t)from->slot * e->d.V, row,
                                cudaMemcpyDeviceToDevice, e->stream));
    OG_CUDA_TRY(cudaStreamSynchronize(e->stream));
    return OG_OK;
}

OG_API og_status og_seq_select(og_engine *e, int32_t seq) {
    OG_CHECK_HANDLE(e);
    KvSequence *found = nullptr;
    const og_status status = e->kv.lookup(seq, "og_seq_select", &found);
    if (status != OG_OK) return status;
    e->kv.current = seq;
    e->n_pending = 0;
    return OG_OK;
}

OG_API og_status og_seq_current(og_engine *e, int32_t *seq) {
    OG_CHECK_HANDLE(e);
    OG_CHECK_OUT(seq);
    *seq = e->kv.current;
    return OG_OK;
}

OG_API og_status og_seq_reset(og_engine *e, int32_t seq) {
    OG_CHECK_HANDLE(e);
    og_status status = use_device(e);
    if (status != OG_OK) return status;
    KvSequence *found = nullptr;
    status = e->kv.lookup(seq, "og_seq_reset", &found);
    if (status != OG_OK) return status;
    const int32_t slot = found->slot;
    status = e->kv.reset(seq, e->stream);
    if (status == OG_OK) cancel_step_of(e, seq);
    if (status == OG_OK) status = clear_counts(e, slot);
    return status;
}

OG_API og_status og_seq_free(og_engine *e, int32_t seq) {
    OG_CHECK_HANDLE(e);
    og_status status = use_device(e);
    if (status != OG_OK) return status;
    KvSequence *found = nullptr;
    status = e->kv.lookup(seq, "og_seq_free", &found);
    if (status != OG_OK) return status;
    const int32_t slot = found->slot;
    status = e->kv.free_sequence(seq, e->stream);
    if (status == OG_OK) cancel_step_of(e, seq);
    if (status == OG_OK) {  // the slot's next sequence starts from the defaults
        e->seq_sampling[slot] = default_sampling();
        status = clear_counts(e, slot);
    }
    return status;
}

OG_API og_status og_seq_length(og_engine *e, int32_t seq, int32_t *length) {
    OG_CHECK_HANDLE(e);
    OG_CHECK_OUT(length);
    KvSequence *found = nullptr;
    const og_status status = e->kv.lookup(seq, "og_seq_length", &found);
    if (status != OG_OK) return status;
    *length = found->length;
    return OG_OK;
}

OG_API og_status og_seq_set_length(og_engine *e, int32_t seq, int32_t length) {
    OG_CHECK_HANDLE(e);
    og_status status = use_device(e);
    if (status != OG_OK) return status;
    status = e->kv.set_length(seq, length, e->stream);
    if (status == OG_OK) cancel_step_of(e, seq);
    return status;
}

OG_API og_status og_seq_reserve(og_engine *e, int32_t seq, int32_t n_tokens) {
    OG_CHECK_HANDLE(e);
    const og_status status = use_device(e);
    if (status != OG_OK) return status;
    return e->kv.reserve(seq, n_tokens, e->stream);
}

OG_API og_status og_seq_blocks(og_engine *e, int32_t seq, int32_t *blocks, int32_t capacity,
                               int32_t *count) {
    OG_CHECK_HANDLE(e);
    OG_CHECK_OUT(count);
    if (capacity < 0 || (capacity > 0 && blocks == nullptr))
        return set_error(OG_E_INVALID_ARGUMENT, "og_seq_blocks: blocks is NULL or capacity=%d < 0",
                         capacity);
    KvSequence *found = nullptr;
    const og_status status = e->kv.lookup(seq, "og_seq_blocks", &found);
    if (status != OG_OK) return status;
    const int32_t n = (int32_t)found->blocks.size();
    for (int32_t i = 0; i < n && i < capacity; ++i) blocks[i] = found->blocks[i];
    *count = n;
    return OG_OK;
}

OG_API og_status og_get_kv_pool_info(og_engine *e, og_kv_pool_info *info) {
    OG_CHECK_HANDLE(e);
    OG_CHECK_OUT(info);
    const KvLayout &l = e->kv.layout;
    memset(info, 0, sizeof *info);
    info->page_size = l.page_size;
    info->n_blocks = l.n_blocks;
    info->free_blocks = e->kv.blocks.free_count();
    info->max_blocks_per_seq = l.max_blocks_per_seq;
    info->max_sequences = l.max_sequences;
    info->live_sequences = (int32_t)e->kv.seqs.size();
    info->n_segments = (int32_t)l.segments.size();
    info->current_sequence = e->kv.current;
    info->block_stride_bytes = (uint64_t)l.block_stride;
    info->pool_bytes = (uint64_t)l.pool_bytes();
    return OG_OK;
}

OG_API og_status og_kv_segments(og_engine *e, int64_t *offsets, int64_t *page_bytes,
                                int32_t capacity, int32_t *count) {
    OG_CHECK_HANDLE(e);
    OG_CHECK_OUT(count);
    if (capacity < 0 || (capacity > 0 && (offsets == nullptr || page_bytes == nullptr)))
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_kv_segments: offsets or page_bytes is NULL, or capacity=%d < 0", capacity);
    const std::vector<KvSegment> &segments = e->kv.layout.segments;
    const int32_t n = (int32_t)segments.size();
    for (int32_t i = 0; i < n && i < capacity; ++i) {
        offsets[i] = segments[i].offset_bytes;
        page_bytes[i] = segments[i].page_bytes;
    }
    *count = n;
    return OG_OK;
}

OG_API og_status og_kv_block_refcount(og_engine *e, int32_t block, int32_t *count) {
    OG_CHECK_HANDLE(e);
    OG_CHECK_OUT(count);
    const int32_t refs = e->kv.blocks.refcount(block);
    if (refs < 0)
        return set_error(OG_E_INVALID_ARGUMENT, "og_kv_block_refcount: block %d is outside the pool [0, %d)",
                         block, e->kv.layout.n_blocks);
    *count = refs;
    return OG_OK;
}

OG_API og_status og_zero_blocks(og_engine *e, const int32_t *blocks, int32_t count) {
    OG_CHECK_HANDLE(e);
    const og_status status = use_device(e);
    if (status != OG_OK) return status;
    return e->kv.zero_blocks(blocks, count, e->stream);
}

OG_API og_status og_test_kv_set_free_order(og_engine *e, const int32_t *blocks, int32_t count) {
    OG_CHECK_HANDLE(e);
    return e->kv.blocks.set_free_order(blocks, count);
}

}  // extern "C"
