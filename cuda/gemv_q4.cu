// gemv_q4.cu — the GEMV over q4 weights (dense projections, lm_head and the MoE experts), with
// its input vector quantized to int8 per group of 32 columns (w4a8) so that the dot products run
// on the integer dot-product instruction: dp4a multiplies 4 weight codes by 4 input codes and
// adds them in one instruction.
//
// Why: batch-1 decode reads every weight once, and a q4 weight is 0.53125 bytes with its
// one-byte group scale (e5m3: quant.cuh), so at DRAM speed a q4 GEMV has ~3.8x fewer
// instruction slots per weight than a bf16 one.
// Dequantizing to fp16 for the tensor cores costs 9 instructions per 8 weights before the mma
// (gemv_int8.cu's kernel still does that: int8 has twice the bytes per weight), which left the
// q4 GEMVs bound by instruction issue. Here 8
// weights cost 2 LOP3 + 2 dp4a, with no conversion at all.
//
// Numerics (the reference's gemv on a q4 matrix does the same, runtime/reference.py): the input
// x (normalized first in the norm modes) is quantized per group g of 32 columns, the groups of
// the weight rows:
//   amax = max |x[c]| over g;  scale_x[g] = amax / 127  (IEEE fp32 division)
//   q_x[c] = rint(x[c] * (127 / amax))   (fp32 product, round half to even; 0 where amax = 0)
// and a row's dot product is sum over groups of isum[g] * (scale_w[g] * scale_x[g]), where
//   isum[g] = sum over c in g of q_w[c] * q_x[c]      (exact, in int32)
// A group with a NaN or infinite input gets scale_x = NaN, so non-finite inputs propagate.
//
// Layouts:
//   weight: [rows, groups * 16] bytes (quant.cuh), byte j of a group holds column 2j in its low
//           nibble and 2j + 1 in its high nibble, as 4-bit two's complement codes;
//           scales [rows, groups] e5m3, one byte a group (quant.cuh q4_scale_value).
//   staged input (shared memory): codes [groups][8] uint32 and Q8Group [groups]. Word 2k of a
//           group holds the codes of columns 8k, 8k+2, 8k+4, 8k+6 (bytes low to high), word
//           2k + 1 those of 8k+1, 8k+3, 8k+5, 8k+7: the low and the high nibbles of weight word
//           k, so each weight word meets its two input words with no shuffling of bytes.
//   A weight word w: (w ^ 0x88888888) turns each nibble q into q + 8 in [0, 15] (offset
//   binary); & 0x0F0F0F0F gives the low nibbles as bytes, & 0xF0F0F0F0 the high nibbles times
//   16. dp4a (unsigned x signed bytes) sums them against the input codes, and
//     isum = lo + (hi >> 4) - 8 * sum(q_x)        (the offset removed per group, exactly)
//
// Work split. A warp owns a task = two rows (r, r+1), or for SwiGLU (gate row i, up row I + i),
// or for the MoE gate/up (expert j's gate and up row i); lane l takes groups l, l + 32, ... of
// both rows and accumulates isum * (scale_w * scale_x) in fp32 in group order; the warp then
// sums its lanes with shuffles (fixed order: graph replays are bit-identical). Warps stride
// over the tasks.
//
// The load pipeline. A warp's work is one stream of chunks: chunk c of a task is the lane's
// groups 2c and 2c + 1 (groups 64c + l and 64c + 32 + l) of both rows, 4 x 16 bytes of weights
// and 4 scales a lane. Two register slots take the chunks in turn, and a slot is refilled with
// the chunk after next as soon as it has been folded in, across task boundaries: the warp
// always has one to two chunks in flight and never stops to wait for a whole round of loads.
// (Loading a task's U groups, folding them, and only then loading the next task left DRAM idle
// between rounds, in lockstep over the GPU.) The weights do not depend on earlier kernels, so
// both slots are filled before the PDL wait (not for the MoE gate/up: the top-k kernel picks its experts' rows).
#include "kernels.cuh"
#include "quant.cuh"
#include "trace.cuh"

namespace og {
namespace {

constexpr int kQ4MaxWarps = 16;  // the largest block: one per SM stages the input once for all
constexpr int kQ4MoeGateUp = 4;  // a mode beside GemvMode's four: the MoE experts' gate/up + SwiGLU
constexpr int kQ4MaxTopK = 32;
constexpr int kQ4MoeDownWarps = 8;
constexpr int kQ4ChunkGroups = 2;  // lane groups per row in a chunk
constexpr int kQ4Slots = 2;        // chunks a warp has in flight (register slots)

// One staged group of the input: scale_x and 8 * the sum of its codes.
struct Q8Group {
    float scale;
    int offset;
};
// Shared memory of the staged input: codes [groups][8] uint32, then Q8Group [groups].
__host__ __device__ inline size_t q4_staged_bytes(int groups) {
    return (size_t)groups * (32 + sizeof(Q8Group));
}

struct Q4Params {
    const uint8_t *weight;    // [rows, groups * 16]
    const uint8_t *scales;    // [rows, groups] e5m3 (quant.cuh)
    const float *x;           // [cols]
    const float *norm_weight; // [cols] (norm modes)
    float *y;
    float *normed_out;        // optional [cols] (norm modes; block 0 writes it)
    int rows, cols, groups, n_tasks, out_rows;
    float eps;
    const int32_t *selected;  // kQ4MoeGateUp: the experts chosen for this token [top_k]
    int residual_settled;     // kGemvResidual: y may be read before the PDL wait (GemvArgs)
};

// d = c + dot(4 unsigned bytes of a, 4 signed bytes of b).
__device__ __forceinline__ int dp4a_us(uint32_t a, uint32_t b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// isum of one group: weight chunk w (32 codes) against the staged codes xa (words 0-3), xb
// (words 4-7) and the group's offset (8 * sum of the input codes).
__device__ __forceinline__ int q4_group_dot(const uint4 &w, const uint4 &xa, const uint4 &xb, int offset) {
    constexpr uint32_t kFlip = 0x88888888u, kLow = 0x0F0F0F0Fu, kHigh = 0xF0F0F0F0u;
    int lo = 0, hi = 0;
    lo = dp4a_us((w.x ^ kFlip) & kLow, xa.x, lo);
    hi = dp4a_us((w.x ^ kFlip) & kHigh, xa.y, hi);
    lo = dp4a_us((w.y ^ kFlip) & kLow, xa.z, lo);
    hi = dp4a_us((w.y ^ kFlip) & kHigh, xa.w, hi);
    lo = dp4a_us((w.z ^ kFlip) & kLow, xb.x, lo);
    hi = dp4a_us((w.z ^ kFlip) & kHigh, xb.y, hi);
    lo = dp4a_us((w.w ^ kFlip) & kLow, xb.z, lo);
    hi = dp4a_us((w.w ^ kFlip) & kHigh, xb.w, hi);
    return lo + (hi >> 4) - offset;  // hi is a multiple of 16: the shift is exact
}

// Group f of the staged input against one group of each of a task's two rows (weights w0, w1,
// scales s0, s1) into the rows' running sums, in the order every q4 kernel folds them.
__device__ __forceinline__ void q4_fold_group(const uint4 *codes, const Q8Group *gq, int f, const uint4 &w0,
                                              const uint4 &w1, float s0, float s1, float &acc0, float &acc1) {
    const uint4 xa = codes[2 * f], xb = codes[2 * f + 1];
    const Q8Group g = gq[f];
    acc0 = fmaf((float)q4_group_dot(w0, xa, xb, g.offset), s0 * g.scale, acc0);
    acc1 = fmaf((float)q4_group_dot(w1, xa, xb, g.offset), s1 * g.scale, acc1);
}

// Weights stream once per token (quant.cuh load_weight_chunk); the e5m3 group scale likewise,
// its lines evicted first (policy: l2_evict_first()).
__device__ __forceinline__ float load_q4_scale(const uint8_t *p, uint64_t policy) {
    uint32_t code;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.u8 %0, [%1], %2;" : "=r"(code) : "l"(p), "l"(policy));
    return q4_scale_value(code);
}

__device__ __forceinline__ uint32_t pack_codes(int a, int b, int c, int d) {
    return (uint32_t)(a & 0xFF) | (uint32_t)(b & 0xFF) << 8 | (uint32_t)(c & 0xFF) << 16 |
           (uint32_t)(d & 0xFF) << 24;
}

// Quantize an input of `cols` columns into the staged codes and groups (layout above), NT
// threads. Item i is columns 8i .. 8i + 7 (group i / 4, part i % 4): the four lanes of a quad
// share a group and combine its max and code sum with two shuffles each. Norm modes pass
// inv_rms and the norm weights: the quantized value is then x * inv_rms * w (the order of
// reference.rmsnorm), and normed_out (if not NULL) receives it.
struct Q8Item {
    float v[8];
};
__device__ __forceinline__ bool q8_vec_ok(const float *x, const float *norm_weight, const float *normed_out, int cols) {
    auto aligned = [](const float *p) { return p == nullptr || (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
    return cols % 4 == 0 && aligned(x) && aligned(norm_weight) && aligned(normed_out);
}
// The 8 values of item `item` of v (zeros past cols or n_items).
__device__ __forceinline__ Q8Item load_q8_item(const float *v, int item, int n_items, int cols, bool vec) {
    Q8Item r;
    const int col0 = 8 * item;
    if (vec) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int col = col0 + 4 * h;  // cols % 4 == 0: a float4 is wholly in or out
            const float4 a = item < n_items && col < cols ? *reinterpret_cast<const float4 *>(v + col)
                                                          : make_float4(0.f, 0.f, 0.f, 0.f);
            r.v[4 * h] = a.x;
            r.v[4 * h + 1] = a.y;
            r.v[4 * h + 2] = a.z;
            r.v[4 * h + 3] = a.w;
        }
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) r.v[k] = item < n_items && col0 + k < cols ? v[col0 + k] : 0.f;
    }
    return r;
}
// Item `item` (values a, normalized in norm modes with norm weights nw) into the staged input.
// Every lane of the warp calls it (the quad shuffles), items past n_items store nothing.
__device__ __forceinline__ void quantize_q8_item(Q8Item a, bool norm, const Q8Item &nw, float inv_rms, int item,
                                                 int n_items, int cols, uint2 *codes, Q8Group *gq,
                                                 float *normed_out) {
    if (norm) {
#pragma unroll
        for (int k = 0; k < 8; ++k) a.v[k] = a.v[k] * inv_rms * nw.v[k];
        if (normed_out != nullptr && item < n_items)
#pragma unroll
            for (int k = 0; k < 8; ++k)
                if (8 * item + k < cols) normed_out[8 * item + k] = a.v[k];
    }
    float amax = 0.f;
    int finite = 1;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        amax = fmaxf(amax, fabsf(a.v[k]));
        finite &= q8_finite(a.v[k]);
    }
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 2));
    finite &= __shfl_xor_sync(kFullMask, finite, 1);
    finite &= __shfl_xor_sync(kFullMask, finite, 2);
    const float inv = q8_inverse(amax);
    int q[8], sum = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        q[k] = q8_code(a.v[k], inv);
        sum += q[k];
    }
    sum += __shfl_xor_sync(kFullMask, sum, 1);
    sum += __shfl_xor_sync(kFullMask, sum, 2);
    if (item < n_items) {
        codes[item] = make_uint2(pack_codes(q[0], q[2], q[4], q[6]), pack_codes(q[1], q[3], q[5], q[7]));
        if ((item & 3) == 0) gq[item / 4] = Q8Group{q8_scale(amax, finite), 8 * sum};
    }
}

// The staging of one input by a block of NT threads, in two halves so that the norm weights
// (weights: they do not depend on earlier kernels) load before the PDL wait and x costs one
// round trip to L2 after it. Thread t's items are t, t + NT, ..., the first kCached of them held
// in registers from prepare() to stage(); more (a wide input on a small block) are loaded in
// stage() itself.
template <int NT, int kCached>
struct Q8Stager {
    Q8Item x[kCached], nw[kCached];
    int n_items;
    bool vec;

    // Before the PDL wait: the norm weights of the cached items (norm_weight may be NULL).
    __device__ __forceinline__ void prepare(const float *x_in, const float *norm_weight, const float *normed_out,
                                            int cols) {
        n_items = 4 * ceil_div(cols, kQ4Group);
        vec = q8_vec_ok(x_in, norm_weight, normed_out, cols);
        if (norm_weight != nullptr)
#pragma unroll
            for (int k = 0; k < kCached; ++k)
                nw[k] = load_q8_item(norm_weight, threadIdx.x + k * NT, n_items, cols, vec);
    }
    // After it: the cached items of x (stage() loads them itself unless told they are loaded).
    __device__ __forceinline__ void load_x(const float *x_in, int cols) {
#pragma unroll
        for (int k = 0; k < kCached; ++k) x[k] = load_q8_item(x_in, threadIdx.x + k * NT, n_items, cols, vec);
    }
    // x (normalized: RMSNorm with eps when norm_weight is not NULL) into codes / gq.
    __device__ __forceinline__ void stage(const float *x_in, const float *norm_weight, float eps, int cols,
                                          uint2 *codes, Q8Group *gq, float *normed_out, float *scratch,
                                          bool x_loaded = false) {
        if (!x_loaded) load_x(x_in, cols);
        float inv_rms = 1.f;
        if (norm_weight != nullptr) {
            float sum_sq = 0.f;
#pragma unroll
            for (int k = 0; k < kCached; ++k)
#pragma unroll
                for (int e = 0; e < 8; ++e) sum_sq = fmaf(x[k].v[e], x[k].v[e], sum_sq);
            for (int item = threadIdx.x + kCached * NT; item < n_items; item += NT) {
                const Q8Item a = load_q8_item(x_in, item, n_items, cols, vec);
#pragma unroll
                for (int e = 0; e < 8; ++e) sum_sq = fmaf(a.v[e], a.v[e], sum_sq);
            }
            inv_rms = 1.0f / sqrtf(block_sum<NT>(sum_sq, scratch) / (float)cols + eps);
        }
#pragma unroll
        for (int k = 0; k < kCached; ++k)
            quantize_q8_item(x[k], norm_weight != nullptr, nw[k], inv_rms, threadIdx.x + k * NT,
                             n_items, cols, codes, gq, normed_out);
        // Whole warps per round beyond the cached items (the quad shuffles need every lane).
        const int lane = threadIdx.x % kWarpSize;
        for (int base = threadIdx.x - lane + kCached * NT; base < n_items; base += NT) {
            const int item = base + lane;
            const bool norm = norm_weight != nullptr;
            const Q8Item w = norm ? load_q8_item(norm_weight, item, n_items, cols, vec) : Q8Item{};
            quantize_q8_item(load_q8_item(x_in, item, n_items, cols, vec), norm, w, inv_rms, item, n_items,
                             cols, codes, gq, normed_out);
        }
    }
};

// The stager of a dense q4 kernel: items held in registers from before the PDL wait. A norm
// mode's 4096 columns are one per thread of 16 warps (two of 8: registers at the wait are the
// slots' plus these); the down projection's 12288 three.
template <int MODE, int WARPS>
using Q4Stager = Q8Stager<WARPS * kWarpSize, mode_has_norm(MODE) ? (WARPS >= 16 ? 1 : 2) : 3>;

// Rows of task `task`: (r0, r1); r1 == r0 for the last task of an odd row count.
template <int MODE>
__device__ __forceinline__ void q4_task_rows(const Q4Params &p, int task, int &r0, int &r1) {
    if (MODE == kQ4MoeGateUp) {
        const int j = task / p.out_rows, i = task - j * p.out_rows;
        r0 = __ldg(p.selected + j) * 2 * p.out_rows + i;
        r1 = r0 + p.out_rows;
    } else if (MODE == kGemvNormSwiglu) {
        r0 = task;
        r1 = task + p.out_rows;
    } else {
        r0 = 2 * task;
        r1 = min(r0 + 1, p.rows - 1);
    }
}

// A register slot: chunk `chunk` of task `task` (lane groups chunk * H .. chunk * H + H - 1 of
// both rows), loaded with the weights' L2 policy.
struct Q4Slot {
    uint4 w0[kQ4ChunkGroups], w1[kQ4ChunkGroups];
    float s0[kQ4ChunkGroups], s1[kQ4ChunkGroups];
    int task, chunk, r0, r1;
};
template <int MODE>
__device__ __forceinline__ void load_slot(Q4Slot &s, const Q4Params &p, int task, int chunk, int lane,
                                          uint64_t policy) {
    constexpr int H = kQ4ChunkGroups;
    s.task = task;
    s.chunk = chunk;
    if (task >= p.n_tasks) return;
    q4_task_rows<MODE>(p, task, s.r0, s.r1);
    const uint4 *w0 = reinterpret_cast<const uint4 *>(p.weight + (size_t)s.r0 * p.groups * 16);
    const uint4 *w1 = reinterpret_cast<const uint4 *>(p.weight + (size_t)s.r1 * p.groups * 16);
    const uint8_t *s0 = p.scales + (size_t)s.r0 * p.groups, *s1 = p.scales + (size_t)s.r1 * p.groups;
#pragma unroll
    for (int h = 0; h < H; ++h) {
        const int c = lane + (chunk * H + h) * kWarpSize;
        const bool ok = c < p.groups;
        s.w0[h] = ok ? load_weight_chunk(w0 + c, policy) : make_uint4(0u, 0u, 0u, 0u);
        s.w1[h] = ok ? load_weight_chunk(w1 + c, policy) : make_uint4(0u, 0u, 0u, 0u);
        s.s0[h] = ok ? load_q4_scale(s0 + c, policy) : 0.f;
        s.s1[h] = ok ? load_q4_scale(s1 + c, policy) : 0.f;
    }
}
// A settled residual (GemvArgs::residual_settled): lane 0 reads the y of the warp's first task
// before the PDL wait, so that the task's end does not wait on an L2 round trip. Returns that
// task, or -1 (no read: another mode, another lane, no task).
template <int MODE>
__device__ __forceinline__ int read_settled(const Q4Params &p, int task, int lane, float2 &settled) {
    settled = make_float2(0.f, 0.f);
    if (MODE != kGemvResidual || !p.residual_settled || lane != 0 || task >= p.n_tasks) return -1;
    int r0, r1;
    q4_task_rows<MODE>(p, task, r0, r1);
    settled = make_float2(__ldcg(p.y + r0), __ldcg(p.y + r1));
    return task;
}

// A task's outputs from its two rows' dot products (lane 0 writes them).
// settled: the y values of task settled_task, read before the PDL wait (residual mode).
template <int MODE>
__device__ __forceinline__ void q4_task_out(const Q4Params &p, int task, int r0, int r1, float a0, float a1,
                                            int lane, const float2 &settled, int settled_task) {
    if (lane != 0) return;
    if (MODE == kGemvNormSwiglu || MODE == kQ4MoeGateUp) {
        p.y[task] = a0 / (1.0f + expf(-a0)) * a1;
    } else if (MODE == kGemvResidual) {
        const bool pre = task == settled_task;
        p.y[r0] = (pre ? settled.x : p.y[r0]) + a0;
        if (r1 != r0) p.y[r1] = (pre ? settled.y : p.y[r1]) + a1;
    } else {
        p.y[r0] = a0;
        if (r1 != r0) p.y[r1] = a1;
    }
}
// Fold a slot into its task's running sums (acc0, acc1); at the task's last chunk the warp sums
// its lanes, lane 0 writes the outputs and the sums restart.
template <int MODE>
__device__ __forceinline__ void fold_slot(const Q4Slot &s, const Q4Params &p, const uint4 *codes,
                                          const Q8Group *gq, int chunks, int lane, float &acc0, float &acc1,
                                          const float2 &settled, int settled_task) {
    constexpr int H = kQ4ChunkGroups;
#pragma unroll
    for (int h = 0; h < H; ++h) {
        const int c = lane + (s.chunk * H + h) * kWarpSize;
        if (c < p.groups) q4_fold_group(codes, gq, c, s.w0[h], s.w1[h], s.s0[h], s.s1[h], acc0, acc1);
    }
    if (s.chunk == chunks - 1) {
        q4_task_out<MODE>(p, s.task, s.r0, s.r1, warp_sum(acc0), warp_sum(acc1), lane, settled, settled_task);
        acc0 = acc1 = 0.f;
    }
}

// ---- OG_Q4_TRACE: per-block timestamps (build.py --trace; scripts/q4_trace.py) -------------
// A diagnostic build: every block of the dense q4 GEMV records %globaltimer when it starts,
// when the PDL wait returns, when its input is quantized and staged and when its last warp is
// done (trace.cuh's GEMV_TRACE_*), into a ring read with og_q4_trace_read(). The normal build
// has none of it.
#ifdef OG_Q4_TRACE
__device__ GemvTraceRecord g_q4_trace[kGemvTraceRecords];
__device__ unsigned g_q4_trace_count;
#endif

template <int MODE, int WARPS>
__global__ void __launch_bounds__(WARPS * kWarpSize) gemv_q4_kernel(const Q4Params p) {
    constexpr int H = kQ4ChunkGroups, S = kQ4Slots;
    constexpr bool kNorm = mode_has_norm(MODE);
    extern __shared__ __align__(16) uint4 q4_smem[];
    uint4 *codes = q4_smem;
    Q8Group *gq = reinterpret_cast<Q8Group *>(codes + 2 * p.groups);
    __shared__ float scratch[WARPS];
    GEMV_TRACE_START();

    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int task_stride = gridDim.x * WARPS;
    const int chunks = ceil_div(ceil_div(p.groups, kWarpSize), H);
    const uint64_t policy = l2_evict_first();
    const int first_task = blockIdx.x * WARPS + warp;
    int ld_task = first_task, ld_chunk = 0;
    auto advance = [&]() {
        if (++ld_chunk == chunks) {
            ld_chunk = 0;
            ld_task += task_stride;
        }
    };
    // The weights do not depend on earlier kernels: both slots are filled before the wait (the
    // MoE gate/up's rows do: the top-k kernel picks the experts).
    Q4Slot slot[S];
    if (MODE != kQ4MoeGateUp) {
#pragma unroll
        for (int k = 0; k < S; ++k) {
            load_slot<MODE>(slot[k], p, ld_task, ld_chunk, lane, policy);
            advance();
        }
    }
    float2 settled;
    const int settled_task = read_settled<MODE>(p, first_task, lane, settled);
    const float *norm_weight = kNorm ? p.norm_weight : nullptr;
    float *normed_out = kNorm && blockIdx.x == 0 ? p.normed_out : nullptr;
    Q4Stager<MODE, WARPS> stager;
    stager.prepare(p.x, norm_weight, normed_out, p.cols);
    // The MoE gate/up's x (x_normed, the router GEMV's) is settled before the wait: its writer
    // is two launches back, and the top-k kernel between lets this one launch only after its
    // own wait has returned. Only the expert ids need the wait.
    if (MODE == kQ4MoeGateUp)
        stager.stage(p.x, norm_weight, p.eps, p.cols, reinterpret_cast<uint2 *>(codes), gq, normed_out, scratch);
    GEMV_TRACE_SLOT(g_q4_trace_count);
    pdl_wait_then_launch<MODE == kGemvNorm>();
    GEMV_TRACE_WAITED();
    if (MODE == kQ4MoeGateUp) {
#pragma unroll
        for (int k = 0; k < S; ++k) {
            load_slot<MODE>(slot[k], p, ld_task, ld_chunk, lane, policy);
            advance();
        }
    } else {
        stager.stage(p.x, norm_weight, p.eps, p.cols, reinterpret_cast<uint2 *>(codes), gq, normed_out,
                     scratch);
    }
    GEMV_TRACE_QUANTIZED();
    __syncthreads();
    GEMV_TRACE_STAGED(g_q4_trace);

    // The slots in turn: fold one, refill it with the chunk after the other slot's.
    float acc0 = 0.f, acc1 = 0.f;
    for (;;) {
#pragma unroll
        for (int k = 0; k < S; ++k) {
            if (slot[k].task >= p.n_tasks) goto done;  // chunks come in order: none left
            fold_slot<MODE>(slot[k], p, codes, gq, chunks, lane, acc0, acc1, settled, settled_task);
            load_slot<MODE>(slot[k], p, ld_task, ld_chunk, lane, policy);
            advance();
        }
    }
done:
    GEMV_TRACE_END(g_q4_trace);
}

// ---- The weight stream through the copy engine (bulk copies into shared memory) -----------
// The same work split, chunk stream and arithmetic as gemv_q4_kernel (outputs bit-identical),
// but a warp's chunks land in a ring of kQ4BulkSlots shared-memory slots, copied by the SM's
// copy engine (cp.async.bulk, TMA; completion counted in bytes on one mbarrier per slot)
// instead of the warp's own loads into registers. Why: the register kernel has at most two
// chunks a warp in flight (a third slot costs registers the 16-warp block does not have), so
// a long stream runs below the DRAM's rate. Here lane 0 issues four copies a chunk: two slots
// before the PDL wait (as many bytes as the register kernel preloads), the other two right
// after the input's loads (queued behind them), then each slot again as soon as the warp has
// folded it. The planner gives this stream to the dense FFN's gate/up and down projections
// (GemvPlan::stream), the long streams of a layer; the QKV, O and lm_head projections are
// shorter than the ring needs to pay for its copies, and keep the register slots.
// Slot layout (bytes): row r0's 64 groups of weights [0, 1024), r1's [1024, 2048), r0's 64
// e5m3 scales [2048, 2112), r1's [2112, 2176). A last chunk of n < 64 groups fills the first n
// of each. Copies need 16-byte sizes and addresses: groups % 16 == 0 (q4_bulk_fits).
constexpr int kQ4BulkSlots = 4;
constexpr int kQ4BulkPreWait = 2;                           // slots filled before the PDL wait
constexpr int kQ4SlotGroups = kQ4ChunkGroups * kWarpSize;   // groups of a row in a chunk: 64
constexpr int kQ4SlotRowBytes = kQ4SlotGroups * 16;
constexpr int kQ4SlotScaleBytes = kQ4SlotGroups;  // one e5m3 byte a group
constexpr int kQ4SlotBytes = 2 * kQ4SlotRowBytes + 2 * kQ4SlotScaleBytes;

// Dynamic shared memory: the staged input (q4_staged_bytes), then the warps' rings.
__host__ __device__ inline size_t q4_ring_offset(int groups) {
    return (q4_staged_bytes(groups) + 15) / 16 * 16;
}
// A row's scales are groups bytes: whole 16-byte copies.
__host__ __device__ constexpr bool q4_bulk_groups_fit(int groups) { return groups % 16 == 0; }

__device__ __forceinline__ uint32_t smem_address(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbarrier_init(uint64_t *bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(count) : "memory");
}
// One arrival that also announces `bytes` of copies to come in this phase.
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t *bar, unsigned parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(smem_address(bar)),
        "r"(parity)
        : "memory");
}
// `bytes` from src to dst, counted on bar, the source's L2 lines under `policy`.
__device__ __forceinline__ void bulk_copy_to_shared(void *dst, const void *src, unsigned bytes, uint64_t *bar,
                                                    uint64_t policy) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
            smem_address(dst)),
        "l"(src), "r"(bytes), "r"(smem_address(bar)), "l"(policy)
        : "memory");
}

template <int MODE, int WARPS>
__global__ void __launch_bounds__(WARPS * kWarpSize) gemv_q4_bulk_kernel(const Q4Params p) {
    constexpr int H = kQ4ChunkGroups, NS = kQ4BulkSlots;
    constexpr bool kNorm = mode_has_norm(MODE);
    extern __shared__ __align__(16) uint4 q4_smem[];
    uint4 *codes = q4_smem;
    Q8Group *gq = reinterpret_cast<Q8Group *>(codes + 2 * p.groups);
    __shared__ float scratch[WARPS];
    __shared__ uint64_t slot_full[WARPS][NS];
    GEMV_TRACE_START();

    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    char *ring = reinterpret_cast<char *>(q4_smem) + q4_ring_offset(p.groups) + (size_t)warp * NS * kQ4SlotBytes;
    uint64_t *full = slot_full[warp];
    const int task_stride = gridDim.x * WARPS;
    const int chunks = ceil_div(p.groups, kQ4SlotGroups);
    const uint64_t policy = l2_evict_first();
    const int first_task = blockIdx.x * WARPS + warp;
    const int my_chunks = first_task < p.n_tasks ? ceil_div(p.n_tasks - first_task, task_stride) * chunks : 0;
    // Chunk k of the warp's stream into slot k % NS (lane 0).
    auto issue = [&](int k) {
        const int task = first_task + (k / chunks) * task_stride, g0 = (k % chunks) * kQ4SlotGroups;
        const int n = min(kQ4SlotGroups, p.groups - g0);
        int r0, r1;
        q4_task_rows<MODE>(p, task, r0, r1);
        char *slot = ring + (k % NS) * kQ4SlotBytes;
        uint64_t *bar = full + k % NS;
        mbarrier_expect_bytes(bar, 2 * n * 16 + 2 * n);
        bulk_copy_to_shared(slot, p.weight + ((size_t)r0 * p.groups + g0) * 16, n * 16, bar, policy);
        bulk_copy_to_shared(slot + kQ4SlotRowBytes, p.weight + ((size_t)r1 * p.groups + g0) * 16, n * 16, bar, policy);
        bulk_copy_to_shared(slot + 2 * kQ4SlotRowBytes, p.scales + (size_t)r0 * p.groups + g0, n, bar, policy);
        bulk_copy_to_shared(slot + 2 * kQ4SlotRowBytes + kQ4SlotScaleBytes, p.scales + (size_t)r1 * p.groups + g0,
                            n, bar, policy);
    };
    if (lane == 0) {
#pragma unroll
        for (int s = 0; s < NS; ++s) mbarrier_init(full + s, 1);
        // The barriers' initialization is visible to the copy engine before its first copy.
        asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::: "memory");
        // The weights do not depend on earlier kernels.
        for (int k = 0; k < kQ4BulkPreWait && k < my_chunks; ++k) issue(k);
    }
    __syncwarp();
    float2 settled;
    const int settled_task = read_settled<MODE>(p, first_task, lane, settled);
    const float *norm_weight = kNorm ? p.norm_weight : nullptr;
    float *normed_out = kNorm && blockIdx.x == 0 ? p.normed_out : nullptr;
    Q4Stager<MODE, WARPS> stager;
    stager.prepare(p.x, norm_weight, normed_out, p.cols);
    GEMV_TRACE_SLOT(g_q4_trace_count);
    pdl_wait_then_launch<MODE == kGemvNorm>();
    GEMV_TRACE_WAITED();
    stager.load_x(p.x, p.cols);
    if (lane == 0)
        for (int k = kQ4BulkPreWait; k < NS && k < my_chunks; ++k) issue(k);
    stager.stage(p.x, norm_weight, p.eps, p.cols, reinterpret_cast<uint2 *>(codes), gq, normed_out, scratch,
                 true);
    GEMV_TRACE_QUANTIZED();
    __syncthreads();
    GEMV_TRACE_STAGED(g_q4_trace);

    float acc0 = 0.f, acc1 = 0.f;
    int task = first_task, chunk = 0;
    for (int k = 0; k < my_chunks; ++k) {
        mbarrier_wait(full + k % NS, (k / NS) & 1);
        const char *slot = ring + (k % NS) * kQ4SlotBytes;
        const uint4 *w0 = reinterpret_cast<const uint4 *>(slot);
        const uint4 *w1 = reinterpret_cast<const uint4 *>(slot + kQ4SlotRowBytes);
        const uint8_t *s0 = reinterpret_cast<const uint8_t *>(slot + 2 * kQ4SlotRowBytes);
        const uint8_t *s1 = s0 + kQ4SlotGroups;
#pragma unroll
        for (int h = 0; h < H; ++h) {
            const int local = h * kWarpSize + lane, c = chunk * kQ4SlotGroups + local;
            if (c < p.groups)
                q4_fold_group(codes, gq, c, w0[local], w1[local], q4_scale_value(s0[local]),
                              q4_scale_value(s1[local]), acc0, acc1);
        }
        // Every lane has read the slot (generic proxy) before the copy engine refills it.
        __syncwarp();
        if (lane == 0 && k + NS < my_chunks) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            issue(k + NS);
        }
        if (++chunk == chunks) {
            int r0, r1;
            q4_task_rows<MODE>(p, task, r0, r1);
            q4_task_out<MODE>(p, task, r0, r1, warp_sum(acc0), warp_sum(acc1), lane, settled, settled_task);
            acc0 = acc1 = 0.f;
            chunk = 0;
            task += task_stride;
        }
    }
    GEMV_TRACE_END(g_q4_trace);
}

// ---- MoE down ------------------------------------------------------------------------------
// x[r] += sum over j of sel_weights[j] * (down_e[r] . act_j), e = selected[j]: every act_j
// quantized per group (its groups follow each other: slot f = j * gpe + g, gpe = groups per
// expert row), the routing weight folded into the group's scale. A warp takes two output rows
// and its lanes stride over all top_k * gpe slots, so a small expert row (Qwen3-30B-A3B: 24
// groups) still keeps every lane busy.
struct Q4MoeDownParams {
    const uint8_t *weight;      // [E * H rows, gpe * 16]
    const uint8_t *scales;      // [E * H, gpe] e5m3
    const float *act;           // [top_k, I]
    const int32_t *selected;    // [top_k]
    const float *sel_weights;   // [top_k]
    float *x;                   // [H], += the weighted sum
    int top_k, hidden, inter, gpe;
};

template <int U>
__global__ void __launch_bounds__(kQ4MoeDownWarps * kWarpSize) moe_down_q4_kernel(const Q4MoeDownParams p) {
    constexpr int kThreads = kQ4MoeDownWarps * kWarpSize;
    extern __shared__ __align__(16) uint4 q4_smem[];  // codes [slots * 2], Q8Group [slots], int2 [slots]
    const int n_slots = p.top_k * p.gpe;
    uint4 *codes = q4_smem;
    Q8Group *gq = reinterpret_cast<Q8Group *>(codes + 2 * n_slots);
    int2 *slot_of = reinterpret_cast<int2 *>(gq + n_slots);  // (first row of expert e: e * H, group)
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int n_tasks = ceil_div(p.hidden, 2);
    const int task_stride = gridDim.x * kQ4MoeDownWarps;
    const uint64_t policy = l2_evict_first();

    // Lane l's U slots of a batch (b0 + l + 32u) for the task's two rows.
    uint4 w0[U], w1[U];
    float s0[U], s1[U];
    auto load = [&](int r0, int r1, int b0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int f = b0 + lane + u * kWarpSize;
            w0[u] = w1[u] = make_uint4(0u, 0u, 0u, 0u);
            s0[u] = s1[u] = 0.f;
            if (f < n_slots) {
                const int2 s = slot_of[f];
                const size_t row0 = (size_t)(s.x + r0), row1 = (size_t)(s.x + r1);
                w0[u] = load_weight_chunk(reinterpret_cast<const uint4 *>(p.weight + row0 * p.gpe * 16) + s.y,
                                          policy);
                w1[u] = load_weight_chunk(reinterpret_cast<const uint4 *>(p.weight + row1 * p.gpe * 16) + s.y,
                                          policy);
                s0[u] = load_q4_scale(p.scales + row0 * p.gpe + s.y, policy);
                s1[u] = load_q4_scale(p.scales + row1 * p.gpe + s.y, policy);
            }
        }
    };

    // Before the wait: selected and sel_weights (the top-k kernel's) and x (the O
    // projection's) are settled. Their writers are two or more launches back, and the gate/up
    // kernel between lets this one launch only after its own wait has returned. So the slot
    // table, the first task's first weights and its residual are read now; act needs the wait.
    for (int f = threadIdx.x; f < n_slots; f += kThreads) {
        const int j = f / p.gpe;
        slot_of[f] = make_int2(p.selected[j] * p.hidden, f - j * p.gpe);
    }
    __syncthreads();
    int task = blockIdx.x * kQ4MoeDownWarps + warp;
    float x0 = 0.f, x1 = 0.f;  // lane 0: the task's residual, read as its loads are issued
    if (task < n_tasks) {
        const int r0 = 2 * task, r1 = min(r0 + 1, p.hidden - 1);
        load(r0, r1, 0);
        if (lane == 0) {
            x0 = p.x[r0];
            x1 = p.x[r1];
        }
    }

    pdl_wait();  // act comes from the gate/up kernel
    pdl_launch_dependents();
    if (p.inter % kQ4Group == 0) {
        // The experts' groups meet at group boundaries: act [top_k, I] staged as one input of
        // top_k * I columns gives the same codes and groups as expert by expert, in one round
        // trip to L2 instead of top_k (Qwen3-30B-A3B: 8 x 768 columns, 3 items a thread).
        Q8Stager<kThreads, 3> stager;
        stager.prepare(p.act, nullptr, nullptr, p.top_k * p.inter);
        stager.stage(p.act, nullptr, 0.f, p.top_k * p.inter, reinterpret_cast<uint2 *>(codes), gq, nullptr,
                     nullptr);
    } else {
        for (int j = 0; j < p.top_k; ++j) {
            Q8Stager<kThreads, 1> stager;
            stager.prepare(p.act + (size_t)j * p.inter, nullptr, nullptr, p.inter);
            stager.stage(p.act + (size_t)j * p.inter, nullptr, 0.f, p.inter,
                         reinterpret_cast<uint2 *>(codes + 2 * j * p.gpe), gq + j * p.gpe, nullptr, nullptr);
        }
    }
    __syncthreads();
    for (int f = threadIdx.x; f < n_slots; f += kThreads) gq[f].scale *= p.sel_weights[f / p.gpe];
    __syncthreads();

    for (; task < n_tasks; task += task_stride) {
        const int r0 = 2 * task, r1 = min(r0 + 1, p.hidden - 1);
        float acc0 = 0.f, acc1 = 0.f;
        for (int b0 = 0;;) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int f = b0 + lane + u * kWarpSize;
                if (f < n_slots) q4_fold_group(codes, gq, f, w0[u], w1[u], s0[u], s1[u], acc0, acc1);
            }
            b0 += kWarpSize * U;
            if (b0 >= n_slots) break;
            load(r0, r1, b0);
        }
        const float x0_task = x0, x1_task = x1;
        const int next = task + task_stride;
        if (next < n_tasks) {  // the next task's first loads overlap this one's reduction
            const int n0 = 2 * next, n1 = min(n0 + 1, p.hidden - 1);
            load(n0, n1, 0);
            if (lane == 0) {
                x0 = p.x[n0];
                x1 = p.x[n1];
            }
        }
        acc0 = warp_sum(acc0);
        acc1 = warp_sum(acc1);
        if (lane == 0) {
            p.x[r0] = x0_task + acc0;
            if (r1 != r0) p.x[r1] = x1_task + acc1;
        }
    }
}

// ---- dispatch ------------------------------------------------------------------------------
template <int WARPS>
const void *q4_kernel_for_mode(int mode) {
    switch (mode) {
        case kGemvPlain: return (const void *)gemv_q4_kernel<kGemvPlain, WARPS>;
        case kGemvNorm: return (const void *)gemv_q4_kernel<kGemvNorm, WARPS>;
        case kGemvResidual: return (const void *)gemv_q4_kernel<kGemvResidual, WARPS>;
        case kGemvNormSwiglu: return (const void *)gemv_q4_kernel<kGemvNormSwiglu, WARPS>;
        case kQ4MoeGateUp: return (const void *)gemv_q4_kernel<kQ4MoeGateUp, WARPS>;
    }
    return nullptr;
}
template <int WARPS>
const void *q4_bulk_kernel_for_mode(int mode) {
    switch (mode) {
        case kGemvPlain: return (const void *)gemv_q4_bulk_kernel<kGemvPlain, WARPS>;
        case kGemvNorm: return (const void *)gemv_q4_bulk_kernel<kGemvNorm, WARPS>;
        case kGemvResidual: return (const void *)gemv_q4_bulk_kernel<kGemvResidual, WARPS>;
        case kGemvNormSwiglu: return (const void *)gemv_q4_bulk_kernel<kGemvNormSwiglu, WARPS>;
    }
    return nullptr;
}
const void *q4_bulk_kernel_for(int mode, int warps) {
    switch (warps) {
        case 2: return q4_bulk_kernel_for_mode<2>(mode);
        case 4: return q4_bulk_kernel_for_mode<4>(mode);
        case 8: return q4_bulk_kernel_for_mode<8>(mode);
        case 16: return q4_bulk_kernel_for_mode<16>(mode);
    }
    return nullptr;
}
size_t q4_bulk_smem_bytes(int groups, int warps) {
    return q4_ring_offset(groups) + (size_t)warps * kQ4BulkSlots * kQ4SlotBytes;
}
// Bulk copies need 16-byte sizes and addresses: a row's scales are groups * 2 bytes.
bool q4_bulk_fits(const Q4Params &q) {
    return q4_bulk_groups_fit(q.groups) && (reinterpret_cast<uintptr_t>(q.weight) & 15) == 0 &&
           (reinterpret_cast<uintptr_t>(q.scales) & 15) == 0;
}
const void *q4_kernel_for(int mode, int warps) {
    switch (warps) {
        case 2: return q4_kernel_for_mode<2>(mode);
        case 4: return q4_kernel_for_mode<4>(mode);
        case 8: return q4_kernel_for_mode<8>(mode);
        case 16: return q4_kernel_for_mode<16>(mode);
    }
    return nullptr;
}

int q4_groups(int cols) { return ceil_div(cols, kQ4Group); }

// Plan for `tasks` two-row tasks: the largest block (16, 8, 4 or 2 warps) of which the tasks
// still give at least half the SMs a block, so that each SM stages the input once (a 16-warp
// block stages 12288 columns in one round trip to L2, an 8-warp block in two) and the task
// stride spreads rows over the SMs; the grid is at most what is resident at once. (With the
// pipeline a warp's rounds do not cost a load round trip each, so staging the input once per SM
// matters more than losing fewer rounds to a smaller block.)
cudaError_t q4_plan_tasks(int mode, int tasks, int cols, bool bulk_stream, GemvPlan *plan) {
    int sm_count = 0;
    OG_CUDA_RETURN_IF(current_sm_count(&sm_count));
    const size_t smem = gemv_q4_smem_bytes(cols);
    int warps = kQ4MaxWarps;
    while (warps > 2 && 2 * ceil_div(tasks, warps) < sm_count) warps /= 2;
    const void *kernel = q4_kernel_for(mode, warps);
    if (kernel == nullptr) return cudaErrorInvalidValue;
    int blocks_per_sm = 0;
    OG_CUDA_RETURN_IF(allow_dynamic_smem(kernel, smem));
    OG_CUDA_RETURN_IF(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, warps * kWarpSize, smem));
    if (blocks_per_sm <= 0) return cudaErrorInvalidConfiguration;
    const int needed = ceil_div(tasks, warps);
    plan->grid = needed < blocks_per_sm * sm_count ? needed : blocks_per_sm * sm_count;
    plan->warps = warps;
    plan->unroll = kQ4ChunkGroups;
    plan->stages = 0;
    plan->smem_bytes = (int)smem;
    plan->format = OG_WEIGHTS_Q4;
    plan->stream = kQ4StreamRegisters;
    // The bulk stream where asked for and possible: 16-byte copies, the ring within the
    // device's shared memory, a block resident per SM (the same blocks and tasks).
    const void *bulk = q4_bulk_kernel_for(mode, warps);
    const size_t bulk_smem = q4_bulk_smem_bytes(q4_groups(cols), warps);
    if (!bulk_stream || bulk == nullptr || !q4_bulk_groups_fit(q4_groups(cols))) return cudaSuccess;
    if (allow_dynamic_smem(bulk, bulk_smem) != cudaSuccess) {
        cudaGetLastError();  // too large for this device: the register stream stays
        return cudaSuccess;
    }
    OG_CUDA_RETURN_IF(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, bulk, warps * kWarpSize, bulk_smem));
    if (blocks_per_sm <= 0) return cudaSuccess;
    plan->grid = needed < blocks_per_sm * sm_count ? needed : blocks_per_sm * sm_count;
    plan->smem_bytes = (int)bulk_smem;
    plan->stream = kQ4StreamBulk;
    return cudaSuccess;
}

Q4Params q4_params(int rows, int cols, const void *weight, const void *scales) {
    Q4Params q = {};
    q.weight = static_cast<const uint8_t *>(weight);
    q.scales = static_cast<const uint8_t *>(scales);
    q.rows = rows;
    q.cols = cols;
    q.groups = q4_groups(cols);
    return q;
}

// The plan's stream; a bulk plan's matrix that does not fit the copies (a weight or scale
// pointer not 16-byte aligned) takes the register stream on the same grid.
cudaError_t launch_q4(int mode, const GemvPlan &plan, const Q4Params &q, cudaStream_t stream, bool pdl) {
    using Kernel = void (*)(Q4Params);
    const bool bulk = plan.stream == kQ4StreamBulk && q4_bulk_fits(q);
    const auto kernel = (Kernel)(bulk ? q4_bulk_kernel_for(mode, plan.warps) : q4_kernel_for(mode, plan.warps));
    if (kernel == nullptr) return cudaErrorInvalidConfiguration;
    const size_t smem = bulk ? (size_t)plan.smem_bytes : gemv_q4_smem_bytes(q.cols);
    return launch_kernel(kernel, dim3(plan.grid), dim3(plan.warps * kWarpSize), smem, stream, pdl, q);
}

}  // namespace

size_t gemv_q4_smem_bytes(int cols) {
    return q4_staged_bytes(q4_groups(cols));
}

cudaError_t gemv_q4_plan(GemvMode mode, int rows, int cols, GemvPlan *plan, bool bulk_stream) {
    if (mode < kGemvPlain || mode > kGemvNormSwiglu || rows <= 0 || cols <= 0 || plan == nullptr ||
        (mode == kGemvNormSwiglu && rows % 2 != 0))
        return cudaErrorInvalidValue;
    return q4_plan_tasks(mode, mode == kGemvNormSwiglu ? rows / 2 : ceil_div(rows, 2), cols, bulk_stream, plan);
}

cudaError_t launch_gemv_q4(GemvMode mode, const GemvPlan &plan, const GemvArgs &args,
                           cudaStream_t stream, bool pdl) {
    if (plan.grid <= 0 || plan.format != OG_WEIGHTS_Q4) return cudaErrorInvalidConfiguration;
    if (args.w.format != OG_WEIGHTS_Q4 || args.w.scales == nullptr || mode < kGemvPlain ||
        mode > kGemvNormSwiglu)
        return cudaErrorInvalidValue;
    const int rows = (int)args.w.rows;   // launch_gemv checked the range
    Q4Params q = q4_params(rows, args.w.cols, args.w.data, args.w.scales);
    q.x = args.x;
    q.norm_weight = args.norm_weight;
    q.y = args.y;
    q.normed_out = args.normed_out;
    q.out_rows = mode == kGemvNormSwiglu ? rows / 2 : rows;
    q.n_tasks = mode == kGemvNormSwiglu ? q.out_rows : ceil_div(rows, 2);
    q.eps = args.eps;
    q.residual_settled = mode == kGemvResidual && args.residual_settled;
    return launch_q4(mode, plan, q, stream, pdl);
}

cudaError_t launch_moe_gate_up_q4(const void *weights, const void *scales, const float *x_normed,
                                  const int32_t *selected, int top_k, int hidden, int inter,
                                  float *act, cudaStream_t stream, bool pdl) {
    if (weights == nullptr || scales == nullptr || x_normed == nullptr || selected == nullptr ||
        act == nullptr || top_k < 1 || hidden < 1 || inter < 1 || (int64_t)top_k * inter > INT32_MAX)
        return cudaErrorInvalidValue;
    // The plan depends only on the shape; the occupancy query is made once per shape and device.
    struct Cached {
        int device = -1, top_k = 0, hidden = 0, inter = 0;
        GemvPlan plan;
    };
    static thread_local Cached cached;
    int device = 0;
    OG_CUDA_RETURN_IF(cudaGetDevice(&device));
    if (cached.device != device || cached.top_k != top_k || cached.hidden != hidden || cached.inter != inter) {
        GemvPlan plan;
        OG_CUDA_RETURN_IF(q4_plan_tasks(kQ4MoeGateUp, top_k * inter, hidden, false, &plan));
        cached = Cached{device, top_k, hidden, inter, plan};
    }
    Q4Params q = q4_params(2 * inter, hidden, weights, scales);  // rows: per expert
    q.x = x_normed;
    q.y = act;
    q.out_rows = inter;
    q.n_tasks = top_k * inter;
    q.selected = selected;
    return launch_q4(kQ4MoeGateUp, cached.plan, q, stream, pdl);
}

cudaError_t launch_moe_down_q4(const void *weights, const void *scales, const float *act,
                               const int32_t *selected, const float *sel_weights, int top_k,
                               int hidden, int inter, float *x, cudaStream_t stream, bool pdl) {
    if (weights == nullptr || scales == nullptr || act == nullptr || selected == nullptr ||
        sel_weights == nullptr || x == nullptr || top_k < 1 || top_k > kQ4MaxTopK || hidden < 1 ||
        inter < 1)
        return cudaErrorInvalidValue;
    Q4MoeDownParams q = {};
    q.weight = static_cast<const uint8_t *>(weights);
    q.scales = static_cast<const uint8_t *>(scales);
    q.act = act;
    q.selected = selected;
    q.sel_weights = sel_weights;
    q.x = x;
    q.top_k = top_k;
    q.hidden = hidden;
    q.inter = inter;
    q.gpe = q4_groups(inter);
    const int n_slots = top_k * q.gpe;
    const size_t smem = (size_t)n_slots * (32 + sizeof(Q8Group) + sizeof(int2));
    int sm_count = 0;
    OG_CUDA_RETURN_IF(current_sm_count(&sm_count));
    const int blocks = ceil_div(ceil_div(hidden, 2), kQ4MoeDownWarps);
    const int grid = blocks < 2 * sm_count ? blocks : 2 * sm_count;
    const int per_lane = ceil_div(n_slots, kWarpSize);
    const auto kernel = per_lane <= 2 ? moe_down_q4_kernel<2> : per_lane <= 4 ? moe_down_q4_kernel<4>
                                                                             : moe_down_q4_kernel<8>;
    if (smem > 48 * 1024) OG_CUDA_RETURN_IF(allow_dynamic_smem((const void *)kernel, smem));
    return launch_kernel(kernel, dim3(grid), dim3(kQ4MoeDownWarps * kWarpSize), smem, stream, pdl, q);
}

}  // namespace og

#ifdef OG_Q4_TRACE
OG_TRACE_READERS(q4, og::g_q4_trace, og::g_q4_trace_count)
#endif
