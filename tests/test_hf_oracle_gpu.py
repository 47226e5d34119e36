"""The GPU engine against Hugging Face transformers, an oracle nobody here wrote: a dense Qwen3,
a Llama and a Qwen3-MoE synthetic checkpoint (bf16 safetensors folders), run by transformers in
float32 on the CPU (eager attention) and by the GPU engine (bf16 weights, fp32 KV). An 8-token
prompt (HF in one forward, the engine token by token), then 32 greedy steps each: the logits at
every position within the case's bound (bounds.py: fp32 on both sides, so only summation order
differs) and the same greedy tokens. Skipped without a GPU, torch or transformers."""
import inspect

import numpy as np
import pytest

from bounds import assert_below
from gpu_support import rel_l2, require_gpu
from onegraph.engine import Engine
from onegraph.synth import preset_config, write_model

pytestmark = pytest.mark.gpu

PROMPT = [3, 17, 99, 250, 4, 61, 200, 8]
DECODE_STEPS = 32


@pytest.fixture(scope="module", autouse=True)
def _gpu():
    require_gpu()


def hugging_face_greedy(folder, prompt, n):
    """(greedy tokens, logits at every prompt position and after every token) from transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    # transformers renamed past_key_values to cache (5.2x); the GPU machine may have either
    cache_name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    tokens = []
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([prompt]), use_cache=True)
        logits = list(out.logits[0].numpy().copy())             # [len(prompt)] x [vocab]
        for _ in range(n):
            tokens.append(int(np.argmax(logits[-1])))
            out = hf(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **{cache_name: getattr(out, cache_name)})
            logits.append(out.logits[0, -1].numpy().copy())
    return tokens, logits


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-llama", "tiny-llama3", "tiny-moe"])
def test_gpu_engine_matches_hugging_face(preset, tmp_path):
    config = preset_config(preset)
    write_model(config, str(tmp_path))
    want_tokens, want_logits = hugging_face_greedy(tmp_path, PROMPT, DECODE_STEPS)
    with Engine.from_pretrained(str(tmp_path), kv="fp32", max_seq_len=64, device="gpu") as engine:
        assert engine.backend == "gpu-graph"
        logits = [engine.step(t) for t in PROMPT]
        tokens = []
        for _ in range(DECODE_STEPS):
            tokens.append(int(np.argmax(logits[-1])))
            logits.append(engine.step(tokens[-1]))
    assert len(logits) == len(want_logits) == len(PROMPT) + DECODE_STEPS
    worst = max(rel_l2(g, w) for g, w in zip(logits, want_logits))
    print(f"{preset} vs Hugging Face: worst logits rel L2 {worst:.3g} over {len(want_logits)} positions")
    assert_below(f"hf-gpu/{preset}", worst)
    assert tokens == want_tokens
