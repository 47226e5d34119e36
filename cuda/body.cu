// body.cu — THE BODY: one decode step, read top to bottom (og_enqueue); and og_prefill's glue
// (the model's device pointers for prefill.cu, its chunks, the last row's logits).
//
// The body (body.cu) reads like llama2.c's forward(): H2D step record -> embedding -> per layer
// (attention block, FFN block) -> final norm + lm_head -> D2H logits. Kernels per layer:
//   dense: [RMSNorm+QKV GEMV] [QK-norm+RoPE+KV write+attention] [O GEMV + residual]
//          [RMSNorm+gate/up GEMV+SwiGLU] [down GEMV + residual]                      = 5
//   MoE:   the same attention block (3), then [RMSNorm+router GEMV (writes normed)]
//          [top-k] [experts gate/up+SwiGLU] [experts down, weighted sum + residual]  = 7
// plus the embedding gather and [final RMSNorm+lm_head GEMV] per token.
// On sm_90+ every kernel after the embedding is launched with programmatic dependent launch
// (kernels wait on their predecessor before touching memory, so results are unchanged);
// ONEGRAPH_PDL=0 in the environment at og_init turns it off.
#include "engine.cuh"

namespace {

// The parts of the body, as og_test_set_omit names them (OG_TEST_OMIT_*, onegraph_testing.h).
// The product library enqueues every part; the testing library can leave parts out so that a
// benchmark can time a step without them.
enum BodyPart { kPartQkv = 1, kPartAttention = 2, kPartOProj = 4, kPartFfnIn = 8, kPartFfnOut = 16,
                kPartLmHead = 32 };
#ifdef OG_TESTING
static_assert(kPartQkv == OG_TEST_OMIT_QKV && kPartAttention == OG_TEST_OMIT_ATTENTION &&
                  kPartOProj == OG_TEST_OMIT_O_PROJ && kPartFfnIn == OG_TEST_OMIT_FFN_IN &&
                  kPartFfnOut == OG_TEST_OMIT_FFN_OUT && kPartLmHead == OG_TEST_OMIT_LM_HEAD,
              "BodyPart mirrors OG_TEST_OMIT_*");
bool keep(const og_engine *e, BodyPart part) { return (e->test_omit & part) == 0; }
bool whole_body(const og_engine *e) { return e->test_omit == 0; }
#else
constexpr bool keep(const og_engine *, BodyPart) { return true; }
constexpr bool whole_body(const og_engine *) { return true; }
#endif

}  // namespace

// Layer l's attention of one row: its QK-norm, RoPE and K/V write, then attention over the
// rows the step record makes visible (shared by the decode and verify bodies).
AttentionArgs layer_attention(const og_engine *e, int l, const float *qkv, const og_step_record *step,
                              float *out) {
    const Dims &d = e->d;
    const LayerWeights &w = e->layers[l];
    AttentionArgs attn = {};
    attn.qkv = qkv;
    attn.q_norm = w.q_norm;
    attn.k_norm = w.k_norm;
    attn.eps = e->cfg.rms_norm_eps;
    attn.inv_freq = e->inv_freq;
    attn.table_update = l == 0 ? e->kv.tables : nullptr;
    attn.kv = e->kv.pages(l);
    attn.step = step;
    attn.n_heads = d.n_heads;
    attn.n_kv_heads = d.n_kv;
    attn.head_dim = d.hd;
    attn.max_seq_len = d.max_seq;
    attn.kv_dtype = d.kv_dtype;
    attn.partials = e->attn_partials;
    attn.counters = e->attn_counters;
    attn.out = out;
    return attn;
}

// THE BODY: one decode step, enqueued on `stream`.
og_status enqueue_body(og_engine *e, cudaStream_t stream) {
    const Dims &d = e->d;
    const og_config &c = e->cfg;
    const bool pdl = e->pdl;
    // The newest begun step's slot: its pinned record in, its pinned result out.
    const int slot = e->n_pending > 0 ? e->pending[e->n_pending - 1].slot : 0;
    const AttentionPlan &attention = e->plan_attention[newest_step_band(e)];
    OG_CUDA_TRY(cudaMemcpyAsync(e->step, e->step_host + slot, sizeof(og_step_record),
                                cudaMemcpyHostToDevice, stream));
    // A chained step's token is the previous step's argmax or sample, still in e->next_token.
    OG_CUDA_TRY(launch_embedding(e->embed_tokens, d.V, d.H, e->step, e->next_token, e->x, stream,
                                 false));

    for (int l = 0; l < d.L; ++l) {
        const LayerWeights &w = e->layers[l];
        // ---- attention block: x += o_proj(attention(rope(qkv_proj(rmsnorm(x))))) ----
        const GemvArgs qkv_proj = {w.qkv, e->x, w.input_layernorm, c.rms_norm_eps, e->qkv, nullptr};
        if (keep(e, kPartQkv)) OG_CUDA_TRY(launch_gemv(kGemvNorm, e->plan_qkv, qkv_proj, stream, pdl));

        // QK-norm + RoPE + the K/V write of this row + attention, one kernel. Layer 0 also
        // stores the row's block into the block table; later layers read it there.
        const AttentionArgs attn = layer_attention(e, l, e->qkv, e->step, e->attn_out);
        if (keep(e, kPartAttention)) OG_CUDA_TRY(launch_attention(attn, attention, stream, pdl));

        GemvArgs o_proj = {w.o_proj, e->attn_out, nullptr, 0.f, e->x, nullptr};
        // x's last writer is the previous layer's FFN, three kernels back (none when omitted).
        o_proj.residual_settled = whole_body(e);
        if (keep(e, kPartOProj)) OG_CUDA_TRY(launch_gemv(kGemvResidual, e->plan_o, o_proj, stream, pdl));

        // ---- FFN block: x += mlp(rmsnorm(x)) ----
        if (w.is_moe) {
            const GemvArgs router = {w.router, e->x, w.post_attention_layernorm, c.rms_norm_eps,
                                     e->router_logits, e->normed};
            if (keep(e, kPartFfnIn)) {
                OG_CUDA_TRY(launch_gemv(kGemvNorm, e->plan_router, router, stream, pdl));
                OG_CUDA_TRY(launch_moe_topk(e->router_logits, d.E, d.top_k, c.norm_topk_prob,
                                            e->selected_experts, e->selected_weights, stream, pdl));
                OG_CUDA_TRY(launch_moe_gate_up_swiglu(w.expert_gate_up, e->normed, e->selected_experts,
                                                      d.top_k, d.H, d.Im, e->moe_act, stream, pdl));
            }
            if (keep(e, kPartFfnOut))
                OG_CUDA_TRY(launch_moe_down_weighted_residual(w.expert_down, e->moe_act, e->selected_experts,
                                                              e->selected_weights, d.top_k, d.H,
                                                              d.Im, e->x, stream, pdl));
        } else {
            const GemvArgs gate_up = {w.gate_up, e->x, w.post_attention_layernorm,
                                      c.rms_norm_eps, e->act, nullptr};
            if (keep(e, kPartFfnIn))
                OG_CUDA_TRY(launch_gemv(kGemvNormSwiglu, e->plan_gate_up, gate_up, stream, pdl));
            GemvArgs down = {w.down, e->act, nullptr, 0.f, e->x, nullptr};
            // x's last writer is the O projection, two kernels back (none when omitted).
            down.residual_settled = whole_body(e);
            if (keep(e, kPartFfnOut))
                OG_CUDA_TRY(launch_gemv(kGemvResidual, e->plan_down, down, stream, pdl));
        }
    }

    // ---- logits = lm_head(rmsnorm(x)) ----
    const GemvArgs lm_head = {e->lm_head, e->x, e->final_norm, c.rms_norm_eps, e->logits, nullptr};
    if (keep(e, kPartLmHead)) OG_CUDA_TRY(launch_gemv(kGemvNorm, e->plan_lm_head, lm_head, stream, pdl));
    // ---- the one device->host copy: the logits, or only their argmax (og_set_output) ----
    if (e->output == OG_OUTPUT_NEXT_TOKEN) {
        OG_CUDA_TRY(launch_argmax(e->logits, d.V, e->argmax_partials, e->argmax_ticket,
                                  e->next_token, stream, pdl));
        OG_CUDA_TRY(cudaMemcpyAsync(e->next_host + slot, e->next_token, sizeof(NextToken),
                                    cudaMemcpyDeviceToHost, stream));
    } else if (e->output == OG_OUTPUT_SAMPLED || e->output == OG_OUTPUT_SAMPLED_LOGPROBS) {
        const SampleArgs sample = {e->logits, d.V, e->step, e->sample_params, e->next_token,
                                   e->sample_counts, e->sample_z, e->sample_state, e->sampled};
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
namespace {

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
    for (int l = 0; l < d.L; ++l) {
        const LayerWeights &w = e->layers[l];
        PrefillLayer &p = m.layers[l];
        p.is_moe = w.is_moe;
        p.input_layernorm = w.input_layernorm;
        p.post_attention_layernorm = w.post_attention_layernorm;
        p.q_norm = w.q_norm;
        p.k_norm = w.k_norm;
        p.qkv = w.qkv;
        p.o_proj = w.o_proj;
        if (w.is_moe) {
            p.router = w.router;
            p.expert_gate_up = w.expert_gate_up;
            p.expert_down = w.expert_down;
        } else {
            p.gate_up = w.gate_up;
            p.down = w.down;
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

}  // namespace

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
    const GemvArgs lm_head = {e->lm_head, e->prefill.x + (size_t)last_row * d.H, e->final_norm,
                              e->cfg.rms_norm_eps, e->logits, nullptr};
    OG_CUDA_TRY(launch_gemv(kGemvNorm, e->plan_lm_head, lm_head, stream, false));
    OG_CUDA_TRY(cudaMemcpyAsync(e->logits_host, e->logits, (size_t)d.V * sizeof(float),
                                cudaMemcpyDeviceToHost, stream));
    OG_CUDA_TRY(cudaStreamSynchronize(stream));
    seq.length += n_tokens;
    return OG_OK;
}
