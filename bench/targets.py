"""What a benchmark run measures: its settings (from the command line), the models it runs
(targets: a preset's synthetic weights streamed from the generator, or a model folder / GGUF
file) and their prompts (random token ids, fixed by the seed)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from onegraph.config import ModelConfig

# ---- settings -----------------------------------------------------------------------------

@dataclass
class Settings:
    prompt: int = 32
    n: int = 64
    repeats: int = 3
    seed: int = 0
    device: str = "gpu"
    kv: list = field(default_factory=lambda: ["int8"])
    peers: list = field(default_factory=list)
    contexts: list = field(default_factory=list)
    context_steps: int = 16
    context_fill: str = "position"
    weights: list = field(default_factory=lambda: ["bf16"])  # weight formats, `engines` engines each
    engines: int = 1               # engines built per record, in rounds over the weight formats
    placement_step_mb: int = 0     # round e holds e * this many MiB of device memory (placement)
    quantize: str = "all"          # which matrices a quantized format applies to
    quantize_lm_head: bool = False

    kv_pages: list = field(default_factory=lambda: [0])  # rows per KV block; 0 default, -1 contiguous
    ttft: list = field(default_factory=list)  # prompt lengths of the TTFT comparison
    step_output: str = "next_token"  # next_token: argmax on the device; logits: on the host
    pipeline: bool = True          # also time the graph's steps pipelined (Engine.stream), next_token only
    sampling: object = None        # SamplingParams of the sampled modes (--sampling), or None

    def lm_head_fmt(self, fmt: str) -> str:
        return fmt if self.quantize_lm_head else "bf16"


CONTIGUOUS = -1  # --kv-page contiguous: one KV block holds a whole sequence


def page_spec(text: str) -> int:
    return CONTIGUOUS if text.strip() == "contiguous" else int(text)


SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed")


def sampling_record(params) -> dict | None:
    """The sampling parameters as a record's "sampling" field."""
    return None if params is None else {key: getattr(params, key) for key in SAMPLING_KEYS}


# ---- models and prompts -------------------------------------------------------------------

@dataclass
class Target:
    label: str
    config: ModelConfig
    source: Callable  # () -> iterable of (HF name, numpy array)
    origin: str       # "preset NAME" or the folder


def preset_target(spec: str, layers: int | None, seed: int) -> Target:
    """`name` or `name:layers` (e.g. qwen3-30b-a3b:24)."""
    from onegraph.synth import iter_tensors, preset_config
    name, _, own_layers = spec.partition(":")
    layers = int(own_layers) if own_layers else layers
    config = preset_config(name, num_hidden_layers=layers)
    label = name if layers is None else f"{name}/{layers}L"
    return Target(label, config, lambda: iter_tensors(config, seed=seed), f"preset {name}")


def folder_target(folder: str) -> Target:
    from onegraph.loader import load_model
    model = load_model(folder)
    names = list(model.config.tensor_shapes())
    return Target(os.path.basename(os.path.normpath(folder)), model.config,
                  lambda: ((n, model.tensors[n]) for n in names), folder)


def model_file(target: Target) -> str | None:
    """The file or folder a target was loaded from (None for a preset)."""
    return None if target.origin.startswith("preset ") else target.origin


def make_prompt(config: ModelConfig, length: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, config.vocab_size, length)]
