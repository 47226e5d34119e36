"""Shared by the GPU tests: skip cleanly unless the library is built and a device is usable."""
import pytest


def require_gpu():
    from runtime.engine import library_status
    usable, reason = library_status()
    if not usable:
        pytest.skip(f"GPU path unusable: {reason}")


def synthetic(preset, layers=None, seed=0):
    """(config, tensors dict) of a synthetic preset, generated in memory."""
    from runtime.synth import iter_tensors, preset_config
    config = preset_config(preset, num_hidden_layers=layers)
    return config, dict(iter_tensors(config, seed=seed))


def rel_l2(a, b):
    import numpy as np
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


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
