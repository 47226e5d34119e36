"""Model configuration: one dataclass read from a Hugging Face ``config.json``.

Field names are Hugging Face's own keys, so a reader can hold this file next to a
checkpoint's config and see the same words. Everything the runtime cannot execute
faithfully is rejected here, with the key and the value in the message, before any
weights are read.

The table of tensors a model needs (``tensor_shapes``) lives here too: it is the single
source of truth used by the loader, the synthetic-model writer, the reference decoder
and the GPU upload.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM")
_MODEL_TYPES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "LlamaForCausalLM": "llama"}
# A config.json without 'architectures' (transformers writes none when a bare config is saved)
# names its family by model_type alone.
MODEL_TYPE_ARCHITECTURES = {model_type: arch for arch, model_type in _MODEL_TYPES.items()}
# rope_scaling kinds the reference and the CUDA body implement. "freq_factors" is not a Hugging
# Face kind: it is how a GGUF's rope_freqs tensor reads (llama.cpp's converter writes Llama 3.x's
# "llama3" scaling as those per-frequency divisors), {"rope_type": "freq_factors", "factors":
# [head_dim / 2 numbers]}.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
SUPPORTED_HIDDEN_ACTS = ("silu",)
GENERATION_CONFIG = "generation_config.json"


class ConfigError(ValueError):
    """A config.json the runtime cannot run; the message names the key and the value."""


def read_json_file(path: str, error: type[Exception]) -> Any:
    """The JSON document in `path`; a malformed or non-UTF-8 file raises `error` naming the file
    and the place (config.json, model.safetensors.index.json)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise error(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason})") from None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    # Mixture of experts (Qwen3-MoE); num_experts == 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = field(default_factory=tuple)
    source: str = ""  # where the config was read from, for messages

    # ---- derived facts -------------------------------------------------------------
    @property
    def model_type(self) -> str:
        return _MODEL_TYPES[self.architecture]

    @property
    def has_qk_norm(self) -> bool:
        """Qwen3 normalizes each query and key head (RMSNorm over head_dim); Llama does not."""
        return self.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Hugging Face's rule (Qwen3MoeDecoderLayer): sparse unless listed in
        mlp_only_layers, and only every decoder_sparse_step-th layer."""
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rope_linear_factor(self) -> float:
        """Positions are divided by this factor ('linear' rope_scaling); 1.0 otherwise."""
        if self.rope_scaling and _rope_type(self.rope_scaling) == "linear":
            return float(self.rope_scaling["factor"])
        return 1.0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence ids, duplicates dropped, in order: config.json's eos_token_id,
        then (from_file) generation_config.json's. Engine.generate's default stop tokens."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(dict.fromkeys(int(t) for t in self.eos_token_id))

    # ---- the tensor table ----------------------------------------------------------
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model needs, by Hugging Face name, with its shape.

        Shapes follow torch.nn.Linear: weight [out_features, in_features].
        """
        H, V = self.hidden_size, self.vocab_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (H,)
            shapes[p + "self_attn.q_proj.weight"] = (self.q_size, H)
            shapes[p + "self_attn.k_proj.weight"] = (self.kv_size, H)
            shapes[p + "self_attn.v_proj.weight"] = (self.kv_size, H)
            shapes[p + "self_attn.o_proj.weight"] = (H, self.q_size)
            if self.has_qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (self.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (self.head_dim,)
            shapes[p + "post_attention_layernorm.weight"] = (H,)
            if self.is_moe_layer(layer):
                E, I = self.num_experts, self.moe_intermediate_size
                shapes[p + "mlp.gate.weight"] = (E, H)
                for e in range(E):
                    q = f"{p}mlp.experts.{e}."
                    shapes[q + "gate_proj.weight"] = (I, H)
                    shapes[q + "up_proj.weight"] = (I, H)
                    shapes[q + "down_proj.weight"] = (H, I)
            else:
                I = self.intermediate_size
                shapes[p + "mlp.gate_proj.weight"] = (I, H)
                shapes[p + "mlp.up_proj.weight"] = (I, H)
                shapes[p + "mlp.down_proj.weight"] = (H, I)
        shapes["model.norm.weight"] = (H,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (V, H)
        return shapes

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json this dataclass stands for (what synth writes)."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
        }
        for f in fields(self):
            if f.name in ("architecture", "source"):
                continue
            v = getattr(self, f.name)
            if f.name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers") and not self.is_moe:
                continue
            d[f.name] = list(v) if isinstance(v, tuple) else v
        return d

    # ---- reading -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<dict>") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        raw = _classic_keys(raw, source)
        arch = _architecture(raw, source)

        def need(key: str, kind=int):
            if key not in raw:
                raise ConfigError(f"{source}: required key '{key}' is missing")
            return _typed(source, key, raw[key], kind)

        def opt(key: str, default, kind):
            v = raw.get(key, default)
            return default if v is None and default is None else _typed(source, key, v, kind)

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        head_dim = opt("head_dim", None, int)
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(f"{source}: head_dim is absent and hidden_size={hidden} is not divisible by num_attention_heads={heads}")
            head_dim = hidden // heads
        is_moe_arch = arch == "Qwen3MoeForCausalLM"
        kwargs = dict(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=opt("intermediate_size", 0, int) if is_moe_arch else need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=opt("num_key_value_heads", heads, int),
            head_dim=head_dim,
            rms_norm_eps=opt("rms_norm_eps", 1e-6, float),
            rope_theta=opt("rope_theta", 10000.0 if arch == "LlamaForCausalLM" else 1_000_000.0, float),
            rope_scaling=_canonical_rope_scaling(raw.get("rope_scaling")),
            max_position_embeddings=opt("max_position_embeddings", 40960, int),
            tie_word_embeddings=opt("tie_word_embeddings", False, bool),
            hidden_act=raw.get("hidden_act", "silu"),
            attention_bias=opt("attention_bias", False, bool),
            torch_dtype=_dtype(raw, source),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            source=source,
        )
        if is_moe_arch:
            mlp_only = raw.get("mlp_only_layers") or []
            if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
                raise ConfigError(f"{source}: mlp_only_layers={mlp_only!r} must be a list of layer indices")
            kwargs.update(
                num_experts=need("num_experts"),
                num_experts_per_tok=need("num_experts_per_tok"),
                moe_intermediate_size=need("moe_intermediate_size"),
                norm_topk_prob=opt("norm_topk_prob", False, bool),
                decoder_sparse_step=opt("decoder_sparse_step", 1, int),
                mlp_only_layers=tuple(mlp_only),
            )
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str) -> "ModelConfig":
        """config.json (or a folder's), with the eos_token_id of a generation_config.json beside
        it added to its own: generation stops at any of them, as transformers' generate does."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: config file not found")
        cfg = cls.from_dict(read_json_file(path, ConfigError), source=path)
        generation = os.path.join(os.path.dirname(path), GENERATION_CONFIG)
        if os.path.isfile(generation):
            cfg = cfg.with_eos_token_ids(_generation_eos_token_ids(generation, cfg.vocab_size))
        return cfg

    def with_eos_token_ids(self, extra: tuple[int, ...]) -> "ModelConfig":
        """eos_token_id = its own ids, then those of `extra` not among them (in order)."""
        merged = list(dict.fromkeys([*self.eos_token_ids, *extra]))
        if merged == list(self.eos_token_ids):
            return self
        return self.replace(eos_token_id=merged[0] if len(merged) == 1 else merged)

    def replace(self, **changes) -> "ModelConfig":
        from dataclasses import replace
        cfg = replace(self, **changes)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        src = self.source or "config"

        def bad(key, value, why):
            raise ConfigError(f"{src}: {key}={value!r} {why}")

        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim"):
            v = getattr(self, key)
            if v <= 0:
                bad(key, v, "must be a positive integer")
        if not self.is_moe and self.intermediate_size <= 0:
            bad("intermediate_size", self.intermediate_size, "must be a positive integer")
        if self.is_moe and any(not self.is_moe_layer(l) for l in range(self.num_hidden_layers)) \
                and self.intermediate_size <= 0:
            bad("intermediate_size", self.intermediate_size, "must be positive: some layers are dense (mlp_only_layers / decoder_sparse_step)")
        if self.num_attention_heads % self.num_key_value_heads:
            bad("num_key_value_heads", self.num_key_value_heads,
                f"must divide num_attention_heads={self.num_attention_heads} (grouped-query attention)")
        if self.head_dim % 2:
            bad("head_dim", self.head_dim, "must be even (rotary embedding rotates pairs)")
        if self.architecture == "LlamaForCausalLM" and self.head_dim * self.num_attention_heads != self.hidden_size:
            bad("head_dim", self.head_dim,
                f"× num_attention_heads={self.num_attention_heads} must equal hidden_size={self.hidden_size} for Llama")
        if not (self.rms_norm_eps > 0):
            bad("rms_norm_eps", self.rms_norm_eps, "must be positive")
        if not (self.rope_theta > 0):
            bad("rope_theta", self.rope_theta, "must be positive")
        if self.attention_bias:
            bad("attention_bias", self.attention_bias, "is not supported (q/k/v/o projections without bias only)")
        if self.hidden_act not in SUPPORTED_HIDDEN_ACTS:
            bad("hidden_act", self.hidden_act, f"is not supported; supported: {SUPPORTED_HIDDEN_ACTS}")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                bad("rope_scaling", self.rope_scaling, "must be an object or null")
            kind = _rope_type(self.rope_scaling)
            if kind not in SUPPORTED_ROPE_TYPES:
                bad("rope_scaling", self.rope_scaling,
                    f"has rope_type '{kind}', which is not implemented; supported: {SUPPORTED_ROPE_TYPES}")
            if kind == "linear":
                factor = self.rope_scaling.get("factor")
                if not isinstance(factor, (int, float)) or factor <= 0:
                    bad("rope_scaling", self.rope_scaling, "needs a positive 'factor' for linear scaling")
            if kind == "llama3":
                for key in LLAMA3_ROPE_KEYS:
                    v = self.rope_scaling.get(key)
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                        bad("rope_scaling", self.rope_scaling, f"needs a positive '{key}' for llama3 scaling")
                if not self.rope_scaling["high_freq_factor"] > self.rope_scaling["low_freq_factor"]:
                    bad("rope_scaling", self.rope_scaling,
                        "needs high_freq_factor > low_freq_factor for llama3 scaling")
            if kind == "freq_factors":
                factors = self.rope_scaling.get("factors")
                if (not isinstance(factors, list) or len(factors) != self.head_dim // 2
                        or not all(isinstance(f, (int, float)) and not isinstance(f, bool)
                                   and 0 < f < float("inf") for f in factors)):
                    got = f"{len(factors)} values" if isinstance(factors, list) else repr(factors)
                    raise ConfigError(f"{src}: rope_scaling 'freq_factors' has factors={got}; needs "
                                      f"{self.head_dim // 2} positive finite numbers (head_dim / 2)")
        if self.is_moe:
            if self.num_experts_per_tok <= 0:
                bad("num_experts_per_tok", self.num_experts_per_tok, "must be a positive integer")
            if self.num_experts_per_tok > self.num_experts:
                bad("num_experts_per_tok", self.num_experts_per_tok,
                    f"exceeds num_experts={self.num_experts}")
            if self.moe_intermediate_size <= 0:
                bad("moe_intermediate_size", self.moe_intermediate_size, "must be a positive integer")
            if self.decoder_sparse_step <= 0:
                bad("decoder_sparse_step", self.decoder_sparse_step, "must be a positive integer")
            for layer in self.mlp_only_layers:
                if not 0 <= layer < self.num_hidden_layers:
                    bad("mlp_only_layers", list(self.mlp_only_layers),
                        f"names layer {layer}, outside 0..{self.num_hidden_layers - 1}")
        for t in self.eos_token_ids:
            if not 0 <= t < self.vocab_size:
                bad("eos_token_id", self.eos_token_id, f"is outside the vocabulary 0..{self.vocab_size - 1}")


def _architecture(raw: dict, source: str) -> str:
    """architectures[0], or the architecture model_type names when 'architectures' is absent;
    a model_type of another supported family than architectures[0] is refused."""
    archs = raw.get("architectures")
    model_type = raw.get("model_type")
    if archs is None or archs == []:
        arch = MODEL_TYPE_ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
        if arch is None:
            raise ConfigError(
                f"{source}: architectures={archs!r} and model_type={model_type!r} name no supported model; "
                f"supported: architectures {', '.join(SUPPORTED_ARCHITECTURES)} or model_type "
                f"{', '.join(MODEL_TYPE_ARCHITECTURES)}")
        return arch
    if not isinstance(archs, list):
        raise ConfigError(f"{source}: architectures={archs!r} must be a list of class names")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{source}: architectures={archs!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if model_type in MODEL_TYPE_ARCHITECTURES and MODEL_TYPE_ARCHITECTURES[model_type] != arch:
        raise ConfigError(f"{source}: architectures={archs!r} disagrees with model_type={model_type!r} "
                          f"(which means {MODEL_TYPE_ARCHITECTURES[model_type]})")
    return arch


def _dtype(raw: dict, source: str) -> str:
    """The weights' dtype: 'torch_dtype' (transformers < 5) or 'dtype' (transformers >= 5)."""
    classic, v5 = raw.get("torch_dtype"), raw.get("dtype")
    if classic is not None and v5 is not None and classic != v5:
        raise ConfigError(f"{source}: torch_dtype={classic!r} disagrees with dtype={v5!r}")
    return classic or v5 or "bfloat16"


def _canonical_rope_scaling(rope_scaling):
    """rope_scaling as {"rope_type": kind, **parameters}, None for the default rotary embedding,
    so that the old 'type' key, an explicit default and transformers 5's rope_parameters all
    give one ModelConfig. Anything but an object is left for validate() to refuse."""
    if not isinstance(rope_scaling, dict):
        return rope_scaling
    kind = _rope_type(rope_scaling)
    rest = {k: v for k, v in rope_scaling.items() if k not in ("type", "rope_type", "rope_theta")}
    if kind == "default" and not rest:
        return None
    return {"rope_type": kind, **rest}


def _classic_keys(raw: dict, source: str) -> dict:
    """transformers >= 5 saves num_experts as 'num_local_experts' and rope_theta/rope_scaling
    inside one 'rope_parameters' object; read them as the classic keys. A config holding both
    spellings must say the same thing in each (ConfigError naming both otherwise)."""
    if "num_local_experts" not in raw and "rope_parameters" not in raw:
        return raw
    raw = dict(raw)
    if "num_local_experts" in raw:
        local, classic = raw["num_local_experts"], raw.get("num_experts")
        if classic is not None and classic != local:
            raise ConfigError(f"{source}: num_experts={classic!r} disagrees with num_local_experts={local!r}")
        raw["num_experts"] = local
    rope = raw.get("rope_parameters")
    if rope is not None:
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: rope_parameters={rope!r} must be an object")
        if "rope_theta" in rope:
            theta = raw.get("rope_theta")
            if theta is not None and theta != rope["rope_theta"]:
                raise ConfigError(f"{source}: rope_theta={theta!r} disagrees with rope_parameters={rope!r}")
            raw["rope_theta"] = rope["rope_theta"]
        scaling = _canonical_rope_scaling(rope)
        classic = raw.get("rope_scaling")
        if classic is not None and _canonical_rope_scaling(classic) != scaling:
            raise ConfigError(f"{source}: rope_scaling={classic!r} disagrees with rope_parameters={rope!r}")
        raw["rope_scaling"] = scaling
    return raw


def _generation_eos_token_ids(path: str, vocab_size: int) -> tuple[int, ...]:
    """The eos_token_id (an id or a list of ids) of a generation_config.json; () when absent."""
    raw = read_json_file(path, ConfigError)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    eos = raw.get("eos_token_id")
    ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ConfigError(f"{path}: eos_token_id={eos!r} must be a token id or a list of token ids")
    for t in ids:
        if not 0 <= t < vocab_size:
            raise ConfigError(f"{path}: eos_token_id={eos!r} is outside the vocabulary 0..{vocab_size - 1}")
    return tuple(ids)


def _rope_type(rope_scaling: dict) -> str:
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def _typed(source: str, key: str, value, kind):
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {key}={value!r} must be true or false")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {key}={value!r} must be an integer")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: {key}={value!r} must be a number")
        return float(value)
    return value
