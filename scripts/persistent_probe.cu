// persistent_probe.cu — what does one dense transformer layer cost at batch 1 when the whole
// token's layer loop runs as ONE persistent kernel (one block per SM, dependencies between phases
// as counters in global memory, each phase's weights loaded into registers before the block waits
// on its counter), as TWO kernels a layer whose inner dependencies stay inside thread block
// clusters, or as FOUR kernels a layer with the attention computed again inside every block of the
// O projection or by the last blocks of the QKV projection, or with the down projection inside
// the gate/up kernel or the O projection inside the attention kernel, against the same phases as
// five kernels a layer chained with PDL in a CUDA graph?
// Standalone experiment, not part of the library.
//
//   build: nvcc -arch=sm_90 -O3 -std=c++17 -o /tmp/persistent_probe scripts/persistent_probe.cu
//   run:   /tmp/persistent_probe                       (both shapes, context 64, 200 replays)
//          /tmp/persistent_probe --context 64,512 --trace --json /tmp/persistent_probe.json
//          /tmp/persistent_probe --calibrate           (what a kernel boundary costs alone)
//          options: --shape smollm2|qwen3-0.6b|both  --context C[,C...]  --iters N  --json PATH
//                   --trace (one extra replay a variant with per-block %globaltimer stamps; prints
//                   per phase the hand-over, the median block's start minus the last block's end
//                   of the phase before, and the work, the last end minus that start; then the
//                   first / median / last block's start and end; for the clustered variants the
//                   median and last block at each point of the two kernels)
//                   --calibrate (graphs of 150 chained kernels with no weights: one that only
//                   waits, and one that reads the previous kernel's output from L2, reduces it
//                   over the block and writes one element; µs a kernel per grid size)
//
// Shapes (layers only: no embedding, no lm_head; the residual stream x [hidden] fp32 is the input
// and the output; bf16 weights uniform in +-0.05 and RMSNorm weights 1 +- 0.05 from a fixed-seed
// hash, generated on the device; RMSNorm eps 1e-6; RoPE theta 1e6, rotate-half as Qwen/Llama):
//   smollm2:    hidden 576,  9 q heads, 3 KV heads, head_dim  64, intermediate 1536, 30 layers
//   qwen3-0.6b: hidden 1024, 16 q heads, 8 KV heads, head_dim 128, intermediate 3072, 28 layers,
//               QK-norm (RMSNorm over head_dim on q and k, a per-layer weight each)
// KV cache: per layer, K and V each [C + 1][n_kv][head_dim] bf16, rows 0..C-1 filled (uniform
// +-1); the step is at position C: it writes row C and attends over C + 1 rows.
//
// Phases of a layer, each written ONCE as __device__ code over a range of work items:
//   (a) RMSNorm(x), QKV GEMV      rows (n_heads + 2 n_kv) * head_dim     -> qkv
//   (b) per (query head, split):  QK-norm, RoPE at position C, K/V row C (written once per KV
//       head), scores, softmax (fp32), weighted V; several splits fold in the last one to finish
//   (c) O GEMV + residual         rows hidden, cols n_heads * head_dim    -> x
//   (d) RMSNorm(x), gate & up GEMVs, SwiGLU  (gate row i, up row i) per task -> act [intermediate]
//   (e) down GEMV + residual      rows hidden, cols intermediate          -> x
// Variants, all replaying the whole token as one CUDA graph:
//   baseline             5 kernels a layer; each has the PDL attribute and issues its weight loads
//                        (attention: its K/V rows 0..C-1) before griddepcontrol.wait
//   persistent           1 cooperative kernel, grid = SM count, 8 warps a block; between phases
//                        a block waits on the finest counter that is correct: head h's attention
//                        waits for the QKV rows of its KV group (q of the group's heads, its k, v),
//                        the O GEMV for all heads, gate/up for all O rows, down for all of act,
//                        the next layer's QKV for all down rows
//   persistent_barrier   the same kernel with a grid-wide barrier between phases instead: one
//                        counter, every block arrives after and waits before every phase (weights
//                        still loaded before the wait)
//   clusters_8, _16      two kernels a layer (section (D) below): attention block and FFN block,
//                        each cluster of 8 or 16 blocks keeping its dependencies inside it, the O
//                        and down projections split over K with the partial sums taken by the next
//                        kernel; weights into shared memory by cp.async before the PDL wait
//   o_attn               4 kernels a layer (section (E)): QKV, then an O projection whose every
//                        block first computes the whole step's attention itself (K/V rows 0..C-1
//                        in its shared memory, copied before the PDL wait), then gate/up, down; run
//                        where those rows fit in one block's shared memory (a short context)
//   o_attn_gated         o_attn with an attention kernel left between QKV and O that ends at once
//                        (attention_gate_kernel): a graph that serves long contexts as well
//   qkv_attn             4 kernels a layer (section (F)): the QKV kernel's last blocks, once the
//                        QKV rows of their KV group are written (a counter a group), each compute
//                        one attention item; then O, gate/up, down; run where the items are no
//                        more than the QKV grid's blocks
//   ffn_red, ffn_red_l2  4 kernels a layer (section (G)): QKV, attention, O, and one FFN kernel
//                        whose warps multiply each act[i] they compute by w_down's column i at
//                        once; a block's partial sums go to a fixed-point residual by integer
//                        atomic adds (deterministic in any order); _l2: the down weights wait in
//                        L2, not registers, during the gate/up dot products; _x8: the residual in
//                        8 copies that its readers add up, so that 8 times the L2 lines take the adds
//   attn_o               4 kernels a layer (section (H)): QKV, then attention and O in one kernel
//                        (each block one head's whole attention and a slice of the O rows for that
//                        head's columns; the next kernels add the heads' shares where they read
//                        the residual), gate/up, down; run where one split covers the context;
//                        _red: the O rows added to a fixed-point residual by integer atomics instead
//   qkv_local            4 kernels a layer (section (I)): one block a query head computes that
//                        head's q and its KV head's k and v itself (weights in registers and shared
//                        memory before the PDL wait), then the head's attention: no hand-over
//                        between the QKV rows and the attention; run where one split covers the
//                        context
// GEMV work: a task is one row (two for gate/up: gate i and up i share x), one warp a task, 16-byte
// loads, lane l takes 16-byte chunks l, l + 32, ... of the row, fp32 fma in chunk order, then a
// shuffle butterfly. Tasks go round-robin over all warps of the grid (task t -> warp t mod warps);
// the baseline GEMV kernels use the same grid (SM count, fewer when a matrix has fewer rows) and
// so the same dealing. A warp holds up to four tasks of a phase in registers (the depth is sized
// for 132 SMs; tasks beyond it, on a smaller GPU, are loaded after the wait).
//
// What it prints: per shape and context, the D2D copy bandwidth (1 GiB cudaMemcpyAsync, bytes read
// + written), the bytes a layer reads and writes (weights, norm weights, K/V rows read and the
// row written), the floor a layer = bytes / bandwidth, and per variant: µs a token, µs a layer,
// floor / layer time, baseline / variant. Then the checks: the first three variants' and
// qkv_attn's and qkv_local's x and K/V row C bit-identical (memcmp); every variant stable over the timed replays
// and within a relative L2 error of 1e-3 of a CPU reference (fp64 host loop over all layers); the
// clustered variants sum the O and down projections in another order, o_attn the attention,
// ffn_red the down projection and attn_o the O projection, so they are held to the reference only.
// PASS/FAIL; exit code 1 on any failure. A clustered variant that cannot place one cluster is
// not run (said so in the output).
//
// Why the outputs are bit-identical: every output element is computed by the same code with the
// same reduction order in all variants (per-row chunk order and butterfly; RMSNorm sums by each
// warp in lane-strided order; attention reductions over a fixed 256-thread block; splits folded in
// split order). Arithmetic on that path uses __fmaf_rn/__fmul_rn/__fadd_rn so the compiler cannot
// contract or reorder differently in different kernels.
//
// Design notes and caveats:
// - Deadlock. Spinning blocks wait for blocks that must be running, so the persistent kernel
//   needs all its blocks resident at once. It is launched cooperative (the launch fails rather
//   than running partially resident), with one block per SM after a
//   cudaOccupancyMaxActiveBlocksPerMultiprocessor check that refuses with a message. Every wait
//   targets work of an earlier phase in program order ((a) of layer l on (e) of l-1, (b) on (a),
//   (c) on (b), (d) on (c), (e) on (d)), so there is no cycle. A block with no work in a phase
//   neither waits nor signals there (it goes straight to prefetching the next phase), which keeps
//   every counter's producers exactly the blocks that do the work. As a last guard, a wait that
//   spins for 2 s sets an abort flag, every later wait returns at once, the kernel ends, and the
//   host reports FAIL instead of hanging. Another process's kernels on the same GPU (MPS, a second
//   stream) cannot make it deadlock, only make the cooperative launch fail.
// - Signals and waits are cooperative groups' grid-sync pattern at GPU scope: the producer block
//   does __syncthreads, then one thread fence.acq_rel + a relaxed red.add; the consumer's thread 0
//   polls with relaxed loads, then fence.acq_rel, then __syncthreads. Data written by other blocks
//   is read with ld.global.cg (__ldcg), so no stale L1 line from an earlier layer is used.
// - Reuse hazards. qkv, attn, act, x and the split partials are reused by every layer; a writer
//   of layer l + 1 is ordered after every reader of layer l through the chain of counters above
//   (each block signals after its last read of its inputs; every phase's counter needs all
//   producers of the phase before, and every buffer's readers are among them).
// - In the barrier variant a block must wait at every barrier, work or not: with one counter, a
//   block that only arrived could run ahead and add its arrival for a later phase to the count
//   an earlier phase's waiters are watching.
// - Counters are never reset: a launch reads the step epoch (incremented by the last block to
//   leave), and its targets are (epoch * layers + layer + 1) * per-layer count, compared
//   wrap-safe. Attention split tickets grow by the split count each layer: the last split is the
//   one whose ticket is split-count - 1 modulo the split count. Each variant has its own counters.
// - Replays are honest: layer 0 reads x_in (never written) for its RMSNorm and its O residual, so
//   every replay computes the same token; row C of the K/V cache is rewritten identically.
// - The KV row C the step writes is never read back from memory in the step: each head uses the
//   bf16-rounded k/v it computed (as a decode step reading back its own row would).
// - Registers: the persistent kernel holds one phase's tasks (plus, during the attention, the next
//   O rows and the K/V batch); it prints its register count and local (spill) bytes. The
//   prefetch arrays are defined on every path (zeros past the last task): a conditionally
//   assigned array is loop-carried and keeps every phase's registers live at once. The K/V batch
//   (4 rows a lane group: 64 rows a split at head_dim 128, 128 at 64) is what keeps qwen3-0.6b's
//   kernel at 255 registers or fewer without spills; longer contexts take more splits.
// - Not modelled: the embedding, the final norm and lm_head, the per-step H2D/D2H copies, paged KV.
#include <cuda_bf16.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "probe_common.cuh"

using probe::capture_graph;
using probe::copy_bandwidth;
using probe::elapsed_ms;
using probe::pdl_launch_dependents;
using probe::pdl_wait;
using probe::bf_hi;
using probe::bf_lo;
using probe::dot8;
using probe::warp_sum;

namespace cg = cooperative_groups;

namespace {

constexpr int kWarpSize = 32;
constexpr int kWarps = 8;                      // warps a block, in every kernel (the attention's
constexpr int kThreads = kWarps * kWarpSize;   // block reductions depend on it)
constexpr int kAssumedSms = 132;               // an H200: sizes the register prefetch depth only
constexpr int kMaxPrefetch = 4;                // tasks a warp holds in registers before a wait
constexpr int kAttnBatch = 4;                  // K/V rows a lane group holds (one load round trip)
constexpr float kEps = 1e-6f;
constexpr double kRopeTheta = 1e6;
constexpr unsigned long long kWaitTimeoutNs = 2000000000ull;

struct SmolLM2 {
    static constexpr const char *kName = "smollm2";
    static constexpr int H = 576, NH = 9, NKV = 3, HD = 64, I = 1536, L = 30;
    static constexpr bool QKN = false;
};
struct Qwen3_06B {
    static constexpr const char *kName = "qwen3-0.6b";
    static constexpr int H = 1024, NH = 16, NKV = 8, HD = 128, I = 3072, L = 28;
    static constexpr bool QKN = true;
};

constexpr int cmax(int a, int b) { return a > b ? a : b; }
constexpr int prefetch_depth(int tasks) {
    const int per_warp = (tasks + kAssumedSms * kWarps - 1) / (kAssumedSms * kWarps);
    return per_warp < kMaxPrefetch ? per_warp : kMaxPrefetch;
}

template <class S>
struct Dims {
    static constexpr int GRP = S::NH / S::NKV;               // query heads a KV head serves
    static constexpr int ATT = S::NH * S::HD;                // attention output = O GEMV columns
    static constexpr int QKV = (S::NH + 2 * S::NKV) * S::HD; // QKV rows: q heads, k heads, v heads
    static constexpr int GROUP_ROWS = (GRP + 2) * S::HD;     // QKV rows one KV group's heads need
    static constexpr int XMAX = cmax(cmax(S::H, ATT), S::I); // widest GEMV input
    // attention: lanes a K/V row (16-byte chunks), rows a warp pass, rows a block batch
    static constexpr int LPR = S::HD / 8, RPI = kWarpSize / LPR, RB = kWarps * RPI * kAttnBatch;
    static_assert(S::NH % S::NKV == 0, "GQA groups");
    static_assert(S::HD % 8 == 0 && LPR <= kWarpSize && S::HD <= kThreads, "head_dim");
    static_assert(S::H % 8 == 0 && ATT % 8 == 0 && S::I % 8 == 0, "16-byte rows");
};

// ---- model and activations (device pointers; bf16 stored as its 16 bits) --------------------
struct Model {
    const uint16_t *ln_in, *ln_post;   // [L][H]
    const uint16_t *q_norm, *k_norm;   // [L][HD] (QK-norm shapes)
    const uint16_t *w_qkv;             // [L][QKV][H]
    const uint16_t *w_o;               // [L][H][ATT]
    const uint16_t *w_gu;              // [L][2I][H]: gate rows 0..I-1, up rows I..2I-1
    const uint16_t *w_down;            // [L][H][I]
    uint16_t *k_cache, *v_cache;       // [L][max_ctx][NKV][HD]
    const float *rope_cos, *rope_sin;  // [HD / 2] at position ctx
    int ctx, max_ctx;                  // C rows cached, max_ctx = C + 1
    int splits, split_rows;            // attention splits a head, rows a split (<= Dims::RB)
    const uint16_t *w_down_t;          // [L][I][H] w_down transposed (ffn_red: row i = column i)
};
struct Acts {
    const float *x_in;   // [H] the step's input, never written
    float *x;            // [H] the residual stream, the output
    float *qkv;          // [QKV]
    float *attn;         // [ATT]
    float *act;          // [I]
    float *part_o;       // [NH * splits][HD] attention split partials
    float *part_ml;      // [NH * splits][2]  their max and sum
    unsigned long long *trace;   // --trace: [L][5 phases][kTraceBlocks][2] %globaltimer, or null
    // the clustered body only:
    float *x_res;        // [H] the attention block's input x, the FFN block's residual
    float *qkvh;         // [NH][3 head_dim] each query head's q and its KV head's k, v
    float *attn_part;    // [NH][H] each head's share of the O projection
    float *ffn_part;     // [clusters][H] each FFN cluster's share of the down projection
    // ffn_red only:
    unsigned long long *xq;   // [kMaxCopies][H] the residual stream in fixed point (two's complement,
                              // 2^-32 units): the sum of its first K copies
};
struct Sync {            // one per variant, zeroed once
    unsigned epoch, exit, heads, o, act, down, bar, abort;
    unsigned group[16];
    unsigned tickets[32];
};

// ---- small device helpers -----------------------------------------------------------------
__device__ __forceinline__ unsigned long long globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// --trace: thread 0 stamps when its block starts a phase's work (after its wait, k = 0) and when
// it is done with it (after its signal, or its end in the baseline, k = 1). The timed graphs pass
// a null pointer and skip it.
constexpr int kTraceBlocks = 1024;
__device__ __forceinline__ void trace(const Acts &a, int l, int phase, int k) {
    if (a.trace != nullptr && threadIdx.x == 0)
        a.trace[(((size_t)l * 5 + phase) * kTraceBlocks + blockIdx.x) * 2 + k] = globaltimer();
}
// The clustered variants' trace: [L][kStamps][kTraceBlocks] %globaltimer, a stamp a point of each
// kernel (fused_*_kernel: kStampAttn* in the attention kernel, kStampFfn* in the FFN kernel).
enum Stamp { kStampAttnEntry, kStampAttnWait, kStampAttnStaged, kStampAttnQkv, kStampAttnHeads, kStampAttnEnd,
             kStampFfnEntry, kStampFfnWait, kStampFfnStaged, kStampFfnAct, kStampFfnGather, kStampFfnEnd, kStamps };
__device__ __forceinline__ void stamp(const Acts &a, int l, int point) {
    if (a.trace != nullptr && threadIdx.x == 0)
        a.trace[((size_t)l * kStamps + point) * kTraceBlocks + blockIdx.x] = globaltimer();
}
__device__ __forceinline__ float bf(uint16_t v) { return __uint_as_float((unsigned)v << 16); }
__device__ __forceinline__ uint16_t to_bf(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }

__device__ __forceinline__ void unpack8(uint4 w, float (&f)[8]) {
    f[0] = bf_lo(w.x), f[1] = bf_hi(w.x), f[2] = bf_lo(w.y), f[3] = bf_hi(w.y);
    f[4] = bf_lo(w.z), f[5] = bf_hi(w.z), f[6] = bf_lo(w.w), f[7] = bf_hi(w.w);
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// RMSNorm's 1 / rms from a sum of n squares.
__device__ __forceinline__ float inv_rms(float sum_sq, int n) {
    return __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, (float)n), kEps)));
}
// Rotate-half RoPE of element x (partner p = x[t +- HD/2]): x cos - p sin in the first half,
// x cos + p sin in the second.
__device__ __forceinline__ float rope_half(float x, float p, float c, float sn, bool first_half) {
    return first_half ? __fsub_rn(__fmul_rn(x, c), __fmul_rn(p, sn)) : __fadd_rn(__fmul_rn(x, c), __fmul_rn(p, sn));
}

// Release / acquire at GPU scope as cooperative groups' grid sync does it: a relaxed poll, then a
// fence.acq_rel once it has seen the target; the producer's fence.acq_rel before its relaxed add.
__device__ __forceinline__ unsigned ld_relaxed(const unsigned *p) {
    unsigned v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void fence_acq_rel() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void red_add(unsigned *p, unsigned v) {
    asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// ffn_red's residual in fixed point: units of 2^-32, two's complement in 64 bits (|x| < 2^31).
// Integer adds commute, so the blocks' partial sums land in any order with the same result.
__device__ __forceinline__ unsigned long long to_fixed(float v) {
    return (unsigned long long)__float2ll_rn(__fmul_rn(v, 4294967296.f));
}
__device__ __forceinline__ float from_fixed(unsigned long long q) {
    return __fmul_rn(__ll2float_rn((long long)q), 2.3283064365386963e-10f);   // one rounding, then exact
}
__device__ __forceinline__ void red_add_u64(unsigned long long *p, unsigned long long v) {
    asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// The residual xq holds K copies, [K][H]: the FFN's blocks add to copy blockIdx % K, so that K
// times as many L2 lines take the atomic adds. Element i is the integer sum of its copies.
constexpr int kMaxCopies = 8;
template <int K>
__device__ __forceinline__ float xq_value(const unsigned long long *xq, int i, int h) {
    unsigned long long q = 0;
#pragma unroll
    for (int c = 0; c < K; ++c) q += __ldcg(xq + (size_t)c * h + i);
    return from_fixed(q);
}
// Counters only grow (mod 2^32): "reached" compares wrap-safe.
__device__ __forceinline__ bool reached(unsigned value, unsigned target) { return (int)(value - target) >= 0; }

// The block waits until *counter reaches target: thread 0 polls, fences (acquire), and the block
// barrier releases the rest (bar.sync orders their later reads after thread 0's acquire). A poll longer than kWaitTimeoutNs (a bug, never a legal wait) raises the abort
// flag; with it raised every wait returns, so the kernel always ends.
__device__ void block_wait(const unsigned *counter, unsigned target, unsigned *abort_flag) {
    if (threadIdx.x == 0 && !reached(ld_relaxed(counter), target)) {
        const unsigned long long t0 = globaltimer();
        for (unsigned spin = 1; !reached(ld_relaxed(counter), target); ++spin) {
            if ((spin & 1023u) == 0) {
                if (*(volatile unsigned *)abort_flag) break;
                if (globaltimer() - t0 > kWaitTimeoutNs) {
                    atomicExch(abort_flag, 1u);
                    break;
                }
            }
        }
    }
    if (threadIdx.x == 0) fence_acq_rel();
    __syncthreads();
}
// After the block's writes (and its last reads of its inputs): counter += n, ordered after them
// (the block barrier, then a release fence by the thread that adds; fences are cumulative).
__device__ __forceinline__ void block_signal(unsigned *counter, unsigned n) {
    __syncthreads();
    if (threadIdx.x == 0 && n > 0) {
        fence_acq_rel();
        red_add(counter, n);
    }
}

// ---- GEMV phases ------------------------------------------------------------------------------
enum PhaseId { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3, kDownT = 4 };

template <class S, int P> struct Gemv;
template <class S> struct Gemv<S, kQkv> {
    static constexpr int COLS = S::H, NR = 1, TASKS = Dims<S>::QKV;
    static constexpr bool NORM = true;
};
template <class S> struct Gemv<S, kO> {
    static constexpr int COLS = Dims<S>::ATT, NR = 1, TASKS = S::H;
    static constexpr bool NORM = false;
};
template <class S> struct Gemv<S, kGateUp> {
    static constexpr int COLS = S::H, NR = 2, TASKS = S::I;
    static constexpr bool NORM = true;
};
template <class S> struct Gemv<S, kDown> {
    static constexpr int COLS = S::I, NR = 1, TASKS = S::H;
    static constexpr bool NORM = false;
};
// ffn_red: w_down's column i as a row of H, one a gate/up task (task i's act times that row)
template <class S> struct Gemv<S, kDownT> {
    static constexpr int COLS = S::H, NR = 1, TASKS = S::I;
};

// One task's rows, as each lane holds them: U 16-byte chunks a row.
template <int COLS, int NR>
struct Task {
    static constexpr int kChunks = COLS / 8, U = (kChunks + kWarpSize - 1) / kWarpSize;
    uint4 w[NR][U];
};
template <class S, int P> using TaskOf = Task<Gemv<S, P>::COLS, Gemv<S, P>::NR>;

// A warp's first R tasks of a phase (tasks first, first + stride, ...), loaded before its wait.
// prefetch() defines every element (zeros past the last task): a conditionally assigned array
// would carry its old values around the layer loop and keep all phases' arrays live at once.
template <class S, int P>
struct Prefetch {
    static constexpr int R = prefetch_depth(Gemv<S, P>::TASKS);
    TaskOf<S, P> t[R];
};

template <class S, int P>
__device__ __forceinline__ const uint16_t *weights(const Model &m, int l) {
    using G = Gemv<S, P>;
    const size_t per_layer = (size_t)G::TASKS * G::NR * G::COLS;
    const uint16_t *base = P == kQkv     ? m.w_qkv
                           : P == kO     ? m.w_o
                           : P == kGateUp ? m.w_gu
                           : P == kDown  ? m.w_down
                                         : m.w_down_t;
    return base + (size_t)l * per_layer;
}

template <class S, int P>
__device__ __forceinline__ void load_task(TaskOf<S, P> &t, const uint16_t *w, int task, int lane) {
    using G = Gemv<S, P>;
    using T = TaskOf<S, P>;
#pragma unroll
    for (int r = 0; r < G::NR; ++r) {
        const uint4 *row = reinterpret_cast<const uint4 *>(w + (size_t)(task + r * G::TASKS) * G::COLS);
#pragma unroll
        for (int u = 0; u < T::U; ++u) {
            const int c = lane + u * kWarpSize;
            t.w[r][u] = c < T::kChunks ? __ldcs(row + c) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

template <class S, int P>
__device__ __forceinline__ void prefetch(Prefetch<S, P> &pf, const Model &m, int l, int first, int stride,
                                         int lane) {
    const uint16_t *w = weights<S, P>(m, l);
#pragma unroll
    for (int k = 0; k < Prefetch<S, P>::R; ++k) {
        const int task = first + k * stride;
        if (task < Gemv<S, P>::TASKS) {
            load_task<S, P>(pf.t[k], w, task, lane);
        } else {
#pragma unroll
            for (int r = 0; r < Gemv<S, P>::NR; ++r)
#pragma unroll
                for (int u = 0; u < TaskOf<S, P>::U; ++u) pf.t[k].w[r][u] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// The task's rows times x (staged in shared memory, [COLS] fp32): lane chunks in order, then the
// butterfly. x reads: a quarter-warp's 8 lanes read 8 chunks of 32 bytes in two 16-byte halves;
// lanes 4..7 of each quarter take the halves in the other order (no bank conflicts), and the
// arithmetic order is the same for every lane.
template <int COLS, int NR>
__device__ __forceinline__ void dot_task(const Task<COLS, NR> &t, const float *xs, int lane, float (&acc)[NR]) {
    using T = Task<COLS, NR>;
    const float4 *xs4 = reinterpret_cast<const float4 *>(xs);
    const int swap = (lane >> 2) & 1;
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.f;
#pragma unroll
    for (int u = 0; u < T::U; ++u) {
        const int c = lane + u * kWarpSize;
        if (c < T::kChunks) {
            const float4 h0 = xs4[2 * c + swap], h1 = xs4[2 * c + 1 - swap];
            const float4 xa = swap ? h1 : h0, xb = swap ? h0 : h1;
#pragma unroll
            for (int r = 0; r < NR; ++r) acc[r] = dot8(t.w[r][u], xa, xb, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = warp_sum(acc[r]);
}

// A task's result (lane 0): QKV row; O row + residual (layer 0's residual is x_in); SwiGLU of the
// gate and up rows; down row + residual. XQ > 0 (ffn_red, XQ copies of xq): the O row's residual
// is xq, and the sum goes to x (the FFN's norm input) and to xq's first copy, the others zeroed
// (the FFN kernel adds the down projection to them).
// The attention block's output plus the O projection, as attn_o leaves it: the residual before
// the O projection (layer 0: x_in) plus each head's share, in head order.
template <class S>
__device__ __forceinline__ float x_mid(const Acts &a, int l, int i) {
    float v = __ldcg((l == 0 ? a.x_in : a.x) + i);
#pragma unroll
    for (int h = 0; h < S::NH; ++h) v = __fadd_rn(v, __ldcg(a.attn_part + (size_t)h * S::H + i));
    return v;
}
// OP (attn_o): kOpParts, the down row's residual is x_mid; kOpFixed, it is xq, and the sum goes
// back to xq.
enum OpMode { kOpNone = 0, kOpParts = 1, kOpFixed = 2 };
template <class S, int P, int XQ = 0, int OP = kOpNone>
__device__ __forceinline__ void emit(const Acts &a, int l, int task, const float (&acc)[Gemv<S, P>::NR]) {
    if constexpr (P == kDown && OP == kOpParts) {
        a.x[task] = __fadd_rn(x_mid<S>(a, l, task), acc[0]);
    } else if constexpr (P == kDown && OP == kOpFixed) {
        a.xq[task] = to_fixed(__fadd_rn(from_fixed(__ldcg(a.xq + task)), acc[0]));
    } else if constexpr (P == kQkv) {
        a.qkv[task] = acc[0];
    } else if constexpr (P == kO && XQ > 0) {
        const float res = l == 0 ? __ldg(a.x_in + task) : xq_value<XQ>(a.xq, task, S::H);
        const float v = __fadd_rn(res, acc[0]);
        a.x[task] = v;
        a.xq[task] = to_fixed(v);
#pragma unroll
        for (int c = 1; c < XQ; ++c) a.xq[(size_t)c * S::H + task] = 0ull;
    } else if constexpr (P == kO) {
        const float *res = l == 0 ? a.x_in : a.x;
        a.x[task] = __fadd_rn(__ldcg(res + task), acc[0]);
    } else if constexpr (P == kGateUp) {
        const float g = acc[0];
        const float silu = __fdiv_rn(g, __fadd_rn(1.f, expf(-g)));
        a.act[task] = __fmul_rn(silu, acc[1]);
    } else {
        a.x[task] = __fadd_rn(__ldcg(a.x + task), acc[0]);
    }
}

// All of a warp's tasks of a phase: the prefetched ones, then any beyond the prefetch depth.
template <class S, int P, int XQ = 0, int OP = kOpNone>
__device__ __forceinline__ void gemv_tasks(const Prefetch<S, P> &pf, const Model &m, const Acts &a, int l,
                                           int first, int stride, int lane, const float *xs) {
    using G = Gemv<S, P>;
    float acc[G::NR];
#pragma unroll
    for (int k = 0; k < Prefetch<S, P>::R; ++k) {
        const int task = first + k * stride;
        if (task < G::TASKS) {
            dot_task(pf.t[k], xs, lane, acc);
            if (lane == 0) emit<S, P, XQ, OP>(a, l, task, acc);
        }
    }
    const uint16_t *w = weights<S, P>(m, l);
    for (int task = first + Prefetch<S, P>::R * stride; task < G::TASKS; task += stride) {
        TaskOf<S, P> t;
        load_task<S, P>(t, w, task, lane);
        dot_task(t, xs, lane, acc);
        if (lane == 0) emit<S, P, XQ, OP>(a, l, task, acc);
    }
}

// RMSNorm weights a thread needs (elements t, t + 256, ...), loaded before the wait.
template <int N>
struct Gamma {
    float g[(N + kThreads - 1) / kThreads];
};
template <int N>
__device__ __forceinline__ void load_gamma(Gamma<N> &g, const uint16_t *w) {
#pragma unroll
    for (int k = 0; k < (N + kThreads - 1) / kThreads; ++k) {
        const int i = threadIdx.x + k * kThreads;
        g.g[k] = i < N ? bf(__ldg(w + i)) : 0.f;
    }
}

// xs = RMSNorm(raw) * gamma, raw staged and visible to the block. Every warp sums the squares
// itself in lane-strided order, so all threads hold the same 1/rms without a block reduction, and
// it does not depend on the block.
template <int N>
__device__ __forceinline__ void norm_raw(const Gamma<N> &g, const float *raw, float *xs) {
    float ss = 0.f;
    for (int i = threadIdx.x % kWarpSize; i < N; i += kWarpSize) ss = __fmaf_rn(raw[i], raw[i], ss);
    ss = warp_sum(ss);
    const float inv = inv_rms(ss, N);
#pragma unroll
    for (int k = 0; k < (N + kThreads - 1) / kThreads; ++k) {
        const int i = threadIdx.x + k * kThreads;
        if (i < N) xs[i] = __fmul_rn(__fmul_rn(raw[i], inv), g.g[k]);
    }
    __syncthreads();
}
// xs = RMSNorm(src) * gamma.
template <int N>
__device__ __forceinline__ void stage_norm(const float *src, const Gamma<N> &g, float *raw, float *xs) {
#pragma unroll 4
    for (int i = threadIdx.x; i < N; i += kThreads) raw[i] = __ldcg(src + i);
    __syncthreads();
    norm_raw(g, raw, xs);
}
template <int N, int K>
__device__ __forceinline__ void stage_norm_fixed(const unsigned long long *src, const Gamma<N> &g, float *raw,
                                                 float *xs) {
#pragma unroll 4
    for (int i = threadIdx.x; i < N; i += kThreads) raw[i] = xq_value<K>(src, i, N);
    __syncthreads();
    norm_raw(g, raw, xs);
}
template <class S>
__device__ __forceinline__ void stage_norm_mid(const Acts &a, int l, const Gamma<S::H> &g, float *raw, float *xs) {
#pragma unroll 4
    for (int i = threadIdx.x; i < S::H; i += kThreads) raw[i] = x_mid<S>(a, l, i);
    __syncthreads();
    norm_raw(g, raw, xs);
}
template <int N>
__device__ __forceinline__ void stage_plain(const float *src, float *xs) {
    __syncthreads();   // xs may still be read by the block's previous phase
#pragma unroll 4
    for (int i = threadIdx.x; i < N; i += kThreads) xs[i] = __ldcg(src + i);
    __syncthreads();
}

// ---- attention phase ------------------------------------------------------------------------
template <class S>
struct Smem {
    alignas(16) float raw[S::H];               // RMSNorm input
    alignas(16) float xs[Dims<S>::XMAX];       // the GEMV input
    alignas(16) float q[S::HD];                // this head's q after QK-norm and RoPE
    float q_raw[S::HD], k_raw[S::HD];
    alignas(16) uint16_t k_new[S::HD];         // row C's k and v, bf16 as the cache holds them
    alignas(16) uint16_t v_new[S::HD];
    alignas(16) float part[kWarps][S::HD];     // warps' weighted V sums
    float scores[Dims<S>::RB];
    float red[2][kWarps];
    unsigned last;
};

// What an attention item loads before its wait: its K/V rows below C (a step never writes them),
// and per thread t < head_dim the QK-norm weights of t and its RoPE partner, and the rotation.
template <class S>
struct AttnRegs {
    uint4 k[kAttnBatch], v[kAttnBatch];
    float qn_t, qn_p, kn_t, kn_p, cos_t, sin_t;
};

// Split s of head h covers rows [s * split_rows, min(C + 1, (s + 1) * split_rows)). Lane group
// `sub` of warp w takes rows i = k * (8 * RPI) + w * RPI + sub of the split, k < kAttnBatch.
template <class S>
__device__ __forceinline__ void attn_prefetch(AttnRegs<S> &r, const Model &m, int l, int h, int s) {
    using D = Dims<S>;
    const int t = threadIdx.x, warp = t / kWarpSize, lane = t % kWarpSize;
    const int sub = lane / D::LPR, part = lane % D::LPR, g = h / D::GRP;
    const int j0 = s * m.split_rows, j1 = min(m.ctx + 1, j0 + m.split_rows);
    const size_t row_stride = (size_t)S::NKV * S::HD;
    const size_t base = (size_t)l * m.max_ctx * row_stride + (size_t)g * S::HD + part * 8;
#pragma unroll
    for (int k = 0; k < kAttnBatch; ++k) {
        const int j = j0 + k * (kWarps * D::RPI) + warp * D::RPI + sub;
        if (j < j1 && j < m.ctx) {
            r.k[k] = __ldg(reinterpret_cast<const uint4 *>(m.k_cache + base + (size_t)j * row_stride));
            r.v[k] = __ldg(reinterpret_cast<const uint4 *>(m.v_cache + base + (size_t)j * row_stride));
        } else {
            r.k[k] = r.v[k] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    r.qn_t = r.qn_p = r.kn_t = r.kn_p = r.cos_t = r.sin_t = 0.f;
    if (t < S::HD) {
        constexpr int half = S::HD / 2;
        const int p = t < half ? t + half : t - half;
        if constexpr (S::QKN) {
            r.qn_t = bf(__ldg(m.q_norm + l * S::HD + t));
            r.qn_p = bf(__ldg(m.q_norm + l * S::HD + p));
            r.kn_t = bf(__ldg(m.k_norm + l * S::HD + t));
            r.kn_p = bf(__ldg(m.k_norm + l * S::HD + p));
        }
        r.cos_t = __ldg(m.rope_cos + t % half);
        r.sin_t = __ldg(m.rope_sin + t % half);
    }
}

// Head h's output element t from its splits' partials (written by other blocks: read from L2),
// folded in split order.
template <class S>
__device__ __forceinline__ float fold_splits(const Acts &a, int h, int splits, int t) {
    float big = -INFINITY;
    for (int sp = 0; sp < splits; ++sp) big = fmaxf(big, __ldcg(a.part_ml + 2 * (h * splits + sp)));
    float total = 0.f, out = 0.f;
    for (int sp = 0; sp < splits; ++sp) {
        const int it = h * splits + sp;
        const float e = expf(__fsub_rn(__ldcg(a.part_ml + 2 * it), big));
        total = __fmaf_rn(__ldcg(a.part_ml + 2 * it + 1), e, total);
        out = __fmaf_rn(__ldcg(a.part_o + (size_t)it * S::HD + t), e, out);
    }
    return __fdiv_rn(out, total);
}

// fold_splits with every load in flight at once (splits <= MAXS), the same arithmetic in the same
// order; the clustered body's blocks fold CS or more splits, where a loop's dependent loads cost a
// round trip to L2 each.
template <class S, int MAXS>
__device__ __forceinline__ float fold_splits_batched(const Acts &a, int h, int splits, int t) {
    float mx[MAXS], sm[MAXS], po[MAXS];
#pragma unroll
    for (int sp = 0; sp < MAXS; ++sp) {
        const int it = h * splits + sp;
        const bool in = sp < splits;
        mx[sp] = in ? __ldcg(a.part_ml + 2 * it) : -INFINITY;
        sm[sp] = in ? __ldcg(a.part_ml + 2 * it + 1) : 0.f;
        po[sp] = in ? __ldcg(a.part_o + (size_t)it * S::HD + t) : 0.f;
    }
    float big = -INFINITY;
#pragma unroll
    for (int sp = 0; sp < MAXS; ++sp)
        if (sp < splits) big = fmaxf(big, mx[sp]);
    float total = 0.f, out = 0.f;
#pragma unroll
    for (int sp = 0; sp < MAXS; ++sp) {
        if (sp < splits) {
            const float e = expf(__fsub_rn(mx[sp], big));
            total = __fmaf_rn(sm[sp], e, total);
            out = __fmaf_rn(po[sp], e, out);
        }
    }
    return __fdiv_rn(out, total);
}

// One (head, split) item, the whole block. Returns true (block-uniform) when this call completed
// head h's output: always with one split; with several, only in the last split to finish, which
// folds the partials of all splits in split order.
// q_src, k_src, v_src: head h's q and its KV head's k and v, [head_dim] each. fold = false (the
// clustered body): a split only writes its partial; the cluster folds them after its barrier.
// out_smem (attn_o, one split): the head's output goes there instead of to attn; write_kv = false:
// another block of the same head writes row C.
template <class S, class Sm>
__device__ bool attention_core(const AttnRegs<S> &r, const Model &m, const Acts &a, unsigned *tickets, int l,
                               int h, int s, Sm &sm, const float *q_src, const float *k_src,
                               const float *v_src, bool fold, float *out_smem = nullptr, bool write_kv = true,
                               bool src_shared = false) {
    using D = Dims<S>;
    constexpr int HD = S::HD, half = HD / 2;
    const int t = threadIdx.x, warp = t / kWarpSize, lane = t % kWarpSize;
    const int sub = lane / D::LPR, part = lane % D::LPR, g = h / D::GRP;
    const int j0 = s * m.split_rows, j1 = min(m.ctx + 1, j0 + m.split_rows), n = j1 - j0;

    // 1. this step's q (head h), k and v (KV head g), from the QKV GEMV (qkv_local: from the
    //    block's own shared memory, written before a block barrier)
    float v_t = 0.f;
    if (t < HD) {
        if (src_shared) {
            sm.q_raw[t] = q_src[t];
            sm.k_raw[t] = k_src[t];
            v_t = v_src[t];
        } else {
            sm.q_raw[t] = __ldcg(q_src + t);
            sm.k_raw[t] = __ldcg(k_src + t);
            v_t = __ldcg(v_src + t);
        }
    }
    __syncthreads();
    // 2. QK-norm (every warp sums the squares in the same order), RoPE, row C in bf16
    float inv_q = 1.f, inv_k = 1.f;
    if constexpr (S::QKN) {
        float sq = 0.f, sk = 0.f;
        for (int i = lane; i < HD; i += kWarpSize) {
            sq = __fmaf_rn(sm.q_raw[i], sm.q_raw[i], sq);
            sk = __fmaf_rn(sm.k_raw[i], sm.k_raw[i], sk);
        }
        sq = warp_sum(sq);
        sk = warp_sum(sk);
        inv_q = inv_rms(sq, HD);
        inv_k = inv_rms(sk, HD);
    }
    if (t < HD) {
        const int p = t < half ? t + half : t - half;
        float qt = sm.q_raw[t], qp = sm.q_raw[p], kt = sm.k_raw[t], kp = sm.k_raw[p];
        if constexpr (S::QKN) {
            qt = __fmul_rn(__fmul_rn(qt, inv_q), r.qn_t);
            qp = __fmul_rn(__fmul_rn(qp, inv_q), r.qn_p);
            kt = __fmul_rn(__fmul_rn(kt, inv_k), r.kn_t);
            kp = __fmul_rn(__fmul_rn(kp, inv_k), r.kn_p);
        }
        const float qr = rope_half(qt, qp, r.cos_t, r.sin_t, t < half);
        const float kr = rope_half(kt, kp, r.cos_t, r.sin_t, t < half);
        sm.q[t] = qr;
        const uint16_t kb = to_bf(kr), vb = to_bf(v_t);
        sm.k_new[t] = kb;
        sm.v_new[t] = vb;
        // the KV head's row C, written by one item: its first query head's last split
        if (write_kv && h % D::GRP == 0 && s == m.splits - 1) {
            const size_t at = ((size_t)l * m.max_ctx + m.ctx) * S::NKV * HD + (size_t)g * HD + t;
            m.k_cache[at] = kb;
            m.v_cache[at] = vb;
        }
    }
    __syncthreads();

    // 3. scores: a group of LPR lanes a row, 8 dims a lane, reduced within the group
    const float scale = __fdiv_rn(1.f, __fsqrt_rn((float)HD));
    const float4 qa = reinterpret_cast<const float4 *>(sm.q)[2 * part];
    const float4 qb = reinterpret_cast<const float4 *>(sm.q)[2 * part + 1];
    const uint4 k_new = reinterpret_cast<const uint4 *>(sm.k_new)[part];
#pragma unroll
    for (int k = 0; k < kAttnBatch; ++k) {
        const int i = k * (kWarps * D::RPI) + warp * D::RPI + sub, j = j0 + i;
        float d = dot8(j == m.ctx ? k_new : r.k[k], qa, qb, 0.f);
#pragma unroll
        for (int o = D::LPR / 2; o > 0; o >>= 1) d = __fadd_rn(d, __shfl_xor_sync(0xffffffffu, d, o));
        if (part == 0 && j < j1) sm.scores[i] = __fmul_rn(d, scale);
    }
    __syncthreads();

    // 4. softmax over the split's rows: max (exact in any order), then exp and the sum in a fixed order
    float mx = -INFINITY;
    for (int i = t; i < n; i += kThreads) mx = fmaxf(mx, sm.scores[i]);
    mx = warp_max(mx);
    if (lane == 0) sm.red[0][warp] = mx;
    __syncthreads();
    mx = sm.red[0][0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, sm.red[0][w]);
    float sum = 0.f;
    for (int i = t; i < n; i += kThreads) {
        const float p = expf(__fsub_rn(sm.scores[i], mx));
        sm.scores[i] = p;
        sum = __fadd_rn(sum, p);
    }
    sum = warp_sum(sum);
    if (lane == 0) sm.red[1][warp] = sum;
    __syncthreads();
    sum = sm.red[1][0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) sum = __fadd_rn(sum, sm.red[1][w]);

    // 5. probabilities times V: 8 dims a lane over its rows, then the row groups of the warp, then
    //    the warps in order
    float o8[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) o8[e] = 0.f;
    const uint4 v_new = reinterpret_cast<const uint4 *>(sm.v_new)[part];
#pragma unroll
    for (int k = 0; k < kAttnBatch; ++k) {
        const int i = k * (kWarps * D::RPI) + warp * D::RPI + sub, j = j0 + i;
        if (j < j1) {
            const float p = sm.scores[i];
            float f[8];
            unpack8(j == m.ctx ? v_new : r.v[k], f);
#pragma unroll
            for (int e = 0; e < 8; ++e) o8[e] = __fmaf_rn(p, f[e], o8[e]);
        }
    }
#pragma unroll
    for (int o = D::LPR; o < kWarpSize; o <<= 1)
#pragma unroll
        for (int e = 0; e < 8; ++e) o8[e] = __fadd_rn(o8[e], __shfl_xor_sync(0xffffffffu, o8[e], o));
    if (sub == 0)
#pragma unroll
        for (int e = 0; e < 8; ++e) sm.part[warp][part * 8 + e] = o8[e];
    __syncthreads();
    float acc = 0.f;
    if (t < HD)
#pragma unroll
        for (int w = 0; w < kWarps; ++w) acc = __fadd_rn(acc, sm.part[w][t]);

    // 6. one split: the output. Several: the split's partial; the last to finish folds them all.
    if (m.splits == 1) {
        if (t < HD) (out_smem != nullptr ? out_smem[t] : a.attn[h * HD + t]) = __fdiv_rn(acc, sum);
        return true;
    }
    const int item = h * m.splits + s;
    if (t < HD) a.part_o[(size_t)item * HD + t] = acc;
    if (t == 0) {
        a.part_ml[2 * item] = mx;
        a.part_ml[2 * item + 1] = sum;
    }
    if (!fold) return false;
    __syncthreads();
    if (t == 0) {
        fence_acq_rel();
        const unsigned old = atomicAdd(tickets + h, 1u);
        sm.last = old % (unsigned)m.splits == (unsigned)(m.splits - 1);
        fence_acq_rel();
    }
    __syncthreads();
    if (!sm.last) return false;
    if (t < HD) a.attn[h * HD + t] = fold_splits<S>(a, h, m.splits, t);
    return true;
}
template <class S>
__device__ __forceinline__ bool attention_item(const AttnRegs<S> &r, const Model &m, const Acts &a,
                                               unsigned *tickets, int l, int h, int s, Smem<S> &sm) {
    using D = Dims<S>;
    const int g = h / D::GRP;
    return attention_core(r, m, a, tickets, l, h, s, sm, a.qkv + h * S::HD, a.qkv + D::ATT + g * S::HD,
                          a.qkv + D::ATT + S::NKV * S::HD + g * S::HD, true);
}

// ---- (A) baseline: one kernel a phase, PDL ------------------------------------------------
// XQ > 0 (ffn_red, XQ copies of xq): the QKV projection normalizes xq (layers after the first),
// the O projection adds its rows to xq. OP (attn_o): kOpParts, gate/up normalizes x_mid, and down
// adds its rows to it; kOpFixed, the residual is xq (layer 0's QKV projection sets it to x_in),
// which gate/up normalizes and down adds its rows to.
template <class S, int P, int XQ = 0, int OP = kOpNone>
__global__ void __launch_bounds__(kThreads) phase_kernel(const Model m, const Acts a, int l) {
    using G = Gemv<S, P>;
    __shared__ Smem<S> sm;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int first = blockIdx.x * kWarps + warp, stride = gridDim.x * kWarps;
    Prefetch<S, P> pf;
    prefetch(pf, m, l, first, stride, lane);
    Gamma<S::H> gm;
    if constexpr (G::NORM) load_gamma(gm, (P == kQkv ? m.ln_in : m.ln_post) + (size_t)l * S::H);
    pdl_wait();
    pdl_launch_dependents();
    trace(a, l, P == kQkv ? 0 : P + 1, 0);
    if constexpr (G::NORM) {
        if (XQ > 0 && P == kQkv && l > 0) stage_norm_fixed<S::H, XQ>(a.xq, gm, sm.raw, sm.xs);
        else if (OP == kOpParts && P == kGateUp) stage_norm_mid<S>(a, l, gm, sm.raw, sm.xs);
        else if (OP == kOpFixed && P == kGateUp) stage_norm_fixed<S::H, 1>(a.xq, gm, sm.raw, sm.xs);
        else stage_norm<S::H>(P == kQkv && l == 0 ? a.x_in : a.x, gm, sm.raw, sm.xs);
    } else {
        stage_plain<G::COLS>(P == kO ? a.attn : a.act, sm.xs);
    }
    if constexpr (OP == kOpFixed && P == kQkv)
        if (l == 0 && blockIdx.x == 0)
            for (int i = threadIdx.x; i < S::H; i += kThreads) a.xq[i] = to_fixed(__ldg(a.x_in + i));
    gemv_tasks<S, P, XQ, OP>(pf, m, a, l, first, stride, lane, sm.xs);
    if (a.trace != nullptr) {
        __syncthreads();
        trace(a, l, P == kQkv ? 0 : P + 1, 1);
    }
}

template <class S>
__global__ void __launch_bounds__(kThreads) attention_kernel(const Model m, const Acts a, unsigned *tickets,
                                                             int l) {
    __shared__ Smem<S> sm;
    const int h = blockIdx.x / m.splits, s = blockIdx.x % m.splits;
    AttnRegs<S> r;
    attn_prefetch(r, m, l, h, s);
    pdl_wait();
    pdl_launch_dependents();
    trace(a, l, 1, 0);
    attention_item(r, m, a, tickets, l, h, s, sm);
    if (a.trace != nullptr) {
        __syncthreads();
        trace(a, l, 1, 1);
    }
}

// ---- (B, C) the persistent kernel ------------------------------------------------------------
__device__ __forceinline__ unsigned tasks_of_block(int n_tasks) {
    unsigned c = 0;
    for (int w = 0; w < kWarps; ++w) {
        const int first = blockIdx.x * kWarps + w, stride = gridDim.x * kWarps;
        if (first < n_tasks) c += (n_tasks - 1 - first) / stride + 1;
    }
    return c;
}
template <class S>
__device__ __forceinline__ int group_of_qkv_row(int r) {
    using D = Dims<S>;
    if (r < D::ATT) return r / S::HD / D::GRP;
    if (r < D::ATT + S::NKV * S::HD) return (r - D::ATT) / S::HD;
    return (r - D::ATT - S::NKV * S::HD) / S::HD;
}
// After the block's QKV rows (and a block barrier): counters[g] += the rows of KV group g this
// block wrote, ordered after them (thread g's release fence; the barrier made it cumulative).
template <class S>
__device__ __forceinline__ void signal_group_rows(unsigned *counters, int block_first, int stride) {
    if (threadIdx.x >= S::NKV) return;
    unsigned c = 0;
    for (int w = 0; w < kWarps; ++w)
        for (int r = block_first + w; r < Dims<S>::QKV; r += stride)
            c += group_of_qkv_row<S>(r) == (int)threadIdx.x;
    if (c > 0) {
        fence_acq_rel();
        red_add(counters + threadIdx.x, c);
    }
}

// kBarrier = false: per-dependency counters (the finest correct), and a block with no work in a
// phase neither waits nor signals there. kBarrier = true: one counter, a grid-wide barrier between
// phases: every block arrives after every phase and every block waits for all arrivals before the
// next (a block that skipped waiting could arrive for a later phase early and complete the count of
// an earlier one). Both issue a phase's weight loads before its wait.
template <class S, bool kBarrier>
__global__ void __launch_bounds__(kThreads, 1) persistent_kernel(const Model m, const Acts a, Sync *sy) {
    using D = Dims<S>;
    __shared__ Smem<S> sm;
    __shared__ unsigned s_epoch;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int grid = gridDim.x, first = blockIdx.x * kWarps + warp, stride = grid * kWarps;
    const int block_first = blockIdx.x * kWarps;   // the block has work in a phase iff warp 0 has
    const int items = S::NH * m.splits;
    const int my_item = grid - 1 - (int)blockIdx.x; // attention items go to the last blocks
    if (threadIdx.x == 0) s_epoch = *(volatile unsigned *)&sy->epoch;
    __syncthreads();
    const unsigned epoch = s_epoch;

    Prefetch<S, kQkv> pa;
    Prefetch<S, kO> pc;
    Prefetch<S, kGateUp> pd;
    Prefetch<S, kDown> pe;
    Gamma<S::H> g_in, g_post;
    AttnRegs<S> ar;

    prefetch(pa, m, 0, first, stride, lane);
    load_gamma(g_in, m.ln_in);
    for (int l = 0; l < S::L; ++l) {
        const unsigned gl = epoch * S::L + l;            // layers before this one, over all launches
        const unsigned bar0 = 5u * gl * (unsigned)grid;  // barrier arrivals before this layer

        // (a) RMSNorm + QKV: needs all of x (the previous layer's down rows)
        const bool has_a = block_first < D::QKV;
        if (kBarrier) block_wait(&sy->bar, bar0, &sy->abort);
        else if (has_a && l > 0) block_wait(&sy->down, gl * S::H, &sy->abort);
        if (has_a) {
            trace(a, l, 0, 0);
            stage_norm<S::H>(l == 0 ? a.x_in : a.x, g_in, sm.raw, sm.xs);
            gemv_tasks<S, kQkv>(pa, m, a, l, first, stride, lane, sm.xs);
            if (!kBarrier) {   // rows done per KV group
                __syncthreads();
                signal_group_rows<S>(sy->group, block_first, stride);
            }
        }
        if (kBarrier) block_signal(&sy->bar, 1);
        if (has_a) trace(a, l, 0, 1);

        // (b) attention: the O rows first (they stream in during it), then each item's K/V rows
        //     before its wait; head h needs the QKV rows of its KV group
        prefetch(pc, m, l, first, stride, lane);
        const bool has_b = my_item < items;
        if (has_b) attn_prefetch(ar, m, l, my_item / m.splits, my_item % m.splits);
        if (kBarrier) block_wait(&sy->bar, bar0 + grid, &sy->abort);
        for (int item = my_item; item < items; item += grid) {
            const int h = item / m.splits, s = item % m.splits;
            if (item != my_item) attn_prefetch(ar, m, l, h, s);
            if (!kBarrier) block_wait(&sy->group[h / D::GRP], (gl + 1) * D::GROUP_ROWS, &sy->abort);
            if (item == my_item) trace(a, l, 1, 0);
            const bool done = attention_item(ar, m, a, sy->tickets, l, h, s, sm);
            if (!kBarrier && done) block_signal(&sy->heads, 1);
        }
        if (kBarrier) block_signal(&sy->bar, 1);
        if (has_b) trace(a, l, 1, 1);

        // (c) O + residual: needs all heads
        const bool has_c = block_first < S::H;
        if (kBarrier) block_wait(&sy->bar, bar0 + 2 * grid, &sy->abort);
        else if (has_c) block_wait(&sy->heads, (gl + 1) * S::NH, &sy->abort);
        if (has_c) {
            trace(a, l, 2, 0);
            stage_plain<D::ATT>(a.attn, sm.xs);
            gemv_tasks<S, kO>(pc, m, a, l, first, stride, lane, sm.xs);
            if (!kBarrier) block_signal(&sy->o, tasks_of_block(S::H));
        }
        if (kBarrier) block_signal(&sy->bar, 1);
        if (has_c) trace(a, l, 2, 1);

        // (d) RMSNorm + gate/up + SwiGLU: needs all of x after O
        prefetch(pd, m, l, first, stride, lane);
        load_gamma(g_post, m.ln_post + (size_t)l * S::H);
        const bool has_d = block_first < S::I;
        if (kBarrier) block_wait(&sy->bar, bar0 + 3 * grid, &sy->abort);
        else if (has_d) block_wait(&sy->o, (gl + 1) * S::H, &sy->abort);
        if (has_d) {
            trace(a, l, 3, 0);
            stage_norm<S::H>(a.x, g_post, sm.raw, sm.xs);
            gemv_tasks<S, kGateUp>(pd, m, a, l, first, stride, lane, sm.xs);
            if (!kBarrier) block_signal(&sy->act, tasks_of_block(S::I));
        }
        if (kBarrier) block_signal(&sy->bar, 1);
        if (has_d) trace(a, l, 3, 1);

        // (e) down + residual: needs all of act
        prefetch(pe, m, l, first, stride, lane);
        const bool has_e = block_first < S::H;
        if (kBarrier) block_wait(&sy->bar, bar0 + 4 * grid, &sy->abort);
        else if (has_e) block_wait(&sy->act, (gl + 1) * S::I, &sy->abort);
        if (has_e) {
            trace(a, l, 4, 0);
            stage_plain<S::I>(a.act, sm.xs);
            gemv_tasks<S, kDown>(pe, m, a, l, first, stride, lane, sm.xs);
            if (!kBarrier) block_signal(&sy->down, tasks_of_block(S::H));
        }
        if (kBarrier) block_signal(&sy->bar, 1);
        if (has_e) trace(a, l, 4, 1);

        if (l + 1 < S::L) {
            prefetch(pa, m, l + 1, first, stride, lane);
            load_gamma(g_in, m.ln_in + (size_t)(l + 1) * S::H);
        }
    }
    // The last block to leave advances the epoch: every block read it at its start, before its
    // own exit ticket, and the next launch starts after this one ends.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned old = atomicAdd(&sy->exit, 1u);
        if (old + 1 == (epoch + 1) * (unsigned)grid) atomicExch(&sy->epoch, epoch + 1);
    }
}


// ---- (D) the clustered body: two kernels a layer ---------------------------------------------
// Thread block clusters of CS blocks (distributed shared memory, a hardware barrier across the
// cluster) keep every dependency inside a layer local to a cluster but two:
//   attention kernel, one cluster per query head h (grid NH * CS):
//     x = x_mid + sum_c ffn_part[c] (layer 0: x_in); RMSNorm; the QKV rows head h needs (its q,
//     its KV head's k and v: 3 head_dim rows, RB3 a block) -> qkvh[h]; cluster barrier;
//     attention over splits s = rank, rank + CS, ... (partials); cluster barrier; every block
//     folds the splits; O projection of head h's columns, HPB rows a block -> attn_part[h]
//   FFN kernel, NC clusters, cluster c owning act[c IC, (c + 1) IC):
//     x_mid = x + sum_h attn_part[h]; RMSNorm; gate/up + SwiGLU of IPB act rows a block;
//     cluster barrier; every block gathers the cluster's IC act values from the others' shared
//     memory; down projection of those IC columns, HPB rows a block -> ffn_part[c]
// The O and down projections are split over K (heads, act chunks): their sums are taken by the
// next kernel, in a fixed order, by every block alike (so the outputs are deterministic but not
// bit-identical to the other variants, which sum each row in one pass). The K/V rows of a head
// group are computed by each of the group's clusters (GRP x the K/V weight bytes, mostly from L2).
// Each block's weights go to shared memory by cp.async before its PDL wait.
constexpr int kFfnBlocks = 128;   // NC * CS

template <class S, int CS>
struct Fused {
    static constexpr int NC = kFfnBlocks / CS;          // FFN clusters
    static constexpr int RB3 = 3 * S::HD / CS;          // QKV rows a block
    static constexpr int HPB = S::H / CS;               // O / down rows a block
    static constexpr int IC = S::I / NC;                // act columns a cluster
    static constexpr int IPB = IC / CS;                 // act rows a block
    static constexpr int ATTN_SMEM = (RB3 * S::H + HPB * S::HD) * 2;
    static constexpr int FFN_SMEM = (2 * IPB * S::H + HPB * IC) * 2;
    static_assert(3 * S::HD % CS == 0 && S::H % CS == 0 && S::I % NC == 0 && IC % CS == 0, "cluster split");
    static_assert(IC % 8 == 0 && S::HD % 8 == 0, "16-byte segments");
};

template <class S>
struct FusedSmem {
    alignas(16) float raw[S::H];
    alignas(16) float xs[S::H];
    alignas(16) float head[S::HD];             // head h's attention output
    // attention_core's
    alignas(16) float q[S::HD];
    float q_raw[S::HD], k_raw[S::HD];
    alignas(16) uint16_t k_new[S::HD];
    alignas(16) uint16_t v_new[S::HD];
    alignas(16) float part[kWarps][S::HD];
    float scores[Dims<S>::RB];
    float red[2][kWarps];
    unsigned last;
};

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Rows 0..n-1 of `cols` bf16 each (row(r): global address) into dst [n][cols], 16 bytes a copy.
template <class RowPtr>
__device__ __forceinline__ void copy_rows(uint16_t *dst, int n, int cols, RowPtr row) {
    const int per_row = cols / 8;
    for (int i = threadIdx.x; i < n * per_row; i += kThreads) {
        const int r = i / per_row, c = i % per_row;
        cp_async16(dst + (size_t)r * cols + c * 8, row(r) + c * 8);
    }
}

// A whole row of COLS (shared memory) times xs, one warp: dot_task's order and butterfly.
template <int COLS>
__device__ __forceinline__ float dot_row(const uint16_t *row, const float *xs, int lane) {
    constexpr int kChunks = COLS / 8, U = (kChunks + kWarpSize - 1) / kWarpSize;
    const uint4 *w = reinterpret_cast<const uint4 *>(row);
    const float4 *xs4 = reinterpret_cast<const float4 *>(xs);
    const int swap = (lane >> 2) & 1;
    float acc = 0.f;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int c = lane + u * kWarpSize;
        if (c < kChunks) {
            const float4 h0 = xs4[2 * c + swap], h1 = xs4[2 * c + 1 - swap];
            acc = dot8(w[c], swap ? h1 : h0, swap ? h0 : h1, acc);
        }
    }
    return warp_sum(acc);
}

// Rows 0..n-1 of SEG columns each (shared memory, [n][SEG]) times xs [SEG]: a group of LG lanes a
// row (LG the power of two >= SEG / 8, at most 32), each lane chunks sub, sub + LG, ...; the
// group reduced by a butterfly; emit(row, value) by the group's first lane.
template <int SEG, class Emit>
__device__ __forceinline__ void seg_gemv(const uint16_t *w, int n, const float *xs, int warp, int lane, Emit emit) {
    constexpr int kChunks = SEG / 8;
    constexpr int LG = kChunks >= 32 ? 32 : kChunks > 8 ? (kChunks > 16 ? 32 : 16) : (kChunks > 4 ? 8 : 4);
    constexpr int RPS = kWarpSize / LG, UC = (kChunks + LG - 1) / LG;
    const uint4 *w4 = reinterpret_cast<const uint4 *>(w);
    const float4 *xs4 = reinterpret_cast<const float4 *>(xs);
    const int sub = lane % LG;
    for (int step = warp; step * RPS < n; step += kWarps) {
        const int row = step * RPS + lane / LG;
        float acc = 0.f;
        if (row < n) {
#pragma unroll
            for (int k = 0; k < UC; ++k) {
                const int c = k * LG + sub;
                if (c < kChunks) acc = dot8(w4[(size_t)row * kChunks + c], xs4[2 * c], xs4[2 * c + 1], acc);
            }
        }
#pragma unroll
        for (int o = LG / 2; o > 0; o >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, o));
        if (sub == 0 && row < n) emit(row, acc);
    }
}

// raw = base + parts[0] + ... + parts[np - 1] (in that order; parts [np][N]), written to out too
// when out is not null; then xs = RMSNorm(raw) * gamma. Every load of a thread is in flight at once.
template <int N, int NPMAX>
__device__ __forceinline__ void stage_sum_norm(const float *base, const float *parts, int np, const Gamma<N> &g,
                                               float *raw, float *xs, float *out) {
    constexpr int K = (N + kThreads - 1) / kThreads;
    float v[K][NPMAX + 1];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int i = threadIdx.x + k * kThreads;
#pragma unroll
        for (int p = 0; p <= NPMAX; ++p)
            v[k][p] = i < N && (p == 0 || p <= np) ? __ldcg((p == 0 ? base : parts + (size_t)(p - 1) * N) + i) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int i = threadIdx.x + k * kThreads;
        float sum = v[k][0];
#pragma unroll
        for (int p = 1; p <= NPMAX; ++p)
            if (p <= np) sum = __fadd_rn(sum, v[k][p]);
        if (i < N) {
            raw[i] = sum;
            if (out != nullptr) out[i] = sum;
        }
    }
    __syncthreads();
    norm_raw(g, raw, xs);
}

template <class S, int CS>
__global__ void __launch_bounds__(kThreads, 1) fused_attention_kernel(const Model m, const Acts a, int l) {
    using D = Dims<S>;
    using F = Fused<S, CS>;
    constexpr int H = S::H, HD = S::HD;
    extern __shared__ uint4 dyn_smem[];
    uint16_t *wq = reinterpret_cast<uint16_t *>(dyn_smem);   // [RB3][H]
    uint16_t *wo = wq + F::RB3 * H;                            // [HPB][HD]
    __shared__ FusedSmem<S> sm;
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = (int)cluster.block_rank(), h = blockIdx.x / CS, g = h / D::GRP;
    const int t = threadIdx.x, warp = t / kWarpSize, lane = t % kWarpSize;
    stamp(a, l, kStampAttnEntry);

    // before the wait: this block's QKV and O rows, the norm weights, its first split's K/V rows
    const uint16_t *wqkv = m.w_qkv + (size_t)l * D::QKV * H;
    copy_rows(wq, F::RB3, H, [&](int r) {
        const int i = rank * F::RB3 + r;
        const int row = i < HD ? h * HD + i : i < 2 * HD ? D::ATT + g * HD + i - HD
                                                       : D::ATT + S::NKV * HD + g * HD + i - 2 * HD;
        return wqkv + (size_t)row * H;
    });
    copy_rows(wo, F::HPB, HD, [&](int r) {
        return m.w_o + (size_t)l * H * D::ATT + (size_t)(rank * F::HPB + r) * D::ATT + h * HD;
    });
    Gamma<H> gm;
    load_gamma(gm, m.ln_in + (size_t)l * H);
    AttnRegs<S> ar;
    attn_prefetch(ar, m, l, h, rank);
    pdl_wait();
    pdl_launch_dependents();
    stamp(a, l, kStampAttnWait);

    stage_sum_norm<H, F::NC>(l == 0 ? a.x_in : a.x, a.ffn_part, l == 0 ? 0 : F::NC, gm, sm.raw, sm.xs,
                             h == 0 && rank == 0 ? a.x_res : nullptr);
    cp_async_wait_all();
    __syncthreads();
    stamp(a, l, kStampAttnStaged);
    float *qkvh = a.qkvh + (size_t)h * 3 * HD;
    for (int r = warp; r < F::RB3; r += kWarps) {
        const float v = dot_row<H>(wq + (size_t)r * H, sm.xs, lane);
        if (lane == 0) qkvh[rank * F::RB3 + r] = v;
    }
    cluster.sync();
    stamp(a, l, kStampAttnQkv);
    for (int s = rank; s < m.splits; s += CS) {
        if (s != rank) attn_prefetch(ar, m, l, h, s);
        attention_core(ar, m, a, nullptr, l, h, s, sm, qkvh, qkvh + HD, qkvh + 2 * HD, false);
    }
    cluster.sync();
    stamp(a, l, kStampAttnHeads);
    if (t < HD) sm.head[t] = m.splits <= 16 ? fold_splits_batched<S, 16>(a, h, m.splits, t) : fold_splits<S>(a, h, m.splits, t);
    __syncthreads();
    float *out = a.attn_part + (size_t)h * H + rank * F::HPB;
    seg_gemv<HD>(wo, F::HPB, sm.head, warp, lane, [&](int row, float v) { out[row] = v; });
    if (a.trace != nullptr) {
        __syncthreads();
        stamp(a, l, kStampAttnEnd);
    }
}

template <class S, int CS>
__global__ void __launch_bounds__(kThreads, 1) fused_ffn_kernel(const Model m, const Acts a, int l) {
    using F = Fused<S, CS>;
    constexpr int H = S::H, I = S::I;
    extern __shared__ uint4 dyn_smem[];
    uint16_t *wgu = reinterpret_cast<uint16_t *>(dyn_smem);  // [2 IPB][H]: gate rows, then up rows
    uint16_t *wd = wgu + 2 * F::IPB * H;                       // [HPB][IC]
    __shared__ alignas(16) float raw[H];
    __shared__ alignas(16) float xs[H];
    __shared__ float act_own[F::IPB];
    __shared__ alignas(16) float act[F::IC];
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = (int)cluster.block_rank(), c = blockIdx.x / CS;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int a0 = c * F::IC + rank * F::IPB;   // this block's first act row
    stamp(a, l, kStampFfnEntry);

    copy_rows(wgu, 2 * F::IPB, H, [&](int r) {
        const int row = (r < F::IPB ? 0 : I) + a0 + r % F::IPB;
        return m.w_gu + (size_t)l * 2 * I * H + (size_t)row * H;
    });
    copy_rows(wd, F::HPB, F::IC, [&](int r) {
        return m.w_down + (size_t)l * H * I + (size_t)(rank * F::HPB + r) * I + c * F::IC;
    });
    Gamma<H> gm;
    load_gamma(gm, m.ln_post + (size_t)l * H);
    pdl_wait();
    pdl_launch_dependents();
    stamp(a, l, kStampFfnWait);

    stage_sum_norm<H, S::NH>(a.x_res, a.attn_part, S::NH, gm, raw, xs, c == 0 && rank == 0 ? a.x : nullptr);
    cp_async_wait_all();
    __syncthreads();
    stamp(a, l, kStampFfnStaged);
    for (int i = warp; i < F::IPB; i += kWarps) {
        const float gt = dot_row<H>(wgu + (size_t)i * H, xs, lane);
        const float up = dot_row<H>(wgu + (size_t)(F::IPB + i) * H, xs, lane);
        if (lane == 0) act_own[i] = __fmul_rn(__fdiv_rn(gt, __fadd_rn(1.f, expf(-gt))), up);
    }
    cluster.sync();
    stamp(a, l, kStampFfnAct);
    for (int i = threadIdx.x; i < F::IC; i += kThreads)
        act[i] = cluster.map_shared_rank(act_own, i / F::IPB)[i % F::IPB];
    cluster.sync();   // no block leaves (or reuses act_own) while another still reads it
    stamp(a, l, kStampFfnGather);
    float *out = a.ffn_part + (size_t)c * H + rank * F::HPB;
    seg_gemv<F::IC>(wd, F::HPB, act, warp, lane, [&](int row, float v) { out[row] = v; });
    if (a.trace != nullptr) {
        __syncthreads();
        stamp(a, l, kStampFfnEnd);
    }
}

// The step's output: x = x_mid + the last layer's FFN partials.
template <class S, int CS>
__global__ void __launch_bounds__(kThreads) fused_final_kernel(const Acts a) {
    using F = Fused<S, CS>;
    pdl_wait();
    for (int i = blockIdx.x * kThreads + threadIdx.x; i < S::H; i += gridDim.x * kThreads) {
        float sum = __ldcg(a.x + i);
        for (int p = 0; p < F::NC; ++p) sum = __fadd_rn(sum, __ldcg(a.ffn_part + (size_t)p * S::H + i));
        a.x[i] = sum;
    }
}

// ---- (E) the attention inside the O projection: four kernels a layer ---------------------------
// Every block of the O projection computes the whole step's attention for itself (all heads, one
// block, no splits) and then its O rows, so no kernel, and no cross-block dependency, separates the
// QKV projection from the O projection. The price is redundant work: each block reads every K/V
// row. Rows 0..C-1 (earlier steps': the step never writes them) go to the block's shared memory by
// cp.async before the PDL wait, together with its first O rows (registers), the QK-norm weights
// and the rotation; so the variant runs only where that cache fits in shared memory (a short
// context). After the wait (n = C + 1 rows):
//   1. raw = the QKV output [NH + 2 NKV heads][HD] (one L2 round trip); QK-norm's 1/rms a head (a
//      warp a head, lane-strided squares as attention_core sums them)
//   2. RoPE of the q heads into q [NH][HD] fp32, of the k heads into row C of ks (bf16, as the
//      cache holds it), v into row C of vs; block 0 also stores row C in the cache
//   3. scores [NH][n]: a group of HD / 8 lanes a K row, each lane 8 dims, for the GRP query heads
//      of the row's KV head, reduced within the group
//   4. softmax a head (a warp a head): max, then exp and the sum, lane-strided
//   5. P V: thread (KV head g, 8-dim chunk c, row part p) sums rows j = p, p + P, ... for the GRP
//      heads of g; the P parts are added in order and divided by the head's sum -> xs [NH * HD]
//   6. the O rows of the block's warps (gemv_tasks, the baseline's O code and residual)
// The arithmetic differs from attention_core's (rows folded in another order), so the variant is
// held to the CPU reference only.
template <class S>
struct OAttn {
    static constexpr int HD = S::HD, DCH = HD / 8;                      // 16-byte chunks a row
    static constexpr int LPR = DCH, RPI = kWarpSize / LPR;              // scores: lanes a row, rows a pass
    static constexpr int PV_ITEMS = S::NKV * DCH;                       // (KV head, chunk) pairs
    static constexpr int PV_PARTS = kThreads / PV_ITEMS;                // row parts of P V
    static_assert(PV_ITEMS <= kThreads && LPR <= kWarpSize, "one pass of P V items");
    // dynamic shared memory for n = C + 1 rows: the P V parts [PV_PARTS][NH * HD] fp32, then ks, vs
    // [NKV][n][HD] bf16, then scores [NH][n] fp32
    static constexpr size_t kPartBytes = (size_t)PV_PARTS * S::NH * HD * 4;
    static size_t dyn_bytes(int n) { return kPartBytes + (size_t)2 * S::NKV * n * HD * 2 + (size_t)S::NH * n * 4; }
};

template <class S>
__global__ void __launch_bounds__(kThreads) o_attn_kernel(const Model m, const Acts a, int l) {
    using D = Dims<S>;
    using OA = OAttn<S>;
    constexpr int HD = S::HD, NH = S::NH, NKV = S::NKV, GRP = D::GRP, half = HD / 2, DCH = OA::DCH;
    extern __shared__ uint4 dyn_smem[];
    const int C = m.ctx, n = C + 1;
    float(*part)[D::ATT] = reinterpret_cast<float(*)[D::ATT]>(dyn_smem);   // [PV_PARTS][NH * HD]
    uint16_t *ks = reinterpret_cast<uint16_t *>(dyn_smem + OA::kPartBytes / 16);   // [NKV][n][HD]
    uint16_t *vs = ks + (size_t)NKV * n * HD;                             // [NKV][n][HD]
    float *scores = reinterpret_cast<float *>(vs + (size_t)NKV * n * HD); // [NH][n]
    __shared__ alignas(16) float raw[D::QKV];     // the QKV output: q heads, k heads, v heads
    __shared__ alignas(16) float q[D::ATT];       // [NH][HD] after QK-norm and RoPE
    __shared__ alignas(16) float xs[D::ATT];      // the attention output, the O rows' input
    __shared__ float qn[HD], kn[HD], rc[half], rs[half];
    __shared__ float inv_norm[NH + NKV], sums[NH];
    const int t = threadIdx.x, warp = t / kWarpSize, lane = t % kWarpSize;
    const int first = blockIdx.x * kWarps + warp, stride = gridDim.x * kWarps;

    // before the wait: the warp's first O rows, K/V rows 0..C-1, the QK-norm weights, the rotation
    Prefetch<S, kO> pf;
    prefetch(pf, m, l, first, stride, lane);
    const size_t row_stride = (size_t)NKV * HD;
    const uint16_t *kc = m.k_cache + (size_t)l * m.max_ctx * row_stride;
    const uint16_t *vc = m.v_cache + (size_t)l * m.max_ctx * row_stride;
    for (int i = t; i < NKV * C * DCH; i += kThreads) {
        const int g = i / (C * DCH), j = i / DCH % C, c = i % DCH;
        const size_t at = (size_t)j * row_stride + g * HD + c * 8, to = ((size_t)g * n + j) * HD + c * 8;
        cp_async16(ks + to, kc + at);
        cp_async16(vs + to, vc + at);
    }
    if (t < HD) {
        qn[t] = S::QKN ? bf(__ldg(m.q_norm + l * HD + t)) : 1.f;
        kn[t] = S::QKN ? bf(__ldg(m.k_norm + l * HD + t)) : 1.f;
    }
    if (t < half) rc[t] = __ldg(m.rope_cos + t), rs[t] = __ldg(m.rope_sin + t);
    pdl_wait();
    pdl_launch_dependents();
    trace(a, l, 1, 0);

    // 1. the QKV output, QK-norm's 1/rms a head
    for (int i = t; i < D::QKV; i += kThreads) raw[i] = __ldcg(a.qkv + i);
    __syncthreads();
    if constexpr (S::QKN) {
        for (int hh = warp; hh < NH + NKV; hh += kWarps) {   // q heads, then k heads (contiguous in raw)
            float ss = 0.f;
            for (int i = lane; i < HD; i += kWarpSize) ss = __fmaf_rn(raw[hh * HD + i], raw[hh * HD + i], ss);
            ss = warp_sum(ss);
            if (lane == 0) inv_norm[hh] = inv_rms(ss, HD);
        }
        __syncthreads();
    }
    // 2. RoPE (rotate-half), row C of k and v in bf16
    for (int i = t; i < (NH + NKV) * HD; i += kThreads) {
        const int hh = i / HD, d = i % HD, p = d < half ? d + half : d - half;
        float xt = raw[hh * HD + d], xp = raw[hh * HD + p];
        if constexpr (S::QKN) {
            const float *w = hh < NH ? qn : kn;
            xt = __fmul_rn(__fmul_rn(xt, inv_norm[hh]), w[d]);
            xp = __fmul_rn(__fmul_rn(xp, inv_norm[hh]), w[p]);
        }
        const float r = rope_half(xt, xp, rc[d % half], rs[d % half], d < half);
        if (hh < NH) {
            q[i] = r;
        } else {
            const int g = hh - NH;
            const uint16_t kb = to_bf(r), vb = to_bf(raw[D::ATT + NKV * HD + g * HD + d]);
            ks[((size_t)g * n + C) * HD + d] = kb;
            vs[((size_t)g * n + C) * HD + d] = vb;
            if (blockIdx.x == 0) {
                const size_t at = ((size_t)l * m.max_ctx + C) * row_stride + g * HD + d;
                m.k_cache[at] = kb;
                m.v_cache[at] = vb;
            }
        }
    }
    cp_async_wait_all();
    __syncthreads();

    // 3. scores: a group of LPR lanes a K row, the GRP heads of its KV head
    const float scale = __fdiv_rn(1.f, __fsqrt_rn((float)HD));
    const int sub = lane / OA::LPR, part_lane = lane % OA::LPR;
    const float4 *q4 = reinterpret_cast<const float4 *>(q);
    for (int r0 = warp * OA::RPI; r0 < NKV * n; r0 += kWarps * OA::RPI) {
        const int r = r0 + sub;
        const bool in = r < NKV * n;
        const int g = in ? r / n : 0, j = in ? r % n : 0;
        const uint4 kw = in ? reinterpret_cast<const uint4 *>(ks + ((size_t)g * n + j) * HD)[part_lane]
                            : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int e = 0; e < GRP; ++e) {
            const int h = g * GRP + e;
            float d = dot8(kw, q4[h * HD / 4 + 2 * part_lane], q4[h * HD / 4 + 2 * part_lane + 1], 0.f);
#pragma unroll
            for (int o = OA::LPR / 2; o > 0; o >>= 1) d = __fadd_rn(d, __shfl_xor_sync(0xffffffffu, d, o));
            if (part_lane == 0 && in) scores[h * n + j] = __fmul_rn(d, scale);
        }
    }
    __syncthreads();

    // 4. softmax, a warp a head
    for (int h = warp; h < NH; h += kWarps) {
        float mx = -INFINITY;
        for (int j = lane; j < n; j += kWarpSize) mx = fmaxf(mx, scores[h * n + j]);
        mx = warp_max(mx);
        float sum = 0.f;
        for (int j = lane; j < n; j += kWarpSize) {
            const float p = expf(__fsub_rn(scores[h * n + j], mx));
            scores[h * n + j] = p;
            sum = __fadd_rn(sum, p);
        }
        sum = warp_sum(sum);
        if (lane == 0) sums[h] = sum;
    }
    __syncthreads();

    // 5. P V in PV_PARTS row parts, then the parts in order over the head's sum
    if (t < OA::PV_ITEMS * OA::PV_PARTS) {
        const int item = t % OA::PV_ITEMS, p0 = t / OA::PV_ITEMS, g = item / DCH, c = item % DCH;
        float o[GRP][8];
#pragma unroll
        for (int e = 0; e < GRP; ++e)
#pragma unroll
            for (int k = 0; k < 8; ++k) o[e][k] = 0.f;
        for (int j = p0; j < n; j += OA::PV_PARTS) {
            float f[8];
            unpack8(reinterpret_cast<const uint4 *>(vs + ((size_t)g * n + j) * HD)[c], f);
#pragma unroll
            for (int e = 0; e < GRP; ++e) {
                const float p = scores[(g * GRP + e) * n + j];
#pragma unroll
                for (int k = 0; k < 8; ++k) o[e][k] = __fmaf_rn(p, f[k], o[e][k]);
            }
        }
#pragma unroll
        for (int e = 0; e < GRP; ++e)
#pragma unroll
            for (int k = 0; k < 8; ++k) part[p0][(g * GRP + e) * HD + c * 8 + k] = o[e][k];
    }
    __syncthreads();
    for (int i = t; i < D::ATT; i += kThreads) {
        float acc = part[0][i];
#pragma unroll
        for (int p = 1; p < OA::PV_PARTS; ++p) acc = __fadd_rn(acc, part[p][i]);
        xs[i] = __fdiv_rn(acc, sums[i / HD]);
    }
    __syncthreads();
    trace(a, l, 1, 1);
    trace(a, l, 2, 0);

    // 6. the O rows
    gemv_tasks<S, kO>(pf, m, a, l, first, stride, lane, xs);
    if (a.trace != nullptr) {
        __syncthreads();
        trace(a, l, 2, 1);
    }
}

// o_attn_gated: where a graph has to serve long contexts too, the attention kernel stays in it and
// does its work only past a context threshold; below it, it lets the O projection launch, waits
// for the QKV projection and ends. This is that kernel on the short side of the threshold, on the
// baseline attention's grid: what keeping it in the graph costs.
__global__ void __launch_bounds__(kThreads) attention_gate_kernel() {
    pdl_launch_dependents();
    pdl_wait();
}

// ---- (F) the attention inside the QKV projection's kernel: four kernels a layer ---------------
// The QKV kernel's grid (gemv_grid(QKV) blocks) does the QKV rows as the baseline does; then each
// block counts the rows it wrote per KV group (groups[l][g], as the persistent kernel does), and
// the last NH * splits blocks each take one attention item (head, split), waiting on the counter
// of the item's KV group. An item's K/V rows and norm weights load before the PDL wait, with
// the block's QKV weights. The waits are safe: every block of the grid has passed its PDL wait
// (so the kernel before it is gone) before the O kernel can launch, the grid fits on the GPU at
// once (host check: grid <= SMs, one block an SM at least), and a wait only targets rows of
// blocks that never wait before writing them. Counters are per layer and reset by the next
// layer's kernel (layer 0 resets layer L - 1's): by then every block that read them has ended,
// since each kernel's PDL wait waits for the whole chain before it.
template <class S>
__global__ void __launch_bounds__(kThreads) qkv_attn_kernel(const Model m, const Acts a, Sync *sy,
                                                            unsigned *groups, int l) {
    using D = Dims<S>;
    __shared__ Smem<S> sm;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int grid = gridDim.x, first = blockIdx.x * kWarps + warp, stride = grid * kWarps;
    const int block_first = blockIdx.x * kWarps;
    const int item = grid - 1 - (int)blockIdx.x;   // attention items go to the last blocks
    const bool has_item = item < S::NH * m.splits;
    const int h = has_item ? item / m.splits : 0, s = has_item ? item % m.splits : 0;
    Prefetch<S, kQkv> pf;
    prefetch(pf, m, l, first, stride, lane);
    Gamma<S::H> gm;
    load_gamma(gm, m.ln_in + (size_t)l * S::H);
    AttnRegs<S> ar;
    if (has_item) attn_prefetch(ar, m, l, h, s);
    pdl_wait();
    pdl_launch_dependents();
    if (blockIdx.x == 0 && threadIdx.x < S::NKV) groups[((l + S::L - 1) % S::L) * S::NKV + threadIdx.x] = 0u;
    trace(a, l, 0, 0);
    if (block_first < D::QKV) {
        stage_norm<S::H>(l == 0 ? a.x_in : a.x, gm, sm.raw, sm.xs);
        gemv_tasks<S, kQkv>(pf, m, a, l, first, stride, lane, sm.xs);
        __syncthreads();
        signal_group_rows<S>(groups + l * S::NKV, block_first, stride);   // rows done per KV group
    }
    trace(a, l, 0, 1);
    if (!has_item) return;
    block_wait(groups + l * S::NKV + h / D::GRP, (unsigned)D::GROUP_ROWS, &sy->abort);
    trace(a, l, 1, 0);
    attention_item(ar, m, a, sy->tickets, l, h, s, sm);
    if (a.trace != nullptr) {
        __syncthreads();
        trace(a, l, 1, 1);
    }
}

// ---- (I) each attention block computes its own q, k and v: four kernels a layer --------------
// One block a query head h (one split: the context fits a block's batch of K/V rows). Before its
// PDL wait a block loads the 3 * head_dim QKV rows it needs (q of head h, k and v of its KV head
// g: the KV head's rows are computed again by each of its GRP query heads): the first kLocalReg
// tasks of each warp into registers, the next SMEM_ROWS rows into shared memory by cp.async, and
// any rest after the wait from global memory. After the wait it normalizes x, takes the dot
// products (the same per-row code and order as the QKV GEMV, so q, k, v and the step's result
// are bit-identical to the baseline), and runs head h's attention on them from shared memory;
// the O, gate/up and down kernels follow as in the baseline. No hand-over between the QKV rows
// and the attention: what it costs instead is each block streaming 3 * head_dim * hidden * 2
// bytes alone (SmolLM2: 221 KB; qwen3-0.6b: 786 KB, most of it after the wait).
constexpr int kLocalReg = 4;                  // register tasks a warp
constexpr int kLocalSmemCap = 190 * 1024;     // bytes of weight rows in shared memory at most
template <class S>
struct QkvLocal {
    static constexpr int ROWS = 3 * S::HD, ROW_BYTES = S::H * 2, CHUNKS = S::H / 8;
    static constexpr int REG_ROWS = kWarps * kLocalReg < ROWS ? kWarps * kLocalReg : ROWS;
    static constexpr int SMEM_ROWS = (ROWS - REG_ROWS) < kLocalSmemCap / ROW_BYTES ? (ROWS - REG_ROWS)
                                                                                  : kLocalSmemCap / ROW_BYTES;
    static constexpr int SMEM_BYTES = SMEM_ROWS * ROW_BYTES;
};
// The block's task t (0 .. 3 HD - 1) as a row of w_qkv: q rows of head h, k rows, v rows of KV head g.
template <class S>
__device__ __forceinline__ int local_row(int t, int h, int g) {
    using D = Dims<S>;
    const int seg = t / S::HD, i = t % S::HD;
    return seg == 0 ? h * S::HD + i : seg == 1 ? D::ATT + g * S::HD + i : D::ATT + S::NKV * S::HD + g * S::HD + i;
}
template <class S>
__global__ void __launch_bounds__(kThreads, 1) qkv_local_kernel(const Model m, const Acts a, int l) {
    using D = Dims<S>;
    using QL = QkvLocal<S>;
    using T = TaskOf<S, kQkv>;
    extern __shared__ __align__(16) unsigned char qkv_local_dyn[];
    __shared__ Smem<S> sm;
    __shared__ __align__(16) float loc[3 * S::HD];   // this block's q, k, v
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int h = blockIdx.x, g = h / D::GRP;
    const uint16_t *w = weights<S, kQkv>(m, l);
    // registers: tasks warp + kWarps k, k < kLocalReg
    T reg[kLocalReg];
#pragma unroll
    for (int k = 0; k < kLocalReg; ++k) {
        const int t = warp + k * kWarps;
        if (t < QL::REG_ROWS) {
            load_task<S, kQkv>(reg[k], w, local_row<S>(t, h, g), lane);
        } else {
#pragma unroll
            for (int u = 0; u < T::U; ++u) reg[k].w[0][u] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    // shared memory: rows REG_ROWS .. REG_ROWS + SMEM_ROWS - 1, 16 bytes a copy
    uint16_t *wsm = reinterpret_cast<uint16_t *>(qkv_local_dyn);
    for (int idx = threadIdx.x; idx < QL::SMEM_ROWS * QL::CHUNKS; idx += kThreads) {
        const int r = idx / QL::CHUNKS, c = idx % QL::CHUNKS;
        cp_async16(wsm + (size_t)r * S::H + c * 8, w + (size_t)local_row<S>(QL::REG_ROWS + r, h, g) * S::H + c * 8);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    Gamma<S::H> gm;
    load_gamma(gm, m.ln_in + (size_t)l * S::H);
    AttnRegs<S> ar;
    attn_prefetch(ar, m, l, h, 0);
    pdl_wait();
    pdl_launch_dependents();
    trace(a, l, 0, 0);
    stage_norm<S::H>(l == 0 ? a.x_in : a.x, gm, sm.raw, sm.xs);   // ends with a block barrier
    float acc[1];
#pragma unroll
    for (int k = 0; k < kLocalReg; ++k) {
        const int t = warp + k * kWarps;
        if (t < QL::REG_ROWS) {
            dot_task(reg[k], sm.xs, lane, acc);
            if (lane == 0) loc[t] = acc[0];
        }
    }
    cp_async_wait_all();
    __syncthreads();
    for (int t = QL::REG_ROWS + warp; t < QL::ROWS; t += kWarps) {
        T tk;
        if (t < QL::REG_ROWS + QL::SMEM_ROWS) {
            const uint4 *row = reinterpret_cast<const uint4 *>(wsm + (size_t)(t - QL::REG_ROWS) * S::H);
#pragma unroll
            for (int u = 0; u < T::U; ++u) {
                const int c = lane + u * kWarpSize;
                tk.w[0][u] = c < T::kChunks ? row[c] : make_uint4(0u, 0u, 0u, 0u);
            }
        } else {
            load_task<S, kQkv>(tk, w, local_row<S>(t, h, g), lane);
        }
        dot_task(tk, sm.xs, lane, acc);
        if (lane == 0) loc[t] = acc[0];
    }
    __syncthreads();
    trace(a, l, 0, 1);
    trace(a, l, 1, 0);
    attention_core(ar, m, a, nullptr, l, h, 0, sm, loc, loc + S::HD, loc + 2 * S::HD, false, nullptr, true, true);
    if (a.trace != nullptr) {
        __syncthreads();
        trace(a, l, 1, 1);
    }
}

// ---- (G) the down projection inside the gate/up kernel: four kernels a layer -------------------
// Each warp's gate/up task i yields act[i]; the warp multiplies it at once by w_down's column i
// (row i of w_down_t, [H]), so a block holds the down projection's partial sum over its tasks'
// columns. The warps' partials are summed in warp order through shared memory, and each of the H
// sums is added to the fixed-point residual xq with one red.add.u64: integer sums in any order
// are the same, so the step stays deterministic and no kernel waits on the whole of act. The
// O projection writes xq (and x, this kernel's norm input, which no block adds to); the next
// layer's QKV projection and O residual read xq. The down sums are taken in another order than
// the baseline's (per block, then across blocks exactly), so the variant is held to the reference.
// kDownEarly: w_down_t's rows go into registers before the PDL wait with the gate/up rows (more
// registers a thread); otherwise they are prefetched into L2 before the wait and loaded into the
// registers the gate/up rows held once their dot products are done.
template <class S>
struct FfnRedSmem {
    alignas(16) float raw[S::H];
    alignas(16) float xs[S::H];
    alignas(16) float part[kWarps][S::H];   // each warp's partial of the down projection
};
__device__ __forceinline__ void prefetch_l2(const void *p) {
    asm volatile("prefetch.global.L2::evict_normal [%0];" ::"l"(p));
}
template <class S>
__device__ __forceinline__ float swiglu_act(const float (&acc)[2]) {
    const float g = acc[0];
    const float silu = __fdiv_rn(g, __fadd_rn(1.f, expf(-g)));
    return __fmul_rn(silu, acc[1]);
}
// p += act * the task's w_down_t row (each lane its chunks, 8 columns a chunk)
template <class S>
__device__ __forceinline__ void down_axpy(const TaskOf<S, kDownT> &d, float act, int lane,
                                          float (&p)[TaskOf<S, kDownT>::U][8]) {
    using T = TaskOf<S, kDownT>;
#pragma unroll
    for (int u = 0; u < T::U; ++u) {
        if (lane + u * kWarpSize < T::kChunks) {
            float f[8];
            unpack8(d.w[0][u], f);
#pragma unroll
            for (int e = 0; e < 8; ++e) p[u][e] = __fmaf_rn(act, f[e], p[u][e]);
        }
    }
}
template <class S, bool kDownEarly, int K>
__global__ void __launch_bounds__(kThreads) ffn_red_kernel(const Model m, const Acts a, int l) {
    using T = TaskOf<S, kDownT>;
    constexpr int R = Prefetch<S, kGateUp>::R;
    static_assert(Prefetch<S, kDownT>::R == R, "one w_down_t row a gate/up task");
    __shared__ FfnRedSmem<S> sm;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int first = blockIdx.x * kWarps + warp, stride = gridDim.x * kWarps;
    Prefetch<S, kGateUp> pf;
    prefetch(pf, m, l, first, stride, lane);
    Prefetch<S, kDownT> pd;
    const uint16_t *wdt = weights<S, kDownT>(m, l);
    if constexpr (kDownEarly) {
        prefetch(pd, m, l, first, stride, lane);
    } else {
#pragma unroll
        for (int k = 0; k < R; ++k) {
            const int task = first + k * stride;
            if (task < S::I)
                for (int c = lane * 8; c < S::H; c += kWarpSize * 8) prefetch_l2(wdt + (size_t)task * S::H + c);
        }
    }
    Gamma<S::H> gm;
    load_gamma(gm, m.ln_post + (size_t)l * S::H);
    pdl_wait();
    pdl_launch_dependents();
    trace(a, l, 3, 0);
    stage_norm<S::H>(a.x, gm, sm.raw, sm.xs);
    float p[T::U][8];
#pragma unroll
    for (int u = 0; u < T::U; ++u)
#pragma unroll
        for (int e = 0; e < 8; ++e) p[u][e] = 0.f;
    float acts[R];
    float acc[2];
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const int task = first + k * stride;
        acts[k] = 0.f;
        if (task < S::I) {
            dot_task(pf.t[k], sm.xs, lane, acc);
            acts[k] = swiglu_act<S>(acc);
            if constexpr (kDownEarly) down_axpy<S>(pd.t[k], acts[k], lane, p);
        }
    }
    if constexpr (!kDownEarly) {
        prefetch(pd, m, l, first, stride, lane);
#pragma unroll
        for (int k = 0; k < R; ++k)
            if (first + k * stride < S::I) down_axpy<S>(pd.t[k], acts[k], lane, p);
    }
    for (int task = first + R * stride; task < S::I; task += stride) {   // past the prefetch depth
        TaskOf<S, kGateUp> t;
        load_task<S, kGateUp>(t, weights<S, kGateUp>(m, l), task, lane);
        T d;
        load_task<S, kDownT>(d, wdt, task, lane);
        dot_task(t, sm.xs, lane, acc);
        down_axpy<S>(d, swiglu_act<S>(acc), lane, p);
    }
    trace(a, l, 3, 1);
    trace(a, l, 4, 0);
#pragma unroll
    for (int u = 0; u < T::U; ++u) {
        const int c = lane + u * kWarpSize;
        if (c < T::kChunks)
#pragma unroll
            for (int e = 0; e < 8; ++e) sm.part[warp][c * 8 + e] = p[u][e];
    }
    __syncthreads();
    for (int j = threadIdx.x; j < S::H; j += kThreads) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum = __fadd_rn(sum, sm.part[w][j]);
        red_add_u64(a.xq + (size_t)(blockIdx.x % K) * S::H + j, to_fixed(sum));
    }
    if (a.trace != nullptr) {
        __syncthreads();
        trace(a, l, 4, 1);
    }
}
// The step's output: x = xq after the last layer.
template <int K>
__global__ void __launch_bounds__(kThreads) fixed_final_kernel(const Acts a, int n) {
    pdl_wait();
    for (int i = blockIdx.x * kThreads + threadIdx.x; i < n; i += gridDim.x * kThreads) a.x[i] = xq_value<K>(a.xq, i, n);
}

// ---- (H) the O projection inside the attention kernel: four kernels a layer ---------------------
// NH x SLICES blocks: block (h, slice) computes head h's whole attention (one split: a short
// context), as the baseline's item does, keeps the head's output in shared memory, and multiplies
// it by its slice of OR rows of w_o's head-h columns: attn_part[h][rows] = w_o[rows, head h] *
// out_h. No block waits for another: every block of head h repeats the head's attention (the K/V
// rows come from L2 after the first), and the next kernels take the sum over heads (x_mid, head
// order) where they read the residual. The slice's weights (OR x HD, 16-byte chunks, lanes of a
// row adjacent) load before the PDL wait with the K/V rows. The O sums are taken in another order
// than the baseline's (per head, then across heads), so the variant is held to the reference.
template <class S>
struct AttnO {
    static constexpr int OR = S::H == 576 ? 48 : 128;   // rows a block: NH * H / OR blocks <= 132
    static constexpr int SLICES = S::H / OR, CH = S::HD / 8, NCH = OR * CH;
    static constexpr int K = (NCH + kThreads - 1) / kThreads;   // chunks a thread
    static_assert(S::H % OR == 0 && kWarpSize % CH == 0, "slices");
};
// kRed (attn_o_red): the rows go to the fixed-point residual xq by integer atomic adds instead.
template <class S, bool kRed>
__global__ void __launch_bounds__(kThreads) attn_o_kernel(const Model m, const Acts a, int l) {
    using D = Dims<S>;
    using A = AttnO<S>;
    __shared__ Smem<S> sm;
    __shared__ alignas(16) float head_out[S::HD];
    const int h = blockIdx.x / A::SLICES, slice = blockIdx.x % A::SLICES, g = h / D::GRP;
    const int r0 = slice * A::OR;
    AttnRegs<S> r;
    attn_prefetch(r, m, l, h, 0);
    const uint16_t *wo = m.w_o + (size_t)l * S::H * D::ATT + (size_t)h * S::HD;
    uint4 w[A::K];
#pragma unroll
    for (int k = 0; k < A::K; ++k) {
        const int ci = threadIdx.x + k * kThreads;
        w[k] = ci < A::NCH ? __ldcs(reinterpret_cast<const uint4 *>(wo + (size_t)(r0 + ci / A::CH) * D::ATT) + ci % A::CH)
                           : make_uint4(0u, 0u, 0u, 0u);
    }
    pdl_wait();
    pdl_launch_dependents();
    trace(a, l, 1, 0);
    attention_core(r, m, a, nullptr, l, h, 0, sm, a.qkv + h * S::HD, a.qkv + D::ATT + g * S::HD,
                   a.qkv + D::ATT + S::NKV * S::HD + g * S::HD, true, head_out, slice == 0);
    __syncthreads();
    trace(a, l, 1, 1);
    trace(a, l, 2, 0);
    const float4 *ho = reinterpret_cast<const float4 *>(head_out);
#pragma unroll
    for (int k = 0; k < A::K; ++k) {
        const int ci = threadIdx.x + k * kThreads, c = ci % A::CH;
        float d = ci < A::NCH ? dot8(w[k], ho[2 * c], ho[2 * c + 1], 0.f) : 0.f;
#pragma unroll
        for (int o = A::CH / 2; o > 0; o >>= 1) d = __fadd_rn(d, __shfl_xor_sync(0xffffffffu, d, o));
        if (ci < A::NCH && c == 0) {
            if constexpr (kRed) red_add_u64(a.xq + r0 + ci / A::CH, to_fixed(d));
            else a.attn_part[(size_t)h * S::H + r0 + ci / A::CH] = d;
        }
    }
    if (a.trace != nullptr) {
        __syncthreads();
        trace(a, l, 2, 1);
    }
}

// ---- calibration: the cost of a kernel boundary alone --------------------------------------
// kCalEmpty: a kernel that only waits (PDL) and lets the next one launch. kCalChain: each block
// also reads the whole of the previous kernel's output (n floats, from L2), sums it over the block
// and writes one element of its own output: one dependent L2 round trip and a block reduction a
// kernel, with no weights, the least a GEMV in the chain does after its wait.
enum CalMode { kCalEmpty = 0, kCalChain = 1 };
template <int MODE>
__global__ void __launch_bounds__(kThreads) calibration_kernel(const float *in, float *out, int n) {
    __shared__ float red[kWarps];
    pdl_wait();
    pdl_launch_dependents();
    if (MODE == kCalChain) {
        float v = 0.f;
        for (int i = threadIdx.x; i < n; i += kThreads) v = __fadd_rn(v, __ldcg(in + i));
        v = warp_sum(v);
        if (threadIdx.x % kWarpSize == 0) red[threadIdx.x / kWarpSize] = v;
        __syncthreads();
        if (threadIdx.x == 0) {
            float total = 0.f;
            for (int w = 0; w < kWarps; ++w) total = __fadd_rn(total, red[w]);
            out[blockIdx.x] = __fmul_rn(total, 0.5f);
        }
    }
}

// A square GEMV (N x N bf16, a warp a row, grid N / 8) built up step by step, to see what each
// part of a GEMV kernel adds to a dependent kernel's cost: kGcStage stages the input and writes
// out[row] = in[row]; kGcDot adds the row's weights (loaded before the wait) and the dot product;
// kGcNormWarp adds an RMSNorm whose squares every warp sums itself (norm_raw); kGcNormBlock the
// same norm through a block reduction and a normalising pass (two more barriers); kGcNormFold
// the norm's scale applied after the dot, y = inv_rms * W x (each warp's sum of squares left
// beside the staged x before the staging's barrier, summed by every thread after it: no further
// barrier or pass); kGcResid is kGcDot plus the residual's read after the dot.
enum GemvCal { kGcStage, kGcDot, kGcNormWarp, kGcNormBlock, kGcNormFold, kGcResid, kGemvCals };
template <int N, int V>
__global__ void __launch_bounds__(kThreads) calibration_gemv(const uint16_t *w, const float *in, float *out) {
    __shared__ alignas(16) float raw[N];
    __shared__ alignas(16) float xs[N];
    __shared__ float red[kWarps];
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int row = blockIdx.x * kWarps + warp;
    Task<N, 1> t;
    if (V != kGcStage) {
        const uint4 *wr = reinterpret_cast<const uint4 *>(w + (size_t)row * N);
#pragma unroll
        for (int u = 0; u < Task<N, 1>::U; ++u) {
            const int c = lane + u * kWarpSize;
            t.w[0][u] = c < Task<N, 1>::kChunks ? __ldcs(wr + c) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
    Gamma<N> ones;
#pragma unroll
    for (int k = 0; k < (N + kThreads - 1) / kThreads; ++k) ones.g[k] = 1.f;
    pdl_wait();
    pdl_launch_dependents();
    float ss = 0.f;
#pragma unroll 4
    for (int i = threadIdx.x; i < N; i += kThreads) {
        const float v = __ldcg(in + i);
        (V == kGcNormWarp ? raw : xs)[i] = v;
        ss = __fmaf_rn(v, v, ss);
    }
    if (V == kGcNormFold) {
        ss = warp_sum(ss);
        if (lane == 0) red[warp] = ss;
    }
    __syncthreads();
    float inv = 1.f;
    if (V == kGcNormFold) {
        float total = 0.f;
#pragma unroll
        for (int k = 0; k < kWarps; ++k) total = __fadd_rn(total, red[k]);
        inv = inv_rms(total, N);
    }
    if (V == kGcNormWarp) norm_raw(ones, raw, xs);
    if (V == kGcNormBlock) {
        ss = warp_sum(ss);
        if (lane == 0) red[warp] = ss;
        __syncthreads();
        float total = 0.f;
#pragma unroll
        for (int k = 0; k < kWarps; ++k) total = __fadd_rn(total, red[k]);
        const float inv = inv_rms(total, N);
        for (int i = threadIdx.x; i < N; i += kThreads) xs[i] = __fmul_rn(xs[i], inv);
        __syncthreads();
    }
    if (V == kGcStage) {
        if (lane == 0) out[row] = xs[row];
        return;
    }
    float acc[1];
    dot_task(t, xs, lane, acc);
    if (lane == 0) out[row] = V == kGcResid ? __fadd_rn(__ldcg(in + row), acc[0]) : __fmul_rn(inv, acc[0]);
}

// ---- initialisation ---------------------------------------------------------------------
__host__ __device__ inline uint32_t hash32(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t)x;
}
// p[i] = bf16(offset + scale * u), u uniform in [-1, 1) from (seed, i)
__global__ void fill_bf16(uint16_t *p, size_t n, uint32_t seed, float offset, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float u = (float)(hash32(((uint64_t)seed << 40) ^ i) >> 8) * (2.0f / 16777216.0f) - 1.0f;
        p[i] = to_bf(offset + scale * u);
    }
}
// out[m][c][r] = in[m][r][c] for `mats` matrices of rows x cols
__global__ void transpose_bf16(const uint16_t *in, uint16_t *out, int mats, int rows, int cols) {
    const size_t n = (size_t)mats * rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t mat = i / ((size_t)rows * cols), rc = i % ((size_t)rows * cols);
        const size_t r = rc / cols, c = rc % cols;
        out[(mat * cols + c) * rows + r] = in[i];
    }
}
// rows [row0, rows) of each of the L layers of a [L][rows][width] bf16 array set to zero
__global__ void zero_rows(uint16_t *p, int layers, int rows, int row0, int width) {
    const size_t n = (size_t)layers * (rows - row0) * width;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t l = i / ((size_t)(rows - row0) * width), rest = i % ((size_t)(rows - row0) * width);
        p[(l * rows + row0) * width + rest] = 0;
    }
}

// ---- host side -------------------------------------------------------------------------
float host_bf(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
uint16_t host_to_bf(float f) {   // round to nearest even, as __float2bfloat16_rn (finite values)
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
std::vector<uint16_t> fetch_bf(const uint16_t *d, size_t n) {
    std::vector<uint16_t> h(n);
    CK(cudaMemcpy(h.data(), d, n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    return h;
}
double rel_l2(const std::vector<double> &ref, const float *got, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; ++i) {
        const double d = (double)got[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// The step on the host in fp64 over all layers (weights read back from the device). Row C's k and
// v are rounded to bf16 as the cache holds them, and used as such, as on the device.
template <class S>
void cpu_reference(const Model &m, const std::vector<float> &x_in, const std::vector<float> &rcos,
                   const std::vector<float> &rsin, std::vector<double> &x, std::vector<double> &krow,
                   std::vector<double> &vrow) {
    using D = Dims<S>;
    constexpr int H = S::H, HD = S::HD, NH = S::NH, NKV = S::NKV, I = S::I, half = HD / 2;
    const int C = m.ctx;
    x.assign(x_in.begin(), x_in.end());
    krow.assign((size_t)S::L * NKV * HD, 0.0);
    vrow.assign((size_t)S::L * NKV * HD, 0.0);
    auto rmsnorm = [](const std::vector<double> &v, const std::vector<uint16_t> &w, size_t off, int n) {
        double ss = 0;
        for (int i = 0; i < n; ++i) ss += v[i] * v[i];
        const double inv = 1.0 / std::sqrt(ss / n + (double)kEps);
        std::vector<double> o(n);
        for (int i = 0; i < n; ++i) o[i] = v[i] * inv * host_bf(w[off + i]);
        return o;
    };
    auto rope = [&](std::vector<double> &v) {
        std::vector<double> o(HD);
        for (int t = 0; t < HD; ++t) {
            const double c = rcos[t % half], sn = rsin[t % half];
            o[t] = t < half ? v[t] * c - v[t + half] * sn : v[t] * c + v[t - half] * sn;
        }
        v = o;
    };
    const size_t row_stride = (size_t)NKV * HD;
    const std::vector<uint16_t> ln_in = fetch_bf(m.ln_in, (size_t)S::L * H);
    const std::vector<uint16_t> ln_post = fetch_bf(m.ln_post, (size_t)S::L * H);
    std::vector<uint16_t> qn, kn;
    if (S::QKN) qn = fetch_bf(m.q_norm, (size_t)S::L * HD), kn = fetch_bf(m.k_norm, (size_t)S::L * HD);
    for (int l = 0; l < S::L; ++l) {
        const std::vector<uint16_t> wqkv = fetch_bf(m.w_qkv + (size_t)l * D::QKV * H, (size_t)D::QKV * H);
        const std::vector<uint16_t> wo = fetch_bf(m.w_o + (size_t)l * H * D::ATT, (size_t)H * D::ATT);
        const std::vector<uint16_t> wgu = fetch_bf(m.w_gu + (size_t)l * 2 * I * H, (size_t)2 * I * H);
        const std::vector<uint16_t> wd = fetch_bf(m.w_down + (size_t)l * H * I, (size_t)H * I);
        const std::vector<uint16_t> kc = fetch_bf(m.k_cache + (size_t)l * m.max_ctx * row_stride, (size_t)C * row_stride);
        const std::vector<uint16_t> vc = fetch_bf(m.v_cache + (size_t)l * m.max_ctx * row_stride, (size_t)C * row_stride);
        // (a)
        const std::vector<double> xn = rmsnorm(x, ln_in, (size_t)l * H, H);
        std::vector<double> qkv(D::QKV);
        for (int r = 0; r < D::QKV; ++r) {
            double s = 0;
            for (int c = 0; c < H; ++c) s += host_bf(wqkv[(size_t)r * H + c]) * xn[c];
            qkv[r] = s;
        }
        // (b)
        std::vector<double> kb((size_t)NKV * HD), vb((size_t)NKV * HD), attn(D::ATT);
        for (int g = 0; g < NKV; ++g) {
            std::vector<double> k(qkv.begin() + D::ATT + g * HD, qkv.begin() + D::ATT + (g + 1) * HD);
            if (S::QKN) k = rmsnorm(k, kn, (size_t)l * HD, HD);
            rope(k);
            for (int d = 0; d < HD; ++d) {
                kb[(size_t)g * HD + d] = host_bf(host_to_bf((float)k[d]));
                vb[(size_t)g * HD + d] = host_bf(host_to_bf((float)qkv[D::ATT + NKV * HD + g * HD + d]));
            }
        }
        std::copy(kb.begin(), kb.end(), krow.begin() + (size_t)l * NKV * HD);
        std::copy(vb.begin(), vb.end(), vrow.begin() + (size_t)l * NKV * HD);
        const double scale = 1.0 / std::sqrt((double)HD);
        for (int h = 0; h < NH; ++h) {
            const int g = h / D::GRP;
            std::vector<double> q(qkv.begin() + h * HD, qkv.begin() + (h + 1) * HD);
            if (S::QKN) q = rmsnorm(q, qn, (size_t)l * HD, HD);
            rope(q);
            std::vector<double> sc(C + 1);
            double mx = -1e300;
            for (int j = 0; j <= C; ++j) {
                double s = 0;
                for (int d = 0; d < HD; ++d)
                    s += q[d] * (j < C ? host_bf(kc[(size_t)j * row_stride + g * HD + d]) : kb[(size_t)g * HD + d]);
                sc[j] = s * scale;
                mx = std::max(mx, sc[j]);
            }
            double total = 0;
            for (int j = 0; j <= C; ++j) total += (sc[j] = std::exp(sc[j] - mx));
            for (int d = 0; d < HD; ++d) {
                double o = 0;
                for (int j = 0; j <= C; ++j)
                    o += sc[j] * (j < C ? host_bf(vc[(size_t)j * row_stride + g * HD + d]) : vb[(size_t)g * HD + d]);
                attn[h * HD + d] = o / total;
            }
        }
        // (c)
        for (int r = 0; r < H; ++r) {
            double s = 0;
            for (int c = 0; c < D::ATT; ++c) s += host_bf(wo[(size_t)r * D::ATT + c]) * attn[c];
            x[r] += s;
        }
        // (d)
        const std::vector<double> xn2 = rmsnorm(x, ln_post, (size_t)l * H, H);
        std::vector<double> act(I);
        for (int i = 0; i < I; ++i) {
            double gt = 0, up = 0;
            for (int c = 0; c < H; ++c) {
                gt += host_bf(wgu[(size_t)i * H + c]) * xn2[c];
                up += host_bf(wgu[(size_t)(I + i) * H + c]) * xn2[c];
            }
            act[i] = gt / (1.0 + std::exp(-gt)) * up;
        }
        // (e)
        for (int r = 0; r < H; ++r) {
            double s = 0;
            for (int c = 0; c < I; ++c) s += host_bf(wd[(size_t)r * I + c]) * act[c];
            x[r] += s;
        }
    }
}

template <typename... KArgs, typename... Args>
void launch_smem(void (*kernel)(KArgs...), int grid, int smem, cudaStream_t stream, bool pdl, bool cooperative,
                 Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[2];
    int n = 0;
    if (pdl) {
        attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[n].val.programmaticStreamSerializationAllowed = 1;
        ++n;
    }
    if (cooperative) {
        attr[n].id = cudaLaunchAttributeCooperative;
        attr[n].val.cooperative = 1;
        ++n;
    }
    cfg.attrs = attr;
    cfg.numAttrs = n;
    CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), int grid, cudaStream_t stream, bool pdl, bool cooperative, Args... args) {
    launch_smem(kernel, grid, 0, stream, pdl, cooperative, args...);
}

// A clustered kernel: grid blocks in clusters of `cluster`, `smem` bytes of dynamic shared memory.
template <typename... KArgs, typename... Args>
void launch_cluster(void (*kernel)(KArgs...), int grid, int cluster, int smem, cudaStream_t stream, bool pdl,
                    Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[2];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 2 : 1;
    CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// How many clusters of the kernel can be resident at once (0: it cannot run at all).
template <typename... KArgs>
int max_clusters(void (*kernel)(KArgs...), int grid, int cluster, int smem) {
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    if (cluster > 8) CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int n = 0;
    const cudaError_t err = cudaOccupancyMaxActiveClusters(&n, kernel, &cfg);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

constexpr int kVariants = 15;   // baseline, persistent, persistent_barrier, clusters of 8, of 16, o_attn, gated,
                                // qkv_attn, ffn_red, ffn_red_l2, ffn_red_x8, ffn_red_l2_x8, attn_o, attn_o_red,
                                // qkv_local
constexpr int kClusterOf[kVariants] = {0, 0, 0, 8, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
constexpr int kOAttn = 5, kOAttnGated = 6, kQkvAttn = 7, kFfnRed = 8, kFfnRedL2 = 9, kFfnRedX8 = 10,
              kFfnRedL2X8 = 11, kAttnO = 12, kAttnORed = 13, kQkvLocal = 14;
constexpr bool is_ffn_red(int v) { return v >= kFfnRed && v <= kFfnRedL2X8; }

struct VariantResult {
    std::string name;
    double ref_err_x = 0, ref_err_k = 0, ref_err_v = 0;   // against the CPU reference
    double us_token = 0, us_layer = 0, frac_floor = 0, speedup = 0;
    bool stable = false, no_abort = false;
    std::vector<double> handover_us, work_us;   // --trace, per phase
};
struct ConfigResult {
    std::string shape;
    int ctx = 0, splits = 0, sms = 0, iters = 0;
    double bytes_layer = 0, floor_us_layer = 0, bw_gbs = 0;
    std::vector<VariantResult> variants;
    bool bit_identical = false, kv_identical = false, pass = false;
    double ref_err_x = 0, ref_err_k = 0, ref_err_v = 0;
    int persistent_regs = 0, persistent_local = 0;
};

// --trace: per phase, mean over layers 1..L-1 of one replay: hand-over = the median block's start
// of the phase's work minus the last block's end of the phase before; work = the last block's
// end minus the median start; span = the last end minus the last end before (the spans add up
// to the layer).
void report_trace(VariantResult &vr, const std::vector<unsigned long long> &tr, int layers) {
    const char *phase[5] = {"qkv", "attention", "o+res", "gate/up", "down+res"};
    double hop[5] = {0}, work[5] = {0}, span[5] = {0};
    double spread[5][6] = {};   // starts: first, median, last; ends: first, median, last (after the last end before)
    auto at = [&](int l, int p, int b, int k) { return tr[(((size_t)l * 5 + p) * kTraceBlocks + b) * 2 + k]; };
    std::vector<unsigned long long> end_prev(1, 0);
    for (int l = 0; l < layers; ++l) {
        for (int p = 0; p < 5; ++p) {
            std::vector<unsigned long long> starts, ends;
            unsigned long long last_end = 0;
            for (int b = 0; b < kTraceBlocks; ++b) {
                if (at(l, p, b, 0)) starts.push_back(at(l, p, b, 0));
                if (at(l, p, b, 1)) ends.push_back(at(l, p, b, 1));
                last_end = std::max(last_end, at(l, p, b, 1));
            }
            if (starts.empty() || ends.empty()) return;
            std::sort(starts.begin(), starts.end());
            std::sort(ends.begin(), ends.end());
            const double med = (double)starts[starts.size() / 2];
            if (l > 0) {
                const double e0 = (double)end_prev[0];
                const double q[6] = {(double)starts.front(), med, (double)starts.back(), (double)ends.front(),
                                     (double)ends[ends.size() / 2], (double)ends.back()};
                for (int k = 0; k < 6; ++k) spread[p][k] += (q[k] - e0) * 1e-3;
                hop[p] += (med - (double)end_prev[0]) * 1e-3;
                work[p] += ((double)last_end - med) * 1e-3;
                span[p] += ((double)last_end - (double)end_prev[0]) * 1e-3;
            }
            end_prev[0] = last_end;
        }
    }
    printf("  trace %-18s", vr.name.c_str());
    double total = 0;
    for (int p = 0; p < 5; ++p) {
        printf(" | %s %.2f+%.2f", phase[p], hop[p] / (layers - 1), work[p] / (layers - 1));
        vr.handover_us.push_back(hop[p] / (layers - 1));
        vr.work_us.push_back(work[p] / (layers - 1));
        total += span[p] / (layers - 1);
    }
    printf(" | layer %.2f us\n", total);
    printf("    blocks' starts and ends (first / median / last), us after the phase before ended:\n");
    for (int p = 0; p < 5; ++p) {
        const double n = layers - 1;
        printf("      %-9s start %.2f / %.2f / %.2f   end %.2f / %.2f / %.2f\n", phase[p], spread[p][0] / n,
               spread[p][1] / n, spread[p][2] / n, spread[p][3] / n, spread[p][4] / n, spread[p][5] / n);
    }
}

// The clustered variants' trace, mean over layers 1..L-1 of one replay: each point's median over
// the blocks, in us after the previous kernel's last block ended (the ends: the last block's).
void report_fused_trace(const char *name, const std::vector<unsigned long long> &tr, int layers) {
    static const char *point[kStamps] = {"entry", "wait", "staged", "qkv synced", "heads synced", "end",
                                         "entry", "wait", "staged", "act synced", "gathered", "end"};
    auto at = [&](int l, int p, int b) { return tr[((size_t)l * kStamps + p) * kTraceBlocks + b]; };
    double sum[kStamps] = {0}, last[kStamps] = {0};
    for (int l = 0; l < layers; ++l) {
        for (int k = 0; k < 2; ++k) {   // the attention kernel, then the FFN kernel
            const int p0 = k * 6;
            // the previous kernel's end: the FFN kernel of layer l - 1, or this layer's attention
            unsigned long long ref = 0;
            const int prev_end = k == 0 ? kStampFfnEnd : kStampAttnEnd, prev_l = k == 0 ? l - 1 : l;
            if (prev_l < 0) continue;
            for (int b = 0; b < kTraceBlocks; ++b) ref = std::max(ref, at(prev_l, prev_end, b));
            for (int p = p0; p < p0 + 6; ++p) {
                std::vector<double> v;
                for (int b = 0; b < kTraceBlocks; ++b)
                    if (at(l, p, b)) v.push_back((double)at(l, p, b) - (double)ref);
                if (v.empty()) return;
                std::sort(v.begin(), v.end());
                if (l > 0) sum[p] += (p == p0 + 5 ? v.back() : v[v.size() / 2]) * 1e-3, last[p] += v.back() * 1e-3;
            }
        }
    }
    printf("  trace %s, us after the previous kernel's end (medians; end: the last block)\n    attention:", name);
    for (int p = 0; p < 6; ++p) printf(" %s %.2f%s", point[p], sum[p] / (layers - 1), p < 5 ? "," : "\n    FFN:      ");
    for (int p = 6; p < 12; ++p) printf(" %s %.2f%s", point[p], sum[p] / (layers - 1), p < 11 ? "," : "\n");
    printf("    the last block at each point:\n    attention:");
    for (int p = 0; p < 6; ++p) printf(" %s %.2f%s", point[p], last[p] / (layers - 1), p < 5 ? "," : "\n    FFN:      ");
    for (int p = 6; p < 12; ++p) printf(" %s %.2f%s", point[p], last[p] / (layers - 1), p < 11 ? "," : "\n");
}

template <class S>
ConfigResult run_config(int ctx, int iters, int sms, double bw, bool do_trace) {
    using D = Dims<S>;
    ConfigResult res;
    res.shape = S::kName, res.ctx = ctx, res.sms = sms, res.iters = iters, res.bw_gbs = bw / 1e9;
    constexpr int L = S::L, H = S::H, HD = S::HD, NKV = S::NKV, I = S::I;

    // persistent kernel: one block per SM, all resident
    int per_sm_fine = 0, per_sm_bar = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_fine, persistent_kernel<S, false>, kThreads, 0));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_bar, persistent_kernel<S, true>, kThreads, 0));
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, persistent_kernel<S, false>));
    res.persistent_regs = fa.numRegs, res.persistent_local = (int)fa.localSizeBytes;
    printf("%s: persistent kernel %d registers a thread, %d bytes local, %zu bytes shared; blocks a SM: %d (barrier variant %d)\n",
           S::kName, fa.numRegs, (int)fa.localSizeBytes, fa.sharedSizeBytes, per_sm_fine, per_sm_bar);
    if (per_sm_fine < 1 || per_sm_bar < 1) {
        fprintf(stderr, "REFUSED: the persistent kernel cannot place one %d-thread block on every SM "
                        "(occupancy %d / %d); its waits would deadlock. Nothing run for %s.\n",
                kThreads, per_sm_fine, per_sm_bar, S::kName);
        exit(1);
    }

    // attention split: each split one batch of a block (rows <= RB)
    const int splits = (ctx + 1 + D::RB - 1) / D::RB;
    const int split_rows = (ctx + 1 + splits - 1) / splits;
    res.splits = splits;
    if (S::NH > 32 || S::NKV > 16) { fprintf(stderr, "Sync arrays too small\n"); exit(1); }

    // weights and cache
    const size_t n_qkv = (size_t)L * D::QKV * H, n_o = (size_t)L * H * D::ATT, n_gu = (size_t)L * 2 * I * H,
                 n_down = (size_t)L * H * I, n_kv = (size_t)L * (ctx + 1) * NKV * HD;
    uint16_t *ln_in, *ln_post, *q_norm, *k_norm, *w_qkv, *w_o, *w_gu, *w_down, *k_cache, *v_cache;
    CK(cudaMalloc(&ln_in, (size_t)L * H * 2));
    CK(cudaMalloc(&ln_post, (size_t)L * H * 2));
    CK(cudaMalloc(&q_norm, (size_t)L * HD * 2));
    CK(cudaMalloc(&k_norm, (size_t)L * HD * 2));
    CK(cudaMalloc(&w_qkv, n_qkv * 2));
    CK(cudaMalloc(&w_o, n_o * 2));
    CK(cudaMalloc(&w_gu, n_gu * 2));
    CK(cudaMalloc(&w_down, n_down * 2));
    uint16_t *w_down_t;
    CK(cudaMalloc(&w_down_t, n_down * 2));
    CK(cudaMalloc(&k_cache, n_kv * 2));
    CK(cudaMalloc(&v_cache, n_kv * 2));
    auto fill = [](uint16_t *p, size_t n, uint32_t seed, float off, float scale) {
        fill_bf16<<<1024, 256>>>(p, n, seed, off, scale);
        CK(cudaGetLastError());
    };
    fill(ln_in, (size_t)L * H, 1, 1.f, 0.05f);
    fill(ln_post, (size_t)L * H, 2, 1.f, 0.05f);
    fill(q_norm, (size_t)L * HD, 3, 1.f, 0.05f);
    fill(k_norm, (size_t)L * HD, 4, 1.f, 0.05f);
    fill(w_qkv, n_qkv, 5, 0.f, 0.05f);
    fill(w_o, n_o, 6, 0.f, 0.05f);
    fill(w_gu, n_gu, 7, 0.f, 0.05f);
    fill(w_down, n_down, 8, 0.f, 0.05f);
    transpose_bf16<<<1024, 256>>>(w_down, w_down_t, L, H, I);
    CK(cudaGetLastError());
    fill(k_cache, n_kv, 9, 0.f, 1.f);
    fill(v_cache, n_kv, 10, 0.f, 1.f);
    zero_rows<<<256, 256>>>(k_cache, L, ctx + 1, ctx, NKV * HD);
    CK(cudaGetLastError());
    zero_rows<<<256, 256>>>(v_cache, L, ctx + 1, ctx, NKV * HD);
    CK(cudaGetLastError());

    // RoPE at position ctx (host fp64, rounded to fp32; the reference uses the same values)
    std::vector<float> rcos(HD / 2), rsin(HD / 2);
    for (int i = 0; i < HD / 2; ++i) {
        const double ang = (double)ctx * std::pow(kRopeTheta, -2.0 * i / HD);
        rcos[i] = (float)std::cos(ang), rsin[i] = (float)std::sin(ang);
    }
    float *d_cos, *d_sin;
    CK(cudaMalloc(&d_cos, HD / 2 * sizeof(float)));
    CK(cudaMalloc(&d_sin, HD / 2 * sizeof(float)));
    CK(cudaMemcpy(d_cos, rcos.data(), HD / 2 * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_sin, rsin.data(), HD / 2 * sizeof(float), cudaMemcpyHostToDevice));

    Model m = {ln_in, ln_post, q_norm, k_norm, w_qkv, w_o, w_gu, w_down, k_cache, v_cache, d_cos, d_sin,
               ctx, ctx + 1, splits, split_rows, w_down_t};

    // activations
    std::vector<float> x_in(H);
    for (int i = 0; i < H; ++i) x_in[i] = (float)(hash32(0xabcdef00ull + i) >> 8) * (2.0f / 16777216.0f) - 1.0f;
    float *d_x_in, *d_x, *d_qkv, *d_attn, *d_act, *d_po, *d_pml;
    CK(cudaMalloc(&d_x_in, H * sizeof(float)));
    CK(cudaMalloc(&d_x, H * sizeof(float)));
    CK(cudaMalloc(&d_qkv, D::QKV * sizeof(float)));
    CK(cudaMalloc(&d_attn, D::ATT * sizeof(float)));
    CK(cudaMalloc(&d_act, I * sizeof(float)));
    CK(cudaMalloc(&d_po, (size_t)S::NH * splits * HD * sizeof(float)));
    CK(cudaMalloc(&d_pml, (size_t)S::NH * splits * 2 * sizeof(float)));
    CK(cudaMemcpy(d_x_in, x_in.data(), H * sizeof(float), cudaMemcpyHostToDevice));
    unsigned long long *d_xq;
    CK(cudaMalloc(&d_xq, (size_t)kMaxCopies * H * sizeof(unsigned long long)));
    Acts a = {d_x_in, d_x, d_qkv, d_attn, d_act, d_po, d_pml, nullptr};
    a.xq = d_xq;
    Sync *sync;   // [4]: baseline (tickets only), persistent, persistent_barrier, qkv_attn
    CK(cudaMalloc(&sync, 4 * sizeof(Sync)));
    CK(cudaMemset(sync, 0, 4 * sizeof(Sync)));
    unsigned *groups;   // qkv_attn: [L][NKV] QKV rows done per KV group
    CK(cudaMalloc(&groups, (size_t)L * NKV * sizeof(unsigned)));
    CK(cudaMemset(groups, 0, (size_t)L * NKV * sizeof(unsigned)));

    // the clustered variants: their own split partials (splits a multiple of the cluster size)
    auto fused_splits = [&](int cs) { return cs * ((splits + cs - 1) / cs); };
    const int fs_max = std::max(fused_splits(8), fused_splits(16));
    float *d_xres, *d_qkvh, *d_apart, *d_fpart, *d_fpo, *d_fpml;
    CK(cudaMalloc(&d_xres, H * sizeof(float)));
    CK(cudaMalloc(&d_qkvh, (size_t)S::NH * 3 * HD * sizeof(float)));
    CK(cudaMalloc(&d_apart, (size_t)S::NH * H * sizeof(float)));
    CK(cudaMalloc(&d_fpart, (size_t)(kFfnBlocks / 8) * H * sizeof(float)));
    CK(cudaMalloc(&d_fpo, (size_t)S::NH * fs_max * HD * sizeof(float)));
    CK(cudaMalloc(&d_fpml, (size_t)S::NH * fs_max * 2 * sizeof(float)));
    a.attn_part = d_apart;   // attn_o's heads' shares of the O projection
    Acts af = a;
    af.part_o = d_fpo, af.part_ml = d_fpml, af.x_res = d_xres, af.qkvh = d_qkvh, af.attn_part = d_apart,
    af.ffn_part = d_fpart;
    auto fused_model = [&](int cs) {
        Model fm = m;
        fm.splits = fused_splits(cs);
        fm.split_rows = (ctx + 1 + fm.splits - 1) / fm.splits;
        return fm;
    };
    bool ran[kVariants] = {true, true, true, false, false, false, false, false, true, true, true, true, false, false,
                           false};
    auto fused_runs = [&](auto attn_kernel, auto ffn_kernel, int cs, int attn_smem, int ffn_smem) {
        const int na = max_clusters(attn_kernel, S::NH * cs, cs, attn_smem);
        const int nf = max_clusters(ffn_kernel, kFfnBlocks, cs, ffn_smem);
        printf("%s: clusters of %d: attention kernel %d B dynamic shared, %d clusters resident at most; FFN "
               "kernel %d B, %d clusters\n", S::kName, cs, attn_smem, na, ffn_smem, nf);
        return na > 0 && nf > 0;
    };
    ran[3] = fused_runs(fused_attention_kernel<S, 8>, fused_ffn_kernel<S, 8>, 8, Fused<S, 8>::ATTN_SMEM,
                        Fused<S, 8>::FFN_SMEM);
    ran[4] = fused_runs(fused_attention_kernel<S, 16>, fused_ffn_kernel<S, 16>, 16, Fused<S, 16>::ATTN_SMEM,
                        Fused<S, 16>::FFN_SMEM);
    // o_attn: the K/V rows, the scores and the kernel's static arrays in one block's shared memory
    const int oattn_smem = (int)OAttn<S>::dyn_bytes(ctx + 1);
    int smem_optin = 0;
    CK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    cudaFuncAttributes oa;
    CK(cudaFuncGetAttributes(&oa, o_attn_kernel<S>));
    ran[kOAttn] = ran[kOAttnGated] = oattn_smem + (int)oa.sharedSizeBytes <= smem_optin;
    if (ran[kOAttn])
        CK(cudaFuncSetAttribute(o_attn_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, oattn_smem));
    printf("%s: o_attn kernel %d registers a thread, %zu B static + %d B dynamic shared memory (at most %d)%s\n",
           S::kName, oa.numRegs, oa.sharedSizeBytes, oattn_smem, smem_optin, ran[kOAttn] ? "" : ": not run");
    CK(cudaDeviceSynchronize());
    auto gemv_grid = [&](int tasks) { return std::min(sms, (tasks + kWarps - 1) / kWarps); };
    // qkv_attn: its attention items on the QKV grid's last blocks, and the whole grid resident
    int per_sm_qa = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_qa, qkv_attn_kernel<S>, kThreads, 0));
    ran[kQkvAttn] = per_sm_qa >= 1 && S::NH * splits <= gemv_grid(D::QKV);
    CK(cudaFuncGetAttributes(&oa, qkv_attn_kernel<S>));
    printf("%s: qkv_attn kernel %d registers a thread, %d blocks a SM, grid %d for %d attention items%s\n", S::kName,
           oa.numRegs, per_sm_qa, gemv_grid(D::QKV), S::NH * splits, ran[kQkvAttn] ? "" : ": not run");
    for (int early = 1; early >= 0; --early) {
        CK(cudaFuncGetAttributes(&oa, early ? ffn_red_kernel<S, true, 1> : ffn_red_kernel<S, false, 1>));
        printf("%s: %s kernel %d registers a thread, %zu B local, %zu B shared\n", S::kName,
               early ? "ffn_red" : "ffn_red_l2", oa.numRegs, oa.localSizeBytes, oa.sharedSizeBytes);
    }

    // attn_o: one split a head (the context fits one block's batch of K/V rows)
    Model mo = m;
    mo.splits = 1, mo.split_rows = ctx + 1;
    ran[kAttnO] = ran[kAttnORed] = ctx + 1 <= D::RB;
    CK(cudaFuncGetAttributes(&oa, attn_o_kernel<S, false>));
    printf("%s: attn_o kernel %d registers a thread, %zu B local, grid %d (%d rows a block)%s\n", S::kName, oa.numRegs,
           oa.localSizeBytes, S::NH * AttnO<S>::SLICES, AttnO<S>::OR,
           ran[kAttnO] ? "" : ": not run (the context needs more than one split)");

    // qkv_local: one split a head, and its weight rows' shared memory beside the static arrays
    const int local_smem = QkvLocal<S>::SMEM_BYTES;
    CK(cudaFuncGetAttributes(&oa, qkv_local_kernel<S>));
    ran[kQkvLocal] = splits == 1 && local_smem + (int)oa.sharedSizeBytes <= smem_optin;
    if (ran[kQkvLocal])
        CK(cudaFuncSetAttribute(qkv_local_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, local_smem));
    printf("%s: qkv_local kernel %d registers a thread, %zu B local, %zu B static + %d B dynamic shared (%d rows "
           "in registers, %d in shared memory, %d after the wait, of %d)%s\n", S::kName, oa.numRegs,
           oa.localSizeBytes, oa.sharedSizeBytes, local_smem, QkvLocal<S>::REG_ROWS, QkvLocal<S>::SMEM_ROWS,
           QkvLocal<S>::ROWS - QkvLocal<S>::REG_ROWS - QkvLocal<S>::SMEM_ROWS, QkvLocal<S>::ROWS,
           ran[kQkvLocal] ? "" : ": not run (the context needs more than one split)");

    // graphs
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto build = [&](int v, const Acts &acts) {
        return capture_graph(stream, [&](cudaStream_t) {
            if (v == 0 || v == kOAttn || v == kOAttnGated) {   // a kernel a phase (o_attn: attention in O)
                for (int l = 0; l < L; ++l) {
                    launch(phase_kernel<S, kQkv>, gemv_grid(D::QKV), stream, l > 0, false, m, acts, l);
                    if (v == 0) {
                        launch(attention_kernel<S>, S::NH * splits, stream, true, false, m, acts, sync[0].tickets, l);
                        launch(phase_kernel<S, kO>, gemv_grid(H), stream, true, false, m, acts, l);
                    } else {
                        if (v == kOAttnGated) launch(attention_gate_kernel, S::NH * splits, stream, true, false);
                        launch_smem(o_attn_kernel<S>, gemv_grid(H), oattn_smem, stream, true, false, m, acts, l);
                    }
                    launch(phase_kernel<S, kGateUp>, gemv_grid(I), stream, true, false, m, acts, l);
                    launch(phase_kernel<S, kDown>, gemv_grid(H), stream, true, false, m, acts, l);
                }
            } else if (v == kQkvAttn) {
                for (int l = 0; l < L; ++l) {
                    launch(qkv_attn_kernel<S>, gemv_grid(D::QKV), stream, l > 0, false, m, acts, sync + 3, groups, l);
                    launch(phase_kernel<S, kO>, gemv_grid(H), stream, true, false, m, acts, l);
                    launch(phase_kernel<S, kGateUp>, gemv_grid(I), stream, true, false, m, acts, l);
                    launch(phase_kernel<S, kDown>, gemv_grid(H), stream, true, false, m, acts, l);
                }
            } else if (v == kQkvLocal) {
                for (int l = 0; l < L; ++l) {
                    launch_smem(qkv_local_kernel<S>, S::NH, local_smem, stream, l > 0, false, m, acts, l);
                    launch(phase_kernel<S, kO>, gemv_grid(H), stream, true, false, m, acts, l);
                    launch(phase_kernel<S, kGateUp>, gemv_grid(I), stream, true, false, m, acts, l);
                    launch(phase_kernel<S, kDown>, gemv_grid(H), stream, true, false, m, acts, l);
                }
            } else if (v == kAttnO) {
                for (int l = 0; l < L; ++l) {
                    launch(phase_kernel<S, kQkv>, gemv_grid(D::QKV), stream, l > 0, false, m, acts, l);
                    launch(attn_o_kernel<S, false>, S::NH * AttnO<S>::SLICES, stream, true, false, mo, acts, l);
                    launch(phase_kernel<S, kGateUp, 0, kOpParts>, gemv_grid(I), stream, true, false, m, acts, l);
                    launch(phase_kernel<S, kDown, 0, kOpParts>, gemv_grid(H), stream, true, false, m, acts, l);
                }
            } else if (v == kAttnORed) {
                for (int l = 0; l < L; ++l) {
                    launch(phase_kernel<S, kQkv, 1, kOpFixed>, gemv_grid(D::QKV), stream, l > 0, false, m, acts, l);
                    launch(attn_o_kernel<S, true>, S::NH * AttnO<S>::SLICES, stream, true, false, mo, acts, l);
                    launch(phase_kernel<S, kGateUp, 0, kOpFixed>, gemv_grid(I), stream, true, false, m, acts, l);
                    launch(phase_kernel<S, kDown, 0, kOpFixed>, gemv_grid(H), stream, true, false, m, acts, l);
                }
                launch(fixed_final_kernel<1>, 1, stream, true, false, acts, H);
            } else if (is_ffn_red(v)) {
                auto ffn_red = [&](auto early_tag, auto copies_tag) {
                    constexpr bool EARLY = decltype(early_tag)::value;
                    constexpr int K = decltype(copies_tag)::value;
                    for (int l = 0; l < L; ++l) {
                        launch(phase_kernel<S, kQkv, K>, gemv_grid(D::QKV), stream, l > 0, false, m, acts, l);
                        launch(attention_kernel<S>, S::NH * splits, stream, true, false, m, acts, sync[0].tickets, l);
                        launch(phase_kernel<S, kO, K>, gemv_grid(H), stream, true, false, m, acts, l);
                        launch(ffn_red_kernel<S, EARLY, K>, gemv_grid(I), stream, true, false, m, acts, l);
                    }
                    launch(fixed_final_kernel<K>, 1, stream, true, false, acts, H);
                };
                using T = std::true_type;
                using F = std::false_type;
                using C1 = std::integral_constant<int, 1>;
                using C8 = std::integral_constant<int, 8>;
                if (v == kFfnRed) ffn_red(T(), C1());
                else if (v == kFfnRedL2) ffn_red(F(), C1());
                else if (v == kFfnRedX8) ffn_red(T(), C8());
                else ffn_red(F(), C8());
            } else if (v == 1) {
                launch(persistent_kernel<S, false>, sms, stream, false, true, m, acts, sync + 1);
            } else if (v == 2) {
                launch(persistent_kernel<S, true>, sms, stream, false, true, m, acts, sync + 2);
            } else {   // the clustered body, clusters of kClusterOf[v]
                auto clustered = [&](auto cs_tag) {
                    constexpr int CS = decltype(cs_tag)::value;
                    using F = Fused<S, CS>;
                    const Model fm = fused_model(CS);
                    for (int l = 0; l < L; ++l) {
                        launch_cluster(fused_attention_kernel<S, CS>, S::NH * CS, CS, F::ATTN_SMEM, stream, l > 0, fm, af, l);
                        launch_cluster(fused_ffn_kernel<S, CS>, kFfnBlocks, CS, F::FFN_SMEM, stream, true, fm, af, l);
                    }
                    launch(fused_final_kernel<S, CS>, 1, stream, true, false, af);
                };
                if (kClusterOf[v] == 8) clustered(std::integral_constant<int, 8>());
                else clustered(std::integral_constant<int, 16>());
            }
        });
    };
    cudaGraphExec_t exec[kVariants] = {};
    for (int v = 0; v < kVariants; ++v)
        if (ran[v]) exec[v] = build(v, a);
    const char *names[kVariants] = {"baseline", "persistent", "persistent_barrier", "clusters_8", "clusters_16",
                                    "o_attn", "o_attn_gated", "qkv_attn", "ffn_red", "ffn_red_l2", "ffn_red_x8",
                                    "ffn_red_l2_x8", "attn_o", "attn_o_red", "qkv_local"};

    // one replay each from x = NaN and row C = 0: outputs, and row C of every layer
    const size_t row_elems = (size_t)NKV * HD;
    auto read_rows = [&](uint16_t *cache, std::vector<uint16_t> &out) {
        out.resize((size_t)L * row_elems);
        CK(cudaMemcpy2D(out.data(), row_elems * 2, cache + (size_t)ctx * row_elems, (size_t)(ctx + 1) * row_elems * 2,
                        row_elems * 2, L, cudaMemcpyDeviceToHost));
    };
    auto read_abort = [&](int v) {
        unsigned ab = 0;
        if (v >= 3 && v != kQkvAttn) return ab;   // the clustered variants and o_attn never wait on counters
        CK(cudaMemcpy(&ab, &sync[v == kQkvAttn ? 3 : v].abort, sizeof(unsigned), cudaMemcpyDeviceToHost));
        return ab;
    };
    std::vector<float> out[kVariants];
    std::vector<uint16_t> krows[kVariants], vrows[kVariants];
    bool no_abort[kVariants] = {};
    for (int v = 0; v < kVariants; ++v) {
        if (!ran[v]) continue;
        CK(cudaMemsetAsync(d_x, 0xff, H * sizeof(float), stream));
        zero_rows<<<256, 256, 0, stream>>>(k_cache, L, ctx + 1, ctx, NKV * HD);
        CK(cudaGetLastError());
        zero_rows<<<256, 256, 0, stream>>>(v_cache, L, ctx + 1, ctx, NKV * HD);
        CK(cudaGetLastError());
        CK(cudaGraphLaunch(exec[v], stream));
        CK(cudaStreamSynchronize(stream));
        out[v].resize(H);
        CK(cudaMemcpy(out[v].data(), d_x, H * sizeof(float), cudaMemcpyDeviceToHost));
        read_rows(k_cache, krows[v]);
        read_rows(v_cache, vrows[v]);
        no_abort[v] = read_abort(v) == 0;
        if (!no_abort[v]) printf("  %s: a wait timed out (abort flag set): results invalid\n", names[v]);
    }
    // the variants that compute every element as the baseline does, in the same order
    std::vector<int> same = {1, 2};
    if (ran[kQkvAttn]) same.push_back(kQkvAttn);
    if (ran[kQkvLocal]) same.push_back(kQkvLocal);
    res.bit_identical = res.kv_identical = true;
    for (int v : same) {
        res.bit_identical = res.bit_identical && memcmp(out[0].data(), out[v].data(), H * 4) == 0;
        res.kv_identical = res.kv_identical && krows[0] == krows[v] && vrows[0] == vrows[v];
    }
    if (!res.bit_identical) {
        for (int v : same) {
            int first_diff = -1, n_diff = 0;
            for (int i = 0; i < H; ++i)
                if (memcmp(&out[0][i], &out[v][i], 4) != 0) { if (first_diff < 0) first_diff = i; ++n_diff; }
            if (n_diff) printf("  %s differs from baseline in %d of %d elements (first %d: %.9g vs %.9g)\n", names[v],
                               n_diff, H, first_diff, out[0][first_diff], out[v][first_diff]);
        }
    }

    // CPU reference
    std::vector<double> ref_x, ref_k, ref_v;
    cpu_reference<S>(m, x_in, rcos, rsin, ref_x, ref_k, ref_v);
    std::vector<float> kf(krows[0].size()), vf(vrows[0].size());
    for (size_t i = 0; i < kf.size(); ++i) kf[i] = host_bf(krows[0][i]), vf[i] = host_bf(vrows[0][i]);
    res.ref_err_x = rel_l2(ref_x, out[0].data(), H);
    res.ref_err_k = rel_l2(ref_k, kf.data(), kf.size());
    res.ref_err_v = rel_l2(ref_v, vf.data(), vf.size());
    bool finite = true;
    for (int v = 0; v < kVariants; ++v)
        for (float f : out[v]) finite = finite && std::isfinite(f);

    // timing: warm up, then N replays between events
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const double bytes_w = 2.0 * ((double)D::QKV * H + (double)H * D::ATT + 2.0 * I * H + (double)H * I + 2.0 * H +
                                  (S::QKN ? 2.0 * HD : 0.0));
    const double bytes_kv = 2.0 * 2.0 * (double)NKV * HD * (ctx + 1);   // K and V: C rows read, row C written
    res.bytes_layer = bytes_w + bytes_kv;
    res.floor_us_layer = res.bytes_layer / bw * 1e6;
    bool all_stable = true;
    for (int v = 0; v < kVariants; ++v) {
        if (!ran[v]) continue;
        for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(exec[v], stream));
        CK(cudaEventRecord(e0, stream));
        for (int i = 0; i < iters; ++i) CK(cudaGraphLaunch(exec[v], stream));
        CK(cudaEventRecord(e1, stream));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        VariantResult vr;
        vr.name = names[v];
        vr.us_token = ms * 1e3 / iters;
        vr.us_layer = vr.us_token / L;
        vr.frac_floor = res.floor_us_layer / vr.us_layer;
        std::vector<float> again(H);
        CK(cudaMemcpy(again.data(), d_x, H * sizeof(float), cudaMemcpyDeviceToHost));
        vr.stable = memcmp(again.data(), out[v].data(), H * 4) == 0;
        vr.no_abort = no_abort[v] && read_abort(v) == 0;
        all_stable = all_stable && vr.stable && vr.no_abort;
        std::vector<float> vk(krows[v].size()), vv(vrows[v].size());
        for (size_t i = 0; i < vk.size(); ++i) vk[i] = host_bf(krows[v][i]), vv[i] = host_bf(vrows[v][i]);
        vr.ref_err_x = rel_l2(ref_x, out[v].data(), H);
        vr.ref_err_k = rel_l2(ref_k, vk.data(), vk.size());
        vr.ref_err_v = rel_l2(ref_v, vv.data(), vv.size());
        res.variants.push_back(vr);
    }
    for (auto &vr : res.variants) vr.speedup = res.variants[0].us_token / vr.us_token;

    // --trace: one replay of each variant with timestamps (separate graphs; the timed ones have none)
    std::vector<std::pair<int, std::vector<unsigned long long>>> traces;   // (variant, stamps)
    const bool can_trace = sms <= kTraceBlocks && S::NH * splits <= kTraceBlocks;
    if (do_trace && can_trace) {
        const size_t n_trace = (size_t)L * 5 * kTraceBlocks * 2;
        unsigned long long *d_trace;
        CK(cudaMalloc(&d_trace, n_trace * sizeof(unsigned long long)));
        Acts at = a;
        at.trace = d_trace;
        for (int v : {0, 1, 2, kOAttn, kOAttnGated, kQkvAttn, kFfnRed, kFfnRedL2, kFfnRedX8, kFfnRedL2X8, kAttnO, kAttnORed,
                      kQkvLocal}) {
            if (!ran[v]) continue;
            cudaGraphExec_t ge = build(v, at);
            CK(cudaMemsetAsync(d_trace, 0, n_trace * sizeof(unsigned long long), stream));
            for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, stream));   // the last one's stamps stay
            CK(cudaStreamSynchronize(stream));
            traces.emplace_back(v, std::vector<unsigned long long>(n_trace));
            CK(cudaMemcpy(traces.back().second.data(), d_trace, n_trace * sizeof(unsigned long long),
                          cudaMemcpyDeviceToHost));
            CK(cudaGraphExecDestroy(ge));
            if (read_abort(v) != 0) all_stable = false;
        }
        CK(cudaFree(d_trace));
    }
    std::vector<std::pair<int, std::vector<unsigned long long>>> fused_traces;
    if (do_trace && S::NH * 16 <= kTraceBlocks) {
        const size_t n_trace = (size_t)L * kStamps * kTraceBlocks;
        unsigned long long *d_trace;
        CK(cudaMalloc(&d_trace, n_trace * sizeof(unsigned long long)));
        const Acts saved = af;
        af.trace = d_trace;
        for (int v = 3; v < kOAttn; ++v) {
            if (!ran[v]) continue;
            cudaGraphExec_t ge = build(v, a);
            CK(cudaMemsetAsync(d_trace, 0, n_trace * sizeof(unsigned long long), stream));
            for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, stream));
            CK(cudaStreamSynchronize(stream));
            fused_traces.emplace_back(v, std::vector<unsigned long long>(n_trace));
            CK(cudaMemcpy(fused_traces.back().second.data(), d_trace, n_trace * sizeof(unsigned long long),
                          cudaMemcpyDeviceToHost));
            CK(cudaGraphExecDestroy(ge));
        }
        af = saved;
        CK(cudaFree(d_trace));
    }

    const bool ref_ok = res.ref_err_x < 1e-3 && res.ref_err_k < 1e-3 && res.ref_err_v < 1e-3;
    bool variants_ok = true;   // the clustered variants and o_attn sum in another order: the reference only
    for (const auto &vr : res.variants)
        variants_ok = variants_ok && vr.ref_err_x < 1e-3 && vr.ref_err_k < 1e-3 && vr.ref_err_v < 1e-3;
    res.pass = res.bit_identical && res.kv_identical && ref_ok && variants_ok && finite && all_stable;

    printf("\n%s, context %d (attention: %d split%s of <= %d rows), %d SMs, %d replays\n", S::kName, ctx, splits,
           splits > 1 ? "s" : "", split_rows, sms, iters);
    printf("  bytes a layer %.3f MB (weights %.3f, KV %.3f); copy bandwidth %.0f GB/s; floor %.2f us a layer\n",
           res.bytes_layer / 1e6, bytes_w / 1e6, bytes_kv / 1e6, bw / 1e9, res.floor_us_layer);
    printf("  %-20s %12s %12s %14s %14s %12s\n", "variant", "us/token", "us/layer", "floor/layer", "baseline/this",
           "ref rel L2 x");
    for (const auto &vr : res.variants)
        printf("  %-20s %12.2f %12.3f %13.1f%% %14.2f %12.3g\n", vr.name.c_str(), vr.us_token, vr.us_layer,
               100.0 * vr.frac_floor, vr.speedup, vr.ref_err_x);
    for (int v = 3; v < kOAttn; ++v)
        if (!ran[v]) printf("  %s: not run (no cluster of %d fits)\n", names[v], kClusterOf[v]);
    if (!ran[kOAttn]) printf("  o_attn, o_attn_gated: not run (the K/V rows do not fit in a block's shared memory)\n");
    if (!ran[kQkvAttn]) printf("  qkv_attn: not run (more attention items than QKV blocks, or no block fits)\n");
    printf("  checks: x bit-identical across variants %s; K/V row C identical %s; stable over replays %s; finite %s\n",
           res.bit_identical ? "yes" : "NO", res.kv_identical ? "yes" : "NO", all_stable ? "yes" : "NO",
           finite ? "yes" : "NO");
    printf("  vs CPU fp64 reference: rel L2 x %.3g, k row %.3g, v row %.3g (< 1e-3) -> %s\n", res.ref_err_x,
           res.ref_err_k, res.ref_err_v, ref_ok ? "ok" : "TOO LARGE");
    if (do_trace && !can_trace) printf("  (no trace: more than %d blocks)\n", kTraceBlocks);
    if (!traces.empty())
        printf("  trace, us a layer (mean over layers 1..%d of one replay), per phase: hand-over + work\n", L - 1);
    for (auto &tr : traces)
        for (auto &vr : res.variants)
            if (vr.name == names[tr.first]) report_trace(vr, tr.second, L);
    for (const auto &ft : fused_traces) report_fused_trace(names[ft.first], ft.second, L);
    printf("  %s\n", res.pass ? "PASS" : "FAIL");

    for (int v = 0; v < kVariants; ++v)
        if (ran[v]) CK(cudaGraphExecDestroy(exec[v]));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    CK(cudaStreamDestroy(stream));
    for (void *p : {(void *)ln_in, (void *)ln_post, (void *)q_norm, (void *)k_norm, (void *)w_qkv, (void *)w_o,
                    (void *)w_gu, (void *)w_down, (void *)k_cache, (void *)v_cache, (void *)d_cos, (void *)d_sin,
                    (void *)d_x_in, (void *)d_x, (void *)d_qkv, (void *)d_attn, (void *)d_act, (void *)d_po,
                    (void *)d_pml, (void *)sync, (void *)d_xres, (void *)d_qkvh, (void *)d_apart, (void *)d_fpart,
                    (void *)d_fpo, (void *)d_fpml, (void *)groups, (void *)w_down_t, (void *)d_xq})
        CK(cudaFree(p));
    return res;
}

// µs a kernel of a graph of `kernels` kernels that enqueue(stream) captures: 20 replays to warm
// up, then `iters` replays between two events.
template <class Enqueue>
double us_per_kernel(cudaStream_t stream, int kernels, int iters, Enqueue enqueue) {
    const cudaGraphExec_t ge = capture_graph(stream, enqueue);
    for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(ge, stream));
    const float ms = elapsed_ms(stream, [&] {
        for (int i = 0; i < iters; ++i) CK(cudaGraphLaunch(ge, stream));
    });
    CK(cudaGraphExecDestroy(ge));
    return ms * 1e3 / iters / kernels;
}

// --calibrate: µs a kernel in a graph of 150 chained kernels (PDL unless stated), per mode and grid.
void calibrate(int sms, int iters) {
    constexpr int kKernels = 150;
    float *buf;
    CK(cudaMalloc(&buf, 2 * 4096 * sizeof(float)));
    CK(cudaMemset(buf, 0, 2 * 4096 * sizeof(float)));
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    struct Case { const char *name; int mode, grid; bool pdl; };
    const Case cases[] = {{"empty, no PDL", kCalEmpty, sms, false}, {"empty", kCalEmpty, sms, true},
                          {"chain", kCalChain, sms, true},          {"chain", kCalChain, 2 * sms, true},
                          {"chain", kCalChain, 72, true},           {"chain", kCalChain, 9, true},
                          {"chain, no PDL", kCalChain, sms, false}};
    printf("\ncalibration: %d chained kernels a graph, 256 threads a block, %d replays\n", kKernels, iters);
    for (const Case &c : cases) {
        const double us = us_per_kernel(stream, kKernels, iters, [&](cudaStream_t st) {
            for (int k = 0; k < kKernels; ++k) {
                float *in = buf + (k % 2) * 4096, *out = buf + ((k + 1) % 2) * 4096;
                if (c.mode == kCalEmpty)
                    launch(calibration_kernel<kCalEmpty>, c.grid, st, c.pdl && k > 0, false, in, out, c.grid);
                else
                    launch(calibration_kernel<kCalChain>, c.grid, st, c.pdl && k > 0, false, in, out, c.grid);
            }
        });
        printf("  %-14s grid %4d: %.3f us a kernel\n", c.name, c.grid, us);
    }
    // the GEMV built up step by step (calibration_gemv), N = 576 and 1024; weights: one matrix for
    // all kernels (L2-resident) or a matrix each (streamed from memory)
    auto gemv_case = [&](auto n_tag, int v, bool distinct) {
        constexpr int N = decltype(n_tag)::value;
        uint16_t *w;
        const size_t mats = distinct ? kKernels : 1;
        CK(cudaMalloc(&w, mats * N * N * sizeof(uint16_t)));
        fill_bf16<<<1024, 256>>>(w, mats * N * N, 77, 0.f, 0.05f);
        CK(cudaGetLastError());
        float *xb;
        CK(cudaMalloc(&xb, 2 * N * sizeof(float)));
        CK(cudaMemset(xb, 0, 2 * N * sizeof(float)));
        const double us = us_per_kernel(stream, kKernels, iters, [&](cudaStream_t st) {
            for (int k = 0; k < kKernels; ++k) {
                const uint16_t *wk = w + (distinct ? (size_t)k * N * N : 0);
                float *in = xb + (k % 2) * N, *out = xb + ((k + 1) % 2) * N;
                const int grid = N / kWarps;
                const bool pdl = k > 0;
                switch (v) {
                    case kGcStage: launch(calibration_gemv<N, kGcStage>, grid, st, pdl, false, wk, in, out); break;
                    case kGcDot: launch(calibration_gemv<N, kGcDot>, grid, st, pdl, false, wk, in, out); break;
                    case kGcNormWarp: launch(calibration_gemv<N, kGcNormWarp>, grid, st, pdl, false, wk, in, out); break;
                    case kGcNormBlock: launch(calibration_gemv<N, kGcNormBlock>, grid, st, pdl, false, wk, in, out); break;
                    case kGcNormFold: launch(calibration_gemv<N, kGcNormFold>, grid, st, pdl, false, wk, in, out); break;
                    default: launch(calibration_gemv<N, kGcResid>, grid, st, pdl, false, wk, in, out); break;
                }
            }
        });
        static const char *vname[kGemvCals] = {"stage only", "+ dot", "+ dot, norm per warp",
                                               "+ dot, norm per block", "+ dot, norm after the dot",
                                               "+ dot, residual"};
        printf("  gemv %4d x %-4d %-26s %-9s: %.3f us a kernel\n", N, N, vname[v], distinct ? "streamed" : "L2", us);
        CK(cudaFree(w));
        CK(cudaFree(xb));
    };
    for (int v = 0; v < kGemvCals; ++v) gemv_case(std::integral_constant<int, 576>(), v, false);
    for (int v = 1; v < kGemvCals; ++v) gemv_case(std::integral_constant<int, 576>(), v, true);
    for (int v = 0; v < kGemvCals; ++v) gemv_case(std::integral_constant<int, 1024>(), v, false);
    for (int v = 1; v < kGemvCals; ++v) gemv_case(std::integral_constant<int, 1024>(), v, true);
    CK(cudaStreamDestroy(stream));
    CK(cudaFree(buf));
}

void write_json(const char *path, const std::vector<ConfigResult> &rs, const char *device, bool pass) {
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(1);
    }
    fprintf(f, "{\n  \"device\": \"%s\",\n  \"pass\": %s,\n  \"configs\": [\n", device, pass ? "true" : "false");
    for (size_t i = 0; i < rs.size(); ++i) {
        const ConfigResult &r = rs[i];
        fprintf(f, "    {\"shape\": \"%s\", \"context\": %d, \"attention_splits\": %d, \"sms\": %d, \"replays\": %d,\n",
                r.shape.c_str(), r.ctx, r.splits, r.sms, r.iters);
        fprintf(f, "     \"copy_bandwidth_GBps\": %.1f, \"bytes_per_layer\": %.0f, \"floor_us_per_layer\": %.4f,\n",
                r.bw_gbs, r.bytes_layer, r.floor_us_layer);
        fprintf(f, "     \"persistent_registers\": %d, \"persistent_local_bytes\": %d,\n", r.persistent_regs,
                r.persistent_local);
        fprintf(f, "     \"variants\": {");
        for (size_t v = 0; v < r.variants.size(); ++v) {
            const VariantResult &vr = r.variants[v];
            fprintf(f, "%s\n       \"%s\": {\"us_per_token\": %.3f, \"us_per_layer\": %.4f, \"fraction_of_floor\": %.4f, "
                       "\"baseline_over_this\": %.4f, \"ref_rel_l2_x\": %.3e, \"stable\": %s",
                    v ? "," : "", vr.name.c_str(), vr.us_token, vr.us_layer, vr.frac_floor, vr.speedup, vr.ref_err_x,
                    vr.stable && vr.no_abort ? "true" : "false");
            if (!vr.handover_us.empty()) {   // --trace: qkv, attention, o, gate/up, down
                fprintf(f, ", \"trace_handover_us\": [");
                for (size_t p = 0; p < vr.handover_us.size(); ++p) fprintf(f, "%s%.3f", p ? ", " : "", vr.handover_us[p]);
                fprintf(f, "], \"trace_work_us\": [");
                for (size_t p = 0; p < vr.work_us.size(); ++p) fprintf(f, "%s%.3f", p ? ", " : "", vr.work_us[p]);
                fprintf(f, "]");
            }
            fprintf(f, "}");
        }
        fprintf(f, "},\n     \"bit_identical\": %s, \"kv_row_identical\": %s, \"ref_rel_l2_x\": %.3e, "
                   "\"ref_rel_l2_k\": %.3e, \"ref_rel_l2_v\": %.3e, \"pass\": %s}%s\n",
                r.bit_identical ? "true" : "false", r.kv_identical ? "true" : "false", r.ref_err_x, r.ref_err_k,
                r.ref_err_v, r.pass ? "true" : "false", i + 1 < rs.size() ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
    fclose(f);
}

void usage(const char *argv0) {
    printf("usage: %s [--shape smollm2|qwen3-0.6b|both] [--context C[,C...]] [--iters N] [--json PATH] [--trace] [--calibrate]\n",
           argv0);
}

}  // namespace

int main(int argc, char **argv) {
    std::string shape = "both", json;
    std::vector<int> contexts;
    int iters = 200;
    bool trace = false, calibrate_only = false;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        const bool has_value = i + 1 < argc;
        if (arg == "--shape" && has_value) {
            shape = argv[++i];
        } else if (arg == "--context" && has_value) {
            for (int c : probe::parse_ints(argv[++i])) contexts.push_back(c);  // repeated flags add up
        } else if (arg == "--iters" && has_value) {
            iters = atoi(argv[++i]);
        } else if (arg == "--json" && has_value) {
            json = argv[++i];
        } else if (arg == "--trace") {
            trace = true;
        } else if (arg == "--calibrate") {
            calibrate_only = true;
        } else {
            usage(argv[0]);
            return arg == "--help" || arg == "-h" ? 0 : 1;
        }
    }
    if (contexts.empty()) contexts.push_back(64);
    for (int c : contexts)
        if (c < 1 || c > 65536) {
            fprintf(stderr, "context %d out of range [1, 65536]\n", c);
            return 1;
        }
    if (iters < 1 || (shape != "both" && shape != "smollm2" && shape != "qwen3-0.6b")) {
        usage(argv[0]);
        return 1;
    }

    int dev = 0, sms = 0, coop = 0, major = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    CK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
    CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    if (major < 9 || !coop) {
        fprintf(stderr, "needs sm_90+ with cooperative launch (PDL, co-resident persistent blocks); %s has sm_%d0, "
                        "cooperative %d\n", prop.name, major, coop);
        return 1;
    }
    const double bw = copy_bandwidth();
    printf("%s: %d SMs; device-to-device copy of 1 GiB: %.0f GB/s (read + written)\n", prop.name, sms, bw / 1e9);
    if (calibrate_only) {
        calibrate(sms, iters);
        return 0;
    }

    std::vector<ConfigResult> results;
    bool pass = true;
    for (int ctx : contexts) {
        if (shape == "both" || shape == "smollm2") results.push_back(run_config<SmolLM2>(ctx, iters, sms, bw, trace));
        if (shape == "both" || shape == "qwen3-0.6b") results.push_back(run_config<Qwen3_06B>(ctx, iters, sms, bw, trace));
    }
    for (const auto &r : results) pass = pass && r.pass;
    if (!json.empty()) write_json(json.c_str(), results, prop.name, pass);
    printf("\n%s\n", pass ? "PASS" : "FAIL");
    return pass ? 0 : 1;
}
