// verify.cu — THE VERIFY BODY: n = 2..OG_MAX_VERIFY positions of one sequence in one pass
// (speculative decoding, onegraph.h), read top to bottom like the decode body (body.cu):
// H2D verify record (n step records) -> n embeddings -> per layer (attention block, FFN block)
// -> final norm + lm_head -> n argmaxes -> D2H n results.
//
// Every position's arithmetic is the decode body's, so its logits are bit-identical to a decode
// step's at that position:
//   - the GEMVs over the n vectors (launch_gemv_multi): bf16 weights read once for all n by the
//     multi-vector instance of the decode kernel (same block size and unroll, each vector's
//     staging, norm, chunk order and reduction as alone); int8 / q4 weights, and inputs whose n
//     staged copies do not fit in a block's shared memory, one decode launch per vector;
//   - attention: one launch of the decode kernel over the n positions (AttentionArgs::n_rows)
//     of its attention band (og_engine::plan_attention): position j takes the new K/V rows of
//     positions 0..j from the QKV output, encoded in shared memory exactly as the decode body
//     stores and reads them back, and earlier rows from the cache; each position stores its
//     own row. Nothing reads a row this launch writes, so it goes with programmatic dependent
//     launch like the decode body's. Positions on both sides of the long band's start take
//     one launch per band, the long band's after the short band's has completed;
//   - MoE layers: router, top-k and experts once per position, in order (their scratch is
//     single);
//   - the argmax of the n positions in one launch.
#include "engine.cuh"

og_status enqueue_verify(og_engine *e, cudaStream_t stream) {
    const Dims &d = e->d;
    const og_config &c = e->cfg;
    const bool pdl = e->pdl;
    const int n = e->verify_n;
    const int64_t ld_qkv = e->verify_qkv_ld;
    const int n_short = std::max(0, std::min(n, e->attention_long_from - e->verify_position));
    OG_CUDA_TRY(cudaMemcpyAsync(e->verify_steps, e->verify_host, n * sizeof(og_step_record),
                                cudaMemcpyHostToDevice, stream));
    for (int j = 0; j < n; ++j)
        OG_CUDA_TRY(launch_embedding(e->embed_tokens, d.V, d.H, e->verify_steps + j, nullptr,
                                     e->verify_x + (size_t)j * d.ldH, stream, false));

    for (int l = 0; l < d.L; ++l) {
        const LayerWeights &w = e->layers[l];
        // ---- attention block: x_j += o_proj(attention_j(rope(qkv_proj(rmsnorm(x_j))))) ----
        const GemvArgs qkv_proj = {w.qkv, e->verify_x, w.input_layernorm, c.rms_norm_eps,
                                   e->verify_qkv, nullptr};
        OG_CUDA_TRY(launch_gemv_multi(kGemvNorm, e->vplan_qkv, qkv_proj, n, d.ldH, ld_qkv, stream, pdl));

        // Rows 0..n_short - 1 in the short attention band, the rest in the long one: each band's
        // rows in one launch of that band's kernel, as a decode step at their positions takes.
        // The long rows read the short rows' K/V from the cache, so their launch waits for the
        // short one to complete (no programmatic dependent launch).
        AttentionArgs attn = layer_attention(e, l, e->verify_qkv, e->verify_steps, e->verify_attn);
        attn.qkv_stride = ld_qkv;
        attn.out_stride = d.ldQ;
        if (n_short > 0) {
            attn.n_rows = n_short;
            OG_CUDA_TRY(launch_attention(attn, e->plan_attention[0], stream, pdl));
        }
        if (n_short < n) {
            attn.step = e->verify_steps + n_short;
            attn.qkv = e->verify_qkv + (size_t)n_short * ld_qkv;
            attn.out = e->verify_attn + (size_t)n_short * d.ldQ;
            attn.n_rows = n - n_short;
            OG_CUDA_TRY(launch_attention(attn, e->plan_attention[1], stream, pdl && n_short == 0));
        }

        const GemvArgs o_proj = {w.o_proj, e->verify_attn, nullptr, 0.f, e->verify_x, nullptr};
        OG_CUDA_TRY(launch_gemv_multi(kGemvResidual, e->vplan_o, o_proj, n, d.ldQ, d.ldH, stream, pdl));

        // ---- FFN block: x_j += mlp(rmsnorm(x_j)) ----
        if (w.is_moe) {
            for (int j = 0; j < n; ++j) {
                float *x = e->verify_x + (size_t)j * d.ldH;
                const GemvArgs router = {w.router, x, w.post_attention_layernorm, c.rms_norm_eps,
                                         e->router_logits, e->normed};
                OG_CUDA_TRY(launch_gemv(kGemvNorm, e->plan_router, router, stream, pdl));
                OG_CUDA_TRY(launch_moe_topk(e->router_logits, d.E, d.top_k, c.norm_topk_prob,
                                            e->selected_experts, e->selected_weights, stream, pdl));
                OG_CUDA_TRY(launch_moe_gate_up_swiglu(w.expert_gate_up, e->normed, e->selected_experts,
                                                      d.top_k, d.H, d.Im, e->moe_act, stream, pdl));
                OG_CUDA_TRY(launch_moe_down_weighted_residual(w.expert_down, e->moe_act, e->selected_experts,
                                                              e->selected_weights, d.top_k, d.H,
                                                              d.Im, x, stream, pdl));
            }
        } else {
            const GemvArgs gate_up = {w.gate_up, e->verify_x, w.post_attention_layernorm,
                                      c.rms_norm_eps, e->verify_act, nullptr};
            OG_CUDA_TRY(launch_gemv_multi(kGemvNormSwiglu, e->vplan_gate_up, gate_up, n, d.ldH,
                                          d.ldI, stream, pdl));
            const GemvArgs down = {w.down, e->verify_act, nullptr, 0.f, e->verify_x, nullptr};
            OG_CUDA_TRY(launch_gemv_multi(kGemvResidual, e->vplan_down, down, n, d.ldI, d.ldH,
                                          stream, pdl));
        }
    }

    // ---- logits_j = lm_head(rmsnorm(x_j)), their argmax ----
    const GemvArgs lm_head = {e->lm_head, e->verify_x, e->final_norm, c.rms_norm_eps,
                              e->verify_logits, nullptr};
    OG_CUDA_TRY(launch_gemv_multi(kGemvNorm, e->vplan_lm_head, lm_head, n, d.ldH, d.V, stream, pdl));
    OG_CUDA_TRY(launch_argmax_rows(e->verify_logits, d.V, n, d.V, e->argmax_partials, e->argmax_ticket,
                                   e->verify_next, stream, pdl));
    OG_CUDA_TRY(cudaMemcpyAsync(e->verify_next_host, e->verify_next, n * sizeof(NextToken),
                                cudaMemcpyDeviceToHost, stream));
    e->stats.d2h_copies += 1;
    if (e->output == OG_OUTPUT_LOGITS) {
        OG_CUDA_TRY(cudaMemcpyAsync(e->verify_logits_host, e->verify_logits,
                                    (size_t)n * d.V * sizeof(float), cudaMemcpyDeviceToHost, stream));
        e->stats.d2h_copies += 1;
    }
    e->stats.enqueues += 1;
    e->stats.h2d_copies += 1;
    return OG_OK;
}
