// engine.cuh — the engine's state (struct og_engine, opaque in onegraph.h) and what the engine's
// files share. One concern a file:
//   api.cu             the C ABI of onegraph.h: handles, argument checks, step bookkeeping,
//                      sequences; the work is delegated to the files below
//   errors.cu          og_last_error's thread-local message and the CUDA error helpers
//   config.cu          og_config validation
//   arena.cu           dimensions, the one device arena and its layout, kernel plans, og_init's
//                      setup and the release of everything
//   weights.cu         the weight table (one slot per Hugging Face tensor), upload, precheck
//   body.cu            the per-token decode body (og_enqueue) and og_prefill's glue
//   engine_testing.cu  test entry points on an engine (testing library only)
#pragma once

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
#include "packed_file.h"
#include "prefill.cuh"
#include "reliability.cuh"
#ifdef OG_TESTING
#include "onegraph_testing.h"
#endif

using namespace og;

constexpr size_t kArenaAlign = 256;

struct LayerWeights {
    bool is_moe = false;
    float *input_layernorm = nullptr;          // (H)
    WeightMatrix qkv;                          // (q + 2kv, H): q_proj | k_proj | v_proj
    float *q_norm = nullptr, *k_norm = nullptr;  // (hd) each, qk_norm only
    WeightMatrix o_proj;                       // (H, q)
    float *post_attention_layernorm = nullptr; // (H)
    WeightMatrix gate_up;                      // dense: (2I, H): gate_proj | up_proj
    WeightMatrix down;                         // dense: (H, I)
    WeightMatrix router;                       // MoE: (E, H) mlp.gate, always bf16
    WeightMatrix expert_gate_up;               // MoE: (E * 2Im, H), expert-major
    WeightMatrix expert_down;                  // MoE: (E * H, Im), expert-major
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

constexpr int kStepSlots = 2;  // steps in flight at once (pipelined greedy decoding)
// The first position of the long attention band (og_engine::plan_attention) by default: about
// where the long band's fold overtakes the short band's (docs/performance.md). A KV head's 8
// query heads in one block leave half the blocks of two groups of 4 to a short context.
constexpr int kAttentionLongFrom = 2048, kAttentionLongFromGroup8 = 16384;

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
    WeightMatrix lm_head;                   // (V, H); data == embed_tokens when tied and bf16
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
    // Per sequence slot (og_seq_set_sampling): a host copy and the device array the stage reads
    // through the step record's seq_slot, so a captured graph serves any parameters.
    std::vector<og_sampling_params> seq_sampling;
    og_sampling_params *sample_params = nullptr;  // (max_sequences)
    int32_t result_output = OG_OUTPUT_NEXT_TOKEN;  // output of the last ended next-token step
    og::NextToken *argmax_partials = nullptr;  // [OG_MAX_VERIFY, argmax_partials(V)]: per-block candidates
    unsigned *argmax_ticket = nullptr;   // [OG_MAX_VERIFY] last-block counters (0 between steps)
    float *attn_partials = nullptr;      // split-KV scratch for OG_MAX_VERIFY rows
    unsigned *attn_counters = nullptr;   // [OG_MAX_VERIFY, n_kv * attention head groups]
    float *router_logits = nullptr;      // (E)
    int32_t *selected_experts = nullptr; // (top_k)
    float *selected_weights = nullptr;   // (top_k)
    float *moe_act = nullptr;            // (top_k, Im)
    PrefillScratch prefill;              // og_prefill's chunk buffers (prefill.cuh)
#ifdef OG_TESTING
    int32_t test_omit = 0;               // og_test_set_omit: OG_TEST_OMIT_* kinds left out
#endif

    GemvPlan plan_qkv, plan_o, plan_gate_up, plan_down, plan_router, plan_lm_head;
    // Attention in two bands of the context: a step at a position below attention_long_from
    // takes plan_attention[0] (the short band), the others plan_attention[1] (the long band,
    // planned as long_band: kBandLong unless ONEGRAPH_ATTENTION_FOLD asks for another fold).
    // Which one a step takes is fixed when it is begun (og_step_bands), so that a captured
    // graph holds one band's kernels and each band has graphs of its own.
    // attention_long_from == max_seq_len: one band.
    AttentionPlan plan_attention[2];
    int32_t attention_long_from = 0;
    AttentionBand long_band = kBandLong;

    // ---- the verify step (verify.cu): n = 2..OG_MAX_VERIFY positions in one pass ----
    // Per position j < n: the step record (token, position, seq_slot, row_block) and the
    // buffers of the decode body, one row each, rows padded so that each starts 16-byte
    // aligned like the decode body's single buffers.
    og_step_record *verify_host = nullptr;     // pinned [OG_MAX_VERIFY]
    og::NextToken *verify_next_host = nullptr; // pinned [OG_MAX_VERIFY]: each position's argmax
    float *verify_logits_host = nullptr;       // pinned [OG_MAX_VERIFY, V] (OG_OUTPUT_LOGITS)
    og_step_record *verify_steps = nullptr;    // [OG_MAX_VERIFY]
    float *verify_x = nullptr;                 // [OG_MAX_VERIFY, ldH]
    float *verify_qkv = nullptr;               // [OG_MAX_VERIFY, verify_qkv_ld]
    float *verify_attn = nullptr;              // [OG_MAX_VERIFY, ldQ]
    float *verify_act = nullptr;               // [OG_MAX_VERIFY, ldI]
    float *verify_logits = nullptr;            // [OG_MAX_VERIFY, V]
    og::NextToken *verify_next = nullptr;      // [OG_MAX_VERIFY]
    int verify_qkv_ld = 0;                     // padded_cols(q + 2kv)
    GemvMultiPlan vplan_qkv, vplan_o, vplan_gate_up, vplan_down, vplan_lm_head;
    // The begun verify step (og_begin_verify_seq): its sequence, first position and positions
    // (0: none); its results are readable once it completed (og_verify_results).
    int32_t verify_seq = -1, verify_position = 0, verify_n = 0, verify_output = OG_OUTPUT_NEXT_TOKEN;

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
    int32_t result_slot = 0;             // slot of the last ended next-token step
    og_stats stats = {};
};

// ---- shared by the engine's files --------------------------------------------------------
// The attention band (0 short, 1 long) of a step at `position`.
inline int attention_band(const og_engine *e, int32_t position) {
    return position >= e->attention_long_from ? 1 : 0;
}
// The attention band of the newest begun decode step (0 when none is begun): the one its
// body launches.
inline int newest_step_band(const og_engine *e) {
    return e->n_pending > 0 ? attention_band(e, e->pending[e->n_pending - 1].position) : 0;
}
// api.cu: whether e is a live handle (the registry of og_init / og_free), and its device made
// current for the calling thread.
bool is_live(og_engine *e);
og_status use_device(og_engine *e);

#define OG_CHECK_HANDLE(e)                                                            \
    do {                                                                              \
        if (!is_live(e))                                                              \
            return set_error(OG_E_INVALID_HANDLE, "%s: %s", __func__,                 \
                             (e) == nullptr ? "NULL engine handle"                    \
                                            : "not a live engine handle (already freed?)"); \
    } while (0)

// config.cu: whether layer `layer` is a MoE layer; OG_OK or the first problem of c.
bool layer_moe(const og_config *c, int layer);
og_status validate_config(const og_config *c);

// arena.cu: allocate and lay out everything for e->cfg (already validated); destroy releases
// everything, also of a partially built engine.
og_status init_engine(og_engine *e);
void destroy(og_engine *e);
// arena.cu: the sampling parameters of a fresh sequence slot (greedy, every filter off); zero
// slot's generated-token counts; set slot's parameters, host and device (both synchronous).
og_sampling_params default_sampling();
og_status clear_counts(og_engine *e, int32_t slot);
og_status store_sampling(og_engine *e, int32_t slot, const og_sampling_params &p);

// weights.cu: the slot table of e->cfg's tensors; the hit-only precheck; the dtype a slot
// takes from og_set_weight; one tensor's upload into its slot (synchronous).
void build_weight_table(og_engine *e);
og_status precheck(og_engine *e);
int32_t expected_dtype(const WeightSlot &s);
og_status upload(og_engine *e, const WeightSlot &s, int32_t dtype, const void *data);

// body.cu: one decode step enqueued on stream; og_prefill's chunks for sequence seq
// (synchronous; the sequence grows only when all of it completed).
og_status enqueue_body(og_engine *e, cudaStream_t stream);
// Layer l's attention arguments for the row of `step` (body.cu; the verify body's too).
AttentionArgs layer_attention(const og_engine *e, int l, const float *qkv, const og_step_record *step,
                              float *out);
// verify.cu: the begun verify step's n positions enqueued on stream (the verify body).
og_status enqueue_verify(og_engine *e, cudaStream_t stream);
og_status run_prefill(og_engine *e, KvSequence &seq, const int32_t *tokens, int32_t n_tokens);
