"""The verify step on the GPU (cuda/verify.cu): each position's logits bit-identical to the
decode body's at that position, for every k in 1..8, graph and non-graph, every KV format, bf16
weights (the multi-vector GEMV) and int8 / q4 weights (per-vector launches); the rollback of
rejected rows; its errors; Engine.generate(speculative="ngram") equal to plain greedy decoding,
its plain steps pipelined between verify steps. Skipped without a usable GPU."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import FOLD_ENV, LONG_FROM_ENV, require_gpu, synthetic, tensor_core_model
import capi_testing as ct
from onegraph import capi
from onegraph.engine import Engine
from speculative_support import EverySixth, PinnedCosts

pytestmark = pytest.mark.gpu

PROMPT = [3, 17, 99, 250, 4, 61, 200, 8, 45, 123, 7, 300, 11, 90, 150, 33]
FEED = [5, 77, 310, 12, 9, 300, 41, 2, 150]   # the last accepted token and up to 8 drafts


@pytest.fixture(scope="module", autouse=True)
def _gpu():
    require_gpu()


def engine_for(preset, kv, weights, graph, max_seq_len=96, page=8):
    config, tensors = synthetic(preset)
    # A small page: the fed rows cross block boundaries (fresh blocks, and shared ones copied).
    return Engine.from_tensors(config, tensors, kv=kv, max_seq_len=max_seq_len, graph=graph, device="gpu",
                               weights=weights, kv_page_size=page, kv_pool_blocks=64)


def decode_logits(engine, base, tokens):
    """Logits after each of tokens, fed by the decode body on a fork of base."""
    seq = engine.fork(base)
    engine.use(seq)
    rows = np.stack([engine.step(t) for t in tokens])
    engine.free_sequence(seq)
    return rows


def run_verify(gpu, tokens, graph):
    """Begin a verify step over tokens on the selected sequence and run it (its graph, or the
    non-graph path)."""
    gpu.begin_verify(tokens)
    if graph:
        gpu.capture_verify(len(tokens)).replay()
    else:
        gpu.run_verify_nongraph()


def verify_logits(engine, base, tokens, graph):
    """Logits after each of tokens from one verify step on a fork of base (all rows kept)."""
    seq = engine.fork(base)
    engine.use(seq)
    gpu = engine.session
    gpu.set_output("logits")
    run_verify(gpu, tokens, graph)
    rows = gpu.verify_logits()
    next_tokens, next_logits = gpu.verify_results(len(tokens))
    gpu.end_verify(len(tokens))
    engine.free_sequence(seq)
    return rows, next_tokens, next_logits


CASES = [(preset, kv, "bf16") for preset in ("tiny-dense", "tiny-llama", "tiny-moe")
         for kv in ("fp32", "bf16", "int8")]
CASES += [(preset, "int8", weights) for preset in ("tiny-dense", "tiny-moe") for weights in ("int8", "q4")]


def check_verify_equals_decode(engine, graph):
    """Each k: the verify step's logits, tokens and logit values at each position are the
    decode body's bit for bit."""
    engine.prefill(PROMPT)
    base = engine.sequence
    expected = decode_logits(engine, base, FEED)
    for n in range(2, capi.MAX_VERIFY + 1):
        got, next_tokens, next_logits = verify_logits(engine, base, FEED[:n], graph)
        for j in range(n):
            assert np.array_equal(got[j], expected[j]), f"k={n - 1}, position {j}"
        best = np.argmax(expected[:n], axis=1)
        assert np.array_equal(next_tokens, best)
        assert np.array_equal(next_logits, expected[np.arange(n), best])


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "nongraph"])
@pytest.mark.parametrize("preset, kv, weights", CASES)
def test_verify_logits_are_the_decode_bodys_bit_for_bit(preset, kv, weights, graph):
    with engine_for(preset, kv, weights, graph) as engine:
        check_verify_equals_decode(engine, graph)


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "nongraph"])
@pytest.mark.parametrize("long_from", [len(PROMPT), len(PROMPT) + 4], ids=["long", "straddling"])
@pytest.mark.parametrize("group, fold", [(4, "auto"), (2, "tensor")], ids=["group-4", "group-2-tensor"])
def test_verify_across_the_attention_bands_is_the_decode_bodys_bit_for_bit(graph, long_from, group, fold,
                                                                           monkeypatch):
    # Int8 rows of 128 dims, 4 query heads a KV head (or 2, with the long band asked onto the
    # tensor cores): the long attention band folds on the tensor cores, the short one on the
    # CUDA cores. Every verify row lies in the long band, or (straddling) the first four in the
    # short band and the rest in the long one: each row's logits are a decode step's at its
    # position, in that position's band.
    monkeypatch.setenv(LONG_FROM_ENV, str(long_from))
    monkeypatch.setenv(FOLD_ENV, fold)
    band = ct.BAND_LONG_TC if fold == "tensor" else ct.BAND_LONG
    assert ct.attention_plan(2 * group, 2, 128, 96, ct.OG_KV_INT8, band=band)["tensor_cores"]
    config, tensors = tensor_core_model(group=group)
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=96, graph=graph, device="gpu",
                             weights="bf16", kv_page_size=8, kv_pool_blocks=64) as engine:
        check_verify_equals_decode(engine, graph)
        if graph:
            bands = {key[-2:] for key in engine.session._graphs if key[0] == "verify"}
            assert bands == ({(1, 1)} if long_from == len(PROMPT) else {(0, 0), (0, 1)}), bands


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "nongraph"])
def test_rollback_makes_rejected_rows_invisible(graph):
    """Verify 9 rows (16..24: two blocks of 8), keep 2: the block holding none of the kept rows
    goes back to the pool, and the next decode step equals one on a sequence that only ever
    held the 2 kept rows."""
    with engine_for("tiny-dense", "int8", "bf16", graph) as engine:
        engine.prefill(PROMPT)
        base = engine.sequence
        gpu = engine.session
        free_before = gpu.pool.info()["free_blocks"]
        seq = engine.fork(base)
        engine.use(seq)
        gpu.set_output("next_token")
        run_verify(gpu, FEED, graph)
        gpu.end_verify(2)
        lib_seq = gpu.pool.current()
        assert gpu.pool.length(lib_seq) == len(PROMPT) + 2
        assert len(gpu.pool.blocks(lib_seq)) == 3          # rows 0..17 in blocks of 8
        assert gpu.pool.info()["free_blocks"] == free_before - 1   # block 2 taken, block 3 released
        gpu.set_output("logits")
        gpu.begin(123)
        gpu.run_nongraph()
        got = gpu.end()
        expected = decode_logits(engine, base, FEED[:2] + [123])[-1]
        assert np.array_equal(got, expected)


def test_verify_errors_change_nothing():
    with engine_for("tiny-dense", "int8", "bf16", True, max_seq_len=24) as engine:
        engine.prefill(PROMPT)
        gpu = engine.session
        seq = gpu.pool.current()
        for tokens, status in [([5], capi.OG_E_INVALID_ARGUMENT),
                               (FEED + [1], capi.OG_E_INVALID_ARGUMENT),
                               ([5, engine.config.vocab_size], capi.OG_E_TOKEN_OUT_OF_RANGE),
                               (FEED, capi.OG_E_CONTEXT_FULL)]:
            with pytest.raises(capi.LibraryError) as err:
                gpu.begin_verify(tokens)
            assert err.value.status == status
            assert gpu.pool.length(seq) == len(PROMPT)
        with pytest.raises(capi.LibraryError) as err:
            gpu.end_verify(1)                       # no verify step begun
        assert err.value.status == capi.OG_E_BAD_STATE
        gpu.begin_verify(FEED[:3])
        with pytest.raises(capi.LibraryError) as err:
            gpu.end_verify(4)                       # more rows than fed
        assert err.value.status == capi.OG_E_INVALID_ARGUMENT
        gpu.run_verify_nongraph()
        gpu.end_verify(3)
        assert gpu.pool.length(seq) == len(PROMPT) + 3


REPETITIVE = [3, 17, 99, 250, 4, 61, 200, 8] * 3


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "nongraph"])
@pytest.mark.parametrize("preset, weights", [("tiny-dense", "bf16"), ("tiny-llama", "bf16"),
                                             ("tiny-moe", "bf16"), ("tiny-dense", "q4")])
def test_speculative_generate_equals_plain_on_the_gpu(preset, weights, graph):
    with engine_for(preset, "int8", weights, graph) as plain, engine_for(preset, "int8", weights, graph) as spec:
        spec.step_costs = PinnedCosts()   # draft whenever the drafter has drafts
        expected = plain.generate(REPETITIVE, 48, stop_token_ids=())
        got = spec.generate(REPETITIVE, 48, stop_token_ids=(), speculative="ngram")
        assert got == expected
        assert spec.history == plain.history
        assert spec.stats()["verify_steps"] > 0


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "nongraph"])
@pytest.mark.parametrize("seed", [0, 1], ids=["same-model", "other-seed"])
def test_draft_model_generate_equals_plain_on_the_gpu(seed, graph):
    """A draft engine (the same weights, or another seed's) on the GPU: plain greedy's tokens and
    rows; its own sequence is truncated back after rejections (og_seq_set_length)."""
    config, tensors = synthetic("tiny-dense", seed=seed)
    with engine_for("tiny-dense", "int8", "bf16", graph) as plain, \
            engine_for("tiny-dense", "int8", "bf16", graph) as target, \
            Engine.from_tensors(config, tensors, kv="int8", max_seq_len=96, graph=graph, device="gpu",
                                kv_page_size=8, kv_pool_blocks=64) as draft:
        target.step_costs = PinnedCosts()   # draft at every step
        expected = plain.generate(PROMPT, 40, stop_token_ids=())
        got = target.generate(PROMPT, 40, stop_token_ids=(), speculative=draft)
        assert got == expected
        assert target.history == plain.history
        stats = target.stats()
        assert stats["verify_steps"] > 0
        if seed == 0:   # the same model drafts what the target decodes (its prefill rows aside)
            assert stats["accepted"] > 0


def count_chained(monkeypatch, engine) -> list:
    """Counts the chained steps the engine's session begins (the pipelined plain path)."""
    gpu = engine.session
    calls = []
    begin_chained = gpu.begin_chained

    def counted():
        calls.append(1)
        return begin_chained()
    monkeypatch.setattr(gpu, "begin_chained", counted)
    return calls


@pytest.mark.parametrize("stop_at", [None, 3, 17, 30], ids=["no-stop", "stop-3", "stop-17", "stop-30"])
def test_pipelined_plain_steps_between_verify_steps_equal_plain(monkeypatch, stop_at):
    """Plain steps inside speculative generation run pipelined and stop for a verify step when
    the policy asks (the in-flight step drained first): plain greedy's tokens and rows, with a
    stop token anywhere (inside a plain burst or a verify step's run)."""
    monkeypatch.setattr("onegraph.engine.AdaptiveK", EverySixth)
    with engine_for("tiny-dense", "int8", "bf16", True) as plain, engine_for("tiny-dense", "int8", "bf16", True) as spec:
        full = plain.generate(REPETITIVE, 48, stop_token_ids=())
        stop = () if stop_at is None else (full[stop_at],)
        plain.reset()
        expected = plain.generate(REPETITIVE, 48, stop_token_ids=stop)
        chained = count_chained(monkeypatch, spec)
        got = spec.generate(REPETITIVE, 48, stop_token_ids=stop, speculative="ngram")
        assert got == expected
        assert spec.history == plain.history
        if stop_at is None:   # the drafter has drafts only late in this output
            assert spec.stats()["verify_steps"] > 0
            assert len(chained) > 0


def test_pipelined_speculative_stream_closed_early_leaves_the_tokens_fed(monkeypatch):
    """A speculative stream closed inside a pipelined plain burst leaves no launched step behind:
    the sequence holds a prefix of plain greedy's rows, and the engine decodes on as plain."""
    monkeypatch.setattr("onegraph.engine.AdaptiveK", EverySixth)
    with engine_for("tiny-dense", "int8", "bf16", True) as plain, engine_for("tiny-dense", "int8", "bf16", True) as spec:
        expected = plain.generate(REPETITIVE, 40, stop_token_ids=())
        full_rows = list(plain.history)
        for taken in (2, 9):
            spec.reset()
            stream = spec.stream(REPETITIVE, 40, stop_token_ids=(), speculative="ngram")
            got = [next(stream) for _ in range(taken)]
            stream.close()
            assert got == expected[:taken]
            held = list(spec.history)
            assert len(REPETITIVE) + taken - 1 <= len(held) <= len(full_rows)
            assert held == full_rows[:len(held)]
        spec.reset()
        assert spec.generate(REPETITIVE, 40, stop_token_ids=()) == expected
        assert spec.history == plain.history


def test_speculative_generate_measures_step_costs():
    """A speculative generation on the graph path records plain tokens and verify steps in the
    engine's step costs, and gives plain greedy's tokens with the cost-aware policy."""
    with engine_for("tiny-dense", "int8", "bf16", True) as plain, engine_for("tiny-dense", "int8", "bf16", True) as spec:
        expected = plain.generate(PROMPT + REPETITIVE, 48, stop_token_ids=())
        got = spec.generate(PROMPT + REPETITIVE, 48, stop_token_ids=(), speculative="ngram")
        assert got == expected
        assert spec.history == plain.history
        costs = spec.step_costs
        assert costs.plain_s is not None and costs.plain_s > 0   # the first tokens have no drafts
        assert bool(costs.verify_s) == (spec.stats()["verify_steps"] > 0)
        assert all(s > 0 for s in costs.verify_s.values())
