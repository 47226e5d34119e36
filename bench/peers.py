"""Hugging Face transformers peers for `onegraph bench`, on the very weights the engine runs.

Both peers decode greedily at batch 1 with bf16 weights, bf16 compute and a bf16 KV cache,
the same prompt and the same number of tokens as the engine, in a hand loop that times
every step (torch.cuda.synchronize before the clock is read):

- ``hf-eager``: PyTorch eager, a DynamicCache (use_cache). The prompt is one forward.
- ``hf-compile``: a StaticCache and ``torch.compile(mode="reduce-overhead")``, i.e. the
  one-token step replayed as CUDA graphs (cudagraph trees); every step starts with
  ``torch.compiler.cudagraph_mark_step_begin()``. The prompt runs eagerly into the same
  static cache (the compiled step has the one-token shape only). Compilation and graph
  recording happen in a warm-up run that is excluded from the timing; its time is
  reported as ``warmup_s``.

Weights: the model is built from the config on the device, then every parameter is
overwritten from the same (name, array) stream the engine uploads (synthetic presets are
never written to disk: the 30B-A3B shape is 61 GB). transformers 5 stores a layer's experts
fused ([E, 2I, H] gate|up and [E, H, I] down); the per-expert names map into slices of
those. Loading fails unless every parameter was written in full.

The third peer, ``llama.cpp`` (llama-cpp-python built with CUDA), lives in bench/llamacpp.py;
run_peer hands it over. The benchmark imports these modules only when --peers asks for them;
the runtime never does.
"""
from __future__ import annotations

import inspect
import re
import time
import warnings

import numpy as np

PEERS = ("hf-eager", "hf-compile", "llama.cpp")
WARMUP_STEPS = 4  # cudagraph trees: a warm-up call, a recording call, then replays
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def unavailable(peer: str, device: str = "cuda") -> str | None:
    """Why `peer` cannot run here, or None when it can."""
    if peer not in PEERS:
        return f"unknown peer {peer!r}; peers: {', '.join(PEERS)}"
    if peer == "llama.cpp":
        from bench import llamacpp
        return llamacpp.unavailable() if device == "cuda" else "the llama.cpp peer runs on the GPU only"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed"
    if device == "cuda" and not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if peer == "hf-compile" and not hasattr(torch.compiler, "cudagraph_mark_step_begin"):
        return f"torch {torch.__version__} has no torch.compiler.cudagraph_mark_step_begin"
    return None


# ---- the model ------------------------------------------------------------------------

def build_model(config, tensors, *, device: str = "cuda", dtype: str = "bfloat16"):
    """A transformers model of `config` on `device` holding exactly the arrays of `tensors`
    (an iterable of (HF name, numpy array) pairs)."""
    import torch
    import transformers
    model_class = getattr(transformers, config.architecture, None)
    if model_class is None:
        raise RuntimeError(f"transformers {transformers.__version__} has no {config.architecture}")
    hf_config = model_class.config_class.from_dict(config.to_hf_dict())
    with torch.device(device):
        model = model_class._from_config(hf_config, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    load_weights(model, tensors)
    return model.eval()


def load_weights(model, tensors) -> None:
    """Copy (name, array) pairs into the parameters; every element must be written once."""
    import torch
    params = dict(model.named_parameters())
    written = {name: 0 for name in params}
    with torch.no_grad():
        for name, array in tensors:
            target, index = _destination(params, name)
            source = _as_torch(array)
            view = params[target][index]
            if tuple(view.shape) != tuple(source.shape):
                raise ValueError(f"tensor '{name}': shape {tuple(source.shape)} does not fit "
                                 f"'{target}'{list(index) if index else ''} of shape {tuple(view.shape)}")
            view.copy_(source)
            written[target] += source.numel()
    for name, count in written.items():
        if count != params[name].numel():
            raise ValueError(f"parameter '{name}': {count} of {params[name].numel()} elements written; "
                             f"the weight stream does not cover this model")


def _destination(params: dict, name: str) -> tuple[str, tuple]:
    """(parameter name, index) that HF name `name` fills."""
    if name in params:
        return name, ()
    m = _EXPERT.match(name)
    if m is None:
        raise KeyError(f"tensor '{name}' has no parameter in the transformers model")
    experts, e, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj == "down":
        return f"{experts}.down_proj", (e,)
    fused = params[f"{experts}.gate_up_proj"]  # [E, 2I, H]: gate rows first, then up
    half = fused.shape[1] // 2
    return f"{experts}.gate_up_proj", (e, slice(0, half) if proj == "gate" else slice(half, 2 * half))


def _as_torch(array: np.ndarray):
    import torch
    array = np.ascontiguousarray(array)
    with warnings.catch_warnings():  # memory-mapped arrays are read-only; we only read them
        warnings.simplefilter("ignore", UserWarning)
        if array.dtype.name == "bfloat16":
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)


# ---- the decode loops -------------------------------------------------------------------

def _cache_keyword(model) -> str:
    """transformers renamed the forward argument past_key_values to cache (5.2x)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _synchronize(device: str):
    import torch
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def _timed_decode(prefill, step, prompt_ids, n: int, sync) -> dict:
    """Prompt in one forward (TTFT), then n one-token steps, each timed on the host after
    a device synchronize. Tokens: the prompt's next token and one per step (n + 1)."""
    sync()
    t0 = time.perf_counter()
    token = prefill(prompt_ids)
    tokens = [int(token)]
    sync()
    ttft_ms = (time.perf_counter() - t0) * 1e3
    step_ms = []
    for _ in range(n):
        t = time.perf_counter()
        token = step(token)
        tokens.append(int(token))
        sync()
        step_ms.append((time.perf_counter() - t) * 1e3)
    return {"ttft_ms": ttft_ms, "step_ms": step_ms, "tokens": tokens}


def _greedy(logits):
    return logits[:, -1:].argmax(-1)  # [1, 1] token id, still on the device


def _eager_loop(model, cache_kw: str):
    from transformers import DynamicCache
    state = {}

    def prefill(ids):
        state["cache"] = DynamicCache(config=model.config)
        return step(ids)

    def step(ids):
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kw: state["cache"]})
        return _greedy(out.logits)

    return prefill, step


def _compiled_loop(model, cache_kw: str, max_cache_len: int, fullgraph: bool):
    import torch
    from transformers import StaticCache
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)

    def forward(ids):
        return model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kw: cache}).logits

    compiled = torch.compile(forward, mode="reduce-overhead", fullgraph=fullgraph)

    def prefill(ids):
        cache.reset()
        return _greedy(forward(ids))  # eager: the prompt's shape is not the step's

    def step(ids):
        torch.compiler.cudagraph_mark_step_begin()
        return _greedy(compiled(ids))  # argmax copies out of the graph's output buffer

    return prefill, step


def _warm_up(peer: str, model, ids, n: int, sync, details: dict):
    """Build the peer's (prefill, step) loop and run it once untimed: compilation and CUDA
    graph recording happen here. Returns (loop, seconds)."""
    import torch
    cache_kw = _cache_keyword(model)
    steps = max(n, WARMUP_STEPS)
    t0 = time.perf_counter()
    if peer == "hf-eager":
        loop = _eager_loop(model, cache_kw)
        _timed_decode(*loop, ids, steps, sync)
        return loop, time.perf_counter() - t0
    max_cache_len = ids.shape[1] + steps
    try:  # one graph for the whole step if dynamo can trace it without a break
        loop = _compiled_loop(model, cache_kw, max_cache_len, fullgraph=True)
        _timed_decode(*loop, ids, steps, sync)
        details["fullgraph"] = True
    except Exception as e:  # a graph break: compile again allowing breaks (CUDA graphs per piece)
        torch._dynamo.reset()
        details["fullgraph"] = False
        details["fullgraph_error"] = (str(e).splitlines() or [type(e).__name__])[0][:300]
        loop = _compiled_loop(model, cache_kw, max_cache_len, fullgraph=False)
        _timed_decode(*loop, ids, steps, sync)
    return loop, time.perf_counter() - t0


def run_peer(peer: str, config, tensor_source, *, prompt: list[int], n: int, repeats: int,
             device: str = "cuda", dtype: str = "bfloat16", model_path: str | None = None) -> dict:
    """A warm-up run (excluded from timing, its time is warmup_s), then `repeats` timed runs.
    Returns {"runtime", "status", "reason", "load_s", "warmup_s", "runs", "device_bytes",
    "details"}; each run is {"ttft_ms", "step_ms" [n], "tokens" [n + 1]}. model_path: the
    model's own file, which the llama.cpp peer decodes when it is a GGUF."""
    reason = unavailable(peer, device)
    if reason:
        return {"runtime": peer, "status": "skipped", "reason": reason}
    if peer == "llama.cpp":
        from bench import llamacpp
        return llamacpp.run_peer(config, tensor_source, prompt=prompt, n=n, repeats=repeats,
                                 model_path=model_path)
    import torch
    import transformers
    sync = _synchronize(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = build_model(config, tensor_source(), device=device, dtype=dtype)
    load_s = time.perf_counter() - t0
    details = {"torch": torch.__version__, "transformers": transformers.__version__, "dtype": dtype,
               "device": device, "prompt": "one forward",
               "attn_implementation": getattr(model.config, "_attn_implementation", None),
               "experts_implementation": getattr(model.config, "_experts_implementation", None)}
    ids = torch.tensor([prompt], device=device)
    loop = None
    try:
        with torch.no_grad():
            loop, warmup_s = _warm_up(peer, model, ids, n, sync, details)
            runs = [_timed_decode(*loop, ids, n, sync) for _ in range(repeats)]
        device_bytes = torch.cuda.max_memory_allocated() if device == "cuda" else None
    finally:
        del model, loop
        if peer == "hf-compile":
            torch._dynamo.reset()  # frees the cudagraph pools before the next model
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"runtime": peer, "status": "ok", "reason": None, "load_s": load_s, "warmup_s": warmup_s,
            "runs": runs, "device_bytes": device_bytes, "details": details}
