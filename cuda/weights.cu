// weights.cu — the weight table (one slot per Hugging Face tensor the config uses, pointing into
// the arena), og_set_weight's upload into a slot, and the hit-only precheck.
#include "engine.cuh"

namespace {

// The tensor `name` = rows [first_row, first_row + rows) of m (cols columns); a quantized
// matrix adds "<name>.scale" for the same rows. The arena's bytes are the engine's to write:
// the descriptor is read-only only for the kernels.
void add_matrix(og_engine *e, const std::string &name, int64_t rows, int64_t cols,
                const WeightMatrix &m, int64_t first_row) {
    char *data = static_cast<char *>(const_cast<void *>(m.data));
    char *scales = static_cast<char *>(const_cast<void *>(m.scales));
    WeightSlot s;
    s.name = name;
    s.kind = WeightSlot::kMatrix;
    s.format = m.format;
    s.rows = rows;
    s.cols = cols;
    s.pitch = weight_row_bytes(m.format, cols);
    s.dst = data + first_row * s.pitch;
    e->slots.push_back(s);
    if (m.format == OG_WEIGHTS_BF16) return;
    s.name = name + ".scale";
    s.kind = WeightSlot::kScales;
    s.pitch = weight_scales_per_row(m.format, cols) * weight_scale_bytes(m.format);
    s.dst = scales + first_row * s.pitch;
    e->slots.push_back(std::move(s));
}

WeightMatrix bf16_matrix(__nv_bfloat16 *data, int64_t rows, int cols) {
    WeightMatrix m;
    m.data = data;
    m.rows = rows;
    m.cols = cols;
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

}  // namespace

// The tensor table: HF name -> device region (fused layouts assembled by row offset).
void build_weight_table(og_engine *e) {
    const Dims &d = e->d;
    add_matrix(e, "model.embed_tokens.weight", d.V, d.H, bf16_matrix(e->embed_tokens, d.V, d.H), 0);
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
            add_matrix(e, p + "mlp.gate.weight", d.E, d.H, w.router, 0);
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

og_status precheck(og_engine *e) {
    if (e->n_missing == 0) return OG_OK;
    for (size_t i = 0; i < e->slots.size(); ++i)
        if (!e->resident[i])
            return set_error(OG_E_MISSING_WEIGHT,
                             "weight %s is not resident (%zu of %zu required tensors missing)",
                             e->slots[i].name.c_str(), e->n_missing, e->slots.size());
    return OG_OK;
}

namespace {

// Bytes of one row of a matrix as og_set_weight receives it (onegraph.h "weight formats").
int64_t source_row_bytes(const WeightSlot &s) {
    switch (s.format) {
        case OG_WEIGHTS_INT8: return s.cols;
        case OG_WEIGHTS_Q4: return weight_row_bytes(OG_WEIGHTS_Q4, s.cols);  // whole groups
    }
    return s.cols * (int64_t)sizeof(__nv_bfloat16);
}

}  // namespace

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
