"""The Engine's contract on the CPU path (runs everywhere, including CI without a GPU)."""
import contextlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gpu_support import float16_folder_runs, synthetic
from onegraph.engine import Engine, EngineError, library_status
from onegraph.reference import ReferenceDecoder
from onegraph.sampling import SamplingParams, sample
from onegraph.synth import preset_config, write_model

PROMPT = [3, 17, 99, 250, 4, 61, 200, 8]


@pytest.fixture(scope="module")
def tiny():
    return synthetic("tiny-dense")


def test_plumbing_cpu_engine_generate_drives_the_reference_decoder(tiny):
    """Plumbing, not numerics: the CPU engine IS the reference decoder, so this checks only that
    generate feeds it the prompt and the greedy tokens and counts the steps. The numerics are
    checked against independent oracles in test_reference.py / test_hf_oracle.py (CPU) and
    test_engine_gpu.py (GPU vs this reference)."""
    config, tensors = tiny
    ref = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=64)
    logits = ref.prefill(PROMPT)
    expected = []
    for _ in range(16):
        t = int(np.argmax(logits))
        expected.append(t)
        logits = ref.step(t)
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="cpu") as engine:
        assert engine.backend == "cpu"
        assert engine.generate(PROMPT, 16, stop_token_ids=()) == expected
        st = engine.stats()
        assert st["tokens"] == len(PROMPT) + 15 and st["cpu_steps"] == st["tokens"]


def test_step_greedy_is_the_argmax_of_step(tiny):
    config, tensors = tiny
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="cpu") as a, \
            Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="cpu") as b:
        token_a = token_b = PROMPT[0]
        for _ in range(12):
            token_a = a.step_greedy(token_a)
            token_b = int(np.argmax(b.step(token_b)))
            assert token_a == token_b
        assert a.position == b.position == 12
        with pytest.raises(EngineError, match="outside the vocabulary"):
            a.step_greedy(config.vocab_size)
        assert a.position == 12


def test_auto_device_without_gpu_falls_back_with_a_reason(tiny):
    usable, _ = library_status()
    if usable:
        pytest.skip("a GPU is usable here; the fallback is exercised on machines without one")
    config, tensors = tiny
    with Engine.from_tensors(config, tensors, device="auto", max_seq_len=32) as engine:
        assert engine.backend == "cpu"
        assert engine.fallback_reason and "GPU path unusable" in engine.fallback_reason
    with pytest.raises(EngineError, match="device='gpu'"):
        Engine.from_tensors(config, tensors, device="gpu", max_seq_len=32)


def test_bad_requests_are_refused_and_change_nothing(tiny):
    config, tensors = tiny
    with Engine.from_tensors(config, tensors, device="cpu", max_seq_len=12) as engine:
        engine.prefill([1, 2, 3])
        before = engine.step(4)
        engine.reset()
        engine.prefill([1, 2, 3])
        for bad in (-1, config.vocab_size, 2.5):
            with pytest.raises(EngineError, match="outside the vocabulary"):
                engine.step(bad)
        with pytest.raises(EngineError, match="empty prompt"):
            engine.generate([], 4)
        with pytest.raises(EngineError, match="exceeds max_seq_len"):
            engine.generate([1] * 8, 8)
        with pytest.raises(EngineError, match="does not fit"):
            engine.prefill([1] * 10)
        assert engine.position == 3
        np.testing.assert_array_equal(engine.step(4), before)


def test_context_full_is_an_error_until_reset(tiny):
    config, tensors = tiny
    with Engine.from_tensors(config, tensors, device="cpu", max_seq_len=4) as engine:
        engine.prefill([1, 2, 3, 4])
        with pytest.raises(EngineError, match="context is full"):
            engine.step(5)
        engine.reset()
        engine.step(5)
        assert engine.position == 1


def test_seeded_sampling_is_reproducible(tiny):
    config, tensors = tiny
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1234)
    runs = []
    for _ in range(2):
        with Engine.from_tensors(config, tensors, device="cpu", max_seq_len=64) as engine:
            runs.append(engine.generate(PROMPT, 12, params, stop_token_ids=()))
    assert runs[0] == runs[1] and len(runs[0]) == 12


def test_invalid_engine_options(tiny):
    config, tensors = tiny
    with pytest.raises(ValueError, match="kv="):
        Engine.from_tensors(config, tensors, device="cpu", kv="fp8")
    with pytest.raises(ValueError, match="device="):
        Engine.from_tensors(config, tensors, device="tpu")


def test_generate_stops_at_an_eos_of_generation_config(tmp_path):
    """An eos id listed only in generation_config.json ends generate() by default."""
    config = preset_config("tiny-dense", eos_token_id=0)
    write_model(config, tmp_path)
    with Engine.from_pretrained(str(tmp_path), kv="int8", max_seq_len=64, device="cpu") as engine:
        free_run = engine.generate(PROMPT, 16, stop_token_ids=())
    # the first occurrence of a token, some steps in, before any 0 (config.json's eos)
    stop_at = next(i for i, t in enumerate(free_run) if i >= 3 and t not in free_run[:i] and 0 not in free_run[:i + 1])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [free_run[stop_at], 0]}))
    with Engine.from_pretrained(str(tmp_path), kv="int8", max_seq_len=64, device="cpu") as engine:
        assert engine.config.eos_token_ids == (0, free_run[stop_at])
        assert engine.generate(PROMPT, 16) == free_run[:stop_at + 1]


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-tied", "tiny-moe"])
def test_float16_checkpoint_loads_as_its_bf16_rounding(tmp_path, preset):
    """An all-float16 folder decodes on the CPU exactly (bit for bit) as the same weights rounded
    to bf16: matrices are used as bf16, the GPU's rule (reference.py module docstring)."""
    config, tensors = synthetic(preset)
    f16, f16_logits, bf16_logits = float16_folder_runs(config, tensors, tmp_path, PROMPT, "int8", "cpu")
    for a, b in zip(f16_logits, bf16_logits):
        np.testing.assert_array_equal(a, b)
    # The rounding matters: widening float16 matrices without it gives other logits.
    unrounded = ReferenceDecoder(config, {n: t.astype(np.float32) for n, t in f16.items()}, kv_dtype="int8",
                                 max_seq_len=64)
    assert not np.array_equal(unrounded.prefill(PROMPT), f16_logits[-1])


RSS_PROBE = textwrap.dedent("""
    import json, os, resource, sys
    import numpy as np
    from onegraph.engine import Engine
    def peak_bytes():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    before = peak_bytes()
    with Engine.from_pretrained(sys.argv[1], kv="int8", max_seq_len=64, device="cpu") as engine:
        token = 3
        for _ in range(8):
            token = int(np.argmax(engine.step(token)))
    print(json.dumps({"before": before, "after": peak_bytes(),
                      "file_bytes": os.path.getsize(os.path.join(sys.argv[1], "model.safetensors"))}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss units are Linux's")
def test_cpu_engine_peak_rss_stays_below_one_and_a_half_times_the_file(tmp_path):
    """With no fp32 budget the CPU path keeps the weights as mapped file pages (~1x once read) and
    widens one matrix at a time into an fp32 buffer of the largest (here gate|up, 0.2x), never
    the whole model. (The default budget keeps fp32 copies of models this small, for speed.)"""
    config = preset_config("tiny-dense", vocab_size=4096, hidden_size=640, intermediate_size=1728,
                           num_attention_heads=10, num_key_value_heads=2, head_dim=64, num_hidden_layers=4)
    write_model(config, tmp_path)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, str(tmp_path)], capture_output=True, text=True,
                         cwd=repo, env=dict(os.environ, ONEGRAPH_CPU_FP32_BUDGET_MB="0"), check=True)
    m = json.loads(out.stdout)
    assert m["file_bytes"] > 40e6
    assert m["after"] - m["before"] < 1.5 * m["file_bytes"], m


def test_kept_fp32_copies_give_the_same_logits_as_widening_at_every_use():
    config, tensors = synthetic("tiny-dense")
    lean = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=64, fp32_budget_bytes=0)
    kept = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=64, fp32_budget_bytes=1 << 40)
    assert all(m.kept is None for m in (lean.lm_head, lean.layers[0].qkv_proj))
    assert all(m.kept is not None for m in (kept.lm_head, kept.layers[0].qkv_proj))
    for token in PROMPT:
        np.testing.assert_array_equal(lean.step(token), kept.step(token))


# ---- the generation loop (Engine.stream / generate) against the loop written out here ----------
def reference_generate(config, tensors, prompt, n, params=SamplingParams(), stop=()):
    """(new tokens, tokens fed): prompt, then each token sampled from the logits before it (with
    the params' seed, keyed by the row of the logits, over the counts of the tokens generated so
    far) and fed, the last one not; stops after a stop token or n tokens."""
    ref = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=64)
    logits, fed, out = ref.prefill(prompt), list(prompt), []
    while len(out) < n:
        counts = np.bincount(np.asarray(out, np.int64), minlength=logits.size)
        token = sample(logits, params, len(fed) - 1, counts)
        out.append(token)
        if token in stop or len(out) == n:
            break
        logits = ref.step(token)
        fed.append(token)
    return out, fed


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=5),
                                    SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                                                   frequency_penalty=0.2, presence_penalty=0.1, seed=9),
                                    SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5)])
def test_stream_yields_the_loops_tokens_and_feeds_all_but_the_last(tiny, params):
    config, tensors = tiny
    want, fed = reference_generate(config, tensors, PROMPT, 10, params)
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="cpu") as engine:
        assert list(engine.stream(PROMPT, 10, params, stop_token_ids=())) == want
        assert engine._history == fed and engine.position == len(PROMPT) + 9
        engine.reset()
        seen = []
        assert engine.generate(PROMPT, 10, params, stop_token_ids=(), on_token=seen.append) == want == seen
        assert engine._history == fed


def test_stream_stops_after_a_stop_token_and_yields_it(tiny):
    config, tensors = tiny
    free, _ = reference_generate(config, tensors, PROMPT, 10)
    stop = free[4]
    want, fed = reference_generate(config, tensors, PROMPT, 10, stop=(stop, config.vocab_size + 7))
    assert want[-1] == stop and len(want) <= 5
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="cpu") as engine:
        assert engine.generate(PROMPT, 10, stop_token_ids=[stop, config.vocab_size + 7]) == want
        assert engine._history == fed
        engine.reset()
        assert engine.generate(PROMPT, 2, stop_token_ids=[free[3]]) == free[:2]  # max_new_tokens first


def test_zero_new_tokens_feeds_the_prompt_and_bad_counts_change_nothing(tiny):
    config, tensors = tiny
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="cpu") as engine:
        for bad in (-1, 2.5, True):
            with pytest.raises(ValueError, match="max_new_tokens"):
                engine.stream(PROMPT, bad)
        assert engine.position == 0
        assert engine.generate(PROMPT, 0) == []
        assert engine._history == PROMPT


def test_stream_closed_early_leaves_exactly_the_fed_tokens(tiny):
    config, tensors = tiny
    want, _ = reference_generate(config, tensors, PROMPT, 10)
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="cpu") as engine:
        for stop_how in ("break", "close", "raise"):
            engine.reset()
            got = []
            tokens = engine.stream(PROMPT, 10, stop_token_ids=())
            with pytest.raises(KeyboardInterrupt) if stop_how == "raise" else contextlib.nullcontext():
                for token in tokens:
                    got.append(token)
                    if len(got) == 4:
                        if stop_how == "raise":
                            raise KeyboardInterrupt
                        if stop_how == "close":
                            tokens.close()
                        break
            assert got == want[:4]
            assert engine._history == PROMPT + want[:3], stop_how
            # The next call closes the stream if the consumer has not; decoding goes on from there.
            ref = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=64)
            ref.prefill(PROMPT + want[:3])
            np.testing.assert_array_equal(engine.step(want[3]), ref.step(want[3]))
            assert list(tokens) == []  # the stream has ended


def test_another_call_ends_the_open_stream(tiny):
    config, tensors = tiny
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="cpu") as engine:
        first = engine.stream(PROMPT, 10, stop_token_ids=())
        t1, _ = next(first), next(first)
        second = engine.stream([5, 6], 3, stop_token_ids=())  # the first one ends here
        assert list(first) == []
        assert engine._history == PROMPT + [t1]
        want, fed = reference_generate(config, tensors, PROMPT + [t1, 5, 6], 3)
        assert list(second) == want and engine._history == fed
        third = engine.stream([7], 3, stop_token_ids=())
        next(third)
        engine.reset()
        assert list(third) == [] and engine.position == 0
