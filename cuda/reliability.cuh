// reliability.cuh — helpers that let the tests prove the library fails cleanly:
//   - counted device / pinned allocations, with a test hook that fails the n-th one
//     (og_test_fail_allocation_at) and live counts (og_test_allocation_counts), so a test
//     can show that every failed og_init releases everything it took;
//   - guard regions (sentinels) around buffers that kernels index by position (the KV
//     cache and its scales): a known byte pattern before and after, written at init and
//     compared by og_check_guards;
//   - the test hook that makes og_enqueue make an illegal call while its stream is being
//     captured (og_test_set_capture_fault).
// The product library has the allocations and the guard bands; the counting, the failure
// injection, the checks and the hooks exist in the testing library only (OG_TESTING), whose
// og_test_* entry points are declared in onegraph_testing.h (no ABI promise).
#pragma once

#include <string>
#include <vector>

#include "common.cuh"
#ifdef OG_TESTING
#include "onegraph_testing.h"
#endif

namespace og {

// ---- allocations ----------------------------------------------------------------------
// Every device and pinned host allocation an engine makes goes through these (a CPU test
// checks cuda/ for raw cudaMalloc / cudaHostAlloc), so fault injection reaches each one.
// They return what cudaMalloc / cudaHostAlloc(cudaHostAllocDefault) return, and
// cudaErrorMemoryAllocation for an injected failure (nothing is allocated then).
cudaError_t device_alloc(void **ptr, size_t bytes);
cudaError_t pinned_alloc(void **ptr, size_t bytes);
// Release what device_alloc / pinned_alloc returned; NULL is a no-op.
cudaError_t device_free(void *ptr);
cudaError_t pinned_free(void *ptr);

template <class T>
cudaError_t device_alloc(T **ptr, size_t bytes) {
    return device_alloc(reinterpret_cast<void **>(ptr), bytes);
}
template <class T>
cudaError_t pinned_alloc(T **ptr, size_t bytes) {
    return pinned_alloc(reinterpret_cast<void **>(ptr), bytes);
}

// ---- guard regions ----------------------------------------------------------------------
// Bytes of each guard band. A multiple of the arena alignment, so a guarded buffer carved
// from an aligned reservation keeps its alignment.
constexpr size_t kGuardBytes = 256;

// Guard bands around buffers carved out of larger allocations. Usage at an allocation site:
//     buf = (T *)guards.place("kv_values", cursor.take<char>(GuardSet::reserve_bytes(n)), n);
// place() records the bands [reservation, +kGuardBytes) and [buf + n, +kGuardBytes); it is
// idempotent per name (a layout computed twice, to size and then to assign, records once).
// fill() writes the pattern (after the allocation has been zeroed); check() compares.
class GuardSet {
  public:
    static size_t reserve_bytes(size_t bytes) { return bytes + 2 * kGuardBytes; }
    void *place(const char *name, void *reservation, size_t bytes);
    // Enqueue the pattern into every band on stream (the caller synchronizes).
    cudaError_t fill(cudaStream_t stream) const;
#ifdef OG_TESTING
    // Synchronize stream, copy every band back and compare. OG_OK, or OG_E_CORRUPTED naming
    // the buffer, the side, how many bytes changed and the first one.
    og_status check(cudaStream_t stream) const;
    // Overwrite one byte of a band (after = 0: before the buffer, 1: after it).
    og_status corrupt(const char *name, int after, cudaStream_t stream) const;
#endif
    size_t size() const { return regions_.size(); }

  private:
    struct Region {
        std::string name;
        uintptr_t before = 0, after = 0;  // device addresses of the two bands
    };
    std::vector<Region> regions_;
};

#ifdef OG_TESTING
// ---- capture fault hook -------------------------------------------------------------------
// og_enqueue calls this before enqueuing the body. It does nothing unless a test armed it
// with og_test_set_capture_fault and `stream` is being captured; then it makes the armed
// illegal call (see onegraph_testing.h) and returns what a checked call would.
og_status capture_fault_hook(cudaStream_t stream);
#endif

}  // namespace og
