// attention.cu — decode attention (one query token) over the paged KV cache, on a fixed grid
// that serves every position from one captured graph; in the body it also does QK-norm, RoPE
// and the KV-cache write of the new token (fused: no separate kernel, no round trip).
//
//   qkv:  [n_heads*hd | n_kv*hd | n_kv*hd] fp32, the fused QKV GEMV's output (fused mode); or
//   q:    [n_heads, hd] fp32, already normed and rotated (attention only: the test entry points)
//   K, V: the paged pool (kernels.cuh, KvPages): row t of KV head g is row g * page + t % page
//         of the K / V page (fp32 / bf16 / int8; int8 with a scale page [n_kv, page] fp32) in
//         block table[t / page], table = row step->seq_slot of the block tables
//   out:  [n_heads, hd] fp32
//   visible length len = position + 1 (read from the device step record)
//   score[t] = (q . dequant(K[t])) / sqrt(hd); p = softmax(score) (fp32, max subtracted);
//   out = sum_t p[t] * dequant(V[t]); dequant(int8) = q_int8 * scale, the scale applied once per
//   row: score = (q . k_int8) * (k_scale * (1 / sqrt(hd))) (fp32 or bf16: (q . k) * (1 /
//   sqrt(hd))), and the weight p * v_scale multiplies the integer row.
//   GQA: the G = n_heads / n_kv consecutive query heads of a KV head share it, so a block reads
//   its KV rows once for a group of HG of them (as many as the registers hold: 8 for bf16 KV
//   at head dim 128, 4 for int8); with G > HG each head group has its own blocks, side by
//   side over the same chunks, rather than a second pass over the rows. A short cache takes a
//   narrower group, down to one head a block (attention_plan).
//
// Fused prologue (rope_kv.cuh): every block rotates the query heads of its head group (a warp
// per head; q is tiny). The block that owns the chunk holding row `position` also norms and
// rotates k, encodes k and v in the cache type, and takes that row from shared memory instead
// of the cache; head group 0's owner stores them at row `position` of block step->row_block
// (layer 0 also stores row_block into the block table). So nothing in the kernel reads a row
// it writes. A launch of n rows (the verify body: consecutive positions, grid z) works the same
// per row, except that row j takes all the launch's new rows up to its own (positions
// step[0].position .. its own) from shared memory: a block computes those of them its chunks
// hold, and stores only row j's.
//
// Work split. The context is cut into chunks of C = split_len rows (a multiple of 32). Grid (n_kv
// * head groups, B), 256 threads: block b of a (KV head, head group) takes chunks b, b + B, b +
// 2B, ... (B is fixed by the plan: about one wave of blocks), so any context spreads over up to B
// blocks per head group and a short one occupies few. Inside a block, a chunk is cut into tiles
// of R rows and warp w takes tiles w, w + 8, ...; a warp reads a row with L = row bytes / 16
// lanes (16-byte loads, or one element per lane for head dims other than 64/128/256), so one load
// instruction covers 32 / L consecutive rows and a tile is 2-4 such loads of K and of V in flight
// per lane. A warp works as a pipeline: while it folds in tile i, the K/V loads of tile i+1 and
// the block-table reads of tile i+3 are in flight (a row's address depends on its table entry,
// so a tile is located two steps before it is loaded; pulling tile i+2 into L2 as well made the
// fold slower, scripts/attention_probe.cu's regs-d2 against regs-d0). Each warp
// keeps an online softmax (running max m, sum l, accumulator o per head, rescaled when m grows);
// the 8 warps combine through shared memory in warp order. Int8 rows of 128 dims whose KV head's
// query heads form one group of 2, 4 or 8 may fold on the tensor cores instead (attend_mma: its
// own layout of a tile's rows over the lanes; the same pipeline and the same combine).
// A block that is alone for its head group (len <= C) writes out directly; otherwise it writes
// (m, l, o) as a partial, and the last of the n_active blocks of the head group to finish (an
// atomic counter, reset by that block) combines the partials in block order: the same
// arithmetic whichever block is last, so results are bit-identical run to run. The first
// tile's K/V loads depend only on the step record and on earlier steps' rows, and the
// prologue's norm weights and rotation angles only on weights and the position, so all of them
// are issued before waiting on the previous kernel (PDL), overlapping its tail.
#include <math.h>

#include <type_traits>

#include "kernels.cuh"
#include "quant.cuh"
#include "rope_kv.cuh"
#include "trace.cuh"

namespace og {
namespace {

constexpr int kAttnWarps = 8;
constexpr int kAttnThreads = kAttnWarps * kWarpSize;

constexpr int cmin(int a, int b) { return a < b ? a : b; }
constexpr int cmax(int a, int b) { return a > b ? a : b; }

// A lane's rows a tile where a row is one vector a lane (SL of AttnLayout): the long band's
// tiles, and the short band's (int8 rows of 64 dims), half as many rows a warp, so that a short
// context spreads over more of a block's warps (each warp folds its tiles one after another).
constexpr int kLongSlots = 4, kShortSlots = 2;

// How a warp reads K/V rows, per element type and head dim (HD = 0: any even head dim <= 256),
// with SL rows a lane a tile (kLongSlots or kShortSlots; fewer where a row takes several vectors).
template <int KV, int HD, int SL>
struct AttnLayout {
    static constexpr int kElemBytes = KV == OG_KV_F32 ? 4 : KV == OG_KV_BF16 ? 2 : 1;
    static constexpr bool kVector = HD > 0;
    static constexpr int kVec = kVector ? 16 / kElemBytes : 1;               // elements per load
    static constexpr int kLanesPerRow = kVector ? cmin(HD / kVec, kWarpSize) : kWarpSize;
    static constexpr int kVecsPerLane = kVector ? HD / kVec / kLanesPerRow : kMaxHeadDim / kWarpSize;
    static constexpr int kRowsPerLoad = kWarpSize / kLanesPerRow;
    static constexpr int kSlots = kVector ? cmax(1, SL / kVecsPerLane) : 2;  // rows a lane a tile
    static constexpr int kTileRows = kRowsPerLoad * kSlots;
    static constexpr int kLaneElems = kVecsPerLane * kVec;                  // dims a lane owns
    static constexpr int kMaxHeadGroup = cmin(8, 64 / kLaneElems);          // o registers <= 64
    using Raw = typename std::conditional<kVector, uint4, uint32_t>::type;
};

struct AttnParams {
    AttentionArgs a;
    int chunk;          // C: rows per chunk (plan.split_len)
    int n_blocks;       // B: blocks per (KV head, head group)
    int head_groups;    // ceil(G / HG): blocks of a KV head's chunk, one per head group
    float inv_sqrt_hd;  // 1 / sqrt(hd): scores are (q . k) * (k_scale * inv_sqrt_hd)
};

// Shared-memory carve-up, in floats (every region a multiple of 4 floats: 16-byte aligned).
struct AttnSmem {
    int q, o, m, l, sums, factors, new_k, new_v, row_floats, k_head, scales, total;
};
__host__ __device__ inline int round4(int n) { return (n + 3) & ~3; }
// rows: the new rows a block may hold (AttentionArgs::n_rows).
__host__ __device__ inline AttnSmem attn_smem(int head_group, int hd, int n_blocks, int elem_bytes,
                                              int rows) {
    AttnSmem s;
    int off = 0;
    s.q = off;        off += round4(head_group * hd);                    // [HG, hd]
    s.o = off;        off += round4(kAttnWarps * head_group * hd);       // [warps, HG, hd]
    s.m = off;        off += round4(kAttnWarps * head_group);            // [warps, HG]
    s.l = off;        off += round4(kAttnWarps * head_group);
    s.sums = off;     off += round4(head_group);                         // [HG]
    s.factors = off;  off += round4(head_group * n_blocks);              // [HG, B]
    s.row_floats = round4((hd * elem_bytes + 3) / 4);                    // a new row's bytes
    s.new_k = off;    off += rows * s.row_floats;                        // [rows, row_floats]
    s.new_v = off;    off += rows * s.row_floats;
    s.k_head = off;   off += rows * round4(hd);                          // rotated k (fp32) [rows, hd]
    s.scales = off;   off += round4(2 * rows);                           // [rows]: k scale, v scale
    s.total = off;
    return s;
}

// Per-thread view of the cache for one KV head.
struct RowSource {
    const char *k, *v, *k_scales, *v_scales;
    int64_t block_stride;
    const int32_t *table;   // the sequence's block-table row
    int page, n_pool_blocks, kv_head, len;
    int page_shift;         // log2(page) where page is a power of two (the engine's default), else -1
    int new_lo, new_hi;     // rows [new_lo, new_hi] are taken from shared memory (fused), or
                            // new_lo > new_hi: none
    int row_floats;         // a new row's stride in shared memory (AttnSmem::row_floats)
    int row_group, lane_in_row;
};

template <int KV, int HD, int SL>
struct Tile {
    using L = AttnLayout<KV, HD, SL>;
    typename L::Raw k[L::kSlots][L::kVecsPerLane];
    typename L::Raw v[L::kSlots][L::kVecsPerLane];
    float k_scale[L::kSlots], v_scale[L::kSlots];
};

template <int KV>
__device__ __forceinline__ uint32_t load_element(const char *row, int d) {
    if constexpr (KV == OG_KV_F32) return __ldg(reinterpret_cast<const unsigned int *>(row) + d);
    else if constexpr (KV == OG_KV_BF16) return __ldg(reinterpret_cast<const unsigned short *>(row) + d);
    else return __ldg(reinterpret_cast<const unsigned char *>(row) + d);
}

// Where a tile's rows are: per slot the block id (-1: no row to read: past len, the new row,
// no tile, or a table entry outside the pool) and the row within the block's page. Locating
// reads the block table; loading then depends on it, so the kernel locates a tile one step
// before it loads it.
template <int KV, int HD, int SL>
struct TileLoc {
    int row0;                                   // the tile's first row, -1: none
    int block[AttnLayout<KV, HD, SL>::kSlots];
    int in_page[AttnLayout<KV, HD, SL>::kSlots];
};

// A row the kernel takes from shared memory (the tensor-core fold's test; locate_tile and
// attend_tile spell out the same one, which as a call compiles to other instructions there).
template <bool ROWS>
__device__ __forceinline__ bool is_new_row(int row, const RowSource &src) {
    return ROWS ? row >= src.new_lo && row <= src.new_hi : row == src.new_hi;
}

// The page index of row `row` (>= 0): a shift where the page is a power of two, else a division
// (a tile's location takes one; a division by a value known only at run time is about twenty
// instructions).
__device__ __forceinline__ int page_of(int row, const RowSource &src) {
    return src.page_shift >= 0 ? row >> src.page_shift : row / src.page;
}

// Block-table entry page_index of the sequence, or -1 outside the pool (layer 0 of this step may
// be storing it: read past L1).
__device__ __forceinline__ int table_block(const RowSource &src, int page_index) {
    const int block = __ldcg(src.table + page_index);
    return (unsigned)block < (unsigned)src.n_pool_blocks ? block : -1;
}

// The byte offset of the block that holds a tile lying in one page (block: its rows' block,
// or -1 for a row not read; all that are read share the page's): the page's block, or block
// 0's (a valid address) where no row is read.
template <int N>
__device__ __forceinline__ int64_t one_page_base(const int (&block)[N], const RowSource &src) {
    int b = block[0];
#pragma unroll
    for (int i = 1; i < N; ++i) b = max(b, block[i]);
    return (int64_t)max(b, 0) * src.block_stride;
}

// ROWS (attention_kernel's): the new rows are a range; else at most the one row new_hi.
template <int KV, int HD, int SL, bool ROWS>
__device__ __forceinline__ void locate_tile(TileLoc<KV, HD, SL> &loc, int row0, const RowSource &src) {
    using L = AttnLayout<KV, HD, SL>;
    loc.row0 = row0;
    // A tile (row0 a multiple of its rows) in one page: one table read.
    if (src.page % L::kTileRows == 0) {
        const int page_index = row0 >= 0 ? page_of(row0, src) : 0;
        const int in0 = row0 >= 0 ? row0 - page_index * src.page : 0;
        const int block = row0 >= 0 ? table_block(src, page_index) : -1;
#pragma unroll
        for (int s = 0; s < L::kSlots; ++s) {
            const int in_tile = s * L::kRowsPerLoad + src.row_group;
            const int row = row0 + in_tile;
            const bool fresh = ROWS ? row >= src.new_lo && row <= src.new_hi : row == src.new_hi;
            loc.block[s] = row0 >= 0 && row < src.len && !fresh ? block : -1;
            loc.in_page[s] = in0 + in_tile;
        }
        return;
    }
    int page_index = 0, in_page = 0;
    if (row0 >= 0) {  // one division per tile; the slots' rows step by kRowsPerLoad
        const int row = row0 + src.row_group;
        page_index = page_of(row, src);
        in_page = row - page_index * src.page;
    }
#pragma unroll
    for (int s = 0; s < L::kSlots; ++s) {
        if (s > 0) {
            in_page += L::kRowsPerLoad;
            while (in_page >= src.page) {
                in_page -= src.page;
                ++page_index;
            }
        }
        const int row = row0 + s * L::kRowsPerLoad + src.row_group;
        const bool fresh = ROWS ? row >= src.new_lo && row <= src.new_hi : row == src.new_hi;
        const bool ok = row0 >= 0 && row < src.len && !fresh;
        int block = -1;
        if (ok) {
            block = __ldcg(src.table + page_index);  // layer 0 of this step may be storing it
            if ((unsigned)block >= (unsigned)src.n_pool_blocks) block = -1;
        }
        loc.block[s] = block;
        loc.in_page[s] = in_page;
    }
}

// 16 bytes of a K/V row: no L1 allocation, 256-byte L2 fetches, the normal L2 priority (the
// rows are read again by every later step, while the weights' lines are evicted first).
__device__ __forceinline__ uint4 load_row_chunk(const uint4 *p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// One slot's row of a tile (the lane's vectors or elements of K and V, and the int8 rows' scales
// at k_scale / v_scale); zeros (scale 0) where !ok.
template <int KV, int HD, int SL>
__device__ __forceinline__ void load_slot(Tile<KV, HD, SL> &t, int s, bool ok, const char *k_row, const char *v_row,
                                          const float *k_scale, const float *v_scale, const RowSource &src,
                                          int hd) {
    using L = AttnLayout<KV, HD, SL>;
#pragma unroll
    for (int v = 0; v < L::kVecsPerLane; ++v) {
        if constexpr (L::kVector) {
            const int vec = src.lane_in_row + v * L::kLanesPerRow;
            t.k[s][v] = ok ? load_row_chunk(reinterpret_cast<const uint4 *>(k_row) + vec)
                           : make_uint4(0u, 0u, 0u, 0u);
            t.v[s][v] = ok ? load_row_chunk(reinterpret_cast<const uint4 *>(v_row) + vec)
                           : make_uint4(0u, 0u, 0u, 0u);
        } else {
            const int d = src.lane_in_row + v * kWarpSize;
            const bool e_ok = ok && d < hd;
            t.k[s][v] = e_ok ? load_element<KV>(k_row, d) : 0u;
            t.v[s][v] = e_ok ? load_element<KV>(v_row, d) : 0u;
        }
    }
    if constexpr (KV == OG_KV_INT8) {
        t.k_scale[s] = ok ? __ldg(k_scale) : 0.f;
        t.v_scale[s] = ok ? __ldg(v_scale) : 0.f;
    } else {
        t.k_scale[s] = 1.f;
        t.v_scale[s] = 1.f;
    }
}

// Issue the loads of a located tile; rows without a block read as zeros (scale 0).
template <int KV, int HD, int SL>
__device__ __forceinline__ void load_tile(Tile<KV, HD, SL> &t, const TileLoc<KV, HD, SL> &loc,
                                          const RowSource &src, int hd) {
    using L = AttnLayout<KV, HD, SL>;
    const int64_t row_bytes = (int64_t)hd * L::kElemBytes;
    if (src.page % L::kTileRows == 0) {
        // The tile in one page (locate_tile: every row's block that page's, or -1): one address
        // a tile, slot s kRowsPerLoad rows past slot s - 1.
        const int64_t base = one_page_base(loc.block, src);
        const int64_t row = (int64_t)src.kv_head * src.page + loc.in_page[0];  // slot 0's
        const char *k = src.k + base + row * row_bytes, *v = src.v + base + row * row_bytes;
        const float *k_scales = nullptr, *v_scales = nullptr;
        if constexpr (KV == OG_KV_INT8) {
            k_scales = reinterpret_cast<const float *>(src.k_scales + base) + row;
            v_scales = reinterpret_cast<const float *>(src.v_scales + base) + row;
        }
#pragma unroll
        for (int s = 0; s < L::kSlots; ++s) {
            const int step = s * L::kRowsPerLoad;
            load_slot<KV, HD, SL>(t, s, loc.block[s] >= 0, k + step * row_bytes, v + step * row_bytes,
                                  KV == OG_KV_INT8 ? k_scales + step : nullptr,
                                  KV == OG_KV_INT8 ? v_scales + step : nullptr, src, hd);
        }
        return;
    }
#pragma unroll
    for (int s = 0; s < L::kSlots; ++s) {
        const bool ok = loc.block[s] >= 0;
        const int64_t base = (int64_t)(ok ? loc.block[s] : 0) * src.block_stride;
        const int64_t row = (int64_t)src.kv_head * src.page + loc.in_page[s];
        const float *k_scales = nullptr, *v_scales = nullptr;
        if constexpr (KV == OG_KV_INT8) {
            k_scales = reinterpret_cast<const float *>(src.k_scales + base) + row;
            v_scales = reinterpret_cast<const float *>(src.v_scales + base) + row;
        }
        load_slot<KV, HD, SL>(t, s, ok, src.k + base + row * row_bytes, src.v + base + row * row_bytes,
                              k_scales, v_scales, src, hd);
    }
}

// Elements 4g .. 4g+3 of a 16-byte vector as fp32 (int8: the integer codes, exactly; see
// quant.cuh for the two-instruction conversion).
template <int KV>
__device__ __forceinline__ float4 decode4(const uint4 &r, int g) {
    if constexpr (KV == OG_KV_F32) {
        return make_float4(__uint_as_float(r.x), __uint_as_float(r.y), __uint_as_float(r.z),
                           __uint_as_float(r.w));
    } else if constexpr (KV == OG_KV_BF16) {
        const uint32_t w0 = g == 0 ? r.x : r.z;
        const uint32_t w1 = g == 0 ? r.y : r.w;
        return make_float4(bf16_lo(w0), bf16_hi(w0), bf16_lo(w1), bf16_hi(w1));
    } else {
        __half2 h[2];  // (q0, q2), (q1, q3)
        word_pairs(word_of(r, g), h);
        return make_float4(__low2float(h[0]), __low2float(h[1]), __high2float(h[0]),
                           __high2float(h[1]));
    }
}
template <int KV>
__device__ __forceinline__ float decode1(uint32_t r) {
    if constexpr (KV == OG_KV_F32) return __uint_as_float(r);
    else if constexpr (KV == OG_KV_BF16) return __uint_as_float(r << 16);
    else return (float)(int8_t)(r & 0xffu);
}

// Running softmax state of one warp for HG heads: m (warp-uniform), l (this lane's rows), o.
template <int HG, int E>
struct WarpState {
    float m[HG], l[HG], o[HG][E];
};

// Fold one tile into the warp's state for the head group whose queries start at q_s.
template <int KV, int HD, int SL, int HG, bool ROWS>
__device__ __forceinline__ void attend_tile(Tile<KV, HD, SL> &t, int row0, const RowSource &src,
                                            const float *q_s, const void *new_k_s,
                                            const void *new_v_s, const float *new_scales,
                                            int hd, float inv_sqrt_hd, int lane,
                                            WarpState<HG, AttnLayout<KV, HD, SL>::kLaneElems> &st) {
    using L = AttnLayout<KV, HD, SL>;
    constexpr int S = L::kSlots, V = L::kVecsPerLane, LPR = L::kLanesPerRow;
    int rows[S];
#pragma unroll
    for (int s = 0; s < S; ++s) rows[s] = row0 + s * L::kRowsPerLoad + src.row_group;

    // The new rows (fused, the blocks whose chunks hold them): from shared memory, as stored.
    if (src.new_lo <= src.new_hi) {
#pragma unroll
        for (int s = 0; s < S; ++s) {
            if (ROWS ? rows[s] >= src.new_lo && rows[s] <= src.new_hi : rows[s] == src.new_hi) {
                const int r = ROWS ? rows[s] - src.new_lo : 0;
                const float *k_s = static_cast<const float *>(new_k_s) + r * src.row_floats;
                const float *v_s = static_cast<const float *>(new_v_s) + r * src.row_floats;
#pragma unroll
                for (int v = 0; v < V; ++v) {
                    if constexpr (L::kVector) {
                        const int vec = src.lane_in_row + v * LPR;
                        t.k[s][v] = reinterpret_cast<const uint4 *>(k_s)[vec];
                        t.v[s][v] = reinterpret_cast<const uint4 *>(v_s)[vec];
                    } else {
                        const int d = src.lane_in_row + v * kWarpSize;
                        uint32_t kb = 0u, vb = 0u;
                        if (d < hd) {
                            if constexpr (KV == OG_KV_F32) {
                                kb = reinterpret_cast<const uint32_t *>(k_s)[d];
                                vb = reinterpret_cast<const uint32_t *>(v_s)[d];
                            } else if constexpr (KV == OG_KV_BF16) {
                                kb = reinterpret_cast<const uint16_t *>(k_s)[d];
                                vb = reinterpret_cast<const uint16_t *>(v_s)[d];
                            } else {
                                kb = reinterpret_cast<const uint8_t *>(k_s)[d];
                                vb = reinterpret_cast<const uint8_t *>(v_s)[d];
                            }
                        }
                        t.k[s][v] = kb;
                        t.v[s][v] = vb;
                    }
                }
                if constexpr (KV == OG_KV_INT8) {
                    t.k_scale[s] = new_scales[2 * r];
                    t.v_scale[s] = new_scales[2 * r + 1];
                }
            }
        }
    }

    // ---- scores: lanes of a row split its dims, then a butterfly over the row's lanes ----
    float sc[S][HG];
#pragma unroll
    for (int s = 0; s < S; ++s)
#pragma unroll
        for (int j = 0; j < HG; ++j) sc[s][j] = 0.f;
    if constexpr (L::kVector) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
            const int e0 = (src.lane_in_row + v * LPR) * L::kVec;
#pragma unroll
            for (int g = 0; g < L::kVec / 4; ++g) {
                float4 qv[HG];
#pragma unroll
                for (int j = 0; j < HG; ++j)
                    qv[j] = *reinterpret_cast<const float4 *>(q_s + j * HD + e0 + 4 * g);
#pragma unroll
                for (int s = 0; s < S; ++s) {
                    const float4 k4 = decode4<KV>(t.k[s][v], g);
#pragma unroll
                    for (int j = 0; j < HG; ++j) {
                        float a = sc[s][j];
                        a = fmaf(qv[j].x, k4.x, a);
                        a = fmaf(qv[j].y, k4.y, a);
                        a = fmaf(qv[j].z, k4.z, a);
                        a = fmaf(qv[j].w, k4.w, a);
                        sc[s][j] = a;
                    }
                }
            }
        }
    } else {
#pragma unroll
        for (int v = 0; v < V; ++v) {
            const int d = lane + v * kWarpSize;
            if (d < hd) {
#pragma unroll
                for (int j = 0; j < HG; ++j) {
                    const float qd = q_s[j * hd + d];
#pragma unroll
                    for (int s = 0; s < S; ++s) sc[s][j] = fmaf(qd, decode1<KV>(t.k[s][v]), sc[s][j]);
                }
            }
        }
    }
#pragma unroll
    for (int off = LPR / 2; off > 0; off >>= 1)
#pragma unroll
        for (int s = 0; s < S; ++s)
#pragma unroll
            for (int j = 0; j < HG; ++j) sc[s][j] += __shfl_xor_sync(kFullMask, sc[s][j], off);
#pragma unroll
    for (int s = 0; s < S; ++s) {
        const bool valid = rows[s] < src.len;
        const float factor = KV == OG_KV_INT8 ? t.k_scale[s] * inv_sqrt_hd : inv_sqrt_hd;
#pragma unroll
        for (int j = 0; j < HG; ++j) sc[s][j] = valid ? sc[s][j] * factor : -INFINITY;
    }

    // ---- online softmax: the tile's max over the warp, rescale when the max grows --------
#pragma unroll
    for (int j = 0; j < HG; ++j) {
        float tile_max = sc[0][j];
#pragma unroll
        for (int s = 1; s < S; ++s) tile_max = fmaxf(tile_max, sc[s][j]);
#pragma unroll
        for (int off = LPR; off < kWarpSize; off <<= 1)
            tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, off));
        const float m_new = fmaxf(st.m[j], tile_max);
        if (m_new != st.m[j]) {  // warp-uniform
            const float f = expf(st.m[j] - m_new);
            st.l[j] *= f;
#pragma unroll
            for (int e = 0; e < L::kLaneElems; ++e) st.o[j][e] *= f;
            st.m[j] = m_new;
        }
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const float p = expf(sc[s][j] - m_new);
            st.l[j] += p;
            sc[s][j] = KV == OG_KV_INT8 ? p * t.v_scale[s] : p;  // weight of the row's V
        }
    }

    // ---- o += w * V -----------------------------------------------------------------------
    if constexpr (L::kVector) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
#pragma unroll
            for (int g = 0; g < L::kVec / 4; ++g) {
#pragma unroll
                for (int s = 0; s < S; ++s) {
                    const float4 v4 = decode4<KV>(t.v[s][v], g);
                    const int e = v * L::kVec + 4 * g;
#pragma unroll
                    for (int j = 0; j < HG; ++j) {
                        st.o[j][e] = fmaf(sc[s][j], v4.x, st.o[j][e]);
                        st.o[j][e + 1] = fmaf(sc[s][j], v4.y, st.o[j][e + 1]);
                        st.o[j][e + 2] = fmaf(sc[s][j], v4.z, st.o[j][e + 2]);
                        st.o[j][e + 3] = fmaf(sc[s][j], v4.w, st.o[j][e + 3]);
                    }
                }
            }
        }
    } else {
#pragma unroll
        for (int v = 0; v < V; ++v)
#pragma unroll
            for (int s = 0; s < S; ++s) {
                const float x = decode1<KV>(t.v[s][v]);
#pragma unroll
                for (int j = 0; j < HG; ++j) st.o[j][v] = fmaf(sc[s][j], x, st.o[j][v]);
            }
    }
}

// ---- the fold on the tensor cores: int8 K/V, head dim 128, a group of 2, 4 or 8 query heads --
// One warp tile (16 rows) folds with mma.sync m16n8k16 (fp16 operands, fp32 accumulators) in
// place of the CUDA-core fold above, whose instructions, not the loads, bound it at long
// context (1,816 instructions a 16-row tile for 4 heads: scripts/sass_loops.py). Lane = 4 g + t.
//   Scores S [16 x 8 rows] = Q [16 x 128] . K^T, per n-tile nt of 8 rows, 8 k-steps kk of 16
//   dims. A's row j < 4 is head j's q times 2^s_j (max |q| of the head in [2^13, 2^14)) rounded
//   to fp16 (hi), row 8 + j the fp16 remainder (lo); other rows zero. B's column g is K row
//   8 nt + g, whose codes are exact in fp16 (quant.cuh word_pairs). The k-indices of a step
//   stand for dims in an order chosen so that lane t's K bytes of a row are two 16-byte runs,
//   16 t and 64 + 16 t (one load instruction covers 64 whole bytes of 8 rows): in k-step kk,
//   word w = kk % 4 of run kk / 4 holds dims D .. D + 3 (D = 64 (kk / 4) + 16 t + 4 w), and
//   k-indices 2t, 2t + 1, 2t + 8, 2t + 9 are dims D, D + 2, D + 1, D + 3 (word_pairs' order).
//   Accumulator rows g and 8 + g, columns 2t + e: head g's score of row 8 nt + 2t + e is
//   (hi + lo) 2^-s_g, times k_scale / sqrt(hd) as on the CUDA cores.
//   Weighted V: O [16 x 8 dims] += P [16 x 16 rows] . V per n-tile j of 8 dims. P's row g is
//   head g's weight p v_scale times 2^w (hi), row 8 + g its remainder (lo); its k-indices are
//   the tile's rows in the scores' accumulator order, so the score fragments become P's A
//   fragments in place. B's column n of n-tile j is dim 16 n + j: lane (g, t) holds V rows 2t,
//   2t + 1, 8 + 2t, 9 + 2t, bytes 16 g .. 16 g + 15 (one 16-byte load each), and pairs two
//   rows' codes of a dim with one byte permute. 2^w follows head g's largest weight (every
//   weight so far below 2^(w_exp), times the softmax's rescale since, scaled below 2^14); when
//   it moves, o is rescaled by the exact power of two, as the running max rescales it. o = (hi
//   + lo) 2^-w at the end.
// Every scale is a power of two and hi + lo carries 22 bits of each fp32 operand, so the fold
// matches the CUDA cores' error bound, except that a weight below about 2^-38 of its head's
// largest falls below fp16's range and counts as zero (an error that small next to the head's
// output). Both the decode and the verify body use it, so their results stay bit-identical.
// A group of 2 or 4 leaves the A rows of heads 2..7 or 4..7 (and their remainders) zero; a
// group of 8 fills all 16, at the same instructions a tile. The plan takes it where a KV head's
// query heads are exactly one group and the long band asks for it (attention_plan).
template <int KV, int HD, int HG>
constexpr bool kMmaFold = KV == OG_KV_INT8 && HD == 128 && (HG == 2 || HG == 4 || HG == 8);
constexpr int kMmaLocRows = 6;  // a lane's rows of a tile: K 8 nt + g (nt = 0, 1), V the four of mma_row

struct MmaTile {
    uint4 k[2][2];                 // K rows g, 8 + g: bytes 16 t .. and 64 + 16 t ..
    uint4 v[4];                    // V rows 2t, 2t + 1, 8 + 2t, 9 + 2t: bytes 16 g ..
    float k_scale[4], v_scale[4];  // of the V rows: the rows of this lane's scores
};
struct MmaLoc {
    int row0;                      // the tile's first row, -1: none
    int block[kMmaLocRows], in_page[kMmaLocRows];  // as TileLoc, per row of mma_row
};
struct MmaState {
    float m, l;                    // head g's running max and (this lane's) sum
    float o[16][4];                // n-tile j: (head g hi, dims 16 (2t + e) + j), (lo, same)
    int w_exp;                     // head g's weights so far are below 2^w_exp; o holds them
                                   // times 2^(14 - w_exp)
};

// Row i of a lane's tile rows (offset from row0): K rows 0, 1, then V rows 2..5.
__device__ __forceinline__ int mma_row(int i, int lane) {
    const int g = lane / 4, t = lane % 4;
    return i < 2 ? 8 * i + g : 8 * ((i - 2) / 2) + 2 * t + (i - 2) % 2;
}
// The largest v of the four lanes 4 g .. 4 g + 3 (one head's, or one tile row set's).
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 1));
    return fmaxf(v, __shfl_xor_sync(kFullMask, v, 2));
}
// 2^e as a float, e in [-126, 127].
__device__ __forceinline__ float pow2(int e) { return __int_as_float((e + 127) << 23); }
// The exponent e with x < 2^e (x > 0 finite), clamped to [kMinExp, kMaxExp] so that 2^(14 - e)
// and 2^(e - 14) stay normal floats.
constexpr int kMinExp = -100, kMaxExp = 120;
__device__ __forceinline__ int bound_exponent(float x) {
    int e;
    frexpf(x, &e);
    return max(kMinExp, min(e, kMaxExp));
}
// v split into fp16 hi and the fp16 remainder lo, packed in pairs (a, b).
__device__ __forceinline__ void split_pair(float a, float b, uint32_t &hi, uint32_t &lo) {
    const __half2 h = __floats2half2_rn(a, b);
    hi = half2_as_u32(h);
    lo = half2_as_u32(__floats2half2_rn(a - __low2float(h), b - __high2float(h)));
}
// Locate a lane's rows of the tile at row0 (-1: none), as locate_tile does for its layout.
template <bool ROWS>
__device__ __forceinline__ void locate_mma(MmaLoc &loc, int row0, const RowSource &src, int lane) {
    loc.row0 = row0;
    int page0 = 0, in0 = 0;
    if (row0 >= 0) {
        page0 = page_of(row0, src);
        in0 = row0 - page0 * src.page;
    }
    if (src.page % 16 == 0) {  // a tile (row0 a multiple of 16) lies in one page: one table read
        const int block = row0 >= 0 ? table_block(src, page0) : -1;
#pragma unroll
        for (int i = 0; i < kMmaLocRows; ++i) {
            const int row = row0 + mma_row(i, lane);
            loc.block[i] = row < src.len && !is_new_row<ROWS>(row, src) ? block : -1;
            loc.in_page[i] = in0 + mma_row(i, lane);
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < kMmaLocRows; ++i) {
        const int row = row0 + mma_row(i, lane);
        int page_index = page0, in_page = in0 + mma_row(i, lane);
        while (in_page >= src.page) {  // at most 15 / page steps
            in_page -= src.page;
            ++page_index;
        }
        const bool read = row0 >= 0 && row < src.len && !is_new_row<ROWS>(row, src);
        loc.block[i] = read ? table_block(src, page_index) : -1;
        loc.in_page[i] = in_page;
    }
}

// Issue the loads of a located tile; rows without a block read as zeros (scale 0).
__device__ __forceinline__ void load_mma(MmaTile &t, const MmaLoc &loc, const RowSource &src, int lane) {
    const int g = lane / 4, tq = lane % 4;
    constexpr int kRowBytes = 128, kRowVecs = kRowBytes / 16;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    if (src.page % 16 == 0) {
        // The tile lies in one page (locate_mma: in_page[i] = its first row's + mma_row(i, lane)
        // and every row's block that page's, or -1): one address a lane for K, V and each scale
        // page, the lane's rows at fixed offsets from it (K rows g, 8 + g; V rows 2t, 2t + 1,
        // 8 + 2t, 9 + 2t).
        const int64_t base = one_page_base(loc.block, src);
        const int64_t first = (int64_t)src.kv_head * src.page + (loc.in_page[0] - g);
        const uint4 *k = reinterpret_cast<const uint4 *>(src.k + base + first * kRowBytes) + g * kRowVecs + tq;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const bool ok = loc.block[i] >= 0;
            t.k[i][0] = ok ? load_row_chunk(k + 8 * i * kRowVecs) : zero;
            t.k[i][1] = ok ? load_row_chunk(k + 8 * i * kRowVecs + 4) : zero;
        }
        const uint4 *v = reinterpret_cast<const uint4 *>(src.v + base + first * kRowBytes) + 2 * tq * kRowVecs + g;
        const float *k_scales = reinterpret_cast<const float *>(src.k_scales + base) + first + 2 * tq;
        const float *v_scales = reinterpret_cast<const float *>(src.v_scales + base) + first + 2 * tq;
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // V row 8 (j / 2) + 2t + j % 2
            const bool ok = loc.block[2 + j] >= 0;
            const int r = 8 * (j / 2) + j % 2;
            t.v[j] = ok ? load_row_chunk(v + r * kRowVecs) : zero;
            t.k_scale[j] = ok ? __ldg(k_scales + r) : 0.f;
            t.v_scale[j] = ok ? __ldg(v_scales + r) : 0.f;
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < kMmaLocRows; ++i) {
        const bool ok = loc.block[i] >= 0;
        const int64_t base = (int64_t)(ok ? loc.block[i] : 0) * src.block_stride;
        const int64_t row_index = (int64_t)src.kv_head * src.page + loc.in_page[i];
        if (i < 2) {
            const uint4 *k_row = reinterpret_cast<const uint4 *>(src.k + base + row_index * kRowBytes);
            t.k[i][0] = ok ? load_row_chunk(k_row + tq) : zero;
            t.k[i][1] = ok ? load_row_chunk(k_row + 4 + tq) : zero;
        } else {
            const uint4 *v_row = reinterpret_cast<const uint4 *>(src.v + base + row_index * kRowBytes);
            t.v[i - 2] = ok ? load_row_chunk(v_row + g) : zero;
            t.k_scale[i - 2] = ok ? __ldg(reinterpret_cast<const float *>(src.k_scales + base) + row_index) : 0.f;
            t.v_scale[i - 2] = ok ? __ldg(reinterpret_cast<const float *>(src.v_scales + base) + row_index) : 0.f;
        }
    }
}

// Q's A fragments from q_s [HG, 128] (head j's row of shared memory) and head g's 2^-s.
template <int HG>
__device__ __forceinline__ void mma_query(const float *q_s, int lane, uint32_t (&qa)[8][4], float &q_inv) {
    const int g = lane / 4, tq = lane % 4;
    const float *q = q_s + (g < HG ? g : 0) * 128;
    float amax = 0.f;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) amax = fmaxf(amax, fabsf(q[64 * (kk / 4) + 16 * tq + 4 * (kk % 4) + e]));
    amax = quad_max(amax);
    const int s = amax > 0.f ? bound_exponent(amax) : 0;
    const float q_mul = g < HG ? pow2(14 - s) : 0.f;
    q_inv = pow2(s - 14);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        const float *d = q + 64 * (kk / 4) + 16 * tq + 4 * (kk % 4);
        split_pair(d[0] * q_mul, d[2] * q_mul, qa[kk][0], qa[kk][1]);  // k-indices 2t, 2t + 1
        split_pair(d[1] * q_mul, d[3] * q_mul, qa[kk][2], qa[kk][3]);  // 2t + 8, 2t + 9
    }
}

__device__ __forceinline__ void mma_state_init(MmaState &st) {
    st.m = -INFINITY;
    st.l = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) st.o[j][0] = st.o[j][1] = st.o[j][2] = st.o[j][3] = 0.f;
    st.w_exp = kMinExp;
}

// Fold one tile into the warp's state (heads g < HG of lanes 4g .. 4g + 3).
template <int HG, bool ROWS>
__device__ __forceinline__ void attend_mma(MmaTile &t, int row0, const RowSource &src,
                                           const uint32_t (&qa)[8][4], float q_inv,
                                           const void *new_k_s, const void *new_v_s,
                                           const float *new_scales, float inv_sqrt_hd, int lane,
                                           MmaState &st) {
    const int g = lane / 4, tq = lane % 4;
    // The new rows (fused, the blocks whose chunks hold them): from shared memory, as stored.
    if (src.new_lo <= src.new_hi) {
#pragma unroll
        for (int i = 0; i < kMmaLocRows; ++i) {
            const int row = row0 + mma_row(i, lane);
            if (!is_new_row<ROWS>(row, src)) continue;
            const int r = ROWS ? row - src.new_lo : 0;
            if (i < 2) {
                const uint4 *k_s =
                    reinterpret_cast<const uint4 *>(static_cast<const float *>(new_k_s) + r * src.row_floats);
                t.k[i][0] = k_s[tq];
                t.k[i][1] = k_s[4 + tq];
            } else {
                const uint4 *v_s =
                    reinterpret_cast<const uint4 *>(static_cast<const float *>(new_v_s) + r * src.row_floats);
                t.v[i - 2] = v_s[g];
                t.k_scale[i - 2] = new_scales[2 * r];
                t.v_scale[i - 2] = new_scales[2 * r + 1];
            }
        }
    }

    // ---- scores of rows 8 nt + 2t + e for head g -----------------------------------------
    float c[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
        c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            __half2 h[2];
            word_pairs(word_of(t.k[nt][kk / 4], kk % 4), h);
            mma_16816(c[nt], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], half2_as_u32(h[0]), half2_as_u32(h[1]));
        }
    }
    float sc[4];
    float tile_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int row = row0 + 8 * (i / 2) + 2 * tq + i % 2;
        const float dot = (c[i / 2][i % 2] + c[i / 2][2 + i % 2]) * q_inv;
        sc[i] = row < src.len ? dot * (t.k_scale[i] * inv_sqrt_hd) : -INFINITY;
        tile_max = fmaxf(tile_max, sc[i]);
    }
    tile_max = quad_max(tile_max);

    // ---- online softmax and head g's weight scale: rescale o when either moves --------------
    // The weights' scale follows head g's own largest weight p v_scale, so that it stays within
    // fp16's normal range whatever the other heads' and rows' scales: 2^w_exp bounds every
    // weight folded so far (times the softmax's rescale factor f since) and this tile's.
    float f = 1.f;
    int bound = st.w_exp;
    const float m_new = fmaxf(st.m, tile_max);
    if (m_new != st.m) {  // uniform over head g's four lanes
        f = expf(st.m - m_new);
        st.l *= f;
        st.m = m_new;
        bound = f > 0.f ? min(kMaxExp, max(kMinExp, st.w_exp + bound_exponent(f))) : kMinExp;
    }
    float w[4], w_max = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float p = g < HG && sc[i] != -INFINITY ? expf(sc[i] - st.m) : 0.f;
        st.l += p;
        w[i] = p * t.v_scale[i];
        w_max = fmaxf(w_max, w[i]);
    }
    w_max = quad_max(w_max);
    const int w_exp = max(bound, w_max > 0.f ? bound_exponent(w_max) : kMinExp);
    if (w_exp != st.w_exp) {  // o to the new scale: a power of two (<= 1 with f), exact
        f = ldexpf(f, st.w_exp - w_exp);
        st.w_exp = w_exp;
    }
    if (f != 1.f) {
#pragma unroll
        for (int j = 0; j < 16; ++j) st.o[j][0] *= f, st.o[j][1] *= f, st.o[j][2] *= f, st.o[j][3] *= f;
    }
    const float w_mul = pow2(14 - w_exp);
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] *= w_mul;
    uint32_t pa[4];
    split_pair(w[0], w[1], pa[0], pa[1]);  // rows 2t, 2t + 1: hi (A row g), lo (row 8 + g)
    split_pair(w[2], w[3], pa[2], pa[3]);  // rows 8 + 2t, 9 + 2t

    // ---- o += P . V: n-tiles j, j + 1 from one byte permute of two rows' words --------------
#pragma unroll
    for (int word = 0; word < 4; ++word) {
        const uint32_t r0 = word_of(t.v[0], word), r1 = word_of(t.v[1], word);
        const uint32_t r2 = word_of(t.v[2], word), r3 = word_of(t.v[3], word);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            // Bytes b, b + 1 of the word (dims 16 g + 4 word + b, + 1) of rows a, a': (a b,
            // a b+1, a' b, a' b+1), which word_pairs turns into (a, a') of each dim.
            const uint32_t sel = half == 0 ? 0x5410u : 0x7632u;
            __half2 lo_rows[2], hi_rows[2];
            word_pairs(__byte_perm(r0, r1, sel), lo_rows);
            word_pairs(__byte_perm(r2, r3, sel), hi_rows);
            const int j = 4 * word + 2 * half;
            mma_16816(st.o[j], pa[0], pa[1], pa[2], pa[3], half2_as_u32(lo_rows[0]), half2_as_u32(hi_rows[0]));
            mma_16816(st.o[j + 1], pa[0], pa[1], pa[2], pa[3], half2_as_u32(lo_rows[1]), half2_as_u32(hi_rows[1]));
        }
    }
}

// The CUDA-core fold's warp state into shared memory: its row groups summed, then o [warps,
// HG, hd], m and l [warps, HG] of this warp.
template <int KV, int HD, int SL, int HG>
__device__ __forceinline__ void warp_state_out(WarpState<HG, AttnLayout<KV, HD, SL>::kLaneElems> &st,
                                               float *o_s, float *m_s, float *l_s, int hd,
                                               int warp, int lane) {
    using L = AttnLayout<KV, HD, SL>;
    constexpr int LPR = L::kLanesPerRow, E = L::kLaneElems;
#pragma unroll
    for (int j = 0; j < HG; ++j) {
#pragma unroll
        for (int off = LPR; off < kWarpSize; off <<= 1) {
            st.l[j] += __shfl_xor_sync(kFullMask, st.l[j], off);
#pragma unroll
            for (int e = 0; e < E; ++e) st.o[j][e] += __shfl_xor_sync(kFullMask, st.o[j][e], off);
        }
    }
    if (lane < LPR) {
#pragma unroll
        for (int j = 0; j < HG; ++j) {
            float *o_w = o_s + (warp * HG + j) * hd;
#pragma unroll
            for (int v = 0; v < L::kVecsPerLane; ++v) {
                if constexpr (L::kVector) {
                    const int e0 = (lane + v * LPR) * L::kVec;
#pragma unroll
                    for (int i = 0; i < L::kVec; i += 4)
                        *reinterpret_cast<float4 *>(o_w + e0 + i) =
                            make_float4(st.o[j][v * L::kVec + i], st.o[j][v * L::kVec + i + 1],
                                        st.o[j][v * L::kVec + i + 2], st.o[j][v * L::kVec + i + 3]);
                } else {
                    const int d = lane + v * kWarpSize;
                    if (d < hd) o_w[d] = st.o[j][v];
                }
            }
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < HG; ++j) {
            m_s[warp * HG + j] = st.m[j];
            l_s[warp * HG + j] = st.l[j];
        }
    }
}

// The warp's next tile after item n (n advances): its first row, or -1 when the warp is done.
// Item n = (k, i) with k = n / per_warp, i = n % per_warp: chunk b + k * B, tile warp + i * 8.
// The engine's chunks give each warp one tile (per_warp 1): no division then.
__device__ __forceinline__ int next_tile(int &n, int b, int n_blocks, int chunk_rows,
                                         int tile_rows, int per_warp, int warp, int n_chunks,
                                         int len) {
    for (;;) {
        ++n;
        const int k = per_warp == 1 ? n : n / per_warp;
        const int chunk = b + k * n_blocks;
        if (chunk >= n_chunks) return -1;
        const int tile = warp + (n - k * per_warp) * kAttnWarps;
        if (tile * tile_rows >= chunk_rows) continue;  // the chunk has fewer tiles than warps
        const int row0 = chunk * chunk_rows + tile * tile_rows;
        return row0 < len ? row0 : -1;  // past len: the last chunk, nothing follows
    }
}

// ---- OG_Q4_TRACE: per-block timestamps (build.py --trace; scripts/q4_trace.py) -------------
// The diagnostic build also has every working block of the attention kernel record
// %globaltimer when it starts, when the PDL wait returns, when its query heads are ready, when
// thread 0's first tile (loaded before the wait) had arrived (the CUDA-core fold; the
// tensor-core fold records its query heads' time there), when its rows are folded in and when
// it is done. The normal build has none of it.
#ifdef OG_Q4_TRACE
struct AttnTraceRecord {
    unsigned long long layer, t_start, t_wait, t_prologue, t_kv, t_rows, t_end;  // layer: its K pages
    long long c_wait, c_prologue, c_kv, c_rows, c_end;  // thread 0's SM clock at the same points
    int block_x, block_y, sm, n_active;
};
constexpr unsigned kAttnTraceRecords = 1u << 14;
__device__ AttnTraceRecord g_attn_trace[kAttnTraceRecords];
__device__ unsigned g_attn_trace_count;
#define ATTN_TRACE(var) const unsigned long long var = trace_now(); const long long c_##var = clock64()
__device__ __forceinline__ unsigned trace_word(const uint4 &v) { return v.x; }
__device__ __forceinline__ unsigned trace_word(uint32_t v) { return v; }
template <bool TC, class TileT>
__device__ __forceinline__ unsigned long long trace_tile_arrived(const TileT &t) {
    if constexpr (TC) return trace_now();
    else return trace_now_after(trace_word(t.k[0][0]));
}
#define ATTN_TRACE_TILE(var, tc, tile) \
    const unsigned long long var = trace_tile_arrived<tc>(tile); const long long c_##var = clock64()
#define ATTN_TRACE_END()                                                                              \
    if (tid == 0) {                                                                                   \
        const unsigned slot = atomicAdd(&g_attn_trace_count, 1u) % kAttnTraceRecords;                \
        g_attn_trace[slot] = AttnTraceRecord{(unsigned long long)a.kv.k, trace_start, trace_wait,     \
                                             trace_prologue, trace_kv, trace_rows, trace_now(),       \
                                             c_trace_wait, c_trace_prologue, c_trace_kv, c_trace_rows, \
                                             clock64(), (int)blockIdx.x, (int)blockIdx.y, trace_sm(), \
                                             n_active};                                               \
    }
#else
#define ATTN_TRACE(var) (void)0
#define ATTN_TRACE_TILE(var, tc, tile) (void)0
#define ATTN_TRACE_END() (void)0
#endif

// ROWS: the verify body's launch of several rows (grid z); the decode body's one-row instance
// is a function of its own, with the one-row shared-memory limit and none of the row loops.
// TC: the tensor-core fold (kMmaFold shapes only; SL kLongSlots). SL: AttnLayout's rows a lane a
// tile.
template <int KV, int HD, int SL, int HG, bool ROWS, bool TC = false>
__global__ void __launch_bounds__(kAttnThreads, 1) attention_kernel(const AttnParams p) {
    static_assert(!TC || kMmaFold<KV, HD, HG>, "the tensor-core fold: int8 rows of 128 dims, 2, 4 or 8 heads");
    using L = AttnLayout<KV, HD, SL>;
    constexpr int E = L::kLaneElems;
    extern __shared__ float4 smem4[];
    float *smem = reinterpret_cast<float *>(smem4);
    __shared__ int is_last_block;
    const AttentionArgs &a = p.a;
    const int hd = HD > 0 ? HD : a.head_dim;
    const int group = a.n_heads / a.n_kv_heads;
    const int tid = threadIdx.x;
    const int warp = tid / kWarpSize;
    const int lane = tid % kWarpSize;
    // Block (kv_head * head_groups + hg, b): query heads head0 .. head0 + heads_here - 1 of
    // KV head kv_head, chunks b, b + B, ...
    const int kv_head = blockIdx.x / p.head_groups;
    const int hg = blockIdx.x - kv_head * p.head_groups;
    const int b = blockIdx.y;
    const int head0 = kv_head * group + hg * HG;
    const int heads_here = min(HG, group - hg * HG);
    const int C = p.chunk, B = p.n_blocks;
    ATTN_TRACE(trace_start);

    // Row z of the launch (blockIdx.z < n_rows): its step record, input, output and scratch.
    const int z = ROWS ? (int)blockIdx.z : 0;
    const og_step_record *step = a.step + z;
    const float *qkv = a.qkv != nullptr ? a.qkv + z * a.qkv_stride : nullptr;
    float *out = a.out + z * a.out_stride;
    float *partials = a.partials + (size_t)z * a.n_heads * B * (hd + 2);
    unsigned *counters = a.counters + (size_t)z * gridDim.x;

    // The step records are written before the body's first kernel, and the rows below the
    // launch's first position by earlier steps: both may be read before waiting on the
    // previous kernel.
    const int position = step->position;
    const int len = max(1, min(position + 1, a.max_seq_len));
    const int n_chunks = ceil_div(len, C);
    if (b >= n_chunks) return;
    const int n_active = min(B, n_chunks);
    const bool fused = qkv != nullptr;
    const bool row_ok = position >= 0 && position < a.max_seq_len;
    // The new rows this row attends to without reading the cache: the launch's rows 0..z, at
    // positions new_lo..position. The owner of the chunk holding a new row rotates and encodes
    // it into its shared memory (every head group's owner: each reads the row from there); only
    // head group 0's owner of row z's own position stores it into the cache.
    const int new_lo = fused && row_ok ? (ROWS ? max(0, a.step[0].position) : position) : 0;
    const int new_hi = fused && row_ok ? position : -1;
    const bool owner = fused && ((len - 1) / C) % B == b;
    int held = 0;  // new rows in this block's chunks: a K task and a V task each (prologue)
    for (int r = new_lo; r <= new_hi; ++r) held += (r / C) % B == b;
    const KvPages &kv = a.kv;

    RowSource src;
    src.k = kv.k;
    src.v = kv.v;
    src.k_scales = kv.k_scales;
    src.v_scales = kv.v_scales;
    src.block_stride = kv.block_stride;
    src.table = kv.block_tables + (size_t)step->seq_slot * kv.max_blocks_per_seq;
    src.page = kv.page_size;
    src.page_shift = (kv.page_size & (kv.page_size - 1)) == 0 ? __ffs(kv.page_size) - 1 : -1;
    src.n_pool_blocks = kv.n_blocks;
    src.kv_head = kv_head;
    src.len = len;
    src.new_lo = new_lo;
    src.new_hi = new_hi;
    src.row_group = lane / L::kLanesPerRow;
    src.lane_in_row = lane % L::kLanesPerRow;

    // The warp's tiles i, i+1, i+2: tile i loaded (cur, row0), i+1 and i+2 located (loc1, loc2).
    const int tiles_per_warp = ceil_div(C / L::kTileRows, kAttnWarps);
    auto next_row = [&](int &cursor) {
        return next_tile(cursor, b, B, C, L::kTileRows, tiles_per_warp, warp, n_chunks, len);
    };
    // The tensor-core fold (kMmaFold) has a layout of its own: which rows and bytes a lane holds.
    using Loc = std::conditional_t<TC, MmaLoc, TileLoc<KV, HD, SL>>;
    using TileT = std::conditional_t<TC, MmaTile, Tile<KV, HD, SL>>;
    auto locate = [&](Loc &loc, int r) {
        if constexpr (TC) locate_mma<ROWS>(loc, r, src, lane);
        else locate_tile<KV, HD, SL, ROWS>(loc, r, src);
    };
    auto load = [&](TileT &t, const Loc &loc) {
        if constexpr (TC) load_mma(t, loc, src, lane);
        else load_tile<KV, HD, SL>(t, loc, src, hd);
    };
    int cursor = -1;
    int row0 = next_row(cursor);
    Loc loc1, loc2;
    locate(loc1, row0);
    TileT cur;
    load(cur, loc1);
    locate(loc1, next_row(cursor));
    locate(loc2, next_row(cursor));

    // The prologue's inputs that do not depend on the previous kernel: norm weights and the
    // rotation angles at `position`.
    RopeAngles angles;
    float q_w[kHeadSlots], k_w[kHeadSlots];
    if (fused) {
        rope_angles(a.inv_freq, hd, position, lane, angles);
        norm_weights(a.q_norm, hd, lane, q_w);
        norm_weights(held > 0 ? a.k_norm : nullptr, hd, lane, k_w);
    }

    pdl_wait();
    ATTN_TRACE(trace_wait);
    pdl_launch_dependents();

    const AttnSmem lay = attn_smem(HG, hd, B, L::kElemBytes, ROWS ? a.n_rows : 1);
    src.row_floats = lay.row_floats;
    float *q_s = smem + lay.q;
    float *new_scales = smem + lay.scales;
    void *new_k_s = smem + lay.new_k;
    void *new_v_s = smem + lay.new_v;

    // ---- the block's query heads (and the new K/V rows its chunks hold) --------------------
    if (!fused) {
        for (int i = tid; i < HG * hd; i += kAttnThreads)
            q_s[i] = i < heads_here * hd ? a.q[(size_t)head0 * hd + i] : 0.f;
    } else {
        for (int i = heads_here * hd + tid; i < HG * hd; i += kAttnThreads) q_s[i] = 0.f;
        const int q_size = a.n_heads * hd, kv_size = a.n_kv_heads * hd;
        const int row_block = step->row_block;
        const bool store = hg == 0 && row_ok && (unsigned)row_block < (unsigned)kv.n_blocks;
        const int page_index = row_ok ? position / kv.page_size : 0;
        const int64_t base = (int64_t)row_block * kv.block_stride;
        const int64_t row_index = (int64_t)kv_head * kv.page_size + (position - page_index * kv.page_size);
        const int64_t row_bytes = (int64_t)hd * L::kElemBytes;
        const int tasks = heads_here + 2 * held;
        for (int task = warp; task < tasks; task += kAttnWarps) {
            if (task < heads_here) {
                float *head = q_s + task * hd;
                warp_norm_rope(qkv + (size_t)(head0 + task) * hd, a.q_norm != nullptr, q_w,
                               a.eps, angles, hd, head, lane);
                if (owner && a.q_out != nullptr)
                    for (int i = lane; i < hd; i += kWarpSize)
                        a.q_out[(size_t)(head0 + task) * hd + i] = head[i];
                continue;
            }
            // Task heads_here + 2i (+1): the K (V) row of the i-th held new row r, launch row
            // r - new_lo; only row z's own (r == position) is stored.
            const int i = (task - heads_here) / 2;
            int r = new_lo;
            if constexpr (ROWS) {
                for (int seen = -1;; ++r) {
                    seen += (r / C) % B == b;
                    if (seen == i) break;
                }
            }
            const int slot = r - new_lo;
            const float *row_qkv = qkv + (slot - z) * a.qkv_stride;
            const bool store_row = store && r == position;
            float *row_k_s = static_cast<float *>(new_k_s) + slot * lay.row_floats;
            float *row_v_s = static_cast<float *>(new_v_s) + slot * lay.row_floats;
            if ((task - heads_here) % 2 == 0) {
                RopeAngles row_angles = angles;
                if (ROWS && r != position) rope_angles(a.inv_freq, hd, r, lane, row_angles);
                float *k_head = smem + lay.k_head + slot * round4(hd);
                warp_norm_rope(row_qkv + q_size + (size_t)kv_head * hd, a.k_norm != nullptr, k_w,
                               a.eps, row_angles, hd, k_head, lane);
                warp_encode_row<KV>(k_head, hd, row_k_s, new_scales + 2 * slot,
                                    store_row ? kv.k + base + row_index * row_bytes : nullptr,
                                    store_row && KV == OG_KV_INT8
                                        ? reinterpret_cast<float *>(kv.k_scales + base) + row_index
                                        : nullptr,
                                    lane);
            } else {
                warp_encode_row<KV>(row_qkv + q_size + kv_size + (size_t)kv_head * hd, hd, row_v_s,
                                    new_scales + 2 * slot + 1,
                                    store_row ? kv.v + base + row_index * row_bytes : nullptr,
                                    store_row && KV == OG_KV_INT8
                                        ? reinterpret_cast<float *>(kv.v_scales + base) + row_index
                                        : nullptr,
                                    lane);
            }
        }
        if (owner && store && kv_head == 0 && tid == 0 && a.table_update != nullptr)
            a.table_update[(size_t)step->seq_slot * kv.max_blocks_per_seq + page_index] = row_block;
    }
    __syncthreads();
    ATTN_TRACE(trace_prologue);
    ATTN_TRACE_TILE(trace_kv, TC, cur);

    float *o_s = smem + lay.o;       // [warps, HG, hd]
    float *m_s = smem + lay.m;       // [warps, HG]
    float *l_s = smem + lay.l;
    float *sums = smem + lay.sums;   // [HG]: the last block's sum over the partials
    float *partial_o = partials;                                            // [n_heads, B, hd]
    float *partial_m = partials + (size_t)a.n_heads * B * hd;               // [n_heads, B]
    float *partial_l = partial_m + (size_t)a.n_heads * B;                   // [n_heads, B]

    std::conditional_t<TC, MmaState, WarpState<HG, E>> st;
    uint32_t qa[8][4];  // the tensor-core fold's query fragments and 2^-s (mma_query)
    float q_inv = 1.f;
    if constexpr (TC) {
        mma_state_init(st);
        mma_query<HG>(q_s, lane, qa, q_inv);
    } else {
#pragma unroll
        for (int j = 0; j < HG; ++j) {
            st.m[j] = -INFINITY;
            st.l[j] = 0.f;
#pragma unroll
            for (int e = 0; e < E; ++e) st.o[j][e] = 0.f;
        }
    }
    while (row0 >= 0) {
        // While tile i is folded in: the loads of tile i+1 (located two steps ago) and the
        // block-table reads of tile i+3 are in flight.
        TileT nxt;
        load(nxt, loc1);
        const int row1 = loc1.row0;
        loc1 = loc2;
        locate(loc2, next_row(cursor));
        if constexpr (TC)
            attend_mma<HG, ROWS>(cur, row0, src, qa, q_inv, new_k_s, new_v_s, new_scales,
                                 p.inv_sqrt_hd, lane, st);
        else
            attend_tile<KV, HD, SL, HG, ROWS>(cur, row0, src, q_s, new_k_s, new_v_s, new_scales,
                                              hd, p.inv_sqrt_hd, lane, st);
        cur = nxt;
        row0 = row1;
    }

    ATTN_TRACE(trace_rows);
    // ---- the warp's state over its row groups, then the block's warps in order --------
    if constexpr (TC) {
        // Head g's sum over its four lanes; o (hi + lo) 2^-w of dims 16 (2t + e) + j.
        const int g = lane / 4, tq = lane % 4;
        st.l += __shfl_xor_sync(kFullMask, st.l, 1);
        st.l += __shfl_xor_sync(kFullMask, st.l, 2);
        if (g < HG) {
            const float w_inv = pow2(st.w_exp - 14);
            float *o_w = o_s + (warp * HG + g) * hd;
#pragma unroll
            for (int j = 0; j < 16; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) o_w[16 * (2 * tq + e) + j] = (st.o[j][e] + st.o[j][2 + e]) * w_inv;
            if (tq == 0) {
                m_s[warp * HG + g] = st.m;
                l_s[warp * HG + g] = st.l;
            }
        }
    } else {
        warp_state_out<KV, HD, SL, HG>(st, o_s, m_s, l_s, hd, warp, lane);
    }
    __syncthreads();
    // Each output element combines the warps itself (m, the factors and l recomputed per
    // element: the same values in the same order for every element of a head, with no further
    // barrier); a warp without rows has m = -inf and factor 0.
    for (int i = tid; i < heads_here * hd; i += kAttnThreads) {
        const int j = i / hd;
        const int d = i - j * hd;
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < kAttnWarps; ++w) m = fmaxf(m, m_s[w * HG + j]);
        float l = 0.f, o = 0.f;
#pragma unroll
        for (int w = 0; w < kAttnWarps; ++w) {
            const float f = expf(m_s[w * HG + j] - m);
            l = fmaf(l_s[w * HG + j], f, l);
            o = fmaf(f, o_s[(w * HG + j) * hd + d], o);
        }
        const size_t head = (size_t)head0 + j;
        if (n_active == 1) {
            out[head * hd + d] = o / l;
        } else {
            partial_o[(head * B + b) * hd + d] = o;
            if (d == 0) {
                partial_m[head * B + b] = m;
                partial_l[head * B + b] = l;
            }
        }
    }
    if (n_active == 1) {
        ATTN_TRACE_END();
        return;
    }

    // ---- publish the partial; the last block of this KV head combines -------------------
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        const unsigned previous = atomicAdd(&counters[blockIdx.x], 1u);
        is_last_block = previous + 1u == (unsigned)n_active;
    }
    __syncthreads();
    if (!is_last_block) {
        ATTN_TRACE_END();
        return;
    }
    __threadfence();

    // factors[j, s] = exp(m_s - M); sums[j] = L = sum_s l_s * factors[j, s]
    float *factors = smem + lay.factors;
    for (int j = warp; j < heads_here; j += kAttnWarps) {
        const size_t base = (size_t)(head0 + j) * B;
        float m = -INFINITY;
        for (int s = lane; s < n_active; s += kWarpSize) m = fmaxf(m, __ldcg(partial_m + base + s));
        m = warp_max(m);
        float l = 0.f;
        for (int s = lane; s < n_active; s += kWarpSize) {
            const float f = expf(__ldcg(partial_m + base + s) - m);
            factors[j * B + s] = f;
            l = fmaf(__ldcg(partial_l + base + s), f, l);
        }
        l = warp_sum(l);
        if (lane == 0) sums[j] = l;
    }
    __syncthreads();
    for (int i = tid; i < heads_here * hd; i += kAttnThreads) {
        const int j = i / hd;
        const int d = i - j * hd;
        const size_t head = (size_t)head0 + j;
        float o = 0.f;
        for (int s = 0; s < n_active; ++s)
            o = fmaf(factors[j * B + s], __ldcg(partial_o + (head * B + s) * hd + d), o);
        out[head * hd + d] = o / sums[j];
    }
    if (tid == 0) counters[blockIdx.x] = 0u;
    ATTN_TRACE_END();
}

using AttnKernel = void (*)(AttnParams);

// Head-group sizes compiled: 1, 2, 4 and 8 (up to what the registers allow) for head_dim 64 and
// 128 (where the real models are), the largest the registers allow for the other head dims.
template <int KV, int HD, int SL, bool ROWS>
AttnKernel cuda_core_kernel(int head_group) {
    constexpr int kMax = AttnLayout<KV, HD, SL>::kMaxHeadGroup;
    if constexpr (HD == 64 || HD == 128) {
        if (head_group == 1) return attention_kernel<KV, HD, SL, 1, ROWS>;
        if (head_group == 2) return attention_kernel<KV, HD, SL, 2, ROWS>;
        if (head_group == 4 && kMax >= 4) return attention_kernel<KV, HD, SL, (kMax >= 4 ? 4 : 2), ROWS>;
        if (head_group == 8 && kMax >= 8) return attention_kernel<KV, HD, SL, (kMax >= 8 ? 8 : 2), ROWS>;
        return nullptr;
    } else {
        return head_group == kMax ? attention_kernel<KV, HD, SL, kMax, ROWS> : nullptr;
    }
}

// short_tiles: the short band's tiles (kShortSlots), compiled for int8 rows of 64 dims only,
// where they were measured faster at every short-band context; bf16 rows, and int8 rows of 128
// dims, were slower or no faster with them (docs/performance.md).
template <int KV, int HD, bool ROWS>
AttnKernel kernel_for_group(int head_group, bool tensor_cores, bool short_tiles) {
    if constexpr (kMmaFold<KV, HD, 4>) {
        if (tensor_cores)
            return head_group == 2   ? attention_kernel<KV, HD, kLongSlots, 2, ROWS, true>
                   : head_group == 4 ? attention_kernel<KV, HD, kLongSlots, 4, ROWS, true>
                   : head_group == 8 ? attention_kernel<KV, HD, kLongSlots, 8, ROWS, true>
                                     : nullptr;
    }
    if (tensor_cores) return nullptr;
    if constexpr (KV == OG_KV_INT8 && HD == 64) {
        if (short_tiles) return cuda_core_kernel<KV, HD, kShortSlots, ROWS>(head_group);
    } else {
        if (short_tiles) return nullptr;
    }
    return cuda_core_kernel<KV, HD, kLongSlots, ROWS>(head_group);
}

template <int KV, bool ROWS>
AttnKernel kernel_for(int head_dim, int head_group, bool tc, bool short_tiles) {
    switch (head_dim) {
        case 64: return kernel_for_group<KV, 64, ROWS>(head_group, tc, short_tiles);
        case 128: return kernel_for_group<KV, 128, ROWS>(head_group, tc, short_tiles);
        case 256: return kernel_for_group<KV, 256, ROWS>(head_group, tc, short_tiles);
        default: return kernel_for_group<KV, 0, ROWS>(head_group, tc, short_tiles);
    }
}

// The kernel of a launch of one row (the decode body) or of several (the verify body); tc: the
// tensor-core fold, short_tiles: the short band's tiles (nullptr where it is not compiled).
AttnKernel kernel_for(int kv_dtype, int head_dim, int head_group, bool rows, bool tc = false,
                      bool short_tiles = false) {
    switch (kv_dtype) {
        case OG_KV_F32: return rows ? kernel_for<OG_KV_F32, true>(head_dim, head_group, tc, short_tiles)
                                    : kernel_for<OG_KV_F32, false>(head_dim, head_group, tc, short_tiles);
        case OG_KV_BF16: return rows ? kernel_for<OG_KV_BF16, true>(head_dim, head_group, tc, short_tiles)
                                     : kernel_for<OG_KV_BF16, false>(head_dim, head_group, tc, short_tiles);
        case OG_KV_INT8: return rows ? kernel_for<OG_KV_INT8, true>(head_dim, head_group, tc, short_tiles)
                                     : kernel_for<OG_KV_INT8, false>(head_dim, head_group, tc, short_tiles);
    }
    return nullptr;
}

template <int KV, int HD, int SL>
void layout_facts(int *tile_rows, int *max_group) {
    *tile_rows = AttnLayout<KV, HD, SL>::kTileRows;
    *max_group = AttnLayout<KV, HD, SL>::kMaxHeadGroup;
}
template <int KV, int SL>
void layout_facts(int head_dim, int *tile_rows, int *max_group) {
    switch (head_dim) {
        case 64: return layout_facts<KV, 64, SL>(tile_rows, max_group);
        case 128: return layout_facts<KV, 128, SL>(tile_rows, max_group);
        case 256: return layout_facts<KV, 256, SL>(tile_rows, max_group);
        default: return layout_facts<KV, 0, SL>(tile_rows, max_group);
    }
}
template <int SL>
bool layout_facts(int kv_dtype, int head_dim, int *tile_rows, int *max_group) {
    switch (kv_dtype) {
        case OG_KV_F32: layout_facts<OG_KV_F32, SL>(head_dim, tile_rows, max_group); return true;
        case OG_KV_BF16: layout_facts<OG_KV_BF16, SL>(head_dim, tile_rows, max_group); return true;
        case OG_KV_INT8: layout_facts<OG_KV_INT8, SL>(head_dim, tile_rows, max_group); return true;
    }
    return false;
}
bool layout_facts(int kv_dtype, int head_dim, bool short_tiles, int *tile_rows, int *max_group) {
    return short_tiles ? layout_facts<kShortSlots>(kv_dtype, head_dim, tile_rows, max_group)
                       : layout_facts<kLongSlots>(kv_dtype, head_dim, tile_rows, max_group);
}

int elem_bytes(int kv_dtype) { return kv_dtype == OG_KV_F32 ? 4 : kv_dtype == OG_KV_BF16 ? 2 : 1; }

}  // namespace

cudaError_t attention_plan(int n_heads, int n_kv_heads, int head_dim, int max_seq_len,
                           int kv_dtype, int split_len, AttentionBand band, AttentionPlan *plan) {
    if (plan == nullptr || n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 ||
        head_dim <= 0 || head_dim > kMaxHeadDim || head_dim % 2 != 0 || max_seq_len <= 0 ||
        split_len < 0 || band < kBandShort || band > kBandLongCudaCores)
        return cudaErrorInvalidValue;
    // The short band folds with its own tiles where they are compiled (int8 rows of 64 dims).
    const bool short_tiles =
        band == kBandShort && kernel_for(kv_dtype, head_dim, 1, false, false, true) != nullptr;
    int tile_rows = 0, max_group = 0;
    if (!layout_facts(kv_dtype, head_dim, short_tiles, &tile_rows, &max_group)) return cudaErrorInvalidValue;
    const int group = n_heads / n_kv_heads;
    // The long band's tensor-core fold where a KV head's query heads are one of its groups: by
    // default for groups of 4 and 8; a group of 2 keeps the tensor cores' work of a group of 4
    // while the CUDA cores' fold has half the multiply-adds, so it takes them only when asked.
    const bool tensor_cores = (band == kBandLongTensorCores || (band == kBandLong && group >= 4)) &&
                              kernel_for(kv_dtype, head_dim, group, false, true) != nullptr;
    int head_group = tensor_cores ? group : max_group;
    // Shapes with narrower head groups compiled (kernel_for_group): a one-head instance exists.
    const bool grouped = kernel_for(kv_dtype, head_dim, 1, false) != nullptr;
    if (grouped && !tensor_cores) head_group = min(max_group, group <= 2 ? 2 : group <= 4 ? 4 : 8);
    const bool chosen_split = split_len == 0;
    // Chunks: by default one tile per warp, so that a context up to one chunk is one block's
    // single pass and longer ones spread over blocks.
    if (split_len == 0) split_len = kAttnWarps * tile_rows;
    split_len = (int)round_up(split_len < 32 ? 32 : split_len, 32);
    const int n_splits = ceil_div(max_seq_len, split_len);
    const int eb = elem_bytes(kv_dtype);

    int device = 0, smem_optin = 0, sm_count = 0;
    OG_CUDA_RETURN_IF(cudaGetDevice(&device));
    OG_CUDA_RETURN_IF(
        cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    OG_CUDA_RETURN_IF(current_sm_count(&sm_count));
    // Blocks per (KV head, head group) for head group hg: one wave of blocks over all of them
    // (before the cap at one per chunk: *wave).
    auto blocks_for = [&](int hg, int *wave) -> cudaError_t {
        const AttnKernel kernel = kernel_for(kv_dtype, head_dim, hg, false, tensor_cores, short_tiles);
        const AttnKernel rows_kernel = kernel_for(kv_dtype, head_dim, hg, true, tensor_cores, short_tiles);
        if (kernel == nullptr || rows_kernel == nullptr) return cudaErrorInvalidValue;
        const size_t smem = (size_t)attn_smem(hg, head_dim, n_splits, eb, 1).total * 4;
        if (smem > (size_t)smem_optin - 64) return cudaErrorInvalidValue;  // is_last_block
        OG_CUDA_RETURN_IF(allow_dynamic_smem((const void *)kernel, smem));
        // Launches of up to kAttnMaxRows rows (the verify body) hold more new rows; where
        // those do not fit, such a launch fails and the decode body still runs.
        const size_t smem_rows = (size_t)attn_smem(hg, head_dim, n_splits, eb, kAttnMaxRows).total * 4;
        OG_CUDA_RETURN_IF(allow_dynamic_smem(
            (const void *)rows_kernel, smem_rows <= (size_t)smem_optin - 64 ? smem_rows : smem));
        int per_sm = 0;
        OG_CUDA_RETURN_IF(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kAttnThreads, smem));
        if (per_sm <= 0) return cudaErrorInvalidConfiguration;
        *wave = per_sm * sm_count / (n_kv_heads * ceil_div(group, hg));
        return cudaSuccess;
    };
    int wave = 0;
    OG_CUDA_RETURN_IF(blocks_for(head_group, &wave));
    // The short band: a cache whose longest context still fits one chunk per block of a
    // narrower head group (the engine's chunking, head_dim 64 or 128) takes the narrowest such
    // group: with no more chunks than the wide group has blocks, its blocks beyond the chunks
    // sit idle while each busy one folds its rows for HG heads one after another; the narrower
    // group puts those heads on blocks of their own, and no block ever takes a second chunk.
    // Longer caches keep the widest group, which reads each K/V row the fewest times.
    if (band == kBandShort && chosen_split && grouped) {
        for (int hg = head_group / 2; hg >= 1; hg /= 2) {
            int narrow_wave = 0;
            if (blocks_for(hg, &narrow_wave) != cudaSuccess || narrow_wave < n_splits) {
                (void)cudaGetLastError();
                break;
            }
            head_group = hg;
            wave = narrow_wave;
        }
    }
    plan->split_len = split_len;
    plan->n_splits = n_splits;
    plan->n_blocks = wave < 1 ? 1 : wave > n_splits ? n_splits : wave;
    plan->head_group = head_group;
    plan->head_groups = ceil_div(group, head_group);
    plan->tensor_cores = tensor_cores;
    plan->short_tiles = short_tiles;
    plan->smem_bytes = (int)attn_smem(head_group, head_dim, plan->n_blocks, eb, 1).total * 4;
    return cudaSuccess;
}

size_t attention_partial_floats(int n_heads, int head_dim, const AttentionPlan &plan, int rows) {
    return (size_t)rows * n_heads * plan.n_blocks * (head_dim + 2);
}

int attention_counters(int n_kv_heads, const AttentionPlan &plan, int rows) {
    return rows * n_kv_heads * plan.head_groups;
}

cudaError_t launch_attention(const AttentionArgs &args, const AttentionPlan &plan,
                             cudaStream_t stream, bool pdl) {
    if (plan.split_len <= 0 || plan.n_blocks <= 0) return cudaErrorInvalidConfiguration;
    if (args.kv.page_size <= 0 || args.kv.block_tables == nullptr) return cudaErrorInvalidValue;
    if (args.qkv == nullptr && args.q == nullptr) return cudaErrorInvalidValue;
    // Several rows: consecutive positions of one sequence, fused mode only.
    if (args.n_rows < 1 || args.n_rows > kAttnMaxRows || (args.n_rows > 1 && args.qkv == nullptr))
        return cudaErrorInvalidValue;
    const AttnKernel kernel = kernel_for(args.kv_dtype, args.head_dim, plan.head_group, args.n_rows > 1,
                                         plan.tensor_cores, plan.short_tiles);
    if (kernel == nullptr) return cudaErrorInvalidValue;
    AttnParams p;
    p.a = args;
    p.chunk = plan.split_len;
    p.n_blocks = plan.n_blocks;
    p.head_groups = plan.head_groups;
    if (plan.head_groups != ceil_div(args.n_heads / args.n_kv_heads, plan.head_group))
        return cudaErrorInvalidValue;
    p.inv_sqrt_hd = (float)(1.0 / sqrt((double)args.head_dim));
    const dim3 grid(args.n_kv_heads * plan.head_groups, plan.n_blocks, args.n_rows), block(kAttnThreads);
    const size_t smem = args.n_rows == 1 ? (size_t)plan.smem_bytes
                                         : (size_t)attn_smem(plan.head_group, args.head_dim, plan.n_blocks,
                                                             elem_bytes(args.kv_dtype), args.n_rows).total * 4;
    return launch_kernel(kernel, grid, block, smem, stream, pdl, p);
}

}  // namespace og

#ifdef OG_Q4_TRACE
OG_TRACE_READERS(attn, og::g_attn_trace, og::g_attn_trace_count)
#endif
