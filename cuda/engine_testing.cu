// engine_testing.cu — test entry points on an engine (onegraph_testing.h; testing library only):
// the guard check and corruption, the body's omit switches, the block allocator's order.
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

}  // extern "C"
