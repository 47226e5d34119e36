// sample.cu — the sampling stage (OG_OUTPUT_SAMPLED): runtime/sampling.py's sample_step on the
// device. The plan is in sample.cuh; step numbers below are sample_step's. Every float32
// operation that decides a token is written with the explicit IEEE intrinsics (__fdiv_rn,
// __fmul_rn, __fsub_rn) so nvcc cannot contract it into an FMA that numpy does not do.
#include <climits>

#include "sample.cuh"

namespace og {
namespace {

constexpr int kSampleThreads = 256;
constexpr int kSamplePerBlock = 2048;     // ids a block covers (8 a thread), at least
constexpr int kSampleMaxBlocks = 128;
constexpr int kSampleWeights = 1024;      // ranks whose weights the last block computes once
static_assert(kSampleBuckets == kSampleThreads, "step 3 finds its cut with one thread a bucket");
constexpr double kWeightScale = 1099511627776.0;   // 2^40, sampling.WEIGHT_SCALE

// float -> uint32 whose unsigned order is the float order (-inf lowest); packed with ~id below
// it, so a 64-bit max picks the largest value and, among equal ones, the lowest id.
__device__ __forceinline__ unsigned ordered(float x) {
    const unsigned b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float unordered(unsigned u) {
    return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}
__device__ __forceinline__ unsigned long long pack(float x, int id) {
    return ((unsigned long long)ordered(x) << 32) | (unsigned)(0xffffffffu - (unsigned)id);
}
__device__ __forceinline__ int packed_id(unsigned long long p) {
    return (int)(0xffffffffu - (unsigned)(p & 0xffffffffu));
}

// The block's reduction of v by op (max or sum), in every thread. Integers: the grouping does
// not change a sum.
template <class Op>
__device__ __forceinline__ unsigned long long block_reduce_u64(unsigned long long v, unsigned long long *scratch,
                                                               Op op) {
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, offset));
    __syncthreads();
    if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
    __syncthreads();
    v = scratch[0];
    for (int w = 1; w < (int)(blockDim.x / kWarpSize); ++w) v = op(v, scratch[w]);
    return v;
}
__device__ __forceinline__ unsigned long long block_max_u64(unsigned long long v, unsigned long long *scratch) {
    return block_reduce_u64(v, scratch, [](unsigned long long a, unsigned long long b) { return b > a ? b : a; });
}
__device__ __forceinline__ unsigned long long block_sum_u64(unsigned long long v, unsigned long long *scratch) {
    return block_reduce_u64(v, scratch, [](unsigned long long a, unsigned long long b) { return a + b; });
}

// The sum of v over the threads before this one (in thread order).
__device__ __forceinline__ unsigned long long block_exclusive_scan_u64(unsigned long long v,
                                                                       unsigned long long *scratch) {
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    unsigned long long inclusive = v;
    for (int offset = 1; offset < kWarpSize; offset <<= 1) {
        const unsigned long long o = __shfl_up_sync(kFullMask, inclusive, offset);
        if (lane >= offset) inclusive += o;
    }
    __syncthreads();
    if (lane == kWarpSize - 1) scratch[warp] = inclusive;
    __syncthreads();
    unsigned long long before = 0;
    for (int w = 0; w < warp; ++w) before += scratch[w];
    return before + inclusive - v;
}

// Philox4x32-10 (Random123, curand): runtime/philox.py.
__device__ __forceinline__ uint4 philox(uint4 c, unsigned k0, unsigned k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
        const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// Step 5's key of id i: float32(d - log(-log(u))), u = (word + 0.5) / 2^32 of philox.uniforms.
__device__ __forceinline__ float race_key(float d, unsigned long long seed, int position, int i) {
    const uint4 w = philox(make_uint4((unsigned)i >> 2, (unsigned)position, 0u, 0u),
                           (unsigned)seed, (unsigned)(seed >> 32));
    const unsigned word = (i & 3) == 0 ? w.x : (i & 3) == 1 ? w.y : (i & 3) == 2 ? w.z : w.w;
    const double u = ((double)word + 0.5) * (1.0 / 4294967296.0);
    return (float)__dsub_rn((double)d, log(-log(u)));
}

__device__ __forceinline__ float weight(float d) { return (float)exp((double)d); }
__device__ __forceinline__ unsigned long long fixed_weight(float w) {
    return __double2ull_rz(__dmul_rn((double)w, kWeightScale));
}
// Bucket of d <= 0: 8 per nat, the last one open-ended (-inf included).
__device__ __forceinline__ int bucket(float d) {
    return d > -32.f ? min(kSampleBuckets - 1, (int)__fmul_rn(-d, 8.f)) : kSampleBuckets - 1;
}

__device__ __forceinline__ bool filters_on(const og_sampling_params &p, int V) {
    return (p.top_k > 0 && p.top_k < V) || p.top_p < 1.f || p.min_p > 0.f;
}
// Does step 3 need the histogram's mass? Only for sums over every id: with no filter (the total),
// and for top-p without top-k (its cut and its S_k). Otherwise every sum is over the sorted
// candidates, and the histogram counts ids only.
__device__ __forceinline__ bool needs_mass(const og_sampling_params &p, int V) {
    return !filters_on(p, V) || (p.top_p < 1.f && !(p.top_k > 0 && p.top_k < V));
}

// ---- 1: z = penalties(logits) / temperature; max z ----
__global__ void __launch_bounds__(kSampleThreads) sample_prepare_kernel(SampleArgs a) {
    __shared__ unsigned long long scratch[kSampleThreads / kWarpSize];
    pdl_wait();
    pdl_launch_dependents();
    const og_step_record *rec = a.step;
    const og_sampling_params p = a.params[rec->seq_slot];
    int input = rec->token;
    if (input == OG_TOKEN_PREVIOUS_ARGMAX) input = __ldcg(&a.previous->token);
    const int32_t *counts = a.counts + (size_t)rec->seq_slot * a.V;
    const bool penalize = p.repetition_penalty != 1.f || p.presence_penalty != 0.f ||
                          p.frequency_penalty != 0.f;
    const int per_block = ceil_div(a.V, gridDim.x);
    const int begin = blockIdx.x * per_block, end = min(a.V, begin + per_block);
    unsigned long long best = 0;
    unsigned bad = 0;
    for (int i = begin + threadIdx.x; i < end; i += kSampleThreads) {
        float l = a.logits[i];
        bad |= (l != l) || l == INFINITY;
        if (penalize) {
            const int c = counts[i] + (i == input);   // this step's input counts already
            if (c > 0) {
                l = l > 0.f ? __fdiv_rn(l, p.repetition_penalty) : __fmul_rn(l, p.repetition_penalty);
                l = __fsub_rn(l, __fmul_rn(p.frequency_penalty, (float)c));
                l = __fsub_rn(l, p.presence_penalty);
            }
        }
        const float z = p.temperature > 0.f ? __fdiv_rn(l, p.temperature) : l;
        bad |= z == INFINITY;
        a.z[i] = z;
        const unsigned long long k = pack(z, i);
        best = k > best ? k : best;
    }
    best = block_max_u64(best, scratch);
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) {
        atomicMax(&a.state->best_z, best);
        if (bad) atomicOr(&a.state->bad, 1u);
        if (blockIdx.x == 0) a.state->input = input;
    }
}

// ---- 2: the histogram of d (count, fixed-point mass); with no filter, the race ----
__global__ void __launch_bounds__(kSampleThreads) sample_histogram_kernel(SampleArgs a) {
    __shared__ unsigned count[kSampleBuckets];
    __shared__ unsigned long long mass[kSampleBuckets];
    __shared__ unsigned long long scratch[kSampleThreads / kWarpSize];
    pdl_wait();
    pdl_launch_dependents();
    const og_step_record *rec = a.step;
    const og_sampling_params p = a.params[rec->seq_slot];
    SampleState *st = a.state;
    const float m = unordered((unsigned)(__ldcg(&st->best_z) >> 32));
    if (p.temperature <= 0.f || __ldcg(&st->bad) || m == -INFINITY) return;
    for (int b = threadIdx.x; b < kSampleBuckets; b += kSampleThreads) count[b] = 0, mass[b] = 0;
    __syncthreads();
    const bool race_all = !filters_on(p, a.V);
    const bool with_mass = needs_mass(p, a.V);
    const int per_block = ceil_div(a.V, gridDim.x);
    const int begin = blockIdx.x * per_block, end = min(a.V, begin + per_block);
    unsigned long long best = 0;
    for (int i = begin + threadIdx.x; i < end; i += kSampleThreads) {
        const float d = __fsub_rn(a.z[i], m);
        const int b = bucket(d);
        atomicAdd(&count[b], 1u);
        if (with_mass) atomicAdd(&mass[b], fixed_weight(weight(d)));
        if (race_all) {
            const unsigned long long k = pack(race_key(d, p.seed, rec->position, i), i);
            best = k > best ? k : best;
        }
    }
    __syncthreads();
    for (int b = threadIdx.x; b < kSampleBuckets; b += kSampleThreads)
        if (count[b] != 0) {
            atomicAdd(&st->hist_count[b], count[b]);
            if (with_mass) atomicAdd(&st->hist_mass[b], mass[b]);
        }
    if (race_all) {
        best = block_max_u64(best, scratch);
        if (threadIdx.x == 0) atomicMax(&st->best_race, best);
    }
}

// Does candidate (da, ia) come before (db, ib)? d descending, then the lower id.
__device__ __forceinline__ bool before(float da, int ia, float db, int ib) {
    return da > db || (da == db && ia < ib);
}

// ---- 3: gather the ids up to the cut's bucket; the last block cuts, races and finishes ----
__global__ void __launch_bounds__(kSampleThreads) sample_select_kernel(SampleArgs a) {
    __shared__ float sd[kSampleCandidates];
    __shared__ int sid[kSampleCandidates];
    __shared__ float sw[kSampleWeights];
    __shared__ unsigned long long scratch[kSampleThreads / kWarpSize];
    __shared__ bool last;
    pdl_wait();
    pdl_launch_dependents();
    const og_step_record *rec = a.step;
    const og_sampling_params p = a.params[rec->seq_slot];
    SampleState *st = a.state;
    const int V = a.V;
    const unsigned long long best_z = __ldcg(&st->best_z);
    const float m = unordered((unsigned)(best_z >> 32));
    const bool bad = __ldcg(&st->bad) != 0 || m == -INFINITY;
    const bool sampling = p.temperature > 0.f && !bad;
    const bool filtered = filters_on(p, V);
    const int n_k = p.top_k > 0 && p.top_k < V ? p.top_k : V;

    if (sampling) {
        // The last bucket the kept prefix (and the listed top log-probabilities) can reach, from
        // the cumulative count and mass up to each bucket (one thread a bucket).
        const int b = threadIdx.x;
        const auto first_bucket = [&](bool reached) {   // the first bucket where `reached` holds, else the last
            return kSampleBuckets - 1 -
                   (int)block_max_u64(reached ? (unsigned long long)(kSampleBuckets - 1 - b) : 0ull, scratch);
        };
        int cut = -1;
        if (filtered || p.logprobs > 0) {
            const unsigned long long count_b = __ldcg(&st->hist_count[b]);
            const unsigned long long count_to_b = block_exclusive_scan_u64(count_b, scratch) + count_b;
            if (filtered) {
                const int cut_k = n_k < V ? first_bucket(count_to_b >= (unsigned long long)n_k) : kSampleBuckets - 1;
                int cut_p = kSampleBuckets - 1, cut_m = kSampleBuckets - 1;
                if (p.top_p < 1.f && n_k == V) {
                    const unsigned long long mass_b = __ldcg(&st->hist_mass[b]);
                    const unsigned long long mass_to_b = block_exclusive_scan_u64(mass_b, scratch) + mass_b;
                    const double target = (double)p.top_p * (double)block_sum_u64(mass_b, scratch);
                    cut_p = first_bucket((double)mass_to_b >= target);
                }
                if (p.min_p > 0.f)   // w >= min_p needs d >= log(min_p) - rounding: one bucket of room
                    cut_m = min(kSampleBuckets - 1, (int)(-logf(p.min_p) * 8.f) + 1);
                // with top-k and top-p the top-p mass is over the top-k set: gather all of it
                cut = n_k < V ? (p.top_p < 1.f ? cut_k : min(cut_k, cut_m)) : min(cut_p, cut_m);
            } else {
                cut = first_bucket(count_to_b >= (unsigned long long)p.logprobs);
            }
        }
        if (cut >= 0) {
            const int per_block = ceil_div(V, gridDim.x);
            const int begin = blockIdx.x * per_block, end = min(V, begin + per_block);
            for (int i = begin + threadIdx.x; i < end; i += kSampleThreads) {
                const float d = __fsub_rn(a.z[i], m);
                if (bucket(d) > cut) continue;
                const unsigned slot = atomicAdd(&st->n_candidates, 1u);
                if (slot < (unsigned)kSampleCandidates) st->candidate_d[slot] = d, st->candidate_id[slot] = i;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();  // the candidates are visible before the ticket says so
        last = atomicAdd(&st->ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();

    SampledResult *out = a.out;
    int token = OG_TOKEN_NONFINITE;
    float value = 0.f;
    int n_top = 0;
    if (!bad && !sampling) {                      // temperature 0: the argmax of the penalized
        token = packed_id(best_z);
    } else if (sampling) {
        const unsigned n = __ldcg(&st->n_candidates);
        if (n > (unsigned)kSampleCandidates) {
            token = OG_TOKEN_OVERFLOW;
        } else {
            int size = 1;
            while (size < (int)n) size <<= 1;
            for (int j = threadIdx.x; j < size; j += kSampleThreads) {
                sd[j] = j < (int)n ? __ldcg(&st->candidate_d[j]) : -INFINITY;
                sid[j] = j < (int)n ? __ldcg(&st->candidate_id[j]) : INT_MAX;
            }
            __syncthreads();
            // bitonic sort into "before" order (padding, -inf with id INT_MAX, goes last)
            for (int k = 2; k <= size; k <<= 1)
                for (int j = k >> 1; j > 0; j >>= 1) {
                    for (int t = threadIdx.x; t < size; t += kSampleThreads) {
                        const int u = t ^ j;
                        if (u > t) {
                            const bool up = (t & k) == 0;
                            const bool swap = up ? before(sd[u], sid[u], sd[t], sid[t])
                                                 : before(sd[t], sid[t], sd[u], sid[u]);
                            if (swap) {
                                const float fd = sd[t];
                                sd[t] = sd[u], sd[u] = fd;
                                const int fi = sid[t];
                                sid[t] = sid[u], sid[u] = fi;
                            }
                        }
                    }
                    // Stages with j < 32 pair t with t ^ j in the same warp: between two such
                    // stages a warp barrier suffices; a stage across warps needs the block's.
                    const int next_j = j > 1 ? j >> 1 : k;
                    if (j >= kWarpSize || next_j >= kWarpSize) __syncthreads();
                    else __syncwarp();
                }
            __syncthreads();
            // Step 4 in parallel: thread t owns the ranks [j0, j1) (contiguous, so a prefix sum
            // is its running sum plus the sum of the ranks before its range). The sums are of
            // integers (fixed_weight), so they do not depend on how they are grouped: the
            // result is the sequential loop's. The weights of the first ranks are computed once.
            const int n_weights = min((int)n, kSampleWeights);
            for (int j = threadIdx.x; j < n_weights; j += kSampleThreads) sw[j] = weight(sd[j]);
            __syncthreads();
            const auto weight_at = [&](int j) { return j < n_weights ? sw[j] : weight(sd[j]); };
            const int per = ceil_div((int)n, kSampleThreads);
            const int j0 = min((int)n, (int)threadIdx.x * per), j1 = min((int)n, j0 + per);
            // the mass of every id (the histogram's, where needs_mass says it was taken)
            const auto hist_total = [&]() {
                unsigned long long part = 0;
                for (int b = threadIdx.x; b < kSampleBuckets; b += kSampleThreads) part += __ldcg(&st->hist_mass[b]);
                return block_sum_u64(part, scratch);
            };
            int kept = V;
            unsigned long long total = 0;
            if (filtered) {
                kept = min(n_k, (int)n);
                if (p.top_p < 1.f) {
                    // S_k over the first n_k ranks (the list holds them all), else over every id
                    unsigned long long mine = 0, mine_k = 0;
                    for (int j = j0; j < j1; ++j) {
                        const unsigned long long w = fixed_weight(weight_at(j));
                        mine += w;
                        if (j < n_k) mine_k += w;
                    }
                    const unsigned long long s = n_k < V ? block_sum_u64(mine_k, scratch) : hist_total();
                    const double target = (double)p.top_p * (double)s;
                    // n_p: the first rank whose prefix mass reaches the target (V: none does)
                    unsigned long long cum = block_exclusive_scan_u64(mine, scratch);
                    int n_p = V;
                    for (int j = j0; j < j1; ++j) {
                        cum += fixed_weight(weight_at(j));
                        if ((double)cum >= target) { n_p = j + 1; break; }
                    }
                    n_p = V - (int)block_max_u64((unsigned long long)(V - n_p), scratch);
                    kept = min(kept, n_p);
                }
                if (p.min_p > 0.f) {   // w does not grow with the rank: the ids above min_p are a prefix
                    unsigned count = 0;
                    for (int j = j0; j < j1; ++j) count += weight_at(j) >= p.min_p;
                    kept = min(kept, (int)block_sum_u64(count, scratch));
                }
                unsigned long long part = 0;
                for (int j = j0; j < min(j1, kept); ++j) part += fixed_weight(weight_at(j));
                total = block_sum_u64(part, scratch);
            } else {
                total = hist_total();
            }
            unsigned long long best = 0;
            if (filtered) {  // step 5 over the kept prefix
                for (int j = threadIdx.x; j < kept; j += kSampleThreads) {
                    const unsigned long long k = pack(race_key(sd[j], p.seed, rec->position, sid[j]), sid[j]);
                    best = k > best ? k : best;
                }
                best = block_max_u64(best, scratch);
            } else {
                best = __ldcg(&st->best_race);
            }
            token = packed_id(best);
            // step 6
            const double log_total = log((double)total / kWeightScale);
            value = (float)((double)__fsub_rn(a.z[token], m) - log_total);
            n_top = min(p.logprobs, min(kept, (int)n));
            for (int j = threadIdx.x; j < n_top; j += kSampleThreads)
                out->top[j] = og_top_logprob{sid[j], (float)((double)sd[j] - log_total)};
        }
    }
    __syncthreads();  // every thread has read the state zeroed below
    if (threadIdx.x == 0) {
        out->next = NextToken{token, token >= 0 ? value : __int_as_float(0x7fc00000)};
        out->n_top = n_top;
        const int input = st->input;  // counted as generated (the penalties above included it)
        if (input >= 0 && input < V) a.counts[(size_t)rec->seq_slot * V + input] += 1;
        st->best_z = 0, st->best_race = 0, st->bad = 0, st->n_candidates = 0, st->ticket = 0;
    }
    for (int b = threadIdx.x; b < kSampleBuckets; b += kSampleThreads)
        st->hist_count[b] = 0, st->hist_mass[b] = 0;
}

}  // namespace

cudaError_t launch_sample(const SampleArgs &args, cudaStream_t stream, bool pdl) {
    if (args.logits == nullptr || args.V < 1 || args.step == nullptr || args.params == nullptr ||
        args.counts == nullptr ||
        args.z == nullptr || args.state == nullptr || args.out == nullptr)
        return cudaErrorInvalidValue;
    int blocks = ceil_div(args.V, kSamplePerBlock);
    blocks = blocks < 1 ? 1 : blocks > kSampleMaxBlocks ? kSampleMaxBlocks : blocks;
    cudaError_t err = launch_kernel(sample_prepare_kernel, dim3(blocks), dim3(kSampleThreads), 0,
                                    stream, pdl, args);
    if (err == cudaSuccess)
        err = launch_kernel(sample_histogram_kernel, dim3(blocks), dim3(kSampleThreads), 0, stream,
                            pdl, args);
    if (err == cudaSuccess)
        err = launch_kernel(sample_select_kernel, dim3(blocks), dim3(kSampleThreads), 0, stream,
                            pdl, args);
    return err;
}

}  // namespace og
