"""Deterministic random-weight models in Hugging Face format, with real shapes.

Presets
-------
``PRESETS`` holds config.json dicts: the public shapes of Qwen3-0.6B, Qwen3-8B,
Qwen3-30B-A3B, SmolLM2-135M and Llama-3.2-1B, a small ``demo`` model (the CLI's embedded
default), and tiny models for tests whose sizes are deliberately not multiples of 32 where the
architecture allows it.
``preset_config(name, num_hidden_layers=None, **overrides)`` turns one into a ``ModelConfig``.

How values are drawn (fast, deterministic, i.i.d.)
--------------------------------------------------
Every tensor is cut into chunks of ``CHUNK_ELEMENTS``. Chunk c of tensor ``name`` draws its
random bits from PCG64 seeded by ``SeedSequence([seed, blake2b(name)], spawn_key=(c,))``, so a
value depends only on (seed, name, position): never on the order of generation, the number
of threads or which other tensors exist. Each 16-bit random word indexes a 65,536-entry
table holding the normal quantiles ``Φ⁻¹((i + ½) / 65536)`` scaled by the tensor's
(mean, std) and rounded to bf16 once per table. The values are therefore exactly i.i.d.
draws from a normal distribution discretized to 65,536 levels and clipped at ±4.3σ (finer
than bf16 can tell apart near the mode), with no pool reuse and so no periodicity: no two
rows repeat, no matrix is low-rank. Cost is 1.5–2.5 ns per value on one core (raw PCG64
words + one table gather, both release the GIL), so chunks run in parallel on a thread pool:
the Qwen3-8B shape (8.2e9 values) is about 15 s of CPU, ~1 s on 16 cores, and writing its
16 GB is bound by the disk. (``standard_normal`` + a bf16 cast costs ~10x more per value.)

Init scale (why greedy decoding is decided by clear margins)
------------------------------------------------------------
- RMSNorm weights (input, post-attention, q_norm, k_norm): mean 1, std 0.05.
- Projections (q/k/v/o, gate/up/down, experts): N(0, 1/fan_in). After an RMSNorm the input
  of each projection has RMS 1, so every projection output, attention score (q·k/√d with
  unit-RMS heads) and sublayer output is O(1); the residual grows like √(layers): RMS ≈ 6
  after 28 layers (Qwen3-0.6B shape), ≈ 7 after 48, never near any float limit.
- MoE router (``mlp.gate``): N(0, 1/fan_in), so router logits have std 1 and routing weights
  are neither uniform nor one-hot.
- Embedding: N(0, 1/hidden), i.e. rows of unit norm, small beside the O(1) layer outputs. A
  unit-RMS embedding would dominate the residual, and with a tied lm_head the current token
  would then always win the argmax (a model that repeats itself tests nothing).
- lm_head: N(0, 1/hidden), and the final norm weight has mean ``LOGIT_STD`` (std 5%), so the
  logits have std ≈ ``LOGIT_STD`` for tied and untied models alike (softmax peaked but not
  one-hot, so sampling tests see a real distribution). Gaussian logits over a vocabulary of
  V have a top-1/top-2 gap of about LOGIT_STD/√(2 ln V) (median ≈1 logit for V=512, ≈0.5
  for the real vocabularies), while rounding
  the KV cache moves the worst logit of a step by ~0.1 (int8) or ~0.04 (bf16) on the tiny
  models: a median margin 9–16x (int8) and 27–43x (bf16) the error, measured by an
  independent float64 forward in tests/test_synth.py. Margins are scale-free here (a larger
  logit scale grows the errors too), so near-ties still occur: a greedy comparison between
  different KV formats, or against a bf16 oracle, can diverge at a rare near-tied step; one
  with identical arithmetic (GPU vs numpy reference, same KV format) cannot.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import struct
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from statistics import NormalDist
from typing import Iterator

import ml_dtypes
import numpy as np

from .config import ModelConfig
from .loader import INDEX_FILE, SINGLE_FILE

BF16 = np.dtype(ml_dtypes.bfloat16)
# Part of what a seed means: changing either changes every model's bytes.
CHUNK_ELEMENTS = 1 << 20
TABLE_BITS = 16
_BLOCK_ELEMENTS = 1 << 18     # 512 KB of words: fits L2; few Python calls per chunk (GIL)
_LOOKAHEAD_CHUNKS_PER_WORKER = 4
SYNTH_FORMAT_VERSION = 1

LOGIT_STD = 4.0
NORM_WEIGHT_STD = 0.05
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # transformers' default shard size, "5GB"
PROGRESS_MIN_BYTES = 1 << 30           # automatic progress bar from this model size

_QWEN3_IDS = {"bos_token_id": 151643, "eos_token_id": 151645}
_COMMON = {"hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}

PRESETS: dict[str, dict] = {
    # https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        tie_word_embeddings=True, rope_theta=1_000_000.0, max_position_embeddings=40960, **_COMMON, **_QWEN3_IDS),
    # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        tie_word_embeddings=False, rope_theta=1_000_000.0, max_position_embeddings=40960, **_COMMON, **_QWEN3_IDS),
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False, rope_theta=1_000_000.0, max_position_embeddings=40960, **_COMMON, **_QWEN3_IDS),
    # https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json: the shape
    # of the default real model, for benchmarks where no copy of its GGUF is at hand.
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        tie_word_embeddings=True, rope_theta=100_000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
        hidden_act="silu", attention_bias=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2),
    # https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json: the shape a public
    # comparison of batch-1 decode designs measures.
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        tie_word_embeddings=True, rope_theta=500_000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        hidden_act="silu", attention_bias=False, torch_dtype="bfloat16", bos_token_id=128000,
        eos_token_id=128001),
    # The CLI's embedded default: small enough to generate in well under a second.
    "demo": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=4096, hidden_size=256, intermediate_size=768,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        tie_word_embeddings=True, rope_theta=1_000_000.0, max_position_embeddings=4096, **_COMMON),
    # Tiny test models: awkward sizes (not multiples of 32) wherever the architecture allows.
    "tiny-dense": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=512, hidden_size=96, intermediate_size=160,
        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        tie_word_embeddings=False, rope_theta=1_000_000.0, max_position_embeddings=2048, **_COMMON),
    "tiny-tied": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=300, hidden_size=80, intermediate_size=136,
        num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1, head_dim=24,
        tie_word_embeddings=True, rope_theta=10_000.0, max_position_embeddings=2048, **_COMMON),
    # Layer 1 is dense (mlp_only_layers), so mixed MoE/dense models are covered.
    "tiny-moe": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=384, hidden_size=96, intermediate_size=136,
        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1],
        tie_word_embeddings=False, rope_theta=1_000_000.0, max_position_embeddings=2048, **_COMMON),
    # No QK-norm; head_dim × heads == hidden as Llama requires.
    "tiny-llama": dict(
        architectures=["LlamaForCausalLM"], vocab_size=448, hidden_size=120, intermediate_size=200,
        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3, head_dim=20,
        tie_word_embeddings=False, rope_theta=10_000.0, max_position_embeddings=2048, rms_norm_eps=1e-5,
        hidden_act="silu", attention_bias=False, torch_dtype="bfloat16"),
}

# tiny-llama with Llama 3.x's rope scaling: its frequencies' wavelengths 6.3, 15.8, 39.7, ...
# against an original context of 32 take each branch of the rule (kept below 8, blended, divided
# by the factor above 32), and a few dozen decoded positions pass all of them.
PRESETS["tiny-llama3"] = dict(PRESETS["tiny-llama"], rope_scaling={
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32})


def preset_config(name: str, num_hidden_layers: int | None = None, **overrides) -> ModelConfig:
    """The ModelConfig of a preset, optionally with fewer layers or other config.json keys
    changed (e.g. ``preset_config("qwen3-8b", num_hidden_layers=2)``)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    raw = json.loads(json.dumps(PRESETS[name]))
    if num_hidden_layers is not None:
        raw["num_hidden_layers"] = num_hidden_layers
    for key, value in overrides.items():
        raw[key] = list(value) if isinstance(value, tuple) else value
    # A smaller vocabulary drops the special token ids it no longer holds (unless given).
    for key in ("bos_token_id", "eos_token_id"):
        if key not in overrides and isinstance(raw.get(key), int) and raw[key] >= raw["vocab_size"]:
            raw[key] = None
    return ModelConfig.from_dict(raw, source=f"preset {name}")


# ---- values --------------------------------------------------------------------------------

def init_scale(config: ModelConfig, name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of the normal distribution tensor ``name`` of ``shape`` is drawn from
    (see the module docstring)."""
    if name == "model.norm.weight":
        return LOGIT_STD, NORM_WEIGHT_STD * LOGIT_STD
    if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")):
        return 1.0, NORM_WEIGHT_STD
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0.0, 1.0 / math.sqrt(config.hidden_size)
    if len(shape) != 2:
        raise KeyError(f"no init rule for tensor '{name}' of shape {shape}")
    return 0.0, 1.0 / math.sqrt(shape[1])


@lru_cache(maxsize=1)
def _normal_quantiles() -> np.ndarray:
    """Φ⁻¹((i + ½) / 2^16) for every 16-bit word i, float64, ascending."""
    n = 1 << TABLE_BITS
    inv_cdf = NormalDist().inv_cdf
    return np.array([inv_cdf((i + 0.5) / n) for i in range(n)], dtype=np.float64)


@lru_cache(maxsize=64)
def _bf16_table(mean: float, std: float) -> np.ndarray:
    """The bf16 bit patterns of mean + std·quantile, indexed by a 16-bit random word."""
    return (mean + std * _normal_quantiles()).astype(BF16).view(np.uint16)


def _name_key(seed: int, name: str) -> list[int]:
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative integer")
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=16).digest()
    return [seed, *struct.unpack("<4I", digest)]


def _fill_chunk(out_bits: np.ndarray, key: list[int], chunk: int, table: np.ndarray) -> None:
    """Fill out_bits (uint16, 1-D) with chunk ``chunk`` of the tensor keyed by ``key``."""
    n = out_bits.size
    bits = np.random.PCG64(np.random.SeedSequence(key, spawn_key=(chunk,)))
    # Draw in cache-sized blocks (the raw words stay in L2 until gathered); consecutive
    # random_raw calls continue one stream, so the block size does not change the values.
    for begin in range(0, n, _BLOCK_ELEMENTS):
        count = min(_BLOCK_ELEMENTS, n - begin)
        words = bits.random_raw((count + 3) // 4).view(np.uint16)[:count]
        # mode="clip" skips the bounds check (every uint16 is a valid index), ~30% faster.
        np.take(table, words, out=out_bits[begin:begin + count], mode="clip")


def _submit_tensor(pool: ThreadPoolExecutor | None, config: ModelConfig, name: str, shape, seed: int):
    """Start generating one tensor; returns (array, futures)."""
    count = math.prod(shape)
    out = np.empty(count, dtype=np.uint16)
    key = _name_key(seed, name)
    table = _bf16_table(*init_scale(config, name, shape))
    futures: list[Future] = []
    for chunk, begin in enumerate(range(0, count, CHUNK_ELEMENTS)):
        piece = out[begin:begin + CHUNK_ELEMENTS]
        if pool is None:
            _fill_chunk(piece, key, chunk, table)
        else:
            futures.append(pool.submit(_fill_chunk, piece, key, chunk, table))
    return out.view(BF16).reshape(shape), futures


def make_tensor(config: ModelConfig, name: str, seed: int = 0) -> np.ndarray:
    """One tensor, on this thread; identical to what iter_tensors yields for it."""
    shape = config.tensor_shapes()[name]
    arr, _ = _submit_tensor(None, config, name, shape, seed)
    return arr


def iter_tensors(config: ModelConfig, seed: int = 0, names=None, workers: int | None = None
                 ) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, bf16 array) for every tensor of ``config.tensor_shapes()`` (or ``names``),
    in that order, lazily. Values depend only on (seed, name), see the module docstring.

    While the caller handles one tensor, the following ones are being generated: at least one
    tensor and about 4 chunks per worker ahead, so memory holds the current tensor plus that
    lookahead; each yielded array is the caller's to keep or drop.
    """
    shapes = config.tensor_shapes()
    order = list(shapes) if names is None else list(names)
    for name in order:
        if name not in shapes:
            raise KeyError(f"tensor '{name}' is not part of this model (config {config.source})")
    workers = workers or os.cpu_count() or 1
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="synth") if workers > 1 else None
    lookahead_values = workers * _LOOKAHEAD_CHUNKS_PER_WORKER * CHUNK_ELEMENTS
    pending: deque = deque()  # (name, array, futures), in yield order
    pending_values = 0
    try:
        for name in order:
            arr, futures = _submit_tensor(pool, config, name, shapes[name], seed)
            pending.append((name, arr, futures))
            pending_values += arr.size
            while len(pending) > 1 and pending_values - pending[0][1].size >= lookahead_values:
                done = pending.popleft()
                pending_values -= done[1].size
                yield _finish(done)
        while pending:
            yield _finish(pending.popleft())
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _finish(pending) -> tuple[str, np.ndarray]:
    name, arr, futures = pending
    for f in futures:
        f.result()
    return name, arr


# ---- writing a model folder -------------------------------------------------------------

def _shard_plan(config: ModelConfig, max_shard_bytes: int) -> list[list[str]]:
    """Tensors in tensor_shapes() order, cut into shards of at most max_shard_bytes (a tensor
    larger than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in config.tensor_shapes().items():
        nbytes = math.prod(shape) * BF16.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _header_bytes(config: ModelConfig, names: list[str]) -> bytes:
    """The safetensors header for these tensors in this order, padded to 8 bytes."""
    shapes = config.tensor_shapes()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        nbytes = math.prod(shapes[name]) * BF16.itemsize
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _progress_bar(total_bytes: int, progress: bool | None, desc: str):
    if progress is None:
        progress = total_bytes >= PROGRESS_MIN_BYTES
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc)


def write_model(config: ModelConfig, out_dir: str | os.PathLike, seed: int = 0,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool | None = None,
                overwrite: bool = False, workers: int | None = None) -> list[str]:
    """Write a Hugging Face model folder: config.json, generation_config.json and
    model.safetensors, or shards model-0000i-of-0000n.safetensors + model.safetensors.index.json
    when the weights exceed max_shard_bytes. Streams tensor by tensor (headers are computed from
    the shapes first), so memory holds one tensor plus the generation lookahead, never the
    model. Returns the paths written.

    ``out_dir`` must be empty or absent unless ``overwrite``, in which case weight files of a
    previous model there are removed first (a stale shard would make the folder inconsistent).
    """
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    existing = os.listdir(out_dir)
    if existing:
        if not overwrite:
            raise FileExistsError(f"{out_dir}: folder is not empty ({', '.join(sorted(existing)[:5])}); "
                                  f"pass overwrite=True to replace a model there")
        for f in existing:
            if f in ("config.json", "generation_config.json", INDEX_FILE) or f.endswith(".safetensors"):
                os.remove(os.path.join(out_dir, f))

    shapes = config.tensor_shapes()
    shards = _shard_plan(config, max_shard_bytes)
    total_bytes = sum(math.prod(s) for s in shapes.values()) * BF16.itemsize
    if len(shards) == 1:
        files = [SINGLE_FILE]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    written: list[str] = []
    bar = _progress_bar(total_bytes, progress, f"write {os.path.basename(out_dir) or out_dir}")
    tensors = iter_tensors(config, seed, workers=workers)
    try:
        for file_name, names in zip(files, shards):
            path = os.path.join(out_dir, file_name)
            with open(path, "wb") as f:
                f.write(_header_bytes(config, names))
                for expected in names:
                    name, arr = next(tensors)
                    assert name == expected, (name, expected)
                    f.write(arr.view(np.uint16).data)
                    if bar is not None:
                        bar.update(arr.nbytes)
                    del arr
            written.append(path)
    finally:
        tensors.close()
        if bar is not None:
            bar.close()

    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes},
                 "weight_map": {name: file_name for file_name, names in zip(files, shards) for name in names}}
        path = os.path.join(out_dir, INDEX_FILE)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
        written.append(path)
    generation = {"do_sample": False}
    for key in ("bos_token_id", "eos_token_id"):
        if getattr(config, key) is not None:
            generation[key] = getattr(config, key)
    for file_name, content in (("generation_config.json", generation),
                               ("config.json", config.to_hf_dict())):
        path = os.path.join(out_dir, file_name)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
        written.append(path)
    return written


def write_tensors(config: ModelConfig, out_dir: str | os.PathLike, tensors: dict[str, np.ndarray]) -> str:
    """Write config.json and a model.safetensors holding `tensors` (by name, in their own dtype:
    bfloat16, float16 or float32) into out_dir, e.g. a float16 checkpoint made from a synthetic
    one. Returns the weights file's path."""
    dtypes = {BF16: "BF16", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in tensors.items():
        if array.dtype not in dtypes:
            raise ValueError(f"tensor '{name}': dtype {array.dtype} is not one of bfloat16, float16, float32")
        header[name] = {"dtype": dtypes[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(os.fspath(out_dir), SINGLE_FILE)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())
    with open(os.path.join(os.fspath(out_dir), "config.json"), "w", encoding="utf-8") as f:
        json.dump(config.to_hf_dict(), f, indent=2)
    return path


# ---- the embedded demo model ------------------------------------------------------------

DEMO_PRESET = "demo"
DEMO_SEED = 0


def ensure_demo_model(cache_dir: str | os.PathLike | None = None) -> str:
    """Path of the CLI's default model, generated on first use into
    ``<cache>/demo-<hash>`` where cache is ``cache_dir``, else $ONEGRAPH_CACHE, else
    ~/.cache/onegraph. The hash covers the config, the seed and the generator version, so a
    change to any of them makes a new folder. Written to a temporary folder and renamed into
    place, so the folder either holds the whole model or does not exist."""
    config = preset_config(DEMO_PRESET)
    base = os.fspath(cache_dir) if cache_dir is not None else (
        os.environ.get("ONEGRAPH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "onegraph"))
    ident = json.dumps([config.to_hf_dict(), DEMO_SEED, SYNTH_FORMAT_VERSION, CHUNK_ELEMENTS], sort_keys=True)
    final = os.path.join(base, f"demo-{hashlib.sha256(ident.encode()).hexdigest()[:12]}")
    if os.path.isdir(final):
        return final
    os.makedirs(base, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".demo-tmp-", dir=base)
    try:
        write_model(config, tmp, seed=DEMO_SEED, progress=False, overwrite=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isdir(final):  # not a concurrent writer winning the race
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# ---- command line: python -m onegraph.synth PRESET OUT_DIR ----------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onegraph.synth", description=__doc__.split("\n")[0])
    parser.add_argument("preset", choices=list(PRESETS))
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    parser.add_argument("--max-shard-gb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 1e9)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    config = preset_config(args.preset, num_hidden_layers=args.layers)
    start = time.perf_counter()
    files = write_model(config, args.out_dir, seed=args.seed, max_shard_bytes=int(args.max_shard_gb * 1e9),
                        overwrite=args.overwrite)
    seconds = time.perf_counter() - start
    nbytes = sum(os.path.getsize(f) for f in files)
    print(f"wrote {len(files)} files, {nbytes / 1e9:.2f} GB in {seconds:.1f} s ({nbytes / 1e9 / seconds:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
