"""Batched prefill on any machine: the ABI pieces (og_prefill bound, og_config.prefill_chunk
appended and validated before a device is touched, the ABI version in the header, the binding and the
Rust declarations), and the Engine's plumbing (prefill modes, generate feeding the prompt
through prefill, the fallbacks when the library refuses) against a stand-in GPU session that
computes with the numpy reference."""
import ctypes
import logging
import pathlib
import re

import numpy as np
import pytest

from onegraph import capi
from onegraph.engine import Engine, EngineError
from onegraph.reference import ReferenceDecoder
from test_library_cpu import init, lib, small_config  # noqa: F401  (lib is a fixture)
from test_reliability_cpu import PROMPT, _FakeSession, tiny  # noqa: F401  (tiny is a fixture)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_abi_7_in_header_binding_and_rust():
    header = (ROOT / "cuda" / "onegraph.h").read_text()
    rust = (ROOT / "examples" / "rust" / "src" / "ffi.rs").read_text()
    assert capi.header_abi_version_numbers(str(ROOT / "cuda" / "onegraph.h")) == (7, 2)
    # 7.1 added og_step_bands, 7.2 og_set_rope_frequencies
    assert capi.ABI_VERSION == 7 and capi.ABI_MINOR_REQUIRED == 2
    assert "OG_API og_status og_set_rope_frequencies(og_engine *e" in header
    assert re.search(r"pub const OG_ABI_VERSION: i32 = 7;", rust)
    # 7.0 dropped the test and tool calls (now og_test_* in onegraph_testing.h) from the ABI.
    testing = (ROOT / "cuda" / "onegraph_testing.h").read_text()
    binding = (ROOT / "runtime" / "capi.py").read_text()
    for name in ("og_step_record_ptr", "og_copy_kv_cache", "og_zero_blocks"):
        assert name not in header and name not in rust and name not in binding
    for name in ("og_test_step_record", "og_test_copy_kv_cache", "og_test_kv_zero_blocks"):
        assert f"OG_API og_status {name}(og_engine *e" in testing
    for name in ("og_begin_verify_seq", "og_enqueue_verify", "og_run_verify", "og_verify_results",
                 "og_verify_logits", "og_end_verify"):
        assert f"OG_API og_status {name}(og_engine *e" in header
    params_c = header[header.index("typedef struct og_sampling_params {"):header.index("} og_sampling_params;")]
    params_rs = rust[rust.index("pub struct og_sampling_params {"):]
    params_rs = params_rs[:params_rs.index("}")]
    names = [n for n, _ in capi.OgSamplingParams._fields_]
    assert re.findall(r"(?:u?int\d+_t|float)\s+(\w+);", params_c) == names == re.findall(r"pub (\w+):", params_rs)
    assert ctypes.sizeof(capi.OgSamplingParams) == 40
    assert [n for n, _ in capi.OgStepRecord._fields_] == ["token", "position", "seq_slot", "row_block"]
    for name in ("og_seq_set_sampling", "og_top_logprobs"):
        assert f"OG_API og_status {name}(og_engine *e" in header
    assert "og_prefill(og_engine *e, const int32_t *tokens, int32_t n_tokens, float *logits)" in header
    assert "pub fn og_prefill(" in rust
    for name in ("og_begin_chained_step", "og_cancel_step", "og_step_slot", "og_step_bands"):
        assert f"OG_API og_status {name}(og_engine *e" in header and f"pub fn {name}(" in rust
    # og_config ends with prefill_chunk in all three
    assert capi.OgConfig._fields_[-1] == ("prefill_chunk", ctypes.c_int32)
    config_c = header[header.index("typedef struct og_config {"):header.index("} og_config;")]
    assert re.findall(r"int32_t\s+(\w+);", config_c)[-1] == "prefill_chunk"
    config_rs = rust[rust.index("pub struct og_config {"):]
    config_rs = config_rs[:config_rs.index("}")]
    assert re.findall(r"pub (\w+):", config_rs)[-1] == "prefill_chunk"


def test_bf16_split_is_within_2_to_the_minus_16():
    """The GEMM inputs of og_prefill (cuda/prefill.cuh, "Numerics"): x = hi + lo, hi = bf16(x),
    lo = bf16(x - hi): within 2^-16 |x| (2^-8 of a residual at most 2^-8 |x|), rms ~2^-18.5
    relative; the numerics statement and the GPU tests' bounds rest on this."""
    import capi_testing as ct
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(200_000), rng.standard_normal(1000) * 1e30,
                        rng.standard_normal(1000) * 1e-30, [0.0, -0.0, 1.0, 3.0e38]]).astype(np.float32)
    hi, lo = ct.bf16_split(x)
    x64 = x.astype(np.float64)
    approx = ct.bf16_to_f32(hi).astype(np.float64) + ct.bf16_to_f32(lo).astype(np.float64)
    err = np.abs(approx - x64)
    assert np.all(err <= 2.0 ** -16 * np.abs(x64))
    normal = slice(0, 200_000)
    typical = np.sqrt(np.mean((err[normal] / np.abs(x64[normal])) ** 2))
    assert 2.0 ** -20 < typical < 2.0 ** -18, typical
    # ... against bf16 alone: 2^-8 at most, ~2^-9 typical
    one = np.abs(ct.bf16_to_f32(hi).astype(np.float64) - x64)[normal] / np.abs(x64[normal])
    assert one.max() <= 2.0 ** -8 and typical < one.max() / 64


def test_og_prefill_is_bound(lib):  # noqa: F811
    f = lib.og_prefill
    assert f.restype is ctypes.c_int32
    assert f.argtypes == [capi.Handle, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32,
                          ctypes.POINTER(ctypes.c_float)]
    ids = (ctypes.c_int32 * 2)(1, 2)
    assert f(None, ids, 2, None) == capi.OG_E_INVALID_HANDLE


def test_prefill_chunk_defaults_to_zero_and_negative_is_refused(lib):  # noqa: F811
    cfg = capi.OgConfig()
    lib.og_config_default(ctypes.byref(cfg))
    assert cfg.prefill_chunk == 0
    status, handle = init(lib, small_config(lib, prefill_chunk=-1))
    assert status == capi.OG_E_INVALID_ARGUMENT and not handle.value
    assert "og_config.prefill_chunk=-1" in capi.last_error()


# ---- the Engine ---------------------------------------------------------------------------------

def test_engine_options_are_checked(tiny):  # noqa: F811
    config, tensors = tiny
    with pytest.raises(ValueError, match="prefill='fast'"):
        Engine.from_tensors(config, tensors, device="cpu", prefill="fast")
    with pytest.raises(ValueError, match="prefill_chunk=-3"):
        Engine.from_tensors(config, tensors, device="cpu", prefill_chunk=-3)
    with Engine.from_tensors(config, tensors, device="cpu", max_seq_len=64) as engine:
        with pytest.raises(ValueError, match="mode"):
            engine.prefill([1, 2], mode="fast")
        assert engine.position == 0


def test_plumbing_cpu_path_batched_and_token_prefill_reach_the_reference(tiny):  # noqa: F811
    """Plumbing, not numerics: on the CPU path both prefill modes feed the reference decoder
    token by token (the CPU engine IS the reference), so this checks only that the prompt gets
    there whole. Batched vs token prefill numerics are compared on the GPU (test_prefill_gpu.py)."""
    config, tensors = tiny
    want = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=64).prefill(PROMPT)
    for mode in ("batched", "token"):
        with Engine.from_tensors(config, tensors, device="cpu", max_seq_len=64, prefill=mode) as engine:
            np.testing.assert_array_equal(engine.prefill(PROMPT), want)
            assert engine.position == len(PROMPT)


class _PrefillSession(_FakeSession):
    """The stand-in GPU session with og_prefill (the reference's prefill) and a pool that
    reserves nothing; `refuse` makes og_prefill fail with that status instead."""

    class _Pool:
        def current(self):
            return 0

        def reserve(self, seq, n):
            pass

    def __init__(self, config, tensors, refuse=None):
        super().__init__(config, tensors)
        self.pool = self._Pool()
        self.refuse = refuse
        self.prefills = 0

    def prefill(self, tokens):
        self.prefills += 1
        if self.refuse is not None:
            raise capi.LibraryError(self.refuse, "refused (stand-in)", "og_prefill")
        return self.ref.prefill(tokens)


def _engine(config, tensors, refuse=None, **kw):
    engine = Engine.from_tensors(config, tensors, device="cpu", max_seq_len=64, **kw)
    engine._cpu = None
    engine._gpu = _PrefillSession(config, tensors, refuse)
    engine._seqs[0].lib_id = 0
    return engine


def test_generate_feeds_the_prompt_through_one_batched_prefill(tiny):  # noqa: F811
    config, tensors = tiny
    ref = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=64)
    logits, want = ref.prefill(PROMPT), []
    for _ in range(6):
        want.append(int(np.argmax(logits)))
        logits = ref.step(want[-1])
    engine = _engine(config, tensors)
    assert engine.generate(PROMPT, 6, stop_token_ids=()) == want
    assert engine._gpu.prefills == 1
    st = engine.stats()
    assert st["prefill_tokens"] == len(PROMPT) and st["tokens"] == 5  # steps: the new tokens fed back
    assert engine.position == len(PROMPT) + 5


def test_token_mode_never_calls_og_prefill(tiny):  # noqa: F811
    config, tensors = tiny
    engine = _engine(config, tensors, prefill="token")
    engine.generate(PROMPT, 3, stop_token_ids=())
    engine.prefill(PROMPT[:2])
    assert engine._gpu.prefills == 0
    engine.prefill(PROMPT[:2], mode="batched")
    assert engine._gpu.prefills == 1


def test_unsupported_falls_back_to_token_by_token_once_with_a_log_line(tiny, caplog):  # noqa: F811
    config, tensors = tiny
    want = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=64).prefill(PROMPT)
    engine = _engine(config, tensors, refuse=capi.OG_E_UNSUPPORTED)
    with caplog.at_level(logging.WARNING, logger="onegraph"):
        np.testing.assert_array_equal(engine.prefill(PROMPT), want)
    assert [r for r in caplog.records if "batched prefill unavailable" in r.getMessage()]
    assert engine.position == len(PROMPT) and engine.stats()["prefill_tokens"] == 0
    engine.reset()
    engine.prefill(PROMPT)
    assert engine._gpu.prefills == 1  # not asked again


def test_missing_weight_continues_on_the_cpu_path(tiny):  # noqa: F811
    config, tensors = tiny
    want = ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=64).prefill(PROMPT)
    engine = _engine(config, tensors, refuse=capi.OG_E_MISSING_WEIGHT)
    np.testing.assert_array_equal(engine.prefill(PROMPT), want)
    assert engine.backend == "cpu" and "precheck" in engine.fallback_reason
    assert engine.position == len(PROMPT)


@pytest.mark.parametrize("status", [capi.OG_E_POOL_EXHAUSTED, capi.OG_E_CONTEXT_FULL])
def test_library_refusals_are_engine_errors_and_change_nothing(tiny, status):  # noqa: F811
    config, tensors = tiny
    engine = _engine(config, tensors, refuse=status)
    with pytest.raises(EngineError, match="refused"):
        engine.prefill(PROMPT)
    assert engine.position == 0 and engine.backend == "gpu-graph"


def test_bench_ttft_records_on_the_cpu(tmp_path, capsys):
    from bench import benchmark, measure, report
    out = tmp_path / "b.json"
    assert benchmark.main(["--device", "cpu", "--preset", "tiny-dense", "--prompt", "3", "--n", "2",
                       "--repeats", "1", "--ttft", "5,9", "--json", str(out)]) == 0
    import json
    doc = json.loads(out.read_text())
    report.check_schema(doc)
    got = {(r["runtime"], r["prompt"]) for r in doc["ttft"]}
    assert got == {(f"onegraph-cpu-{m}", p) for m in ("batched", "token") for p in (5, 9)}
    assert all(r["ttft_ms"] > 0 for r in doc["ttft"])
    # A batched TTFT is a median of at least 3 runs even with --repeats 1; token by token keeps
    # --repeats (its runs are long).
    runs = {r["runtime"].rsplit("-", 1)[1]: len(r["ttft_ms_runs"]) for r in doc["ttft"]}
    assert runs == {"batched": measure.TTFT_MIN_REPEATS, "token": 1}
    assert "time to first token" in capsys.readouterr().out
