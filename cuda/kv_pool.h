// kv_pool.h — the paged KV cache, host side: the layout of a packed block, the block
// allocator (free list and reference counts), and the sequences (block tables, lengths,
// forks that share blocks). og_engine (engine.cuh) owns one KvPool; the body reads the pool through
// KvPages (kernels.cuh).
//
// Layout. The pool is n_blocks blocks of block_stride bytes. A block packs, per layer l:
//   K page   [n_kv, page_size, hd]  kv dtype      at layers[l].k
//   V page   [n_kv, page_size, hd]  kv dtype      at layers[l].v
//   K scales [n_kv, page_size]      fp32 (int8)   at layers[l].k_scales
//   V scales [n_kv, page_size]      fp32 (int8)   at layers[l].v_scales
// each page 16-byte aligned, the block stride rounded up to 256 bytes. The same facts in
// Python: runtime/kvpool.py (PoolLayout), which tests hold against og_kv_segments.
//
// Block tables. Sequence s owns row s.slot of the device tables [max_sequences,
// max_blocks_per_seq]; entry i is the block of rows [i * page, (i + 1) * page). The host
// keeps the truth (KvSequence::blocks); the device row is kept equal to it for the rows
// the attention reads without a copy per token: the step record carries the block of the
// row being written (row_block), and the body's KV write stores it into the table entry
// of that row before any attention of the step reads it. Rows that become visible without
// a step writing them (a fork, a length set by og_seq_set_length) have their table row
// uploaded once, synchronously, outside the body.
//
// Zeroing. A free block is all zeros (the pool starts zeroed). When blocks return to the
// free list (a sequence reset, freed or truncated), one launch of the zeroing kernel
// clears exactly those whose count reaches zero, before the allocator takes them back; so
// a block handed to a sequence is zero and handing it out costs the decode path nothing.
//
// Sharing. og_seq_fork shares every block of the source's rows (reference counts + 1). A
// write into a shared block — only ever the partial last one — first copies it to a fresh
// block (copy-on-write, one device copy + synchronize, outside the body).
#pragma once

#include <unordered_map>
#include <vector>

#include "kernels.cuh"

namespace og {

constexpr int kKvDefaultPageSize = 64;
constexpr int kKvDefaultMaxSequences = 16;
constexpr int64_t kKvPageAlign = 16;    // bytes: every page starts 16-byte aligned (vector loads)
constexpr int64_t kKvBlockAlign = 256;  // bytes: the block stride is a multiple of this

struct KvLayerOffsets {
    int64_t k = 0, v = 0;                 // byte offsets of the layer's pages inside a block
    int64_t k_scales = -1, v_scales = -1; // -1 unless the cache is int8
};

struct KvLayout {
    int page_size = 0;            // rows per block
    int n_blocks = 0;
    int max_blocks_per_seq = 0;   // ceil(max_seq_len / page_size)
    int max_sequences = 0;
    int64_t block_stride = 0;     // bytes
    std::vector<KvSegment> segments;       // per layer: K, V (, K scales, V scales)
    std::vector<KvLayerOffsets> layers;    // [num_hidden_layers]
    int64_t pool_bytes() const { return block_stride * (int64_t)n_blocks; }
};

// page_size, n_blocks and max_sequences already resolved (positive).
KvLayout plan_kv_layout(int layers, int n_kv_heads, int head_dim, int kv_dtype, int page_size,
                        int n_blocks, int max_seq_len, int max_sequences);

// Free list and reference counts over block ids [0, n_blocks). Every error is an og_status
// with a message (set_error) and leaves the allocator unchanged.
class BlockAllocator {
   public:
    void init(int n_blocks);
    int n_blocks() const { return (int)refs_.size(); }
    int free_count() const { return (int)free_.size(); }
    int refcount(int32_t block) const;  // -1 outside the pool, 0 free
    // OG_E_INVALID_ARGUMENT unless block is in range and allocated; `what` names the caller.
    og_status check_held(int32_t block, const char *what) const;
    // Next free block (refcount 1); OG_E_POOL_EXHAUSTED when none is free.
    og_status allocate(int32_t *block);
    og_status retain(int32_t block);
    // Count - 1; *freed (may be NULL) = whether it reached 0 and went back to the free list.
    og_status release(int32_t block, bool *freed);
    // Test hook: `blocks` (exactly the free blocks, each once) are handed out in this order.
    og_status set_free_order(const int32_t *blocks, int count);

   private:
    std::vector<int32_t> free_;  // a stack: back() is handed out next
    std::vector<int32_t> refs_;  // per block; 0 = free
};

struct KvSequence {
    int32_t slot = -1;            // row of the device block tables
    int32_t length = 0;           // rows written; the next step writes row `length`
    std::vector<int32_t> blocks;  // blocks[i] holds rows [i * page, (i + 1) * page); at least
                                  // ceil(length / page) entries (more after og_seq_reserve)
};

class KvPool {
   public:
    KvLayout layout;
    int kv_dtype = 0;
    int max_seq_len = 0;
    // device memory (in the engine's arena), zeroed before init()
    char *pool = nullptr;            // [n_blocks, block_stride] bytes
    int32_t *tables = nullptr;       // [max_sequences, max_blocks_per_seq]
    KvSegment *segments_dev = nullptr;  // [segments]
    int32_t *ids_dev = nullptr;      // [n_blocks] scratch: the block list of a zeroing launch

    BlockAllocator blocks;
    std::unordered_map<int32_t, KvSequence> seqs;
    int32_t current = -1;            // the selected sequence, -1 none

    // Device bytes the pool needs in the arena (pool, tables, segment table, id scratch) is
    // the caller's business; init() uploads the segment table and creates sequence 0,
    // selected.
    og_status init(cudaStream_t stream);
    KvPages pages(int layer) const;

    // `fn` names the calling ABI function in messages.
    og_status lookup(int32_t id, const char *fn, KvSequence **seq);
    og_status create(int32_t *id);
    og_status fork(int32_t src, int32_t *id, cudaStream_t stream);
    og_status reset(int32_t id, cudaStream_t stream);
    og_status free_sequence(int32_t id, cudaStream_t stream);
    og_status set_length(int32_t id, int32_t length, cudaStream_t stream);
    // Make rows [length, length + n_tokens) writable: copy the block of row `length` if it is
    // shared, allocate blocks up to row length + n_tokens - 1. Checked before any change:
    // OG_E_CONTEXT_FULL beyond max_seq_len, OG_E_POOL_EXHAUSTED without enough free blocks.
    og_status reserve(int32_t id, int32_t n_tokens, cudaStream_t stream);
    // Zero the pages of the listed blocks (validated first), whoever holds them; synchronous.
    og_status zero_blocks(const int32_t *ids, int count, cudaStream_t stream);

   private:
    std::vector<int32_t> free_slots_;  // a stack of unused table rows
    int32_t next_id_ = 0;
    og_status upload_table(const KvSequence &seq, cudaStream_t stream);
    // Release a sequence's blocks from index `keep` on: those whose count reaches zero are
    // zeroed first (one launch), so a failed launch changes nothing.
    og_status release_tail(KvSequence &seq, size_t keep, cudaStream_t stream);
};

}  // namespace og
