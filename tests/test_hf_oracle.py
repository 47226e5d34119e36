"""Hugging Face transformers as an oracle nobody here wrote.

Tiny random bf16 models are saved as HF folders (config.json from ModelConfig.to_hf_dict(),
model.safetensors with bf16 tensors), loaded by transformers in float32 with eager attention,
and run side by side with ReferenceDecoder (fp32 KV): an 8-token prompt (HF in one forward,
ours token by token), then 16 greedy decode steps (HF with use_cache / past_key_values).

Skipped when torch or transformers is not installed (the runtime itself never imports them).
"""
from __future__ import annotations

import inspect
import json
import math

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from onegraph.config import ModelConfig  # noqa: E402
from onegraph.reference import ReferenceDecoder  # noqa: E402

# Both sides compute in fp32 from the same bf16 weights but in different orders (HF: batched
# prefill, torch matmul blocking, expert sums in expert-index order; ours: gemv per token, expert
# sums in selection order). Differences are ~1e-6 relative; 1e-4 catches any real divergence
# (a wrong RoPE, norm or routing gives >= 1e-2).
HF_REL_L2 = 1e-4
PROMPT_LEN = 8
DECODE_STEPS = 16

ARCH_CLASSES = {
    "Qwen3ForCausalLM": "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "Qwen3MoeForCausalLM",
    "LlamaForCausalLM": "LlamaForCausalLM",
}

MODELS = {
    # GQA group of 4, head_dim * heads (128) != hidden (48), tied embeddings
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], hidden_size=48, intermediate_size=80,
                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                  tie_word_embeddings=True, rope_theta=1_000_000.0),
    # no QK-norm, untied lm_head, linear rope scaling
    "llama": dict(architectures=["LlamaForCausalLM"], hidden_size=48, intermediate_size=72,
                  num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                  tie_word_embeddings=False, rope_theta=10_000.0,
                  rope_scaling={"rope_type": "linear", "factor": 4.0}),
    # Llama 3.x's rope scaling: wavelengths 6.3, 19.9, 62.8, ... against an original context of
    # 32 take each branch of the rule (kept, blended, divided by the factor), and the 24
    # positions decoded rotate by all of them
    "llama3": dict(architectures=["LlamaForCausalLM"], hidden_size=96, intermediate_size=72,
                   num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                   tie_word_embeddings=False, rope_theta=10_000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    # layer 1 dense through mlp_only_layers; top-2 of 6 experts
    "qwen3_moe_norm": dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=48, intermediate_size=64,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           tie_word_embeddings=False, num_experts=6, num_experts_per_tok=2,
                           moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen3_moe_nonorm": dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=48, intermediate_size=64,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             tie_word_embeddings=True, num_experts=6, num_experts_per_tok=3,
                             moe_intermediate_size=24, norm_topk_prob=False, mlp_only_layers=[0]),
}


def make_model(name: str, seed: int):
    """A ModelConfig and random bf16 tensors. Matrices ~ N(0, 1/in_features) keep activations
    O(1); the embedding ~ N(0, 0.1^2) is small next to the layers' contributions, so a tied
    lm_head does not simply predict the input token again and greedy runs visit many tokens."""
    raw = dict(vocab_size=131, rms_norm_eps=1e-6, max_position_embeddings=256, bos_token_id=1,
               eos_token_id=2, **MODELS[name])
    config = ModelConfig.from_dict(raw, source=name)
    rng = np.random.default_rng(seed)
    tensors = {}
    for tensor_name, shape in config.tensor_shapes().items():
        if len(shape) == 1:
            t = 1.0 + 0.1 * rng.standard_normal(shape)
        elif tensor_name == "model.embed_tokens.weight":
            t = 0.1 * rng.standard_normal(shape)
        else:
            t = rng.standard_normal(shape) / math.sqrt(shape[1])
        tensors[tensor_name] = t.astype(ml_dtypes.bfloat16)
    return config, tensors


def save_hf_folder(config: ModelConfig, tensors, folder) -> None:
    with open(folder / "config.json", "w") as f:
        json.dump(config.to_hf_dict(), f, indent=2)
    as_torch = {name: torch.from_numpy(np.ascontiguousarray(t).view(np.uint16).astype(np.int16)).view(torch.bfloat16)
                for name, t in tensors.items()}
    safetensors_torch.save_file(as_torch, str(folder / "model.safetensors"), metadata={"format": "pt"})


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", list(MODELS))
def test_reference_matches_transformers(name, tmp_path):
    torch.manual_seed(0)
    config, tensors = make_model(name, seed=sum(map(ord, name)))
    save_hf_folder(config, tensors, tmp_path)
    model_class = getattr(transformers, ARCH_CLASSES[config.architecture])
    hf, loading = model_class.from_pretrained(str(tmp_path), dtype=torch.float32, attn_implementation="eager",
                                              output_loading_info=True)
    hf.eval()
    # every parameter came from our file (nothing randomly initialized, nothing left over)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    # the bf16 checkpoint reached HF unchanged (bf16 -> fp32 is exact)
    hf_state = hf.state_dict()
    np.testing.assert_array_equal(hf_state["model.embed_tokens.weight"].numpy(),
                                  tensors["model.embed_tokens.weight"].astype(np.float32))

    ours = ReferenceDecoder(config, tensors, kv_dtype="fp32", max_seq_len=PROMPT_LEN + DECODE_STEPS)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, config.vocab_size, PROMPT_LEN)]
    # transformers renamed past_key_values to cache (5.2x); the GPU machine may have either
    cache_name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    errors, tokens = [], []
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([prompt]), use_cache=True)
        past = getattr(out, cache_name)
        hf_logits = out.logits[0].numpy()                      # [PROMPT_LEN, vocab]
        for i, token in enumerate(prompt):
            our_logits = ours.step(token)
            errors.append(rel_l2(our_logits, hf_logits[i]))
        hf_logits = hf_logits[-1]
        for step in range(DECODE_STEPS):
            token = int(np.argmax(our_logits))
            assert token == int(np.argmax(hf_logits)), f"decode step {step}: greedy tokens differ"
            tokens.append(token)
            our_logits = ours.step(token)
            out = hf(input_ids=torch.tensor([[token]]), use_cache=True, **{cache_name: past})
            past = getattr(out, cache_name)
            hf_logits = out.logits[0, -1].numpy()
            errors.append(rel_l2(our_logits, hf_logits))
    print(f"{name}: max rel L2 {max(errors):.2e} over {len(errors)} positions; greedy {tokens}")
    assert max(errors) < HF_REL_L2, errors
    assert ours.position == PROMPT_LEN + DECODE_STEPS
