// reliability.cu — the engine's allocations and guard regions (reliability.cuh). In the testing
// library (OG_TESTING) also the allocation counts with failure injection, the guard check, the
// capture fault hook and their og_test_* entry points (onegraph_testing.h): process-wide hooks
// that cost one atomic load per allocation or enqueue when unarmed.
#include <string.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

#include "reliability.cuh"

namespace og {

// ---- allocations ----------------------------------------------------------------------
namespace {

enum Kind { kDevice, kPinned };

#ifdef OG_TESTING
// Allocations left before the injected failure: -1 = none armed; 0 = the next one fails.
std::atomic<int64_t> g_fail_countdown{-1};
std::atomic<int64_t> g_alloc_calls{0};

struct LiveAllocations {
    std::mutex mutex;
    std::unordered_map<void *, size_t> by_kind[2];  // [Kind]: pointer -> bytes
};
LiveAllocations &live() {
    static LiveAllocations *table = new LiveAllocations();  // never destroyed: safe at exit
    return *table;
}

// True when this allocation is the one a test asked to fail.
bool injected_failure() {
    g_alloc_calls.fetch_add(1);
    int64_t left = g_fail_countdown.load();
    while (left >= 0) {
        if (g_fail_countdown.compare_exchange_weak(left, left - 1)) return left == 0;
    }
    return false;
}

void remember(Kind kind, void *ptr, size_t bytes) {
    LiveAllocations &t = live();
    std::lock_guard<std::mutex> lock(t.mutex);
    t.by_kind[kind][ptr] = bytes;
}

void forget(Kind kind, void *ptr) {
    LiveAllocations &t = live();
    std::lock_guard<std::mutex> lock(t.mutex);
    t.by_kind[kind].erase(ptr);
}
#else
// The product library neither counts allocations nor fails one on purpose.
constexpr bool injected_failure() { return false; }
void remember(Kind, void *, size_t) {}
void forget(Kind, void *) {}
#endif

}  // namespace

cudaError_t device_alloc(void **ptr, size_t bytes) {
    *ptr = nullptr;
    if (injected_failure()) return cudaErrorMemoryAllocation;
    const cudaError_t err = cudaMalloc(ptr, bytes);
    if (err == cudaSuccess) remember(kDevice, *ptr, bytes);
    return err;
}

cudaError_t pinned_alloc(void **ptr, size_t bytes) {
    *ptr = nullptr;
    if (injected_failure()) return cudaErrorMemoryAllocation;
    const cudaError_t err = cudaHostAlloc(ptr, bytes, cudaHostAllocDefault);
    if (err == cudaSuccess) remember(kPinned, *ptr, bytes);
    return err;
}

cudaError_t device_free(void *ptr) {
    if (ptr == nullptr) return cudaSuccess;
    forget(kDevice, ptr);
    return cudaFree(ptr);
}

cudaError_t pinned_free(void *ptr) {
    if (ptr == nullptr) return cudaSuccess;
    forget(kPinned, ptr);
    return cudaFreeHost(ptr);
}

// ---- guard regions ----------------------------------------------------------------------
namespace {

// Byte i of every band: a permutation of 0..255 (0x3B is odd), so shifted or repeated
// copies of the pattern do not match it.
struct GuardPattern {
    uint8_t bytes[kGuardBytes];
    GuardPattern() {
        for (size_t i = 0; i < kGuardBytes; ++i) bytes[i] = (uint8_t)((i * 0x3B) ^ 0xA5);
    }
};
const GuardPattern &guard_pattern() {
    static const GuardPattern pattern;
    return pattern;
}

}  // namespace

void *GuardSet::place(const char *name, void *reservation, size_t bytes) {
    const uintptr_t base = reinterpret_cast<uintptr_t>(reservation);
    Region region;
    region.name = name;
    region.before = base;
    region.after = base + kGuardBytes + bytes;
    bool replaced = false;
    for (Region &r : regions_)
        if (r.name == region.name) {
            r = region;
            replaced = true;
        }
    if (!replaced) regions_.push_back(region);
    return reinterpret_cast<void *>(base + kGuardBytes);
}

cudaError_t GuardSet::fill(cudaStream_t stream) const {
    const uint8_t *pattern = guard_pattern().bytes;
    for (const Region &r : regions_)
        for (uintptr_t band : {r.before, r.after})
            OG_CUDA_RETURN_IF(cudaMemcpyAsync(reinterpret_cast<void *>(band), pattern,
                                              kGuardBytes, cudaMemcpyHostToDevice, stream));
    return cudaSuccess;
}

#ifdef OG_TESTING
og_status GuardSet::check(cudaStream_t stream) const {
    const uint8_t *pattern = guard_pattern().bytes;
    std::vector<uint8_t> host(regions_.size() * 2 * kGuardBytes);
    OG_CUDA_TRY(cudaStreamSynchronize(stream));
    for (size_t i = 0; i < regions_.size(); ++i) {
        OG_CUDA_TRY(cudaMemcpyAsync(&host[(2 * i) * kGuardBytes],
                                    reinterpret_cast<void *>(regions_[i].before), kGuardBytes,
                                    cudaMemcpyDeviceToHost, stream));
        OG_CUDA_TRY(cudaMemcpyAsync(&host[(2 * i + 1) * kGuardBytes],
                                    reinterpret_cast<void *>(regions_[i].after), kGuardBytes,
                                    cudaMemcpyDeviceToHost, stream));
    }
    OG_CUDA_TRY(cudaStreamSynchronize(stream));
    for (size_t band = 0; band < 2 * regions_.size(); ++band) {
        const uint8_t *got = &host[band * kGuardBytes];
        size_t changed = 0, first = 0;
        for (size_t b = kGuardBytes; b-- > 0;)
            if (got[b] != pattern[b]) {
                changed += 1;
                first = b;
            }
        if (changed > 0)
            return set_error(OG_E_CORRUPTED,
                             "the guard band %s %s was overwritten: %zu of %zu bytes changed, "
                             "first at byte %zu (0x%02x, expected 0x%02x)",
                             band % 2 == 0 ? "before" : "after",
                             regions_[band / 2].name.c_str(), changed, kGuardBytes, first,
                             got[first], pattern[first]);
    }
    return OG_OK;
}

og_status GuardSet::corrupt(const char *name, int after, cudaStream_t stream) const {
    for (const Region &r : regions_) {
        if (r.name != name) continue;
        // Flip the band's first byte after the buffer (an off-by-one write), or its last byte
        // before it (a write at index -1).
        const uintptr_t address = after ? r.after : r.before + kGuardBytes - 1;
        // Both copies on the engine's stream, then a sync: a plain cudaMemcpy from pageable
        // memory may return before its DMA lands, and the engine's (non-blocking) stream is
        // not ordered after the legacy stream, so a check right after could read the old byte.
        uint8_t value = 0;
        OG_CUDA_TRY(cudaMemcpyAsync(&value, reinterpret_cast<void *>(address), 1,
                                    cudaMemcpyDeviceToHost, stream));
        OG_CUDA_TRY(cudaStreamSynchronize(stream));
        value = (uint8_t)~value;
        OG_CUDA_TRY(cudaMemcpyAsync(reinterpret_cast<void *>(address), &value, 1,
                                    cudaMemcpyHostToDevice, stream));
        OG_CUDA_TRY(cudaStreamSynchronize(stream));
        return OG_OK;
    }
    std::string known;
    for (const Region &r : regions_) known += (known.empty() ? "" : ", ") + r.name;
    return set_error(OG_E_INVALID_ARGUMENT, "og_test_corrupt_guard: no guarded buffer named "
                     "'%s' (guarded: %s)", name, known.c_str());
}
#endif  // OG_TESTING

#ifdef OG_TESTING
// ---- capture fault hook -------------------------------------------------------------------
namespace {
std::atomic<int32_t> g_capture_fault_kind{OG_TEST_CAPTURE_FAULT_NONE};
std::atomic<int32_t> g_capture_faults_left{0};
}  // namespace

og_status capture_fault_hook(cudaStream_t stream) {
    if (g_capture_faults_left.load() <= 0) return OG_OK;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
        (void)cudaGetLastError();
        return OG_OK;
    }
    if (capture != cudaStreamCaptureStatusActive) return OG_OK;
    int32_t left = g_capture_faults_left.load();
    do {
        if (left <= 0) return OG_OK;
    } while (!g_capture_faults_left.compare_exchange_weak(left, left - 1));

    switch (g_capture_fault_kind.load()) {
        case OG_TEST_CAPTURE_FAULT_MALLOC: {
            // A checked allocation inside the body: capture forbids it; the error is returned
            // as any failed CUDA call of the body would be.
            void *ptr = nullptr;
            const cudaError_t err = cudaMalloc(&ptr, 256);
            if (err != cudaSuccess)
                return cuda_failure(err, "cudaMalloc (injected by og_test_set_capture_fault)",
                                    __FILE__, __LINE__);
            cudaFree(ptr);  // allowed after all (relaxed capture): do not leak it
            (void)cudaGetLastError();
            return OG_OK;
        }
        case OG_TEST_CAPTURE_FAULT_SYNC:
            // An unchecked synchronize of the capturing stream: illegal in every capture mode;
            // it invalidates the capture, and the body's next CUDA call fails.
            (void)cudaStreamSynchronize(stream);
            (void)cudaGetLastError();
            return OG_OK;
    }
    return OG_OK;
}
#endif  // OG_TESTING

}  // namespace og

#ifdef OG_TESTING
using namespace og;

extern "C" {

OG_API og_status og_test_fail_allocation_at(int32_t n) {
    if (n < -1)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_test_fail_allocation_at: n=%d (>= 0 arms, -1 disarms)", n);
    g_fail_countdown.store(n);
    return OG_OK;
}

OG_API og_status og_test_allocation_counts(int64_t *calls, int64_t *device_live,
                                           int64_t *pinned_live, uint64_t *device_bytes_live,
                                           uint64_t *pinned_bytes_live) {
    LiveAllocations &t = live();
    std::lock_guard<std::mutex> lock(t.mutex);
    uint64_t device_bytes = 0, pinned_bytes = 0;
    const auto &device = t.by_kind[kDevice], &pinned = t.by_kind[kPinned];
    for (const auto &a : device) device_bytes += a.second;
    for (const auto &a : pinned) pinned_bytes += a.second;
    if (calls != nullptr) *calls = g_alloc_calls.load();
    if (device_live != nullptr) *device_live = (int64_t)device.size();
    if (pinned_live != nullptr) *pinned_live = (int64_t)pinned.size();
    if (device_bytes_live != nullptr) *device_bytes_live = device_bytes;
    if (pinned_bytes_live != nullptr) *pinned_bytes_live = pinned_bytes;
    return OG_OK;
}

OG_API og_status og_test_set_capture_fault(int32_t kind, int32_t count) {
    if (kind != OG_TEST_CAPTURE_FAULT_NONE && kind != OG_TEST_CAPTURE_FAULT_MALLOC &&
        kind != OG_TEST_CAPTURE_FAULT_SYNC)
        return set_error(OG_E_INVALID_ARGUMENT,
                         "og_test_set_capture_fault: kind=%d is not an OG_TEST_CAPTURE_FAULT_* "
                         "value", kind);
    if (count < 0)
        return set_error(OG_E_INVALID_ARGUMENT, "og_test_set_capture_fault: count=%d < 0", count);
    g_capture_faults_left.store(0);
    g_capture_fault_kind.store(kind);
    g_capture_faults_left.store(kind == OG_TEST_CAPTURE_FAULT_NONE ? 0 : count);
    return OG_OK;
}

}  // extern "C"
#endif  // OG_TESTING
