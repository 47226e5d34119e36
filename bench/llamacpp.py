"""The llama.cpp peer for `onegraph bench --peers llama.cpp`: llama-cpp-python built with CUDA.

It decodes the same prompt greedily at batch 1 with every layer on the GPU and flash attention,
the way a llama.cpp user runs a small model: each step evaluates one token, then takes the last
position's logits to the host (``llama_get_logits_ith(ctx, -1)``, which waits for the GPU) and
the argmax there. The clock is read after the logits are on the host.

The weights: a model given as a GGUF file (``--model X.gguf``) is decoded from that very file
(llama.cpp runs its own kernels for its quantized types); a synthetic preset is first written
as a BF16 GGUF (onegraph.gguf_model.write_gguf) with a placeholder vocabulary, since llama.cpp
loads no model without one; the prompt is given as token ids, so the vocabulary is never used.
"""
from __future__ import annotations

import ctypes
import os
import tempfile
import time

import numpy as np

PEER = "llama.cpp"


def unavailable() -> str | None:
    """Why the llama.cpp peer cannot run here, or None when it can."""
    try:
        import gguf  # noqa: F401  (writes a preset's weights as the GGUF llama.cpp loads)
    except ImportError as e:
        return f"the gguf package is not installed ({e})"
    try:
        import llama_cpp
    except ImportError as e:
        return f"llama-cpp-python is not installed ({e})"
    except (OSError, RuntimeError) as e:  # its shared libraries did not load (no CUDA driver)
        return f"llama-cpp-python did not load: {e}"
    if not llama_cpp.llama_supports_gpu_offload():
        return "llama-cpp-python was built without GPU offload"
    return None


def placeholder_vocab(n: int) -> list[str]:
    """n distinct token strings for a GGUF whose prompts arrive as ids."""
    return [f"<t{i}>" for i in range(n)]


def gguf_for(config, tensor_source, model_path: str | None, workdir: str) -> str:
    """The GGUF file llama.cpp decodes: the model's own file, or the preset written as BF16."""
    if model_path and str(model_path).endswith(".gguf"):
        return str(model_path)
    from onegraph.gguf_model import write_gguf
    path = os.path.join(workdir, "peer-bf16.gguf")
    return write_gguf(config, dict(tensor_source()), path, types="BF16",
                      vocab=placeholder_vocab(config.vocab_size))


def _decode(llm, llama_cpp, prompt: list[int], n: int) -> dict:
    """One greedy run from an empty cache: the prompt in one batch, then n one-token steps."""
    ctx = llm.ctx
    n_vocab = llm.n_vocab()

    def greedy() -> int:
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                                   shape=(n_vocab,))))

    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    tokens = [greedy()]
    ttft_ms = (time.perf_counter() - t0) * 1e3
    step_ms = []
    for _ in range(n):
        t0 = time.perf_counter()
        llm.eval([tokens[-1]])
        tokens.append(greedy())
        step_ms.append((time.perf_counter() - t0) * 1e3)
    return {"ttft_ms": ttft_ms, "step_ms": step_ms, "tokens": tokens}


def run_peer(config, tensor_source, *, prompt: list[int], n: int, repeats: int,
             model_path: str | None = None) -> dict:
    """A warm-up run (excluded from timing), then `repeats` timed runs, in peers.run_peer's
    record shape."""
    reason = unavailable()
    if reason:
        return {"runtime": PEER, "status": "skipped", "reason": reason}
    import llama_cpp
    with tempfile.TemporaryDirectory(prefix="onegraph-llamacpp-") as workdir:
        t0 = time.perf_counter()
        path = gguf_for(config, tensor_source, model_path, workdir)
        llm = llama_cpp.Llama(model_path=path, n_gpu_layers=-1, n_ctx=len(prompt) + n + 8,
                              n_batch=max(len(prompt), 8), flash_attn=True, logits_all=False,
                              verbose=False)
        load_s = time.perf_counter() - t0
        try:
            t0 = time.perf_counter()
            _decode(llm, llama_cpp, prompt, n)
            warmup_s = time.perf_counter() - t0
            runs = [_decode(llm, llama_cpp, prompt, n) for _ in range(repeats)]
        finally:
            llm.close()
    details = {"llama_cpp_python": llama_cpp.__version__, "gguf": os.path.basename(path),
               "n_gpu_layers": "all", "flash_attn": True,
               "argmax": "host, logits copied out (llama_get_logits_ith)"}
    return {"runtime": PEER, "status": "ok", "reason": None, "load_s": load_s, "warmup_s": warmup_s,
            "runs": runs, "device_bytes": None, "details": details}
