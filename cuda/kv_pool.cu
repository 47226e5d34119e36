// kv_pool.cu — the host side of the paged KV cache (see kv_pool.h): layout, block
// allocator, sequences. Device work here is never part of the decode body: zeroing released
// blocks, a copy-on-write block copy, a block-table upload — each synchronized before the
// call returns, so the next body (on any stream) sees it.
#include <string.h>

#include <string>

#include "kv_pool.h"

namespace og {

KvLayout plan_kv_layout(int layers, int n_kv_heads, int head_dim, int kv_dtype, int page_size,
                        int n_blocks, int max_seq_len, int max_sequences) {
    KvLayout l;
    l.page_size = page_size;
    l.n_blocks = n_blocks;
    l.max_sequences = max_sequences;
    l.max_blocks_per_seq = (int)((max_seq_len + (int64_t)page_size - 1) / page_size);
    const int64_t elem = kv_dtype == OG_KV_F32 ? 4 : kv_dtype == OG_KV_BF16 ? 2 : 1;
    const int64_t value_page = (int64_t)n_kv_heads * page_size * head_dim * elem;
    const int64_t scale_page = (int64_t)n_kv_heads * page_size * (int64_t)sizeof(float);
    int64_t cursor = 0;
    auto place = [&](int64_t bytes) {
        cursor = round_up(cursor, kKvPageAlign);
        const int64_t offset = cursor;
        l.segments.push_back(KvSegment{offset, bytes});
        cursor += bytes;
        return offset;
    };
    l.layers.resize(layers);
    for (int layer = 0; layer < layers; ++layer) {
        KvLayerOffsets &o = l.layers[layer];
        o.k = place(value_page);
        o.v = place(value_page);
        if (kv_dtype == OG_KV_INT8) {
            o.k_scales = place(scale_page);
            o.v_scales = place(scale_page);
        }
    }
    l.block_stride = round_up(cursor, kKvBlockAlign);
    return l;
}

// ---- BlockAllocator ----------------------------------------------------------------------

void BlockAllocator::init(int n_blocks) {
    refs_.assign(n_blocks, 0);
    free_.resize(n_blocks);
    for (int i = 0; i < n_blocks; ++i) free_[i] = n_blocks - 1 - i;  // block 0 comes out first
}

int BlockAllocator::refcount(int32_t block) const {
    return block >= 0 && block < n_blocks() ? refs_[block] : -1;
}

og_status BlockAllocator::check_held(int32_t block, const char *what) const {
    if (block < 0 || block >= n_blocks())
        return set_error(OG_E_INVALID_ARGUMENT, "%s: block %d is outside the pool [0, %d)", what,
                         block, n_blocks());
    if (refs_[block] == 0)
        return set_error(OG_E_INVALID_ARGUMENT, "%s: block %d is free (double free?)", what, block);
    return OG_OK;
}

og_status BlockAllocator::allocate(int32_t *block) {
    if (free_.empty())
        return set_error(OG_E_POOL_EXHAUSTED, "KV block pool exhausted: all %d blocks are in use",
                         n_blocks());
    *block = free_.back();
    free_.pop_back();
    refs_[*block] = 1;
    return OG_OK;
}

og_status BlockAllocator::retain(int32_t block) {
    const og_status status = check_held(block, "retain");
    if (status != OG_OK) return status;
    refs_[block] += 1;
    return OG_OK;
}

og_status BlockAllocator::release(int32_t block, bool *freed) {
    const og_status status = check_held(block, "release");
    if (status != OG_OK) return status;
    refs_[block] -= 1;
    if (refs_[block] == 0) free_.push_back(block);
    if (freed != nullptr) *freed = refs_[block] == 0;
    return OG_OK;
}

og_status BlockAllocator::set_free_order(const int32_t *blocks, int count) {
    if (count != free_count() || (count > 0 && blocks == nullptr))
        return set_error(OG_E_INVALID_ARGUMENT,
                         "set_free_order: %d blocks given, but %d blocks are free", count,
                         free_count());
    std::vector<uint8_t> seen(n_blocks(), 0);
    for (int i = 0; i < count; ++i) {
        const int32_t b = blocks[i];
        if (b < 0 || b >= n_blocks() || refs_[b] != 0 || seen[b])
            return set_error(OG_E_INVALID_ARGUMENT,
                             "set_free_order: entry %d (block %d) is not a free block listed once",
                             i, b);
        seen[b] = 1;
    }
    for (int i = 0; i < count; ++i) free_[count - 1 - i] = blocks[i];  // blocks[0] comes out first
    return OG_OK;
}

// ---- KvPool ----------------------------------------------------------------------------

og_status KvPool::init(cudaStream_t stream) {
    blocks.init(layout.n_blocks);
    seqs.clear();
    free_slots_.resize(layout.max_sequences);
    for (int i = 0; i < layout.max_sequences; ++i) free_slots_[i] = layout.max_sequences - 1 - i;
    next_id_ = 0;
    OG_CUDA_TRY(cudaMemcpyAsync(segments_dev, layout.segments.data(),
                                layout.segments.size() * sizeof(KvSegment),
                                cudaMemcpyHostToDevice, stream));
    OG_CUDA_TRY(cudaStreamSynchronize(stream));
    int32_t first = -1;
    const og_status status = create(&first);
    if (status != OG_OK) return status;
    current = first;
    return OG_OK;
}

KvPages KvPool::pages(int layer) const {
    const KvLayerOffsets &o = layout.layers[layer];
    KvPages p = {};
    p.k = pool + o.k;
    p.v = pool + o.v;
    p.k_scales = o.k_scales >= 0 ? pool + o.k_scales : nullptr;
    p.v_scales = o.v_scales >= 0 ? pool + o.v_scales : nullptr;
    p.block_stride = layout.block_stride;
    p.page_size = layout.page_size;
    p.n_blocks = layout.n_blocks;
    p.block_tables = tables;
    p.max_blocks_per_seq = layout.max_blocks_per_seq;
    return p;
}

og_status KvPool::lookup(int32_t id, const char *fn, KvSequence **seq) {
    const auto found = seqs.find(id);
    if (found == seqs.end())
        return set_error(OG_E_INVALID_ARGUMENT, "%s: sequence %d is not live (never created, or freed)",
                         fn, id);
    *seq = &found->second;
    return OG_OK;
}

og_status KvPool::create(int32_t *id) {
    if (free_slots_.empty())
        return set_error(OG_E_POOL_EXHAUSTED,
                         "og_seq_create: all %d sequence slots are in use "
                         "(og_config.kv_max_sequences); free a sequence first",
                         layout.max_sequences);
    KvSequence seq;
    seq.slot = free_slots_.back();
    free_slots_.pop_back();
    *id = next_id_++;
    seqs.emplace(*id, std::move(seq));
    return OG_OK;
}

og_status KvPool::upload_table(const KvSequence &seq, cudaStream_t stream) {
    if (seq.blocks.empty()) return OG_OK;
    OG_CUDA_TRY(cudaMemcpyAsync(tables + (size_t)seq.slot * layout.max_blocks_per_seq,
                                seq.blocks.data(), seq.blocks.size() * sizeof(int32_t),
                                cudaMemcpyHostToDevice, stream));
    OG_CUDA_TRY(cudaStreamSynchronize(stream));
    return OG_OK;
}

og_status KvPool::fork(int32_t src, int32_t *id, cudaStream_t stream) {
    KvSequence *from = nullptr;
    og_status status = lookup(src, "og_seq_fork", &from);
    if (status != OG_OK) return status;
    if (free_slots_.empty())
        return set_error(OG_E_POOL_EXHAUSTED,
                         "og_seq_fork: all %d sequence slots are in use "
                         "(og_config.kv_max_sequences); free a sequence first",
                         layout.max_sequences);
    KvSequence seq;
    seq.slot = free_slots_.back();
    seq.length = from->length;
    // Only the blocks holding rows: reserved blocks beyond the length stay the source's.
    const size_t shared = (size_t)((from->length + (int64_t)layout.page_size - 1) / layout.page_size);
    seq.blocks.assign(from->blocks.begin(), from->blocks.begin() + shared);
    status = upload_table(seq, stream);
    if (status != OG_OK) return status;
    for (int32_t b : seq.blocks) {
        status = blocks.retain(b);
        if (status != OG_OK) return status;  // unreachable: the source holds every one
    }
    free_slots_.pop_back();
    *id = next_id_++;
    seqs.emplace(*id, std::move(seq));
    return OG_OK;
}

og_status KvPool::release_tail(KvSequence &seq, size_t keep, cudaStream_t stream) {
    if (keep >= seq.blocks.size()) return OG_OK;
    std::vector<int32_t> to_zero;
    for (size_t i = keep; i < seq.blocks.size(); ++i)
        if (blocks.refcount(seq.blocks[i]) == 1) to_zero.push_back(seq.blocks[i]);
    og_status status = zero_blocks(to_zero.data(), (int)to_zero.size(), stream);
    if (status != OG_OK) return status;
    for (size_t i = keep; i < seq.blocks.size(); ++i) {
        status = blocks.release(seq.blocks[i], nullptr);
        if (status != OG_OK) return status;  // unreachable: the sequence holds every one
    }
    seq.blocks.resize(keep);
    return OG_OK;
}

og_status KvPool::reset(int32_t id, cudaStream_t stream) {
    KvSequence *seq = nullptr;
    og_status status = lookup(id, "og_seq_reset", &seq);
    if (status != OG_OK) return status;
    status = release_tail(*seq, 0, stream);
    if (status != OG_OK) return status;
    seq->length = 0;
    return OG_OK;
}

og_status KvPool::free_sequence(int32_t id, cudaStream_t stream) {
    KvSequence *seq = nullptr;
    og_status status = lookup(id, "og_seq_free", &seq);
    if (status != OG_OK) return status;
    status = release_tail(*seq, 0, stream);
    if (status != OG_OK) return status;
    free_slots_.push_back(seq->slot);
    seqs.erase(id);
    if (current == id) current = -1;
    return OG_OK;
}

og_status KvPool::set_length(int32_t id, int32_t length, cudaStream_t stream) {
    KvSequence *seq = nullptr;
    og_status status = lookup(id, "og_seq_set_length", &seq);
    if (status != OG_OK) return status;
    if (length < 0 || length > max_seq_len)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_seq_set_length: length %d is outside [0, max_seq_len=%d]", length,
                         max_seq_len);
    const size_t needed = (size_t)((length + (int64_t)layout.page_size - 1) / layout.page_size);
    if (length <= seq->length) {
        status = release_tail(*seq, needed, stream);
        if (status != OG_OK) return status;
        seq->length = length;
        return OG_OK;
    }
    const int missing = needed > seq->blocks.size() ? (int)(needed - seq->blocks.size()) : 0;
    if (missing > blocks.free_count())
        return set_error(OG_E_POOL_EXHAUSTED,
                         "og_seq_set_length: sequence %d needs %d more KV blocks for %d rows, "
                         "%d of %d are free",
                         id, missing, length, blocks.free_count(), blocks.n_blocks());
    const size_t before = seq->blocks.size();
    for (int i = 0; i < missing; ++i) {
        int32_t b = -1;
        blocks.allocate(&b);  // cannot fail: counted above
        seq->blocks.push_back(b);
    }
    // The new rows become visible without a step writing their table entries.
    status = upload_table(*seq, stream);
    if (status != OG_OK) {
        for (size_t i = before; i < seq->blocks.size(); ++i) blocks.release(seq->blocks[i], nullptr);
        seq->blocks.resize(before);  // untouched blocks: still zero
        return status;
    }
    seq->length = length;
    return OG_OK;
}

og_status KvPool::reserve(int32_t id, int32_t n_tokens, cudaStream_t stream) {
    KvSequence *seq = nullptr;
    og_status status = lookup(id, "og_seq_reserve", &seq);
    if (status != OG_OK) return status;
    if (n_tokens < 0)
        return set_error(OG_E_INVALID_ARGUMENT, "og_seq_reserve: n_tokens=%d is negative", n_tokens);
    if (n_tokens == 0) return OG_OK;
    if ((int64_t)seq->length + n_tokens > max_seq_len)
        return set_error(OG_E_CONTEXT_FULL,
                         "sequence %d: %d rows + %d would exceed max_seq_len=%d; reset the "
                         "sequence or start another",
                         id, seq->length, n_tokens, max_seq_len);
    const int page = layout.page_size;
    const size_t first = (size_t)(seq->length / page);
    const bool copy = first < seq->blocks.size() && blocks.refcount(seq->blocks[first]) > 1;
    const size_t needed = (size_t)((seq->length + (int64_t)n_tokens + page - 1) / page);
    const int missing = needed > seq->blocks.size() ? (int)(needed - seq->blocks.size()) : 0;
    if ((copy ? 1 : 0) + missing > blocks.free_count())
        return set_error(OG_E_POOL_EXHAUSTED,
                         "sequence %d: %d more rows need %d free KV blocks%s, %d of %d are free "
                         "(free or reset a sequence, or raise og_config.kv_pool_blocks)",
                         id, n_tokens, (copy ? 1 : 0) + missing,
                         copy ? " (one to copy a shared block on write)" : "",
                         blocks.free_count(), blocks.n_blocks());
    if (copy) {
        // Copy-on-write: the rows before `length` of the shared block go to a fresh block.
        // The whole block is copied (every layer's pages at once); rows from `length` on are
        // overwritten before they are read.
        int32_t fresh = -1;
        blocks.allocate(&fresh);
        const int32_t shared = seq->blocks[first];
        const int64_t stride = layout.block_stride;
        cudaError_t err = cudaMemcpyAsync(pool + fresh * stride, pool + shared * stride,
                                          (size_t)stride, cudaMemcpyDeviceToDevice, stream);
        if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
        if (err != cudaSuccess) {
            const og_status failed = cuda_failure(err, "copy-on-write block copy", __FILE__, __LINE__);
            // The fresh block may hold part of the copy: zero it before it is free again.
            const std::string message = og_last_error();
            if (zero_blocks(&fresh, 1, stream) == OG_OK) blocks.release(fresh, nullptr);
            return set_error(failed, "%s", message.c_str());
        }
        seq->blocks[first] = fresh;
        blocks.release(shared, nullptr);  // still held by the sequences it was shared with
    }
    for (int i = 0; i < missing; ++i) {
        int32_t b = -1;
        blocks.allocate(&b);  // cannot fail: counted above
        seq->blocks.push_back(b);
    }
    return OG_OK;
}

og_status KvPool::zero_blocks(const int32_t *ids, int count, cudaStream_t stream) {
    if (count < 0 || (count > 0 && ids == nullptr))
        return set_error(OG_E_INVALID_ARGUMENT, "zeroing KV blocks: ids is NULL or count=%d < 0", count);
    if (count > layout.n_blocks)
        return set_error(OG_E_INVALID_ARGUMENT, "zeroing KV blocks: %d ids but the pool has %d blocks",
                         count, layout.n_blocks);
    for (int i = 0; i < count; ++i)
        if (ids[i] < 0 || ids[i] >= layout.n_blocks)
            return set_error(OG_E_INVALID_ARGUMENT,
                             "zeroing KV blocks: ids[%d]=%d is outside the pool [0, %d)", i, ids[i],
                             layout.n_blocks);
    if (count == 0) return OG_OK;
    OG_CUDA_TRY(cudaMemcpyAsync(ids_dev, ids, (size_t)count * sizeof(int32_t),
                                cudaMemcpyHostToDevice, stream));
    ZeroBlocksArgs a = {};
    a.base = pool;
    a.block_stride = layout.block_stride;
    a.n_blocks = layout.n_blocks;
    a.segments = segments_dev;
    a.n_segments = (int)layout.segments.size();
    a.block_ids = ids_dev;
    a.n_ids = count;
    OG_CUDA_TRY(launch_zero_blocks(a, stream));
    OG_CUDA_TRY(cudaStreamSynchronize(stream));
    return OG_OK;
}

}  // namespace og
