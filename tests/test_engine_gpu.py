"""End-to-end decode on the GPU against the numpy reference, graph vs non-graph, transfers,
and the hit-only contract. Skipped without a usable GPU and library."""
import ctypes

import numpy as np
import pytest

from bounds import assert_below
from gpu_support import FOLD_ENV, LONG_FROM_ENV, float16_folder_runs, rel_l2, require_gpu, synthetic, tensor_core_model
from gpu_support import greedy_decode as _decode
import capi_testing as ct
from onegraph import capi
from onegraph.engine import Engine
from onegraph.session import GpuSession
from onegraph.reference import ReferenceDecoder

pytestmark = pytest.mark.gpu

# Logits relative L2 error, GPU vs reference: bounds.py, per case. With fp32 KV the two differ
# only in the order of fp32 sums (GEMV trees vs numpy's). With bf16 / int8 KV the same values
# are rounded on both sides, but a value that lands on a rounding boundary can round one way on
# the GPU and the other in numpy: one quantization step (1/127 of the head's max for int8, 2^-8
# relative for bf16) on that element. Such flips are rare, so the logits move by far less.
PROMPT = [3, 17, 99, 250, 4, 61, 200, 8, 45, 123, 7, 300, 11, 90, 150, 33]




@pytest.fixture(scope="module", autouse=True)
def _gpu():
    require_gpu()


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-llama"])
@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
def test_greedy_matches_reference(preset, kv):
    config, tensors = synthetic(preset)
    ref = ReferenceDecoder(config, tensors, kv_dtype=kv, max_seq_len=128)
    ref_tokens, ref_logits = _decode(ref.step, PROMPT, 64)
    with Engine.from_tensors(config, tensors, kv=kv, max_seq_len=128, device="gpu") as engine:
        tokens, logits = _decode(engine.step, PROMPT, 64)
    assert_below(f"engine/{preset}/kv={kv}", max(rel_l2(g, r) for g, r in zip(logits, ref_logits)))
    assert tokens == ref_tokens


def test_graph_replay_is_bit_identical_to_nongraph():
    config, tensors = synthetic("tiny-dense")
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=128, device="gpu") as engine:
        engine.set_graph(True)
        graph_tokens, graph_logits = _decode(engine.step, PROMPT, 64)
        engine.reset()
        engine.set_graph(False)
        plain_tokens, plain_logits = _decode(engine.step, PROMPT, 64)
        assert engine.stats()["graph_steps"] == len(PROMPT) + 64
    assert graph_tokens == plain_tokens
    for g, p in zip(graph_logits, plain_logits):
        assert np.array_equal(g, p)


def test_bad_rope_frequencies_are_refused_and_change_nothing():
    """og_set_rope_frequencies refuses a table of the wrong length or with a value that is not
    positive and finite, names it, and the engine decodes as before (the table the session
    uploaded at init stands)."""
    config, tensors = synthetic("tiny-llama")
    with Engine.from_tensors(config, tensors, kv="fp32", max_seq_len=128, device="gpu") as engine:
        want = _decode(engine.step, PROMPT, 16)
        engine.reset()
        session = engine._gpu
        half = config.head_dim // 2
        for values, n, text in [(np.ones(half), half - 1, f"n={half - 1}, expected head_dim / 2 = {half}"),
                                (np.array([1.0] * (half - 1) + [np.nan]), half, f"inv_freq[{half - 1}]=nan"),
                                (np.array([-1.0] + [1.0] * (half - 1)), half, "inv_freq[0]=-1")]:
            table = np.ascontiguousarray(values, np.float32)
            status = session.lib.og_set_rope_frequencies(
                session.handle, table.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n)
            assert status == capi.OG_E_INVALID_ARGUMENT and text in capi.last_error(), capi.last_error()
        got = _decode(engine.step, PROMPT, 16)
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1]):
        assert np.array_equal(g, w)


@pytest.mark.parametrize("group, fold", [(4, "auto"), (2, "tensor")], ids=["group-4", "group-2-tensor"])
def test_graph_replay_is_bit_identical_to_nongraph_across_the_attention_bands(group, fold, monkeypatch):
    # Int8 rows of 128 dims, 4 query heads a KV head (or 2, with the long band asked onto the
    # tensor cores): the short band folds on the CUDA cores, the long band (from position 100
    # here) on the tensor cores. Each band has its own graph; graph and non-graph agree bit for
    # bit on both sides, and the reference fed the same tokens picks the same token at every
    # step but a near tie (test_kernels_gpu.py bounds both folds' error against float64).
    monkeypatch.setenv(LONG_FROM_ENV, "100")
    monkeypatch.setenv(FOLD_ENV, fold)
    band = ct.BAND_LONG_TC if fold == "tensor" else ct.BAND_LONG
    assert not ct.attention_plan(2 * group, 2, 128, 100, ct.OG_KV_INT8, band=ct.BAND_SHORT)["tensor_cores"]
    assert ct.attention_plan(2 * group, 2, 128, 256, ct.OG_KV_INT8, band=band)["tensor_cores"]
    config, tensors = tensor_core_model(group=group)
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=256, device="gpu") as engine:
        engine.set_graph(True)
        graph_tokens, graph_logits = _decode(engine.step, PROMPT, 200)
        assert {key[2] for key in engine._gpu._graphs} == {0, 1}
        engine.reset()
        engine.set_graph(False)
        plain_tokens, plain_logits = _decode(engine.step, PROMPT, 200)
    assert graph_tokens == plain_tokens
    for g, p in zip(graph_logits, plain_logits):
        assert np.array_equal(g, p)
    ref = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=256)
    ref_logits = [ref.step(t) for t in PROMPT + graph_tokens[:-1]][len(PROMPT) - 1:]
    for i, (token, want) in enumerate(zip(graph_tokens, ref_logits)):  # position len(PROMPT) - 1 + i
        top = np.sort(want)[-2:]
        assert token == int(np.argmax(want)) or top[1] - top[0] < 1e-3 * np.abs(want).max(), \
            f"position {len(PROMPT) - 1 + i}"


@pytest.mark.parametrize("name, value", [(LONG_FROM_ENV, "0"), (LONG_FROM_ENV, "2k"), (FOLD_ENV, "fast")])
def test_bad_attention_settings_are_refused_by_name(name, value, monkeypatch):
    # A setting read at og_init that it cannot take fails the engine's creation with a one-line
    # error naming the variable and its value; with the setting gone the same model loads.
    monkeypatch.setenv(name, value)
    config, tensors = tensor_core_model()
    with pytest.raises(capi.LibraryError) as err:
        GpuSession(config, tensors.items(), kv="int8", max_seq_len=64)
    assert err.value.status == capi.OG_E_INVALID_ARGUMENT and f"{name}={value}" in str(err.value)
    assert "\n" not in str(err.value)
    monkeypatch.delenv(name)
    GpuSession(config, tensors.items(), kv="int8", max_seq_len=64).close()


def test_one_copy_each_way_per_token():
    config, tensors = synthetic("tiny-dense")
    # prefill="token": the prompt goes through the decode body too (one copy each way per token)
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="gpu",
                             prefill="token") as engine:
        engine.set_graph(False)
        engine.prefill(PROMPT)
        lib = engine.stats()["library"]
        assert lib["h2d_copies"] == len(PROMPT) and lib["d2h_copies"] == len(PROMPT)
        engine.set_graph(True)
        engine.step(5)
        graph = engine._gpu.graph
        kinds = graph.node_types()
        assert kinds["Memcpy"] == 2, kinds
        assert graph.memcpy_directions() == {"HostToDevice": 1, "DeviceToHost": 1}
        st = engine.stats()
        assert st["h2d_per_token"] == 1.0 and st["d2h_per_token"] == 1.0


def _d2h_bytes(graph) -> list[int]:
    """The sizes of the captured device-to-host copies."""
    return [size for direction, size in graph.memcpy_nodes() if direction == "DeviceToHost"]


@pytest.mark.parametrize("preset,weights", [("tiny-dense", "bf16"), ("tiny-dense", "q4"), ("tiny-moe", "bf16")])
def test_step_greedy_is_the_argmax_of_step_graph_and_nongraph(preset, weights):
    config, tensors = synthetic(preset)
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=128, device="gpu",
                             weights=weights) as engine:
        for graph in (True, False):
            engine.set_graph(graph)
            engine.reset()
            want, _ = _decode(engine.step, PROMPT, 32)
            engine.reset()
            for t in PROMPT[:-1]:
                engine.step(t)
            got = [engine.step_greedy(PROMPT[-1])]
            for _ in range(31):
                got.append(engine.step_greedy(got[-1]))
            assert got == want, f"graph={graph}"
        # One graph per output, each with one copy each way; the token output copies 8 bytes.
        graphs = engine._gpu._graphs
        assert set(graphs) == {("logits", 0, 0), ("next_token", 0, 0)} and engine._gpu.captures == 2
        assert _d2h_bytes(graphs["logits", 0, 0]) == [4 * config.vocab_size]
        assert _d2h_bytes(graphs["next_token", 0, 0]) == [8]
        for g in graphs.values():
            assert g.memcpy_directions() == {"HostToDevice": 1, "DeviceToHost": 1}


def test_next_token_output_gives_the_token_and_its_logit_and_refuses_bad_values():
    config, tensors = synthetic("tiny-dense")
    session = GpuSession(config, tensors.items(), kv="int8", max_seq_len=64)
    try:
        lib, h = session.lib, session.handle
        token, logit = ctypes.c_int32(7), ctypes.c_float()
        capi.check(lib.og_next_token(h, ctypes.byref(token), ctypes.byref(logit)))
        assert token.value == -1  # no next-token step yet
        assert lib.og_set_output(h, 4) == capi.OG_E_INVALID_ARGUMENT and "output=4" in capi.last_error()
        assert lib.og_next_token(h, None, None) == capi.OG_E_INVALID_ARGUMENT
        session.begin(5)
        session.run_nongraph()
        logits = session.end()  # the refused og_set_output left the logits output in place
        assert logits.shape == (config.vocab_size,)
        session.reset()
        session.set_output("next_token")
        session.begin(5)
        session.run_nongraph()
        token, logit = session.end()
        assert token == int(np.argmax(logits)) and np.float32(logit) == logits[token]
        assert session.stats()["d2h_copies"] == 2
    finally:
        session.close()


def test_hit_only_missing_weight_changes_nothing_then_cpu_fallback_matches():
    config, tensors = synthetic("tiny-dense")
    missing = "model.layers.1.mlp.down_proj.weight"
    session = GpuSession(config, tensors.items(), kv="int8", max_seq_len=64, omit_weights={missing})
    try:
        kv_before, pos_before = ct.kv_cache_bytes(session), session.position
        with pytest.raises(capi.LibraryError) as err:
            session.begin(5)
        assert err.value.status == capi.OG_E_MISSING_WEIGHT and missing in str(err.value)
        # The body itself refuses too, whoever calls it (NULL stream = the engine's own).
        assert session.lib.og_enqueue(session.handle, None) == capi.OG_E_MISSING_WEIGHT
        assert missing in capi.last_error()
        assert ct.kv_cache_bytes(session) == kv_before
        assert session.position == pos_before
        # Once the weight is resident the same handle decodes normally.
        session.set_weight(missing, tensors[missing])
        session.begin(5)
        session.run_nongraph()
        session.end()
        assert session.position == pos_before + 1
    finally:
        session.close()

    # The prompt goes through the decode body token by token on both sides, so that the
    # CPU continuation is compared with the same GPU arithmetic it replaces.
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=128, device="gpu",
                             prefill="token") as full:
        gpu_tokens = full.generate(PROMPT, 32, stop_token_ids=())
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=128, device="gpu", prefill="token",
                             omit_weights={missing}) as partial:
        tokens = partial.generate(PROMPT, 32, stop_token_ids=())
        assert partial.backend == "cpu" and "precheck" in partial.fallback_reason
    assert tokens == gpu_tokens


def test_bad_tokens_and_full_context_leave_state_unchanged():
    config, tensors = synthetic("tiny-dense")
    session = GpuSession(config, tensors.items(), kv="int8", max_seq_len=4)
    try:
        for token in (-1, config.vocab_size):
            with pytest.raises(capi.LibraryError) as err:
                session.begin(token)
            assert err.value.status == capi.OG_E_TOKEN_OUT_OF_RANGE
        for t in range(4):
            session.begin(t)
            session.run_nongraph()
            session.end()
        kv_before = ct.kv_cache_bytes(session)
        with pytest.raises(capi.LibraryError) as err:
            session.begin(1)
        assert err.value.status == capi.OG_E_CONTEXT_FULL
        assert ct.kv_cache_bytes(session) == kv_before and session.position == 4
        session.reset()
        session.begin(1)
        session.run_nongraph()
        session.end()
        assert session.position == 1
    finally:
        session.close()


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_qwen3_0_6b_shape_matches_reference(kv):
    config, tensors = synthetic("qwen3-0.6b")
    ref = ReferenceDecoder(config, tensors, kv_dtype=kv, max_seq_len=96)
    ref_tokens, ref_logits = _decode(ref.step, PROMPT, 64)
    del ref
    with Engine.from_tensors(config, tensors, kv=kv, max_seq_len=96, device="gpu") as engine:
        tokens, logits = _decode(engine.step, PROMPT, 64)
    worst = max(rel_l2(g, r) for g, r in zip(logits, ref_logits))
    print(f"qwen3-0.6b kv={kv}: worst logits rel L2 {worst:.3g}")
    assert_below(f"engine/qwen3-0.6b/kv={kv}", worst)
    assert tokens == ref_tokens


# ---- pipelined greedy steps: og_begin_chained_step, Engine.decode_greedy ----------------------
@pytest.mark.parametrize("preset,weights", [("tiny-dense", "bf16"), ("tiny-dense", "q4"), ("tiny-moe", "int8")])
def test_pipelined_greedy_is_the_step_by_step_decode(preset, weights):
    """decode_greedy launches each step before the host has read the token it consumes (the
    embedding takes it from the step before's argmax on the device): the same tokens, the same
    KV cache bytes and one copy each way per token as step_greedy one step at a time."""
    config, tensors = synthetic(preset)
    n = 40
    kw = dict(kv="int8", max_seq_len=128, device="gpu", weights=weights)
    with Engine.from_tensors(config, tensors, **kw) as serial, Engine.from_tensors(config, tensors, **kw) as piped:
        first = int(np.argmax(serial.prefill(PROMPT)))
        want, token = [], first
        for _ in range(n):
            token = serial.step_greedy(token)
            want.append(token)
        assert int(np.argmax(piped.prefill(PROMPT))) == first
        seen = []
        assert piped.decode_greedy(first, n, on_token=seen.append) == want == seen
        assert piped.position == serial.position == len(PROMPT) + n
        assert ct.kv_cache_bytes(piped._gpu) == ct.kv_cache_bytes(serial._gpu)
        # Both slots' graphs, each one copy each way (the token out: 8 bytes).
        graphs = piped._gpu._graphs
        assert set(graphs) == {("next_token", 0, 0), ("next_token", 1, 0)}
        for g in graphs.values():
            assert g.memcpy_directions() == {"HostToDevice": 1, "DeviceToHost": 1} and _d2h_bytes(g) == [8]
        st = piped.stats()
        assert st["graph_steps"] == n and st["nongraph_steps"] == 0
        assert st["h2d_per_token"] == 1.0 and st["d2h_per_token"] == 1.0
        # Decoding on from here: bit-identical logits.
        assert np.array_equal(piped.step(want[-1]), serial.step(want[-1]))


def test_pipelined_greedy_stop_token_leaves_the_step_by_step_state():
    config, tensors = synthetic("tiny-dense")
    kw = dict(kv="int8", max_seq_len=128, device="gpu")
    with Engine.from_tensors(config, tensors, **kw) as serial, Engine.from_tensors(config, tensors, **kw) as piped:
        first = int(np.argmax(piped.prefill(PROMPT)))
        all_tokens = piped.decode_greedy(first, 24)
        piped.reset()
        piped.prefill(PROMPT)
        stop = all_tokens[9]
        k = all_tokens.index(stop)
        assert piped.decode_greedy(first, 24, stop_token_ids=[stop]) == all_tokens[:k + 1]
        assert piped.position == len(PROMPT) + k + 1  # the step launched after the stop was dropped
        serial.prefill(PROMPT)
        for t in [first] + all_tokens[:k]:
            serial.step_greedy(t)
        assert np.array_equal(piped.step(all_tokens[k]), serial.step(all_tokens[k]))


def test_chained_step_refusals_change_nothing():
    config, tensors = synthetic("tiny-dense")
    session = GpuSession(config, tensors.items(), kv="int8", max_seq_len=24)
    try:
        lib, h = session.lib, session.handle
        slot = ctypes.c_int32()

        def refused(status, words):
            assert lib.og_begin_chained_step(h, ctypes.byref(slot)) == status
            assert words in capi.last_error(), capi.last_error()

        refused(capi.OG_E_BAD_STATE, "exactly one step begun")  # nothing begun
        assert lib.og_begin_chained_step(h, None) == capi.OG_E_INVALID_ARGUMENT
        assert lib.og_cancel_step(h) == capi.OG_E_BAD_STATE
        session.begin(5)  # the logits output
        refused(capi.OG_E_BAD_STATE, "OG_OUTPUT_NEXT_TOKEN")
        session.set_output("next_token")
        refused(capi.OG_E_BAD_STATE, "OG_OUTPUT_NEXT_TOKEN")  # the step in flight was begun with logits
        session.begin(5)
        assert session.begin_chained() == 1
        capi.check(lib.og_step_slot(h, ctypes.byref(slot)))
        assert slot.value == 1
        refused(capi.OG_E_BAD_STATE, "(2 are)")
        session.cancel()
        session.cancel()
        assert lib.og_cancel_step(h) == capi.OG_E_BAD_STATE
        # The last row: a chained step would be past max_seq_len; the begun step still ends.
        session.seek(23)
        session.begin(5)
        refused(capi.OG_E_CONTEXT_FULL, "max_seq_len=24")
        session.run_nongraph()
        token, _ = session.end()
        assert 0 <= token < config.vocab_size and session.position == 24
    finally:
        session.close()


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_float16_checkpoint_loads_as_its_bf16_rounding(tmp_path, preset):
    """An all-float16 folder decodes on the GPU bit for bit as the same weights rounded to bf16
    (set_weight stores float16 matrices as bf16, vectors as fp32), and within the usual bound of
    the CPU reference of the float16 folder (which applies the same rule)."""
    config, tensors = synthetic(preset)
    f16, f16_logits, bf16_logits = float16_folder_runs(config, tensors, tmp_path, PROMPT, "fp32", "gpu")
    for a, b in zip(f16_logits, bf16_logits):
        np.testing.assert_array_equal(a, b)
    with Engine.from_pretrained(str(tmp_path / "f16"), kv="fp32", max_seq_len=64, device="cpu") as cpu:
        cpu_logits = [cpu.step(t) for t in PROMPT]
    assert_below(f"engine/float16-folder/{preset}", max(rel_l2(g, c) for g, c in zip(f16_logits, cpu_logits)))
