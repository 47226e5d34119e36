"""Reliability on any machine (issue 9): every handle-taking entry point refuses NULL and
unknown handles, the binding mirrors the headers, engine allocations go through the counted
wrappers that fault injection reaches, the fault hooks validate their arguments, bad requests
and non-finite weights are refused with state unchanged, and the Engine's graph-failure logic
(run the step un-captured, capture again later) holds against a stand-in GPU session.

The GPU half is tests/test_reliability_gpu.py.
"""
from __future__ import annotations

import ctypes
import pathlib
import re

import ml_dtypes
import types

import numpy as np
import pytest

from gpu_support import build_library_or_skip, synthetic
from onegraph import capi
from onegraph.engine import Engine, EngineError, check_finite
from onegraph.graph import GraphError
from onegraph.reference import ReferenceDecoder

ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA = ROOT / "cuda"
HEADERS = {"onegraph.h": CUDA / "onegraph.h", "onegraph_testing.h": CUDA / "onegraph_testing.h"}
PROMPT = [3, 17, 99, 250, 4, 61, 200, 8]


def _strip_c_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def exported_functions(header: pathlib.Path) -> list[str]:
    return re.findall(r"OG_API\s+[\w\s\*]+?\b(og_\w+)\s*\(", _strip_c_comments(header.read_text()))


def handle_functions(header: pathlib.Path) -> list[str]:
    """Exported functions whose first parameter is an engine handle (og_engine *e)."""
    return re.findall(r"OG_API\s+og_status\s+(og_\w+)\s*\(\s*og_engine\s*\*\s*\w+",
                      _strip_c_comments(header.read_text()))


@pytest.fixture(scope="module")
def lib():
    build_library_or_skip()
    try:
        library = capi.load_library()
    except capi.LibraryUnavailable as e:
        pytest.fail(f"the library does not load: {e}")
    import capi_testing
    capi_testing.load()
    capi_testing.reliability()
    return library


@pytest.fixture(scope="module")
def tiny():
    return synthetic("tiny-dense")


# ---- the C ABI: handles and bindings ------------------------------------------------------
def _zero_args(f) -> list:
    """A NULL / zero value for every parameter after the handle, from the bound argtypes."""
    args = []
    for t in f.argtypes[1:]:
        if t in (ctypes.c_void_p, ctypes.c_char_p) or (isinstance(t, type) and issubclass(t, ctypes._Pointer)):
            args.append(None)
        else:
            args.append(t())
    return args


def _all_handle_functions() -> list[str]:
    return sorted({name for h in HEADERS.values() for name in handle_functions(h)})


def test_the_header_scan_finds_the_handle_functions():
    names = _all_handle_functions()
    for expected in ("og_set_weight", "og_begin_step", "og_enqueue", "og_run", "og_free",
                     "og_test_copy_kv_cache", "og_check_guards", "og_test_corrupt_guard"):
        assert expected in names
    assert "og_init" not in names and "og_open_packed" not in names  # og_engine **out


@pytest.mark.parametrize("header", sorted(HEADERS))
def test_every_exported_function_is_bound(lib, header):
    unbound = [n for n in exported_functions(HEADERS[header]) if getattr(lib, n).argtypes is None]
    assert not unbound, (f"{header} declares {unbound} but runtime/capi.py or tests/capi_testing.py "
                         f"does not bind them (argtypes/restype)")


@pytest.mark.parametrize("name", _all_handle_functions())
def test_null_handle_is_refused_by_every_handle_function(lib, name):
    f = getattr(lib, name)
    assert f.argtypes is not None, f"{name} is not bound"
    assert f(None, *_zero_args(f)) == capi.OG_E_INVALID_HANDLE
    assert "NULL engine handle" in capi.last_error()


@pytest.mark.parametrize("name", _all_handle_functions())
def test_unknown_handle_is_refused_by_every_handle_function(lib, name):
    # Never returned by og_init: looked up in the live-handle registry, never dereferenced.
    # A freed handle takes the same path (tests/test_reliability_gpu.py frees a real one).
    f = getattr(lib, name)
    assert f(ctypes.c_void_p(0xDEADBEEF0), *_zero_args(f)) == capi.OG_E_INVALID_HANDLE
    assert "not a live engine handle" in capi.last_error()


RAW_ALLOCATION = re.compile(
    r"\bcuda(Malloc|MallocHost|HostAlloc|MallocManaged|MallocAsync|MallocPitch|Malloc3D|"
    r"Free|FreeHost|FreeAsync)\s*\(")
# Files whose raw allocations are not the engine's: the allocation wrappers themselves and the
# kernel test entry points of the testing library (which allocate scratch buffers per call).
RAW_ALLOCATION_ALLOWED = {"reliability.cu", "testing.cu", "moe_testing.cu"}


def test_engine_allocations_go_through_the_counted_wrappers():
    offenders = []
    for path in sorted(list(CUDA.glob("*.cu")) + list(CUDA.glob("*.c"))):
        if path.name in RAW_ALLOCATION_ALLOWED:
            continue
        for number, line in enumerate(_strip_c_comments(path.read_text()).splitlines(), 1):
            if RAW_ALLOCATION.search(line):
                offenders.append(f"{path.name}:{number}: {line.strip()}")
    assert not offenders, ("allocate with og::device_alloc / og::pinned_alloc and release with "
                           "og::device_free / og::pinned_free (cuda/reliability.cuh) so that "
                           "og_test_fail_allocation_at reaches every allocation:\n" + "\n".join(offenders))


def test_fault_hooks_validate_their_arguments(lib):
    import capi_testing
    with pytest.raises(capi.LibraryError) as err:
        capi_testing.fail_allocation_at(-2)
    assert err.value.status == capi.OG_E_INVALID_ARGUMENT and "n=-2" in str(err.value)
    assert lib.og_test_set_capture_fault(7, 1) == capi.OG_E_INVALID_ARGUMENT
    assert "kind=7" in capi.last_error()
    assert lib.og_test_set_capture_fault(capi_testing.OG_TEST_CAPTURE_FAULT_SYNC, -1) == capi.OG_E_INVALID_ARGUMENT
    capi_testing.set_capture_fault("none", 0)
    capi_testing.fail_allocation_at(5)
    capi_testing.fail_allocation_at(-1)
    counts = capi_testing.allocation_counts()
    assert set(counts) == {"calls", "device_live", "pinned_live", "device_bytes_live", "pinned_bytes_live"}
    assert all(v >= 0 for v in counts.values())
    # Every output pointer may be NULL.
    assert lib.og_test_allocation_counts(None, None, None, None, None) == capi.OG_OK


def test_corrupted_status_has_a_name(lib):
    assert capi.STATUS_NAMES[capi.OG_E_CORRUPTED] == "OG_E_CORRUPTED"
    assert re.search(r"#define\s+OG_E_CORRUPTED\s+-14\b", HEADERS["onegraph.h"].read_text())


# ---- bad requests to the Engine (CPU path) ------------------------------------------------
def test_bad_prompts_are_refused_and_change_nothing(tiny):
    config, tensors = tiny
    with Engine.from_tensors(config, tensors, device="cpu", max_seq_len=16) as engine:
        engine.prefill(PROMPT[:3])
        expected = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=16)
        expected.prefill(PROMPT[:3])
        want = expected.step(PROMPT[3])
        bad_calls = [
            (lambda: engine.prefill([]), "empty prompt"),
            (lambda: engine.generate([], 4), "empty prompt"),
            (lambda: engine.prefill([1] * 14), "does not fit"),
            (lambda: engine.generate([1] * 10, 8), "exceeds max_seq_len"),
            (lambda: engine.prefill([1, 2, config.vocab_size]), "outside the vocabulary"),
            (lambda: engine.prefill([1, -1]), "outside the vocabulary"),
            (lambda: engine.generate([1, config.vocab_size + 7], 2), "outside the vocabulary"),
            (lambda: engine.step(-1), "outside the vocabulary"),
            (lambda: engine.step(config.vocab_size), "outside the vocabulary"),
            (lambda: engine.step("7"), "outside the vocabulary"),
        ]
        for call, text in bad_calls:
            with pytest.raises(EngineError, match=text):
                call()
            assert engine.position == 3  # nothing was fed, not even the valid prefix
        np.testing.assert_array_equal(engine.step(PROMPT[3]), want)


def test_full_context_is_refused_until_reset(tiny):
    config, tensors = tiny
    with Engine.from_tensors(config, tensors, device="cpu", max_seq_len=5) as engine:
        first = engine.prefill(PROMPT[:5])
        with pytest.raises(EngineError, match="context is full"):
            engine.step(1)
        assert engine.position == 5
        engine.reset()
        np.testing.assert_array_equal(engine.prefill(PROMPT[:5]), first)


# ---- NaN / Inf in weights (check_weights=True) ----------------------------------------------
def _poisoned(tensors, name, index, value):
    out = dict(tensors)
    array = np.array(tensors[name], copy=True)
    array[index] = value
    out[name] = array
    return out


@pytest.mark.parametrize("name,index,value", [
    ("model.layers.1.mlp.down_proj.weight", (3, 5), np.nan),
    ("model.layers.0.self_attn.q_proj.weight", (0, 0), np.inf),
    ("model.embed_tokens.weight", (7, 2), -np.inf),
    ("model.norm.weight", (4,), np.nan),
])
def test_check_weights_refuses_non_finite_tensors_by_name(tiny, name, index, value):
    config, tensors = tiny
    bad = _poisoned(tensors, name, index, value)
    with pytest.raises(EngineError) as err:
        Engine.from_tensors(config, bad, device="cpu", max_seq_len=16, check_weights=True)
    message = str(err.value)
    assert message.startswith(f"{name}: 1 non-finite value")
    assert f"at index {index}" in message and "check_weights=True" in message
    # Without the check the engine is built (the scan is opt-in).
    Engine.from_tensors(config, bad, device="cpu", max_seq_len=16).close()


def test_check_weights_accepts_finite_models_and_integer_data(tiny):
    config, tensors = tiny
    with Engine.from_tensors(config, tensors, device="cpu", max_seq_len=16, check_weights=True) as engine:
        engine.prefill(PROMPT[:2])
    check_finite("int8 codes", np.full((4, 4), -128, np.int8))
    check_finite("q4 bytes", np.full(16, 255, np.uint8))


def test_check_finite_counts_across_chunks():
    a = np.zeros((10, 10), ml_dtypes.bfloat16)
    a[2, 3] = np.nan
    a[9, 9] = np.inf
    with pytest.raises(EngineError, match=r"t: 2 non-finite value\(s\) of 100, the first nan at index \(2, 3\)"):
        check_finite("t", a, chunk_elems=7)


# ---- graph failures: the Engine's logic against a stand-in session --------------------------
class _FakeGraph:
    def __init__(self, session):
        self.session = session

    def replay(self):
        self.launch()

    def launch(self, stream=None):
        s = self.session
        if s.fail_replays > 0:
            s.fail_replays -= 1
            raise GraphError("cudaGraphLaunch failed: stand-in failure")
        s.run_nongraph()
        s.replays += 1

    def synchronize(self):
        pass

    def memcpy_directions(self):
        return {"HostToDevice": 1, "DeviceToHost": 1}

    def close(self):
        self.session.closed_graphs += 1


class _FakeSession:
    """The GpuSession surface Engine._gpu_step and Engine.decode_greedy use, computing with the
    numpy reference. Steps run when launched (or run un-captured); `pending` holds the begun
    steps not ended, oldest first: {"token": id or OG_TOKEN_PREVIOUS_ARGMAX, "logits": once run}."""

    def __init__(self, config, tensors):
        self.ref = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=64)
        self.graph = None
        self.graph_copies = None
        self.captures = self.replays = self.closed_graphs = 0
        self.fail_captures = self.fail_replays = 0
        self.token = None
        self.logits = None
        self.enqueues = 0
        self.output = "logits"
        self.pending = []
        self.refuse_chained = 0  # begin_chained refusals to come (og_begin_chained_step's errors)
        self.chained = 0         # chained steps begun
        self.pool = types.SimpleNamespace(reserve=lambda seq, n: None)  # blocks are not modelled

    def set_output(self, output):
        self.output = output

    def begin(self, token):
        self.token = token
        self.pending = [{"token": token, "logits": None}]

    def begin_chained(self):
        if self.refuse_chained > 0:
            self.refuse_chained -= 1
            raise capi.LibraryError(capi.OG_E_POOL_EXHAUSTED, "no free KV block (stand-in)", "og_begin_chained_step")
        assert len(self.pending) == 1 and self.output == "next_token"
        self.pending.append({"token": capi.OG_TOKEN_PREVIOUS_ARGMAX, "logits": None})
        self.chained += 1
        return self.chained % 2

    def launch(self, slot):
        self.capture(slot).launch()

    def wait(self, slot):
        pass

    def drain(self):
        pass

    def cancel(self):
        step = self.pending.pop()
        if step["logits"] is not None:  # it ran: its row lies past the length now
            self.ref._position -= 1

    def capture(self, slot=0):
        if self.graph is None:
            if self.fail_captures > 0:
                self.fail_captures -= 1
                raise capi.LibraryError(capi.OG_E_CUDA, "cudaMalloc (injected) failed: operation not "
                                        "permitted when stream is capturing", "og_enqueue")
            self.graph = _FakeGraph(self)
            self.captures += 1
            self.enqueues += 1
        return self.graph

    def drop_graph(self):
        if self.graph is not None:
            self.graph.close()
            self.graph = None

    def run_nongraph(self):
        step = self.pending[-1]
        token = step["token"]
        if token == capi.OG_TOKEN_PREVIOUS_ARGMAX:  # the step before's argmax, "on the device"
            token = int(np.argmax(self.pending[-2]["logits"]))
        step["logits"] = self.logits = self.ref.step(token)

    def end(self):
        logits = self.pending.pop(0)["logits"]
        if self.output == "logits":
            return logits.copy()
        best = int(np.argmax(logits))
        return best, float(logits[best])

    def reset(self):
        self.ref.reset()

    def stats(self):
        return {"h2d_copies": self.enqueues, "d2h_copies": self.enqueues}

    def close(self):
        self.drop_graph()


def _engine_on_fake_gpu(config, tensors):
    engine = Engine.from_tensors(config, tensors, device="cpu", max_seq_len=64)
    engine._cpu = None
    engine._gpu = _FakeSession(config, tensors)
    return engine


@pytest.mark.parametrize("failure", ["capture", "replay"])
def test_graph_failure_runs_the_step_uncaptured_then_captures_again(tiny, failure):
    config, tensors = tiny
    ref = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=64)
    want = [ref.step(t) for t in PROMPT * 3]
    engine = _engine_on_fake_gpu(config, tensors)
    engine.recapture_after = 4
    fake = engine._gpu
    for i, t in enumerate(PROMPT * 3):
        if i == 2:
            if failure == "capture":
                fake.drop_graph()
                fake.fail_captures = 1
            else:
                fake.fail_replays = 1
        np.testing.assert_array_equal(engine.step(t), want[i])
    st = engine.stats()
    assert st["graph_failures"] == 1
    assert "stand-in" in engine.last_graph_error or "injected" in engine.last_graph_error
    # Step 2 failed and ran un-captured, steps 3..6 ran un-captured, step 7 captured again.
    assert st["nongraph_steps"] == 1 + engine.recapture_after
    assert st["graph_steps"] == len(PROMPT) * 3 - st["nongraph_steps"]
    assert fake.captures == 2 and st["captures"] == 2
    assert fake.closed_graphs >= 1


def test_recapture_waits_count_steps_across_resets(tiny):
    # The wait is counted in steps, so a reset (position back to 0) cannot postpone it forever.
    config, tensors = tiny
    engine = _engine_on_fake_gpu(config, tensors)
    engine.recapture_after = 3
    fake = engine._gpu
    fake.fail_captures = 1
    engine.step(PROMPT[0])
    for t in PROMPT[1:4]:
        engine.reset()
        engine.step(t)
    assert fake.captures == 0
    engine.reset()
    engine.step(PROMPT[4])
    assert fake.captures == 1 and engine.stats()["graph_steps"] == 1


def test_graph_failure_other_than_graph_or_library_errors_propagates(tiny):
    config, tensors = tiny
    engine = _engine_on_fake_gpu(config, tensors)

    def broken():
        raise KeyError("a bug, not a CUDA failure")

    engine._gpu.capture = broken
    with pytest.raises(KeyError):
        engine.step(PROMPT[0])
    assert engine.position == 0


def test_greedy_steps_take_the_next_token_output(tiny):
    # Engine.step_greedy asks the session for output "next_token" (the device argmax) and returns
    # the token: the same tokens as the logits path.
    config, tensors = tiny
    ref = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=64)
    logits = [ref.step(t) for t in PROMPT]
    want = [int(np.argmax(l)) for l in logits]
    engine = _engine_on_fake_gpu(config, tensors)
    outputs = []
    set_output = engine._gpu.set_output
    engine._gpu.set_output = lambda output: (outputs.append(output), set_output(output))
    assert [engine.step_greedy(t) for t in PROMPT] == want
    assert set(outputs) == {"next_token"}
    engine.reset()
    np.testing.assert_array_equal(engine.step(PROMPT[0]), logits[0])  # back to the logits output
    assert outputs[-1] == "logits"



def test_greedy_step_refuses_nan_logits(tiny):
    config, tensors = tiny
    engine = _engine_on_fake_gpu(config, tensors)
    fake = engine._gpu
    run = fake.run_nongraph

    def nan_logits():
        run()
        fake.logits[5] = np.nan

    fake.run_nongraph = nan_logits
    with pytest.raises(ValueError, match="NaN"):
        engine.step_greedy(PROMPT[0])
    assert engine.position == 1  # the step was fed, as step() followed by sample() would have


# ---- pipelined greedy steps (Engine.decode_greedy) against the stand-in session ---------------
def _serial_greedy(config, tensors, first, n):
    """The step-by-step reference: n greedy tokens after the prompt, each fed in turn."""
    ref = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=64)
    for t in PROMPT:
        ref.step(t)
    out, token = [], first
    for _ in range(n):
        token = int(np.argmax(ref.step(token)))
        out.append(token)
    return out


def _prompted_fake_engine(config, tensors):
    engine = _engine_on_fake_gpu(config, tensors)
    logits = None
    for t in PROMPT:
        logits = engine.step(t)
    return engine, int(np.argmax(logits))


def test_decode_greedy_pipelines_the_step_by_step_tokens_and_state(tiny):
    config, tensors = tiny
    engine, first = _prompted_fake_engine(config, tensors)
    want = _serial_greedy(config, tensors, first, 12)
    seen = []
    assert engine.decode_greedy(first, 12, on_token=seen.append) == want == seen
    # 12 steps fed (first and want[:11]); the last token is not fed; 11 steps were chained.
    assert engine.position == len(PROMPT) + 12 == engine._gpu.ref.position
    assert engine._history[len(PROMPT):] == [first] + want[:11]
    assert engine._gpu.chained == 11 and engine._gpu.pending == []
    st = engine.stats()
    assert st["graph_steps"] == len(PROMPT) + 12 and st["nongraph_steps"] == 0


def test_decode_greedy_stop_token_drops_the_step_launched_after_it(tiny):
    config, tensors = tiny
    engine, first = _prompted_fake_engine(config, tensors)
    want = _serial_greedy(config, tensors, first, 12)
    k = want.index(want[5])
    assert engine.decode_greedy(first, 12, stop_token_ids=[want[5]]) == want[:k + 1]
    # k + 1 steps fed; the chained step that consumed the stop token ran and was dropped.
    assert engine.position == len(PROMPT) + k + 1 == engine._gpu.ref.position
    assert engine._gpu.pending == []
    # Decoding goes on from exactly the state a step-by-step decode leaves.
    ref = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=64)
    for t in PROMPT + [first] + want[:k]:
        ref.step(t)
    np.testing.assert_array_equal(engine.step(want[k]), ref.step(want[k]))


def test_decode_greedy_goes_on_step_by_step_after_a_refused_chained_step(tiny):
    config, tensors = tiny
    engine, first = _prompted_fake_engine(config, tensors)
    want = _serial_greedy(config, tensors, first, 8)
    engine._gpu.refuse_chained = 1  # the first chained step is refused (e.g. no free KV block)
    assert engine.decode_greedy(first, 8) == want
    assert engine.position == len(PROMPT) + 8 == engine._gpu.ref.position
    assert engine._gpu.chained == 0  # the rest went step by step, as step_greedy


@pytest.mark.parametrize("failure", ["launch", "capture"])
def test_decode_greedy_graph_failure_continues_uncaptured_with_the_same_tokens(tiny, failure):
    config, tensors = tiny
    engine, first = _prompted_fake_engine(config, tensors)
    engine.recapture_after = 3
    want = _serial_greedy(config, tensors, first, 10)
    fake = engine._gpu

    def fail_a_launch(token):
        if token == want[2]:
            if failure == "launch":
                fake.fail_replays = 1  # the next launch: the chained step after want[3]'s
            else:
                fake.drop_graph()      # the next launch captures again, and that fails
                fake.fail_captures = 1
    assert engine.decode_greedy(first, 10, on_token=fail_a_launch) == want
    assert engine.position == len(PROMPT) + 10 == fake.ref.position
    st = engine.stats()
    assert st["graph_failures"] == 1 and st["nongraph_steps"] >= 1
    assert "stand-in" in engine.last_graph_error or "injected" in engine.last_graph_error


def test_decode_greedy_error_in_on_token_keeps_only_the_ended_steps(tiny):
    config, tensors = tiny
    engine, first = _prompted_fake_engine(config, tensors)
    want = _serial_greedy(config, tensors, first, 10)
    seen = []

    def on_token(token):
        seen.append(token)
        if len(seen) == 4:
            raise RuntimeError("the caller's callback failed")
    with pytest.raises(RuntimeError, match="callback"):
        engine.decode_greedy(first, 10, on_token=on_token)
    assert seen == want[:4]
    assert engine.position == len(PROMPT) + 4 == engine._gpu.ref.position and engine._gpu.pending == []


@pytest.mark.parametrize("stop_how", ["break", "close", "raise"])
def test_stream_stopped_early_drops_the_launched_step(tiny, stop_how):
    """A consumer of Engine.stream that stops while a chained step is in flight: the step is
    waited for and dropped (at close(), or at the engine's next call when the iterator is left
    open), the sequence holds exactly the tokens fed, and decoding goes on from there."""
    config, tensors = tiny
    engine = _engine_on_fake_gpu(config, tensors)
    engine.prefill_mode = "token"
    ref = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=64)
    first = int(np.argmax(ref.prefill(PROMPT)))
    want = [first] + _serial_greedy(config, tensors, first, 9)
    got = []
    tokens = engine.stream(PROMPT, 10, stop_token_ids=())
    try:
        for token in tokens:
            got.append(token)
            if len(got) == 5:
                if stop_how == "raise":
                    raise KeyboardInterrupt
                if stop_how == "close":
                    tokens.close()
                break
    except KeyboardInterrupt:
        pass
    assert got == want[:5] and engine._gpu.chained >= 3
    if stop_how == "close":
        assert engine._history == PROMPT + want[:4] and engine._gpu.pending == []
    for t in want[:4]:
        ref.step(t)
    np.testing.assert_array_equal(engine.step(want[4]), ref.step(want[4]))
    assert engine._history == PROMPT + want[:5] and engine._gpu.ref.position == len(PROMPT) + 5
    assert engine._gpu.pending == [] and list(tokens) == []
