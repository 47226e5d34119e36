"""Packed model files: the writer (runtime/pack.py), the C parser (cuda/packed_file.c) on
valid and malformed files, a fuzz run under AddressSanitizer, the C and Rust examples.

The parser is tested twice where the library is built: alone (packed_file.c compiled here
with -DOG_PACKED_PARSER_ONLY into a small .so, so CI needs no CUDA), and inside
libonegraph.so, where its messages must reach og_last_error(). The GPU test at the end runs
the C program, the Rust program and the Python engine on the same file and prompt; they
must print the same tokens.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

from gpu_support import skip_or_fail
from onegraph import capi
from onegraph.config import ModelConfig
from onegraph.pack import (KEY_CONFIG, KEY_FORMAT_VERSION, KEY_OG_CONFIG, KEY_WEIGHTS, PackError,
                          og_config_fields, open_packed, write_packed)
from onegraph.synth import iter_tensors, preset_config, write_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_DIR = os.path.join(ROOT, "cuda")
LIBRARY = os.path.join(ROOT, "runtime", "_lib", "libonegraph.so")
BAD_FILE, UNSUPPORTED, INVALID_ARGUMENT = capi.OG_E_BAD_FILE, capi.OG_E_UNSUPPORTED, capi.OG_E_INVALID_ARGUMENT
PROMPT = [9, 41, 7, 200, 12, 5, 77, 150]  # inside every tiny vocabulary (tiny-tied: 300)


def _cc():
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


# ---- files ------------------------------------------------------------------------------

def _small(preset, **overrides):
    config = preset_config(preset, **overrides)
    return config, dict(iter_tensors(config, seed=3))


MODELS = ("tiny-dense", "tiny-tied", "tiny-moe", "tiny-llama3")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{preset: (config, tensors, packed path)} for a dense, a tied, an MoE and a llama3 model."""
    out = tmp_path_factory.mktemp("packed")
    result = {}
    for preset in MODELS:
        config, tensors = _small(preset)
        path = write_packed(config, tensors, out / f"{preset}.og.safetensors")
        result[preset] = (config, tensors, str(path))
    return result


def split_file(raw: bytes) -> tuple[bytes, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8:8 + n], raw[8 + n:]


def join_file(header: bytes | str, data: bytes) -> bytes:
    if isinstance(header, str):
        header = header.encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def edit_header(raw: bytes, edit) -> bytes:
    """Apply edit(header dict) (key order kept) and rebuild the file around the same data."""
    text, data = split_file(raw)
    header = json.loads(text)
    edit(header)
    return join_file(json.dumps(header, separators=(",", ":")), data)


def edit_og_config(raw: bytes, edit) -> bytes:
    def apply(header):
        fields = json.loads(header["__metadata__"][KEY_OG_CONFIG])
        edit(fields)
        header["__metadata__"][KEY_OG_CONFIG] = json.dumps(fields)
    return edit_header(raw, apply)


def tensor_names(raw: bytes) -> list[str]:
    return [k for k in json.loads(split_file(raw)[0]) if k != "__metadata__"]


# ---- the parser, alone and inside the library ---------------------------------------------

@pytest.fixture(scope="module")
def parser_only(tmp_path_factory):
    """packed_file.c built alone (no CUDA): og_packed_validate, og_argmax, og_last_error."""
    cc = _cc()
    if cc is None:
        pytest.skip("no C compiler (gcc/cc) to build the parser")
    out = tmp_path_factory.mktemp("parser") / "libogpacked.so"
    subprocess.run([cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
                    "-DOG_PACKED_PARSER_ONLY", "-I", CUDA_DIR, os.path.join(CUDA_DIR, "packed_file.c"),
                    "-o", str(out)], check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(out))
    lib.og_packed_validate.restype = ctypes.c_int32
    lib.og_packed_validate.argtypes = [ctypes.c_char_p]
    lib.og_last_error.restype = ctypes.c_char_p
    lib.og_argmax.restype = ctypes.c_int32
    lib.og_argmax.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)]
    return lib


@pytest.fixture(scope="module", params=["parser-only", "library"])
def validate(request, parser_only):
    """validate(path) -> (status, message), through the parser alone or libonegraph.so."""
    if request.param == "parser-only":
        lib = parser_only
    else:
        try:
            lib = capi.load_library()
        except capi.LibraryUnavailable as e:
            pytest.skip(str(e))

    def run(path):
        status = lib.og_packed_validate(os.fspath(path).encode())
        message = lib.og_last_error()
        return status, (message or b"").decode("utf-8", "replace")
    return run


def test_accepts_what_pack_writes(models, validate):
    for config, _, path in models.values():
        status, message = validate(path)
        assert status == capi.OG_OK, message


def _case(tmp_path, raw: bytes, name="case.og.safetensors"):
    path = tmp_path / name
    path.write_bytes(raw)
    return path


def _first_norm(raw):
    return next(n for n in tensor_names(raw) if n.endswith("input_layernorm.weight"))


def _set_entry(name, key, value):
    return lambda h: h[name].__setitem__(key, value)


# Each malformed file: (id, make(raw) -> bytes, status, substrings the message must hold).
# Names are resolved on tiny-dense, whose tensors are (in order) the embedding, layer 0's
# input norm, q_proj, ..., model.norm.weight, lm_head.weight.
MALFORMED = [
    ("truncated", lambda raw: raw[:-1], BAD_FILE, ["'lm_head.weight'", "truncated file or offsets out of range"]),
    ("shorter-than-length-field", lambda raw: raw[:5], BAD_FILE, ["file is 5 bytes, too short"]),
    ("header-length-beyond-file", lambda raw: struct.pack("<Q", len(raw)) + raw[8:], BAD_FILE,
     ["header length field says", "truncated or corrupt"]),
    ("header-length-over-limit", lambda raw: struct.pack("<Q", 200_000_000) + raw[8:], BAD_FILE,
     ["beyond the 100000000-byte limit"]),
    ("header-length-tiny", lambda raw: struct.pack("<Q", 1) + raw[8:], BAD_FILE, ["too short for a JSON object"]),
    ("offsets-out-of-bounds",
     lambda raw: edit_header(raw, lambda h: h["lm_head.weight"].__setitem__(
         "data_offsets", [o + 2 for o in h["lm_head.weight"]["data_offsets"]])),
     BAD_FILE, ["'lm_head.weight'", "out of range"]),
    ("overlapping-offsets",
     lambda raw: edit_header(raw, lambda h: h["model.layers.0.self_attn.v_proj.weight"].__setitem__(
         "data_offsets", h["model.layers.0.self_attn.k_proj.weight"]["data_offsets"])),
     BAD_FILE, ["'model.layers.0.self_attn.k_proj.weight'", "'model.layers.0.self_attn.v_proj.weight'", "overlap"]),
    ("gap", lambda raw: edit_header(raw, lambda h: h.pop("model.layers.0.self_attn.q_proj.weight")),
     BAD_FILE, ["belong to no tensor", "'model.layers.0.self_attn.k_proj.weight'"]),
    ("trailing-bytes", lambda raw: raw + b"\0\0\0\0", BAD_FILE, ["4 trailing bytes"]),
    ("unknown-dtype", lambda raw: edit_header(raw, _set_entry("model.norm.weight", "dtype", "BF17")),
     BAD_FILE, ["'model.norm.weight'", "unknown dtype 'BF17'"]),
    ("dtype-size-mismatch", lambda raw: edit_header(raw, _set_entry("model.norm.weight", "dtype", "F32")),
     BAD_FILE, ["'model.norm.weight'", "span 192 bytes", "needs 384 bytes"]),
    ("dtype-not-in-a-bf16-file", lambda raw: edit_header(raw, _set_entry("model.norm.weight", "dtype", "F16")),
     BAD_FILE, ["'model.norm.weight'", "dtype F16"]),
    ("duplicate-names",
     lambda raw: join_file(split_file(raw)[0].replace(b'"model.layers.0.self_attn.k_proj.weight"',
                                                      b'"model.layers.0.self_attn.q_proj.weight"'), split_file(raw)[1]),
     BAD_FILE, ["'model.layers.0.self_attn.q_proj.weight' is named twice"]),
    ("duplicate-entry-field",
     lambda raw: join_file(split_file(raw)[0].replace(b'"dtype":"BF16"', b'"dtype":"BF16","dtype":"BF16"', 1),
                           split_file(raw)[1]), BAD_FILE, ["'model.embed_tokens.weight'", "repeated field 'dtype'"]),
    ("no-metadata", lambda raw: edit_header(raw, lambda h: h.pop("__metadata__")), BAD_FILE,
     ["no __metadata__", "not a packed model file"]),
    ("missing-config-metadata", lambda raw: edit_header(raw, lambda h: h["__metadata__"].pop(KEY_OG_CONFIG)),
     BAD_FILE, ["lacks 'onegraph.og_config'"]),
    ("missing-hf-config-metadata", lambda raw: edit_header(raw, lambda h: h["__metadata__"].pop(KEY_CONFIG)),
     BAD_FILE, ["lacks 'onegraph.config'"]),
    ("metadata-value-not-a-string",
     lambda raw: edit_header(raw, lambda h: h["__metadata__"].__setitem__(KEY_FORMAT_VERSION, 1)),
     BAD_FILE, ["'onegraph.format_version' must be a string"]),
    ("config-missing-key", lambda raw: edit_og_config(raw, lambda c: c.pop("head_dim")), BAD_FILE,
     ["required key 'head_dim' is missing"]),
    ("config-unknown-key", lambda raw: edit_og_config(raw, lambda c: c.__setitem__("sliding_window", 4)), BAD_FILE,
     ["unknown key 'sliding_window'"]),
    ("config-gqa", lambda raw: edit_og_config(raw, lambda c: c.__setitem__("num_key_value_heads", 4)), BAD_FILE,
     ["num_key_value_heads=4 must divide num_attention_heads=6"]),
    ("config-non-positive", lambda raw: edit_og_config(raw, lambda c: c.__setitem__("hidden_size", 0)), BAD_FILE,
     ["hidden_size = 0, must be in [1, 2147483647]"]),
    ("config-odd-head-dim", lambda raw: edit_og_config(raw, lambda c: c.__setitem__("head_dim", 15)), BAD_FILE,
     ["head_dim=15 must be even"]),
    ("config-layer-mask-length", lambda raw: edit_og_config(raw, lambda c: c.__setitem__("layer_is_moe", [0, 0])),
     BAD_FILE, ["layer_is_moe has 2 entries, num_hidden_layers=3"]),
    ("config-moe-without-experts", lambda raw: edit_og_config(raw, lambda c: c.__setitem__("layer_is_moe", [0, 1, 0])),
     BAD_FILE, ["num_experts=0"]),
    ("config-eps-not-positive", lambda raw: edit_og_config(raw, lambda c: c.__setitem__("rms_norm_eps", -1e-6)),
     BAD_FILE, ["rms_norm_eps = -1e-06 must be a positive number"]),
    ("config-rope-table-length",
     lambda raw: edit_og_config(raw, lambda c: c.__setitem__("rope_inv_freq", [1.0, 0.5])),
     BAD_FILE, ["rope_inv_freq has 2 entries, head_dim / 2 = 8"]),
    ("config-rope-table-value",
     lambda raw: edit_og_config(raw, lambda c: c.__setitem__("rope_inv_freq", [1.0] * 7 + [-1.0])),
     BAD_FILE, ["rope_inv_freq[7] = -1 must be a positive number"]),
    ("config-not-json",
     lambda raw: edit_header(raw, lambda h: h["__metadata__"].__setitem__(KEY_OG_CONFIG, '{"vocab_size":1,')),
     BAD_FILE, ["metadata 'onegraph.og_config', string byte 16: expected '\"' as a config key, found the end"]),
    ("json-trailing-comma",
     lambda raw: join_file(split_file(raw)[0].rstrip()[:-1] + b",}", split_file(raw)[1]), BAD_FILE,
     ["expected '\"' as a tensor name, found '}'"]),
    ("json-true-literal", lambda raw: edit_header(raw, _set_entry("model.norm.weight", "dtype", True)), BAD_FILE,
     ["'model.norm.weight': dtype must be a string"]),
    ("json-unterminated-string", lambda raw: join_file(split_file(raw)[0].rstrip()[:-60], split_file(raw)[1]),
     BAD_FILE, ["header byte", "string starting here is not terminated"]),
    ("json-invalid-escape",
     lambda raw: join_file(split_file(raw)[0].replace(b'"model.norm.weight"', b'"model.norm\\q"'), split_file(raw)[1]),
     BAD_FILE, ["invalid escape '\\q'"]),
    ("json-not-utf8",
     lambda raw: join_file(split_file(raw)[0].replace(b'"model.norm.weight"', b'"model.norm.\xffeight"'),
                           split_file(raw)[1]), BAD_FILE, ["invalid UTF-8"]),
    ("json-nul-in-name",
     lambda raw: join_file(split_file(raw)[0].replace(b'"model.norm.weight"', b'"model.norm\\u0000"'),
                           split_file(raw)[1]), BAD_FILE, ["\\u0000 inside a string"]),
    ("json-leading-zero", lambda raw: join_file(split_file(raw)[0].replace(b'"data_offsets":[0,', b'"data_offsets":[00,'),
                                                split_file(raw)[1]), BAD_FILE, ["leading zero"]),
    ("json-not-an-object", lambda raw: join_file(b"[" + split_file(raw)[0][1:], split_file(raw)[1]), BAD_FILE,
     ["header must start with '{', found '['"]),
    ("json-garbage-after-object", lambda raw: join_file(split_file(raw)[0].rstrip() + b"{}", split_file(raw)[1]),
     BAD_FILE, ["only whitespace may follow the header object"]),
    ("negative-offset", lambda raw: edit_header(raw, _set_entry("model.norm.weight", "data_offsets", [-1, 191])),
     BAD_FILE, ["negative number for tensor 'model.norm.weight'"]),
    ("begin-after-end",
     lambda raw: edit_header(raw, lambda h: h["model.norm.weight"].__setitem__(
         "data_offsets", h["model.norm.weight"]["data_offsets"][::-1])),
     BAD_FILE, ["'model.norm.weight'", "begin > end"]),
    ("shape-overflow", lambda raw: edit_header(raw, _set_entry("model.norm.weight", "shape", [2**62, 2**62])),
     BAD_FILE, ["'model.norm.weight'", "overflows 64-bit"]),
    ("too-many-dims", lambda raw: edit_header(raw, _set_entry("model.norm.weight", "shape", [1] * 9)),
     BAD_FILE, ["more than 8 dimensions"]),
    ("missing-field", lambda raw: edit_header(raw, lambda h: h["model.norm.weight"].pop("shape")),
     BAD_FILE, ["'model.norm.weight': entry lacks shape"]),
    ("unknown-field", lambda raw: edit_header(raw, _set_entry("model.norm.weight", "offset", 3)),
     BAD_FILE, ["unknown field 'offset'"]),
    ("weights-int8-not-yet", lambda raw: edit_header(raw, lambda h: h["__metadata__"].__setitem__(KEY_WEIGHTS, "int8")),
     UNSUPPORTED, ["weights format 'int8' is not implemented", "supported: bf16"]),
    ("weights-unknown", lambda raw: edit_header(raw, lambda h: h["__metadata__"].__setitem__(KEY_WEIGHTS, "fp8")),
     BAD_FILE, ["'fp8' is not a weights format"]),
    ("newer-format-version",
     lambda raw: edit_header(raw, lambda h: h["__metadata__"].__setitem__(KEY_FORMAT_VERSION, "2")),
     UNSUPPORTED, ["packed format version 2, this library reads version 1"]),
]


@pytest.mark.parametrize("make,status,needles", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_rejects_malformed(models, validate, tmp_path, make, status, needles):
    raw = open(models["tiny-dense"][2], "rb").read()
    path = _case(tmp_path, make(raw))
    got_status, message = validate(path)
    assert got_status == status, message
    assert message.startswith(f"{path}: "), message
    for needle in needles:
        assert needle in message, message


def test_rejects_unreadable_paths(validate, tmp_path, models):
    status, message = validate(tmp_path / "absent.og.safetensors")
    assert status == BAD_FILE and "cannot open: No such file" in message
    status, message = validate(tmp_path)
    assert status == BAD_FILE and "not a regular file" in message
    hf_folder = tmp_path / "hf"
    config, tensors, _ = models["tiny-dense"]
    write_model(config, hf_folder)
    status, message = validate(hf_folder / "model.safetensors")  # a safetensors file, but not packed
    assert status == BAD_FILE and "lacks 'onegraph.format_version'" in message


def test_argmax_matches_numpy(parser_only):
    lib = parser_only
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 513):
        for _ in range(20):
            logits = rng.integers(-3, 4, n).astype(np.float32)  # many ties: first maximum wins
            token = ctypes.c_int32(-1)
            assert lib.og_argmax(logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n, ctypes.byref(token)) == 0
            assert token.value == int(np.argmax(logits))
    logits = np.array([-np.inf, -np.inf], dtype=np.float32)
    token = ctypes.c_int32(-1)
    assert lib.og_argmax(logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 2, ctypes.byref(token)) == 0
    assert token.value == 0
    logits = np.array([1.0, np.nan, 2.0], dtype=np.float32)
    assert lib.og_argmax(logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 3, ctypes.byref(token)) == INVALID_ARGUMENT
    assert b"logits[1] is NaN" in lib.og_last_error()
    assert lib.og_argmax(logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 0, ctypes.byref(token)) == INVALID_ARGUMENT


# ---- the writer and the Python reader ----------------------------------------------------

def test_open_packed_round_trip(models):
    for preset, (config, tensors, path) in models.items():
        got_config, got = open_packed(path)
        assert got_config.to_hf_dict() == config.to_hf_dict()
        assert list(got) == list(config.tensor_shapes())
        for name, array in tensors.items():
            assert got[name].dtype == array.dtype == ml_dtypes.bfloat16, name
            assert np.array_equal(got[name].view(np.uint16), array.view(np.uint16)), name


def test_packed_header_layout(models):
    config, _, path = models["tiny-moe"]
    raw = open(path, "rb").read()
    header_text, data = split_file(raw)
    assert len(header_text) % 8 == 0  # the data section starts 8-byte aligned
    meta = json.loads(header_text)["__metadata__"]
    assert meta[KEY_FORMAT_VERSION] == "1" and meta[KEY_WEIGHTS] == "bf16"
    assert all(isinstance(v, str) for v in meta.values())
    og = json.loads(meta[KEY_OG_CONFIG])
    assert og == og_config_fields(config)
    assert og["layer_is_moe"] == [1, 0, 1] and og["qk_norm"] == 1  # tiny-moe: layer 1 in mlp_only_layers
    assert ModelConfig.from_dict(json.loads(meta[KEY_CONFIG])).to_hf_dict() == config.to_hf_dict()
    from safetensors import safe_open  # the reference implementation reads it too
    with safe_open(path, framework="numpy") as f:
        assert set(f.keys()) == set(config.tensor_shapes())
        assert f.metadata()[KEY_WEIGHTS] == "bf16"


def test_pack_converts_like_the_gpu_upload(tmp_path):
    """F32 and F16 sources: matrices become BF16 (round to nearest even), norm vectors keep
    F32 (F16 becomes F32), as GpuSession.set_weight would upload them from an HF folder."""
    config, tensors = _small("tiny-dense")
    rng = np.random.default_rng(1)
    source = {}
    for i, (name, array) in enumerate(tensors.items()):
        values = rng.standard_normal(array.shape).astype(np.float32)
        source[name] = values.astype(np.float16) if i % 2 else values
    path = write_packed(config, source, tmp_path / "mixed.og.safetensors")
    _, got = open_packed(path)
    for name, array in source.items():
        if array.ndim == 1:
            assert got[name].dtype == np.float32
            assert np.array_equal(got[name], array.astype(np.float32)), name
        else:
            assert got[name].dtype == ml_dtypes.bfloat16
            assert np.array_equal(got[name].view(np.uint16),
                                  array.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)), name


def test_open_packed_rejects(models, tmp_path):
    raw = open(models["tiny-dense"][2], "rb").read()
    cases = [
        (edit_header(raw, lambda h: h["__metadata__"].pop(KEY_CONFIG)), "lacks 'onegraph.config'"),
        (edit_og_config(raw, lambda c: c.__setitem__("qk_norm", 0)), "disagrees with 'onegraph.config' on qk_norm"),
        (edit_header(raw, lambda h: h["__metadata__"].__setitem__(KEY_WEIGHTS, "q4")), "'q4' is not implemented yet"),
        (raw[:-2], "truncated"),
    ]
    for i, (bad, needle) in enumerate(cases):
        path = _case(tmp_path, bad, f"bad{i}.og.safetensors")
        with pytest.raises(ValueError, match=None) as info:
            open_packed(path)
        assert needle in str(info.value)


def test_write_packed_rejects(tmp_path):
    config, tensors = _small("tiny-dense")
    with pytest.raises(PackError, match="weights format 'int8' is not implemented yet"):
        write_packed(config, tensors, tmp_path / "x", weights="int8")
    with pytest.raises(PackError, match="unknown weights format 'fp4'"):
        write_packed(config, tensors, tmp_path / "x", weights="fp4")
    partial = dict(tensors)
    partial.pop("model.norm.weight")
    with pytest.raises(PackError, match="'model.norm.weight'"):
        write_packed(config, partial, tmp_path / "x")
    assert not os.path.exists(tmp_path / "x")


def test_cli_pack(tmp_path, capsys):
    from onegraph.cli import main
    config, tensors = _small("tiny-moe")
    folder = tmp_path / "hf"
    write_model(config, folder, seed=3)
    out = tmp_path / "model.og.safetensors"
    assert main(["pack", "--model", str(folder), "--out", str(out)]) == 0
    assert f"{out} (" in capsys.readouterr().out
    got_config, got = open_packed(out)
    for name, array in tensors.items():
        assert np.array_equal(got[name].view(np.uint16), array.view(np.uint16)), name
    assert main(["pack", "--model", str(folder), "--out", str(tmp_path / "q.safetensors"), "--weights", "int8"]) == 1
    assert "weights format 'int8' is not implemented yet" in capsys.readouterr().err


def test_python_engine_decodes_packed_like_the_folder(models, tmp_path):
    """CPU path: the same tokens from the packed file as from the HF folder it stands for."""
    from onegraph.engine import Engine
    config, tensors, path = models["tiny-moe"]
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="cpu") as engine:
        expected = engine.generate(PROMPT, 6, stop_token_ids=())
    packed_config, packed = open_packed(path)
    with Engine.from_tensors(packed_config, packed, kv="int8", max_seq_len=64, device="cpu") as engine:
        assert engine.generate(PROMPT, 6, stop_token_ids=()) == expected


# ---- fuzzing under AddressSanitizer ------------------------------------------------------

FUZZ_ITERATIONS = 20000


def test_fuzz_parser_under_sanitizers(tmp_path):
    """Thousands of mutated files through the parser built with ASan + UBSan (leak checks
    on): no crash, no leak, every result OK or a named rejection, every accepted file
    passes an independent check (tests/fuzz/fuzz_packed.c). About 5 s on 2 cores."""
    cc = _cc()
    if cc is None:
        pytest.skip("no C compiler")
    seeds = []
    for preset, overrides in (("tiny-moe", dict(vocab_size=40, hidden_size=12, intermediate_size=20,
                                                num_attention_heads=2, num_key_value_heads=1, head_dim=6,
                                                num_experts=3, num_experts_per_tok=2, moe_intermediate_size=4)),
                              ("tiny-tied", dict(vocab_size=30, hidden_size=10, intermediate_size=14,
                                                 num_hidden_layers=1))):
        config, tensors = _small(preset, **overrides)
        seeds.append(str(write_packed(config, tensors, tmp_path / f"seed-{preset}.og.safetensors")))
    exe = tmp_path / "fuzz_packed"
    build = subprocess.run([cc, "-std=c11", "-g", "-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                            "-fno-omit-frame-pointer", "-DOG_PACKED_PARSER_ONLY", "-I", CUDA_DIR,
                            os.path.join(ROOT, "tests", "fuzz", "fuzz_packed.c"),
                            os.path.join(CUDA_DIR, "packed_file.c"), "-o", str(exe)],
                           capture_output=True, text=True)
    if build.returncode != 0 and "sanitize" in build.stderr and "cannot find" in build.stderr:
        pytest.skip(f"the sanitizer runtimes are not installed: {build.stderr.strip()[:200]}")
    assert build.returncode == 0, build.stderr
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:exitcode=23",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    t0 = time.perf_counter()
    run = subprocess.run([str(exe), "-v", "-n", str(FUZZ_ITERATIONS), "-s", "1", "-t", str(tmp_path)] + seeds,
                         capture_output=True, text=True, env=env, timeout=120)
    seconds = time.perf_counter() - t0
    assert run.returncode == 0, run.stderr[-4000:]
    summary = run.stdout.strip().splitlines()[-1]
    numbers = [int(t) for t in summary.replace(";", " ").replace(",", " ").split() if t.isdigit()]
    total, accepted, bad, unsupported, disk = numbers
    assert total == FUZZ_ITERATIONS == accepted + bad + unsupported
    assert disk == (FUZZ_ITERATIONS + 15) // 16
    assert bad > FUZZ_ITERATIONS // 2 and accepted > 0, summary
    messages = run.stdout
    # The mutations reach every family of check, not only the JSON syntax.
    for family in ("overlap", "is named twice", "unknown dtype", "truncated", "header length field",
                   "trailing bytes", "needs", "metadata 'onegraph.og_config'", "invalid UTF-8",
                   "not terminated", "lacks"):
        assert family in messages, f"no mutation hit '{family}'"
    assert seconds < 60, f"fuzz run took {seconds:.1f} s"


# ---- og_open_packed on the CPU, against a mock engine --------------------------------------

def _checksum(array: np.ndarray) -> int:
    """sum((i + 1) * byte_i) mod 2^64, as tests/fuzz/open_packed_mock.c computes it."""
    data = np.ascontiguousarray(array).view(np.uint8).ravel().astype(np.uint64)
    return int((data * np.arange(1, data.size + 1, dtype=np.uint64)).sum(dtype=np.uint64))


@pytest.fixture(scope="module")
def open_packed_mock(tmp_path_factory):
    cc = _cc()
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path_factory.mktemp("mock") / "open_packed_mock"
    sources = [os.path.join(ROOT, "tests", "fuzz", "open_packed_mock.c"), os.path.join(CUDA_DIR, "packed_file.c")]
    base = [cc, "-std=c11", "-g", "-O1", "-Wall", "-Wextra", "-Werror", "-I", CUDA_DIR] + sources + ["-o", str(exe)]
    build = subprocess.run(base[:1] + ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"] + base[1:],
                           capture_output=True, text=True)
    if build.returncode != 0:  # no sanitizer runtimes: still test the logic
        subprocess.run(base, check=True, capture_output=True, text=True)

    def run(path, kv=capi.OG_KV_INT8, max_seq_len=4096, fail=None):
        env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1")
        env.pop("MOCK_FAIL", None)
        if fail:
            env["MOCK_FAIL"] = fail
        proc = subprocess.run([str(exe), str(path), str(kv), str(max_seq_len)], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.splitlines()
    return run


def test_open_packed_uploads_every_tensor(tmp_path, open_packed_mock):
    """og_open_packed hands og_init the config of the metadata and og_set_weight every tensor
    with its bytes; an odd-sized BF16 embedding leaves the next F32 vector 2-byte aligned in
    the file, and the mock refuses misaligned data, so the copy path is exercised too."""
    config, tensors = _small("tiny-tied", vocab_size=301, hidden_size=81)
    tensors = {n: a.astype(np.float32) if a.ndim == 1 else a for n, a in tensors.items()}
    odd = write_packed(config, tensors, tmp_path / "odd.og.safetensors")
    moe_config, moe_tensors = _small("tiny-moe")
    moe = write_packed(moe_config, moe_tensors, tmp_path / "moe.og.safetensors")
    for cfg, arrays, path, kv, max_seq_len in ((config, tensors, odd, capi.OG_KV_BF16, 100),
                                               (moe_config, moe_tensors, moe, capi.OG_KV_INT8, 0)):
        lines = open_packed_mock(path, kv, max_seq_len)
        got = dict(item.split("=") for item in lines[0].split()[1:])
        fields = og_config_fields(cfg)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "qk_norm", "tie_word_embeddings", "num_experts",
                    "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
            assert int(got[key]) == fields[key], key
        for key in ("rms_norm_eps", "rope_theta", "rope_linear_factor"):
            assert np.float32(got[key]) == np.float32(fields[key]), key
        assert got["layer_is_moe"] == ",".join(map(str, fields["layer_is_moe"]))
        assert int(got["abi_version"]) == capi.ABI_VERSION and int(got["kv_dtype"]) == kv
        assert int(got["max_seq_len"]) == (max_seq_len or min(4096, cfg.max_position_embeddings))
        assert lines[-2:] == ["status 0 ", "freed"]  # main() frees the engine it got
        weights = [line.split() for line in lines[1:-2]]
        assert [w[1] for w in weights] == list(cfg.tensor_shapes())
        for _, name, dtype, shape, checksum in weights:
            array = arrays[name]
            assert dtype == ("F32" if array.dtype == np.float32 else "BF16"), name
            assert tuple(int(d) for d in shape.split(",")) == array.shape, name
            assert int(checksum) == _checksum(array), name


def test_llama3_rope_table_is_packed_and_handed_to_the_library(models, open_packed_mock):
    """A llama3 model's packed file carries its rotary frequency table in og_config
    ("rope_inv_freq", the reference's, bit for bit); og_open_packed hands it to
    og_set_rope_frequencies after og_init, and a refusal there frees the engine."""
    from onegraph.reference import rope_frequencies
    config, _, path = models["tiny-llama3"]
    table = rope_frequencies(config)
    meta = json.loads(split_file(open(path, "rb").read())[0])["__metadata__"]
    assert np.array_equal(np.array(json.loads(meta[KEY_OG_CONFIG])["rope_inv_freq"], np.float32), table)
    got_config, _ = open_packed(path)
    assert got_config.rope_scaling == config.rope_scaling and config.rope_scaling["rope_type"] == "llama3"
    lines = open_packed_mock(path)
    assert lines[1] == f"rope_freqs {table.size} {_checksum(table)}" and lines[-1] == "freed"
    assert [line.split()[0] for line in lines[2:-2]] == ["weight"] * len(config.tensor_shapes())
    lines = open_packed_mock(path, fail="rope")
    assert lines[-2] == "freed"
    assert lines[-1] == (f"status {capi.OG_E_INVALID_ARGUMENT} {path}: og_set_rope_frequencies: "
                         "mock: inv_freq[0] is not positive")


def test_open_packed_failures_free_the_engine(models, open_packed_mock):
    path = models["tiny-dense"][2]
    lines = open_packed_mock(path, fail="init")
    assert lines == [f"status {capi.OG_E_NO_DEVICE} {path}: og_init: no CUDA device: mock"]
    second = list(models["tiny-dense"][0].tensor_shapes())[1]
    lines = open_packed_mock(path, fail=second)
    assert len(lines) == 5 and lines[-2] == "freed"
    assert lines[-1] == f"status {capi.OG_E_WEIGHT_MISMATCH} {path}: og_set_weight('{second}'): mock: shape mismatch"
    lines = open_packed_mock(path, fail="precheck")
    assert lines[-2] == "freed"
    assert lines[-1] == f"status {capi.OG_E_MISSING_WEIGHT} {path}: og_precheck: mock: 'lm_head.weight' is missing"
    raw = open(path, "rb").read()
    lines = open_packed_mock(path + ".absent")
    assert lines == [f"status {BAD_FILE} {path}.absent: cannot open: No such file or directory"]
    assert raw  # the file itself is untouched


# ---- the C and Rust examples -------------------------------------------------------------

def _gpu_usable() -> bool:
    from onegraph.engine import library_status
    return library_status()[0]


def _build_c_example(tmp_path) -> str:
    out = str(tmp_path / "og_decode")
    subprocess.run(["sh", os.path.join(ROOT, "examples", "c", "build.sh"), out], check=True,
                   capture_output=True, text=True)
    return out


def _build_rust_example(tmp_path, check_only=False) -> str:
    cargo = shutil.which("cargo")
    if cargo is None:
        pytest.skip("cargo is not installed")
    target = tmp_path / "rust-target"
    cmd = [cargo, "check" if check_only else "build", "--offline", "--release", "--quiet"]
    run = subprocess.run(cmd, cwd=os.path.join(ROOT, "examples", "rust"), capture_output=True, text=True,
                         env=dict(os.environ, CARGO_TARGET_DIR=str(target)), timeout=300)
    assert run.returncode == 0, run.stderr
    return str(target / "release" / "og_decode")


def test_c_example_without_gpu(models, tmp_path):
    cc = _cc()
    if cc is None:
        pytest.skip("no C compiler")
    if not os.path.isfile(LIBRARY):
        # Without the library only the compile can be checked.
        subprocess.run([cc, "-std=c11", "-Wall", "-Wextra", "-Werror", "-c", "-I", CUDA_DIR,
                        os.path.join(ROOT, "examples", "c", "decode.c"), "-o", str(tmp_path / "decode.o")],
                       check=True, capture_output=True, text=True)
        pytest.skip(f"{LIBRARY} is not built: compiled the C example, did not link it")
    if _gpu_usable():
        pytest.skip("a GPU is present: test_three_programs_print_the_same_tokens covers the example")
    exe = _build_c_example(tmp_path)
    run = subprocess.run([exe, models["tiny-dense"][2], "4"] + [str(t) for t in PROMPT], capture_output=True, text=True)
    assert run.returncode == 3
    assert run.stdout == ""
    assert run.stderr.startswith("og_decode: no CUDA device"), run.stderr
    usage = subprocess.run([exe], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: og_decode" in usage.stderr


def test_rust_example_builds(models, tmp_path):
    """cargo build of a std-only crate: about 2 s. Without the library: cargo check only."""
    if not os.path.isfile(LIBRARY):
        _build_rust_example(tmp_path, check_only=True)
        pytest.skip(f"{LIBRARY} is not built: type-checked the Rust example, did not link it")
    exe = _build_rust_example(tmp_path)
    if _gpu_usable():
        pytest.skip("a GPU is present: test_three_programs_print_the_same_tokens runs the example")
    run = subprocess.run([exe, models["tiny-dense"][2], "4"] + [str(t) for t in PROMPT], capture_output=True, text=True)
    assert run.returncode == 3
    assert run.stderr.startswith("og_decode: no CUDA device"), run.stderr


# ---- GPU: the three programs agree -------------------------------------------------------

def _rust_program(tmp_path):
    """The Rust example's command: built here with cargo, or $ONEGRAPH_RUST_DECODE (built
    elsewhere: the GPU machine has no cargo); None when neither is available."""
    if shutil.which("cargo"):
        return [_build_rust_example(tmp_path)]
    if os.environ.get("ONEGRAPH_RUST_DECODE"):
        return [os.environ["ONEGRAPH_RUST_DECODE"]]
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("preset", list(MODELS))
def test_three_programs_print_the_same_tokens(models, tmp_path, preset):
    if not _gpu_usable():
        skip_or_fail("no usable GPU")
    path = models[preset][2]
    args = [path, "32"] + [str(t) for t in PROMPT]
    programs = [("python", [sys.executable, "-m", "onegraph.pack", "decode", "--device", "gpu"]),
                ("c", [_build_c_example(tmp_path)])]
    rust = _rust_program(tmp_path)
    if rust:
        programs.append(("rust", rust))
    outputs = {}
    for label, cmd in programs:
        run = subprocess.run(cmd + args, capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert run.returncode == 0, f"{label}: {run.stderr}"
        outputs[label] = run.stdout.split()
        print(f"{preset} {label:>6}: {run.stdout.strip()}  [{run.stderr.strip().splitlines()[-1]}]")
    assert len(outputs["c"]) == 32
    assert outputs["python"] == outputs["c"]
    if "rust" in outputs:
        assert outputs["rust"] == outputs["c"]
    else:  # cargo missing: the Python / C comparison above stands; the Rust one was not run
        print(f"{preset}: the Rust example was not run (no cargo, no ONEGRAPH_RUST_DECODE)")


@pytest.mark.gpu
def test_open_packed_failures_leave_nothing(models, tmp_path):
    """og_open_packed on a file missing a tensor: OG_E_MISSING_WEIGHT naming the file, *out
    NULL; on a file whose tensor disagrees with the config: OG_E_WEIGHT_MISMATCH."""
    if not _gpu_usable():
        skip_or_fail("no usable GPU")
    lib = capi.load_library()
    raw = open(models["tiny-dense"][2], "rb").read()
    header_text, data = split_file(raw)
    header = json.loads(header_text)
    begin, end = header["lm_head.weight"]["data_offsets"]
    assert end == len(data)  # the last tensor: drop it and its bytes
    del header["lm_head.weight"]
    missing = _case(tmp_path, join_file(json.dumps(header), data[:begin]), "missing.og.safetensors")
    handle = capi.Handle()
    status = lib.og_open_packed(str(missing).encode(), capi.OG_KV_INT8, 0, ctypes.byref(handle))
    assert status == capi.OG_E_MISSING_WEIGHT, capi.last_error()
    assert not handle and capi.last_error().startswith(f"{missing}: og_precheck")
    mismatch = _case(tmp_path, edit_og_config(raw, lambda c: c.__setitem__("vocab_size", 500)), "mismatch.og.safetensors")
    status = lib.og_open_packed(str(mismatch).encode(), capi.OG_KV_INT8, 0, ctypes.byref(handle))
    assert status == capi.OG_E_WEIGHT_MISMATCH, capi.last_error()
    assert not handle and "model.embed_tokens.weight" in capi.last_error()
