// engine_testing.cu — test entry points on an engine (onegraph_testing.h; testing library only):
// the guard check and corruption, the body's omit switches, the block allocator's order, and
// read-backs of the KV pool and the step record.
#include "engine.cuh"
#include "onegraph_testing.h"

extern "C" {

// ---- test entry points on an engine (onegraph_testing.h; testing library only) ------------
OG_API og_status og_check_guards(og_engine *e) {
    OG_CHECK_HANDLE(e);
    const og_status status = use_device(e);
    if (status != OG_OK) return status;
    return e->kv_guards.check(e->stream);
}

OG_API og_status og_test_corrupt_guard(og_engine *e, const char *buffer, int32_t after) {
    OG_CHECK_HANDLE(e);
    if (buffer == nullptr || (after != 0 && after != 1))
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_test_corrupt_guard: buffer is NULL or after=%d is not 0 or 1", after);
    const og_status status = use_device(e);
    if (status != OG_OK) return status;
    return e->kv_guards.corrupt(buffer, after, e->stream);
}

OG_API og_status og_test_set_omit(og_engine *e, int32_t kinds) {
    OG_CHECK_HANDLE(e);
    constexpr int32_t all = OG_TEST_OMIT_QKV | OG_TEST_OMIT_ATTENTION | OG_TEST_OMIT_O_PROJ |
                            OG_TEST_OMIT_FFN_IN | OG_TEST_OMIT_FFN_OUT | OG_TEST_OMIT_LM_HEAD;
    if ((kinds & ~all) != 0)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_test_set_omit: kinds=%d holds bits outside the OG_TEST_OMIT_* mask %d",
                         kinds, all);
    e->test_omit = kinds;
    return OG_OK;
}

OG_API og_status og_test_kv_set_free_order(og_engine *e, const int32_t *blocks, int32_t count) {
    OG_CHECK_HANDLE(e);
    return e->kv.blocks.set_free_order(blocks, count);
}

OG_API og_status og_test_copy_kv_cache(og_engine *e, void *host_dst, uint64_t capacity_bytes) {
    OG_CHECK_HANDLE(e);
    if (host_dst == nullptr)
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_copy_kv_cache: host_dst is NULL");
    const uint64_t needed = (uint64_t)e->kv.layout.pool_bytes();
    if (capacity_bytes < needed)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_test_copy_kv_cache: capacity_bytes=%llu < kv_cache_bytes=%llu",
                         (unsigned long long)capacity_bytes, (unsigned long long)needed);
    const og_status status = use_device(e);
    if (status != OG_OK) return status;
    OG_CUDA_TRY(cudaStreamSynchronize(e->stream));
    OG_CUDA_TRY(cudaMemcpyAsync(host_dst, e->kv.pool, (size_t)needed, cudaMemcpyDeviceToHost,
                                e->stream));
    OG_CUDA_TRY(cudaStreamSynchronize(e->stream));
    return OG_OK;
}

OG_API og_status og_test_step_record(og_engine *e, og_step_record *record) {
    OG_CHECK_HANDLE(e);
    if (record == nullptr)
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_step_record: record is NULL");
    *record = e->step_host[0];
    return OG_OK;
}

OG_API og_status og_test_kv_zero_blocks(og_engine *e, const int32_t *blocks, int32_t count) {
    OG_CHECK_HANDLE(e);
    const og_status status = use_device(e);
    if (status != OG_OK) return status;
    return e->kv.zero_blocks(blocks, count, e->stream);
}

}  // extern "C"
