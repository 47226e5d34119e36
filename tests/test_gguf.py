"""GGUF input: synth -> write_gguf -> load_model round trips, and one clear error per bad file.

Every file here is written by the test with the gguf package's GGUFWriter (through write_gguf,
or `rewrite` below, which copies a GGUF with changes). The independent oracle (transformers'
own GGUF reader) is in test_gguf_oracle.py.
"""
import os

import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from onegraph import synth  # noqa: E402
from onegraph.engine import Engine  # noqa: E402
from onegraph.gguf_model import permute_rows, unpermute_rows, write_gguf  # noqa: E402
from onegraph.loader import LoaderError, load_model  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)

# Shapes whose rows are whole blocks of 32 (gguf.quants quantizes whole blocks only).
LLAMA = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=192)
MOE = dict(moe_intermediate_size=64, mlp_only_layers=[])


def model(preset, **overrides):
    config = synth.preset_config(preset, **overrides)
    return config, dict(synth.iter_tensors(config))


def as_f32(a):
    return np.asarray(a, dtype=np.float32)


# ---- helpers: copy a GGUF with changes ------------------------------------------------------

def rewrite(src, dst, drop=(), fields=None, arch=None, extra=None):
    """Copy GGUF src to dst, without the tensors in `drop`, with metadata `fields` replaced
    ({key: value}, same value type as before), optionally another general.architecture (its
    keys renamed) and `extra` F32 tensors ({name: array}) added."""
    reader = gguf.GGUFReader(src)
    old_arch = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(dst, arch or old_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = (fields or {}).get(key, field.contents())
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        new_key = key.replace(f"{old_arch}.", f"{arch}.", 1) if arch else key
        writer.add_key_value(new_key, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name not in drop:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, np.asarray(array, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


# ---- round trips ----------------------------------------------------------------------------

@pytest.mark.parametrize("preset,overrides", [
    ("tiny-llama", LLAMA), ("tiny-dense", {}), ("tiny-tied", {}), ("tiny-moe", MOE)])
@pytest.mark.parametrize("kind", ["F32", "F16", "BF16"])
def test_float_round_trip_is_exact(tmp_path, preset, overrides, kind):
    """Synth tensors are bf16 values: F32, F16 (|x| < 2^16, 11-bit mantissa holds bf16's 8
    for normal values) and BF16 all hold them exactly, so the load must give back the same bits
    (this also checks the llama Q/K permutation is undone exactly)."""
    config, tensors = model(preset, **overrides)
    path = write_gguf(config, tensors, tmp_path / "m.gguf", types=kind)
    loaded = load_model(path)
    assert loaded.config.replace(source="", rms_norm_eps=config.rms_norm_eps) == config.replace(source="")
    assert float(np.float32(loaded.config.rms_norm_eps)) == float(np.float32(config.rms_norm_eps))
    assert list(loaded.tensors) == list(config.tensor_shapes())
    assert loaded.ignored == [] and loaded.files == [os.fspath(path)]
    for name, ref in tensors.items():
        got = loaded.tensors[name]
        assert got.dtype == (np.float32 if ref.ndim == 1 else BF16), name
        assert not got.flags.writeable
        if kind == "F16":
            tiny = np.abs(as_f32(ref)) < 2.0 ** -14  # F16 subnormals lose bits bf16 has
            np.testing.assert_array_equal(as_f32(got)[~tiny], as_f32(ref)[~tiny], err_msg=name)
        else:
            np.testing.assert_array_equal(as_f32(got), as_f32(ref), err_msg=name)


# llama.cpp's block quantizers, per block of 32 with a step d stored as fp16:
#   Q8_0: d = max|x| / 127, q = round(x / d): error <= d / 2;
#   Q4_0: d = -(signed value of largest |x|) / 8, q = clamp(round(x / d) + 8, 0, 15): the
#         opposite end of [-8d, 8d] is clamped to 7d, so error <= d;
#   Q4_1: d = (max - min) / 15, q = round((x - min) / d): error <= d / 2.
# Plus the fp16 rounding of d (2^-11 relative, times |q| d <= max|x| + d) and the bf16
# rounding of the result (2^-9 relative; 2^-8 leaves room for the error above).
BLOCK_STEP = {  # kind -> (step of a block of values b, error in steps)
    "Q8_0": (lambda b: np.abs(b).max(-1) / 127, 0.5),
    "Q4_0": (lambda b: np.abs(b).max(-1) / 8, 1.0),
    "Q4_1": (lambda b: (b.max(-1) - b.min(-1)) / 15, 0.5),
}


@pytest.mark.parametrize("kind", list(BLOCK_STEP))
def test_quantized_round_trip_within_block_error(tmp_path, kind):
    config, tensors = model("tiny-llama", **LLAMA)
    loaded = load_model(write_gguf(config, tensors, tmp_path / "m.gguf", types=kind))
    step_of, steps = BLOCK_STEP[kind]
    for name, ref in tensors.items():
        ref = as_f32(ref)
        got = as_f32(loaded.tensors[name])
        if ref.ndim == 1:
            np.testing.assert_array_equal(got, ref, err_msg=name)
            continue
        blocks = ref.reshape(ref.shape[0], -1, 32)
        per_block = steps * step_of(blocks) + 2.0 ** -10 * np.abs(blocks).max(-1)
        bound = np.repeat(per_block, 32, axis=-1).reshape(ref.shape) + np.abs(ref) * 2.0 ** -8
        err = np.abs(got - ref)
        assert (err <= bound).all(), (name, float((err - bound).max()))
        assert (err > 0).any(), name  # the file really was quantized


def test_permutation_is_llama_cpp_s():
    """permute_rows is the converter's: row (h, i) of head h's rotate-half pair i (i < d/2) and
    row (h, d/2 + i) become rows (h, 2i) and (h, 2i + 1)."""
    heads, d = 3, 8
    w = np.arange(heads * d)[:, None] * np.ones((1, 2))
    p = permute_rows(w, heads)
    for h in range(heads):
        for i in range(d // 2):
            assert p[h * d + 2 * i, 0] == h * d + i
            assert p[h * d + 2 * i + 1, 0] == h * d + d // 2 + i
    np.testing.assert_array_equal(unpermute_rows(p, heads), w)


def assert_same_tokens(path, config, tensors, n):
    """Engine.from_pretrained on the GGUF at path decodes n greedy tokens as on the tensors."""
    prompt = [3, 17, 250, 9]
    with Engine.from_pretrained(path, device="cpu", kv="fp32") as engine:
        ours = engine.generate(prompt, n, stop_token_ids=())
    with Engine.from_tensors(config, tensors, device="cpu", kv="fp32") as engine:
        ref = engine.generate(prompt, n, stop_token_ids=())
    assert ours == ref


def test_engine_from_gguf_matches_engine_from_tensors(tmp_path):
    config, tensors = model("tiny-dense")
    assert_same_tokens(write_gguf(config, tensors, tmp_path / "m.gguf", types="BF16"), config, tensors, 8)


def test_placeholder_vocab_is_written_and_checked(tmp_path):
    """A vocabulary given to write_gguf lands as a gpt2-type tokenizer that gguf reads back;
    one of the wrong length is refused before anything is written."""
    config, tensors = model("tiny-dense")
    vocab = [f"<t{i}>" for i in range(config.vocab_size)]
    path = write_gguf(config, tensors, tmp_path / "m.gguf", types="BF16", vocab=vocab)
    reader = gguf.GGUFReader(path)
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert reader.fields["tokenizer.ggml.tokens"].contents() == vocab
    with pytest.raises(ValueError, match=f"vocab: 3 tokens, the config's vocab_size is {config.vocab_size}"):
        write_gguf(config, tensors, tmp_path / "short.gguf", vocab=vocab[:3])
    assert not (tmp_path / "short.gguf").exists()


def test_pack_reads_gguf(tmp_path):
    from onegraph.pack import open_packed, pack_model
    config, tensors = model("tiny-tied")
    path = write_gguf(config, tensors, tmp_path / "m.gguf", types="BF16")
    packed = pack_model(path, tmp_path / "m.og")
    packed_config, packed_tensors = open_packed(packed)
    assert packed_config.num_hidden_layers == config.num_hidden_layers
    for name, ref in tensors.items():
        np.testing.assert_array_equal(as_f32(packed_tensors[name]), as_f32(ref), err_msg=name)


def test_cli_info_reads_gguf(tmp_path, capsys):
    import json
    from onegraph.cli import main
    config, tensors = model("tiny-moe", **MOE)
    path = write_gguf(config, tensors, tmp_path / "m.gguf", types="Q8_0")
    assert main(["info", "--model", os.fspath(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "Qwen3MoeForCausalLM" and info["layers"] == 3
    assert info["experts"] == "8 (top 2)"


# ---- bad files: one line, naming the file and the problem -----------------------------------

@pytest.fixture
def good(tmp_path):
    config, tensors = model("tiny-llama", **LLAMA)
    return config, write_gguf(config, tensors, tmp_path / "good.gguf", types="Q8_0")


def one_line_error(path, *needles):
    with pytest.raises(LoaderError) as info:
        load_model(path)
    message = str(info.value)
    assert "\n" not in message and os.fspath(path) in message, message
    for needle in needles:
        assert needle in message, message
    return message


def test_truncated(tmp_path, good):
    _, path = good
    data = open(path, "rb").read()
    for keep in (len(data) - 100, len(data) // 2, 64, 10):
        bad = tmp_path / f"cut{keep}.gguf"
        bad.write_bytes(data[:keep])
        one_line_error(bad, "truncated")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"\x00" * 4096)
    one_line_error(bad, "not a GGUF file")


def test_unsupported_architecture(tmp_path, good):
    _, path = good
    bad = rewrite(path, tmp_path / "gpt2.gguf", arch="gpt2")
    one_line_error(bad, "'gpt2'", "not supported")


def test_unsupported_tensor_type(tmp_path):
    config, tensors = model("tiny-llama", **LLAMA)
    name = "model.layers.1.mlp.up_proj.weight"
    path = write_gguf(config, tensors, tmp_path / "q5.gguf", types={name: "Q5_0"})
    one_line_error(path, "blk.1.ffn_up.weight", "Q5_0")


def test_shape_disagrees_with_metadata(tmp_path, good):
    config, path = good
    bad = rewrite(path, tmp_path / "ff.gguf", fields={"llama.feed_forward_length": 224})
    one_line_error(bad, "blk.0.ffn_gate.weight", "[192, 128]", "[224, 128]")


def test_missing_tensor(tmp_path, good):
    _, path = good
    bad = rewrite(path, tmp_path / "missing.gguf", drop={"blk.2.attn_v.weight"})
    one_line_error(bad, "blk.2.attn_v.weight", "missing")


def test_qwen2_reads_as_llama_without_permutation(tmp_path):
    """The same file bytes under 'qwen2' are not un-permuted: Q comes back as stored."""
    config, tensors = model("tiny-llama", **LLAMA)
    path = write_gguf(config, tensors, tmp_path / "l.gguf", types="F32")
    loaded = load_model(rewrite(path, tmp_path / "qwen2.gguf", arch="qwen2"))
    assert loaded.config.architecture == "LlamaForCausalLM"
    q = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(as_f32(loaded.tensors[q]),
                                  permute_rows(as_f32(tensors[q]), config.num_attention_heads))


def test_bias_tensors_refused(tmp_path):
    """Qwen2's q/k/v biases are not implemented: refused, not dropped."""
    config, tensors = model("tiny-llama", **LLAMA)
    path = write_gguf(config, tensors, tmp_path / "l.gguf", types="F32")
    bad = rewrite(path, tmp_path / "qwen2.gguf", arch="qwen2",
                  extra={"blk.0.attn_q.bias": np.zeros(config.q_size)})
    one_line_error(bad, "blk.0.attn_q.bias", "bias")


# ---- Llama 3.x rope scaling: the rope_freqs tensor ------------------------------------------

# tiny-llama3's rope scaling at LLAMA's head_dim 32 (theta 10000): wavelengths 6.3, 11.2, 19.9,
# 35.3, ... against its original context of 32 (kept below 8, divided above 32) take every branch.


def test_llama3_rope_scaling_round_trips_as_rope_freqs(tmp_path):
    """A llama3-scaled model is written with llama.cpp's rope_freqs tensor (one divisor per
    frequency) and reads back as a 'freq_factors' scaling that rotates by the same
    frequencies, to fp32 rounding; a model decoded from the GGUF gives the same tokens."""
    from onegraph.reference import rope_frequencies, rope_frequency_factors
    config, tensors = model("tiny-llama3", **LLAMA)
    factors = rope_frequency_factors(config)
    assert factors[0] == 1.0 and factors[-1] == 8.0 and 1.0 < factors[2] < 8.0   # every branch
    path = write_gguf(config, tensors, tmp_path / "m.gguf", types="F32")
    reader = gguf.GGUFReader(path)
    stored = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    np.testing.assert_array_equal(np.asarray(stored.data), factors.astype(np.float32))
    loaded = load_model(path)
    assert loaded.config.rope_scaling["rope_type"] == "freq_factors" and loaded.ignored == []
    np.testing.assert_allclose(rope_frequencies(loaded.config), rope_frequencies(config), rtol=2.4e-7)
    assert_same_tokens(path, config, tensors, 40)


def test_rope_freqs_of_the_wrong_length_or_type(tmp_path, good):
    config, path = good
    half = config.head_dim // 2
    short = rewrite(path, tmp_path / "short.gguf", extra={"rope_freqs.weight": np.ones(half - 1)})
    one_line_error(short, f"{half} positive finite numbers", f"factors={half - 1} values")
    negative = rewrite(path, tmp_path / "neg.gguf", extra={"rope_freqs.weight": -np.ones(half)})
    one_line_error(negative, "positive finite")


def test_rope_freqs_beside_a_linear_scaling_is_refused(tmp_path):
    config, tensors = model("tiny-llama", **LLAMA, rope_scaling={"rope_type": "linear", "factor": 2.0})
    path = write_gguf(config, tensors, tmp_path / "linear.gguf", types="F32")
    both = rewrite(path, tmp_path / "both.gguf", extra={"rope_freqs.weight": np.ones(config.head_dim // 2)})
    one_line_error(both, "rope_freqs.weight", "one rope scaling at a time")
