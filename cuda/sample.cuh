// sample.cuh — the sampling stage of the decode body (OG_OUTPUT_SAMPLED), cuda/sample.cu.
//
// The algorithm is runtime/sampling.py's sample_step, step for step (its docstring numbers the
// steps; the comments in sample.cu use the same numbers). Two launches after the lm_head, no
// grid-wide sync: cross-block results meet through integer atomics (order-free, so the result
// is deterministic) and the last block of a launch (a ticket, reset by that block) finishes:
//   1 prepare  z = penalties(logits) / T into scratch; max z (with its id) by atomicMax. With
//              temperature 0 or 0 < top_k <= kSampleFastK (< V) this launch finishes the step:
//              every block keeps its own top_k ids by z (a radix select over its slice) and the
//              largest z it left out; the last block selects the top_k by d = z - max z among
//              those, checks that no left-out id can reach them (else it selects over all V),
//              cuts, races, writes the result and counts the step's input token.
//   2 select   (the other filters) d, w, W = floor(w 2^40): per-bucket count and mass over 256
//              buckets of d (8 per nat), each block's ids sorted by bucket into scratch; with no
//              filter, the race key of every id (atomicMax). The last block finds the last
//              bucket the kept set can reach (top-k by count, top-p by mass, min-p by d),
//              gathers the ids of buckets up to it from every block's sorted slice (at most
//              kSampleCandidates), sorts them (d descending, lower id first), cuts them exactly,
//              races the kept ones and finishes. After a finished launch 1 it returns at once.
#pragma once

#include <cstdint>

#include "kernels.cuh"
#include "onegraph.h"

namespace og {

constexpr int kSampleBuckets = 256;        // histogram of d = z - max z, 8 buckets per nat
constexpr int kSampleCandidates = 4096;    // ids the last block of launch 2 sorts, at most
constexpr int kSampleMaxLogprobs = 20;     // OG_MAX_LOGPROBS
constexpr int kSampleMaxBlocks = 128;      // blocks of either launch
constexpr int kSampleFastK = 128;          // top_k that launch 1 finishes, at most

// What the stage leaves on the device and the body copies out: `next` first (the 8 bytes of
// OG_OUTPUT_SAMPLED, the token a chained step's embedding reads), the top log-probabilities
// after it (OG_OUTPUT_SAMPLED_LOGPROBS copies the whole struct).
struct SampledResult {
    NextToken next;                        // {token, log-probability}; token < 0: an error
    int32_t n_top, pad;
    og_top_logprob top[kSampleMaxLogprobs];
};

// Device scratch. The scalars and the histogram are zeros between steps (the finishing block
// zeroes what it used); the per-block arrays are written before they are read in every step.
struct SampleState {
    unsigned long long best_z;             // max over ids of (ordered z, ~id)
    unsigned long long best_race;          // max over ids of (ordered race key, ~id)
    unsigned bad;                          // a NaN / +inf logit or z
    unsigned prepare_ticket;               // launch 1's last block
    unsigned ticket;                       // launch 2's last block
    int32_t input;                         // the step's input token (counted at the end)
    unsigned hist_count[kSampleBuckets];
    unsigned long long hist_mass[kSampleBuckets];
    // launch 1, per block: its top_k (z, id) in any order, and the largest (ordered z, ~id) it
    // left out (0: none)
    float top_z[kSampleMaxBlocks * kSampleFastK];
    int32_t top_id[kSampleMaxBlocks * kSampleFastK];
    unsigned long long top_excluded[kSampleMaxBlocks];
    // launch 2, per block: ids of its slice in buckets <= b, for every bucket b
    unsigned block_cum[kSampleMaxBlocks][kSampleBuckets];
};

// Floats of the stage's scratch for a vocabulary of V: z [V], then launch 2's bucket-sorted
// d [V] and ids [V] (int32).
inline size_t sample_scratch_floats(int V) { return 3 * (size_t)V; }

struct SampleArgs {
    const float *logits;                   // [V], the lm_head's output
    int V;
    const og_step_record *step;            // its seq_slot, position and token
    const og_sampling_params *params;      // [max_sequences] per sequence slot (og_seq_set_sampling)
    const NextToken *previous;             // the previous step's token (a chained step)
    int32_t *counts;                       // [max_sequences, V] tokens generated per sequence
    float *z;                              // [sample_scratch_floats(V)] scratch
    SampleState *state;
    SampledResult *out;
};

cudaError_t launch_sample(const SampleArgs &args, cudaStream_t stream, bool pdl);

}  // namespace og
