// sample.cu — the sampling stage (OG_OUTPUT_SAMPLED): runtime/sampling.py's sample_step on the
// device. The plan is in sample.cuh; step numbers below are sample_step's. Every float32
// operation that decides a token is written with the explicit IEEE intrinsics (__fdiv_rn,
// __fmul_rn, __fsub_rn) so nvcc cannot contract it into an FMA that numpy does not do.
#include <climits>

#include "sample.cuh"

namespace og {
namespace {

constexpr int kSampleThreads = 256;
constexpr int kSampleWarps = kSampleThreads / kWarpSize;
constexpr int kSamplePerBlock = 2048;     // ids a block covers (8 a thread), at least
constexpr double kWeightScale = 1099511627776.0;   // 2^40, sampling.WEIGHT_SCALE
static_assert(kSampleThreads == kSampleBuckets, "launch 2 scans the buckets one a thread");
static_assert(kSampleMaxBlocks <= kSampleThreads, "launch 2 scans the blocks one a thread");
static_assert(kSampleFastK <= kSampleThreads, "launch 1's rank sort takes one id a thread");

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
__device__ __forceinline__ float packed_value(unsigned long long p) { return unordered((unsigned)(p >> 32)); }
// Step 4's order as one key: d descending, then the lower id. -0 becomes +0 first, so that
// equal d compare equal (sample_step's sort, `before` below).
__device__ __forceinline__ unsigned long long order_key(float d, int id) {
    return pack(__fadd_rn(d, 0.f), id);
}

__device__ __forceinline__ unsigned long long block_max_u64(unsigned long long v,
                                                            unsigned long long *scratch) {
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
        const unsigned long long o = __shfl_xor_sync(kFullMask, v, offset);
        v = o > v ? o : v;
    }
    __syncthreads();
    if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
    __syncthreads();
    v = scratch[0];
    for (int w = 1; w < kSampleWarps; ++w) v = scratch[w] > v ? scratch[w] : v;
    return v;
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
// Launch 1 finishes the step (greedy, or a top-k small enough for its per-block lists).
__device__ __forceinline__ bool prepare_finishes(const og_sampling_params &p, int V) {
    return p.temperature <= 0.f || (p.top_k > 0 && p.top_k < V && p.top_k <= kSampleFastK);
}

// The slice [begin, end) of block b of `blocks` over V ids.
__device__ __forceinline__ int2 slice(int b, int blocks, int V) {
    const int per_block = ceil_div(V, blocks);
    const int begin = min(V, b * per_block);
    return make_int2(begin, min(V, begin + per_block));
}

// ---- the radix select: the k-th largest of n distinct 64-bit keys, in one block ----
struct SelectShared {
    unsigned hist[256];
    int digit;
    unsigned above, count;
};

// Returns t with exactly k of the keys key(j), j in [0, n), >= t (1 <= k <= n). Descends 8 bits
// at a time from the top, counting the keys that share the digits chosen so far; stops as soon
// as every key of the chosen digit is needed (at the last digit at the latest: keys are
// distinct). Every thread calls it and gets t; the caller syncs before `sh` is reused.
template <class Key>
__device__ unsigned long long block_select(int n, int k, Key key, SelectShared &sh) {
    unsigned long long prefix = 0, mask = 0;
    unsigned remaining = (unsigned)k;
    for (int shift = 56; shift >= 0; shift -= 8) {
        __syncthreads();  // the previous digit's readers are done with sh
        for (int b = threadIdx.x; b < 256; b += kSampleThreads) sh.hist[b] = 0;
        __syncthreads();
        for (int j = threadIdx.x; j < n; j += kSampleThreads) {
            const unsigned long long v = key(j);
            if ((v & mask) == prefix) atomicAdd(&sh.hist[(unsigned)(v >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x < kWarpSize) {
            // lane l holds digits 255 - 8l .. 248 - 8l (descending); an inclusive scan over lanes
            const int lane = threadIdx.x;
            unsigned c[8], sum = 0;
#pragma unroll
            for (int q = 0; q < 8; ++q) c[q] = sh.hist[255 - 8 * lane - q], sum += c[q];
            unsigned incl = sum;
#pragma unroll
            for (int o = 1; o < kWarpSize; o <<= 1) {
                const unsigned u = __shfl_up_sync(kFullMask, incl, o);
                if (lane >= o) incl += u;
            }
            unsigned acc = incl - sum;
            if (acc < remaining && remaining <= incl) {
                for (int q = 0; q < 8; ++q) {
                    if (acc + c[q] >= remaining) {
                        sh.digit = 255 - 8 * lane - q, sh.above = acc, sh.count = c[q];
                        break;
                    }
                    acc += c[q];
                }
            }
        }
        __syncthreads();
        prefix |= (unsigned long long)sh.digit << shift;
        mask |= 255ull << shift;
        remaining -= sh.above;
        if (sh.count == remaining) break;   // every key with this prefix is among the k
    }
    return prefix;
}

// Rank sort of k <= kSampleThreads distinct keys (descending) into (d, id) order.
__device__ __forceinline__ void sort_keys(const unsigned long long *key, int k, float *sd, int *sid) {
    __syncthreads();
    if ((int)threadIdx.x < k) {
        const unsigned long long v = key[threadIdx.x];
        int rank = 0;
        for (int i = 0; i < k; ++i) rank += key[i] > v;
        sd[rank] = packed_value(v), sid[rank] = packed_id(v);
    }
    __syncthreads();
}

// ---- steps 4-6 on the ids in order ----
// W over the first n ids in order, summed by warp 0 (integers: any order gives the same sum).
__device__ __forceinline__ unsigned long long warp_mass(const float *sd, int n) {
    unsigned long long s = 0;
    for (int j = threadIdx.x; j < n; j += kWarpSize) s += fixed_weight(weight(sd[j]));
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) s += __shfl_xor_sync(kFullMask, s, offset);
    return s;
}
// The shortest prefix of the first n ids whose cumulative W reaches target (none: `none`).
__device__ __forceinline__ int warp_prefix_reaching(const float *sd, int n, double target, int none) {
    const int lane = threadIdx.x;
    unsigned long long carry = 0;
    for (int base = 0; base < n; base += kWarpSize) {
        const int j = base + lane;
        unsigned long long v = j < n ? fixed_weight(weight(sd[j])) : 0ull;
        for (int o = 1; o < kWarpSize; o <<= 1) {
            const unsigned long long u = __shfl_up_sync(kFullMask, v, o);
            if (lane >= o) v += u;
        }
        v += carry;
        const unsigned hit = __ballot_sync(kFullMask, j < n && (double)v >= target);
        if (hit != 0) return base + __ffs(hit);
        carry = __shfl_sync(kFullMask, v, kWarpSize - 1);
    }
    return none;
}
// The ids (a prefix: w falls along the order) of the first n with w >= min_p.
__device__ __forceinline__ int warp_prefix_above(const float *sd, int n, float min_p) {
    for (int base = 0; base < n; base += kWarpSize) {
        const int j = base + threadIdx.x;
        const unsigned below = __ballot_sync(kFullMask, j < n && weight(sd[j]) < min_p);
        if (below != 0) return base + __ffs(below) - 1;
    }
    return n;
}

struct DrawShared {
    int kept;
    unsigned long long total;
};

struct Drawn {
    int token;
    float value;
    int n_top;
};

// Steps 4-6. sd, sid [n]: the first n ids in order (shared; every id of rank < n, and n >= the
// top-k when top-k is on, n >= the top-p prefix when top-p is on). mass_all: W summed over all
// V (top-p without top-k, no filter). race_all: the race over all V (no filter). Every thread
// calls it; the top log-probabilities go to out->top.
__device__ Drawn draw(const SampleArgs &a, const og_sampling_params &p, int position, const float *sd,
                      const int *sid, int n, float m, unsigned long long mass_all,
                      unsigned long long race_all, unsigned long long *scratch, DrawShared &ds) {
    const int V = a.V;
    const bool filtered = filters_on(p, V);
    const int n_k = p.top_k > 0 && p.top_k < V ? p.top_k : V;
    __syncthreads();
    if (threadIdx.x < kWarpSize) {   // step 4, the kept prefix, exactly
        int kept = V;
        unsigned long long total = mass_all;
        if (filtered) {
            kept = min(n_k, n);
            if (p.top_p < 1.f) {
                const unsigned long long s = n_k < V ? warp_mass(sd, n_k) : mass_all;
                kept = min(kept, warp_prefix_reaching(sd, n, (double)p.top_p * (double)s, V));
            }
            if (p.min_p > 0.f) kept = min(kept, warp_prefix_above(sd, n, p.min_p));
            total = warp_mass(sd, kept);
        }
        if (threadIdx.x == 0) ds.kept = kept, ds.total = total;
    }
    __syncthreads();
    const int kept = ds.kept;
    unsigned long long best = race_all;
    if (filtered) {  // step 5 over the kept prefix
        best = 0;
        for (int j = threadIdx.x; j < kept; j += kSampleThreads) {
            const unsigned long long k = pack(race_key(sd[j], p.seed, position, sid[j]), sid[j]);
            best = k > best ? k : best;
        }
        best = block_max_u64(best, scratch);
    }
    Drawn r;
    r.token = packed_id(best);
    // step 6
    const double log_total = log((double)ds.total / kWeightScale);
    r.value = (float)((double)__fsub_rn(__ldcg(&a.z[r.token]), m) - log_total);
    r.n_top = min(p.logprobs, min(kept, n));
    for (int j = threadIdx.x; j < r.n_top; j += kSampleThreads)
        a.out->top[j] = og_top_logprob{sid[j], (float)((double)sd[j] - log_total)};
    return r;
}

// The finishing block's thread 0: the result, and the step's input token counted as generated
// (the penalties of this step included it already).
__device__ __forceinline__ void write_result(const SampleArgs &a, int seq_slot, int input, const Drawn &r) {
    a.out->next = NextToken{r.token, r.token >= 0 ? r.value : __int_as_float(0x7fc00000)};
    a.out->n_top = r.n_top;
    if (input >= 0 && input < a.V) a.counts[(size_t)seq_slot * a.V + input] += 1;
}

// ---- launch 1: z = penalties(logits) / temperature; max z; greedy and small top-k finish ----
__global__ void __launch_bounds__(kSampleThreads) sample_prepare_kernel(SampleArgs a) {
    __shared__ SelectShared sel;
    __shared__ unsigned long long scratch[kSampleWarps];
    __shared__ unsigned long long skey[kSampleFastK];
    __shared__ float sd[kSampleFastK];
    __shared__ int sid[kSampleFastK];
    __shared__ unsigned s_slot;
    __shared__ DrawShared ds;
    __shared__ bool last;
    pdl_wait();
    pdl_launch_dependents();
    const og_step_record *rec = a.step;
    const og_sampling_params p = a.params[rec->seq_slot];
    SampleState *st = a.state;
    const int V = a.V;
    int input = rec->token;
    if (input == OG_TOKEN_PREVIOUS_ARGMAX) input = __ldcg(&a.previous->token);
    const int32_t *counts = a.counts + (size_t)rec->seq_slot * V;
    const bool penalize = p.repetition_penalty != 1.f || p.presence_penalty != 0.f ||
                          p.frequency_penalty != 0.f;
    const int2 range = slice(blockIdx.x, gridDim.x, V);
    const int begin = range.x, n_slice = range.y - range.x;
    unsigned long long best = 0;
    unsigned bad = 0;
    for (int i = begin + threadIdx.x; i < range.y; i += kSampleThreads) {
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
        atomicMax(&st->best_z, best);
        if (bad) atomicOr(&st->bad, 1u);
        if (blockIdx.x == 0) st->input = input;
    }
    if (!prepare_finishes(p, V)) return;   // launch 2 finishes

    const bool fast = p.temperature > 0.f;   // 0 < top_k <= kSampleFastK, top_k < V
    const int k = p.top_k;
    if (fast) {
        // The block's top k by (z descending, lower id): a superset of its part of the step's
        // top k unless a left-out id ties the k-th d (checked by the last block).
        const auto z_key = [&](int j) { return pack(a.z[begin + j], begin + j); };
        const unsigned long long threshold = n_slice > k ? block_select(n_slice, k, z_key, sel) : 0ull;
        if (threadIdx.x == 0) s_slot = 0;
        __syncthreads();
        unsigned long long left_out = 0;
        for (int j = threadIdx.x; j < n_slice; j += kSampleThreads) {
            const unsigned long long v = z_key(j);
            if (v >= threshold) {
                const unsigned slot = atomicAdd(&s_slot, 1u);
                if (slot < (unsigned)kSampleFastK) {
                    st->top_z[blockIdx.x * kSampleFastK + slot] = a.z[begin + j];
                    st->top_id[blockIdx.x * kSampleFastK + slot] = begin + j;
                }
            } else {
                left_out = v > left_out ? v : left_out;
            }
        }
        left_out = block_max_u64(left_out, scratch);
        if (threadIdx.x == 0) st->top_excluded[blockIdx.x] = left_out;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();  // z and the block's list are visible before the ticket says so
        last = atomicAdd(&st->prepare_ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();

    const unsigned long long best_z = __ldcg(&st->best_z);
    const float m = packed_value(best_z);
    const bool failed = __ldcg(&st->bad) != 0 || m == -INFINITY;
    Drawn r{OG_TOKEN_NONFINITE, 0.f, 0};
    if (!failed && !fast) {                      // temperature 0: the argmax of the penalized
        r.token = packed_id(best_z);
    } else if (!failed) {
        // The top k by order_key(d) among the blocks' lists (block b listed min(k, its slice)).
        const auto listed_key = [&](int j) -> unsigned long long {
            const int b = j / kSampleFastK;
            const int2 rb = slice(b, gridDim.x, V);
            if (j % kSampleFastK >= min(k, rb.y - rb.x)) return 0ull;   // below every id's key
            return order_key(__fsub_rn(__ldcg(&st->top_z[j]), m), __ldcg(&st->top_id[j]));
        };
        const int n_listed = gridDim.x * kSampleFastK;
        unsigned long long threshold = block_select(n_listed, k, listed_key, sel);
        if (threadIdx.x == 0) s_slot = 0;
        __syncthreads();
        for (int j = threadIdx.x; j < n_listed; j += kSampleThreads) {
            const unsigned long long v = listed_key(j);
            if (v != 0ull && v >= threshold) {
                const unsigned slot = atomicAdd(&s_slot, 1u);
                if (slot < (unsigned)k) skey[slot] = v;
            }
        }
        sort_keys(skey, k, sd, sid);
        // A left-out id has z <= its block's largest left-out z, so d <= that z's d: below the
        // k-th d, it is below the k-th. Else (ties of d) select over all V.
        bool reach = false;
        for (int b = threadIdx.x; b < (int)gridDim.x; b += kSampleThreads) {
            const unsigned long long e = __ldcg(&st->top_excluded[b]);
            reach |= e != 0ull && __fsub_rn(packed_value(e), m) >= sd[k - 1];
        }
        if (__syncthreads_or(reach)) {
            const auto all_key = [&](int i) { return order_key(__fsub_rn(__ldcg(&a.z[i]), m), i); };
            threshold = block_select(V, k, all_key, sel);
            if (threadIdx.x == 0) s_slot = 0;
            __syncthreads();
            for (int i = threadIdx.x; i < V; i += kSampleThreads) {
                const unsigned long long v = all_key(i);
                if (v >= threshold) {
                    const unsigned slot = atomicAdd(&s_slot, 1u);
                    if (slot < (unsigned)k) skey[slot] = v;
                }
            }
            sort_keys(skey, k, sd, sid);
        }
        r = draw(a, p, rec->position, sd, sid, k, m, 0ull, 0ull, scratch, ds);
    }
    __syncthreads();  // every thread has read the state zeroed below
    if (threadIdx.x == 0) {
        write_result(a, rec->seq_slot, input, r);
        st->best_z = 0, st->bad = 0, st->prepare_ticket = 0;
    }
}

// Does candidate (da, ia) come before (db, ib)? d descending, then the lower id.
__device__ __forceinline__ bool before(float da, int ia, float db, int ib) {
    return da > db || (da == db && ia < ib);
}

// Inclusive prefix sums of v[0..kSampleThreads) in place (Hillis-Steele; one thread an entry).
template <class T>
__device__ __forceinline__ void block_scan(T *v) {
    for (int offset = 1; offset < kSampleThreads; offset <<= 1) {
        __syncthreads();
        const T x = (int)threadIdx.x >= offset ? v[threadIdx.x - offset] : T(0);
        __syncthreads();
        v[threadIdx.x] += x;
    }
    __syncthreads();
}

// ---- launch 2: the histogram of d, each block's ids sorted by bucket; the last block cuts ----
__global__ void __launch_bounds__(kSampleThreads) sample_select_kernel(SampleArgs a) {
    __shared__ unsigned count[kSampleBuckets];
    __shared__ unsigned long long mass[kSampleBuckets];
    __shared__ unsigned offset[kSampleThreads];
    __shared__ float sd[kSampleCandidates];
    __shared__ int sid[kSampleCandidates];
    __shared__ unsigned long long scratch[kSampleWarps];
    __shared__ int s_cut;
    __shared__ DrawShared ds;
    __shared__ bool last;
    pdl_wait();
    pdl_launch_dependents();
    const og_step_record *rec = a.step;
    const og_sampling_params p = a.params[rec->seq_slot];
    const int V = a.V;
    if (prepare_finishes(p, V)) return;   // launch 1 finished the step
    SampleState *st = a.state;
    float *sorted_d = a.z + V;
    int32_t *sorted_id = reinterpret_cast<int32_t *>(a.z + 2 * (size_t)V);
    const unsigned long long best_z = __ldcg(&st->best_z);
    const float m = packed_value(best_z);
    const bool failed = __ldcg(&st->bad) != 0 || m == -INFINITY;
    const bool filtered = filters_on(p, V);
    const bool gather = filtered || p.logprobs > 0;   // the last block needs ids in order
    const int2 range = slice(blockIdx.x, gridDim.x, V);
    const int begin = range.x;

    if (!failed) {
        count[threadIdx.x] = 0, mass[threadIdx.x] = 0;
        __syncthreads();
        unsigned long long best = 0;
        for (int i = begin + threadIdx.x; i < range.y; i += kSampleThreads) {
            const float d = __fsub_rn(a.z[i], m);
            const int b = bucket(d);
            atomicAdd(&count[b], 1u);
            atomicAdd(&mass[b], fixed_weight(weight(d)));
            if (!filtered) {   // step 5 over all V
                const unsigned long long k = pack(race_key(d, p.seed, rec->position, i), i);
                best = k > best ? k : best;
            }
        }
        __syncthreads();
        const int b = threadIdx.x;
        if (count[b] != 0) {
            atomicAdd(&st->hist_count[b], count[b]);
            atomicAdd(&st->hist_mass[b], mass[b]);
        }
        if (!filtered) {
            best = block_max_u64(best, scratch);
            if (threadIdx.x == 0) atomicMax(&st->best_race, best);
        }
        if (gather) {
            // counting sort of the slice by bucket: block_cum[block][b] = ids in buckets <= b
            offset[b] = count[b];
            block_scan(offset);
            st->block_cum[blockIdx.x][b] = offset[b];
            offset[b] -= count[b];
            __syncthreads();
            for (int i = begin + threadIdx.x; i < range.y; i += kSampleThreads) {
                const float d = __fsub_rn(a.z[i], m);
                const unsigned slot = begin + atomicAdd(&offset[bucket(d)], 1u);
                sorted_d[slot] = d, sorted_id[slot] = i;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();  // the histogram and the sorted slices are visible before the ticket
        last = atomicAdd(&st->ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();

    Drawn r{OG_TOKEN_NONFINITE, 0.f, 0};
    if (!failed) {
        // cumulative count and mass per bucket
        count[threadIdx.x] = __ldcg(&st->hist_count[threadIdx.x]);
        mass[threadIdx.x] = __ldcg(&st->hist_mass[threadIdx.x]);
        block_scan(count);
        block_scan(mass);
        if (threadIdx.x == 0) {
            // The last bucket the kept prefix (and the listed top log-probabilities) can reach.
            const int n_k = p.top_k > 0 && p.top_k < V ? p.top_k : V;
            const auto first_count = [&](unsigned n) {
                int b = 0;
                while (b < kSampleBuckets - 1 && count[b] < n) ++b;
                return b;
            };
            int cut = -1;
            if (filtered) {
                const int cut_k = n_k < V ? first_count((unsigned)n_k) : kSampleBuckets - 1;
                int cut_p = kSampleBuckets - 1, cut_m = kSampleBuckets - 1;
                if (p.top_p < 1.f && n_k == V) {
                    const double target = (double)p.top_p * (double)mass[kSampleBuckets - 1];
                    cut_p = 0;
                    while (cut_p < kSampleBuckets - 1 && (double)mass[cut_p] < target) ++cut_p;
                }
                if (p.min_p > 0.f)   // w >= min_p needs d >= log(min_p) - rounding: one bucket of room
                    cut_m = min(kSampleBuckets - 1, (int)(-logf(p.min_p) * 8.f) + 1);
                // with top-k and top-p the top-p mass is over the top-k set: gather all of it
                cut = n_k < V ? (p.top_p < 1.f ? cut_k : min(cut_k, cut_m)) : min(cut_p, cut_m);
            } else if (p.logprobs > 0) {
                cut = first_count((unsigned)p.logprobs);
            }
            s_cut = cut;
        }
        __syncthreads();
        const int cut = s_cut;
        const int n = cut >= 0 ? (int)count[cut] : 0;
        if (n > kSampleCandidates) {
            r.token = OG_TOKEN_OVERFLOW;
        } else {
            if (n > 0) {
                // every block's ids in buckets <= cut lead its sorted slice: offset[b] = the
                // candidates of blocks <= b
                offset[threadIdx.x] =
                    (int)threadIdx.x < (int)gridDim.x ? __ldcg(&st->block_cum[threadIdx.x][cut]) : 0u;
                block_scan(offset);
                for (int j = threadIdx.x; j < n; j += kSampleThreads) {
                    int lo = 0, hi = gridDim.x - 1;   // the first block with offset > j
                    while (lo < hi) {
                        const int mid = (lo + hi) / 2;
                        if (offset[mid] > (unsigned)j) hi = mid; else lo = mid + 1;
                    }
                    const int src = slice(lo, gridDim.x, V).x + j - (lo > 0 ? (int)offset[lo - 1] : 0);
                    sd[j] = __ldcg(&sorted_d[src]), sid[j] = __ldcg(&sorted_id[src]);
                }
            }
            int size = 1;
            while (size < n) size <<= 1;
            for (int j = n + threadIdx.x; j < size; j += kSampleThreads) sd[j] = -INFINITY, sid[j] = INT_MAX;
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
                    __syncthreads();
                }
            r = draw(a, p, rec->position, sd, sid, n, m, mass[kSampleBuckets - 1],
                     __ldcg(&st->best_race), scratch, ds);
        }
    }
    __syncthreads();  // every thread has read the state zeroed below
    if (threadIdx.x == 0) {
        write_result(a, rec->seq_slot, __ldcg(&st->input), r);
        st->best_z = 0, st->best_race = 0, st->bad = 0, st->ticket = 0;
    }
    st->hist_count[threadIdx.x] = 0, st->hist_mass[threadIdx.x] = 0;
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
        err = launch_kernel(sample_select_kernel, dim3(blocks), dim3(kSampleThreads), 0, stream,
                            pdl, args);
    return err;
}

}  // namespace og
