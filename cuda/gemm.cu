// gemm.cu — bf16 x bf16 -> fp32 matrix product on the tensor cores, for the batched prompt
// pass (prefill.cuh): y[m, n] (= or +=) sum_k a[m, k] * w[n, k].
//
//   a: [rows, lda] bf16, the chunk's activations (row m = token m), K contiguous; optionally
//      as an unevaluated sum of two bf16 matrices a = a_hi + a_lo (the split form prefill
//      uses: a_hi = bf16(x), a_lo = bf16(x - a_hi) of the fp32 activations x)
//   w: [cols, ldw] bf16, a weight matrix exactly as the decode GEMV reads it (rows padded to a
//      multiple of 8 with zeros), K contiguous — i.e. the "col" operand of mma.sync row.col
//   y: [rows, ldy] fp32
//
// Why a kernel of our own rather than cuBLAS / cuBLASLt: the library links the CUDA runtime
// statically and must load (and fail cleanly) on a machine without a GPU and without any CUDA
// shared library but the driver; cuBLAS would add a ~100 MB dynamic dependency (or a static
// one of similar size) to the install for the one operation prefill needs. The shapes are
// few and simple (K-major on both sides, K a multiple of 8), and prefill needs tens, not
// hundreds, of TFLOP/s: a 2,048-token prompt on the Qwen3-0.6B shape is ~1.8 TFLOP of GEMMs.
//
// Kernel: block tile 128 x 128 x 32, 256 threads = 8 warps in 2 x 4, each warp 64 x 32 (4 x 4
// mma.sync.m16n8k16 tiles, bf16 inputs, fp32 accumulators) when that grid still gives every
// multiprocessor a block; otherwise 64 x 64 x 32, 4 warps of 32 x 32 (2 x 4 tiles): the large
// tile reads half the shared memory per mma (10 ldmatrix for 16 mma, against 6 for 8) and
// loads each weight tile for twice the rows. Tiles are staged in shared memory
// by cp.async (16-byte chunks, zero-filled outside the matrix), three stages deep; fragments
// are read with ldmatrix. Shared rows are padded to 40 bf16 (80 bytes), so the 8 row
// addresses of one ldmatrix phase fall in 8 distinct 16-byte bank groups. Each output element
// is owned by one thread, its k-sum runs in a fixed order (k tiles in order, mma inside), so
// results do not depend on the grid or on the other rows: bit-identical run to run and for
// any chunking of the rows.
//
// Split operand (GemmArgs::a_lo not NULL): the a_lo tile is staged with the others (one more
// BM x 32 bf16 tile per stage: 90 KiB of shared memory instead of 60 for the large tile, 45
// instead of 30 for the small one) and every weight fragment
// is multiplied by both a_hi and a_lo, into two sets of fp32 accumulators, each in the fixed
// k order above; the output is y = sum_hi + sum_lo (then added to y when accumulating). The
// weights are read from memory once; the tensor-core work is 2x.
//
// Grouped form (GemmArgs::groups > 1, the MoE experts of a prefill chunk): grid z = the group
// (an expert); its block rows gather the a rows its list names and scatter the output rows
// likewise, against its own weight matrix; the group's row count is read on the device, and
// blocks past it return at once. Per output element the arithmetic is that of the plain form.
#include "prefill.cuh"
#include "reliability.cuh"

namespace og {
namespace {

constexpr int kGemmBK = 32;
constexpr int kGemmStages = 3;
constexpr int kGemmSmemLd = kGemmBK + 8;  // bf16 per shared row: 80 bytes

// A block tile of WARPS_M x WARPS_N warps, each owning WM x WN outputs (WM / 16 x WN / 8 mma
// tiles). Both shapes sum every output element in the same k order (k tiles of 32 in order,
// two k16 mma inside), so which one runs changes no bit of the result.
template <int WARPS_M, int WARPS_N, int WM, int WN>
struct GemmShape {
    static constexpr int kWarpsN = WARPS_N, kWM = WM, kWN = WN;
    static constexpr int kBM = WARPS_M * WM, kBN = WARPS_N * WN;
    static constexpr int kThreads = WARPS_M * WARPS_N * kWarpSize;
    static constexpr int kMI = WM / 16, kNI = WN / 8;
};
using GemmSmall = GemmShape<2, 2, 32, 32>;  // 64 x 64, 4 warps: small or grouped products
using GemmLarge = GemmShape<2, 4, 64, 32>;  // 128 x 128, 8 warps: half the shared-memory
                                            // traffic per mma, when the grid still fills the GPU

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(p)));
}

// a[0]: the activations (a_hi when split), a[1]: a_lo (split only). In dynamic shared memory.
template <class Shape, bool SPLIT>
struct GemmTiles {
    __nv_bfloat16 a[SPLIT ? 2 : 1][kGemmStages][Shape::kBM][kGemmSmemLd];
    __nv_bfloat16 w[kGemmStages][Shape::kBN][kGemmSmemLd];
};

// One block's view of its group: its rows, weight matrix and row lists.
struct GemmGroup {
    int rows;
    const __nv_bfloat16 *w;
    const int32_t *a_rows;  // NULL: a row m is row m
    const int32_t *y_rows;  // NULL: output row m is y row m
};

// Stage k tile `kt` of the operands: BM rows of a (and a_lo) and BN rows of w, 4 chunks of 16
// bytes each.
template <class Shape, bool SPLIT>
__device__ __forceinline__ void load_tiles(GemmTiles<Shape, SPLIT> &s, int stage, int kt,
                                           const GemmArgs &p, const GemmGroup &grp, int m0, int n0) {
    const int k0 = kt * kGemmBK;
#pragma unroll
    for (int i = threadIdx.x; i < Shape::kBM * (kGemmBK / 8); i += Shape::kThreads) {
        const int row = i / (kGemmBK / 8);
        const int col = k0 + (i % (kGemmBK / 8)) * 8;
        const int m = m0 + row;
        const bool a_ok = m < grp.rows && col < p.depth;
        const size_t a_row = !a_ok ? 0 : grp.a_rows ? (size_t)(grp.a_rows[m] / p.a_row_div) : (size_t)m;
        cp_async_16(&s.a[0][stage][row][col - k0], a_ok ? p.a + a_row * p.lda + col : p.a, a_ok);
        if constexpr (SPLIT)
            cp_async_16(&s.a[1][stage][row][col - k0], a_ok ? p.a_lo + a_row * p.lda + col : p.a_lo,
                        a_ok);
    }
#pragma unroll
    for (int i = threadIdx.x; i < Shape::kBN * (kGemmBK / 8); i += Shape::kThreads) {
        const int row = i / (kGemmBK / 8);
        const int col = k0 + (i % (kGemmBK / 8)) * 8;
        const int n = n0 + row;
        const bool w_ok = n < p.cols && col < p.depth;
        cp_async_16(&s.w[stage][row][col - k0], w_ok ? grp.w + (size_t)n * p.ldw + col : grp.w, w_ok);
    }
}

template <class Shape, bool ACCUMULATE, bool SPLIT>
__global__ void __launch_bounds__(Shape::kThreads) gemm_bf16_kernel(const GemmArgs p) {
    extern __shared__ __align__(128) unsigned char gemm_smem[];
    auto &s = *reinterpret_cast<GemmTiles<Shape, SPLIT> *>(gemm_smem);
    constexpr int MI = Shape::kMI, NI = Shape::kNI;
    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    const int m0 = blockIdx.y * Shape::kBM, n0 = blockIdx.x * Shape::kBN;
    const int group = blockIdx.z;
    const GemmGroup grp = {p.group_rows ? min(p.group_rows[group], p.rows) : p.rows,
                           p.w + group * p.w_group_stride,
                           p.a_rows ? p.a_rows + (size_t)group * p.index_stride : nullptr,
                           p.y_rows ? p.y_rows + (size_t)group * p.index_stride : nullptr};
    if (m0 >= grp.rows) return;  // a group with fewer rows than the grid's bound
    const int warp_m = (warp / Shape::kWarpsN) * Shape::kWM, warp_n = (warp % Shape::kWarpsN) * Shape::kWN;
    const int k_tiles = ceil_div(p.depth, kGemmBK);

    float acc[MI][NI][4], acc_lo[MI][NI][4];  // acc_lo: the a_lo products (split only)
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = acc_lo[i][j][e] = 0.f;

#pragma unroll
    for (int stage = 0; stage < kGemmStages - 1; ++stage) {
        if (stage < k_tiles) load_tiles(s, stage, stage, p, grp, m0, n0);
        cp_async_commit();
    }
    // ldmatrix row addresses: A x4 = (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
    // (rows 8-15, k 8-15) = a0..a3 of m16n8k16; W x4 = two n8 tiles x (k 0-7, k 8-15).
    const int a_row = lane % 16, a_col = (lane / 16) * 8;
    const int w_row = (lane % 8) + (lane / 16) * 8, w_col = ((lane / 8) % 2) * 8;
    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<kGemmStages - 2>();
        __syncthreads();  // tile kt is in; every warp is done with the stage refilled below
        const int next = kt + kGemmStages - 1;
        if (next < k_tiles) load_tiles(s, next % kGemmStages, next, p, grp, m0, n0);
        cp_async_commit();
        const int stage = kt % kGemmStages;
#pragma unroll
        for (int kk = 0; kk < kGemmBK; kk += 16) {
            uint32_t a_frag[MI][4], lo_frag[MI][4], w_frag[NI / 2][4];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                ldmatrix_x4(a_frag[mi], &s.a[0][stage][warp_m + mi * 16 + a_row][kk + a_col]);
                if constexpr (SPLIT)
                    ldmatrix_x4(lo_frag[mi], &s.a[1][stage][warp_m + mi * 16 + a_row][kk + a_col]);
            }
#pragma unroll
            for (int nj = 0; nj < NI / 2; ++nj)
                ldmatrix_x4(w_frag[nj], &s.w[stage][warp_n + nj * 16 + w_row][kk + w_col]);
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni) {
                    mma_bf16_16816(acc[mi][ni], a_frag[mi], w_frag[ni / 2][(ni % 2) * 2],
                                   w_frag[ni / 2][(ni % 2) * 2 + 1]);
                    if constexpr (SPLIT)
                        mma_bf16_16816(acc_lo[mi][ni], lo_frag[mi], w_frag[ni / 2][(ni % 2) * 2],
                                       w_frag[ni / 2][(ni % 2) * 2 + 1]);
                }
        }
    }
    cp_async_wait<0>();

    // Accumulator (mi, ni): rows g and g + 8, columns 2t and 2t + 1 of its 16 x 8 tile.
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int m = m0 + warp_m + mi * 16 + g + half * 8;
            if (m >= grp.rows) continue;
            float *y_row = p.y + (size_t)(grp.y_rows ? grp.y_rows[m] : m) * p.ldy;
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int n = n0 + warp_n + ni * 8 + 2 * t + e;
                    if (n < p.cols) {
                        const float v = SPLIT ? acc[mi][ni][half * 2 + e] + acc_lo[mi][ni][half * 2 + e]
                                              : acc[mi][ni][half * 2 + e];
                        if (ACCUMULATE) y_row[n] += v;
                        else y_row[n] = v;
                    }
                }
            }
        }
    }
}

template <class Shape, bool ACCUMULATE, bool SPLIT>
cudaError_t launch_gemm_variant(const GemmArgs &args, cudaStream_t stream) {
    const auto kernel = gemm_bf16_kernel<Shape, ACCUMULATE, SPLIT>;
    const size_t smem = sizeof(GemmTiles<Shape, SPLIT>);
    OG_CUDA_RETURN_IF(allow_dynamic_smem((const void *)kernel, smem));
    const dim3 grid(ceil_div(args.cols, Shape::kBN), ceil_div(args.rows, Shape::kBM), args.groups);
    if (grid.y > 65535u) return cudaErrorInvalidConfiguration;
    return launch_kernel(kernel, grid, dim3(Shape::kThreads), smem, stream, false, args);
}

template <class Shape>
cudaError_t launch_gemm_shape(const GemmArgs &args, cudaStream_t stream) {
    if (args.a_lo != nullptr)
        return args.accumulate ? launch_gemm_variant<Shape, true, true>(args, stream)
                               : launch_gemm_variant<Shape, false, true>(args, stream);
    return args.accumulate ? launch_gemm_variant<Shape, true, false>(args, stream)
                           : launch_gemm_variant<Shape, false, false>(args, stream);
}

}  // namespace

cudaError_t launch_gemm_bf16(const GemmArgs &args, cudaStream_t stream) {
    if (args.rows <= 0 || args.cols <= 0 || args.depth <= 0) return cudaSuccess;  // nothing to do
    if (args.a == nullptr || args.w == nullptr || args.y == nullptr || args.depth % 8 != 0 ||
        args.lda % 8 != 0 || args.ldw % 8 != 0 || args.depth > args.lda || args.depth > args.ldw ||
        args.ldy < args.cols || (reinterpret_cast<uintptr_t>(args.a) & 15) != 0 ||
        (reinterpret_cast<uintptr_t>(args.a_lo) & 15) != 0 ||
        (reinterpret_cast<uintptr_t>(args.w) & 15) != 0)
        return cudaErrorInvalidValue;
    if (args.groups < 1 || args.groups > 65535 || args.a_row_div < 1 ||
        (args.groups > 1 && args.group_rows == nullptr) ||
        (args.groups > 1 && (args.a_rows || args.y_rows) && args.index_stride < args.rows))
        return cudaErrorInvalidValue;
    // The large tile when its grid still gives every multiprocessor a block; grouped products
    // (a few rows per expert) and small ones take the small tile.
    int sm_count = 0;
    OG_CUDA_RETURN_IF(current_sm_count(&sm_count));
    const int64_t large_blocks = (int64_t)ceil_div(args.cols, GemmLarge::kBN) * ceil_div(args.rows, GemmLarge::kBM);
    if (args.groups == 1 && large_blocks >= sm_count) return launch_gemm_shape<GemmLarge>(args, stream);
    return launch_gemm_shape<GemmSmall>(args, stream);
}

}  // namespace og
