"""Shared by the tests: building the library, skipping cleanly unless it is built and a device
is usable, synthetic models, greedy decoding."""
import importlib.util
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_build_module():
    """build.py as a module (a script at the repository root, not part of the package)."""
    spec = importlib.util.spec_from_file_location("onegraph_build", ROOT / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_library_or_skip():
    """Build the testing library (incremental) unless $ONEGRAPH_LIB names another library;
    skip without nvcc. Returns the built library's path, or None when $ONEGRAPH_LIB is used."""
    from capi_testing import TESTING_LIBRARY
    named = os.environ.get("ONEGRAPH_LIB")
    if named and os.path.abspath(named) != os.path.abspath(TESTING_LIBRARY):
        return None
    build = load_build_module()
    if build.find_nvcc() is None:
        pytest.skip("nvcc not found: the CUDA library cannot be built on this machine")
    return build.build_library(testing=True)


def gpu_required() -> bool:
    """$ONEGRAPH_REQUIRE_GPU=1 (scripts/gpu_check.sh): a GPU test that cannot reach a device
    fails instead of skipping, so a run on a GPU machine cannot pass by skipping everything."""
    return os.environ.get("ONEGRAPH_REQUIRE_GPU") == "1"


def skip_or_fail(reason: str):
    """pytest.skip(reason), or pytest.fail(reason) under $ONEGRAPH_REQUIRE_GPU=1."""
    if gpu_required():
        pytest.fail(f"{reason} (ONEGRAPH_REQUIRE_GPU=1)")
    pytest.skip(reason)


def require_gpu():
    from onegraph.engine import library_status
    usable, reason = library_status()
    if not usable:
        skip_or_fail(f"GPU path unusable: {reason}")


def synthetic(preset, layers=None, seed=0):
    """(config, tensors dict) of a synthetic preset, generated in memory."""
    from onegraph.synth import iter_tensors, preset_config
    config = preset_config(preset, num_hidden_layers=layers)
    return config, dict(iter_tensors(config, seed=seed))


# The position where the engine's long attention band starts, read at og_init (onegraph.h,
# og_step_bands): tests set it low so that a short decode crosses it. FOLD_ENV picks the long
# band's fold ("tensor": the tensor cores wherever that fold is compiled).
LONG_FROM_ENV = "ONEGRAPH_ATTENTION_LONG_FROM"
FOLD_ENV = "ONEGRAPH_ATTENTION_FOLD"


# A model whose attention can fold on the tensor cores in the long band: 128-dim heads, int8 KV,
# 2 KV heads of `group` query heads each (4: by default on the tensor cores; 2: with FOLD_ENV
# "tensor").
def tensor_core_model(seed=0, group=4):
    """(config, tensors dict) of that model (tiny-dense's other sizes), generated in memory."""
    from onegraph.synth import iter_tensors, preset_config
    config = preset_config("tiny-dense", num_attention_heads=2 * group, num_key_value_heads=2, head_dim=128)
    return config, dict(iter_tensors(config, seed=seed))


def float16_checkpoint(config, tensors):
    """(float16 tensors, the same rounded to bf16 as the GPU stores matrices): every matrix
    carries mantissa bits bf16 cannot hold (scaled by 1 + 2^-10), so the rounding rule is
    exercised; the norm vectors are bf16 values, exact in float16 and in bf16, since the rule
    keeps vectors at full precision and a bf16 file could not hold more."""
    import ml_dtypes
    import numpy as np
    f16, bf16 = {}, {}
    for name, t in tensors.items():
        wide = t.astype(np.float32)
        if t.ndim == 2:
            wide = wide * np.float32(1 + 2 ** -10)
        f16[name] = wide.astype(np.float16)
        bf16[name] = f16[name].astype(np.float32).astype(ml_dtypes.bfloat16)
    matrices = [n for n, t in f16.items() if t.ndim == 2]
    inexact = sum(int(np.sum(f16[n].astype(np.float32) != bf16[n].astype(np.float32))) for n in matrices)
    assert inexact > 0.5 * sum(f16[n].size for n in matrices)  # most matrix values do round
    assert all(np.array_equal(f16[n].astype(np.float32), bf16[n].astype(np.float32))
               for n, t in f16.items() if t.ndim == 1)
    return f16, bf16


def rel_l2(a, b):
    import numpy as np
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def float16_folder_runs(config, tensors, root, prompt, kv: str, device: str):
    """Write the float16_checkpoint of tensors and its bf16 rounding as two model folders under
    root ("f16", "bf16") and step the prompt through each on `device`: (f16 tensors,
    [logits per prompt token] of the f16 folder, the same of the bf16 folder)."""
    from onegraph.engine import Engine
    from onegraph.synth import write_tensors
    f16, bf16 = float16_checkpoint(config, tensors)
    write_tensors(config, root / "f16", f16)
    write_tensors(config, root / "bf16", bf16)
    runs = []
    for folder in ("f16", "bf16"):
        with Engine.from_pretrained(str(root / folder), kv=kv, max_seq_len=64, device=device) as engine:
            runs.append([engine.step(t) for t in prompt])
    return f16, runs[0], runs[1]


def assert_graph_matches_nongraph(engine, prompt, n):
    """Greedy-decode prompt + n tokens with the graph, reset, the same without: the tokens and
    every step's logits must be bit-identical."""
    import numpy as np
    engine.set_graph(True)
    g_tokens, g_logits = greedy_decode(engine.step, prompt, n)
    engine.reset()
    engine.set_graph(False)
    p_tokens, p_logits = greedy_decode(engine.step, prompt, n)
    assert g_tokens == p_tokens
    assert all(np.array_equal(a, b) for a, b in zip(g_logits, p_logits))


def greedy_decode(step, prompt, n):
    """Feed the prompt through step(token) -> logits, then n greedy tokens.
    Returns (generated tokens, the logits each was chosen from)."""
    import numpy as np
    logits = None
    for t in prompt:
        logits = step(t)
    tokens, all_logits = [], []
    for _ in range(n):
        token = int(np.argmax(logits))
        tokens.append(token)
        all_logits.append(logits)
        logits = step(token)
    return tokens, all_logits
