// gemv_int8.cu — weight matrix x fp32 vector over int8 weights on the tensor cores (modes as
// kernels.cuh's GemvMode, plus the MoE experts' gate/up), and the MoE experts' int8 down
// projection with its weighted residual; the MoE launchers route q4 experts to gemv_q4.cu.
#include <atomic>

#include "gemv.cuh"

namespace og {
namespace {

// ---- int8: the tensor cores ------------------------------------------------------------------
// (q4 has its own kernel, gemv_q4.cu: integer dot products on the input quantized to int8.)
// Dequantizing to fp32 and one fp32 fma per weight cost ~13 instructions per 4 int8 bytes
// (more per token than bf16's 1 per byte): the int8 GEMVs were bound by instruction issue,
// not DRAM. Here the dot products run on mma.sync m16n8k16 (fp16 inputs, fp32 accumulation),
// which leaves only the dequantization (quant.cuh's LOP3 trick: codes straight into fp16,
// exactly) to the CUDA cores.
//
//   A (16 x 16, fp16): weight codes, exact in fp16. Lane (g, t) = (lane / 4, lane % 4) loads
//       16-byte chunk c = 4 kb + t of rows g and g + 8 of the task (k-block kb = 4 chunks);
//       each 32-bit word of a chunk feeds one mma (4 codes per row): its half2 pairs are the
//       lane's A registers, so a lane's k indices {2t, 2t+1, 2t+8, 2t+9} stand for 4 physical
//       columns of its own word (any assignment works as long as B uses the same one).
//   B (16 x 8, fp16): x * 2^e split into hi + lo fp16 halves (|x 2^e - hi - lo| <= 2^-22
//       |x 2^e|; 2^e puts max |x| in [2^14, 2^15), inside fp16's range), staged in shared
//       memory in the A pairs' column order (layout at store_split_word). Column n of B is hi
//       for n < 4 and lo for n >= 4. D accumulates the whole row's hi and lo sums and the row
//       scale is applied at the end.
//   A task is 16 rows (SwiGLU: gate rows i..i+7 and up rows I+i..I+i+7); the block's 8 warps
//   split its k-blocks (warp w: kb = w, w + 8, ...; the dense kernel streams them through its
//   load ring, the MoE down kernel holds U in registers), and the 8 partial sums per row are
//   added in warp order (deterministic: graph replays are bit-identical).

// int8 codes per 32-bit word, and the half2 pairs they make (quant.cuh word_pairs).
constexpr int kCodesPerWord = 4, kPairsPerWord = 2;

// The power of two 2^e that puts max |x| = bound in [2^14, 2^15) (fp16's range with room).
__device__ __forceinline__ int split_exponent(float bound) {
    if (!(bound > 0.f && bound <= 3.0e38f)) return 0;  // zero, inf or NaN input: no scaling
    int ex;
    frexpf(bound, &ex);                                // bound in [2^(ex-1), 2^ex)
    return min(max(15 - ex, -100), 100);
}

__device__ __forceinline__ bool is_aligned16(const void *p) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}
// v[at .. at + 3] = a * up.
template <int V>
__device__ __forceinline__ void put_scaled4(float (&v)[V], int at, float4 a, float up) {
    v[at] = a.x * up;
    v[at + 1] = a.y * up;
    v[at + 2] = a.z * up;
    v[at + 3] = a.w * up;
}
// v[col .. col + 3], or zeros past n (with n % 4 == 0 a float4 is wholly inside or past it).
__device__ __forceinline__ float4 load4_or_zero(const float *v, int col, int n) {
    return col < n ? *reinterpret_cast<const float4 *>(v + col) : make_float4(0.f, 0.f, 0.f, 0.f);
}

// The staged B, in 32-bit words. Word wi of the input (columns wi V .. wi V + V - 1) lies in chunk
// c = wi / 4 = 4 kb + t at word j = wi % 4; its P half2 pairs k = (v[k], v[k + P]) (the order of
// word_pairs) split into hi and lo halves h. Pairs 2m and 2m + 1 of both halves (one mma's B
// registers for lane (g, t) with h = g / 4) sit together:
//   x_pairs[16 ((kb * 4 + j) * (P / 2) + m) + 4 t + 2 h + e]   = half h of pair 2m + e
// so the B loads of one mma (fixed kb, j, m; lanes differ in t and h) read 64 contiguous bytes:
// one shared-memory wavefront (a layout by word with hi and lo apart was a 4- to 5-way conflict).
__host__ __device__ constexpr int b_kblock_words(int pairs) { return 32 * pairs; }
// Where lane (g, t) reads B (its column's pairs), and the words from one k-block to the next.
__device__ __forceinline__ const uint32_t *b_lane_base(const uint32_t *x_pairs, int g, int t) {
    return x_pairs + 4 * t + 2 * (g >> 2);
}
constexpr int kBStep = b_kblock_words(kPairsPerWord);

// Word wi's values v[0..V) (already times 2^e) into the staged B: per pair couple m one 16-byte
// store {hi 2m, hi 2m + 1, lo 2m, lo 2m + 1}.
template <int V>
__device__ __forceinline__ void store_split_word(const float (&v)[V], int wi, uint32_t *x_pairs) {
    constexpr int P = V / 2;
    const int kb = wi / 16, t = (wi / 4) % 4, j = wi % 4;
    uint32_t hi[P], lo[P];
#pragma unroll
    for (int k = 0; k < P; ++k) {
        const __half h0 = __float2half_rn(v[k]), h1 = __float2half_rn(v[k + P]);
        const __half l0 = __float2half_rn(v[k] - __half2float(h0));
        const __half l1 = __float2half_rn(v[k + P] - __half2float(h1));
        hi[k] = half2_as_u32(__halves2half2(h0, h1));
        lo[k] = half2_as_u32(__halves2half2(l0, l1));
    }
#pragma unroll
    for (int m = 0; m < P / 2; ++m)
        *reinterpret_cast<uint4 *>(x_pairs + 16 * ((kb * 4 + j) * (P / 2) + m) + 4 * t) =
            make_uint4(hi[2 * m], hi[2 * m + 1], lo[2 * m], lo[2 * m + 1]);
}

// U k-blocks of two rows in registers: chunk c = 4 kb + t of rows g and g + 8 for kb = kb0,
// kb0 + 1, ... (zeros past n_kb or the row's chunks).
template <int U>
struct KBlockRegs {
    uint4 a_g[U], a_g8[U];
};
template <int U>
__device__ __forceinline__ void load_kblocks(KBlockRegs<U> &r, const uint4 *w_g, const uint4 *w_g8,
                                             int kb0, int n_kb, int n_chunks, int t) {
    const uint64_t policy = l2_evict_first();
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int c = 4 * (kb0 + u) + t;
        const bool ok = kb0 + u < n_kb && c < n_chunks;
        r.a_g[u] = ok ? load_weight_chunk(w_g + c, policy) : make_uint4(0u, 0u, 0u, 0u);
        r.a_g8[u] = ok ? load_weight_chunk(w_g8 + c, policy) : make_uint4(0u, 0u, 0u, 0u);
    }
}

// One k-block of two rows (chunk c = 4 kb + t of rows g and g + 8 in a_g, a_g8) against B's
// k-block at b_kb (b_lane_base + kb * kBStep), accumulated into d (the rows' hi and lo sums).
__device__ __forceinline__ void mma_kblock(const uint4 &a_g, const uint4 &a_g8, const uint32_t *b_kb,
                                           float (&d)[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        __half2 hg[kPairsPerWord], hg8[kPairsPerWord];
        word_pairs(word_of(a_g, j), hg);
        word_pairs(word_of(a_g8, j), hg8);
        const uint2 b = *reinterpret_cast<const uint2 *>(b_kb + 8 * kPairsPerWord * j);
        mma_16816(d, half2_as_u32(hg[0]), half2_as_u32(hg8[0]), half2_as_u32(hg[1]),
                  half2_as_u32(hg8[1]), b.x, b.y);
    }
}

// The rows' sums over a warp's k-blocks (x 2^e, before the row scale), complete in every lane:
// every lane's B is active, so each D column holds the whole hi (columns 0-3) or lo (4-7)
// sum: column 0 (lane t = 0) + column 4 (lane t = 2).
__device__ __forceinline__ void finish_row_sums(const float (&d)[4], float &sum_g, float &sum_g8) {
    sum_g = d[0] + __shfl_xor_sync(kFullMask, d[0], 2);
    sum_g8 = d[2] + __shfl_xor_sync(kFullMask, d[2], 2);
}

// One warp's dot products of two rows with the staged B over all their k-blocks (U in flight),
// chunk c = 4 kb + t of rows w_g and w_g8, against B's k-block kb_b0 + kb (the MoE down
// kernel's loop).
template <int U>
__device__ __forceinline__ void mma_rows_dot(const uint4 *w_g, const uint4 *w_g8, int n_kb, int n_chunks,
                                             const uint32_t *b_base, int kb_b0, int t, float &sum_g,
                                             float &sum_g8) {
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    KBlockRegs<U> r;
    for (int kb0 = 0; kb0 < n_kb; kb0 += U) {
        load_kblocks(r, w_g, w_g8, kb0, n_kb, n_chunks, t);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kb = kb0 + u;
            if (kb >= n_kb) break;  // warp-uniform
            mma_kblock(r.a_g[u], r.a_g8[u], b_base + (size_t)(kb_b0 + kb) * kBStep, d);
        }
    }
    finish_row_sums(d, sum_g, sum_g8);
}

// Row of the matrix behind row slot r (0..15) of task `task`, clamped into the matrix.
template <int MODE>
__device__ __forceinline__ int quant_task_row(const QuantGemvParams &p, int task, int r) {
    if (MODE == kQuantMoeGateUp) {
        const int j = task / p.tasks_per_expert;
        const int i = min(8 * (task - j * p.tasks_per_expert) + (r & 7), p.out_rows - 1);
        return __ldg(p.selected + j) * 2 * p.out_rows + (r < 8 ? i : p.out_rows + i);
    }
    if (MODE == kGemvNormSwiglu) {
        const int i = min(8 * task + (r & 7), p.out_rows - 1);
        return r < 8 ? i : p.out_rows + i;
    }
    return min(kQuantTaskRows * task + r, p.rows - 1);
}


// A weight chunk into its ring slot (zeros when !valid): rows stream once per token, so 256-byte
// L2 fetches and lines evicted first (policy) as load_weight_chunk does (the block's 8 warps
// read a row's neighbouring 64 bytes).
__device__ __forceinline__ void copy_weight_chunk(uint32_t dst, const uint4 *src, bool valid, uint64_t policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(dst),
                 "l"(src), "r"(valid ? 16 : 0), "l"(policy)
                 : "memory");
}


// At most 80 registers (not __launch_bounds__, which cannot be combined with it): three int8
// blocks of 8 warps per SM still fit (768 x 80 <= 64K); left to itself ptxas stopped the q4
// kernels at 64 and spilled the staging registers.
template <int MODE, int WARPS, int S>
__global__ void __maxnreg__(80) gemv_int8_kernel(const QuantGemvParams p) {
    constexpr int kThreads = WARPS * kWarpSize;
    constexpr int V = kCodesPerWord, P = kPairsPerWord;
    // the staged B (n_kblocks * b_kblock_words(P) words, layout above), then the ring (above)
    extern __shared__ __align__(16) uint32_t x_pairs[];
    __shared__ float scratch[2 * WARPS];
    __shared__ float partial[WARPS][kQuantTaskRows];

    const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
    const int g = lane >> 2, t = lane & 3;
    const int n_words = p.n_kblocks * 16;
    uint4 *ring_w = reinterpret_cast<uint4 *>(x_pairs + (size_t)2 * n_words * P);
    // This warp's k-blocks of every task: kb = warp, warp + WARPS, ... (n_mine of them).
    const int n_mine = warp < p.n_kblocks ? ceil_div(p.n_kblocks - warp, WARPS) : 0;
    // A slot's bytes in ring_w, and this lane's slot-0 address (cp.async takes it).
    constexpr uint32_t kSlotW = 2 * kThreads * 16;
    const uint32_t ring_w_lane = smem_address(ring_w + tid);
    const uint64_t policy = l2_evict_first();

    // The copy side: the next k-block to copy is k-block copy_kb4 / 4 of task copy_task (a warp
    // without k-blocks copies nothing). The lane's pointers are set when a task starts (chunk t
    // of rows g and g + 8); k-block kb is 4 kb chunks further.
    int copy_task = n_mine > 0 ? (int)blockIdx.x : p.n_tasks, copy_kb4 = 4 * warp, copy_slot = 0;
    const uint4 *copy_w_g = nullptr, *copy_w_g8 = nullptr;
    auto issue = [&]() {
        if (copy_task < p.n_tasks) {
            if (copy_kb4 == 4 * warp) {
                const int row_g = quant_task_row<MODE>(p, copy_task, g);
                const int row_g8 = quant_task_row<MODE>(p, copy_task, g + 8);
                copy_w_g = reinterpret_cast<const uint4 *>(p.weight + (size_t)row_g * p.row_bytes) + t;
                copy_w_g8 = reinterpret_cast<const uint4 *>(p.weight + (size_t)row_g8 * p.row_bytes) + t;
            }
            const bool ok = copy_kb4 + t < p.n_chunks;
            const int off = ok ? copy_kb4 : 0;  // past the row: nothing is read (zero fill)
            const uint32_t dst_w = ring_w_lane + copy_slot * kSlotW;
            copy_weight_chunk(dst_w, copy_w_g + off, ok, policy);
            copy_weight_chunk(dst_w + kThreads * 16, copy_w_g8 + off, ok, policy);
            copy_slot = copy_slot + 1 == S ? 0 : copy_slot + 1;
            copy_kb4 += 4 * WARPS;
            if (copy_kb4 >= 4 * p.n_kblocks) {
                copy_kb4 = 4 * warp;
                copy_task += gridDim.x;
            }
        }
        cp_async_commit();  // one group per call, empty or not: wait_group counts calls
    };

    // The weights do not depend on earlier kernels (the experts' do: which rows is the top-k
    // kernel's output): the ring's first S - 1 k-blocks go out before waiting on the previous
    // kernel, so they arrive while it finishes and while x is staged below. The rest of the
    // block's first task's rows is not pulled into L2 as well: those prefetches compete with
    // the previous kernel's loads.
    if (MODE != kQuantMoeGateUp) {
#pragma unroll
        for (int s = 0; s < S - 1; ++s) issue();
    }
    // x's staging below reads x (and the norm weights) in two passes. When this thread's share
    // fits kStageFloat4s float4s (4096 columns; 12288 at 16 warps without a norm) the first
    // pass keeps it in registers for the second, and the norm weights (weights: they do not
    // depend on earlier kernels) are loaded before the wait: one round trip to L2 after the
    // wait instead of two. This thread's float4 k
    // is part k % (V / 4) of word tid + (k / (V / 4)) * threads.
    const bool norm = mode_has_norm(MODE);
    const bool write_normed = norm && p.normed_out != nullptr && blockIdx.x == 0;
    // A thread's V columns by float4 when whole float4s are in reach: one scalar load per column
    // strided V floats across the warp cost 32 sectors an instruction (the largest L1 load of the
    // kernel for 12288 columns).
    const bool vec = p.cols % 4 == 0 && is_aligned16(p.x) && (!norm || is_aligned16(p.norm_weight)) &&
                     (!write_normed || is_aligned16(p.normed_out));
    constexpr int kStageFloat4s = mode_has_norm(MODE) || WARPS < 16 ? 4 : 6;
    constexpr int kStageWords = kStageFloat4s / (V / 4);
    const bool in_regs = vec && n_words <= kStageWords * kThreads;
    auto stage_col = [&](int k) { return (tid + (k / (V / 4)) * kThreads) * V + 4 * (k % (V / 4)); };
    float4 xs[kStageFloat4s], ws[kStageFloat4s];
    if (norm && in_regs) {
#pragma unroll
        for (int k = 0; k < kStageFloat4s; ++k) ws[k] = load4_or_zero(p.norm_weight, stage_col(k), p.cols);
    }
    pdl_wait_then_launch<MODE == kGemvNorm>();
    if (MODE == kQuantMoeGateUp) {
#pragma unroll
        for (int s = 0; s < S - 1; ++s) issue();
    }

    // ---- x (normalized in norm modes) -> the scale 2^e -> hi/lo fp16 pairs in shared memory
    float sum_sq = 0.f, max_abs = 0.f;  // norm: max |x w|, the normalized max before 1/rms
    if (in_regs) {
#pragma unroll
        for (int k = 0; k < kStageFloat4s; ++k) xs[k] = load4_or_zero(p.x, stage_col(k), p.cols);
#pragma unroll
        for (int k = 0; k < kStageFloat4s; ++k) {
            const float4 x4 = xs[k];
            sum_sq = fmaf(x4.x, x4.x, sum_sq);
            sum_sq = fmaf(x4.y, x4.y, sum_sq);
            sum_sq = fmaf(x4.z, x4.z, sum_sq);
            sum_sq = fmaf(x4.w, x4.w, sum_sq);
            const float4 m = norm ? make_float4(x4.x * ws[k].x, x4.y * ws[k].y, x4.z * ws[k].z, x4.w * ws[k].w) : x4;
            max_abs = fmaxf(max_abs, fmaxf(fmaxf(fabsf(m.x), fabsf(m.y)), fmaxf(fabsf(m.z), fabsf(m.w))));
        }
    } else {
        for (int i = tid; i < p.cols; i += kThreads) {
            const float v = p.x[i];
            sum_sq = fmaf(v, v, sum_sq);
            max_abs = fmaxf(max_abs, fabsf(norm ? v * p.norm_weight[i] : v));
        }
    }
    sum_sq = warp_sum(sum_sq);
    max_abs = warp_max(max_abs);
    if (lane == 0) {
        scratch[warp] = sum_sq;
        scratch[WARPS + warp] = max_abs;
    }
    __syncthreads();
    float total = 0.f, bound = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        total += scratch[w];
        bound = fmaxf(bound, scratch[WARPS + w]);
    }
    const float inv_rms = norm ? 1.0f / sqrtf(total / (float)p.cols + p.eps) : 1.f;
    if (norm) bound *= inv_rms;
    const int e = split_exponent(bound);
    const float up = ldexpf(1.f, e), down = ldexpf(1.f, -e);
    // Columns col .. col + 3 (x4, norm weights w4), normalized in norm modes, times 2^e into v.
    auto put_normed4 = [&](float (&v)[V], int q, int col, float4 x4, float4 w4) {
        if (norm && col < p.cols) {
            x4 = make_float4(x4.x * inv_rms * w4.x, x4.y * inv_rms * w4.y,
                             x4.z * inv_rms * w4.z, x4.w * inv_rms * w4.w);
            if (write_normed) *reinterpret_cast<float4 *>(p.normed_out + col) = x4;
        }
        put_scaled4(v, 4 * q, x4, up);
    };
    if (in_regs) {
#pragma unroll
        for (int j = 0; j < kStageWords; ++j) {
            const int wi = tid + j * kThreads;
            if (wi >= n_words) break;
            float v[V];
#pragma unroll
            for (int q = 0; q < V / 4; ++q) {
                const int k = j * (V / 4) + q;
                put_normed4(v, q, stage_col(k), xs[k], ws[k]);
            }
            store_split_word(v, wi, x_pairs);
        }
    }
    for (int wi = in_regs ? n_words : tid; wi < n_words; wi += kThreads) {
        float v[V];
        if (vec) {
#pragma unroll
            for (int q = 0; q < V / 4; ++q) {
                const int col = wi * V + 4 * q;
                const float4 w4 = norm && col < p.cols ? *reinterpret_cast<const float4 *>(p.norm_weight + col)
                                                       : make_float4(0.f, 0.f, 0.f, 0.f);
                put_normed4(v, q, col, load4_or_zero(p.x, col, p.cols), w4);
            }
            store_split_word(v, wi, x_pairs);
            continue;
        }
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const int col = wi * V + k;
            float x = 0.f;
            if (col < p.cols) {
                x = p.x[col];
                if (norm) {
                    x = x * inv_rms * p.norm_weight[col];
                    if (write_normed) p.normed_out[col] = x;
                }
            }
            v[k] = x * up;
        }
        store_split_word(v, wi, x_pairs);
    }
    __syncthreads();

    // B: lane (g, t) supplies column g (hi: g < 4, lo: g >= 4).
    const uint32_t *b_first = b_lane_base(x_pairs, g, t) + warp * kBStep;  // this warp's first k-block

    int slot = 0;  // the ring slot of the next k-block to compute
    for (int task = blockIdx.x; task < p.n_tasks; task += gridDim.x) {
        float d[4] = {0.f, 0.f, 0.f, 0.f};  // the rows' hi and lo sums
        const uint32_t *b_kb = b_first;
        for (int i = 0; i < n_mine; ++i) {
            issue();                    // k-block S - 1 ahead, into the slot computed last
            cp_async_wait<S - 1>();     // this one has landed
            const uint4 *slot_w = ring_w + slot * 2 * kThreads + tid;
            mma_kblock(slot_w[0], slot_w[kThreads], b_kb, d);
            b_kb += WARPS * kBStep;
            slot = slot + 1 == S ? 0 : slot + 1;
        }
        float sum_g, sum_g8;
        finish_row_sums(d, sum_g, sum_g8);
        if (t == 0) {
            partial[warp][g] = sum_g;
            partial[warp][g + 8] = sum_g8;
        }
        __syncthreads();
        if (tid < kQuantTaskRows) {
            auto row_sum = [&](int r) {
                float s = 0.f;
#pragma unroll
                for (int w = 0; w < WARPS; ++w) s += partial[w][r];
                return s * down * p.scales[quant_task_row<MODE>(p, task, r)];
            };
            if (MODE == kGemvNormSwiglu || MODE == kQuantMoeGateUp) {
                const int j = MODE == kQuantMoeGateUp ? task / p.tasks_per_expert : 0;
                const int i = 8 * (task - j * p.tasks_per_expert) + tid;
                if (tid < 8 && i < p.out_rows) {
                    const float gate = row_sum(tid), up_ = row_sum(tid + 8);
                    p.y[(size_t)j * p.out_rows + i] = gate / (1.0f + expf(-gate)) * up_;
                }
            } else {
                const int out = kQuantTaskRows * task + tid;
                if (out < p.rows) {
                    const float s = row_sum(tid);
                    if (MODE == kGemvResidual) p.y[out] += s;
                    else p.y[out] = s;
                }
            }
        }
        __syncthreads();  // partial is reused by the next task
    }
    cp_async_wait<0>();  // only empty groups remain; nothing is left in flight at exit
}

// ---- MoE down for int8 experts -------------------------------------------------------
// x[r] += sum over j in selection order of w_j * (down_e[r] . act_j), e = selected[j]: the
// same tensor-core dot products, with B = the top_k act vectors side by side (each expert's
// columns padded to whole k-blocks, so a k-block never spans two experts) and the warps
// assigned to experts (warp w: experts w, w + 8, ...), so each expert's dot product of a row
// is one warp's sum; the per-expert sums are then weighted and added in selection order, as
// the bf16 kernel and the reference do.
struct QuantMoeDownParams {
    const uint8_t *weight;      // [E * H rows, row_bytes(I)]
    const float *scales;        // [E * H] row scales
    const float *act;           // [top_k, I]
    const int32_t *selected;    // [top_k]
    const float *sel_weights;   // [top_k]
    float *x;                   // [H], += the weighted sum
    int top_k, hidden, inter, n_chunks, n_kblocks;  // n_*: per expert row
    int64_t row_bytes;
};
constexpr int kMoeMaxTopK = 32;

__global__ void __launch_bounds__(kQuantWarps * kWarpSize) moe_down_int8_kernel(const QuantMoeDownParams p) {
    constexpr int kThreads = kQuantWarps * kWarpSize;
    constexpr int V = kCodesPerWord;
    extern __shared__ uint32_t x_pairs[];  // staged B: expert j at k-blocks j n_kblocks ..
    __shared__ float scratch[kQuantWarps];
    __shared__ float partial[kMoeMaxTopK][kQuantTaskRows];
    __shared__ int32_t expert_of[kMoeMaxTopK];
    __shared__ float weight_of[kMoeMaxTopK];

    const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
    const int g = lane >> 2, t = lane & 3;
    pdl_wait();  // selected, sel_weights and act come from earlier kernels
    pdl_launch_dependents();
    if (tid < p.top_k) {
        expert_of[tid] = p.selected[tid];
        weight_of[tid] = p.sel_weights[tid];
    }

    // ---- act -> 2^e -> hi/lo pairs; expert j's columns start at k-block j * n_kblocks
    const int n_act = p.top_k * p.inter;
    float bound = 0.f;
    for (int i = tid; i < n_act; i += kThreads) bound = fmaxf(bound, fabsf(p.act[i]));
    bound = warp_max(bound);
    if (lane == 0) scratch[warp] = bound;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kQuantWarps; ++w) bound = fmaxf(bound, scratch[w]);
    const int e = split_exponent(bound);
    const float up = ldexpf(1.f, e), down = ldexpf(1.f, -e);
    const int words_per_expert = p.n_kblocks * 16;
    const int n_words = p.top_k * words_per_expert;
    const bool vec = p.inter % 4 == 0 && is_aligned16(p.act);  // float4s, as the dense staging
    for (int wi = tid; wi < n_words; wi += kThreads) {
        const int j = wi / words_per_expert;
        const int col0 = (wi - j * words_per_expert) * V;
        const float *act_j = p.act + (size_t)j * p.inter;
        float v[V];
        if (vec) {
#pragma unroll
            for (int q = 0; q < V / 4; ++q) {
                const float4 a4 = load4_or_zero(act_j, col0 + 4 * q, p.inter);
                put_scaled4(v, 4 * q, a4, up);
            }
        } else {
#pragma unroll
            for (int k = 0; k < V; ++k) v[k] = col0 + k < p.inter ? act_j[col0 + k] * up : 0.f;
        }
        store_split_word(v, wi, x_pairs);
    }
    __syncthreads();

    const uint32_t *b_base = b_lane_base(x_pairs, g, t);
    const int n_tasks = ceil_div(p.hidden, kQuantTaskRows);
    for (int task = blockIdx.x; task < n_tasks; task += gridDim.x) {
        const int r_g = min(kQuantTaskRows * task + g, p.hidden - 1);
        const int r_g8 = min(kQuantTaskRows * task + g + 8, p.hidden - 1);
        for (int j = warp; j < p.top_k; j += kQuantWarps) {
            const size_t row_g = (size_t)expert_of[j] * p.hidden + r_g;
            const size_t row_g8 = (size_t)expert_of[j] * p.hidden + r_g8;
            float sum_g, sum_g8;
            mma_rows_dot<kQuantKBlocks>(reinterpret_cast<const uint4 *>(p.weight + row_g * p.row_bytes),
                                        reinterpret_cast<const uint4 *>(p.weight + row_g8 * p.row_bytes),
                                        p.n_kblocks, p.n_chunks, b_base, j * p.n_kblocks, t, sum_g, sum_g8);
            if (t == 0) {
                sum_g = sum_g * down * p.scales[row_g];
                sum_g8 = sum_g8 * down * p.scales[row_g8];
                partial[j][g] = sum_g;
                partial[j][g + 8] = sum_g8;
            }
        }
        __syncthreads();
        const int out = kQuantTaskRows * task + tid;
        if (tid < kQuantTaskRows && out < p.hidden) {
            // Explicit roundings, w_j * s_j then + y, in selection order (as the bf16 kernel).
            float y = 0.f;
            for (int j = 0; j < p.top_k; ++j) y = __fadd_rn(y, __fmul_rn(weight_of[j], partial[j][tid]));
            p.x[out] = __fadd_rn(p.x[out], y);
        }
        __syncthreads();  // partial is reused by the next task
    }
}

template <int WARPS, int S>
const void *int8_kernel_of(GemvMode mode) {
    switch (mode) {
        case kGemvPlain: return (const void *)gemv_int8_kernel<kGemvPlain, WARPS, S>;
        case kGemvNorm: return (const void *)gemv_int8_kernel<kGemvNorm, WARPS, S>;
        case kGemvResidual: return (const void *)gemv_int8_kernel<kGemvResidual, WARPS, S>;
        case kGemvNormSwiglu: return (const void *)gemv_int8_kernel<kGemvNormSwiglu, WARPS, S>;
    }
    return nullptr;
}

}  // namespace

// The int8 kernel for a mode, block size and ring depth (nullptr for other ones).
const void *int8_kernel_for(GemvMode mode, int warps, int stages) {
    if (warps == kQuantWarps && stages == kQuantStages) return int8_kernel_of<kQuantWarps, kQuantStages>(mode);
    if (warps == kQuantWideWarps && stages == kQuantWideStages)
        return int8_kernel_of<kQuantWideWarps, kQuantWideStages>(mode);
    return nullptr;
}

// Launch the int8 kernel of the plan (the one gemv_plan sized through int8_kernel_for).
cudaError_t launch_int8(GemvMode mode, const GemvPlan &plan, cudaStream_t stream, bool pdl,
                        const QuantGemvParams &p) {
    if (mode < kGemvPlain || mode > kGemvNormSwiglu) return cudaErrorInvalidValue;
    using Int8Kernel = void (*)(QuantGemvParams);
    const auto kernel = (Int8Kernel)int8_kernel_for(mode, plan.warps, plan.stages);
    if (kernel == nullptr) return cudaErrorInvalidConfiguration;
    return launch_kernel(kernel, dim3(plan.grid), dim3(plan.warps * kWarpSize), plan.smem_bytes,
                         stream, pdl, p);
}


cudaError_t launch_moe_gate_up_quant(int format, const void *weights, const void *scales,
                                     const float *x_normed, const int32_t *selected, int top_k,
                                     int hidden, int inter, float *act, cudaStream_t stream,
                                     bool pdl) {
    if ((format != OG_WEIGHTS_INT8 && format != OG_WEIGHTS_Q4) || weights == nullptr ||
        scales == nullptr || x_normed == nullptr || selected == nullptr || act == nullptr ||
        top_k < 1 || hidden < 1 || inter < 1 || (int64_t)top_k * ceil_div(inter, 8) > INT32_MAX)
        return cudaErrorInvalidValue;
    if (format == OG_WEIGHTS_Q4)
        return launch_moe_gate_up_q4(weights, scales, x_normed, selected, top_k, hidden, inter, act,
                                     stream, pdl);
    QuantGemvParams q = {};
    q.weight = static_cast<const uint8_t *>(weights);
    q.scales = static_cast<const float *>(scales);
    q.x = x_normed;
    q.y = act;
    q.rows = 2 * inter;  // per expert
    q.cols = hidden;
    set_int8_row_layout(q, hidden);
    q.tasks_per_expert = ceil_div(inter, 8);
    q.n_tasks = top_k * q.tasks_per_expert;
    q.out_rows = inter;
    q.selected = selected;
    int sm_count = 0;
    OG_CUDA_RETURN_IF(current_sm_count(&sm_count));
    // Two blocks per SM fit (registers); more would only queue, and the grid strides anyway.
    const int grid = q.n_tasks < 2 * sm_count ? q.n_tasks : 2 * sm_count;
    const size_t smem = gemv_input_smem_bytes(hidden, OG_WEIGHTS_INT8);
    const auto kernel = gemv_int8_kernel<kQuantMoeGateUp, kQuantWarps, kQuantStages>;
    // The staged input and the load ring pass the 48 KB default: opt in once per device (the
    // attribute is per device), not with a driver call on every launch.
    static std::atomic<int> opted_in_device{-1};
    int device = 0;
    OG_CUDA_RETURN_IF(cudaGetDevice(&device));
    if (opted_in_device.load() != device) {
        OG_CUDA_RETURN_IF(allow_dynamic_smem((const void *)kernel, smem));
        opted_in_device.store(device);
    }
    return launch_kernel(kernel, dim3(grid), dim3(kQuantWarps * kWarpSize), smem, stream, pdl, q);
}

cudaError_t launch_moe_down_quant(int format, const void *weights, const void *scales,
                                  const float *act, const int32_t *selected,
                                  const float *sel_weights, int top_k, int hidden, int inter,
                                  float *x, cudaStream_t stream, bool pdl) {
    if ((format != OG_WEIGHTS_INT8 && format != OG_WEIGHTS_Q4) || weights == nullptr ||
        scales == nullptr || act == nullptr || selected == nullptr || sel_weights == nullptr ||
        x == nullptr || top_k < 1 || top_k > kMoeMaxTopK || hidden < 1 || inter < 1)
        return cudaErrorInvalidValue;
    if (format == OG_WEIGHTS_Q4)
        return launch_moe_down_q4(weights, scales, act, selected, sel_weights, top_k, hidden, inter, x,
                                  stream, pdl);
    QuantMoeDownParams q = {};
    q.weight = static_cast<const uint8_t *>(weights);
    q.scales = static_cast<const float *>(scales);
    q.act = act;
    q.selected = selected;
    q.sel_weights = sel_weights;
    q.x = x;
    q.top_k = top_k;
    q.hidden = hidden;
    q.inter = inter;
    set_int8_row_layout(q, inter);
    int sm_count = 0;
    OG_CUDA_RETURN_IF(current_sm_count(&sm_count));
    const int tasks = ceil_div(hidden, kQuantTaskRows);
    const int grid = tasks < 2 * sm_count ? tasks : 2 * sm_count;
    // hi + lo fp16 per column of every expert's k-block-padded row
    const size_t smem = (size_t)top_k * q.n_kblocks * 4 * weight_values_per_chunk(OG_WEIGHTS_INT8) * 4;
    if (smem > 32 * 1024) OG_CUDA_RETURN_IF(allow_dynamic_smem((const void *)moe_down_int8_kernel, smem));
    return launch_kernel(moe_down_int8_kernel, dim3(grid), dim3(kQuantWarps * kWarpSize), smem, stream, pdl, q);
}

}  // namespace og
