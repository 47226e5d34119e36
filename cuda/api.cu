// api.cu — the C ABI of onegraph.h (engine.cuh lists where the work is done): the live-handle
// registry, argument checks, the step bookkeeping and the sequences.
#include <cmath>
#include "engine.cuh"

namespace {

std::mutex g_registry_mutex;
std::unordered_set<og_engine *> &registry() {
    static std::unordered_set<og_engine *> live;
    return live;
}

}  // namespace

bool is_live(og_engine *e) {
    if (e == nullptr) return false;
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    return registry().count(e) != 0;
}

og_status use_device(og_engine *e) {
    int current = -1;
    OG_CUDA_TRY(cudaGetDevice(&current));
    if (current != e->device) OG_CUDA_TRY(cudaSetDevice(e->device));
    return OG_OK;
}

namespace {

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

}  // namespace

// ---- the C ABI -------------------------------------------------------------------------
extern "C" {

OG_API int32_t og_abi_version(void) { return OG_ABI_VERSION; }

OG_API void og_abi_version_numbers(int32_t *major, int32_t *minor) {
    if (major != nullptr) *major = OG_ABI_VERSION_MAJOR;
    if (minor != nullptr) *minor = OG_ABI_VERSION_MINOR;
}

OG_API const char *og_status_string(og_status status) {
    switch (status) {
        case OG_OK: return "OG_OK";
        case OG_E_INVALID_ARGUMENT: return "OG_E_INVALID_ARGUMENT";
        case OG_E_INVALID_HANDLE: return "OG_E_INVALID_HANDLE";
        case OG_E_NO_DEVICE: return "OG_E_NO_DEVICE";
        case OG_E_CUDA: return "OG_E_CUDA";
        case OG_E_OUT_OF_MEMORY: return "OG_E_OUT_OF_MEMORY";
        case OG_E_UNKNOWN_WEIGHT: return "OG_E_UNKNOWN_WEIGHT";
        case OG_E_WEIGHT_MISMATCH: return "OG_E_WEIGHT_MISMATCH";
        case OG_E_MISSING_WEIGHT: return "OG_E_MISSING_WEIGHT";
        case OG_E_TOKEN_OUT_OF_RANGE: return "OG_E_TOKEN_OUT_OF_RANGE";
        case OG_E_CONTEXT_FULL: return "OG_E_CONTEXT_FULL";
        case OG_E_UNSUPPORTED: return "OG_E_UNSUPPORTED";
        case OG_E_BAD_STATE: return "OG_E_BAD_STATE";
        case OG_E_BAD_FILE: return "OG_E_BAD_FILE";
        case OG_E_CORRUPTED: return "OG_E_CORRUPTED";
        case OG_E_POOL_EXHAUSTED: return "OG_E_POOL_EXHAUSTED";
        case OG_E_NONFINITE_LOGITS: return "OG_E_NONFINITE_LOGITS";
    }
    return "unknown og_status";
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

OG_API og_status og_set_rope_frequencies(og_engine *e, const float *inv_freq, int32_t n) {
    OG_CHECK_HANDLE(e);
    if (inv_freq == nullptr)
        return set_error(OG_E_INVALID_ARGUMENT, "og_set_rope_frequencies: inv_freq is NULL");
    if (n != e->d.hd / 2)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_set_rope_frequencies: n=%d, expected head_dim / 2 = %d", n, e->d.hd / 2);
    for (int32_t i = 0; i < n; ++i)
        if (!(inv_freq[i] > 0.0f) || !std::isfinite(inv_freq[i]))
            return set_error(OG_E_INVALID_ARGUMENT,
                             "og_set_rope_frequencies: inv_freq[%d]=%g is not a positive finite number",
                             i, (double)inv_freq[i]);
    og_status status = use_device(e);
    if (status != OG_OK) return status;
    OG_CUDA_TRY(cudaMemcpy(e->inv_freq, inv_freq, (size_t)n * sizeof(float), cudaMemcpyHostToDevice));
    return OG_OK;
}

OG_API og_status og_precheck(og_engine *e) {
    OG_CHECK_HANDLE(e);
    return precheck(e);
}

namespace {

// What every begun step checks and does before its record: rows up to last_row fit the
// sequence, the engine is usable on its device, and the last `rows` rows' blocks are made
// writable (a fresh block, or a private copy of a shared one): the only state a begin changes
// before its record, and one any later step of the sequence would make too.
og_status prepare_rows(og_engine *e, const char *fn, int32_t id, int32_t last_row, int32_t rows) {
    if (last_row >= e->d.max_seq)
        return set_error(OG_E_CONTEXT_FULL,
                         "%s: position %d: sequence %d is full (max_seq_len=%d); og_reset starts "
                         "it over",
                         fn, last_row, id, e->d.max_seq);
    og_status status = precheck(e);
    if (status != OG_OK) return status;
    status = use_device(e);
    if (status != OG_OK) return status;
    return e->kv.reserve(id, rows, e->stream);
}

}  // namespace

OG_API og_status og_begin_step(og_engine *e, int32_t token) {
    OG_CHECK_HANDLE(e);
    const int32_t id = e->kv.current;
    KvSequence *seq = nullptr;
    if (id < 0 || e->kv.lookup(id, "og_begin_step", &seq) != OG_OK)
        return set_error(OG_E_BAD_STATE, "og_begin_step: no sequence is selected (og_seq_select)");
    return og_begin_step_seq(e, id, token);
}

OG_API og_status og_begin_step_seq(og_engine *e, int32_t id, int32_t token) {
    OG_CHECK_HANDLE(e);
    if (token < 0 || token >= e->d.V)
        return set_error(OG_E_TOKEN_OUT_OF_RANGE, "token %d is outside the vocabulary [0, %d)",
                         token, e->d.V);
    KvSequence *seq = nullptr;
    og_status status = e->kv.lookup(id, "og_begin_step_seq", &seq);
    if (status != OG_OK) return status;
    const int32_t position = seq->length;
    status = prepare_rows(e, "og_begin_step_seq", id, position, 1);
    if (status != OG_OK) return status;
    e->step_host[0] = og_step_record{token, position, seq->slot,
                                     seq->blocks[position / e->kv.layout.page_size]};
    e->pending[0] = og_engine::PendingStep{id, 0, position, e->output};
    e->n_pending = 1;
    e->verify_n = 0;  // a begun verify step's rows are no longer the sequence's next rows
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
    // Rows prev.position (already writable) and position; a block the step in flight writes
    // is not copied again, so nothing here touches it.
    status = prepare_rows(e, "og_begin_chained_step", id, position, 2);
    if (status != OG_OK) return status;
    const int32_t next = 1 - prev.slot;
    e->step_host[next] = og_step_record{OG_TOKEN_PREVIOUS_ARGMAX, position, seq->slot,
                                        seq->blocks[position / e->kv.layout.page_size]};
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

OG_API og_status og_step_bands(og_engine *e, int32_t *first, int32_t *last) {
    OG_CHECK_HANDLE(e);
    if (first == nullptr || last == nullptr)
        return set_error(OG_E_INVALID_ARGUMENT, "og_step_bands: first or last is NULL");
    if (e->n_pending == 0 && e->verify_n > 0) {  // a begun verify step
        *first = attention_band(e, e->verify_position);
        *last = attention_band(e, e->verify_position + e->verify_n - 1);
    } else {
        *first = *last = newest_step_band(e);
    }
    return OG_OK;
}

OG_API og_status og_enqueue(og_engine *e, void *stream) {
    OG_CHECK_HANDLE(e);
    og_status status = precheck(e);
    if (status != OG_OK) return status;
    status = use_device(e);
    if (status != OG_OK) return status;
    const cudaStream_t s = stream != nullptr ? static_cast<cudaStream_t>(stream) : e->stream;
#ifdef OG_TESTING
    status = capture_fault_hook(s);  // a no-op unless a test armed it (reliability.cuh)
    if (status != OG_OK) return status;
#endif
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

// ---- the verify step (verify.cu) ----
OG_API og_status og_begin_verify_seq(og_engine *e, int32_t id, const int32_t *tokens, int32_t n) {
    OG_CHECK_HANDLE(e);
    if (tokens == nullptr || n < 2 || n > OG_MAX_VERIFY)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_begin_verify_seq: tokens is NULL or n=%d is outside [2, %d]", n,
                         OG_MAX_VERIFY);
    for (int32_t j = 0; j < n; ++j)
        if (tokens[j] < 0 || tokens[j] >= e->d.V)
            return set_error(OG_E_TOKEN_OUT_OF_RANGE,
                             "og_begin_verify_seq: tokens[%d]=%d is outside the vocabulary [0, %d)",
                             j, tokens[j], e->d.V);
    if (e->n_pending != 0)
        return set_error(OG_E_BAD_STATE,
                         "og_begin_verify_seq: %d decode step(s) begun and not ended (end or "
                         "cancel them first)",
                         e->n_pending);
    KvSequence *seq = nullptr;
    og_status status = e->kv.lookup(id, "og_begin_verify_seq", &seq);
    if (status != OG_OK) return status;
    const int32_t position = seq->length;
    status = prepare_rows(e, "og_begin_verify_seq", id, position + n - 1, n);
    if (status != OG_OK) return status;
    const int page = e->kv.layout.page_size;
    for (int32_t j = 0; j < n; ++j)
        e->verify_host[j] = og_step_record{tokens[j], position + j, seq->slot,
                                           seq->blocks[(position + j) / page]};
    e->verify_seq = id;
    e->verify_position = position;
    e->verify_n = n;
    e->verify_output = e->output;
    return OG_OK;
}

OG_API og_status og_enqueue_verify(og_engine *e, void *stream) {
    OG_CHECK_HANDLE(e);
    if (e->verify_n == 0)
        return set_error(OG_E_BAD_STATE, "og_enqueue_verify: no verify step begun (og_begin_verify_seq)");
    og_status status = precheck(e);
    if (status != OG_OK) return status;
    status = use_device(e);
    if (status != OG_OK) return status;
    e->verify_output = e->output;
    const cudaStream_t s = stream != nullptr ? static_cast<cudaStream_t>(stream) : e->stream;
    return enqueue_verify(e, s);
}

OG_API og_status og_run_verify(og_engine *e) {
    const og_status status = og_enqueue_verify(e, nullptr);
    if (status != OG_OK) return status;
    OG_CUDA_TRY(cudaStreamSynchronize(e->stream));
    return OG_OK;
}

OG_API og_status og_verify_results(og_engine *e, int32_t *next, float *logit, int32_t capacity) {
    OG_CHECK_HANDLE(e);
    if (next == nullptr || capacity < 0)
        return set_error(OG_E_INVALID_ARGUMENT, "og_verify_results: next is NULL or capacity=%d < 0",
                         capacity);
    if (e->verify_n == 0)
        return set_error(OG_E_BAD_STATE, "og_verify_results: no verify step begun");
    for (int32_t j = 0; j < e->verify_n && j < capacity; ++j) {
        next[j] = e->verify_next_host[j].token;
        if (logit != nullptr) logit[j] = e->verify_next_host[j].logit;
    }
    return OG_OK;
}

OG_API og_status og_verify_logits(og_engine *e, const float **logits, int32_t *n) {
    OG_CHECK_HANDLE(e);
    if (logits == nullptr) return set_error(OG_E_INVALID_ARGUMENT, "og_verify_logits: logits is NULL");
    if (e->verify_n == 0 || e->verify_output != OG_OUTPUT_LOGITS)
        return set_error(OG_E_BAD_STATE,
                         "og_verify_logits: no verify step begun and enqueued with OG_OUTPUT_LOGITS");
    *logits = e->verify_logits_host;
    if (n != nullptr) *n = e->verify_n;
    return OG_OK;
}

OG_API og_status og_end_verify(og_engine *e, int32_t accepted) {
    OG_CHECK_HANDLE(e);
    if (e->verify_n == 0) return set_error(OG_E_BAD_STATE, "og_end_verify: no verify step begun");
    if (accepted < 1 || accepted > e->verify_n)
        return set_error(OG_E_INVALID_ARGUMENT, "og_end_verify: accepted=%d is outside [1, %d]",
                         accepted, e->verify_n);
    KvSequence *seq = nullptr;
    og_status status = e->kv.lookup(e->verify_seq, "og_end_verify", &seq);
    if (status != OG_OK) return status;  // unreachable: freeing a sequence cancels its steps
    status = use_device(e);
    if (status != OG_OK) return status;
    // Every written row first becomes the sequence's, then the rejected ones are cut off:
    // set_length releases the blocks past the kept rows (their rows are never read again).
    seq->length = e->verify_position + e->verify_n;
    status = e->kv.set_length(e->verify_seq, e->verify_position + accepted, e->stream);
    if (status != OG_OK) {
        seq->length = e->verify_position;
        return status;
    }
    e->verify_n = 0;
    e->stats.steps += 1;
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
    return og_prefill_seq(e, id, tokens, n_tokens, logits);
}

OG_API og_status og_prefill_seq(og_engine *e, int32_t id, const int32_t *tokens, int32_t n_tokens,
                                float *logits) {
    OG_CHECK_HANDLE(e);
    if (tokens == nullptr || n_tokens <= 0)
        return set_error(OG_E_INVALID_ARGUMENT, "og_prefill: tokens is NULL or n_tokens=%d < 1",
                         n_tokens);
    KvSequence *seq = nullptr;
    og_status status = e->kv.lookup(id, "og_prefill_seq", &seq);
    if (status != OG_OK) return status;
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
    status = precheck(e);
    if (status != OG_OK) return status;
    status = use_device(e);
    if (status != OG_OK) return status;
    status = e->kv.reserve(id, n_tokens, e->stream);  // OG_E_POOL_EXHAUSTED changes nothing
    if (status != OG_OK) return status;
    e->n_pending = 0;  // a begun step's row is no longer the sequence's next row
    e->verify_n = 0;
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
    return store_sampling(e, found->slot, p);
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

// ---- sequences and the KV block pool (the work is in kv_pool.cu) -----------------------

// Steps begun on a sequence whose blocks change are no longer valid: they must be begun again.
static void cancel_step_of(og_engine *e, int32_t seq) {
    if (e->n_pending > 0 && e->pending[0].seq == seq) e->n_pending = 0;  // all on one sequence
    if (e->verify_n > 0 && e->verify_seq == seq) e->verify_n = 0;
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
    status = store_sampling(e, to->slot, e->seq_sampling[from->slot]);
    if (status != OG_OK) return status;
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
        status = store_sampling(e, slot, default_sampling());
        if (status == OG_OK) status = clear_counts(e, slot);
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

}  // extern "C"
