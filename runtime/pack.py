"""Packed model files: one safetensors file a program in any language decodes from.

``onegraph pack --model DIR --out FILE`` writes the tensors the runtime uploads (by Hugging
Face name: the library fuses q|k|v and gate|up at upload) and the model config in the
header's ``__metadata__`` (string values only, as the safetensors spec requires):

    onegraph.format_version  "1"
    onegraph.weights         "bf16"   (the weights format; "int8" and "q4" are planned)
    onegraph.config          the HF config.json (what ``open_packed`` rebuilds ModelConfig from)
    onegraph.og_config       the og_config fields resolved from it (what the C library reads:
                             qk_norm, layer_is_moe, rope_linear_factor, ... so C does not
                             re-implement the HF rules; see cuda/packed_file.h)

Weights "bf16": every matrix BF16 (F16/F32 sources rounded to nearest even); norm vectors
keep BF16 or F32 and F16 becomes F32 — exactly what ``GpuSession.set_weight`` uploads from
an HF folder, so a packed file and its source folder put the same bytes on the device.
Tensors are in ``config.tensor_shapes()`` order and tile the data section without gaps.

From C: ``og_open_packed(path, OG_KV_INT8, 4096, &engine)`` (cuda/onegraph.h). From Python::

    from onegraph.engine import Engine
    from onegraph.pack import open_packed
    config, tensors = open_packed("model.og.safetensors")
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=4096) as engine:
        print(engine.generate([1, 2, 3], 32, stop_token_ids=()))

``python -m onegraph.pack decode FILE N ID...`` does that and prints what examples/c and
examples/rust print, so the three can be compared token for token.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from typing import Mapping

import ml_dtypes
import numpy as np

from .config import ModelConfig
from .reference import rope_frequencies, rope_frequency_factors

FORMAT_VERSION = 1
WEIGHT_FORMATS = ("bf16",)             # implemented
PLANNED_WEIGHT_FORMATS = ("int8", "q4")  # quantized formats of a later issue

KEY_FORMAT_VERSION = "onegraph.format_version"
KEY_WEIGHTS = "onegraph.weights"
KEY_CONFIG = "onegraph.config"
KEY_OG_CONFIG = "onegraph.og_config"

# og_open_packed with max_seq_len <= 0 uses min(this, max_position_embeddings); it is
# og_config_default's max_seq_len.
DEFAULT_MAX_SEQ_LEN = 4096

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


class PackError(ValueError):
    """A model that cannot be packed, or a packed file that cannot be opened; the message
    names the file, the tensor or the metadata key."""


def check_weights_format(weights: str) -> None:
    if weights in WEIGHT_FORMATS:
        return
    if weights in PLANNED_WEIGHT_FORMATS:
        raise PackError(f"weights format '{weights}' is not implemented yet (planned: "
                        f"{', '.join(PLANNED_WEIGHT_FORMATS)}); supported now: {', '.join(WEIGHT_FORMATS)}")
    raise PackError(f"unknown weights format '{weights}'; supported: {', '.join(WEIGHT_FORMATS)}")


def og_config_fields(config: ModelConfig) -> dict:
    """The og_config fields of cuda/onegraph.h, resolved from the HF config, plus
    max_position_embeddings (the default for max_seq_len). Every key is required by the C
    parser (adding one needs a new format version) but rope_inv_freq, the rotary frequency
    table of a rope scaling that sets each frequency on its own ("llama3"), written only for
    such a model: a library that predates it refuses the file by that unknown key."""
    fields = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": float(config.rms_norm_eps),
        "rope_theta": float(config.rope_theta),
        "rope_linear_factor": float(config.rope_linear_factor),
        "qk_norm": int(config.has_qk_norm),
        "tie_word_embeddings": int(config.tie_word_embeddings),
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": int(config.norm_topk_prob),
        "layer_is_moe": [int(config.is_moe_layer(layer)) for layer in range(config.num_hidden_layers)],
        "max_position_embeddings": config.max_position_embeddings,
    }
    if rope_frequency_factors(config) is not None:   # the table og_set_rope_frequencies takes
        fields["rope_inv_freq"] = [float(f) for f in rope_frequencies(config)]
    return fields


def packed_dtype(array: np.ndarray, weights: str = "bf16") -> np.dtype:
    """The dtype a tensor is stored as in a packed file of this weights format."""
    check_weights_format(weights)
    if array.ndim == 1 and array.dtype in (BF16, F32):
        return array.dtype
    return F32 if array.ndim == 1 else BF16


def _convert(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if array.dtype == dtype:
        return np.ascontiguousarray(array)
    return np.ascontiguousarray(array.astype(np.float32).astype(dtype))


def _safetensors_dtype(dtype: np.dtype) -> str:
    return {BF16: "BF16", F32: "F32"}[dtype]


def write_packed(config: ModelConfig, tensors: Mapping[str, np.ndarray], out_path: str | os.PathLike,
                 weights: str = "bf16", progress: bool = False) -> str:
    """Write a packed file from a config and its tensors (by HF name; extra names are
    ignored). Written to a temporary name beside out_path and renamed when complete, one
    tensor converted at a time. Returns out_path."""
    check_weights_format(weights)
    out_path = os.fspath(out_path)
    shapes = config.tensor_shapes()
    missing = [name for name in shapes if name not in tensors]
    if missing:
        raise PackError(f"{len(missing)} tensor(s) required by the config are missing: "
                        + ", ".join(f"'{n}'" for n in missing[:5]))
    plan = []
    offset = 0
    for name, shape in shapes.items():
        array = tensors[name]
        if tuple(array.shape) != tuple(shape):
            raise PackError(f"tensor '{name}' has shape {list(array.shape)}, the config needs {list(shape)}")
        dtype = packed_dtype(array, weights)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        plan.append((name, dtype, offset, offset + nbytes))
        offset += nbytes

    metadata = {
        KEY_FORMAT_VERSION: str(FORMAT_VERSION),
        KEY_WEIGHTS: weights,
        KEY_CONFIG: json.dumps(config.to_hf_dict(), separators=(",", ":")),
        KEY_OG_CONFIG: json.dumps(og_config_fields(config), separators=(",", ":")),
    }
    header: dict = {"__metadata__": metadata}
    for name, dtype, begin, end in plan:
        header[name] = {"dtype": _safetensors_dtype(dtype), "shape": list(shapes[name]), "data_offsets": [begin, end]}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned

    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=offset, unit="B", unit_scale=True, desc=f"pack {os.path.basename(out_path)}")
        except ImportError:
            pass
    tmp_path = f"{out_path}.tmp-{os.getpid()}"
    try:
        with open(tmp_path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for name, dtype, begin, end in plan:
                array = _convert(tensors[name], dtype)
                f.write(array.view(np.uint8).data if array.size else b"")
                if bar is not None:
                    bar.update(end - begin)
        os.replace(tmp_path, out_path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise
    finally:
        if bar is not None:
            bar.close()
    return out_path


def pack_model(model_dir: str | os.PathLike, out_path: str | os.PathLike, weights: str = "bf16",
               progress: bool = False) -> str:
    """`onegraph pack`: read an HF model folder (runtime/loader.py) and write a packed file."""
    check_weights_format(weights)
    from .loader import load_model
    model = load_model(model_dir)
    return write_packed(model.config, model.tensors, out_path, weights=weights, progress=progress)


def open_packed(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, tensors) of a packed file; tensors are read-only views into a mapping of the
    file, in tensor_shapes() order. Checks: the loader's strict safetensors header checks and
    the safetensors library's own parse; format version; weights format; the two configs in
    the metadata agree; exactly the tensors of the config with their shapes and dtypes."""
    from .loader import MappedFile, cross_check_with_library, read_header
    path = os.fspath(path)
    header = read_header(path)
    cross_check_with_library(header)
    meta = header.metadata
    for key in (KEY_FORMAT_VERSION, KEY_WEIGHTS, KEY_CONFIG, KEY_OG_CONFIG):
        if key not in meta:
            raise PackError(f"{path}: __metadata__ lacks '{key}': not a packed model file (write one with 'onegraph pack')")
    if meta[KEY_FORMAT_VERSION] != str(FORMAT_VERSION):
        raise PackError(f"{path}: packed format version {meta[KEY_FORMAT_VERSION]!r}, this runtime reads {FORMAT_VERSION}")
    check_weights_format(meta[KEY_WEIGHTS])
    try:
        raw_config = json.loads(meta[KEY_CONFIG])
        og_fields = json.loads(meta[KEY_OG_CONFIG])
    except json.JSONDecodeError as e:
        raise PackError(f"{path}: __metadata__ config is not valid JSON ({e.msg} at column {e.colno})") from None
    config = ModelConfig.from_dict(raw_config, source=f"{path} __metadata__ '{KEY_CONFIG}'")
    expected_og = og_config_fields(config)
    if og_fields != expected_og:
        diff = sorted(k for k in set(og_fields) | set(expected_og) if og_fields.get(k) != expected_og.get(k))
        raise PackError(f"{path}: __metadata__ '{KEY_OG_CONFIG}' disagrees with '{KEY_CONFIG}' on {', '.join(diff)}")
    shapes = config.tensor_shapes()
    extra = sorted(set(header.entries) - set(shapes))
    if extra:
        raise PackError(f"{path}: holds tensor(s) the config does not use: {', '.join(extra[:5])}")
    mapped = MappedFile(header)
    tensors: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        entry = header.entries.get(name)
        if entry is None:
            raise PackError(f"{path}: tensor '{name}' (shape {list(shape)}) is missing")
        if entry.shape != tuple(shape):
            raise PackError(f"{path}: tensor '{name}' has shape {list(entry.shape)}, the config needs {list(shape)}")
        allowed = ("BF16", "F32") if len(shape) == 1 else ("BF16",)
        if entry.dtype not in allowed:
            raise PackError(f"{path}: tensor '{name}' has dtype {entry.dtype}; a bf16 packed file holds "
                            f"{' or '.join(allowed)} there")
        tensors[name] = mapped.tensor(entry)
    return config, tensors


def default_max_seq_len(config: ModelConfig) -> int:
    """What og_open_packed uses for max_seq_len <= 0."""
    return min(DEFAULT_MAX_SEQ_LEN, config.max_position_embeddings)


# ---- `python -m onegraph.pack decode`: the Python twin of examples/c and examples/rust ----

def decode_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m onegraph.pack decode",
                                description="greedy decode from a packed file; prints the new ids on one line")
    p.add_argument("--kv", choices=["fp32", "bf16", "int8"], default="int8")
    p.add_argument("--max-seq-len", type=int, default=DEFAULT_MAX_SEQ_LEN)
    p.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto")
    p.add_argument("--no-graph", action="store_true")
    # The C and Rust programs feed the prompt one og_step per token; "token" by default here too,
    # so the three programs run the same kernels and print the same ids.
    p.add_argument("--prefill", choices=["token", "batched"], default="token")
    p.add_argument("file")
    p.add_argument("n", type=int)
    p.add_argument("ids", type=int, nargs="+")
    args = p.parse_args(argv)
    from .engine import Engine
    config, tensors = open_packed(args.file)
    engine = Engine.from_tensors(config, tensors, kv=args.kv, max_seq_len=args.max_seq_len,
                                 graph=not args.no_graph, device=args.device, prefill=args.prefill)
    with engine:
        t0 = time.perf_counter()
        tokens = engine.generate(args.ids, args.n, stop_token_ids=())
        seconds = time.perf_counter() - t0
        print(" ".join(map(str, tokens)))
        steps = len(args.ids) + max(0, len(tokens) - 1)
        print(f"{engine.backend}: {steps} steps in {seconds * 1e3:.1f} ms: {steps / seconds:.1f} tok/s",
              file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "decode":
        print("usage: python -m onegraph.pack decode [--kv KV] [--max-seq-len N] FILE N ID [ID ...]\n"
              "(packing is 'onegraph pack --model DIR --out FILE')", file=sys.stderr)
        return 2
    return decode_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
