/*
 * onegraph.h — the C ABI of the onegraph decode library.
 *
 * One token of decode costs one host->device copy (the step record: token id, position,
 * and the KV block of the row) and one device->host copy (the logits). Everything in between — every
 * layer, every intermediate, the KV cache — lives on the GPU, and the per-token body
 * (og_enqueue) is capturable into one CUDA graph that is replayed for every token.
 *
 * Conventions
 *   - Every function returns an og_status (0 = OG_OK, negative = error) unless noted.
 *     On error, og_last_error() returns a message naming the problem (tensor, expected
 *     vs actual) for the calling thread. A failed call changes no engine state.
 *   - Threads: a handle may be used by one thread at a time (calls on one handle must not
 *     overlap; moving a handle between threads is fine); distinct handles may be used from
 *     distinct threads concurrently (tests/test_reliability_gpu.py decodes two at once).
 *     og_init and og_free of different handles may run concurrently; og_last_error() is
 *     per thread; the og_test_* hooks of onegraph_testing.h are process-wide. A thread that
 *     captures og_enqueue into a graph should use cudaStreamCaptureModeThreadLocal (as
 *     runtime/graph.py does) while other threads use the library: global mode makes their
 *     synchronizing calls fail for as long as the capture lasts.
 *   - Calling any function with NULL or an already freed handle returns
 *     OG_E_INVALID_HANDLE; it never crashes. (A freed address may be handed out again by a
 *     later og_init; until then it is refused.)
 *   - The library never prints and never exits the process.
 *   - Ownership. Pointers the caller passes in are borrowed for the call only: the library
 *     copies what it keeps (og_init copies the config and its layer_is_moe array; og_set_weight
 *     and og_prefill read their arrays before returning) and writes outputs before returning.
 *     Pointers the library hands out are owned by the library and never freed by the caller:
 *     the engine (og_init, og_open_packed) until og_free; og_logits(), og_step()'s *logits
 *     and og_verify_logits()'s *logits point into the engine's pinned buffers, valid until
 *     og_free (their contents change with every step, or every verify step);
 *     og_stream()'s stream until og_free (never destroyed by the caller);
 *     og_last_error()'s string until the calling thread's next library call;
 *     og_status_string()'s for the process. A stream passed to og_enqueue or
 *     og_enqueue_verify stays the caller's; it must outlive the work enqueued on it.
 *     og_open_packed borrows the path string for the call only and unmaps the file
 *     before it returns (the weights are on the device).
 *
 * Typical use (non-graph path, from C):
 *   og_config cfg; og_config_default(&cfg); ... fill from config.json ...
 *   og_engine *e; og_init(&cfg, &e);
 *   og_set_weight(e, "model.embed_tokens.weight", OG_DTYPE_BF16, 2, shape, data); ...
 *   og_step(e, token, &logits);   // begin_step + run + end_step
 *   og_free(e);
 * Greedy decoding without the logits copy: og_set_output(e, OG_OUTPUT_NEXT_TOKEN) once, then
 * per token og_step(e, token, NULL) and og_next_token(e, &next, NULL).
 *
 * Graph path (what runtime/graph.py does): capture og_enqueue(e, stream) once into a
 * graph; then per token: og_begin_step(e, token) -> cudaGraphLaunch(graph, stream) ->
 * cudaStreamSynchronize(stream) -> og_end_step(e) -> read og_logits().
 *
 * Pipelined greedy decoding (graph path, OG_OUTPUT_NEXT_TOKEN): the next step is launched
 * before the host has read the token it consumes. og_begin_step(e, t0) -> capture or pick the
 * graph of og_step_slot() -> launch; then per token: og_begin_chained_step(e, &slot) ->
 * launch slot's graph (same stream) -> wait for the older step -> og_end_step(e) ->
 * og_next_token(e, &t, NULL). The chained step's embedding reads its token from the older
 * step's argmax on the device, so the GPU never waits for the host between tokens; each step
 * still makes one H2D copy (its record) and one D2H copy (its token). Each of the two steps in
 * flight has its own pinned record and result (slot 0 and 1), so capture one graph per slot.
 * To stop (a stop token), wait for the chained step and og_cancel_step(e): the sequence keeps
 * the rows of the ended steps only.
 */
#ifndef ONEGRAPH_H
#define ONEGRAPH_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define OG_API __declspec(dllexport)
#else
#define OG_API __attribute__((visibility("default")))
#endif

/* The ABI's version, major.minor. The major number is bumped on any change that breaks a
 * caller (a struct layout, a function signature, a meaning); the minor number on an addition
 * (a new function or constant), reset to 0 with each major bump. A caller written for
 * major.minor works with a library of the same major number and a minor number at least its
 * own (og_abi_version_numbers); the Python binding checks exactly that. */
#define OG_ABI_VERSION_MAJOR 7
#define OG_ABI_VERSION_MINOR 2
/* The major number alone (og_config.abi_version, og_abi_version()). */
#define OG_ABI_VERSION OG_ABI_VERSION_MAJOR

/* ---- status codes ------------------------------------------------------------------ */
typedef int32_t og_status;
#define OG_OK 0
#define OG_E_INVALID_ARGUMENT  -1  /* a NULL pointer, a bad enum, a non-positive size, ...     */
#define OG_E_INVALID_HANDLE    -2  /* NULL handle, or a handle already freed (double free)     */
#define OG_E_NO_DEVICE         -3  /* no usable CUDA device / driver                            */
#define OG_E_CUDA              -4  /* a CUDA call failed; the message names the call            */
#define OG_E_OUT_OF_MEMORY     -5  /* a device or pinned allocation failed; nothing leaked      */
#define OG_E_UNKNOWN_WEIGHT    -6  /* set_weight: a name the config does not use                */
#define OG_E_WEIGHT_MISMATCH   -7  /* set_weight: wrong dtype, rank or shape                    */
#define OG_E_MISSING_WEIGHT    -8  /* hit-only precheck: a required weight is not resident      */
#define OG_E_TOKEN_OUT_OF_RANGE -9 /* token id < 0 or >= vocab_size                             */
#define OG_E_CONTEXT_FULL     -10  /* position == max_seq_len: the KV cache has no free row     */
#define OG_E_UNSUPPORTED      -11  /* a config value the library does not implement            */
#define OG_E_BAD_STATE        -12  /* call out of order (e.g. end_step without begin_step)      */
#define OG_E_BAD_FILE         -13  /* a packed model file is malformed or unreadable; the message
                                       names the file and the byte offset or tensor             */
#define OG_E_CORRUPTED        -14  /* a guard band around the KV cache was overwritten (found by
                                       the test library's og_check_guards)                      */
#define OG_E_POOL_EXHAUSTED   -15  /* the KV block pool has too few free blocks, or every
                                       sequence slot is in use; nothing was changed            */
#define OG_E_NONFINITE_LOGITS -16  /* a sampled step's logits held a NaN or +inf (or overflowed
                                       to +inf over the temperature, or were all -inf)          */

/* ---- element types ----------------------------------------------------------------- */
#define OG_DTYPE_F32  0
#define OG_DTYPE_BF16 1
#define OG_DTYPE_I8   2
#define OG_DTYPE_Q4   3   /* packed signed 4-bit pairs (see "weight formats"); bytes as uint8 */

/* ---- weight formats (og_config.weights_*) -------------------------------------------
 * The rules runtime/quant.py implements (in fp32 on the fp32 value of each bf16 weight,
 * rint = round half to even); the library only stores and multiplies what it is given.
 *
 * OG_WEIGHTS_BF16  the matrix as BF16 [rows, cols].
 * OG_WEIGHTS_INT8  symmetric, one fp32 scale per output row:
 *                    scale[r] = max|w[r, :]| / 127, q = rint(w / scale) in [-127, 127]
 *                    (q = 0 when scale == 0);  w' = float(q) * scale[r].
 *                  set_weight(name)        OG_DTYPE_I8  shape [rows, cols], two's complement
 *                  set_weight(name.scale)  OG_DTYPE_F32 shape [rows]
 * OG_WEIGHTS_Q4    symmetric 4-bit, one e5m3 scale per group of 32 consecutive columns (an
 *                  unsigned 8-bit float, the bits 14..7 of an fp16: 5 exponent bits, bias 15, 3
 *                  mantissa bits; every value exact in bf16):
 *                    scale[r, g] = e5m3(bf16(max|w[r, 32g .. 32g+31]| / 7)) (each rounding to
 *                    nearest even), q = clip(rint(w / scale), -7, 7) (0 where scale == 0);
 *                    w' = float(q) * float(scale[r, g]) (exact in fp32).
 *                  set_weight(name)        OG_DTYPE_Q4  shape [rows, cols] (the logical
 *                    shape); data = rows * ceil(cols / 32) * 16 bytes: each row is
 *                    ceil(cols / 32) groups of 16 bytes, byte j of a group holding columns
 *                    2j (low nibble) and 2j+1 (high nibble) as two's-complement 4-bit values;
 *                    columns past cols in the last group are padding (q = 0 by convention;
 *                    they are multiplied by zeros).
 *                  set_weight(name.scale)  OG_DTYPE_BF16 shape [rows, ceil(cols / 32)]: the
 *                    library stores one byte a group, e5m3(scale) rounded to nearest even (exact
 *                    for the values above), and refuses a negative scale (OG_E_WEIGHT_MISMATCH).
 * "name.scale" is the matrix's Hugging Face name with ".scale" appended, e.g.
 * "model.layers.0.self_attn.q_proj.weight.scale". Both tensors are required weights: the
 * hit-only precheck reports a missing scale like a missing matrix.
 * Classes: weights_dense = attention q/k/v/o and dense-FFN gate/up/down; weights_experts =
 * the MoE experts' gate/up/down; weights_lm_head = lm_head. The embedding table, norms and
 * the MoE router (mlp.gate) are always BF16 (norms BF16 or F32). With tied embeddings and a
 * quantized lm_head, "lm_head.weight" (the quantized embedding table) is required too. */
#define OG_WEIGHTS_BF16 0
#define OG_WEIGHTS_INT8 1
#define OG_WEIGHTS_Q4   2

/* KV cache element type. INT8 stores one fp32 scale per (token, KV head):
 * scale = max|x| / 127, q = round_half_even(x / scale) (q = 0 when scale == 0). */
#define OG_KV_F32  0
#define OG_KV_BF16 1
#define OG_KV_INT8 2

/* ---- configuration ------------------------------------------------------------------
 * Field names follow Hugging Face config.json keys. og_config_default() fills
 * abi_version and sensible defaults; og_init copies everything it needs (including the
 * layer_is_moe array), so the struct may be freed after init. */
typedef struct og_config {
    int32_t abi_version;            /* must equal OG_ABI_VERSION                          */
    int32_t vocab_size;
    int32_t hidden_size;
    int32_t intermediate_size;      /* dense FFN width (0 if every layer is MoE)           */
    int32_t num_hidden_layers;
    int32_t num_attention_heads;
    int32_t num_key_value_heads;
    int32_t head_dim;
    float   rms_norm_eps;
    float   rope_theta;
    float   rope_linear_factor;     /* positions are divided by this; 1.0 = no scaling     */
    int32_t qk_norm;                /* 1: per-head RMSNorm of q and k (Qwen3); 0: Llama    */
    int32_t tie_word_embeddings;    /* 1: lm_head reuses model.embed_tokens.weight         */
    /* mixture of experts (Qwen3-MoE); num_experts == 0 for dense models */
    int32_t num_experts;
    int32_t num_experts_per_tok;
    int32_t moe_intermediate_size;
    int32_t norm_topk_prob;
    const uint8_t *layer_is_moe;    /* [num_hidden_layers]; NULL = every layer MoE when
                                       num_experts > 0, else every layer dense              */
    /* runtime */
    int32_t max_seq_len;            /* the most rows (tokens) one sequence can hold        */
    int32_t kv_dtype;               /* OG_KV_*                                            */
    int32_t device_ordinal;
    /* weight formats (OG_WEIGHTS_*; og_config_default: OG_WEIGHTS_BF16) */
    int32_t weights_dense;          /* attention q/k/v/o, dense FFN gate/up/down           */
    int32_t weights_experts;        /* MoE experts' gate/up/down                           */
    int32_t weights_lm_head;        /* lm_head (a tied model then needs lm_head.weight)    */
    /* paged KV cache (see "sequences and the KV block pool" below) */
    int32_t kv_page_size;           /* rows per KV block; 0 = 64. A page size >= max_seq_len
                                       gives one block per sequence (a contiguous cache)   */
    int32_t kv_pool_blocks;         /* blocks in the pool; 0 = ceil(max_seq_len / page), room
                                       for one full-length sequence                       */
    int32_t kv_max_sequences;       /* sequences alive at once; 0 = 16                    */
    /* batched prefill (og_prefill) */
    int32_t prefill_chunk;          /* prompt rows per pass of og_prefill; 0 = 1024 (capped at
                                       max_seq_len). Sizes its scratch, allocated at init   */
} og_config;

/* ---- sampling on the device (OG_OUTPUT_SAMPLED) ---------------------------------------
 * The stage after the lm_head (cuda/sample.cu) is runtime/sampling.py's sample_step: penalties
 * over the tokens the sequence generated (counts kept on the device), temperature, top-k, top-p,
 * min-p, then an exponential race keyed by Philox4x32-10 (seed, the step's position, token id).
 * A step with output OG_OUTPUT_SAMPLED counts its input token as generated (prompt tokens go in
 * with another output or og_prefill). The parameters are per sequence (og_seq_set_sampling), kept
 * on the device per sequence slot and read through the step record's seq_slot, so a captured
 * graph serves any parameters. */
#define OG_MAX_LOGPROBS 20

typedef struct og_sampling_params {
    uint64_t seed;
    float temperature;              /* 0 = greedy (the argmax after the penalties)          */
    int32_t top_k;                  /* 0 (or >= vocab) = off                                */
    float top_p;                    /* (0, 1]; 1 = off                                      */
    float min_p;                    /* [0, 1]; 0 = off                                      */
    float repetition_penalty;       /* > 0; 1 = off                                         */
    float presence_penalty;         /* 0 = off                                              */
    float frequency_penalty;        /* 0 = off                                              */
    int32_t logprobs;               /* top log-probabilities reported, 0..OG_MAX_LOGPROBS  */
} og_sampling_params;

typedef struct og_top_logprob {
    int32_t token;
    float logprob;
} og_top_logprob;

/* og_next_token's token after a failed sampled step (og_next_token then returns the error). */
#define OG_TOKEN_NONFINITE (-2)     /* OG_E_NONFINITE_LOGITS                                 */
#define OG_TOKEN_OVERFLOW  (-3)     /* more than 4096 ids at the filters' cut: OG_E_UNSUPPORTED */

/* The record copied to the device at the start of every step (og_begin_step fills it, in a
 * pinned buffer of the engine's). The body reads everything per-token from its device copy, so
 * a captured graph replays unchanged for every token, every sequence and every block
 * assignment. The library keeps it internal; its layout is shown for what a step's one
 * host->device copy carries. */
/* og_step_record.token of a chained step: the token is the previous step's argmax, read on
 * the device (og_begin_chained_step). */
#define OG_TOKEN_PREVIOUS_ARGMAX (-1)

typedef struct og_step_record {
    int32_t token;                  /* or OG_TOKEN_PREVIOUS_ARGMAX                          */
    int32_t position;               /* row of the sequence this step writes; visible length
                                       during attention is position + 1                      */
    int32_t seq_slot;               /* the sequence's row of the device block tables         */
    int32_t row_block;              /* the KV block that holds row `position`; the body also
                                       stores it into the sequence's block table             */
} og_step_record;

/* The KV block pool, as og_get_kv_pool_info reports it. */
typedef struct og_kv_pool_info {
    int32_t page_size;              /* rows per block                                     */
    int32_t n_blocks;               /* blocks in the pool                                 */
    int32_t free_blocks;            /* blocks no sequence holds (all zeros)               */
    int32_t max_blocks_per_seq;     /* ceil(max_seq_len / page_size)                      */
    int32_t max_sequences;
    int32_t live_sequences;
    int32_t n_segments;             /* pages per block: per layer K, V (+ K, V scales for int8) */
    int32_t current_sequence;       /* the selected sequence, -1 none                    */
    uint64_t block_stride_bytes;    /* bytes from one block to the next (> any one page)  */
    uint64_t pool_bytes;            /* n_blocks * block_stride_bytes                      */
} og_kv_pool_info;

typedef struct og_stats {
    uint64_t steps;                 /* completed steps (og_end_step calls)                */
    uint64_t enqueues;              /* bodies enqueued (og_run and captures)              */
    uint64_t h2d_copies;            /* host->device copies enqueued by the body           */
    uint64_t d2h_copies;            /* device->host copies enqueued by the body           */
    uint64_t device_bytes;          /* device memory held by the engine                   */
    uint64_t weight_bytes;          /* of which weights                                   */
    uint64_t kv_cache_bytes;        /* of which KV cache (values and scales)              */
} og_stats;

typedef struct og_engine og_engine;

/* ---- functions ---------------------------------------------------------------------- */

/* OG_ABI_VERSION (the major number) of the compiled library (returns the number, not a status). */
OG_API int32_t og_abi_version(void);

/* *major = OG_ABI_VERSION_MAJOR, *minor = OG_ABI_VERSION_MINOR of the compiled library (either
 * pointer may be NULL). */
OG_API void og_abi_version_numbers(int32_t *major, int32_t *minor);

/* The name of a status code ("OG_OK", "OG_E_CUDA", ...; "unknown og_status" for any other
 * value). A static string owned by the library: never NULL, never freed, valid for the life of
 * the process. og_last_error() says what went wrong; this says which code it was. */
OG_API const char *og_status_string(og_status status);

/* Message of the last failed call on this thread ("" if none). Valid until the next
 * call on this thread. Never NULL. */
OG_API const char *og_last_error(void);

/* Fill *cfg with defaults (abi_version = OG_ABI_VERSION, eps 1e-6, theta 1e6, factor 1,
 * kv int8, max_seq_len 4096, device 0, bf16 weights; sizes 0). */
OG_API void og_config_default(og_config *cfg);

/* Number of usable CUDA devices in *count. OG_E_NO_DEVICE (with *count = 0) when the
 * driver is missing or reports none. */
OG_API og_status og_device_count(int32_t *count);

/* Validate cfg, select the device, allocate every device and pinned buffer once (weights,
 * activations, KV cache, step record, logits). On any failure everything allocated so
 * far is released, *out is NULL, and the status says why (OG_E_NO_DEVICE,
 * OG_E_OUT_OF_MEMORY, OG_E_UNSUPPORTED, OG_E_INVALID_ARGUMENT). */
OG_API og_status og_init(const og_config *cfg, og_engine **out);

/* Upload one tensor by its Hugging Face name (e.g. "model.layers.3.self_attn.q_proj.weight").
 * Fused device layouts (q|k|v, gate|up) are assembled here. Matrices must be in their
 * class's weight format (BF16, or I8 / Q4 data plus a "<name>.scale" tensor: see "weight
 * formats"); norm vectors BF16 or F32. shape has ndim entries, row-major, contiguous. Synchronous: the host
 * buffer may be reused on return. Errors: OG_E_UNKNOWN_WEIGHT (name not used by this
 * config), OG_E_WEIGHT_MISMATCH (dtype/rank/shape; message gives expected vs actual). */
OG_API og_status og_set_weight(og_engine *e, const char *name, int32_t dtype, int32_t ndim,
                               const int64_t *shape, const void *data);

/* The rotary embedding's frequencies: inv_freq[i] (i < head_dim / 2) rotates dimension pair i
 * by position * inv_freq[i]. og_init computes 1 / rope_theta^(2i / head_dim) / rope_linear_factor;
 * this replaces that table, for the rope scalings that change each frequency on its own (Llama
 * 3.x's "llama3", a GGUF's rope_freqs tensor). Call it before the first step: rows already in
 * the KV cache keep the rotation they were written with. Errors: OG_E_INVALID_ARGUMENT (NULL,
 * n != head_dim / 2, or a value that is not positive and finite; nothing changes). Since 7.2. */
OG_API og_status og_set_rope_frequencies(og_engine *e, const float *inv_freq, int32_t n);

/* Hit-only contract: OG_OK iff every required weight is resident; otherwise
 * OG_E_MISSING_WEIGHT naming the first missing tensor and the count missing. */
OG_API og_status og_precheck(og_engine *e);

/* Prepare a step of sequence seq (og_seq_create; OG_E_INVALID_ARGUMENT for an id that is not
 * live): check the token range, the row (position < max_seq_len, else OG_E_CONTEXT_FULL) and
 * the precheck; make the row's block writable (og_seq_reserve of one row:
 * OG_E_POOL_EXHAUSTED without a free block); then write {token, position, seq_slot,
 * row_block} into the pinned step record of slot 0. On error nothing changes. Steps begun and
 * not ended are dropped (the caller has waited for any it launched). The selection
 * (og_seq_select) is neither read nor changed. */
OG_API og_status og_begin_step_seq(og_engine *e, int32_t seq, int32_t token);

/* og_begin_step_seq on the selected sequence; OG_E_BAD_STATE when none is selected. */
OG_API og_status og_begin_step(og_engine *e, int32_t token);

/* Pipelined greedy decoding: begin the step after the one in flight, without its token. The
 * token is that step's argmax, which the body's embedding reads on the device
 * (OG_TOKEN_PREVIOUS_ARGMAX), so this step can be launched before the host has seen it.
 * Needs exactly one step begun and not ended, begun on the selected sequence with
 * OG_OUTPUT_NEXT_TOKEN, and the output still OG_OUTPUT_NEXT_TOKEN (else OG_E_BAD_STATE); then
 * checks as og_begin_step (row position + 1 < max_seq_len, the precheck, the row's block) and
 * writes the record of the other slot, which *slot receives (0 or 1: launch the graph
 * captured for that slot, on the same stream as the step in flight). On error nothing
 * changes. og_end_step ends the older step first. */
OG_API og_status og_begin_chained_step(og_engine *e, int32_t *slot);

/* Drop the newest step begun and not ended (a chained step the caller no longer wants). The
 * caller has waited for its work if it was launched: its K/V row lies past the sequence's
 * length then, where the next step writes again. OG_E_BAD_STATE when no step is begun. */
OG_API og_status og_cancel_step(og_engine *e);

/* The slot (0 or 1) of the newest begun step: which pinned record and result og_enqueue
 * uses, i.e. which graph to launch for it. 0 when no step is begun. */
OG_API og_status og_step_slot(og_engine *e, int32_t *slot);

/* The attention bands of the begun step: *first and *last are the bands (0 short, 1 long) of
 * the newest begun decode step's position, or of a begun verify step's first and last
 * positions; both 0 when no step is begun. Attention reads a short context with one kernel
 * and a long one with another, each the faster there; the long band starts at position
 * ONEGRAPH_ATTENTION_LONG_FROM (read at og_init; by default 2048, or 16384 where a KV head has
 * 8 or more query heads), and a cache of no more rows has the short band only.
 * ONEGRAPH_ATTENTION_FOLD (read at og_init) picks the long band's fold: auto (the default: the
 * tensor cores where a KV head's 4 or 8 query heads read int8 rows of 128 dims), tensor (the
 * tensor cores wherever that fold is compiled, 2 query heads a KV head too) or cuda (the CUDA
 * cores). A step's graph serves the later steps of the same slot, output and bands: capture
 * one per band. */
OG_API og_status og_step_bands(og_engine *e, int32_t *first, int32_t *last);

/* THE BODY. Enqueue one decode step on stream (a cudaStream_t; NULL = the engine's own
 * stream): H2D step record -> embedding -> layers -> final norm -> lm_head -> D2H logits.
 * No allocation, no synchronization, no host branch on device data: capturable. Refuses
 * (OG_E_MISSING_WEIGHT) to enqueue when a weight is missing. */
OG_API og_status og_enqueue(og_engine *e, void *stream);

/* The non-graph path: og_enqueue on the engine's own stream, then synchronize. Requires
 * og_begin_step first. The logits are in og_logits() when it returns OG_OK. */
OG_API og_status og_run(og_engine *e);

/* After the step's work has completed (og_run returned, or the caller synchronized the
 * stream a graph was launched on): the visible length advances by one. With a chained step
 * in flight, this ends the older of the two. */
OG_API og_status og_end_step(og_engine *e);

/* Convenience for C callers: begin_step + run + end_step; *logits (may be NULL) points at
 * the pinned logits [vocab_size] fp32, valid until the next step. */
OG_API og_status og_step(og_engine *e, int32_t token, const float **logits);

/* ---- the verify step (speculative decoding) -----------------------------------------------
 * One pass feeds n = 2..OG_MAX_VERIFY tokens (the last accepted token and n - 1 drafted ones)
 * at rows length .. length + n - 1 of a sequence, writes their K/V rows and gives the greedy
 * token (argmax, numpy's rule) after each of them. Each position's logits are bit-identical to
 * those of a decode step (og_enqueue) at that position with the same history, so accepting
 * drafts while they equal the verify's tokens reproduces greedy decoding exactly. Use:
 *   og_begin_verify_seq(e, seq, tokens, n) -> og_enqueue_verify captured once per n (and
 *   per output) and launched, then synchronized; or og_run_verify(e) -> og_verify_results(e,
 *   next, logit_values, n) -> og_end_verify(e, accepted).
 * The verify body makes one H2D copy (the n step records) and one D2H copy (n results of 8
 * bytes); with og_set_output(OG_OUTPUT_LOGITS) also a second D2H copy of the n logits rows
 * (og_verify_logits; tests compare them with the decode body's). The verify step is greedy
 * whatever the output: a sampled output gives the argmax too. Single-threaded per engine. */
#define OG_MAX_VERIFY 9

/* Begin a verify step of n tokens on sequence seq: checks the tokens (OG_E_TOKEN_OUT_OF_RANGE),
 * 2 <= n <= OG_MAX_VERIFY (OG_E_INVALID_ARGUMENT), length + n <= max_seq_len
 * (OG_E_CONTEXT_FULL), no decode step begun and not ended (OG_E_BAD_STATE), the precheck; makes
 * the n rows writable (og_seq_reserve of n rows: OG_E_POOL_EXHAUSTED) and fills the pinned
 * verify record. On error nothing changes. tokens is borrowed for the call. */
OG_API og_status og_begin_verify_seq(og_engine *e, int32_t seq, const int32_t *tokens, int32_t n);

/* THE VERIFY BODY: enqueue the begun verify step on stream (NULL = the engine's stream):
 * capturable like og_enqueue; the graph serves every verify step of the same n and output.
 * OG_E_BAD_STATE when no verify step is begun. */
OG_API og_status og_enqueue_verify(og_engine *e, void *stream);

/* The non-graph path: og_enqueue_verify on the engine's stream, then synchronize. */
OG_API og_status og_run_verify(og_engine *e);

/* After the begun verify step completed: next[j] (and logit[j] when not NULL) = the argmax
 * after position j and its logit, for j < min(n, capacity). OG_E_BAD_STATE when no verify step
 * is begun. */
OG_API og_status og_verify_results(og_engine *e, int32_t *next, float *logit, int32_t capacity);

/* ... and with OG_OUTPUT_LOGITS set when it was enqueued: *logits points at the pinned
 * [n, vocab_size] fp32 logits (owned by the engine, the same address until og_free; the
 * contents hold this verify step's rows until the next verify step is enqueued). */
OG_API og_status og_verify_logits(og_engine *e, const float **logits, int32_t *n);

/* End the verify step keeping its first `accepted` rows (1 <= accepted <= n): the sequence's
 * length advances by `accepted`; the rows after them are no longer visible (the next step
 * overwrites them) and blocks holding none of the kept rows go back to the pool: the rollback
 * of rejected drafts. On error (OG_E_INVALID_ARGUMENT, OG_E_BAD_STATE) nothing changes. */
OG_API og_status og_end_verify(og_engine *e, int32_t accepted);

/* Batched prefill: feed tokens[0, n_tokens) to sequence seq (OG_E_INVALID_ARGUMENT for an id
 * that is not live; the selection is neither read nor changed) in passes of
 * og_config.prefill_chunk rows, each running every layer over all its rows at once (GEMMs on
 * the tensor cores, causal attention over the sequence's cached rows and the pass's own), with
 * K/V written into the paged cache exactly as the decode body writes them; then the last
 * token's logits. Later steps (og_begin_step / og_enqueue, graph or not) continue from the
 * cache unchanged. Numerics: as the body, except that the GEMMs' fp32 activation inputs are
 * multiplied as hi + lo, two bf16 values (within 2^-16 relative; fp32 accumulation), and
 * quantized dense weights are dequantized per matrix into bf16 hi + lo the same way; see
 * cuda/prefill.cuh for the bound. Any chunk size gives bit-identical results.
 * Everything is checked before any state changes: tokens (OG_E_TOKEN_OUT_OF_RANGE), room
 * (OG_E_CONTEXT_FULL past max_seq_len), the precheck (OG_E_MISSING_WEIGHT), the KV blocks of
 * all n_tokens rows (OG_E_POOL_EXHAUSTED). A step begun and not ended is cancelled. The sequence length advances by n_tokens
 * only after every layer of every pass has written. The logits [vocab_size] of the last token
 * are in the pinned og_logits() buffer, and copied to `logits` too when it is not NULL.
 * Synchronous (runs on the engine's stream). MoE layers run their FFN one row at a time
 * through the decode body's expert kernels. */
OG_API og_status og_prefill_seq(og_engine *e, int32_t seq, const int32_t *tokens, int32_t n_tokens,
                                float *logits);

/* og_prefill_seq on the selected sequence; OG_E_BAD_STATE when none is selected. */
OG_API og_status og_prefill(og_engine *e, const int32_t *tokens, int32_t n_tokens, float *logits);

/* Start the selected sequence over: og_seq_reset of the selected sequence (no-op when none
 * is selected). */
OG_API og_status og_reset(og_engine *e);

/* Position of the selected sequence (= its rows in the KV cache). OG_E_BAD_STATE when no
 * sequence is selected. */
OG_API og_status og_get_position(og_engine *e, int32_t *position);

/* The pinned logits [vocab_size] fp32 the body copies into (owned by the engine; the same
 * address until og_free; read it after the step's work completed). */
OG_API og_status og_logits(og_engine *e, float **logits, int32_t *vocab_size);

/* What the body's one device->host copy carries (og_set_output). */
#define OG_OUTPUT_LOGITS     0  /* the logits [vocab_size] fp32 into og_logits() (default)      */
#define OG_OUTPUT_NEXT_TOKEN 1  /* only their argmax, taken on the device: og_next_token()      */
#define OG_OUTPUT_SAMPLED    2  /* the sampling stage's {token, log-probability}: og_next_token() */
#define OG_OUTPUT_SAMPLED_LOGPROBS 3 /* the same plus the top log-probabilities (og_top_logprobs) */

/* Choose the output of the steps enqueued from now on (og_enqueue, og_run, og_step; og_prefill
 * always gives logits). OG_OUTPUT_NEXT_TOKEN is greedy decoding without the logits copy: the
 * body ends with an argmax over the logits on the device (numpy.argmax's rule: the lowest id
 * among equal maxima, a NaN counting as larger than any number) and copies 8 bytes instead of
 * 4 * vocab_size; og_logits() then keeps the last logits-output step's values. A graph keeps
 * the output it was captured with: capture one graph per output. OG_E_INVALID_ARGUMENT for
 * any other value (the output is unchanged). */
OG_API og_status og_set_output(og_engine *e, int32_t output);

/* The result of the last ended OG_OUTPUT_NEXT_TOKEN step: the greedy next token and its
 * logit (NaN when a logit was NaN: the token is then the first NaN's id). Before any such
 * step: token -1. logit may be NULL. */
OG_API og_status og_next_token(og_engine *e, int32_t *token, float *logit);

/* The sampling parameters of sequence `seq` from now on (copied to the device now, synchronous;
 * a graph never needs recapturing). Defaults: greedy, every filter off. Checked as
 * runtime/sampling.py's SamplingParams: OG_E_INVALID_ARGUMENT naming the field. A new or freed
 * sequence slot starts from the defaults; og_seq_fork copies the source's parameters. */
OG_API og_status og_seq_set_sampling(og_engine *e, int32_t seq, const og_sampling_params *params);

/* The top log-probabilities of the last ended OG_OUTPUT_SAMPLED_LOGPROBS step (the kept ids in
 * the final distribution's order, at most its params.logprobs): up to capacity into top, the
 * number in *count. */
OG_API og_status og_top_logprobs(og_engine *e, og_top_logprob *top, int32_t capacity,
                                 int32_t *count);

/* The engine's own stream (a cudaStream_t), e.g. to capture on it: owned by the engine,
 * valid until og_free; the caller never destroys it. */
OG_API og_status og_stream(og_engine *e, void **stream);

OG_API og_status og_get_stats(og_engine *e, og_stats *stats);

/* Release everything. Safe on a partially initialized engine; a second og_free of the
 * same handle returns OG_E_INVALID_HANDLE. */
OG_API og_status og_free(og_engine *e);

/* ---- sequences and the KV block pool -------------------------------------------------
 * The KV cache is a pool of blocks of kv_page_size rows. A block is packed: it holds every
 * layer's K and V page (and for int8 their scale pages), so one block id covers a row range
 * in all layers, and the distance between blocks (the block stride) is larger than any page.
 * A sequence is a block table (block i holds rows [i * page, (i + 1) * page)) and a length.
 * og_init creates sequence 0 and selects it, so a caller that never uses sequences decodes
 * one sequence without creating any. og_begin_step works on the selected sequence: it takes a free
 * block when the row starts one (or copies a shared block on write) and puts the block id
 * in the step record; the body writes K/V there and stores the id into the device block
 * table, so steady-state decode stays at one H2D and one D2H copy per token, and one
 * captured graph serves every sequence, length and block assignment.
 * Free blocks are all zeros: blocks are zeroed as their last holder releases them.
 * Sequence ids are never reused. Calls that change sequences must not overlap a step's work
 * in flight (call them after og_run, or after synchronizing the stream a graph ran on). */

/* A new empty sequence (not selected). OG_E_POOL_EXHAUSTED when kv_max_sequences are live. */
OG_API og_status og_seq_create(og_engine *e, int32_t *seq);

/* A new sequence holding src's rows, sharing src's blocks (reference counted, no copy). The
 * first write into a shared block (the partial last one) copies that block first
 * (copy-on-write), by whichever sequence writes first. Not selected. */
OG_API og_status og_seq_fork(og_engine *e, int32_t src, int32_t *seq);

/* Later steps decode `seq`. Cancels a step begun but not ended. */
OG_API og_status og_seq_select(og_engine *e, int32_t seq);

/* The selected sequence in *seq, -1 when none. */
OG_API og_status og_seq_current(og_engine *e, int32_t *seq);

/* Length 0; the sequence's blocks are released (zeroed when no other sequence holds them). */
OG_API og_status og_seq_reset(og_engine *e, int32_t seq);

/* Release the sequence's blocks and the sequence; a freed id is an error everywhere after
 * (OG_E_INVALID_ARGUMENT, "not live"), so a second free is caught. Freeing the selected
 * sequence leaves none selected. */
OG_API og_status og_seq_free(og_engine *e, int32_t seq);

/* Rows the sequence holds in *length. */
OG_API og_status og_seq_length(og_engine *e, int32_t seq, int32_t *length);

/* Truncate to `length` rows (blocks past them are released), or extend to `length` rows
 * whose K/V content is unspecified (fresh blocks are zeros; benchmarks use this to reach a
 * long context without a prompt). 0 <= length <= max_seq_len; OG_E_POOL_EXHAUSTED (nothing
 * changed) without enough free blocks. */
OG_API og_status og_seq_set_length(og_engine *e, int32_t seq, int32_t length);

/* Make the next n_tokens rows of the sequence writable now (allocate their blocks, copy a
 * shared block on write), so that a prompt either fits entirely or fails before any state
 * changes: OG_E_CONTEXT_FULL past max_seq_len, OG_E_POOL_EXHAUSTED without enough blocks. */
OG_API og_status og_seq_reserve(og_engine *e, int32_t seq, int32_t n_tokens);

/* The sequence's block table: up to `capacity` ids into blocks, the table's size in *count
 * (blocks may be NULL with capacity 0 to ask for the size). */
OG_API og_status og_seq_blocks(og_engine *e, int32_t seq, int32_t *blocks, int32_t capacity,
                               int32_t *count);

OG_API og_status og_get_kv_pool_info(og_engine *e, og_kv_pool_info *info);

/* The packed block's segments (pages) in address order, per layer: K, V, then for int8 K
 * scales, V scales. Up to `capacity` byte offsets (from the start of a block) and page sizes
 * in bytes; the number of segments in *count. Block b's page of segment s is the bytes
 * [b * block_stride + offsets[s], ... + page_bytes[s]) of the pool. */
OG_API og_status og_kv_segments(og_engine *e, int64_t *offsets, int64_t *page_bytes,
                                int32_t capacity, int32_t *count);

/* Reference count of a block in *count (0 = free). OG_E_INVALID_ARGUMENT outside the pool. */
OG_API og_status og_kv_block_refcount(og_engine *e, int32_t block, int32_t *count);

/* ---- packed model files (cuda/packed_file.c) -----------------------------------------
 * One safetensors file written by `onegraph pack` (runtime/pack.py): the tensors the library
 * uploads, by Hugging Face name, and the config in its __metadata__. The format and every
 * check the parser makes are described in cuda/packed_file.h. */

/* Parse and check a packed file without touching a GPU (reads only the header): OG_OK, or
 * OG_E_BAD_FILE (unreadable or malformed; the message names the byte offset or tensor),
 * OG_E_UNSUPPORTED (a newer format_version, or a weights format not implemented yet),
 * OG_E_INVALID_ARGUMENT (path is NULL). */
OG_API og_status og_packed_validate(const char *path);

/* Validate the file, og_init an engine from its config (kv_dtype: OG_KV_*; max_seq_len > 0
 * is used as given, <= 0 means min(4096, max_position_embeddings)), map the file, upload
 * every tensor with og_set_weight and og_precheck. On any failure everything is released,
 * *out is NULL and the status is the failing step's (OG_E_BAD_FILE, OG_E_NO_DEVICE,
 * OG_E_WEIGHT_MISMATCH, OG_E_MISSING_WEIGHT, ...), with the file named in the message. */
OG_API og_status og_open_packed(const char *path, int32_t kv_dtype, int32_t max_seq_len,
                                og_engine **out);

/* Greedy choice: *token = the index of the largest of logits[0, n), ties to the lowest
 * index (as numpy.argmax). OG_E_INVALID_ARGUMENT for NULL pointers, n < 1, or a NaN. */
OG_API og_status og_argmax(const float *logits, int32_t n, int32_t *token);

#ifdef __cplusplus
}
#endif
#endif /* ONEGRAPH_H */
