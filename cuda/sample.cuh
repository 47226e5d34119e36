// sample.cuh — the sampling stage of the decode body (OG_OUTPUT_SAMPLED), cuda/sample.cu.
//
// The algorithm is runtime/sampling.py's sample_step, step for step (its docstring numbers the
// steps; the comments in sample.cu use the same numbers). Three launches after the lm_head, no
// grid-wide sync: cross-block results meet through integer atomics (order-free, so the result
// is deterministic) and the last block of the third launch (a ticket) finishes the step:
//   1 prepare    z = penalties(logits) / T into scratch; max z (with its id) by atomicMax
//   2 histogram  d = z - max, w, W = floor(w 2^40): per-bucket count over 256 buckets of d (8
//                per nat), and mass where a sum over every id needs it (no filter, or top-p
//                without top-k); with no filter, the race key of every id (atomicMax)
//   3 select     every block finds the last bucket the kept set can reach from the histogram
//                (top-k by count, top-p by mass, min-p by d) and gathers the ids of buckets up
//                to it (at most kSampleCandidates); the last block sorts them (d descending,
//                lower id first), cuts them exactly (prefix sums over the block), races the
//                kept ones, writes the result, counts the step's input token and zeroes the
//                state for the next step.
#pragma once

#include <cstdint>

#include "kernels.cuh"
#include "onegraph.h"

namespace og {

constexpr int kSampleBuckets = 256;        // histogram of d = z - max z, 8 buckets per nat
constexpr int kSampleCandidates = 4096;    // ids the last block sorts, at most
constexpr int kSampleMaxLogprobs = 20;     // OG_MAX_LOGPROBS

// What the stage leaves on the device and the body copies out: `next` first (the 8 bytes of
// OG_OUTPUT_SAMPLED, the token a chained step's embedding reads), the top log-probabilities
// after it (OG_OUTPUT_SAMPLED_LOGPROBS copies the whole struct).
struct SampledResult {
    NextToken next;                        // {token, log-probability}; token < 0: an error
    int32_t n_top, pad;
    og_top_logprob top[kSampleMaxLogprobs];
};

// Device scratch, all zeros between steps (the last block of step 3 zeroes what it used).
struct SampleState {
    unsigned long long best_z;             // max over ids of (ordered z, ~id)
    unsigned long long best_race;          // max over ids of (ordered race key, ~id)
    unsigned bad;                          // a NaN / +inf logit or z
    unsigned n_candidates;
    unsigned ticket;
    int32_t input;                         // the step's input token (counted at the end)
    unsigned hist_count[kSampleBuckets];
    unsigned long long hist_mass[kSampleBuckets];
    float candidate_d[kSampleCandidates];
    int32_t candidate_id[kSampleCandidates];
};

struct SampleArgs {
    const float *logits;                   // [V], the lm_head's output
    int V;
    const og_step_record *step;            // its seq_slot, position and token
    const og_sampling_params *params;      // [max_sequences] per sequence slot (og_seq_set_sampling)
    const NextToken *previous;             // the previous step's token (a chained step)
    int32_t *counts;                       // [max_sequences, V] tokens generated per sequence
    float *z;                              // [V] scratch
    SampleState *state;
    SampledResult *out;
};

cudaError_t launch_sample(const SampleArgs &args, cudaStream_t stream, bool pdl);

}  // namespace og
