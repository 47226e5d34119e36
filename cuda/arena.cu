// arena.cu — og_init's setup: the dimensions, the one device arena every buffer lives in (laid
// out twice: to size it, then for real), the kernel plans, and the release of everything.
#include "engine.cuh"

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

og_status store_sampling(og_engine *e, int32_t slot, const og_sampling_params &p) {
    OG_CUDA_TRY(cudaMemcpyAsync(e->sample_params + slot, &p, sizeof p, cudaMemcpyHostToDevice,
                                e->stream));
    OG_CUDA_TRY(cudaStreamSynchronize(e->stream));
    e->seq_sampling[(size_t)slot] = p;
    return OG_OK;
}

namespace {

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
WeightMatrix take_matrix(ArenaCursor &a, int format, int64_t rows, int64_t cols) {
    WeightMatrix m;
    m.format = format;
    m.rows = rows;
    m.cols = (int)cols;
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
            w.router = take_matrix(a, OG_WEIGHTS_BF16, d.E, d.H);
            w.expert_gate_up = take_matrix(a, experts, (int64_t)d.E * 2 * d.Im, d.H);
            w.expert_down = take_matrix(a, experts, (int64_t)d.E * d.H, d.Im);
        } else {
            w.gate_up = take_matrix(a, dense, 2 * (int64_t)d.I, d.H);
            w.down = take_matrix(a, dense, d.H, d.I);
        }
    }
    e->final_norm = a.take<float>(d.H);
    if (e->cfg.tie_word_embeddings && e->cfg.weights_lm_head == OG_WEIGHTS_BF16) {
        e->lm_head.data = e->embed_tokens;
        e->lm_head.rows = d.V;
        e->lm_head.cols = d.H;
    } else {
        e->lm_head = take_matrix(a, e->cfg.weights_lm_head, d.V, d.H);
    }
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
    e->sample_params = a.take<og_sampling_params>((size_t)e->kv.layout.max_sequences);
    // Argmax and attention scratch for one row per launch (the decode body) or up to
    // OG_MAX_VERIFY (the verify body's positions).
    e->argmax_partials = a.take<NextToken>((size_t)OG_MAX_VERIFY * argmax_partials(d.V));
    e->argmax_ticket = a.take<unsigned>(OG_MAX_VERIFY);
    e->attn_partials = a.take<float>(std::max(
        attention_partial_floats(d.n_heads, d.hd, e->plan_attention[0], OG_MAX_VERIFY),
        attention_partial_floats(d.n_heads, d.hd, e->plan_attention[1], OG_MAX_VERIFY)));
    e->attn_counters = a.take<unsigned>(
        std::max(attention_counters(d.n_kv, e->plan_attention[0], OG_MAX_VERIFY),
                 attention_counters(d.n_kv, e->plan_attention[1], OG_MAX_VERIFY)));
    e->verify_qkv_ld = padded_cols(d.qkv_rows);
    e->verify_steps = a.take<og_step_record>(OG_MAX_VERIFY);
    e->verify_x = a.take<float>((size_t)OG_MAX_VERIFY * d.ldH);
    e->verify_qkv = a.take<float>((size_t)OG_MAX_VERIFY * e->verify_qkv_ld);
    e->verify_attn = a.take<float>((size_t)OG_MAX_VERIFY * d.ldQ);
    e->verify_act = a.take<float>((size_t)OG_MAX_VERIFY * d.ldI);
    e->verify_logits = a.take<float>((size_t)OG_MAX_VERIFY * d.V);
    e->verify_next = a.take<NextToken>(OG_MAX_VERIFY);
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

}  // namespace

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
    pinned_free(e->verify_host);
    pinned_free(e->verify_next_host);
    pinned_free(e->verify_logits_host);
    (void)cudaGetLastError();
    delete e;
}

namespace {

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
        // copy-engine stream (gemv_q4.cu; the other projections are too short to pay for it).
        OG_CUDA_TRY(gemv_plan(kGemvNormSwiglu, 2 * d.I, d.H, &e->plan_gate_up, dense, true));
        OG_CUDA_TRY(gemv_plan(kGemvResidual, d.H, d.I, &e->plan_down, dense, true));
    }
    if (d.any_moe) OG_CUDA_TRY(gemv_plan(kGemvNorm, d.E, d.H, &e->plan_router));
    OG_CUDA_TRY(gemv_plan(kGemvNorm, d.V, d.H, &e->plan_lm_head, e->cfg.weights_lm_head));
    // The short band up to attention_long_from rows, the long band over the whole cache.
    const int short_rows = std::min(d.max_seq, e->attention_long_from);
    cudaError_t err = attention_plan(d.n_heads, d.n_kv, d.hd, short_rows, d.kv_dtype, 0, kBandShort,
                                     &e->plan_attention[0]);
    e->plan_attention[1] = e->plan_attention[0];
    if (err == cudaSuccess && d.max_seq > e->attention_long_from)
        err = attention_plan(d.n_heads, d.n_kv, d.hd, d.max_seq, d.kv_dtype, 0, e->long_band,
                             &e->plan_attention[1]);
    if (err == cudaErrorInvalidValue) {
        (void)cudaGetLastError();
        return set_error(OG_E_UNSUPPORTED,
                         "og_config: attention with num_attention_heads=%d, "
                         "num_key_value_heads=%d, head_dim=%d does not fit in shared memory",
                         d.n_heads, d.n_kv, d.hd);
    }
    OG_CUDA_TRY(err);
    // The verify body's GEMVs over up to OG_MAX_VERIFY vectors, on the decode plans.
    static_assert(OG_MAX_VERIFY == kGemvMaxVectors, "a verify step's positions are the GEMV's vectors");
    OG_CUDA_TRY(gemv_multi_plan(kGemvNorm, e->plan_qkv, d.qkv_rows, d.H, &e->vplan_qkv));
    OG_CUDA_TRY(gemv_multi_plan(kGemvResidual, e->plan_o, d.H, d.q_size, &e->vplan_o));
    if (d.any_dense) {
        OG_CUDA_TRY(gemv_multi_plan(kGemvNormSwiglu, e->plan_gate_up, 2 * d.I, d.H, &e->vplan_gate_up));
        OG_CUDA_TRY(gemv_multi_plan(kGemvResidual, e->plan_down, d.H, d.I, &e->vplan_down));
    }
    OG_CUDA_TRY(gemv_multi_plan(kGemvNorm, e->plan_lm_head, d.V, d.H, &e->vplan_lm_head));
    return OG_OK;
}

}  // namespace

og_status init_engine(og_engine *e) {
    OG_CUDA_TRY(cudaSetDevice(e->device));
    cudaDeviceProp prop;
    OG_CUDA_TRY(cudaGetDeviceProperties(&prop, e->device));
    const char *pdl_env = getenv("ONEGRAPH_PDL");
    e->pdl = prop.major >= 9 && !(pdl_env != nullptr && strcmp(pdl_env, "0") == 0);
    e->d = derive_dims(e);
    // ONEGRAPH_ATTENTION_LONG_FROM=N: the long attention band starts at position N (default
    // kAttentionLongFrom, for groups of 8 query heads a KV head kAttentionLongFromGroup8); a
    // cache of at most N rows has the short band only.
    const char *long_env = getenv("ONEGRAPH_ATTENTION_LONG_FROM");
    long long long_from = e->d.n_heads / e->d.n_kv >= 8 ? kAttentionLongFromGroup8 : kAttentionLongFrom;
    if (long_env != nullptr) {
        char *end = nullptr;
        long_from = strtoll(long_env, &end, 10);
        if (end == long_env || *end != '\0' || long_from < 1)
            return set_error(OG_E_INVALID_ARGUMENT,
                             "ONEGRAPH_ATTENTION_LONG_FROM=%s: expected a position >= 1", long_env);
    }
    e->attention_long_from = (int32_t)std::min<long long>(long_from, e->d.max_seq);
    // ONEGRAPH_ATTENTION_FOLD=auto|tensor|cuda: the long band folds on the tensor cores where
    // they win (auto), wherever that fold is compiled (tensor), or never (cuda).
    const char *fold_env = getenv("ONEGRAPH_ATTENTION_FOLD");
    e->long_band = kBandLong;
    if (fold_env != nullptr) {
        if (strcmp(fold_env, "tensor") == 0) e->long_band = kBandLongTensorCores;
        else if (strcmp(fold_env, "cuda") == 0) e->long_band = kBandLongCudaCores;
        else if (strcmp(fold_env, "auto") != 0)
            return set_error(OG_E_INVALID_ARGUMENT,
                             "ONEGRAPH_ATTENTION_FOLD=%s: expected auto, tensor or cuda", fold_env);
    }
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
    OG_CUDA_TRY(pinned_alloc(&e->verify_host, OG_MAX_VERIFY * sizeof(og_step_record)));
    memset(e->verify_host, 0, OG_MAX_VERIFY * sizeof(og_step_record));
    OG_CUDA_TRY(pinned_alloc(&e->verify_next_host, OG_MAX_VERIFY * sizeof(NextToken)));
    memset(e->verify_next_host, 0, OG_MAX_VERIFY * sizeof(NextToken));
    OG_CUDA_TRY(pinned_alloc(&e->verify_logits_host, (size_t)OG_MAX_VERIFY * e->d.V * sizeof(float)));
    memset(e->verify_logits_host, 0, (size_t)OG_MAX_VERIFY * e->d.V * sizeof(float));

    std::vector<float> inv_freq(e->d.hd / 2);
    rope_inv_freq(e->d.hd, (double)e->cfg.rope_theta, (double)e->cfg.rope_linear_factor,
                  inv_freq.data());
    OG_CUDA_TRY(cudaMemcpyAsync(e->inv_freq, inv_freq.data(), inv_freq.size() * sizeof(float),
                                cudaMemcpyHostToDevice, e->stream));
    e->seq_sampling.assign((size_t)e->kv.layout.max_sequences, default_sampling());
    OG_CUDA_TRY(cudaMemcpyAsync(e->sample_params, e->seq_sampling.data(),
                                e->seq_sampling.size() * sizeof(og_sampling_params),
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
