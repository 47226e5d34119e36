// attention_probe.cu — how fast can one decode step's attention read a long int8 KV cache on one
// GPU, and what holds a kernel below that: the way its rows reach the multiprocessor (each warp
// loading its next tile into registers, with an L2 prefetch some tiles ahead; or the block's
// pages copied into a ring of shared-memory stages by the bulk-copy engine), or the fold (scores,
// online softmax, weighted V, on the CUDA cores or the tensor cores) for a group of 2, 4 or 8
// query heads a KV head?
// Standalone experiment, not part of the library.
//
//   build: nvcc -arch=sm_90 -O3 -std=c++17 -o /tmp/attention_probe scripts/attention_probe.cu
//   run:   /tmp/attention_probe                               (every shape, contexts 4096, 32768)
//          /tmp/attention_probe --shape qwen3-0.6b --context 32768 --iters 20 --json /tmp/a.json
//
// Shapes (head dim 128, int8 K/V with one fp32 scale a row, as the library's int8 cache):
//   qwen3-0.6b      16 query heads,  8 KV heads (group 2), 28 layers
//   qwen3-8b        32 query heads,  8 KV heads (group 4), 36 layers
//   qwen3-30b-a3b   32 query heads,  4 KV heads (group 8), 48 layers
// The cache is paged as the library's: pages of 64 rows; layer l's pool holds, per block, the K
// page [n_kv][64][128] int8, the V page, and the scale pages [n_kv][64] fp32; row t of a sequence
// lies in block table[t / 64], and the table is a fixed random permutation of the pool's blocks.
// Codes uniform in -127..127, scales uniform in (0.005, 0.02], q uniform in +-1 (per layer and
// head) times log2(e) / sqrt(128), so that the softmax is base 2.
// What a step reads: C rows of every layer (context C, the new row not modelled), K, V and their
// scales; the token's time is that of a graph of one kernel a layer, `layers` kernels in a row.
//
// Work split, every variant: grid (n_kv * head_groups, B), 256 threads; a head group is the HG
// query heads of a KV head that one block folds, as many as a lane's registers hold o[HG][dims]
// for (below); a KV head with more query heads has its rows read once per head group, as the
// library does on the CUDA cores. B = blocks a head group, one wave (SM count x the blocks an SM
// the variant is built for, over n_kv * head_groups). Block b takes the contiguous rows [b R,
// (b + 1) R), R = ceil(C / B) rounded up to 128, in steps of 128 rows (two pages): warp w folds
// rows 16 w .. 16 w + 15 of a step. LPR lanes share a row: with 8 (the library's int8 layout) a
// lane holds 16 bytes (dims) of 4 of the warp's rows and HG <= 4; with 16 (suffix -l16), 8 bytes
// of 8 rows and HG <= 8, so the 30B-A3B shape reads each row once. Each block writes its
// (m, l, o) per head; the last block of a head group (a counter) combines them in block order.
//
// Variants:
//   regs-dD     the library's data path: a warp's tiles in registers, the next tile's loads in
//               flight while it folds the current one, and an L2 prefetch (prefetch.global.L2,
//               one 128-byte line a lane) of the tile D steps ahead (the library: D = 2). The
//               block-table entry of that tile is read one step before its prefetch. LPR 8.
//   bulk-sS     the block's steps through S shared-memory stages (33 KB each: two pages of K and
//               of V and their scales): thread 0 waits for the whole block to leave a stage
//               (__syncthreads), then refills it with eight cp.async.bulk copies completing on the
//               stage's mbarrier; every warp waits on that mbarrier, then reads its rows from
//               shared memory. S steps of the block (S x 33 KB) are in flight.
//   mma-sS      the bulk data path with the fold on the tensor cores (mma.sync m16n8k16, fp16
//               operands split into hi + lo halves where they are not exact, fp32 accumulators;
//               see attn_mma_kernel): every query head of a KV head in one block, each row read
//               once, for any group up to 8.
//   ...-x2      the grid sized for two blocks an SM (registers capped at 128 a thread).
//   ...-stream  the same data path without the fold, one head group a KV head: each lane xors
//               the words it receives (and the scales' bits) into one register, written out at
//               the end. It bounds what the data path alone can reach.
//
// Fold (every regs and bulk -fold variant, the same code): scores with fp32 fma over a lane's dims, a
// butterfly over a row's lanes, times the row's k scale (q is pre-scaled by log2(e) / sqrt(128),
// so the softmax is exp2); per tile of 16 rows a warp's running max, rescaled when it grows; p =
// exp2(score - m); o[j][d] += (p v_scale) v[d]; the decode of 4 codes: a byte permute into the
// mantissa of 2^23 and one subtraction each (exact). Warps combine through shared memory.
//
// What it prints: per shape and context, the D2D copy bandwidth (1 GiB cudaMemcpyAsync, bytes
// read + written) and per variant: its head groups and B, µs a token (all layers), µs a layer, the
// cache's read rate (bytes a step needs / time) and that rate over the copy bandwidth. Checks:
// every fold variant against a CPU reference (fp64, layers 0 and L-1, every head) within a
// relative L2 error of 1e-4, and every stream variant against the first (the same xor a KV head
// and layer); PASS / FAIL, exit code 1 on any failure. A variant whose blocks do not fit an SM is
// said so and skipped.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "probe_common.cuh"

using probe::capture_graph;
using probe::copy_bandwidth;
using probe::elapsed_ms;

namespace {

constexpr int kWarpSize = 32;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kHd = 128;                       // head dim (bytes a row)
constexpr int kPage = 64;                      // rows a page
constexpr int kStepRows = 128;                 // rows a block step: 8 warps x 16
constexpr int kTileRows = 16;                  // rows a warp a step
constexpr int kMaxStages = 6;
// One stage: K [128][128], V [128][128] int8, K scales [128], V scales [128] fp32.
constexpr int kStageK = 0, kStageV = kStepRows * kHd, kStageKs = 2 * kStepRows * kHd,
              kStageVs = kStageKs + 4 * kStepRows, kStageBytes = kStageVs + 4 * kStepRows;
constexpr float kLog2e = 1.4426950408889634f;

struct Shape {
    const char *name;
    int n_heads, n_kv, layers;
};
const Shape kShapes[] = {{"qwen3-0.6b", 16, 8, 28}, {"qwen3-8b", 32, 8, 36}, {"qwen3-30b-a3b", 32, 4, 48}};

// Layer l's cache and step (device pointers).
struct Layer {
    const int8_t *k, *v;           // [n_blocks][n_kv][kPage][kHd]
    const float *ks, *vs;          // [n_blocks][n_kv][kPage]
    const float *q;                // [n_heads][kHd], pre-scaled by log2(e) / sqrt(kHd)
};
struct Args {
    Layer layer;
    const int32_t *table;          // [pages]: C rows rounded up to whole steps of 128
    int n_kv, n_heads, head_groups, ctx, rows_per_block, n_blocks_grid;
    float *part_o;                 // [n_heads][B][kHd]
    float *part_ml;                // [n_heads][B][2]
    float *out;                    // [n_heads][kHd]
    unsigned *counters;            // [n_kv * head_groups], zero between launches (the last block resets)
    unsigned *sink;                // stream variants: [grid] xor of what a block read
    int prefetch;                  // regs: tiles ahead of the folded one (0: none)
    int stages;                    // bulk: stages in flight
    float q_mul, q_inv;            // mma: q scaled by a power of two into fp16's range, and back
    float w_mul, w_inv;            // mma: the weights p v_scale likewise
};

// ---- small device helpers -------------------------------------------------------------------
__device__ __forceinline__ uint4 load_row_chunk(const void *p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
__device__ __forceinline__ void prefetch_l2(const void *p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
__device__ __forceinline__ unsigned smem_addr(const void *p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t *bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint64_t *bar, unsigned parity) {
    unsigned ok;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
    return ok != 0;
}
// Wait for a stage; a wait that never ends (a copy that never lands: 2^26 polls, each of which
// may suspend the thread for a while, some seconds at least) ends the kernel with a trap, so a
// bug reads as a CUDA error in the output instead of a probe that hangs until its time limit.
__device__ __forceinline__ void mbar_wait(uint64_t *bar, unsigned parity) {
    for (unsigned polls = 0; !mbar_try_wait(bar, parity);)
        if (++polls == (1u << 26)) __trap();
}
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, unsigned bytes, uint64_t *bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
}

// Code i (0..3) of a word of int8 codes, exactly, as fp32: the byte (biased by 128) goes into
// the low mantissa of 2^23, then 2^23 + 128 is taken off.
__device__ __forceinline__ float code(uint32_t biased, int i) {
    return __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7540u + i)) - 8388736.f;
}

// ---- a tile and the fold ---------------------------------------------------------------------
// LPR lanes share a row: lane l holds DPL = 128 / LPR dims (bytes) of rows 4 s + l / LPR ... of a
// warp's 16 rows of a step, slot s = 0 .. SLOTS - 1 (LPR 8: 4 slots of 16 bytes; LPR 16: 8 slots
// of 8 bytes). A lane's o holds HG x DPL floats: 64 at most (HG <= 64 / DPL).
template <int LPR>
struct Lanes {
    static constexpr int DPL = kHd / LPR;              // dims (bytes) a lane a row
    static constexpr int WORDS = DPL / 4;              // 32-bit words of codes a lane a row
    static constexpr int GROUPS = kWarpSize / LPR;     // rows one load instruction covers
    static constexpr int SLOTS = kTileRows / GROUPS;   // rows a lane a tile
    static constexpr int MAX_HG = 64 / DPL;
};
template <int LPR>
struct Tile {
    using L = Lanes<LPR>;
    uint32_t k[L::SLOTS][L::WORDS], v[L::SLOTS][L::WORDS];
    float ks[L::SLOTS], vs[L::SLOTS];
    bool valid[L::SLOTS];   // the row is before the block's end
};

// A warp's running softmax for HG heads: m is warp-uniform; l and o sum this lane's rows (its row
// group's), summed over the row groups at the end.
template <int HG, int LPR>
struct State {
    float m[HG], l[HG], o[HG][Lanes<LPR>::DPL];
};
template <int HG, int LPR>
__device__ __forceinline__ void state_init(State<HG, LPR> &st) {
#pragma unroll
    for (int j = 0; j < HG; ++j) {
        st.m[j] = -INFINITY;
        st.l[j] = 0.f;
#pragma unroll
        for (int e = 0; e < Lanes<LPR>::DPL; ++e) st.o[j][e] = 0.f;
    }
}

// Fold one tile for HG heads whose q (pre-scaled) is q_s [HG][kHd] in shared memory.
template <int HG, int LPR>
__device__ __forceinline__ void fold_tile(const Tile<LPR> &t, const float *q_s, int lane_in_row,
                                          State<HG, LPR> &st) {
    using L = Lanes<LPR>;
    constexpr int S = L::SLOTS;
    const int d0 = lane_in_row * L::DPL;
    float sc[S][HG];
#pragma unroll
    for (int s = 0; s < S; ++s)
#pragma unroll
        for (int j = 0; j < HG; ++j) sc[s][j] = 0.f;
#pragma unroll
    for (int w = 0; w < L::WORDS; ++w) {
        float4 qv[HG];
#pragma unroll
        for (int j = 0; j < HG; ++j) qv[j] = *reinterpret_cast<const float4 *>(q_s + j * kHd + d0 + 4 * w);
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const uint32_t word = t.k[s][w] ^ 0x80808080u;
            const float c0 = code(word, 0), c1 = code(word, 1), c2 = code(word, 2), c3 = code(word, 3);
#pragma unroll
            for (int j = 0; j < HG; ++j) {
                float a = sc[s][j];
                a = fmaf(qv[j].x, c0, a);
                a = fmaf(qv[j].y, c1, a);
                a = fmaf(qv[j].z, c2, a);
                a = fmaf(qv[j].w, c3, a);
                sc[s][j] = a;
            }
        }
    }
#pragma unroll
    for (int off = LPR / 2; off > 0; off >>= 1)
#pragma unroll
        for (int s = 0; s < S; ++s)
#pragma unroll
            for (int j = 0; j < HG; ++j) sc[s][j] += __shfl_xor_sync(0xffffffffu, sc[s][j], off);
#pragma unroll
    for (int s = 0; s < S; ++s)
#pragma unroll
        for (int j = 0; j < HG; ++j) sc[s][j] = t.valid[s] ? sc[s][j] * t.ks[s] : -INFINITY;

    float wgt[S][HG];
#pragma unroll
    for (int j = 0; j < HG; ++j) {
        float tmax = sc[0][j];
#pragma unroll
        for (int s = 1; s < S; ++s) tmax = fmaxf(tmax, sc[s][j]);
#pragma unroll
        for (int off = LPR; off < kWarpSize; off <<= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
        const float m_new = fmaxf(st.m[j], tmax);
        if (m_new > st.m[j]) {  // warp-uniform; never taken while every row so far is masked
            const float f = exp2f(st.m[j] - m_new);
            st.l[j] *= f;
#pragma unroll
            for (int e = 0; e < L::DPL; ++e) st.o[j][e] *= f;
            st.m[j] = m_new;
        }
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const float p = t.valid[s] ? exp2f(sc[s][j] - st.m[j]) : 0.f;
            st.l[j] += p;
            wgt[s][j] = p * t.vs[s];
        }
    }
#pragma unroll
    for (int s = 0; s < S; ++s) {
#pragma unroll
        for (int w = 0; w < L::WORDS; ++w) {
            const uint32_t word = t.v[s][w] ^ 0x80808080u;
            const float c0 = code(word, 0), c1 = code(word, 1), c2 = code(word, 2), c3 = code(word, 3);
#pragma unroll
            for (int j = 0; j < HG; ++j) {
                st.o[j][4 * w + 0] = fmaf(wgt[s][j], c0, st.o[j][4 * w + 0]);
                st.o[j][4 * w + 1] = fmaf(wgt[s][j], c1, st.o[j][4 * w + 1]);
                st.o[j][4 * w + 2] = fmaf(wgt[s][j], c2, st.o[j][4 * w + 2]);
                st.o[j][4 * w + 3] = fmaf(wgt[s][j], c3, st.o[j][4 * w + 3]);
            }
        }
    }
}

// The stream variants' stand-in for the fold: every word and scale of the rows before the
// block's end, xored (so every data path gives the same xor a head group). Every lane of a row
// holds its scales, so only the row's first lane xors them (an even count would cancel).
template <int LPR>
__device__ __forceinline__ void consume_tile(const Tile<LPR> &t, int lane_in_row, unsigned &acc) {
    using L = Lanes<LPR>;
#pragma unroll
    for (int s = 0; s < L::SLOTS; ++s) {
        if (!t.valid[s]) continue;
#pragma unroll
        for (int w = 0; w < L::WORDS; ++w) acc ^= t.k[s][w] ^ t.v[s][w];
        if (lane_in_row == 0) acc ^= __float_as_uint(t.ks[s]) ^ __float_as_uint(t.vs[s]);
    }
}
template <int HG, int LPR, bool FOLD>
__device__ __forceinline__ void use_tile(const Tile<LPR> &t, const float *q_s, int lane_in_row, State<HG, LPR> &st,
                                         unsigned &acc) {
    if constexpr (FOLD) fold_tile<HG, LPR>(t, q_s, lane_in_row, st);
    else consume_tile<LPR>(t, lane_in_row, acc);
}

// ---- the block's end: warps -> block partial -> the last block's combine ----------------------
// Shared memory: o_s [warps][HG][kHd], m_s, l_s [warps][HG]: each warp's unnormalised o, its max
// and its sum, written by the fold's own warp_state_out.
template <int HG>
__device__ void block_combine(const Args &a, const float *o_s, const float *m_s, const float *l_s, int kv, int grp,
                              int b, int n_active) {
    __syncthreads();
    const int B = a.n_blocks_grid;
    const int head0 = kv * (a.n_heads / a.n_kv) + grp * HG;
    for (int i = threadIdx.x; i < HG * kHd; i += kThreads) {
        const int j = i / kHd, d = i % kHd;
        float m = -INFINITY;
        for (int w = 0; w < kWarps; ++w) m = fmaxf(m, m_s[w * HG + j]);
        float l = 0.f, o = 0.f;
        for (int w = 0; w < kWarps; ++w) {
            const float f = m_s[w * HG + j] == -INFINITY ? 0.f : exp2f(m_s[w * HG + j] - m);
            l += f * l_s[w * HG + j];
            o += f * o_s[(w * HG + j) * kHd + d];
        }
        const size_t slot = (size_t)(head0 + j) * B + b;
        a.part_o[slot * kHd + d] = o;
        if (d == 0) {
            a.part_ml[slot * 2] = m;
            a.part_ml[slot * 2 + 1] = l;
        }
    }
    __shared__ unsigned last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned *c = a.counters + kv * a.head_groups + grp;
        last = atomicAdd(c, 1u) == (unsigned)n_active - 1;
        if (last) *c = 0u;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = threadIdx.x; i < HG * kHd; i += kThreads) {
        const int j = i / kHd, d = i % kHd;
        const size_t base = (size_t)(head0 + j) * B;
        float m = -INFINITY;
        for (int bb = 0; bb < n_active; ++bb) m = fmaxf(m, __ldcg(a.part_ml + (base + bb) * 2));
        float l = 0.f, o = 0.f;
        for (int bb = 0; bb < n_active; ++bb) {
            const float mb = __ldcg(a.part_ml + (base + bb) * 2);
            const float f = mb == -INFINITY ? 0.f : exp2f(mb - m);
            l += f * __ldcg(a.part_ml + (base + bb) * 2 + 1);
            o += f * __ldcg(a.part_o + (base + bb) * kHd + d);
        }
        a.out[(size_t)(head0 + j) * kHd + d] = o / l;
    }
}

// The CUDA-core fold's warp state into o_s, m_s, l_s: l and o summed over the row groups.
template <int HG, int LPR>
__device__ void warp_state_out(State<HG, LPR> &st, float *o_s, float *m_s, float *l_s) {
    using L = Lanes<LPR>;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const int lane_in_row = lane % LPR;
#pragma unroll
    for (int j = 0; j < HG; ++j) {
#pragma unroll
        for (int off = LPR; off < kWarpSize; off <<= 1) {
            st.l[j] += __shfl_xor_sync(0xffffffffu, st.l[j], off);
#pragma unroll
            for (int e = 0; e < L::DPL; ++e) st.o[j][e] += __shfl_xor_sync(0xffffffffu, st.o[j][e], off);
        }
        if (lane < LPR) {
#pragma unroll
            for (int e = 0; e < L::DPL; ++e) o_s[(warp * HG + j) * kHd + lane_in_row * L::DPL + e] = st.o[j][e];
        }
        if (lane == 0) {
            m_s[warp * HG + j] = st.m[j];
            l_s[warp * HG + j] = st.l[j];
        }
    }
}

// The end of a kernel: the fold's partials and combine, or the stream variants' xor.
template <int HG, int LPR, bool FOLD>
__device__ __forceinline__ void end_block(const Args &a, State<HG, LPR> &st, unsigned acc, float *o_s, float *m_s,
                                          float *l_s, int kv, int grp, int b, int n_active) {
    if constexpr (FOLD) {
        warp_state_out<HG, LPR>(st, o_s, m_s, l_s);
        block_combine<HG>(a, o_s, m_s, l_s, kv, grp, b, n_active);
    } else {
        acc = __reduce_xor_sync(0xffffffffu, acc);
        if (threadIdx.x % kWarpSize == 0) atomicXor(a.sink + blockIdx.x * gridDim.y + blockIdx.y, acc);
    }
}

// Where a block's work lies, and its shared memory after `skip` bytes (the stages): o_s, m_s,
// l_s first (the tensor cores' fold, which reads q once into registers, puts them at offset 0,
// over stages it no longer needs), then q_s.
struct BlockWork {
    int kv, grp, b, start, end, n_active, head0;
    float *q_s, *o_s, *m_s, *l_s;
};
template <int HG>
__device__ __forceinline__ BlockWork block_work(const Args &a, unsigned char *smem, size_t skip) {
    BlockWork w;
    w.kv = blockIdx.x / a.head_groups;
    w.grp = blockIdx.x % a.head_groups;
    w.b = blockIdx.y;
    w.start = w.b * a.rows_per_block;
    w.end = min(a.ctx, w.start + a.rows_per_block);
    w.n_active = (a.ctx + a.rows_per_block - 1) / a.rows_per_block;
    w.head0 = w.kv * (a.n_heads / a.n_kv) + w.grp * HG;
    w.o_s = reinterpret_cast<float *>(smem + skip);
    w.m_s = w.o_s + kWarps * HG * kHd;
    w.l_s = w.m_s + kWarps * HG;
    w.q_s = w.l_s + kWarps * HG;
    return w;
}

// ---- data path 1: tiles in registers, L2 prefetch D tiles ahead (LPR 8) ----------------------
// Tile i of a warp: rows start + 128 i + 16 w .. + 15, all in one page.
struct TileAt {
    int row0;   // -1: none
    int block;  // pool block of its page
};
__device__ __forceinline__ TileAt tile_at(const Args &a, const BlockWork &w, int i, int warp) {
    TileAt t;
    t.row0 = w.start + i * kStepRows + warp * kTileRows;
    if (t.row0 >= w.end) {
        t.row0 = -1;
        t.block = 0;
    } else {
        t.block = __ldg(a.table + t.row0 / kPage);
    }
    return t;
}
__device__ __forceinline__ void load_tile_regs(const Args &a, const TileAt &at, int end, int kv, int lane,
                                               Tile<8> &t) {
    const int row_group = lane / 8, lane_in_row = lane % 8;
#pragma unroll
    for (int s = 0; s < Lanes<8>::SLOTS; ++s) {
        t.valid[s] = at.row0 >= 0 && at.row0 + 4 * s + row_group < end;
        uint4 kw = make_uint4(0u, 0u, 0u, 0u), vw = kw;
        t.ks[s] = t.vs[s] = 0.f;
        if (at.row0 >= 0) {
            const size_t row = ((size_t)at.block * a.n_kv + kv) * kPage + at.row0 % kPage + 4 * s + row_group;
            kw = load_row_chunk(a.layer.k + row * kHd + lane_in_row * 16);
            vw = load_row_chunk(a.layer.v + row * kHd + lane_in_row * 16);
            t.ks[s] = __ldg(a.layer.ks + row);
            t.vs[s] = __ldg(a.layer.vs + row);
        }
        t.k[s][0] = kw.x, t.k[s][1] = kw.y, t.k[s][2] = kw.z, t.k[s][3] = kw.w;
        t.v[s][0] = vw.x, t.v[s][1] = vw.y, t.v[s][2] = vw.z, t.v[s][3] = vw.w;
    }
}
// One 128-byte line a lane: lanes 0-15 the tile's K (16 rows x 128 bytes, contiguous in its
// page), lanes 16-31 its V.
__device__ __forceinline__ void prefetch_tile(const Args &a, const TileAt &t, int kv, int lane) {
    if (t.row0 < 0) return;
    const size_t row = ((size_t)t.block * a.n_kv + kv) * kPage + t.row0 % kPage + lane % 16;
    prefetch_l2((lane < 16 ? a.layer.k : a.layer.v) + row * kHd);
}

template <int HG, bool FOLD>
__global__ void __launch_bounds__(kThreads, 1) attn_regs_kernel(Args a) {
    extern __shared__ __align__(128) unsigned char smem[];
    const BlockWork w = block_work<HG>(a, smem, 0);
    if (w.start >= a.ctx) return;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    for (int i = threadIdx.x; i < HG * kHd; i += kThreads) w.q_s[i] = a.layer.q[(size_t)w.head0 * kHd + i];
    __syncthreads();

    State<HG, 8> st;
    state_init(st);
    unsigned acc = 0u;
    Tile<8> cur;
    load_tile_regs(a, tile_at(a, w, 0, warp), w.end, w.kv, lane, cur);
    TileAt nxt = tile_at(a, w, 1, warp);
    // The prefetch pipeline: tiles 1 .. D - 1 now; at step i, tile i + D (located at step i - 1).
    TileAt far = tile_at(a, w, a.prefetch, warp);
    for (int i = 1; i < a.prefetch; ++i) prefetch_tile(a, tile_at(a, w, i, warp), w.kv, lane);
    for (int i = 0; w.start + i * kStepRows + warp * kTileRows < w.end; ++i) {
        Tile<8> next;
        load_tile_regs(a, nxt, w.end, w.kv, lane, next);
        if (a.prefetch > 0) {
            prefetch_tile(a, far, w.kv, lane);
            far = tile_at(a, w, i + 1 + a.prefetch, warp);
        }
        nxt = tile_at(a, w, i + 2, warp);
        use_tile<HG, 8, FOLD>(cur, w.q_s, lane % 8, st, acc);
        cur = next;
    }
    end_block<HG, 8, FOLD>(a, st, acc, w.o_s, w.m_s, w.l_s, w.kv, w.grp, w.b, w.n_active);
}

// ---- data path 2: the block's steps through S shared-memory stages, filled by bulk copies -----
// Step t of the block: rows start + 128 t .. + 127 (two pages; start is a multiple of 128).
__device__ __forceinline__ void issue_step(const Args &a, unsigned char *stage, uint64_t *bar, const BlockWork &w,
                                           int t) {
    const int row0 = w.start + t * kStepRows;
    if (row0 >= w.end) return;
    mbar_expect_tx(bar, kStageBytes);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        // A page past the context is still copied (the table holds every page of the capacity):
        // its rows are masked in the fold.
        const size_t blk = (size_t)__ldg(a.table + row0 / kPage + h);
        const size_t row = (blk * a.n_kv + w.kv) * kPage;
        bulk_copy(stage + kStageK + h * kPage * kHd, a.layer.k + row * kHd, kPage * kHd, bar);
        bulk_copy(stage + kStageV + h * kPage * kHd, a.layer.v + row * kHd, kPage * kHd, bar);
        bulk_copy(stage + kStageKs + h * kPage * 4, a.layer.ks + row, kPage * 4, bar);
        bulk_copy(stage + kStageVs + h * kPage * 4, a.layer.vs + row, kPage * 4, bar);
    }
}
// A warp's tile of a landed stage: its 16 rows, DPL bytes of each a lane.
template <int LPR>
__device__ __forceinline__ void read_stage(const unsigned char *stage, int row0, int end, int warp, int lane,
                                           Tile<LPR> &t) {
    using L = Lanes<LPR>;
    const int row_group = lane / LPR, lane_in_row = lane % LPR;
#pragma unroll
    for (int s = 0; s < L::SLOTS; ++s) {
        const int r = warp * kTileRows + L::GROUPS * s + row_group;  // row within the step
        const unsigned char *kp = stage + kStageK + r * kHd + lane_in_row * L::DPL;
        const unsigned char *vp = stage + kStageV + r * kHd + lane_in_row * L::DPL;
        if constexpr (L::WORDS == 4) {
            const uint4 kw = *reinterpret_cast<const uint4 *>(kp), vw = *reinterpret_cast<const uint4 *>(vp);
            t.k[s][0] = kw.x, t.k[s][1] = kw.y, t.k[s][2] = kw.z, t.k[s][3] = kw.w;
            t.v[s][0] = vw.x, t.v[s][1] = vw.y, t.v[s][2] = vw.z, t.v[s][3] = vw.w;
        } else {
            const uint2 kw = *reinterpret_cast<const uint2 *>(kp), vw = *reinterpret_cast<const uint2 *>(vp);
            t.k[s][0] = kw.x, t.k[s][1] = kw.y;
            t.v[s][0] = vw.x, t.v[s][1] = vw.y;
        }
        t.ks[s] = reinterpret_cast<const float *>(stage + kStageKs)[r];
        t.vs[s] = reinterpret_cast<const float *>(stage + kStageVs)[r];
        t.valid[s] = row0 + r < end;
    }
}

// The bulk pipeline of a block: thread 0 fills the first S stages (the block's first S steps),
// then for each step every thread waits on its stage's mbarrier, `fold(stage, step_row0)` runs,
// the block meets at a barrier and thread 0 refills the stage with step t + S. `full` holds the
// stages' mbarriers; callers put q etc. in shared memory before and end the block after.
template <class Fold>
__device__ __forceinline__ void bulk_pipeline(const Args &a, const BlockWork &w, unsigned char *stages,
                                              uint64_t *full, Fold fold) {
    const int n_steps = (w.end - w.start + kStepRows - 1) / kStepRows;
    for (int t = 0; t < n_steps; ++t) {
        const int slot = t % a.stages;
        mbar_wait(&full[slot], (unsigned)(t / a.stages) & 1u);
        fold(stages + (size_t)slot * kStageBytes, w.start + t * kStepRows);
        __syncthreads();  // every warp is done with this stage
        if (threadIdx.x == 0) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            issue_step(a, stages + (size_t)slot * kStageBytes, &full[slot], w, t + a.stages);
        }
    }
}
__device__ __forceinline__ void bulk_start(const Args &a, const BlockWork &w, unsigned char *stages, uint64_t *full) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < a.stages; ++s) mbar_init(&full[s], 1);
        // The barriers' initialisation is visible to the copy engine before its first copy.
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        for (int t = 0; t < a.stages; ++t) issue_step(a, stages + (size_t)t * kStageBytes, &full[t], w, t);
    }
}

template <int HG, int LPR, bool FOLD, int PER_SM>
__global__ void __launch_bounds__(kThreads, PER_SM) attn_bulk_kernel(Args a) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t full[kMaxStages];
    const BlockWork w = block_work<HG>(a, smem, (size_t)a.stages * kStageBytes);
    if (w.start >= a.ctx) return;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    bulk_start(a, w, smem, full);
    for (int i = threadIdx.x; i < HG * kHd; i += kThreads) w.q_s[i] = a.layer.q[(size_t)w.head0 * kHd + i];
    __syncthreads();

    State<HG, LPR> st;
    state_init(st);
    unsigned acc = 0u;
    bulk_pipeline(a, w, smem, full, [&](const unsigned char *stage, int row0) {
        Tile<LPR> tile;
        read_stage<LPR>(stage, row0, w.end, warp, lane, tile);
        use_tile<HG, LPR, FOLD>(tile, w.q_s, lane % LPR, st, acc);
    });
    end_block<HG, LPR, FOLD>(a, st, acc, w.o_s, w.m_s, w.l_s, w.kv, w.grp, w.b, w.n_active);
}

// ---- the fold on the tensor cores (bulk data path; every query head of a KV head in a block) --
// mma.sync m16n8k16, fp16 operands, fp32 accumulators; lane = 4 g + t (g = lane / 4, t = lane % 4).
//   Scores S [16 x 8] = Q [16 x 128] . K^T, 8 k-steps of 16 dims, per n-tile of 8 rows: A's row g
//   is head g's q (scaled by 2^s: q_mul) rounded to fp16 (hi), row g + 8 the remainder (lo), zero
//   for g >= G; B is the tile's K codes, exact in fp16. The dims a k-step's 16 indices stand for
//   are permuted (A and B alike, so the dot product is unchanged): index 2t + e -> dim 32 t + 4 kk
//   + e and 2t + 8 + e -> 32 t + 4 kk + 2 + e, so a lane's K bytes of a row are one contiguous
//   32-byte run. Accumulator c: (head g hi, rows 2t, 2t + 1 of the n-tile) and (head g lo, same
//   rows): score = (hi + lo) / q_mul, times the row's k scale.
//   Weighted V: O [16 x 8 dims] += P [16 x 16 rows] . V, for 16 n-tiles of 8 dims: P's row g is
//   head g's weight p v_scale (scaled by 2^t: w_mul) in fp16 hi, row g + 8 its lo; its columns
//   are the tile's 16 rows in the scores' accumulator order, so the scores' fragments become P's
//   A fragments in place. V's codes are first widened to fp16 in the warp's own shared buffer
//   (rows padded to 272 bytes: ldmatrix's 8 row addresses fall in 8 bank groups) and read with
//   ldmatrix.trans. o = (hi + lo) / w_mul.
constexpr int kVhLd = kHd + 8;                             // halves a widened V row
constexpr int kVhBytes = kWarps * kTileRows * kVhLd * 2;   // every warp's buffer
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ uint32_t pack_half2(float lo_elem, float hi_elem) {
    const __half2 h = __floats2half2_rn(lo_elem, hi_elem);
    return *reinterpret_cast<const uint32_t *>(&h);
}
// Codes i and j of a word of int8 codes (biased by 128) as an exact fp16 pair: 1024 + byte, then
// 1152 off.
__device__ __forceinline__ uint32_t code_pair(uint32_t biased, uint32_t selector) {
    const uint32_t h = __byte_perm(biased, 0x64646464u, selector);
    const __half2 r = __hsub2(*reinterpret_cast<const __half2 *>(&h), __half2half2(__ushort_as_half(0x6480)));
    return *reinterpret_cast<const uint32_t *>(&r);
}
// A float split into fp16 hi and its fp16 remainder lo.
__device__ __forceinline__ void split_half(float v, float &hi, float &lo) {
    hi = __half2float(__float2half_rn(v));
    lo = v - hi;
}

template <int G, int PER_SM>
__global__ void __launch_bounds__(kThreads, PER_SM) attn_mma_kernel(Args a) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t full[kMaxStages];
    // After the pipeline the stages are free: o_s, m_s, l_s take their place (q_s is not used).
    const BlockWork w = block_work<G>(a, smem, 0);
    if (w.start >= a.ctx) return;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const int g = lane / 4, t = lane % 4;
    __half *vh = reinterpret_cast<__half *>(smem + (size_t)a.stages * kStageBytes) + warp * kTileRows * kVhLd;
    bulk_start(a, w, smem, full);

    // Q's A fragments, one per k-step: (hi, lo) of dims 32 t + 4 kk + (0, 1) and + (2, 3).
    uint32_t qa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        float hi[4] = {0.f, 0.f, 0.f, 0.f}, lo[4] = {0.f, 0.f, 0.f, 0.f};
        if (g < G) {
            const float *q = a.layer.q + (size_t)(w.head0 + g) * kHd + 32 * t + 4 * kk;
#pragma unroll
            for (int e = 0; e < 4; ++e) split_half(q[e] * a.q_mul, hi[e], lo[e]);
        }
        qa[kk][0] = pack_half2(hi[0], hi[1]);
        qa[kk][1] = pack_half2(lo[0], lo[1]);
        qa[kk][2] = pack_half2(hi[2], hi[3]);
        qa[kk][3] = pack_half2(lo[2], lo[3]);
    }
    float o[16][4];
#pragma unroll
    for (int n = 0; n < 16; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m = -INFINITY, l = 0.f;  // head g's
    __syncthreads();

    bulk_pipeline(a, w, smem, full, [&](const unsigned char *stage, int row0) {
        const int r0 = warp * kTileRows;  // the warp's rows of the step
        // V's 16 rows widened to fp16: lane takes row lane / 2, dims 64 (lane % 2) .. + 63.
        {
            const int r = lane / 2, d0 = 64 * (lane % 2);
            const uint4 *src = reinterpret_cast<const uint4 *>(stage + kStageV + (r0 + r) * kHd + d0);
            uint4 *dst = reinterpret_cast<uint4 *>(vh + r * kVhLd + d0);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const uint4 wv = src[c];
                const uint32_t words[4] = {wv.x ^ 0x80808080u, wv.y ^ 0x80808080u, wv.z ^ 0x80808080u,
                                           wv.w ^ 0x80808080u};
                dst[2 * c] = make_uint4(code_pair(words[0], 0x5140u), code_pair(words[0], 0x7362u),
                                        code_pair(words[1], 0x5140u), code_pair(words[1], 0x7362u));
                dst[2 * c + 1] = make_uint4(code_pair(words[2], 0x5140u), code_pair(words[2], 0x7362u),
                                            code_pair(words[3], 0x5140u), code_pair(words[3], 0x7362u));
            }
        }
        // Scores of the two n-tiles (rows r0 + 8 nt + g of the K stage as B's column g).
        float c[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.f;
            // Odd g reads its second 16 bytes first: rows g and g + 1 (128 bytes apart, the same
            // banks) then fall in different banks within each load.
            const uint4 *krow = reinterpret_cast<const uint4 *>(stage + kStageK + (r0 + 8 * nt + g) * kHd + 32 * t);
            const int sw = g & 1;
            const uint4 first = krow[sw], second = krow[sw ^ 1];
            const uint4 k0 = sw ? second : first, k1 = sw ? first : second;
            const uint32_t kw[8] = {k0.x, k0.y, k0.z, k0.w, k1.x, k1.y, k1.z, k1.w};
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                const uint32_t word = kw[kk] ^ 0x80808080u;
                // B: k-indices 2t, 2t + 1 (codes 0, 1 of the word) and 2t + 8, 2t + 9 (codes 2, 3).
                mma16816(c[nt], qa[kk], code_pair(word, 0x5140u), code_pair(word, 0x7362u));
            }
        }
        // Head g's scores of this lane's 4 rows: r0 + 8 nt + 2 t + e.
        const float *ks = reinterpret_cast<const float *>(stage + kStageKs);
        const float *vs = reinterpret_cast<const float *>(stage + kStageVs);
        float sc[2][2];
        bool valid[2][2];
        float tmax = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int r = r0 + 8 * nt + 2 * t + e;
                valid[nt][e] = row0 + r < w.end;
                sc[nt][e] = valid[nt][e] ? (c[nt][e] + c[nt][2 + e]) * a.q_inv * ks[r] : -INFINITY;
                tmax = fmaxf(tmax, sc[nt][e]);
            }
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
        const float m_new = fmaxf(m, tmax);
        if (m_new > m) {  // uniform over head g's four lanes
            const float f = exp2f(m - m_new);
            l *= f;
#pragma unroll
            for (int n = 0; n < 16; ++n) o[n][0] *= f, o[n][1] *= f, o[n][2] *= f, o[n][3] *= f;
            m = m_new;
        }
        float hi[2][2], lo[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float p = valid[nt][e] && g < G ? exp2f(sc[nt][e] - m) : 0.f;
                l += p;
                split_half(p * vs[r0 + 8 * nt + 2 * t + e] * a.w_mul, hi[nt][e], lo[nt][e]);
            }
        const uint32_t pa[4] = {pack_half2(hi[0][0], hi[0][1]), pack_half2(lo[0][0], lo[0][1]),
                                pack_half2(hi[1][0], hi[1][1]), pack_half2(lo[1][0], lo[1][1])};
        __syncwarp();  // the widened V is in
        // ldmatrix.trans x4 rows: lanes 0-7 rows 0-7, 8-15 rows 8-15 of dims 16 nj .. + 7; lanes
        // 16-31 the same rows of dims 16 nj + 8 .. + 15: b0 b1 of n-tiles 2 nj and 2 nj + 1.
        const int lrow = (lane % 8) + 8 * ((lane / 8) % 2), lcol = 8 * (lane / 16);
#pragma unroll
        for (int nj = 0; nj < 8; ++nj) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, vh + lrow * kVhLd + 16 * nj + lcol);
            mma16816(o[2 * nj], pa, b[0], b[1]);
            mma16816(o[2 * nj + 1], pa, b[2], b[3]);
        }
        __syncwarp();  // done with the widened V before the next step rewrites it
    });

    // Head g's sum over its four lanes; o (hi + lo) / w_mul of dims 8 n + 2 t + e.
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (g < G) {
#pragma unroll
        for (int n = 0; n < 16; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                w.o_s[(warp * G + g) * kHd + 8 * n + 2 * t + e] = (o[n][e] + o[n][2 + e]) * a.w_inv;
        if (t == 0) {
            w.m_s[warp * G + g] = m;
            w.l_s[warp * G + g] = l;
        }
    }
    block_combine<G>(a, w.o_s, w.m_s, w.l_s, w.kv, w.grp, w.b, w.n_active);
}

// ---- host -------------------------------------------------------------------------------------
enum Path { kRegs, kBulk, kMma };
struct Variant {
    Path path;
    bool fold;
    int param;   // regs: prefetch distance; bulk: stages
    int per_sm;  // blocks an SM the grid is sized for (B = per_sm x SMs / (n_kv x head groups))
    int lpr;     // lanes a row (regs: 8)
    std::string name() const {
        char buf[64];
        snprintf(buf, sizeof buf, "%s-%c%d-%s%s%s", path == kRegs ? "regs" : path == kBulk ? "bulk" : "mma",
                 path == kRegs ? 'd' : 's', param, fold ? "fold" : "stream", lpr == 16 ? "-l16" : "",
                 per_sm > 1 ? "-x2" : "");
        return buf;
    }
    // Heads a block folds for a group of `group` (a stream variant, and the tensor cores' fold,
    // read each row once).
    int head_group(int group) const {
        if (!fold || path == kMma) return group;
        return std::min(group, lpr == 16 ? Lanes<16>::MAX_HG : Lanes<8>::MAX_HG);
    }
};
constexpr int kMaxPerSm = 2;

using Kernel = void (*)(Args);
template <int LPR, int PER_SM>
Kernel bulk_kernel(bool fold, int hg) {
    if (!fold) return attn_bulk_kernel<2, LPR, false, PER_SM>;
    return hg == 2 ? attn_bulk_kernel<2, LPR, true, PER_SM>
                   : hg == 4 ? attn_bulk_kernel<4, LPR, true, PER_SM>
                             : LPR == 16 && hg == 8 ? attn_bulk_kernel<LPR == 16 ? 8 : 4, LPR, true, PER_SM> : nullptr;
}
template <int PER_SM>
Kernel mma_kernel(int group) {
    return group == 2 ? attn_mma_kernel<2, PER_SM> : group == 4 ? attn_mma_kernel<4, PER_SM>
                                                   : group == 8 ? attn_mma_kernel<8, PER_SM> : nullptr;
}
Kernel kernel_for(const Variant &v, int hg) {
    if (v.path == kMma) return v.per_sm > 1 ? mma_kernel<2>(hg) : mma_kernel<1>(hg);
    if (v.path == kRegs) {
        if (!v.fold) return attn_regs_kernel<2, false>;
        return hg == 2 ? attn_regs_kernel<2, true> : hg == 4 ? attn_regs_kernel<4, true> : nullptr;
    }
    if (v.lpr == 16) return v.per_sm > 1 ? bulk_kernel<16, 2>(v.fold, hg) : bulk_kernel<16, 1>(v.fold, hg);
    return v.per_sm > 1 ? bulk_kernel<8, 2>(v.fold, hg) : bulk_kernel<8, 1>(v.fold, hg);
}
size_t smem_for(const Variant &v, int hg) {
    if (v.path == kMma) return (size_t)v.param * kStageBytes + kVhBytes;  // o_s etc. in the stages
    const int khg = v.fold ? hg : 2;  // the stream kernels are built for 2 heads (kernel_for)
    const size_t tail = (size_t)(khg * kHd + kWarps * khg * kHd + 2 * kWarps * khg) * 4;
    return (v.path == kBulk ? (size_t)v.param * kStageBytes : 0) + tail;
}

__host__ __device__ uint64_t mix(uint64_t x) {  // splitmix64's finaliser
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}
// Codes uniform in -127..127 and scales uniform in (0.005, 0.02], from a hash of the index.
__global__ void fill_codes(int8_t *p, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = (int8_t)((int)(mix(i + seed * 0x100000001B3ull) % 255u) - 127);
}
__global__ void fill_scales(float *p, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = 0.005f + 0.015f * (float)((mix(i + seed * 0x100000001B3ull) >> 40) + 1) / (float)(1ull << 24);
}

struct Result {
    std::string shape, variant;
    int ctx;
    double us_token, us_layer, rate, frac, err;
    bool ok;
};

// The reference for one layer: fp64 over the int8 codes as stored.
void reference(const Shape &sh, int ctx, const std::vector<int8_t> &k, const std::vector<int8_t> &v,
               const std::vector<float> &ks, const std::vector<float> &vs, const std::vector<float> &q,
               const std::vector<int32_t> &table, std::vector<double> &out) {
    const int group = sh.n_heads / sh.n_kv;
    out.assign((size_t)sh.n_heads * kHd, 0.0);
    std::vector<double> score(ctx);
    for (int h = 0; h < sh.n_heads; ++h) {
        const int kv = h / group;
        double m = -INFINITY;
        for (int t = 0; t < ctx; ++t) {
            const size_t row = ((size_t)table[t / kPage] * sh.n_kv + kv) * kPage + t % kPage;
            double s = 0.0;
            for (int d = 0; d < kHd; ++d) s += (double)q[(size_t)h * kHd + d] * k[row * kHd + d];
            score[t] = s * ks[row];  // q carries log2(e) / sqrt(hd): the softmax is base 2
            m = std::max(m, score[t]);
        }
        double l = 0.0;
        for (int t = 0; t < ctx; ++t) {
            const size_t row = ((size_t)table[t / kPage] * sh.n_kv + kv) * kPage + t % kPage;
            const double p = std::exp2(score[t] - m);
            l += p;
            for (int d = 0; d < kHd; ++d) out[(size_t)h * kHd + d] += p * vs[row] * v[row * kHd + d];
        }
        for (int d = 0; d < kHd; ++d) out[(size_t)h * kHd + d] /= l;
    }
}

template <class T>
std::vector<T> to_host(const T *p, size_t n) {
    std::vector<T> h(n);
    CK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}

void run_shape(const Shape &sh, int ctx, int iters, double bw, const std::vector<Variant> &variants, int sms,
               std::vector<Result> &results, bool &all_ok) {
    const int group = sh.n_heads / sh.n_kv;
    int device = 0, smem_optin = 0;
    CK(cudaGetDevice(&device));
    CK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    const int pages = (ctx + kStepRows - 1) / kStepRows * kStepRows / kPage;  // whole steps
    // The pool: its pages and a spare block per 64, so the table is not the identity's neighbour.
    const int n_blocks = pages + pages / 64 + 1;
    const size_t kv_bytes = (size_t)n_blocks * sh.n_kv * kPage * kHd;
    const size_t sc_count = (size_t)n_blocks * sh.n_kv * kPage;
    int8_t *k_all, *v_all;
    float *ks_all, *vs_all, *q_all;
    CK(cudaMalloc(&k_all, kv_bytes * sh.layers));
    CK(cudaMalloc(&v_all, kv_bytes * sh.layers));
    CK(cudaMalloc(&ks_all, sc_count * 4 * sh.layers));
    CK(cudaMalloc(&vs_all, sc_count * 4 * sh.layers));
    CK(cudaMalloc(&q_all, (size_t)sh.n_heads * kHd * 4 * sh.layers));
    fill_codes<<<1024, 256>>>(k_all, kv_bytes * sh.layers, 1);
    fill_codes<<<1024, 256>>>(v_all, kv_bytes * sh.layers, 2);
    fill_scales<<<1024, 256>>>(ks_all, sc_count * sh.layers, 3);
    fill_scales<<<1024, 256>>>(vs_all, sc_count * sh.layers, 4);
    CK(cudaGetLastError());
    std::vector<float> q_host((size_t)sh.n_heads * kHd * sh.layers);
    const float qscale = kLog2e / std::sqrt((float)kHd);
    for (size_t i = 0; i < q_host.size(); ++i)
        q_host[i] = qscale * (2.f * (float)(mix(i + 77) >> 40) / (float)(1ull << 24) - 1.f);
    CK(cudaMemcpy(q_all, q_host.data(), q_host.size() * 4, cudaMemcpyHostToDevice));
    // The tensor cores' fold: q and the weights p v_scale (p <= 1, v_scale <= 0.02 by
    // construction) scaled by powers of two that bring their largest to at most 2^14 in fp16.
    float q_max = 0.f;
    for (float v : q_host) q_max = std::max(q_max, std::fabs(v));
    const float q_mul = std::exp2(std::floor(std::log2(16384.f / q_max)));
    const float w_mul = std::exp2(std::floor(std::log2(16384.f / 0.02f)));
    std::vector<int32_t> table(pages);
    {
        std::vector<int32_t> perm(n_blocks);
        for (int i = 0; i < n_blocks; ++i) perm[i] = i;
        for (int i = n_blocks - 1; i > 0; --i) std::swap(perm[i], perm[mix(i) % (uint64_t)(i + 1)]);
        for (int i = 0; i < pages; ++i) table[i] = perm[i];
    }
    int32_t *table_d;
    CK(cudaMalloc(&table_d, pages * 4));
    CK(cudaMemcpy(table_d, table.data(), pages * 4, cudaMemcpyHostToDevice));

    // B, the blocks a head group, and the head groups are the variant's; buffers are sized for
    // the most (one head group a KV head, two blocks an SM).
    const int max_bpkv = std::max(1, kMaxPerSm * sms / sh.n_kv);
    float *part_o, *part_ml, *out;
    unsigned *counters, *sink;
    CK(cudaMalloc(&part_o, (size_t)sh.n_heads * max_bpkv * kHd * 4 * sh.layers));
    CK(cudaMalloc(&part_ml, (size_t)sh.n_heads * max_bpkv * 2 * 4 * sh.layers));
    CK(cudaMalloc(&out, (size_t)sh.n_heads * kHd * 4 * sh.layers));
    CK(cudaMalloc(&counters, (size_t)sh.n_heads * 4 * sh.layers));
    CK(cudaMemset(counters, 0, (size_t)sh.n_heads * 4 * sh.layers));
    const size_t sink_n = (size_t)sh.n_kv * max_bpkv;
    CK(cudaMalloc(&sink, sink_n * 4 * sh.layers));

    // Bytes a token reads: C rows of K and V and their two scales, every KV head, every layer (a
    // second head group of a KV head reads its rows again; not counted: from L2 or not, they are
    // not bytes the step needs).
    const double bytes = (double)ctx * sh.n_kv * (2.0 * kHd + 8.0) * sh.layers;
    std::vector<std::vector<double>> ref(2);
    const int ref_layers[2] = {0, sh.layers - 1};
    for (int r = 0; r < 2; ++r) {
        const int l = ref_layers[r];
        const auto k = to_host(k_all + kv_bytes * l, kv_bytes);
        const auto v = to_host(v_all + kv_bytes * l, kv_bytes);
        const auto ks = to_host(ks_all + sc_count * l, sc_count);
        const auto vs = to_host(vs_all + sc_count * l, sc_count);
        const std::vector<float> q(q_host.begin() + (size_t)sh.n_heads * kHd * l,
                                   q_host.begin() + (size_t)sh.n_heads * kHd * (l + 1));
        reference(sh, ctx, k, v, ks, vs, q, table, ref[r]);
    }

    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::vector<unsigned> stream_sink;  // the first stream variant's xor, per layer and block
    printf("\n%s, context %d: %.1f MB of cache a token (%.2f MB a layer), %d query heads a KV head\n", sh.name, ctx,
           bytes / 1e6, bytes / 1e6 / sh.layers, group);
    printf("  %-24s %6s %5s %10s %10s %10s %8s %10s  %s\n", "variant", "groups", "B", "us/token", "us/layer", "GB/s",
           "of copy", "rel. L2", "check");
    for (const Variant &var : variants) {
        const int hg = var.head_group(group);
        const int head_groups = group / hg;
        const Kernel kernel = kernel_for(var, hg);
        if (kernel == nullptr) continue;
        const size_t smem = smem_for(var, hg);
        cudaFuncAttributes attr;
        CK(cudaFuncGetAttributes(&attr, kernel));
        if (attr.sharedSizeBytes + smem > (size_t)smem_optin) {
            printf("  %-24s needs %zu B of shared memory a block, more than the %d B a block may have\n",
                   var.name().c_str(), attr.sharedSizeBytes + smem, smem_optin);
            continue;
        }
        CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        int per_sm = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
        if (per_sm < var.per_sm) {
            printf("  %-24s %d blocks do not fit an SM (%zu B of shared memory a block)\n", var.name().c_str(),
                   var.per_sm, smem);
            continue;
        }
        const int bpkv = std::max(1, var.per_sm * sms / (sh.n_kv * head_groups));
        const int rows_per_block = ((ctx + bpkv - 1) / bpkv + kStepRows - 1) / kStepRows * kStepRows;
        CK(cudaMemset(sink, 0, sink_n * 4 * sh.layers));
        auto enqueue = [&](cudaStream_t s) {
            for (int l = 0; l < sh.layers; ++l) {
                Args a{};
                a.layer.k = k_all + kv_bytes * l;
                a.layer.v = v_all + kv_bytes * l;
                a.layer.ks = ks_all + sc_count * l;
                a.layer.vs = vs_all + sc_count * l;
                a.layer.q = q_all + (size_t)sh.n_heads * kHd * l;
                a.table = table_d;
                a.n_kv = sh.n_kv;
                a.n_heads = sh.n_heads;
                a.head_groups = head_groups;
                a.ctx = ctx;
                a.rows_per_block = rows_per_block;
                a.n_blocks_grid = bpkv;
                a.part_o = part_o + (size_t)sh.n_heads * max_bpkv * kHd * l;
                a.part_ml = part_ml + (size_t)sh.n_heads * max_bpkv * 2 * l;
                a.out = out + (size_t)sh.n_heads * kHd * l;
                a.counters = counters + (size_t)sh.n_heads * l;
                a.sink = sink + sink_n * l;
                a.prefetch = var.path == kRegs ? var.param : 0;
                a.stages = var.path != kRegs ? var.param : 0;
                a.q_mul = q_mul;
                a.q_inv = 1.f / q_mul;
                a.w_mul = w_mul;
                a.w_inv = 1.f / w_mul;
                kernel<<<dim3(sh.n_kv * head_groups, bpkv), kThreads, smem, s>>>(a);
            }
        };
        CK(cudaMemset(out, 0, (size_t)sh.n_heads * kHd * 4 * sh.layers));
        enqueue(stream);  // once outside the graph: the checks' run
        CK(cudaStreamSynchronize(stream));
        CK(cudaGetLastError());
        Result res{sh.name, var.name(), ctx, 0, 0, 0, 0, 0, true};
        if (var.fold) {
            double worst = 0.0;
            for (int r = 0; r < 2; ++r) {
                const auto got = to_host(out + (size_t)sh.n_heads * kHd * ref_layers[r], (size_t)sh.n_heads * kHd);
                double num = 0.0, den = 0.0;
                for (size_t i = 0; i < got.size(); ++i) {
                    const double d = got[i] - ref[r][i];
                    num += d * d;
                    den += ref[r][i] * ref[r][i];
                }
                const double e = std::isfinite(num) ? std::sqrt(num / den) : INFINITY;
                worst = std::max(worst, e);
            }
            res.err = worst;
            res.ok = worst < 1e-4;
        } else {
            // Per layer and head group, the xor over its blocks is the xor of all its rows' words:
            // the same for every stream variant, whatever the data path.
            const auto got = to_host(sink, sink_n * sh.layers);
            std::vector<unsigned> folded((size_t)sh.layers * sh.n_kv, 0u);
            for (int l = 0; l < sh.layers; ++l)
                for (size_t i = 0; i < (size_t)sh.n_kv * bpkv; ++i) folded[(size_t)l * sh.n_kv + i / bpkv] ^= got[sink_n * l + i];
            if (stream_sink.empty()) stream_sink = folded;
            res.ok = folded == stream_sink;
            res.err = NAN;
        }
        const cudaGraphExec_t ge = capture_graph(stream, enqueue);
        for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, stream));
        const float ms = elapsed_ms(stream, [&] {
            for (int i = 0; i < iters; ++i) CK(cudaGraphLaunch(ge, stream));
        });
        CK(cudaGetLastError());
        CK(cudaGraphExecDestroy(ge));
        res.us_token = 1e3 * ms / iters;
        res.us_layer = res.us_token / sh.layers;
        res.rate = bytes / (res.us_token * 1e-6);
        res.frac = res.rate / bw;
        all_ok = all_ok && res.ok;
        printf("  %-24s %6d %5d %10.1f %10.2f %10.1f %7.1f%% %10.2e  %s\n", res.variant.c_str(), head_groups, bpkv,
               res.us_token, res.us_layer, res.rate / 1e9, 100.0 * res.frac, res.err, res.ok ? "PASS" : "FAIL");
        results.push_back(res);
    }
    CK(cudaStreamDestroy(stream));
    for (void *p : {(void *)k_all, (void *)v_all, (void *)ks_all, (void *)vs_all, (void *)q_all, (void *)table_d,
                    (void *)part_o, (void *)part_ml, (void *)out, (void *)counters, (void *)sink})
        CK(cudaFree(p));
}

void usage(const char *argv0) {
    printf("usage: %s [--shape qwen3-0.6b|qwen3-8b|qwen3-30b-a3b|all] [--context C[,C...]] [--iters N] "
           "[--json PATH]\n",
           argv0);
}

}  // namespace

int main(int argc, char **argv) {
    std::string shape = "all", json;
    std::vector<int> contexts = {4096, 32768};
    int iters = 20;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        const bool has_value = i + 1 < argc;
        if (arg == "--shape" && has_value) {
            shape = argv[++i];
        } else if (arg == "--context" && has_value) {
            contexts = probe::parse_ints(argv[++i]);
        } else if (arg == "--iters" && has_value) {
            iters = atoi(argv[++i]);
        } else if (arg == "--json" && has_value) {
            json = argv[++i];
        } else {
            usage(argv[0]);
            return 2;
        }
    }
    bool known = shape == "all";
    for (const Shape &sh : kShapes) known = known || shape == sh.name;
    if (!known || iters < 1 || contexts.empty() ||
        std::any_of(contexts.begin(), contexts.end(), [](int c) { return c < 1; })) {
        usage(argv[0]);
        return 2;
    }
    int device = 0, sms = 0;
    CK(cudaGetDevice(&device));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, device));
    const double bw = copy_bandwidth();
    printf("%s, %d SMs; D2D copy bandwidth %.1f GB/s (bytes read + written)\n", prop.name, sms, bw / 1e9);

    std::vector<Variant> variants;
    for (bool fold : {false, true}) {
        for (int d : {0, 2, 4, 8, 16}) variants.push_back({kRegs, fold, d, 1, 8});
        for (int s : {2, 3, 4, 6}) variants.push_back({kBulk, fold, s, 1, 8});
        for (int s : {2, 3}) variants.push_back({kBulk, fold, s, 2, 8});
    }
    for (int s : {3, 4, 6}) variants.push_back({kBulk, true, s, 1, 16});
    for (int s : {2, 3}) variants.push_back({kBulk, true, s, 2, 16});
    for (int s : {2, 3, 4, 5}) variants.push_back({kMma, true, s, 1, 16});
    for (int s : {2}) variants.push_back({kMma, true, s, 2, 16});
    std::vector<Result> results;
    bool ok = true;
    for (const Shape &sh : kShapes) {
        if (shape != "all" && shape != sh.name) continue;
        for (int ctx : contexts) run_shape(sh, ctx, iters, bw, variants, sms, results, ok);
    }
    if (!json.empty()) {
        FILE *f = fopen(json.c_str(), "w");
        if (f == nullptr) {
            fprintf(stderr, "cannot write %s\n", json.c_str());
            return 1;
        }
        fprintf(f, "{\"device\": \"%s\", \"copy_bandwidth_GBps\": %.1f, \"results\": [\n", prop.name, bw / 1e9);
        for (size_t i = 0; i < results.size(); ++i) {
            const Result &r = results[i];
            char err[32] = "null";  // no reference (stream variants) or not finite
            if (std::isfinite(r.err)) snprintf(err, sizeof err, "%.3e", r.err);
            fprintf(f,
                    "  {\"shape\": \"%s\", \"context\": %d, \"variant\": \"%s\", \"us_token\": %.3f, \"us_layer\": %.4f, "
                    "\"GBps\": %.1f, \"of_copy\": %.4f, \"rel_l2\": %s, \"ok\": %s}%s\n",
                    r.shape.c_str(), r.ctx, r.variant.c_str(), r.us_token, r.us_layer, r.rate / 1e9, r.frac,
                    err, r.ok ? "true" : "false",
                    i + 1 < results.size() ? "," : "");
        }
        fprintf(f, "]}\n");
        fclose(f);
    }
    printf("\n%s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
}
