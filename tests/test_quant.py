"""Weight quantization (runtime/quant.py) on the CPU: the rules bit for bit, round-trip error
bounds, the q4 packing layout, odd shapes, determinism, which tensors a scheme quantizes, and the
numpy reference with quantized weights against the independent float64 model of
test_reference.py fed the same dequantized weights.

Round-trip bounds, stated once: int8 |w - w'| <= scale/2 per element (rint of an fp32 quotient,
times the fp32 scale: plus a few fp32 ulps of |w|); q4 the same with the group's bf16 scale (no
value is clipped: |w| / scale <= 7 * (1 + 2^-8) < 7.5). Relative to max|w| of the row or group
that is 1/254 (int8) and 1/14 (q4).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from onegraph import quant
from onegraph.quant import (QuantizedMatrix, WeightScheme, dequantize_q4, pack_q4, quantize_int8,
                           quantize_q4, quantize_stream, tensor_class, unpack_q4)
from onegraph.reference import ReferenceDecoder
from onegraph.synth import iter_tensors, preset_config
from test_reference import Float64Model, rel_l2, tiny_config, tiny_tensors

BF16 = ml_dtypes.bfloat16
F32_ULP = 2.0 ** -23


def random_bf16(shape, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * scale).astype(BF16)


# ---- int8 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 7), (17, 100), (64, 4096)])
def test_int8_rule_and_round_trip(rows, cols):
    w = random_bf16((rows, cols), seed=cols)
    qm = quantize_int8(w)
    w32 = w.astype(np.float32)
    want_scale = (np.max(np.abs(w32), axis=1) / np.float32(127)).astype(np.float32)
    assert qm.data.dtype == np.int8 and qm.data.shape == (rows, cols)
    assert qm.scale.dtype == np.float32 and qm.scale.tobytes() == want_scale.tobytes()
    np.testing.assert_array_equal(qm.data, np.rint(w32 / want_scale[:, None]).astype(np.int8))
    assert np.abs(qm.data).max() == 127                      # every row's maximum maps to +-127
    back = qm.dequantize()
    np.testing.assert_array_equal(back, qm.data.astype(np.float32) * want_scale[:, None])
    err = np.abs(back.astype(np.float64) - w32)
    assert (err <= qm.scale[:, None] / 2 + 4 * F32_ULP * np.abs(w32)).all()


def test_int8_zero_row_negative_max_and_ties_to_even():
    w = np.array([[0, 0, 0, 0], [-2.0, 1.0, 0.5, 0.0], [127 * 0.5, 0.25 * 3, 0.25 * 5, 0.0]], np.float32)
    qm = quantize_int8(w)
    assert qm.scale[0] == 0 and (qm.data[0] == 0).all()
    assert qm.data[1, 0] == -127                             # the maximum magnitude may be negative
    # row 2: scale 0.5 exactly; 0.75 / 0.5 = 1.5 -> 2, 1.25 / 0.5 = 2.5 -> 2 (half to even)
    assert qm.scale[2] == 0.5 and list(qm.data[2]) == [127, 2, 2, 0]


def test_non_finite_weights_are_rejected_with_the_name():
    w = np.ones((2, 3), np.float32)
    w[1, 2] = np.inf
    for fmt in ("int8", "q4"):
        with pytest.raises(ValueError, match=r"layer\.w: weight \[1, 2\] is inf"):
            quant.quantize(w, fmt, "layer.w")


# ---- q4 ------------------------------------------------------------------------------------

def test_q4_packing_layout_low_nibble_is_the_even_column():
    q = np.zeros((1, 32), np.int8)
    q[0, :6] = [1, -1, 7, -7, -8, 0]
    packed = pack_q4(q)
    assert packed.shape == (1, 16)
    assert list(packed[0, :3]) == [0xF1, 0x97, 0x08]          # (1, -1), (7, -7), (-8, 0)
    np.testing.assert_array_equal(unpack_q4(packed), q)


def test_q4_codes_by_hand():
    # One group: max |w| = 7 -> scale 1 (exact in bf16); codes are the rounded weights.
    w = np.zeros((1, 32), np.float32)
    w[0, :5] = [7.0, -7.0, 2.5, -0.5, 3.4]
    qm = quantize_q4(w)
    assert qm.scale.dtype == np.dtype(BF16) and float(qm.scale[0, 0]) == 1.0
    assert list(unpack_q4(qm.data)[0, :5]) == [7, -7, 2, 0, 3]   # 2.5 and -0.5 round to even


def e5m3_by_value(v: np.ndarray) -> np.ndarray:
    """v >= 0 float64 -> the nearest e5m3 value (ties to even), from its definition: 3 mantissa
    bits, binades from 2^-14 up (below it the subnormal step 2^-17), values past 61440 inf."""
    v = np.asarray(v, np.float64)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(v > 0, v, 1.0)))
    step = 2.0 ** (np.maximum(e, -14) - 3)
    out = np.round(v / step) * step                      # np.round: half to even
    return np.where(out > 61440, np.inf, out)


def test_q4_scale_codes_every_positive_bf16():
    bits = np.arange(0, 0x7F80, dtype=np.uint16)         # every finite bf16 >= 0
    values = bits.view(BF16)
    codes = quant.q4_scale_codes(values)
    got = quant.q4_scale_values(codes).astype(np.float64)
    want = e5m3_by_value(values.astype(np.float64))
    np.testing.assert_array_equal(got, want)
    # e5m3 values survive bf16 exactly: rounding an e5m3 value again changes nothing.
    finite = np.isfinite(got)
    np.testing.assert_array_equal(quant.e5m3(got[finite].astype(np.float32).astype(BF16)), got[finite])
    specials = np.array([np.inf, np.nan, -0.0], np.float32).astype(BF16)
    assert list(quant.q4_scale_codes(specials)) == [0xF8, 0xFF, 0]
    with pytest.raises(ValueError, match=r"q4 scale \(1,\) is negative"):
        quant.q4_scale_codes(np.array([1.0, -2.0], np.float32))


@pytest.mark.parametrize("rows,cols", [(1, 1), (2, 31), (3, 32), (5, 33), (4, 100), (8, 4096)])
def test_q4_rule_round_trip_and_odd_shapes(rows, cols):
    w = random_bf16((rows, cols), seed=rows * 1000 + cols)
    qm = quantize_q4(w)
    groups = -(-cols // 32)
    assert qm.data.shape == (rows, groups * 16) and qm.data.dtype == np.uint8
    assert qm.scale.shape == (rows, groups)
    w32 = np.zeros((rows, groups * 32), np.float32)
    w32[:, :cols] = w.astype(np.float32)
    g = w32.reshape(rows, groups, 32)
    bf16 = (np.max(np.abs(g), axis=2) / np.float32(7)).astype(np.float32).astype(BF16)
    want = e5m3_by_value(bf16.astype(np.float64)).astype(np.float32).astype(BF16)
    assert qm.scale.tobytes() == want.tobytes()              # the scale rule, bit for bit
    codes = unpack_q4(qm.data)
    assert codes.min() >= -7 and codes.max() <= 7
    assert (codes[:, cols:] == 0).all()                      # padding holds q = 0
    s = np.repeat(want.astype(np.float32), 32, axis=1)
    np.testing.assert_array_equal(codes, np.clip(np.rint(w32 / s), -7, 7))
    assert (np.abs(np.rint(w32 / s)) <= 7).all()             # nothing was clipped
    back = qm.dequantize()
    assert back.shape == (rows, cols) and back.dtype == np.float32
    # q * scale is exact in fp32: the float64 product equals the fp32 result.
    np.testing.assert_array_equal(back.astype(np.float64),
                                  codes[:, :cols].astype(np.float64) * s[:, :cols].astype(np.float64))
    err = np.abs(back.astype(np.float64) - w32[:, :cols])
    assert (err <= s[:, :cols] / 2 * (1 + 4 * F32_ULP)).all()


def test_relative_error_of_gaussian_matrices():
    """The per-element bounds give relative L2 <= max|w| / (254 rms) (int8) and max|w| / (14 rms)
    (q4, max over the matrix); uniform rounding error makes it about 1/sqrt(3) of that."""
    w = random_bf16((64, 4096), seed=7)
    w32 = w.astype(np.float64)
    peak = np.abs(w32).max() / np.sqrt(np.mean(w32 ** 2))
    for fmt, half_steps in (("int8", 254), ("q4", 14)):
        back = quant.quantize(w, fmt).dequantize().astype(np.float64)
        rel = np.linalg.norm(back - w32) / np.linalg.norm(w32)
        print(f"{fmt}: relative L2 round-trip error {rel:.4f} (Gaussian weights)")
        assert rel <= peak / half_steps


def test_zero_group_and_tiny_scale():
    w = np.zeros((1, 96), np.float32)
    w[0, 40] = 7 * 2.0 ** -17                                 # the smallest e5m3 scale, 2^-17
    w[0, 70] = 1e-30                                          # its scale rounds to 0
    qm = quantize_q4(w)
    assert float(qm.scale[0, 0]) == 0 and (unpack_q4(qm.data)[0, :32] == 0).all()
    assert float(qm.scale[0, 1]) == 2.0 ** -17 and unpack_q4(qm.data)[0, 40] == 7
    assert float(qm.scale[0, 2]) == 0 and unpack_q4(qm.data)[0, 70] == 0  # |error| = 1e-30


def test_quantization_is_deterministic():
    w = random_bf16((300, 257), seed=3)
    for fmt in ("int8", "q4"):
        a, b = quant.quantize(w, fmt), quant.quantize(w.copy(), fmt)
        assert a.data.tobytes() == b.data.tobytes() and a.scale.tobytes() == b.scale.tobytes()


def test_row_blocks_do_not_change_results(monkeypatch):
    w = random_bf16((70, 96), seed=4)
    whole = {f: quant.quantize(w, f) for f in ("int8", "q4")}
    monkeypatch.setattr(quant, "_ROW_BLOCK", 16)
    for f, qm in whole.items():
        again = quant.quantize(w, f)
        assert again.data.tobytes() == qm.data.tobytes() and again.scale.tobytes() == qm.scale.tobytes()


# ---- the q4 GEMV's input: int8 per group of 32 (w4a8) ---------------------------------------------

@pytest.mark.parametrize("cols", [1, 7, 32, 33, 100, 4096])
def test_input_q8_rule_bit_for_bit(cols):
    rng = np.random.default_rng(cols)
    x = (rng.standard_normal(cols) * rng.uniform(0.01, 100, cols)).astype(np.float32)
    if cols >= 8:
        x[1:4] = 0.0                                        # a group that is partly zeros
    q, scale = quant.quantize_input_q8(x)
    groups = -(-cols // 32)
    assert q.dtype == np.int8 and q.shape == (groups * 32,) and scale.shape == (groups,)
    for g in range(groups):                                 # the rule, one group at a time
        v = x[32 * g:32 * g + 32]
        amax = np.float32(np.max(np.abs(v)))
        assert scale[g] == np.float32(amax / np.float32(127))
        inv = np.float32(np.float32(127) / amax)
        want = [int(np.rint(np.float32(e * inv))) for e in v]
        assert list(q[32 * g:32 * g + len(v)]) == want
        assert np.abs(q[32 * g:32 * g + 32]).max() == 127  # the group's largest maps to +-127
    assert not q[cols:].any()                               # pad columns are zero codes


def test_input_q8_zero_and_non_finite_groups():
    x = np.zeros(96, np.float32)
    x[40], x[70] = np.inf, np.nan
    x[33] = 5.0
    q, scale = quant.quantize_input_q8(x)
    assert scale[0] == 0 and not q[:32].any()               # all-zero group: scale 0, codes 0
    assert np.isnan(scale[1]) and np.isnan(scale[2])        # inf / NaN: the group's scale is NaN
    assert np.isnan(quant.dequantize_input_q8(x)[32:]).all()


def test_input_q8_error_is_small_next_to_q4_weights():
    """Measured: the relative L2 error input quantization adds to a GEMV, against the error of
    the q4 weights themselves, on Gaussian data (4096 columns, 256 rows)."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((256, 4096)).astype(np.float32)
    x = rng.standard_normal(4096).astype(np.float32)
    exact = w.astype(np.float64) @ x
    wq = quantize_q4(w).dequantize().astype(np.float64)
    xq = quant.dequantize_input_q8(x).astype(np.float64)
    err_input = rel_l2(w.astype(np.float64) @ xq, exact)
    err_weights = rel_l2(wq @ x, exact)
    err_both = rel_l2(wq @ xq, exact)
    print(f"GEMV rel L2 error: int8 input {err_input:.3g}, q4 weights {err_weights:.3g}, both {err_both:.3g}")
    # per element the rounding is uniform in +-scale/2 (rms scale / sqrt(12)); scale = max|x| / 127
    # of a group of 32 Gaussians (E max ~ 2.1 sigma): ~0.5% of the rms input
    assert 0.003 < err_input < 0.008
    assert err_both < err_weights * 1.01


# ---- schemes and the tensor stream -------------------------------------------------------------

def test_tensor_classes_and_schemes():
    assert tensor_class("model.layers.0.self_attn.q_proj.weight") == "dense"
    assert tensor_class("model.layers.2.mlp.down_proj.weight") == "dense"
    assert tensor_class("model.layers.2.mlp.experts.5.up_proj.weight") == "experts"
    assert tensor_class("model.layers.2.mlp.gate.weight") is None          # the router stays bf16
    assert tensor_class("model.layers.2.input_layernorm.weight") is None
    assert tensor_class("model.embed_tokens.weight") is None
    assert tensor_class("lm_head.weight") == "lm_head"
    s = WeightScheme.make("q4", "experts")
    assert (s.dense, s.experts, s.lm_head) == ("bf16", "q4", "bf16") and s.label() == "q4:experts"
    assert WeightScheme.make("int8", "all", True).label() == "int8+lm"
    assert WeightScheme.make().is_bf16 and WeightScheme.make().label() == "bf16"
    with pytest.raises(ValueError, match="q8"):
        WeightScheme.make("q8")
    with pytest.raises(ValueError, match="some"):
        WeightScheme.make("q4", "some")


@pytest.mark.parametrize("quantize", ["all", "dense", "experts"])
def test_stream_quantizes_what_the_scheme_names(quantize):
    config = preset_config("tiny-moe")
    scheme = WeightScheme.make("q4", quantize, quantize_lm_head=True)
    plain = dict(iter_tensors(config))
    out = list(quantize_stream(config, plain.items(), scheme, workers=3))
    assert [n for n, _ in out] == list(plain)                # same names, same order
    for name, t in out:
        cls = tensor_class(name)
        quantized = cls is not None and getattr(scheme, cls) != "bf16"
        assert isinstance(t, QuantizedMatrix) == quantized, name
        if not quantized:
            assert t is plain[name]
    # one worker or many: the same bytes
    serial = dict(quantize_stream(config, plain.items(), scheme, workers=1))
    for name, t in out:
        if isinstance(t, QuantizedMatrix):
            assert t.data.tobytes() == serial[name].data.tobytes()


def test_tied_model_gets_a_quantized_lm_head_copy():
    config = preset_config("tiny-tied")
    plain = dict(iter_tensors(config))
    out = dict(quantize_stream(config, plain.items(), WeightScheme.make("int8", "all", True)))
    assert "lm_head.weight" in out and "lm_head.weight" not in plain
    assert out["model.embed_tokens.weight"] is plain["model.embed_tokens.weight"]  # gather stays bf16
    expected = quantize_int8(plain["model.embed_tokens.weight"])
    assert out["lm_head.weight"].data.tobytes() == expected.data.tobytes()


def test_tied_model_with_an_lm_head_of_its_own_gets_no_copy():
    config = preset_config("tiny-tied")
    plain = dict(iter_tensors(config))
    own = np.asarray(plain["model.embed_tokens.weight"], np.float32)[::-1].copy()
    scheme = WeightScheme.make("int8", "all", True)
    out = list(quantize_stream(config, [*plain.items(), ("lm_head.weight", own)], scheme))
    assert [n for n, _ in out].count("lm_head.weight") == 1
    assert dict(out)["lm_head.weight"].data.tobytes() == quantize_int8(own).data.tobytes()


def test_a_quantized_stream_passes_through_and_a_wrong_format_is_named():
    config = preset_config("tiny-tied")
    scheme = WeightScheme.make("q4", "all", True)
    once = list(quantize_stream(config, iter_tensors(config), scheme))
    again = list(quantize_stream(config, once, scheme, workers=2))
    assert [n for n, _ in again] == [n for n, _ in once]               # the lm_head copy once
    assert all(a is b for (_, a), (_, b) in zip(once, again))
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\..*' arrives quantized as q4, "
                                         r"but the weights int8\+lm make it int8"):
        list(quantize_stream(config, once, WeightScheme.make("int8", "all", True)))


# ---- the reference with quantized weights vs an independent float64 model -----------------------

STEPS = 12
FP32_REL_L2 = 1e-5   # as test_reference.py: fp32 arithmetic vs float64, identical weights


@pytest.mark.parametrize("kind,seed", [("qwen3", 1), ("llama", 2), ("qwen3_moe", 4)])
@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_reference_with_quantized_weights_matches_float64_dequantized(kind, seed, fmt):
    config = tiny_config(kind)
    tensors = tiny_tensors(config, seed)
    scheme = WeightScheme.make(fmt, "all", quantize_lm_head=not config.tie_word_embeddings)
    quantized = dict(quantize_stream(config, tensors.items(), scheme))
    assert sum(isinstance(t, QuantizedMatrix) for t in quantized.values()) > 0
    dequantized = {n: t.dequantize() if isinstance(t, QuantizedMatrix) else t for n, t in quantized.items()}
    q4 = frozenset(n for n, t in quantized.items() if isinstance(t, QuantizedMatrix) and t.format == "q4")
    f64 = Float64Model(config, dequantized, int8_inputs=q4)
    dec = ReferenceDecoder(config, quantized, kv_dtype="fp32", max_seq_len=32)
    token, errors = 5, []
    for _ in range(STEPS):
        expected, ours = f64.step(token), dec.step(token)
        errors.append(rel_l2(ours, expected))
        token = int(np.argmax(expected))
    assert max(errors) < FP32_REL_L2, errors


def test_quantized_vs_bf16_reference_is_close_but_not_equal():
    config = tiny_config("llama")
    tensors = tiny_tensors(config, 2)
    base = ReferenceDecoder(config, tensors, kv_dtype="fp32", max_seq_len=32)
    for fmt, bound in (("int8", 0.05), ("q4", 0.5)):
        q = dict(quantize_stream(config, tensors.items(), WeightScheme.make(fmt)))
        dec = ReferenceDecoder(config, q, kv_dtype="fp32", max_seq_len=32)
        base.reset()
        errs = [rel_l2(dec.step(t), base.step(t)) for t in (5, 9, 11, 2)]
        print(f"{fmt} vs bf16 reference: logits rel L2 {max(errs):.3g}")
        assert 0 < max(errs) < bound


def test_q4_dequantize_matches_manual_unpacking():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (3, 32), dtype=np.uint8)
    scale = np.abs(rng.standard_normal((3, 2))).astype(BF16)  # any bf16: rounded to e5m3 first
    out = dequantize_q4(data, scale, 50)
    lo = (data & 15).astype(np.int64)
    hi = (data >> 4).astype(np.int64)
    codes = np.empty((3, 64), np.int64)
    codes[:, 0::2] = np.where(lo >= 8, lo - 16, lo)
    codes[:, 1::2] = np.where(hi >= 8, hi - 16, hi)
    want = codes * np.repeat(e5m3_by_value(scale.astype(np.float64)), 32, axis=1)
    np.testing.assert_array_equal(out.astype(np.float64), want[:, :50])


# ---- the engine's CPU path, the C ABI's config, the benchmark's byte counts ---------------------

def test_engine_cpu_path_decodes_the_quantized_model():
    from onegraph.engine import Engine
    config = preset_config("tiny-moe")
    tensors = dict(iter_tensors(config))
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="cpu", weights="q4",
                             quantize="experts", quantize_lm_head=True) as engine:
        tokens = engine.generate([3, 17, 99], 8, stop_token_ids=())
    quantized = dict(quantize_stream(config, tensors.items(), WeightScheme.make("q4", "experts", True)))
    ref = ReferenceDecoder(config, quantized, kv_dtype="int8", max_seq_len=64)
    logits, expected = ref.prefill([3, 17, 99]), []
    for _ in range(8):
        expected.append(int(np.argmax(logits)))
        logits = ref.step(expected[-1])
    assert tokens == expected


def test_config_default_and_validation_of_weight_formats():
    import ctypes
    from onegraph import capi
    try:
        lib = capi.load_library()
    except capi.LibraryUnavailable as e:
        pytest.skip(str(e))
    cfg = capi.OgConfig()
    lib.og_config_default(ctypes.byref(cfg))
    assert (cfg.weights_dense, cfg.weights_experts, cfg.weights_lm_head) == (capi.OG_WEIGHTS_BF16,) * 3
    for field in ("weights_dense", "weights_experts", "weights_lm_head"):
        bad = capi.OgConfig()
        lib.og_config_default(ctypes.byref(bad))
        bad.vocab_size, bad.hidden_size, bad.intermediate_size = 64, 32, 48
        bad.num_hidden_layers, bad.num_attention_heads, bad.num_key_value_heads, bad.head_dim = 1, 2, 1, 16
        setattr(bad, field, 3)
        handle = capi.Handle()
        assert lib.og_init(ctypes.byref(bad), ctypes.byref(handle)) == capi.OG_E_INVALID_ARGUMENT
        assert f"og_config.{field}=3" in capi.last_error()


def test_benchmark_counts_quantized_bytes():
    from bench import floor
    c = preset_config("qwen3-8b")
    bf16 = floor.weight_bytes_per_token(c)
    q4 = floor.weight_bytes_per_token(c, "q4", lm_head_fmt="q4")
    H, I = 4096, 12288
    assert q4["ffn"] == 36 * (2 * I * (H // 32) * 17 + H * (I // 32) * 17)   # e5m3 scales: 17 B per group
    assert q4["embedding_row"] == bf16["embedding_row"] == 2 * H             # the gather stays bf16
    print(f"qwen3-8b bytes/token: bf16 {bf16['total'] / 1e9:.2f} GB, q4 {q4['total'] / 1e9:.2f} GB "
          f"({bf16['total'] / q4['total']:.2f}x fewer)")
    assert 3.6 < bf16["total"] / q4["total"] < 3.8
    moe = preset_config("qwen3-30b-a3b")
    experts_only = floor.weight_bytes_per_token(moe, "q4", lm_head_fmt="bf16", quantize="experts")
    base = floor.weight_bytes_per_token(moe)
    assert experts_only["attention"] == base["attention"] and experts_only["lm_head"] == base["lm_head"]
    assert experts_only["ffn"] * 2 * 32 == base["ffn"] * 17                 # 17 of 64 bytes per 32 weights
