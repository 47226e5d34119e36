// config.cu — og_config validation: every field checked before anything is allocated, each
// problem named in one line (og_init's OG_E_INVALID_ARGUMENT / OG_E_UNSUPPORTED).
#include "engine.cuh"

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
