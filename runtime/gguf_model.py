"""Read a GGUF file (llama.cpp's format) into what runtime/loader.py returns; write one.

Reading
-------
The ``gguf`` package's ``GGUFReader`` (llama.cpp's own Python reader) maps the file and
parses its header; this module turns that into a ``LoadedModel``:

- the config comes from the metadata (``<arch>.block_count``, ``<arch>.embedding_length``,
  ...; see ``config_from_metadata``), written as the config.json dict it stands for and read
  by ``ModelConfig.from_dict``, so the same validation applies to both formats;
- tensor names map to Hugging Face names through one table (``LAYER_TENSORS``,
  ``EXPERT_TENSORS``, ``GLOBAL_TENSORS``); a MoE layer's experts are stored stacked in one 3-D
  tensor per projection ([experts, out, in] in numpy order) and come back one per expert;
- a ``rope_freqs`` tensor (how llama.cpp's converter writes Llama 3.x's "llama3" rope scaling:
  one divisor per rotary frequency) becomes a "freq_factors" rope_scaling in the config;
- every required tensor's presence, shape and type is checked when the file is opened;
  values are not touched then. ``LoadedModel.tensors`` is a read-only Mapping that
  dequantizes a tensor when it is accessed (``gguf.quants.dequantize``), undoes the Q/K row
  permutation of the ``llama`` architecture, and returns it as the engine stores weights:
  matrices rounded to bf16 (round to nearest even), 1-D norms float32. Nothing is cached, so a
  GPU upload that reads the tensors one by one holds one dequantized tensor at a time beside
  the mapped file.

Why the permutation: llama.cpp's converter reorders each head's rows of q_proj and k_proj
from Hugging Face's rotate-half layout (pairs (i, i + d/2)) to interleaved pairs (2i, 2i + 1),
which its rope kernel for ``llama`` expects: rows [h, 2, d/2] become [h, d/2, 2]. The Qwen
converters do not permute (their rope is the rotate-half "neox" kind).

``qwen2`` reads as ``LlamaForCausalLM`` (same dense layout without QK-norm, rotate-half rope,
no permutation), but real Qwen2 checkpoints carry q/k/v biases, which the engine does not
implement: a file with any bias tensor is refused, never loaded without them.

Writing
-------
``write_gguf(config, tensors, path, types=...)`` writes a model (e.g. runtime/synth.py's) as
a GGUF with the ``gguf`` package's ``GGUFWriter``, quantizing matrices with
``gguf.quants.quantize``, permuting Q/K for ``llama`` and writing a "llama3" or
"freq_factors" rope scaling as ``rope_freqs``, so synth -> GGUF -> load round-trips.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence

import ml_dtypes
import numpy as np

from .config import ConfigError, ModelConfig
from .loader import LoadedModel, LoaderError
from .reference import rope_frequency_factors

GGUF_MAGIC = b"GGUF"
DEQUANT_CHUNK_ELEMENTS = 1 << 20
BF16 = np.dtype(ml_dtypes.bfloat16)

# GGUF general.architecture -> (Hugging Face architecture, Q/K rows permuted by the converter).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("LlamaForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", False),
}
# The writer's direction: Hugging Face architecture -> GGUF architecture.
GGUF_ARCHITECTURE = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe"}

# Tensor types this module dequantizes (all through gguf.quants.dequantize).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")

# The name table. Per layer: GGUF "blk.{L}.<key>.weight" <-> HF "model.layers.{L}.<value>.weight".
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# Stacked experts: GGUF "blk.{L}.<key>.weight" [E, out, in] <-> HF "model.layers.{L}.mlp.experts.{e}.<value>.weight".
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Llama 3.x's rope scaling as llama.cpp's converter writes it: per-frequency divisors, F32 [head_dim / 2].
ROPE_FREQS = "rope_freqs.weight"
# Rows permuted per head by llama.cpp's converter (for permuted architectures), with the
# config field giving the number of heads.
PERMUTED_TENSORS = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}

_HF_LAYER = {hf: gg for gg, hf in LAYER_TENSORS.items()}
_HF_EXPERT = {hf: gg for gg, hf in EXPERT_TENSORS.items()}
_HF_GLOBAL = {hf: gg for gg, hf in GLOBAL_TENSORS.items()}
_HF_NAME = re.compile(r"model\.layers\.(\d+)\.(?:mlp\.experts\.(\d+)\.)?(.+)\.weight")


def gguf_source(hf_name: str) -> tuple[str, int | None, str]:
    """(GGUF tensor name, expert index or None, table key) holding a Hugging Face tensor."""
    if hf_name.endswith(".weight") and hf_name[:-len(".weight")] in _HF_GLOBAL:
        key = _HF_GLOBAL[hf_name[:-len(".weight")]]
        return f"{key}.weight", None, key
    m = _HF_NAME.fullmatch(hf_name)
    if m is None:
        raise KeyError(f"no GGUF name for tensor '{hf_name}'")
    layer, expert, rest = m.group(1), m.group(2), m.group(3)
    key = _HF_EXPERT[rest] if expert is not None else _HF_LAYER[rest]
    return f"blk.{layer}.{key}.weight", None if expert is None else int(expert), key


def is_gguf_file(path: str | os.PathLike) -> bool:
    """A file that starts with the GGUF magic, or any file named *.gguf (so a damaged one
    gets this module's messages, not the safetensors loader's)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return False
    if path.lower().endswith(".gguf"):
        return True
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


# ---- permutation ----------------------------------------------------------------------------

def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows [2, d/2] -> [d/2, 2] (rotate-half -> interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of permute_rows: each head's rows [d/2, 2] -> [2, d/2]."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- reading --------------------------------------------------------------------------------

def _field(reader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _rope_freqs(reader, path: str) -> list[float]:
    """The values of the file's rope_freqs tensor (F32, one per frequency; the config checks
    how many)."""
    t = next(t for t in reader.tensors if t.name == ROPE_FREQS)
    if t.tensor_type.name != "F32" or len(t.shape) != 1:
        raise LoaderError(f"{path}: tensor '{ROPE_FREQS}' has type {t.tensor_type.name} and shape "
                          f"{_gguf_shape(tuple(int(d) for d in reversed(t.shape.tolist())))}; expected "
                          f"one F32 value per rope frequency")
    return [float(v) for v in np.asarray(t.data, np.float32)]


def config_from_metadata(reader, path: str, tensor_names: set[str]) -> ModelConfig:
    """The ModelConfig of a GGUF file: its metadata written as the config.json it stands for,
    with its rope_freqs tensor (Llama 3.x's rope scaling as per-frequency divisors) as a
    'freq_factors' rope_scaling."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise LoaderError(f"{path}: general.architecture is {arch!r}, not supported; supported: "
                          f"{', '.join(ARCHITECTURES)}")
    hf_arch = ARCHITECTURES[arch][0]

    def meta(key: str, default=None):
        value = _field(reader, f"{arch}.{key}")
        return default if value is None else value

    def need(key: str):
        value = meta(key)
        if value is None:
            raise LoaderError(f"{path}: metadata key '{arch}.{key}' is missing")
        return value

    vocab = meta("vocab_size")
    if vocab is None:
        tokens = reader.get_field("tokenizer.ggml.tokens")
        if tokens is None:
            raise LoaderError(f"{path}: neither '{arch}.vocab_size' nor 'tokenizer.ggml.tokens' gives the vocabulary size")
        vocab = len(tokens.data)
    hidden, heads = need("embedding_length"), need("attention.head_count")
    raw = {
        "architectures": [hf_arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length", 0),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("attention.key_length", hidden // heads if heads else 0),
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": need("context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        raw["rope_scaling"] = {"rope_type": scaling, "factor": meta("rope.scaling.factor")}
        if meta("rope.scaling.original_context_length") is not None:
            raw["rope_scaling"]["original_max_position_embeddings"] = meta("rope.scaling.original_context_length")
    if ROPE_FREQS in tensor_names:
        if "rope_scaling" in raw:
            raise LoaderError(f"{path}: holds both '{ROPE_FREQS}' and {arch}.rope.scaling.type="
                              f"{scaling!r}; the engine implements one rope scaling at a time")
        raw["rope_scaling"] = {"rope_type": "freq_factors", "factors": _rope_freqs(reader, path)}
    if hf_arch == "Qwen3MoeForCausalLM":
        # A layer is sparse when it has a router; llama.cpp normalizes the top-k routing
        # weights of qwen3moe unless the file says otherwise.
        layers = raw["num_hidden_layers"]
        raw.update(
            num_experts=need("expert_count"),
            num_experts_per_tok=need("expert_used_count"),
            moe_intermediate_size=need("expert_feed_forward_length"),
            norm_topk_prob=bool(meta("expert_weights_norm", True)),
            decoder_sparse_step=1,
            mlp_only_layers=[l for l in range(layers) if f"blk.{l}.ffn_gate_inp.weight" not in tensor_names],
        )
    try:
        return ModelConfig.from_dict(raw, source=f"{path} metadata")
    except ConfigError as e:
        raise LoaderError(str(e)) from None


class GGUFTensors(Mapping):
    """HF name -> dequantized tensor, computed on access (read-only; matrices bf16, norms f32).
    Iterates in config.tensor_shapes() order."""

    def __init__(self, config: ModelConfig, tensors: dict, permuted: bool):
        self._shapes = config.tensor_shapes()
        self._config = config
        self._tensors = tensors       # GGUF name -> gguf ReaderTensor
        self._permuted = permuted

    def __len__(self) -> int:
        return len(self._shapes)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __contains__(self, name) -> bool:
        return name in self._shapes

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._shapes:
            raise KeyError(name)
        gguf_name, expert, key = gguf_source(name)
        t = self._tensors[gguf_name]
        data = t.data if expert is None else t.data[expert]   # [rows, row bytes] or [rows, row elements]
        shape = self._shapes[name]
        from gguf.quants import dequantize
        if len(shape) == 1:
            out = np.asarray(dequantize(data, t.tensor_type), dtype=np.float32).reshape(shape)
        else:
            # Row chunks bound the float32 temporaries (the dequantizer makes several) to
            # DEQUANT_CHUNK_ELEMENTS, whatever the tensor's size.
            out = np.empty(shape, BF16)
            rows = max(1, DEQUANT_CHUNK_ELEMENTS // shape[1])
            for r in range(0, shape[0], rows):
                out[r:r + rows] = dequantize(data[r:r + rows], t.tensor_type).reshape(-1, shape[1]).astype(BF16)
            if self._permuted and key in PERMUTED_TENSORS:
                out = unpermute_rows(out, getattr(self._config, PERMUTED_TENSORS[key]))  # exact: moves rows
        out.flags.writeable = False
        return out


def _gguf_shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def open_gguf(path: str | os.PathLike):
    """Parse a GGUF file's header (metadata and tensor index; tensor data stays mapped, unread):
    the gguf.GGUFReader that load_gguf and the tokenizer (text.Tokenizer.from_model) both read."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise LoaderError(f"{path}: GGUF file not found")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise LoaderError(f"{path}: reading GGUF files needs the 'gguf' package (pip install gguf)") from None
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise LoaderError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, ... on a damaged file
        raise LoaderError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}): truncated or corrupt") from None


def load_gguf(path: str | os.PathLike, reader=None) -> LoadedModel:
    """Open a GGUF file and check it (see the module docstring); values are read on access.
    `reader`: the file's open_gguf(path), when the caller has parsed it already."""
    path = os.fspath(path)
    if reader is None:
        reader = open_gguf(path)
    file_bytes = os.path.getsize(path)
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > file_bytes or t.data.nbytes != t.n_bytes:
            raise LoaderError(f"{path}: tensor '{t.name}' needs bytes [{t.data_offset}, {t.data_offset + t.n_bytes}) "
                              f"but the file is {file_bytes} bytes: truncated")
    biases = sorted(n for n in tensors if n.endswith(".bias"))
    if biases:
        raise LoaderError(f"{path}: holds bias tensors ({', '.join(biases[:3])}{', ...' if len(biases) > 3 else ''}); "
                          f"the engine implements no q/k/v biases (Qwen2 has them), so this model cannot run")

    config = config_from_metadata(reader, path, set(tensors))
    permuted = ARCHITECTURES[_field(reader, "general.architecture")][1]
    shapes = config.tensor_shapes()
    used: set[str] = set()
    for name, shape in shapes.items():
        gguf_name, expert, _ = gguf_source(name)
        t = tensors.get(gguf_name)
        # numpy order: the GGUF shape reversed; a stacked expert tensor has the experts first.
        expected = tuple(shape) if expert is None else (config.num_experts, *shape)
        if t is None:
            raise LoaderError(f"{path}: tensor '{gguf_name}' (for '{name}', expected shape "
                              f"{_gguf_shape(expected)}) is missing")
        actual = tuple(int(d) for d in reversed(t.shape.tolist()))
        if actual != expected:
            raise LoaderError(f"{path}: tensor '{gguf_name}' has shape {_gguf_shape(actual)}, expected "
                              f"{_gguf_shape(expected)} from the metadata (for '{name}')")
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise LoaderError(f"{path}: tensor '{gguf_name}' has type {t.tensor_type.name}, not supported; "
                              f"supported: {', '.join(SUPPORTED_TYPES)}")
        used.add(gguf_name)
    total = sum(int(np.prod(s)) * (4 if len(s) == 1 else 2) for s in shapes.values())
    return LoadedModel(
        config=config,
        tensors=GGUFTensors(config, tensors, permuted),
        files=[path],
        total_bytes=total,
        ignored=sorted(set(tensors) - used - {ROPE_FREQS}),
        path=path,
    )


# ---- writing --------------------------------------------------------------------------------

def write_gguf(config: ModelConfig, tensors: Mapping[str, np.ndarray], path: str | os.PathLike,
               types: str | Mapping[str, str] = "F32",
               quantize: Callable[[np.ndarray, object], np.ndarray] | None = None,
               vocab: Sequence[str] | None = None) -> str:
    """Write a model as a GGUF file (metadata from config, tensors by HF name).

    ``types``: the GGML type name of every matrix (e.g. "Q8_0"), or a mapping HF name -> type
    name (unlisted matrices F32; a layer's stacked experts take expert 0's type). 1-D norms are
    always F32, as llama.cpp's converter writes them. ``quantize(values_f32, qtype) -> blocks``
    defaults to ``gguf.quants.quantize``, which has no K-quant quantizer: tests pass one that
    makes K-quant blocks. ``vocab``: token strings written as a gpt2-type tokenizer with no
    real merges, for readers that load no model without a vocabulary (llama.cpp) when the ids
    are given directly. Written to a temporary name and renamed when complete."""
    import gguf
    from gguf.quants import quantize as gguf_quantize
    quantize = quantize or gguf_quantize
    path = os.fspath(path)
    arch = GGUF_ARCHITECTURE[config.architecture]
    permuted = ARCHITECTURES[arch][1]

    def type_of(hf_name: str) -> gguf.GGMLQuantizationType:
        name = types if isinstance(types, str) else types.get(hf_name, "F32")
        try:
            return gguf.GGMLQuantizationType[name]
        except KeyError:
            raise ValueError(f"tensor '{hf_name}': unknown GGML type {name!r}") from None

    tmp_path = f"{path}.tmp-{os.getpid()}"
    writer = gguf.GGUFWriter(tmp_path, arch)
    try:
        writer.add_block_count(config.num_hidden_layers)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        if config.intermediate_size:
            writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_rope_freq_base(config.rope_theta)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_vocab_size(config.vocab_size)
        if config.rope_linear_factor != 1.0:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(config.rope_linear_factor)
        factors = rope_frequency_factors(config)
        if factors is not None:
            writer.add_tensor(ROPE_FREQS, factors.astype(np.float32))
        if config.is_moe:
            writer.add_expert_count(config.num_experts)
            writer.add_expert_used_count(config.num_experts_per_tok)
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
            writer.add_expert_weights_norm(config.norm_topk_prob)
        if vocab is not None:
            if len(vocab) != config.vocab_size:
                raise ValueError(f"vocab: {len(vocab)} tokens, the config's vocab_size is {config.vocab_size}")
            writer.add_tokenizer_model("gpt2")
            writer.add_token_list(list(vocab))
            writer.add_token_types([gguf.TokenType.NORMAL] * len(vocab))
            writer.add_token_merges([f"{vocab[0]} {vocab[1]}"])
        if config.bos_token_id is not None:
            writer.add_bos_token_id(config.bos_token_id)
        if config.eos_token_ids:
            writer.add_eos_token_id(config.eos_token_ids[0])

        stacks: dict[str, list[str]] = {}   # GGUF name -> HF names (one, or one per expert)
        for hf_name in config.tensor_shapes():
            stacks.setdefault(gguf_source(hf_name)[0], []).append(hf_name)
        for gguf_name, hf_names in stacks.items():
            key = gguf_source(hf_names[0])[2]
            values = np.stack([np.asarray(tensors[n], dtype=np.float32) for n in hf_names]) \
                if key in EXPERT_TENSORS else np.asarray(tensors[hf_names[0]], dtype=np.float32)
            if permuted and key in PERMUTED_TENSORS:
                values = permute_rows(values, getattr(config, PERMUTED_TENSORS[key]))
            qtype = gguf.GGMLQuantizationType.F32 if values.ndim == 1 else type_of(hf_names[0])
            if qtype == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(gguf_name, np.ascontiguousarray(values))
            elif qtype == gguf.GGMLQuantizationType.F16:
                writer.add_tensor(gguf_name, values.astype(np.float16))
            else:
                try:
                    blocks = quantize(np.ascontiguousarray(values), qtype)
                except NotImplementedError:
                    raise ValueError(f"tensor '{gguf_name}': gguf.quants has no quantizer for {qtype.name}") from None
                except gguf.QuantError as e:  # rows not a multiple of the block size
                    raise ValueError(f"tensor '{gguf_name}' {list(values.shape)}: {e}") from None
                writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)  # element shape from the block bytes' shape
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp_path, path)
    except BaseException:
        writer.close()
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise
    return path
