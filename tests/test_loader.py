"""The loader: round trips against the generator, and one clear error per kind of bad input.

Each bad-input test asserts the message names the file, the tensor (where there is one) and
the expected vs actual value, since that is what makes a broken checkpoint fixable.
"""
import json
import os
import struct
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from onegraph import synth
from onegraph.config import ConfigError
from onegraph.loader import INDEX_FILE, SINGLE_FILE, LoaderError, load_model, read_header

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
Q_NORM = "model.layers.1.self_attn.q_norm.weight"
LAST = "lm_head.weight"  # the last tensor of an untied model's file


# ---- helpers: read and rewrite raw safetensors files ---------------------------------------

def read_raw(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    return header, data


def write_raw(path, header, data, header_len=None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if header_len is None else header_len))
        f.write(raw)
        f.write(data)


def retile(header):
    """Recompute data_offsets so the tensors tile the data section in their current order."""
    offset = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        size = info["data_offsets"][1] - info["data_offsets"][0]
        info["data_offsets"] = [offset, offset + size]
        offset += size


def replace_tensor(folder, name, dtype, shape, payload: bytes):
    """Rewrite model.safetensors with tensor `name` replaced (or added at the end)."""
    path = os.path.join(folder, SINGLE_FILE)
    header, data = read_raw(path)
    chunks, new_header = [], {"__metadata__": header.pop("__metadata__", {})}
    for n, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        if n == name:
            continue
        b, e = info["data_offsets"]
        chunks.append(data[b:e])
        new_header[n] = dict(info)
    if payload is not None:
        chunks.append(payload)
        new_header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [0, len(payload)]}
    retile(new_header)
    write_raw(path, new_header, b"".join(chunks))
    return path


def drop_tensor(folder, name):
    return replace_tensor(folder, name, None, None, None)


@pytest.fixture
def dense_dir(tmp_path):
    folder = tmp_path / "tiny-dense"
    synth.write_model(synth.preset_config("tiny-dense"), folder, seed=3)
    return str(folder)


def load_error(folder, *fragments, kind=LoaderError):
    with pytest.raises(kind) as info:
        load_model(folder)
    message = str(info.value)
    for fragment in fragments:
        assert str(fragment) in message, f"{fragment!r} not in {message!r}"
    return message


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint16), b.view(np.uint16))


# ---- round trips -------------------------------------------------------------------------------

def test_round_trip_single_file(dense_dir):
    cfg = synth.preset_config("tiny-dense")
    model = load_model(dense_dir)
    assert model.config == cfg.replace(source=os.path.join(dense_dir, "config.json"))
    assert list(model.tensors) == list(cfg.tensor_shapes())
    assert model.files == [os.path.join(dense_dir, SINGLE_FILE)]
    assert model.ignored == []
    for name, expected in synth.iter_tensors(cfg, seed=3):
        got = model.tensors[name]
        assert got.dtype == np.dtype(ml_dtypes.bfloat16)
        assert same_bytes(got, expected), name
        assert not got.flags.writeable  # a view into a read-only mapping, not a copy
    header_bytes = read_header(model.files[0]).data_start
    assert model.total_bytes == os.path.getsize(model.files[0]) - header_bytes


def test_round_trip_sharded(tmp_path):
    cfg = synth.preset_config("tiny-moe")
    written = synth.write_model(cfg, tmp_path, seed=5, max_shard_bytes=200_000)
    shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(shards) == 5 and shards[0] == "model-00001-of-00005.safetensors"
    assert not os.path.exists(tmp_path / SINGLE_FILE)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for _, t in synth.iter_tensors(cfg, seed=5))
    assert set(index["weight_map"]) == set(cfg.tensor_shapes())
    model = load_model(tmp_path)
    assert sorted(model.files) == sorted(str(tmp_path / s) for s in shards)
    assert set(written) >= set(model.files)
    for name, expected in synth.iter_tensors(cfg, seed=5):
        assert same_bytes(model.tensors[name], expected), name


def test_tied_model_has_no_lm_head_and_ignores_one_if_present(tmp_path):
    cfg = synth.preset_config("tiny-tied")
    synth.write_model(cfg, tmp_path)
    model = load_model(tmp_path)
    assert "lm_head.weight" not in model.tensors and model.ignored == []
    # Checkpoints such as Qwen3-0.6B store a copy of the tied embedding as lm_head.weight.
    embed = model.tensors["model.embed_tokens.weight"]
    replace_tensor(tmp_path, "lm_head.weight", "BF16", embed.shape, embed.tobytes())
    model = load_model(tmp_path)
    assert "lm_head.weight" not in model.tensors and model.ignored == ["lm_head.weight"]


def test_extra_tensors_ignored_and_listed(dense_dir):
    inv_freq = np.arange(8, dtype=np.float32)
    replace_tensor(dense_dir, "model.layers.0.self_attn.rotary_emb.inv_freq", "F32", (8,), inv_freq.tobytes())
    replace_tensor(dense_dir, "model.position_ids", "I64", (1, 3), np.arange(3, dtype=np.int64).tobytes())
    model = load_model(dense_dir)
    assert model.ignored == ["model.layers.0.self_attn.rotary_emb.inv_freq", "model.position_ids"]
    assert "model.position_ids" not in model.tensors


def test_f16_and_f32_returned_as_stored(dense_dir):
    cfg = synth.preset_config("tiny-dense")
    q = np.linspace(-1, 1, 96 * 96, dtype=np.float32).reshape(96, 96)
    replace_tensor(dense_dir, Q_PROJ, "F32", q.shape, q.tobytes())
    norm = np.full(cfg.head_dim, 1.5, dtype=np.float16)
    replace_tensor(dense_dir, Q_NORM, "F16", norm.shape, norm.tobytes())
    model = load_model(dense_dir)
    assert model.tensors[Q_PROJ].dtype == np.float32 and np.array_equal(model.tensors[Q_PROJ], q)
    assert model.tensors[Q_NORM].dtype == np.float16 and np.array_equal(model.tensors[Q_NORM], norm)


def test_progress_bar(dense_dir, capsys):
    pytest.importorskip("tqdm")
    load_model(dense_dir, progress=True)
    assert "load" in capsys.readouterr().err


# ---- the folder ------------------------------------------------------------------------------

def test_missing_folder(tmp_path):
    load_error(tmp_path / "absent", tmp_path / "absent", "not found")


def test_path_is_a_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"x")
    load_error(path, path, "not a folder")


def test_missing_config(dense_dir):
    os.remove(os.path.join(dense_dir, "config.json"))
    load_error(dense_dir, os.path.join(dense_dir, "config.json"), "not found")


def test_malformed_config(dense_dir):
    path = os.path.join(dense_dir, "config.json")
    with open(path, "a") as f:
        f.write("\n}")
    load_error(dense_dir, path, "malformed JSON", "line", kind=ConfigError)


def test_invalid_config_value(dense_dir):
    path = os.path.join(dense_dir, "config.json")
    raw = json.load(open(path))
    raw["head_dim"] = 15
    json.dump(raw, open(path, "w"))
    load_error(dense_dir, path, "head_dim=15", kind=ConfigError)


def test_missing_weights(dense_dir):
    os.remove(os.path.join(dense_dir, SINGLE_FILE))
    open(os.path.join(dense_dir, "pytorch_model.bin"), "wb").close()
    load_error(dense_dir, dense_dir, SINGLE_FILE, INDEX_FILE, "pytorch_model.bin")


# ---- one file: corrupt headers -------------------------------------------------------------------

def test_truncated_file(dense_dir):
    path = os.path.join(dense_dir, SINGLE_FILE)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    load_error(dense_dir, path, f"'{LAST}'", "truncated", f"file is {size - 100} bytes", f"expected at least {size}")


def test_file_shorter_than_length_field(dense_dir):
    path = os.path.join(dense_dir, SINGLE_FILE)
    open(path, "wb").write(b"\x10\x00")
    load_error(dense_dir, path, "2 bytes", "too short")


def test_header_not_json(dense_dir):
    path = os.path.join(dense_dir, SINGLE_FILE)
    header, data = read_raw(path)
    raw = json.dumps(header).encode()
    write_raw(path, raw[:-1] + b",", data)  # same length, broken JSON
    load_error(dense_dir, path, "not valid JSON")


def test_header_not_an_object(dense_dir):
    path = os.path.join(dense_dir, SINGLE_FILE)
    write_raw(path, b"[1, 2]  ", b"")
    load_error(dense_dir, path, "does not start with '{'")


def test_header_length_beyond_file(dense_dir):
    path = os.path.join(dense_dir, SINGLE_FILE)
    header, data = read_raw(path)
    size = 8 + len(json.dumps(header).encode()) + len(data)
    write_raw(path, header, data, header_len=size)
    assert os.path.getsize(path) == size
    load_error(dense_dir, path, f"says {size} bytes", f"only {size - 8} bytes follow", "truncated or corrupt")


def test_absurd_header_length(dense_dir):
    path = os.path.join(dense_dir, SINGLE_FILE)
    header, data = read_raw(path)
    write_raw(path, header, data, header_len=2**62)
    load_error(dense_dir, path, f"says {2**62} bytes", "limit")


def test_tensor_named_twice_in_one_header(dense_dir):
    path = os.path.join(dense_dir, SINGLE_FILE)
    header, data = read_raw(path)
    raw = json.dumps(header).encode()
    entry = json.dumps({Q_NORM: header[Q_NORM]}).encode()[1:-1]
    write_raw(path, raw[:-1] + b"," + entry + b"}", data)
    load_error(dense_dir, path, f"'{Q_NORM}' twice")


def test_unknown_dtype_string(dense_dir):
    path = os.path.join(dense_dir, SINGLE_FILE)
    header, data = read_raw(path)
    header[Q_NORM]["dtype"] = "Q4_K"
    write_raw(path, header, data)
    load_error(dense_dir, path, f"'{Q_NORM}'", "unknown dtype 'Q4_K'")


def test_bad_shape_entry(dense_dir):
    path = os.path.join(dense_dir, SINGLE_FILE)
    header, data = read_raw(path)
    header[Q_NORM]["shape"] = [16, -1]
    write_raw(path, header, data)
    load_error(dense_dir, path, f"'{Q_NORM}'", "[16, -1]", "non-negative")


# ---- one file: a header that lies about sizes --------------------------------------------------------

def test_offsets_span_disagrees_with_shape(dense_dir):
    path = os.path.join(dense_dir, SINGLE_FILE)
    header, data = read_raw(path)
    header[Q_PROJ]["shape"] = [96, 95]  # same offsets: 96*96*2 bytes
    write_raw(path, header, data)
    load_error(dense_dir, path, f"'{Q_PROJ}'", f"span {96 * 96 * 2} bytes", "[96, 95] of BF16", f"needs {96 * 95 * 2} bytes")


def test_overlapping_offsets(dense_dir):
    path = os.path.join(dense_dir, SINGLE_FILE)
    header, data = read_raw(path)
    begin, end = header[Q_NORM]["data_offsets"]
    header[Q_NORM]["data_offsets"] = [begin - 2, end - 2]
    write_raw(path, header, data)
    message = load_error(dense_dir, path, f"'{Q_NORM}'", f"[{begin - 2}, {end - 2})", "overlap")
    assert "model.layers.1.self_attn.o_proj.weight" in message  # the tensor it runs into


def test_out_of_range_offsets(dense_dir):
    path = os.path.join(dense_dir, SINGLE_FILE)
    header, data = read_raw(path)
    data_bytes = len(data)
    header[Q_NORM]["data_offsets"] = [data_bytes, data_bytes + 32]
    write_raw(path, header, data)
    load_error(dense_dir, path, f"'{Q_NORM}'", f"[{data_bytes}, {data_bytes + 32})", f"only {data_bytes} data bytes")


def test_gap_between_tensors(dense_dir):
    path = os.path.join(dense_dir, SINGLE_FILE)
    header, data = read_raw(path)
    drop_tensor(dense_dir, "model.norm.weight")  # then put the data back without its entry
    header.pop("model.norm.weight")
    write_raw(path, header, data)
    load_error(dense_dir, path, "belong to no tensor", "model.layers.2.mlp.down_proj.weight")


def test_trailing_bytes(dense_dir):
    path = os.path.join(dense_dir, SINGLE_FILE)
    with open(path, "ab") as f:
        f.write(b"\0" * 6)
    load_error(dense_dir, path, "trailing bytes", f"holds {os.path.getsize(path) - read_header_len(path)}")


def read_header_len(path):
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def test_safetensors_library_cross_check(dense_dir, monkeypatch):
    safetensors = pytest.importorskip("safetensors")

    def refuse(*args, **kwargs):
        raise RuntimeError("Error while deserializing header: simulated")
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    load_error(dense_dir, os.path.join(dense_dir, SINGLE_FILE), "rejected by the safetensors library", "simulated")


# ---- one file: the right tensors? --------------------------------------------------------------------

def test_missing_tensor(dense_dir):
    path = drop_tensor(dense_dir, Q_PROJ)
    load_error(dense_dir, path, "1 tensor(s)", f"'{Q_PROJ}'", "expected shape [96, 96]", "missing")


def test_untied_model_requires_lm_head(dense_dir):
    path = drop_tensor(dense_dir, "lm_head.weight")
    load_error(dense_dir, path, "'lm_head.weight'", "expected shape [512, 96]")


def test_many_missing_tensors_are_counted(dense_dir):
    for layer in range(3):
        for proj in ("q", "k", "v"):
            drop_tensor(dense_dir, f"model.layers.{layer}.self_attn.{proj}_proj.weight")
    load_error(dense_dir, "9 tensor(s)", "and 4 more")


def test_wrong_shape(dense_dir):
    path = replace_tensor(dense_dir, Q_PROJ, "BF16", (96, 80), bytes(96 * 80 * 2))
    load_error(dense_dir, path, f"'{Q_PROJ}'", "shape [96, 80]", "expected [96, 96]")


@pytest.mark.parametrize("dtype,itemsize", [("I64", 8), ("F8_E4M3", 1), ("F64", 8), ("U8", 1)])
def test_unsupported_dtype(dense_dir, dtype, itemsize):
    path = replace_tensor(dense_dir, Q_NORM, dtype, (16,), bytes(16 * itemsize))
    load_error(dense_dir, path, f"'{Q_NORM}'", f"dtype {dtype}", "BF16, F16, F32")


# ---- shards ----------------------------------------------------------------------------------------

@pytest.fixture
def sharded_dir(tmp_path):
    synth.write_model(synth.preset_config("tiny-dense"), tmp_path, max_shard_bytes=150_000)
    return str(tmp_path)


def shard(folder, i, n=5):
    return os.path.join(folder, f"model-{i:05d}-of-{n:05d}.safetensors")


def index_of(folder):
    return json.load(open(os.path.join(folder, INDEX_FILE)))


def write_index(folder, index):
    json.dump(index, open(os.path.join(folder, INDEX_FILE), "w"))


def test_sharded_fixture_has_five_shards(sharded_dir):
    assert sorted(set(index_of(sharded_dir)["weight_map"].values())) == [os.path.basename(shard(sharded_dir, i)) for i in range(1, 6)]


def test_index_names_missing_shard(sharded_dir):
    os.remove(shard(sharded_dir, 3))
    load_error(sharded_dir, os.path.join(sharded_dir, INDEX_FILE), os.path.basename(shard(sharded_dir, 3)),
               shard(sharded_dir, 3), "does not exist", "model.layers.")


def test_malformed_index(sharded_dir):
    path = os.path.join(sharded_dir, INDEX_FILE)
    open(path, "w").write('{"weight_map": {"a": "b",}}')
    load_error(sharded_dir, path, "malformed JSON", "line 1")


def test_index_without_weight_map(sharded_dir):
    write_index(sharded_dir, {"metadata": {}})
    load_error(sharded_dir, os.path.join(sharded_dir, INDEX_FILE), "'weight_map'")


def test_index_shard_path_outside_folder(sharded_dir):
    index = index_of(sharded_dir)
    index["weight_map"][Q_PROJ] = "../elsewhere.safetensors"
    write_index(sharded_dir, index)
    load_error(sharded_dir, f"'{Q_PROJ}'", "'../elsewhere.safetensors'", "not a file name inside")


def owner_shard(folder, name):
    return os.path.join(folder, index_of(folder)["weight_map"][name])


def test_tensor_in_two_shard_headers(sharded_dir):
    first, last = shard(sharded_dir, 1), shard(sharded_dir, 5)
    assert owner_shard(sharded_dir, "model.embed_tokens.weight") == first
    # Copy the embedding into the last shard too (its header and its data).
    header_1, data_1 = read_raw(first)
    header_5, data_5 = read_raw(last)
    b, e = header_1["model.embed_tokens.weight"]["data_offsets"]
    header_5["model.embed_tokens.weight"] = dict(header_1["model.embed_tokens.weight"], data_offsets=[len(data_5), len(data_5) + e - b])
    write_raw(last, header_5, data_5 + data_1[b:e])
    load_error(sharded_dir, "'model.embed_tokens.weight'", "two shards", first, last)


def test_index_maps_tensor_to_wrong_shard(sharded_dir):
    index = index_of(sharded_dir)
    actual = owner_shard(sharded_dir, Q_PROJ)
    other = os.path.basename(shard(sharded_dir, 5))
    assert os.path.basename(actual) != other
    index["weight_map"][Q_PROJ] = other
    write_index(sharded_dir, index)
    load_error(sharded_dir, f"'{Q_PROJ}'", f"in {shard(sharded_dir, 5)}", f"stored in {actual}")


def test_index_lists_tensor_no_shard_has(sharded_dir):
    index = index_of(sharded_dir)
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = os.path.basename(shard(sharded_dir, 2))
    write_index(sharded_dir, index)
    load_error(sharded_dir, "'model.layers.9.mlp.up_proj.weight'", shard(sharded_dir, 2), "no such tensor")


def test_shard_holds_tensor_index_does_not_list(sharded_dir):
    index = index_of(sharded_dir)
    where = index["weight_map"].pop(Q_NORM)
    write_index(sharded_dir, index)
    load_error(sharded_dir, os.path.join(sharded_dir, where), f"'{Q_NORM}'", "does not list")


def test_corrupt_shard_is_named(sharded_dir):
    path = shard(sharded_dir, 4)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    load_error(sharded_dir, path, "truncated")


def test_single_file_wins_over_index(sharded_dir, dense_dir):
    os.rename(os.path.join(dense_dir, SINGLE_FILE), os.path.join(sharded_dir, SINGLE_FILE))
    model = load_model(sharded_dir)
    assert model.files == [os.path.join(sharded_dir, SINGLE_FILE)]


# ---- memory ------------------------------------------------------------------------------------------

RSS_PROBE = textwrap.dedent("""
    import resource, sys, json
    import numpy as np
    from onegraph.loader import load_model
    import safetensors, ml_dtypes
    def peak_bytes():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    before = peak_bytes()
    model = load_model(sys.argv[1])
    after_load = peak_bytes()
    checksum = 0
    for t in model.tensors.values():  # read every byte once, as an upload to the GPU does
        checksum += int(t.view(np.uint16).sum(dtype=np.uint64))
    print(json.dumps({"before": before, "after_load": after_load, "after_read": peak_bytes(),
                      "file_bytes": sum(__import__("os").path.getsize(f) for f in model.files)}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss units are Linux's")
def test_peak_rss_stays_below_one_and_a_half_times_the_file(tmp_path):
    # ~42 MB of weights: big enough that interpreter noise is small beside it.
    cfg = synth.preset_config("tiny-dense", vocab_size=8192, hidden_size=640, intermediate_size=1728,
                              num_attention_heads=10, num_key_value_heads=2, head_dim=64, num_hidden_layers=4)
    synth.write_model(cfg, tmp_path)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, str(tmp_path)], capture_output=True, text=True,
                         cwd=repo, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                             [repo] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])),
                         check=True)
    m = json.loads(out.stdout)
    assert m["file_bytes"] > 40e6
    # Mapping costs nothing until read; reading every tensor maps each page once (~1.0x).
    assert m["after_load"] - m["before"] < 0.1 * m["file_bytes"], m
    assert m["after_read"] - m["before"] < 1.5 * m["file_bytes"], m
