// kv_pool_host.cu — cuda/kv_pool.cu's host logic (block allocator, sequences, forks with
// copy-on-write, reserve, set_length, zero-on-release, block-table uploads) driven on the
// CPU. The CUDA runtime calls kv_pool.cu makes are stubbed on host memory
// (tests/native/cuda_stubs.cpp) and the zeroing kernel by its host mirror, so the pool's
// bytes and tables can be checked after every operation. Built and run by
// tests/test_kvpool.py (nvcc and a host C++ compiler; no GPU). Exit status 0 = every check
// passed; otherwise the failed check is printed.
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <string>
#include <vector>

#include "kv_pool.h"

std::string g_error;
extern int g_fail_memcpy;  // cuda_stubs.cpp: 1 makes the next cudaMemcpyAsync fail

extern "C" const char *og_last_error(void) { return g_error.c_str(); }

namespace og {
og_status set_error(og_status status, const char *fmt, ...) {
    char buffer[1024];
    va_list args;
    va_start(args, fmt);
    vsnprintf(buffer, sizeof buffer, fmt, args);
    va_end(args);
    g_error = buffer;
    return status;
}

og_status cuda_failure(cudaError_t, const char *what, const char *, int) {
    return set_error(OG_E_CUDA, "%s failed", what);
}

int g_zero_launches = 0;

// The kernel's host mirror: every segment's page of every listed block (ids in host memory).
cudaError_t launch_zero_blocks(const ZeroBlocksArgs &a, cudaStream_t) {
    if (a.n_ids == 0) return cudaSuccess;
    g_zero_launches += 1;
    for (int i = 0; i < a.n_ids; ++i)
        for (int s = 0; s < a.n_segments; ++s)
            memset(a.base + (int64_t)a.block_ids[i] * a.block_stride + a.segments[s].offset_bytes,
                   0, (size_t)a.segments[s].page_bytes);
    return cudaSuccess;
}
}  // namespace og

using namespace og;

// Checks with side effects must run in every build: no assert().
#define CHECK(cond)                                                                        \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__,       \
                    __LINE__, #cond, g_error.c_str());                                     \
            return 1;                                                                      \
        }                                                                                  \
    } while (0)

using Blocks = std::vector<int32_t>;

int main() {
    // 2 layers, 2 KV heads, head_dim 16, int8: 8 segments per block; 4 rows per block.
    const int layers = 2, n_kv = 2, hd = 16, page = 4, n_blocks = 6, max_seq = 40, max_seqs = 3;
    KvPool kv;
    kv.layout = plan_kv_layout(layers, n_kv, hd, OG_KV_INT8, page, n_blocks, max_seq, max_seqs);
    kv.kv_dtype = OG_KV_INT8;
    kv.max_seq_len = max_seq;
    const KvLayout &l = kv.layout;
    std::vector<char> pool((size_t)l.pool_bytes(), 0);
    std::vector<int32_t> tables((size_t)max_seqs * l.max_blocks_per_seq, 0);
    std::vector<KvSegment> segments(l.segments.size());
    std::vector<int32_t> ids(n_blocks);
    kv.pool = pool.data();
    kv.tables = tables.data();
    kv.segments_dev = segments.data();
    kv.ids_dev = ids.data();
    CHECK(l.segments.size() == 8 && l.block_stride % 256 == 0 && l.max_blocks_per_seq == 10);
    CHECK(kv.init(nullptr) == OG_OK && kv.current == 0 && kv.seqs.size() == 1);

    auto byte = [&](int block, const KvSegment &s, int row) -> char & {
        return pool[(size_t)(block * l.block_stride + s.offset_bytes + row)];
    };
    auto page_nonzero = [&](int block) {
        for (const KvSegment &s : l.segments)
            for (int64_t i = 0; i < s.page_bytes; ++i)
                if (pool[(size_t)(block * l.block_stride + s.offset_bytes + i)]) return true;
        return false;
    };
    auto table = [&](int32_t id, int index) {
        return tables[(size_t)kv.seqs[id].slot * l.max_blocks_per_seq + index];
    };
    // One decode step as og_begin_step + the body + og_end_step do it: make the row writable,
    // write a marker into byte `row % page` of every page of the row's block, store the block
    // into the table entry (the body's KV write), advance the length.
    auto step = [&](int32_t id, char marker) {
        const og_status status = kv.reserve(id, 1, nullptr);
        if (status != OG_OK) return status;
        KvSequence &s = kv.seqs[id];
        const int block = s.blocks[s.length / page];
        for (const KvSegment &g : l.segments) byte(block, g, s.length % page) = marker;
        tables[(size_t)s.slot * l.max_blocks_per_seq + s.length / page] = block;
        s.length += 1;
        return (og_status)OG_OK;
    };

    // Sequence 0: 6 rows in blocks 0, 1 (block 1 partial).
    for (int i = 0; i < 6; ++i) CHECK(step(0, 'a') == OG_OK);
    CHECK(kv.seqs[0].blocks == (Blocks{0, 1}) && kv.blocks.free_count() == 4);

    // A fork shares both blocks, its table row uploaded.
    int32_t fork = -1;
    CHECK(kv.fork(0, &fork, nullptr) == OG_OK && fork == 1 && kv.seqs[fork].length == 6);
    CHECK(kv.blocks.refcount(0) == 2 && kv.blocks.refcount(1) == 2 && kv.blocks.free_count() == 4);
    CHECK(table(fork, 0) == 0 && table(fork, 1) == 1);

    // The fork writes row 6 first: block 1 is copied to block 2 (copy-on-write).
    CHECK(step(fork, 'b') == OG_OK);
    CHECK(kv.seqs[fork].blocks == (Blocks{0, 2}) && kv.blocks.refcount(1) == 1 &&
          kv.blocks.refcount(2) == 1);
    for (const KvSegment &g : l.segments) {
        CHECK(byte(2, g, 1) == 'a');  // row 5, copied
        CHECK(byte(2, g, 2) == 'b');  // row 6, the fork's own
        CHECK(byte(1, g, 2) == 0);    // the source's block is untouched
    }
    // The source, no longer sharing block 1, writes in place.
    CHECK(step(0, 'c') == OG_OK && kv.seqs[0].blocks == (Blocks{0, 1}));
    for (const KvSegment &g : l.segments) CHECK(byte(1, g, 2) == 'c' && byte(2, g, 2) == 'b');

    // Refusals change nothing: 3 blocks free, 14 more rows need 4; max_seq_len.
    CHECK(kv.reserve(0, 14, nullptr) == OG_E_POOL_EXHAUSTED);
    CHECK(g_error.find("need 4 free KV blocks, 3 of 6 are free") != std::string::npos);
    CHECK(kv.reserve(0, 34, nullptr) == OG_E_CONTEXT_FULL);
    CHECK(kv.blocks.free_count() == 3 && kv.seqs[0].blocks.size() == 2 && kv.seqs[0].length == 7);

    // Sequence slots: 3 at most; a freed id is refused afterwards.
    int32_t third = -1, fourth = -1;
    CHECK(kv.create(&third) == OG_OK && third == 2);
    CHECK(kv.create(&fourth) == OG_E_POOL_EXHAUSTED && kv.fork(0, &fourth, nullptr) == OG_E_POOL_EXHAUSTED);
    CHECK(kv.free_sequence(third, nullptr) == OG_OK);
    CHECK(kv.free_sequence(third, nullptr) == OG_E_INVALID_ARGUMENT);
    CHECK(g_error.find("not live") != std::string::npos);

    // Freeing the fork zeroes its private block 2 (one launch); block 0 stays with sequence 0.
    CHECK(page_nonzero(2));
    const int launches = g_zero_launches;
    CHECK(kv.free_sequence(fork, nullptr) == OG_OK && g_zero_launches == launches + 1);
    CHECK(!page_nonzero(2) && kv.blocks.refcount(2) == 0 && kv.blocks.refcount(0) == 1);
    CHECK(page_nonzero(0) && page_nonzero(1));

    // set_length: extend to 17 rows (5 blocks, table uploaded), refuse past max_seq_len,
    // truncate to 5 rows (3 blocks released and zeroed).
    CHECK(kv.set_length(0, 17, nullptr) == OG_OK && kv.seqs[0].blocks.size() == 5);
    for (int i = 0; i < 5; ++i) CHECK(table(0, i) == kv.seqs[0].blocks[i]);
    CHECK(kv.set_length(0, 41, nullptr) == OG_E_INVALID_ARGUMENT && kv.seqs[0].length == 17);
    CHECK(kv.set_length(0, 5, nullptr) == OG_OK && kv.seqs[0].blocks.size() == 2);
    CHECK(kv.blocks.free_count() == 4);
    // A failed table upload gives the new blocks back.
    g_fail_memcpy = 1;
    CHECK(kv.set_length(0, 12, nullptr) == OG_E_CUDA);
    CHECK(kv.seqs[0].blocks.size() == 2 && kv.seqs[0].length == 5 && kv.blocks.free_count() == 4);

    // reserve allocates ahead; a fork shares only the blocks holding rows.
    CHECK(kv.reserve(0, 7, nullptr) == OG_OK && kv.seqs[0].blocks.size() == 3);
    int32_t second = -1;
    CHECK(kv.fork(0, &second, nullptr) == OG_OK && kv.seqs[second].blocks.size() == 2);
    const int32_t reserved = kv.seqs[0].blocks[2];
    CHECK(kv.blocks.refcount(reserved) == 1);

    // Resetting the source: the shared blocks stay with the fork (not zeroed), the reserved
    // one is released.
    CHECK(kv.reset(0, nullptr) == OG_OK && kv.seqs[0].length == 0 && kv.seqs[0].blocks.empty());
    CHECK(kv.blocks.refcount(kv.seqs[second].blocks[0]) == 1 && page_nonzero(kv.seqs[second].blocks[0]));
    CHECK(kv.blocks.refcount(reserved) == 0);

    // The fork truncated to 2 rows writes row 2 in place (its block is no longer shared).
    CHECK(kv.set_length(second, 2, nullptr) == OG_OK && kv.seqs[second].blocks.size() == 1);
    const int32_t kept = kv.seqs[second].blocks[0];
    CHECK(step(second, 'e') == OG_OK && kv.seqs[second].blocks == (Blocks{kept}));

    // zero_blocks (og_test_kv_zero_blocks) validates ids first.
    const int32_t outside[] = {n_blocks};
    CHECK(kv.zero_blocks(outside, 1, nullptr) == OG_E_INVALID_ARGUMENT);

    // Everything back: all blocks free and zero, no sequence selected.
    CHECK(kv.free_sequence(second, nullptr) == OG_OK && kv.free_sequence(0, nullptr) == OG_OK);
    CHECK(kv.current == -1 && kv.blocks.free_count() == n_blocks && kv.seqs.empty());
    for (int b = 0; b < n_blocks; ++b) CHECK(!page_nonzero(b));
    printf("kv_pool host checks passed\n");
    return 0;
}
