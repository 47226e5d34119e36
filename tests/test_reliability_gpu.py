"""Reliability on the GPU (issue 9): guard bands intact after decodes to a full context and
corruption found by name; freed handles and double free refused by every entry point; bad
set_weight calls change nothing (residency, uploaded bytes); every step entry refuses a
missing weight with state unchanged; an illegal call forced into the capture is detected
(not hung) and the step still gives the undisturbed logits, with a re-captured graph later;
an allocation failure injected at each allocation of og_init returns OG_E_OUT_OF_MEMORY and
leaks nothing; two handles decode in two threads at once exactly as each does alone.

Skipped without a usable GPU and library. The CPU half is tests/test_reliability_cpu.py.
"""
from __future__ import annotations

import ctypes
import faulthandler
import os
import threading

import ml_dtypes
import numpy as np
import pytest

from gpu_support import require_gpu, synthetic
import capi_testing as ct
from onegraph import capi
from onegraph.engine import Engine, EngineError
from onegraph.session import GpuSession
from test_reliability_cpu import _all_handle_functions, _poisoned, _zero_args

pytestmark = pytest.mark.gpu

# Token ids inside every tiny vocabulary (the smallest, tiny-tied, has 300).
PROMPT = [3, 17, 99, 250, 4, 61, 200, 8, 45, 123, 7, 255, 11, 90, 150, 33]
# How far cudaMemGetInfo's free bytes may move between two measurements with nothing leaked
# (driver bookkeeping); the engines below hold ~33 MiB, so a leaked arena shows far above it.
FREE_MEMORY_SLACK_BYTES = 4 << 20
# faulthandler ends the run with a traceback if a test blocks this long (scripts/sanitize.sh
# raises it: every launch is far slower under compute-sanitizer).
HANG_LIMIT_S = int(os.environ.get("ONEGRAPH_TEST_HANG_S", "240"))


@pytest.fixture(scope="module", autouse=True)
def _gpu():
    require_gpu()


@pytest.fixture(scope="module")
def hooks():
    import capi_testing
    capi_testing.load()
    capi_testing.reliability()
    yield capi_testing
    capi_testing.fail_allocation_at(-1)
    capi_testing.set_capture_fault("none", 0)


@pytest.fixture
def watchdog():
    faulthandler.dump_traceback_later(HANG_LIMIT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _decode(step, prompt, n):
    """Greedy: (generated tokens, logits of every step: prompt steps and generated steps)."""
    all_logits = [step(t) for t in prompt]
    tokens = []
    for _ in range(n):
        token = int(np.argmax(all_logits[-1]))
        tokens.append(token)
        all_logits.append(step(token))
    return tokens, all_logits


def _assert_same(a, b):
    assert a[0] == b[0]
    assert len(a[1]) == len(b[1])
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        assert np.array_equal(x, y), f"logits of step {i} differ"


def device_free_bytes() -> int:
    from onegraph.graph import check_cuda, cuda_runtime
    free, _total = check_cuda(cuda_runtime().cudaMemGetInfo(), "cudaMemGetInfo")
    return int(free)


def gpu_shared_with_other_workers() -> bool:
    """Other pytest-xdist workers decode on this GPU meanwhile: the device's free bytes move with
    their engines, so they say nothing about this process's (the allocation counters still do)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1


def _session_decode(session: GpuSession, tokens) -> list[np.ndarray]:
    session.reset()
    out = []
    for t in tokens:
        session.begin(t)
        session.run_nongraph()
        out.append(session.end())
    return out


# ---- guard bands --------------------------------------------------------------------------
@pytest.mark.parametrize("preset,kv", [("tiny-dense", "fp32"), ("tiny-dense", "bf16"), ("tiny-dense", "int8"),
                                       ("tiny-moe", "int8"), ("tiny-llama", "bf16"), ("tiny-tied", "int8")])
def test_guards_intact_after_decoding_to_a_full_context(hooks, preset, kv):
    config, tensors = synthetic(preset)
    max_seq = 40
    with Engine.from_tensors(config, tensors, kv=kv, max_seq_len=max_seq, device="gpu") as engine:
        handle = engine._gpu.handle
        hooks.check_guards(handle)
        for graph in (True, False):
            engine.set_graph(graph)
            engine.reset()
            engine.generate(PROMPT, max_seq - len(PROMPT) + 1, stop_token_ids=())
            assert engine.position == max_seq  # the last row of every head was written
            with pytest.raises(EngineError, match="context is full"):
                engine.step(1)
            hooks.check_guards(handle)


def test_guard_corruption_is_found_and_named(hooks):
    config, tensors = synthetic("tiny-dense")
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=32, device="gpu") as engine:
        handle = engine._gpu.handle
        engine.prefill(PROMPT[:4])
        for buffer in ("kv_pool", "kv_tables"):
            for after, side in ((False, "before"), (True, "after")):
                hooks.corrupt_guard(handle, buffer, after)
                with pytest.raises(capi.LibraryError) as err:
                    hooks.check_guards(handle)
                assert err.value.status == capi.OG_E_CORRUPTED
                assert f"the guard band {side} {buffer} was overwritten: 1 of 256 bytes" in str(err.value)
                hooks.corrupt_guard(handle, buffer, after)  # flip it back
                hooks.check_guards(handle)
        with pytest.raises(capi.LibraryError) as err:
            hooks.corrupt_guard(handle, "weights", True)
        assert err.value.status == capi.OG_E_INVALID_ARGUMENT
        assert "kv_pool, kv_tables" in str(err.value)


# ---- handles ------------------------------------------------------------------------------
def test_freed_handle_and_double_free_are_refused_by_every_function(hooks):
    config, tensors = synthetic("tiny-dense")
    session = GpuSession(config, tensors.items(), kv="int8", max_seq_len=16)
    lib = session.lib
    stale = ctypes.c_void_p(session.handle.value)
    assert lib.og_free(stale) == capi.OG_OK
    session.handle = capi.Handle()  # already freed: close() must not free it again
    session.close()
    # No og_init in between: the freed address cannot have been handed out again.
    for name in _all_handle_functions():  # og_free among them: the double free
        f = getattr(lib, name)
        assert f(stale, *_zero_args(f)) == capi.OG_E_INVALID_HANDLE, name
        assert "not a live engine handle" in capi.last_error(), name


# ---- og_test_set_omit (the graph ablation's hook) ----------------------------------------------
def test_each_omitted_kernel_kind_changes_the_step_and_zero_restores_it(hooks):
    """scripts/graph_ablation.py times steps without a kind of kernel; here each kind must
    really be left out (a step without it differs from the whole body's), and the empty mask
    must give back the whole body bit for bit. Before each omitted step, a whole step on another
    token refreshes every buffer, so no stale buffer can happen to hold the right values."""
    config, tensors = synthetic("tiny-dense")
    session = GpuSession(config, tensors.items(), kv="int8", max_seq_len=16)

    def step(token: int, kinds=()) -> np.ndarray:
        hooks.set_omit(session.handle, kinds)
        session.reset()
        session.begin(token)
        session.run_nongraph()
        return session.end()

    try:
        whole = step(9)
        for kind in hooks.OMIT_KINDS:
            step(5)
            assert not np.array_equal(step(9, [kind]), whole), kind
        assert np.array_equal(step(9), whole)
        with pytest.raises(capi.LibraryError, match="OG_TEST_OMIT"):
            hooks._check(hooks.reliability().og_test_set_omit(session.handle, 64), "og_test_set_omit")
        with pytest.raises(ValueError, match="unknown kernel kind"):
            hooks.set_omit(session.handle, ["softmax"])
    finally:
        hooks.set_omit(session.handle, [])
        session.close()


def test_graph_ablation_script_measures_every_kind(hooks):
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "graph_ablation.py")
    spec = importlib.util.spec_from_file_location("graph_ablation", path)
    ablation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablation)
    doc = ablation.measure(ablation.argparse.Namespace(
        preset="tiny-dense", kv="int8", weights="bf16", quantize="all", quantize_lm_head=False,
        context=8, steps=3, repeats=1))
    assert [r["kind"] for r in doc["kinds"]] == list(ablation.KINDS)
    assert doc["whole_ms"] > 0 and all(r["ms_without"] > 0 for r in doc["kinds"])
    assert "the rest" in ablation.table(doc)
    # --keep-only: each kind alone against the graph with none of them
    alone = ablation.measure(ablation.argparse.Namespace(
        preset="tiny-dense", kv="int8", weights="bf16", quantize="all", quantize_lm_head=False,
        context=8, steps=3, repeats=1, keep_only=True))
    assert [r["kind"] for r in alone["kinds"]] == list(ablation.KINDS)
    # Only that every graph was timed: which of two graphs of a tiny model is faster depends on
    # what else shares the GPU (the suite's workers do), so no order between them is asserted.
    assert alone["none_ms"] > 0 and alone["whole_ms"] > 0 and all(r["ms_alone"] > 0 for r in alone["kinds"])
    assert "kept alone" in ablation.table(alone)


# ---- set_weight -----------------------------------------------------------------------------
def _raw_set_weight(session, name, dtype, shape, array):
    dims = (ctypes.c_int64 * len(shape))(*shape)
    data = None if array is None else ctypes.c_void_p(array.ctypes.data)
    return session.lib.og_set_weight(session.handle, name.encode(), dtype, len(shape), dims, data)


def test_bad_set_weight_changes_neither_residency_nor_uploaded_bytes():
    config, tensors = synthetic("tiny-dense")
    target = "model.layers.1.mlp.down_proj.weight"
    rows, cols = tensors[target].shape
    junk = np.full((rows, cols), 3.0, ml_dtypes.bfloat16)
    hidden = config.hidden_size
    cases = [  # (name, dtype, shape, data, status)
        ("model.layers.9.mlp.down_proj.weight", capi.OG_DTYPE_BF16, (rows, cols), junk, capi.OG_E_UNKNOWN_WEIGHT),
        ("model.layers.1.mlp.down_proj", capi.OG_DTYPE_BF16, (rows, cols), junk, capi.OG_E_UNKNOWN_WEIGHT),
        (target, capi.OG_DTYPE_F32, (rows, cols), np.full((rows, cols), 3.0, np.float32), capi.OG_E_WEIGHT_MISMATCH),
        (target, capi.OG_DTYPE_BF16, (cols, rows), np.ascontiguousarray(junk.T), capi.OG_E_WEIGHT_MISMATCH),
        (target, capi.OG_DTYPE_BF16, (rows * cols,), junk.reshape(-1), capi.OG_E_WEIGHT_MISMATCH),
        (target, capi.OG_DTYPE_BF16, (rows, cols + 1), np.full((rows, cols + 1), 3.0, ml_dtypes.bfloat16),
         capi.OG_E_WEIGHT_MISMATCH),
        (target, 9, (rows, cols), junk, capi.OG_E_INVALID_ARGUMENT),
        (target, capi.OG_DTYPE_BF16, (rows, cols), None, capi.OG_E_INVALID_ARGUMENT),
        ("model.norm.weight", capi.OG_DTYPE_I8, (hidden,), np.full(hidden, 3, np.int8), capi.OG_E_WEIGHT_MISMATCH),
        ("model.norm.weight", capi.OG_DTYPE_F32, (hidden + 1,), np.ones(hidden + 1, np.float32),
         capi.OG_E_WEIGHT_MISMATCH),
    ]
    session = GpuSession(config, tensors.items(), kv="int8", max_seq_len=32)
    try:
        before = _session_decode(session, PROMPT[:6])
        for name, dtype, shape, data, status in cases:
            assert _raw_set_weight(session, name, dtype, shape, data) == status, (name, dtype, shape)
            message = capi.last_error()
            assert name in message, message
            session.precheck()               # every tensor still resident
            assert session.position == 6     # and the sequence where it was
        after = _session_decode(session, PROMPT[:6])
        for i, (a, b) in enumerate(zip(before, after)):
            assert np.array_equal(a, b), f"step {i}: the uploaded weights changed"
    finally:
        session.close()

    # A missing tensor stays missing after a refused upload of it.
    session = GpuSession(config, tensors.items(), kv="int8", max_seq_len=32, omit_weights={target})
    try:
        assert _raw_set_weight(session, target, capi.OG_DTYPE_BF16, (cols, rows),
                               np.ascontiguousarray(junk.T)) == capi.OG_E_WEIGHT_MISMATCH
        with pytest.raises(capi.LibraryError) as err:
            session.precheck()
        assert err.value.status == capi.OG_E_MISSING_WEIGHT and target in str(err.value)
    finally:
        session.close()


# ---- hit-only: every step entry before all weights are resident ------------------------------
def test_every_step_entry_refuses_a_missing_weight_and_changes_nothing(hooks):
    config, tensors = synthetic("tiny-moe")
    missing = "model.layers.2.mlp.experts.5.up_proj.weight"
    session = GpuSession(config, tensors.items(), kv="int8", max_seq_len=16, omit_weights={missing})
    try:
        lib, h = session.lib, session.handle
        kv_before = ct.kv_cache_bytes(session)
        logits_before = session.logits_view.copy()
        stats_before = session.stats()
        record_before = ct.step_record(h)
        out = ctypes.POINTER(ctypes.c_float)()
        assert lib.og_precheck(h) == capi.OG_E_MISSING_WEIGHT
        assert missing in capi.last_error()
        assert lib.og_begin_step(h, 5) == capi.OG_E_MISSING_WEIGHT
        assert lib.og_run(h) == capi.OG_E_BAD_STATE       # the step was never begun
        assert lib.og_end_step(h) == capi.OG_E_BAD_STATE
        assert lib.og_step(h, 5, ctypes.byref(out)) == capi.OG_E_MISSING_WEIGHT
        assert not out                                     # no logits handed out
        assert lib.og_enqueue(h, None) == capi.OG_E_MISSING_WEIGHT
        with pytest.raises(capi.LibraryError):
            session.capture()                              # the graph path refuses too
        assert session.graph is None
        assert ct.kv_cache_bytes(session) == kv_before
        assert np.array_equal(session.logits_view, logits_before)
        assert ct.step_record(h) == record_before
        assert session.position == 0
        stats = session.stats()
        assert stats["steps"] == stats_before["steps"] and stats["enqueues"] == stats_before["enqueues"]
        hooks.check_guards(h)
        session.set_weight(missing, tensors[missing])
        assert lib.og_step(h, 5, ctypes.byref(out)) == capi.OG_OK and session.position == 1
    finally:
        session.close()


# ---- bad requests through the Engine on the GPU -----------------------------------------------
def test_engine_bad_requests_on_gpu_change_nothing(hooks):
    config, tensors = synthetic("tiny-dense")
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=24, device="gpu") as engine, \
            Engine.from_tensors(config, tensors, kv="int8", max_seq_len=24, device="gpu") as twin:
        engine.prefill(PROMPT[:5])
        kv_before = ct.kv_cache_bytes(engine._gpu)
        bad_calls = [
            (lambda: engine.step(-1), "outside the vocabulary"),
            (lambda: engine.step(config.vocab_size), "outside the vocabulary"),
            (lambda: engine.prefill([]), "empty prompt"),
            (lambda: engine.generate([], 3), "empty prompt"),
            (lambda: engine.prefill([1] * 20), "does not fit"),
            (lambda: engine.prefill([1, config.vocab_size]), "outside the vocabulary"),
        ]
        for call, text in bad_calls:
            with pytest.raises(EngineError, match=text):
                call()
            assert engine.position == 5
        # The library refuses on its own too (the Python checks are not the only guard).
        for token in (-1, config.vocab_size, 2**31 - 1):
            with pytest.raises(capi.LibraryError) as err:
                engine._gpu.begin(token)
            assert err.value.status == capi.OG_E_TOKEN_OUT_OF_RANGE
        assert ct.kv_cache_bytes(engine._gpu) == kv_before
        got = engine.step(PROMPT[5])
        twin.prefill(PROMPT[:5])  # the same batched prefill, then the same step
        want = twin.step(PROMPT[5])
        assert np.array_equal(got, want)
        assert engine.backend == "gpu-graph" and engine.stats()["graph_failures"] == 0
        hooks.check_guards(engine._gpu.handle)


def test_check_weights_refuses_nan_on_the_gpu_path_and_releases_everything(hooks):
    config, tensors = synthetic("tiny-dense")
    name = "model.layers.2.self_attn.v_proj.weight"
    bad = _poisoned(tensors, name, (1, 1), np.nan)
    before = hooks.allocation_counts()
    with pytest.raises(EngineError, match=name):
        Engine.from_tensors(config, bad, kv="int8", max_seq_len=16, device="gpu", check_weights=True)
    after = hooks.allocation_counts()
    assert (after["device_live"], after["pinned_live"]) == (before["device_live"], before["pinned_live"])


# ---- capture failures ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["thread_local", "global"])
@pytest.mark.parametrize("kind", ["malloc", "sync"])
def test_illegal_call_during_capture_is_detected_and_the_step_still_right(hooks, watchdog, kind, mode):
    config, tensors = synthetic("tiny-dense")
    n_new = 24
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="gpu") as plain:
        want = _decode(plain.step, PROMPT, n_new)
        assert plain.stats()["graph_failures"] == 0
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="gpu") as engine:
        engine._gpu.capture_mode = mode
        engine.recapture_after = 4
        hooks.set_capture_fault(kind, 1)
        try:
            got = _decode(engine.step, PROMPT, n_new)
        finally:
            hooks.set_capture_fault("none", 0)
        st = engine.stats()
        assert engine._gpu.graph is not None  # captured again after the failure
        hooks.check_guards(engine._gpu.handle)
        error = engine.last_graph_error
    _assert_same(got, want)  # every step, the failed one included, as undisturbed
    total = len(PROMPT) + n_new
    assert st["graph_failures"] == 1
    assert st["nongraph_steps"] == 1 + 4                 # the failed step, then the wait
    assert st["graph_steps"] == total - 5 and st["captures"] == 1
    assert error
    if kind == "malloc":
        assert "cudaMalloc" in error and "og_enqueue" in error, error


def test_capture_fault_hook_fires_only_while_capturing(hooks, watchdog):
    config, tensors = synthetic("tiny-dense")
    session = GpuSession(config, tensors.items(), kv="int8", max_seq_len=16)
    try:
        hooks.set_capture_fault("malloc", 1)
        _session_decode(session, PROMPT[:2])                            # og_run: never capturing
        assert session.lib.og_enqueue(session.handle, None) == capi.OG_OK  # own stream, not capturing
        ct.kv_cache_bytes(session)  # synchronizes the engine's stream before the next step
        session.begin(PROMPT[2])
        with pytest.raises(capi.LibraryError) as err:
            session.capture()
        assert "cudaMalloc" in str(err.value)
        assert session.graph is None and session.captures == 0
        session.capture().replay()                                      # the fault is spent
        logits = session.end()
        assert session.captures == 1 and np.isfinite(logits).all()
    finally:
        hooks.set_capture_fault("none", 0)
        session.close()


# ---- allocation failures in og_init ----------------------------------------------------------
def _config_33mib(lib) -> capi.OgConfig:
    cfg = capi.OgConfig()
    lib.og_config_default(ctypes.byref(cfg))
    for key, value in dict(vocab_size=32768, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, qk_norm=1,
                           max_seq_len=1024, kv_dtype=capi.OG_KV_INT8).items():
        setattr(cfg, key, value)
    return cfg


def test_allocation_failure_at_each_init_allocation_is_clean_and_leaks_nothing(hooks, watchdog):
    lib = capi.load_library()
    cfg = _config_33mib(lib)
    handle = capi.Handle()
    # Warm up (context, kernel modules, driver bookkeeping) before taking the baseline.
    assert lib.og_init(ctypes.byref(cfg), ctypes.byref(handle)) == capi.OG_OK, capi.last_error()
    assert lib.og_free(handle) == capi.OG_OK
    base_counts, base_free = hooks.allocation_counts(), device_free_bytes()

    assert lib.og_init(ctypes.byref(cfg), ctypes.byref(handle)) == capi.OG_OK
    held = hooks.allocation_counts()
    n_allocations = held["calls"] - base_counts["calls"]
    assert held["device_bytes_live"] - base_counts["device_bytes_live"] > 32 << 20
    check_free = not gpu_shared_with_other_workers()
    if check_free:
        assert base_free - device_free_bytes() > 32 << 20
    assert lib.og_free(handle) == capi.OG_OK
    assert n_allocations >= 3  # the arena, the pinned step record, the pinned logits

    live_keys = ("device_live", "pinned_live", "device_bytes_live", "pinned_bytes_live")
    for n in range(n_allocations):
        handle = capi.Handle(12345)
        hooks.fail_allocation_at(n)
        try:
            status = lib.og_init(ctypes.byref(cfg), ctypes.byref(handle))
        finally:
            hooks.fail_allocation_at(-1)
        message = capi.last_error()
        assert status == capi.OG_E_OUT_OF_MEMORY, (n, status, message)
        assert "out of memory" in message, message
        assert not handle.value
        counts = hooks.allocation_counts()
        assert counts["calls"] - base_counts["calls"] >= n + 1
        assert {k: counts[k] for k in live_keys} == {k: base_counts[k] for k in live_keys}, (n, message)
        if check_free:
            moved = base_free - device_free_bytes()
            assert abs(moved) <= FREE_MEMORY_SLACK_BYTES, f"allocation {n}: {moved} bytes not returned"
            print(f"allocation {n} of {n_allocations} failed: OG_E_OUT_OF_MEMORY ({message}); "
                  f"device free moved {moved} bytes")

    # Armed just past the last allocation: init succeeds and the failure never fires.
    hooks.fail_allocation_at(n_allocations)
    try:
        assert lib.og_init(ctypes.byref(cfg), ctypes.byref(handle)) == capi.OG_OK
    finally:
        hooks.fail_allocation_at(-1)
    assert lib.og_free(handle) == capi.OG_OK


def test_allocation_failure_through_the_engine_raises_and_leaks_nothing(hooks):
    config, tensors = synthetic("tiny-dense")
    before = hooks.allocation_counts()
    for n in (0, 1, 2):
        hooks.fail_allocation_at(n)
        try:
            with pytest.raises(capi.LibraryError) as err:
                GpuSession(config, tensors.items(), kv="int8", max_seq_len=32)
        finally:
            hooks.fail_allocation_at(-1)
        assert err.value.status == capi.OG_E_OUT_OF_MEMORY
        after = hooks.allocation_counts()
        assert (after["device_live"], after["pinned_live"]) == (before["device_live"], before["pinned_live"])
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=32, device="gpu") as engine:
        engine.prefill(PROMPT[:3])  # and the library still works


# ---- threads ----------------------------------------------------------------------------------
@pytest.mark.parametrize("graph", [True, False], ids=["graph", "nongraph"])
def test_two_handles_in_two_threads_decode_as_each_alone(hooks, watchdog, graph):
    models = {"dense": synthetic("tiny-dense"), "moe": synthetic("tiny-moe")}
    n_new, rounds = 48, 3

    def make(key):
        config, tensors = models[key]
        return Engine.from_tensors(config, tensors, kv="int8", max_seq_len=128, device="gpu", graph=graph)

    alone = {}
    for key in models:
        with make(key) as engine:
            alone[key] = _decode(engine.step, PROMPT, n_new)

    engines = {key: make(key) for key in models}
    barrier = threading.Barrier(len(engines))
    results = {key: [] for key in engines}
    errors = {}

    def worker(key):
        try:
            engine = engines[key]
            barrier.wait()
            for _ in range(rounds):
                engine.reset()
                results[key].append(_decode(engine.step, PROMPT, n_new))
        except BaseException as e:  # reported by the main thread
            errors[key] = e

    threads = [threading.Thread(target=worker, args=(key,)) for key in engines]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=HANG_LIMIT_S - 30)
        assert not any(t.is_alive() for t in threads), "a decode thread did not finish"
        assert not errors, errors
        for key, engine in engines.items():
            assert len(results[key]) == rounds
            for r in results[key]:
                _assert_same(r, alone[key])
            st = engine.stats()
            assert st["graph_failures"] == 0
            if graph:
                assert st["captures"] == 1 and st["nongraph_steps"] == 0
            hooks.check_guards(engine._gpu.handle)
    finally:
        for engine in engines.values():
            engine.close()
