"""Read a Hugging Face model folder into numpy arrays without copying the weights.

A folder holds ``config.json`` and either ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (its ``weight_map``: tensor name -> shard file). When both
exist the single file wins, as in ``transformers``.

How the bytes are read, and why
-------------------------------
The safetensors format is an 8-byte little-endian header length N, N bytes of JSON
(``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``, offsets
relative to the data section), then the data section. The library's numpy bindings cannot
return bf16 (numpy has no bf16 dtype), and copying through torch is not allowed here. So:

1. we parse the header ourselves with strict checks, because our messages must name the
   file, the tensor and expected vs actual (the library's errors do not name the tensor in
   most cases);
2. the safetensors library then opens the same file (``safe_open``, which only maps it and
   parses the header) as a second, independent validator, and its view of every tensor's
   dtype and shape must agree with ours;
3. each file is memory-mapped read-only once (``mmap`` + ``np.frombuffer``) and every tensor
   is a zero-copy view into that mapping, with ``ml_dtypes.bfloat16`` for BF16.

Nothing is read from disk until a tensor's pages are touched, so ``load_model`` itself costs
only the headers; reading every tensor once (a GPU upload) brings the file's pages into the
page cache, which counts toward RSS at most once: peak RSS stays near 1× the file size, not
the 2× of a read-and-convert loader. The arrays are read-only; copy one to modify it.

Which tensors come back
-----------------------
Exactly ``config.tensor_shapes()``: each must be present, with that exact shape, and dtype
BF16, F16 or F32 (returned as stored, no conversion). Anything else in the files (rotary
``inv_freq`` buffers, ``lm_head.weight`` of a model with ``tie_word_embeddings``) is not
returned and is listed in ``LoadedModel.ignored``. A tied model's ``lm_head.weight`` is
ignored rather than rejected because ``transformers`` does the same: with tied embeddings
the output projection *is* the embedding table, whatever the file holds.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from .config import ModelConfig, read_json_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Same limit as the safetensors library: a header longer than this is not a header.
MAX_HEADER_BYTES = 100_000_000

# Every dtype the safetensors format defines, with its size in bits (needed to check the
# offsets of tensors we do not load), and the subset the runtime loads.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
SUPPORTED_DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
}


class LoaderError(ValueError):
    """A model folder or weights file the runtime cannot load; the message names the file,
    the tensor, and what was expected vs found."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as a safetensors header describes it; offsets are in the data section."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class SafetensorsHeader:
    path: str
    file_bytes: int
    data_start: int  # 8 + header length
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]

    @property
    def data_bytes(self) -> int:
        return self.file_bytes - self.data_start


@dataclass
class LoadedModel:
    config: ModelConfig
    tensors: dict[str, np.ndarray]  # HF name -> read-only view into a mapped file, tensor_shapes() order
    files: list[str]                # the safetensors files read
    total_bytes: int                # sum of the returned tensors' nbytes
    ignored: list[str] = field(default_factory=list)  # tensors in the files that the model does not use
    path: str = ""


# ---- one safetensors file --------------------------------------------------------------

def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _no_duplicate_keys(path: str):
    def hook(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise LoaderError(f"{path}: header names tensor '{key}' twice")
            seen[key] = value
        return seen
    return hook


def _entry_bytes(path: str, name: str, dtype: str, shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    bits = count * DTYPE_BITS[dtype]
    if bits % 8:
        raise LoaderError(f"{path}: tensor '{name}' has {count} elements of {dtype}, not a whole number of bytes")
    return bits // 8


def read_header(path: str) -> SafetensorsHeader:
    """Parse and check one safetensors header. Checks: the length field is sane and inside
    the file; the JSON is an object with no repeated names; every entry has a known dtype, a
    shape of non-negative ints and data_offsets [begin, end] whose span equals shape × dtype
    size; the tensors tile the data section exactly (no overlap, no gap, nothing past the end
    of the file, nothing after the last tensor)."""
    if not os.path.isfile(path):
        raise LoaderError(f"{path}: weights file not found")
    file_bytes = os.path.getsize(path)
    if file_bytes < 8:
        raise LoaderError(f"{path}: file is {file_bytes} bytes, too short for the 8-byte header length of a safetensors file")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > MAX_HEADER_BYTES:
            raise LoaderError(
                f"{path}: header length field says {header_len} bytes, beyond the {MAX_HEADER_BYTES}-byte "
                f"limit of the format (file is {file_bytes} bytes): not a safetensors file or a corrupt one")
        if header_len > file_bytes - 8:
            raise LoaderError(
                f"{path}: header length field says {header_len} bytes but only {file_bytes - 8} bytes follow it "
                f"(file is {file_bytes} bytes): truncated or corrupt")
        if header_len < 2:
            raise LoaderError(f"{path}: header length field says {header_len} bytes, too short for a JSON object")
        raw = f.read(header_len)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LoaderError(f"{path}: header is not UTF-8 text (byte {e.start}): corrupt file") from None
    if not text.startswith("{"):
        raise LoaderError(f"{path}: header does not start with '{{' (starts with {text[:16]!r}): corrupt file")
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicate_keys(path))
    except json.JSONDecodeError as e:
        raise LoaderError(f"{path}: header is not valid JSON (column {e.colno}: {e.msg}): corrupt file") from None

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise LoaderError(f"{path}: header '__metadata__' must map strings to strings, got {metadata!r}")

    data_start = 8 + header_len
    data_bytes = file_bytes - data_start
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        where = f"{path}: tensor '{name}'"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise LoaderError(f"{where}: header entry must be an object with dtype, shape and data_offsets, got {info!r}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPE_BITS:
            raise LoaderError(f"{where}: unknown dtype {dtype!r}; the safetensors format defines {', '.join(DTYPE_BITS)}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise LoaderError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise LoaderError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
        shape = tuple(shape)
        need = _entry_bytes(path, name, dtype, shape)
        span = offsets[1] - offsets[0]
        if span != need:
            raise LoaderError(
                f"{where}: data_offsets {offsets} span {span} bytes, but shape {_fmt_shape(shape)} of {dtype} "
                f"needs {need} bytes: the header lies about sizes")
        entries[name] = TensorEntry(name, dtype, shape, offsets[0], offsets[1])

    # The data section must be tiled exactly: first bytes past the end (truncation), then
    # overlaps and gaps, then trailing bytes.
    ordered = sorted(entries.values(), key=lambda e: (e.begin, e.end))
    for e in ordered:
        if e.end > data_bytes:
            raise LoaderError(
                f"{path}: tensor '{e.name}' occupies bytes [{e.begin}, {e.end}) of the data section, but only "
                f"{data_bytes} data bytes follow the header (file is {file_bytes} bytes, expected at least "
                f"{data_start + e.end}): file truncated or offsets out of range")
    expected_begin, previous = 0, None
    for e in ordered:
        if e.begin < expected_begin:
            raise LoaderError(
                f"{path}: tensors '{previous.name}' at [{previous.begin}, {previous.end}) and '{e.name}' at "
                f"[{e.begin}, {e.end}) overlap in the data section")
        if e.begin > expected_begin:
            after = f"after tensor '{previous.name}'" if previous else "at the start of the data section"
            raise LoaderError(
                f"{path}: bytes [{expected_begin}, {e.begin}) {after} belong to no tensor (next is '{e.name}'); "
                f"the format requires the tensors to cover the data section without gaps")
        expected_begin, previous = e.end, e
    if expected_begin != data_bytes:
        raise LoaderError(
            f"{path}: the tensors cover {expected_begin} data bytes but the file holds {data_bytes} "
            f"(file is {file_bytes} bytes, expected {data_start + expected_begin}): trailing bytes after the last tensor")
    return SafetensorsHeader(path, file_bytes, data_start, entries, metadata)


def cross_check_with_library(header: SafetensorsHeader) -> None:
    """Let the safetensors library parse the same file; it must accept it and agree with us."""
    try:
        from safetensors import safe_open
    except ImportError:  # the library is a dependency; without it only our own checks run
        return
    try:
        with safe_open(header.path, framework="numpy") as f:
            keys = set(f.keys())
            if keys != set(header.entries):
                raise LoaderError(
                    f"{header.path}: the safetensors library sees tensors {sorted(keys ^ set(header.entries))[:5]} "
                    f"differently from this loader's header parse")
            for name, entry in header.entries.items():
                sl = f.get_slice(name)
                if sl.get_dtype() != entry.dtype or tuple(sl.get_shape()) != entry.shape:
                    raise LoaderError(
                        f"{header.path}: tensor '{name}': the safetensors library reads {sl.get_dtype()} "
                        f"{_fmt_shape(sl.get_shape())}, this loader read {entry.dtype} {_fmt_shape(entry.shape)}")
    except LoaderError:
        raise
    except Exception as e:  # SafetensorError and anything the binding raises
        raise LoaderError(f"{header.path}: rejected by the safetensors library: {e}") from None


class MappedFile:
    """One read-only mapping per file; tensors are views that keep the mapping alive."""

    def __init__(self, header: SafetensorsHeader):
        self.header = header
        with open(header.path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def tensor(self, entry: TensorEntry) -> np.ndarray:
        dtype = SUPPORTED_DTYPES[entry.dtype]
        count = (entry.end - entry.begin) // dtype.itemsize
        if count == 0:
            arr = np.empty(entry.shape, dtype)
            arr.flags.writeable = False
            return arr
        arr = np.frombuffer(self.map, dtype=dtype, count=count, offset=self.header.data_start + entry.begin)
        return arr.reshape(entry.shape)


# ---- a model folder -------------------------------------------------------------------------

def _read_index(folder: str, index_path: str) -> dict[str, str]:
    index = read_json_file(index_path, LoaderError)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise LoaderError(f"{index_path}: expected an object with a non-empty 'weight_map' (tensor name -> shard file), "
                          f"got {type(weight_map).__name__ if weight_map is not None else 'none'}")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard or shard in (".", ".."):
            raise LoaderError(f"{index_path}: weight_map maps tensor '{name}' to {shard!r}, "
                              f"which is not a file name inside {folder}")
    return weight_map


def _read_sharded(folder: str, index_path: str) -> tuple[dict[str, SafetensorsHeader], dict[str, str]]:
    """Headers of every shard, and the owner file of every tensor, with the index and the
    shard headers required to agree exactly."""
    weight_map = _read_index(folder, index_path)
    shard_tensors: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shard_tensors.setdefault(shard, []).append(name)
    headers: dict[str, SafetensorsHeader] = {}
    for shard, names in shard_tensors.items():
        shard_path = os.path.join(folder, shard)
        if not os.path.isfile(shard_path):
            others = f" and {len(names) - 1} other(s)" if len(names) > 1 else ""
            raise LoaderError(f"{index_path}: weight_map puts tensor '{names[0]}'{others} in shard '{shard}', "
                              f"but {shard_path} does not exist")
        headers[shard_path] = read_header(shard_path)

    owner: dict[str, str] = {}
    for shard_path, header in headers.items():
        for name in header.entries:
            if name in owner:
                raise LoaderError(f"tensor '{name}' is stored in two shards: {owner[name]} and {shard_path} "
                                  f"(index {index_path})")
            owner[name] = shard_path
    for name, shard in weight_map.items():
        listed = os.path.join(folder, shard)
        actual = owner.get(name)
        if actual is None:
            raise LoaderError(f"{index_path}: weight_map puts tensor '{name}' in {listed}, but that shard's header "
                              f"has no such tensor (nor does any other shard)")
        if actual != listed:
            raise LoaderError(f"{index_path}: weight_map puts tensor '{name}' in {listed}, but it is stored in {actual}")
    for name, shard_path in owner.items():
        if name not in weight_map:
            raise LoaderError(f"{shard_path}: holds tensor '{name}', which the index {index_path} weight_map does not list")
    return headers, owner


def _progress(items, enabled: bool, desc: str):
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="tensor")


def load_model(path: str | os.PathLike, progress: bool = False) -> LoadedModel:
    """Read config.json and the weights of a Hugging Face model folder (see module docstring),
    or a GGUF file (by its magic or a .gguf name; runtime/gguf_model.py), whose tensors are
    then dequantized on access.

    Raises LoaderError for file and weight problems and ConfigError for config.json problems.
    """
    folder = os.fspath(path)
    if os.path.isfile(folder):
        from .gguf_model import is_gguf_file, load_gguf  # a GGUF file: runtime/gguf_model.py
        if is_gguf_file(folder):
            return load_gguf(folder)
    if not os.path.exists(folder):
        raise LoaderError(f"{folder}: model folder not found")
    if not os.path.isdir(folder):
        raise LoaderError(f"{folder}: not a folder (expected a Hugging Face model folder with config.json "
                          f"and {SINGLE_FILE} or {INDEX_FILE})")
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise LoaderError(f"{config_path}: config.json not found in the model folder")
    config = ModelConfig.from_file(config_path)

    single = os.path.join(folder, SINGLE_FILE)
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(single):
        header = read_header(single)
        headers = {single: header}
        owner = {name: single for name in header.entries}
        where = single
    elif os.path.isfile(index_path):
        headers, owner = _read_sharded(folder, index_path)
        where = index_path
    else:
        present = sorted(f for f in os.listdir(folder) if f.endswith((".safetensors", ".bin", ".pt", ".gguf")))
        hint = f" (found {', '.join(present)}; only safetensors named as above are read)" if present else ""
        raise LoaderError(f"{folder}: no weights file: neither {SINGLE_FILE} nor {INDEX_FILE} exists{hint}")
    for header in headers.values():
        cross_check_with_library(header)

    expected = config.tensor_shapes()
    missing = [name for name in expected if name not in owner]
    if missing:
        listed = ", ".join(f"'{n}' (expected shape {_fmt_shape(expected[n])})" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise LoaderError(f"{where}: {len(missing)} tensor(s) required by {config_path} are missing: {listed}{more}")

    maps = {p: MappedFile(h) for p, h in headers.items()}
    tensors: dict[str, np.ndarray] = {}
    for name in _progress(list(expected), progress, "load"):
        file_path = owner[name]
        entry = headers[file_path].entries[name]
        if entry.shape != tuple(expected[name]):
            raise LoaderError(f"{file_path}: tensor '{name}' has shape {_fmt_shape(entry.shape)}, "
                              f"expected {_fmt_shape(expected[name])} (from {config_path})")
        if entry.dtype not in SUPPORTED_DTYPES:
            raise LoaderError(f"{file_path}: tensor '{name}' has dtype {entry.dtype}, expected one of "
                              f"{', '.join(SUPPORTED_DTYPES)}")
        tensors[name] = maps[file_path].tensor(entry)
    ignored = sorted(name for name in owner if name not in expected)
    return LoadedModel(
        config=config,
        tensors=tensors,
        files=list(headers),
        total_bytes=sum(t.nbytes for t in tensors.values()),
        ignored=ignored,
        path=folder,
    )
