"""The synthetic model generator: deterministic, order-independent, i.i.d.-looking values with
scales that make greedy decoding robust, written as folders that Hugging Face can read."""
import json
import os

import ml_dtypes
import numpy as np
import pytest

from onegraph import synth
from onegraph.loader import INDEX_FILE, SINGLE_FILE, load_model

BF16 = np.dtype(ml_dtypes.bfloat16)


def bits(a):
    return a.view(np.uint16)


# ---- determinism -------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-llama", "tiny-tied"])
def test_shapes_dtype_and_order_match_the_tensor_table(preset):
    cfg = synth.preset_config(preset)
    got = [(name, a.shape, a.dtype) for name, a in synth.iter_tensors(cfg)]
    assert got == [(name, shape, BF16) for name, shape in cfg.tensor_shapes().items()]


def test_same_seed_same_bytes_other_seed_other_bytes():
    cfg = synth.preset_config("tiny-moe")
    first = dict(synth.iter_tensors(cfg, seed=7))
    again = dict(synth.iter_tensors(cfg, seed=7, workers=3))
    other = dict(synth.iter_tensors(cfg, seed=8))
    for name in first:
        assert np.array_equal(bits(first[name]), bits(again[name])), name
        # No tensor is shared between seeds (norm weights too: 65,536 levels, not a constant).
        assert np.mean(bits(first[name]) == bits(other[name])) < 0.5, name


def test_values_depend_on_name_not_on_order_threads_or_model():
    cfg = synth.preset_config("tiny-dense", vocab_size=9000)  # embedding spans 1 chunk boundary
    names = list(cfg.tensor_shapes())
    forward = dict(synth.iter_tensors(cfg, seed=1, workers=4))
    backward = dict(synth.iter_tensors(cfg, seed=1, names=names[::-1], workers=1))
    for name in names:
        assert np.array_equal(bits(forward[name]), bits(backward[name])), name
    one = synth.make_tensor(cfg, "model.layers.2.mlp.up_proj.weight", seed=1)
    assert np.array_equal(bits(one), bits(forward["model.layers.2.mlp.up_proj.weight"]))
    # Same name and shape in a model with more layers: same values.
    deeper = synth.preset_config("tiny-dense", vocab_size=9000, num_hidden_layers=5)
    assert np.array_equal(bits(synth.make_tensor(deeper, "model.layers.2.mlp.up_proj.weight", seed=1)), bits(one))


def test_unknown_tensor_and_preset_are_errors():
    cfg = synth.preset_config("tiny-dense")
    with pytest.raises(KeyError, match="model.layers.7.mlp.up_proj.weight"):
        list(synth.iter_tensors(cfg, names=["model.layers.7.mlp.up_proj.weight"]))
    with pytest.raises(KeyError, match="qwen9"):
        synth.preset_config("qwen9")
    with pytest.raises(ValueError, match="seed=-1"):
        synth.make_tensor(cfg, "model.norm.weight", seed=-1)


def test_preset_overrides():
    cfg = synth.preset_config("qwen3-30b-a3b", num_hidden_layers=2, mlp_only_layers=(1,))
    assert cfg.num_hidden_layers == 2 and cfg.mlp_only_layers == (1,) and cfg.num_experts == 128
    assert cfg.is_moe_layer(0) and not cfg.is_moe_layer(1)
    small_vocab = synth.preset_config("qwen3-8b", vocab_size=1000)
    assert small_vocab.eos_token_id is None and synth.preset_config("qwen3-8b").eos_token_id == 151645


# ---- the values look i.i.d. normal -------------------------------------------------------------------

def test_values_are_iid_normal_with_the_intended_scale():
    cfg = synth.preset_config("tiny-dense", vocab_size=12000, hidden_size=192, head_dim=32)
    embed = synth.make_tensor(cfg, "model.embed_tokens.weight").astype(np.float64)  # 2.3M values, 3 chunks
    assert embed.size > 2 * synth.CHUNK_ELEMENTS
    std = 1 / np.sqrt(192)
    z = embed.reshape(-1) / std
    assert abs(z.mean()) < 0.005 and abs(z.std() - 1) < 0.005
    # Normal shape: tail mass and kurtosis of a standard normal, clipped at ±4.3σ.
    assert abs(np.mean(np.abs(z) > 2) - 0.0455) < 0.002
    assert abs(np.mean(z**4) - 3) < 0.05 and np.abs(z).max() < 4.4
    # No two rows alike, no correlation between neighbours in a row or across a chunk boundary.
    flat = z.reshape(-1)
    assert len({row.tobytes() for row in embed}) == embed.shape[0]
    for lag in (1, 2, 192, synth.CHUNK_ELEMENTS):
        assert abs(np.corrcoef(flat[:-lag], flat[lag:])[0, 1]) < 0.01, lag
    # Full rank with the singular values of a Gaussian matrix (Marchenko-Pastur edges).
    s = np.linalg.svd(embed[:768], compute_uv=False) / std / np.sqrt(768)
    assert 0.45 < s.min() and s.max() < 1.55  # edges 1 ± sqrt(192/768) = 0.5, 1.5


def test_init_scales():
    cfg = synth.preset_config("tiny-moe")
    w = dict(synth.iter_tensors(cfg))
    as64 = {n: a.astype(np.float64) for n, a in w.items()}
    for name, expected_std in [("model.layers.0.self_attn.q_proj.weight", 96**-0.5),
                               ("model.layers.0.self_attn.o_proj.weight", 96**-0.5),
                               ("model.layers.1.mlp.down_proj.weight", 136**-0.5),
                               ("model.layers.2.mlp.experts.3.down_proj.weight", 48**-0.5),
                               ("model.layers.2.mlp.gate.weight", 96**-0.5),
                               ("model.embed_tokens.weight", 96**-0.5),
                               ("lm_head.weight", 96**-0.5)]:
        assert abs(as64[name].std() / expected_std - 1) < 0.1, name
    assert abs(as64["model.layers.0.input_layernorm.weight"].mean() - 1) < 0.02
    assert abs(as64["model.norm.weight"].mean() - synth.LOGIT_STD) < 0.1


# ---- greedy decoding is decided by clear margins -------------------------------------------------------
# An independent float64 forward (Hugging Face's arithmetic: RMSNorm, QK-norm, rotate-half RoPE,
# GQA, SwiGLU, softmax top-k routing) with an optional KV-cache round trip (int8 or bf16).

def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, theta):  # x: (heads, head_dim); pairs (i, i + head_dim/2)
    d = x.shape[-1]
    angle = np.tile(pos * theta ** (-np.arange(0, d, 2) / d), 2)
    return x * np.cos(angle) + np.concatenate([-x[:, d // 2:], x[:, :d // 2]], axis=-1) * np.sin(angle)


def int8_round_trip(x):  # symmetric, one scale per (token, KV head)
    scale = np.abs(x).max(axis=-1, keepdims=True) / 127
    return np.round(x / scale) * scale


def bf16_round_trip(x):
    return x.astype(BF16).astype(np.float64)


def swiglu(w, p, h):
    g = w[p + "gate_proj.weight"] @ h
    return w[p + "down_proj.weight"] @ (g / (1 + np.exp(-g)) * (w[p + "up_proj.weight"] @ h))


def decode_step(cfg, w, token, pos, cache, kv_round_trip, residual_rms):
    nh, nkv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    x = w["model.embed_tokens.weight"][token]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = rmsnorm(x, w[p + "input_layernorm.weight"], eps)
        q = (w[p + "self_attn.q_proj.weight"] @ h).reshape(nh, d)
        k = (w[p + "self_attn.k_proj.weight"] @ h).reshape(nkv, d)
        v = (w[p + "self_attn.v_proj.weight"] @ h).reshape(nkv, d)
        if cfg.has_qk_norm:
            q, k = rmsnorm(q, w[p + "self_attn.q_norm.weight"], eps), rmsnorm(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)
        cache[layer].append((kv_round_trip(k), kv_round_trip(v)))
        keys = np.stack([kv[0] for kv in cache[layer]])    # (t, nkv, d)
        values = np.stack([kv[1] for kv in cache[layer]])
        out = np.empty((nh, d))
        for head in range(nh):
            g = head * nkv // nh
            s = keys[:, g] @ q[head] / np.sqrt(d)
            prob = np.exp(s - s.max())
            out[head] = (prob / prob.sum()) @ values[:, g]
        x = x + w[p + "self_attn.o_proj.weight"] @ out.reshape(-1)
        h = rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)
        if cfg.is_moe_layer(layer):
            r = w[p + "mlp.gate.weight"] @ h
            prob = np.exp(r - r.max()) / np.exp(r - r.max()).sum()
            top = np.argsort(-prob, kind="stable")[:cfg.num_experts_per_tok]
            weight = prob[top] / prob[top].sum() if cfg.norm_topk_prob else prob[top]
            x = x + sum(wt * swiglu(w, f"{p}mlp.experts.{e}.", h) for e, wt in zip(top, weight))
        else:
            x = x + swiglu(w, p + "mlp.", h)
        residual_rms.append(np.sqrt(np.mean(x * x)))
    head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    return head @ rmsnorm(x, w["model.norm.weight"], eps)


def decode(cfg, w, prompt, steps, kv_round_trip=lambda a: a, forced=None, residual_rms=None):
    """Greedy decode (or teacher-forced on `forced`); returns tokens and the logits of each
    predicted position."""
    tokens, cache, logits = list(forced or prompt), [[] for _ in range(cfg.num_hidden_layers)], []
    residual_rms = [] if residual_rms is None else residual_rms
    for pos in range(len(prompt) + steps - 1):
        out = decode_step(cfg, w, tokens[pos], pos, cache, kv_round_trip, residual_rms)
        if pos >= len(prompt) - 1:
            logits.append(out)
            if forced is None:
                tokens.append(int(np.argmax(out)))
    return tokens, np.array(logits)


def top2_margin(logits):
    s = np.sort(logits, axis=-1)
    return s[:, -1] - s[:, -2]


PROMPT, STEPS = [1, 2, 3, 4, 5], 32


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_greedy_margins_dwarf_kv_cache_rounding(preset):
    cfg = synth.preset_config(preset)
    w = {name: a.astype(np.float64) for name, a in synth.iter_tensors(cfg)}
    rms = []
    tokens, logits = decode(cfg, w, PROMPT, STEPS, residual_rms=rms)
    _, logits_int8 = decode(cfg, w, PROMPT, STEPS, int8_round_trip, forced=tokens)
    _, logits_bf16 = decode(cfg, w, PROMPT, STEPS, bf16_round_trip, forced=tokens)
    margin = top2_margin(logits)
    int8_error = np.abs(logits_int8 - logits).max(axis=-1)  # worst logit of each step
    bf16_error = np.abs(logits_bf16 - logits).max(axis=-1)
    # Logits have std ≈ LOGIT_STD: a peaked but not one-hot next-token distribution.
    assert np.all(np.abs(logits.std(axis=-1) / synth.LOGIT_STD - 1) < 0.2)
    # Hidden states stay O(1) through every layer.
    assert 0.3 < min(rms) and max(rms) < 4
    # The decode is not degenerate (not one token repeated).
    assert len(set(tokens[len(PROMPT):])) >= 5
    # Measured (seed 0): median top-1/top-2 margin 1.03 (dense) / 1.53 (MoE) logits; median
    # error of the worst logit with an int8 KV cache 0.11 / 0.095, with bf16 0.037 / 0.036.
    # KV rounding is an order of magnitude below the typical margin: it can flip only rare
    # near-ties (and, in MoE, a near-tied expert choice: one step of tiny-moe moves by 5 logits).
    assert np.median(margin) > 8 * np.median(int8_error)
    assert np.median(margin) > 20 * np.median(bf16_error)
    assert np.array_equal(logits_bf16.argmax(-1), logits.argmax(-1))


@pytest.mark.slow
def test_numpy_forward_matches_transformers(tmp_path):
    """The forward used above is checked once against Hugging Face, which also shows that
    transformers reads the generated folders (dense+MoE mixed layers)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for preset in ("tiny-moe", "tiny-llama", "tiny-tied"):
        cfg = synth.preset_config(preset)
        folder = tmp_path / preset
        synth.write_model(cfg, folder, seed=2)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            hf_logits = model(torch.tensor([PROMPT + [7, 9]])).logits[0].numpy()
        w = {name: a.astype(np.float64) for name, a in synth.iter_tensors(cfg, seed=2)}
        _, ours = decode(cfg, w, PROMPT + [7, 9], 1, forced=PROMPT + [7, 9])
        # float32 in transformers (its MoE kernels take no float64): ~1e-6 relative error.
        np.testing.assert_allclose(ours[-1], hf_logits[-1], rtol=0, atol=1e-4)
        assert np.argmax(ours[-1]) == np.argmax(hf_logits[-1])
    # A folder saved by transformers (its own key names and tensor order) loads unchanged.
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-moe", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "saved")
    saved = load_model(tmp_path / "saved")
    assert saved.config.num_experts == 8 and saved.config.rope_theta == 1e6
    for name, expected in synth.iter_tensors(synth.preset_config("tiny-moe"), seed=2):
        assert np.array_equal(bits(saved.tensors[name]), bits(expected)), name


# ---- writing folders -----------------------------------------------------------------------------

def test_written_folder_layout(tmp_path):
    cfg = synth.preset_config("tiny-tied")
    files = synth.write_model(cfg, tmp_path)
    assert sorted(os.path.basename(f) for f in files) == ["config.json", "generation_config.json", SINGLE_FILE]
    assert json.loads((tmp_path / "config.json").read_text()) == cfg.to_hf_dict()
    with open(tmp_path / SINGLE_FILE, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    assert header_len % 8 == 0 and header["__metadata__"] == {"format": "pt"}
    assert list(h for h in header if h != "__metadata__") == list(cfg.tensor_shapes())


def test_write_refuses_non_empty_folder_and_overwrite_removes_stale_shards(tmp_path):
    cfg = synth.preset_config("tiny-dense")
    synth.write_model(cfg, tmp_path, max_shard_bytes=100_000)
    assert (tmp_path / INDEX_FILE).exists()
    with pytest.raises(FileExistsError, match="not empty"):
        synth.write_model(cfg, tmp_path)
    (tmp_path / "notes.txt").write_text("kept")
    synth.write_model(cfg, tmp_path, seed=4, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json", SINGLE_FILE, "notes.txt"]
    model = load_model(tmp_path)
    assert np.array_equal(bits(model.tensors["model.norm.weight"]), bits(synth.make_tensor(cfg, "model.norm.weight", seed=4)))


def test_demo_model_is_cached_and_written_atomically(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    path = synth.ensure_demo_model(cache)
    assert os.path.dirname(path) == str(cache) and os.path.basename(path).startswith("demo-")
    model = load_model(path)
    assert model.config.architecture == "Qwen3ForCausalLM"
    stamp = os.stat(os.path.join(path, SINGLE_FILE)).st_mtime_ns
    assert synth.ensure_demo_model(cache) == path
    assert os.stat(os.path.join(path, SINGLE_FILE)).st_mtime_ns == stamp
    assert os.listdir(cache) == [os.path.basename(path)]  # no temporary folder left behind

    # $ONEGRAPH_CACHE is the default location; a crash while writing leaves nothing behind.
    other = tmp_path / "env-cache"
    monkeypatch.setenv("ONEGRAPH_CACHE", str(other))

    def crash(config, out_dir, **kwargs):
        open(os.path.join(out_dir, SINGLE_FILE), "wb").write(b"half")
        raise OSError("disk full")
    monkeypatch.setattr(synth, "write_model", crash)
    with pytest.raises(OSError, match="disk full"):
        synth.ensure_demo_model()
    assert os.listdir(other) == []
    monkeypatch.undo()
    monkeypatch.setenv("ONEGRAPH_CACHE", str(other))
    assert os.path.dirname(synth.ensure_demo_model()) == str(other)


def test_command_line(tmp_path, capsys):
    assert synth.main(["tiny-llama", str(tmp_path / "m"), "--seed", "3", "--layers", "2"]) == 0
    assert "wrote 3 files" in capsys.readouterr().out
    assert load_model(tmp_path / "m").config.num_hidden_layers == 2


def test_smollm2_preset_is_the_real_models_shape():
    """The smollm2-135m preset stands in for the real model in benchmarks: same shape."""
    pytest.importorskip("gguf")
    from real_model import smollm2_gguf
    from onegraph.gguf_model import load_gguf
    real = load_gguf(smollm2_gguf()).config
    preset = synth.preset_config("smollm2-135m")
    for key in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                "rope_theta", "max_position_embeddings"):
        assert getattr(preset, key) == getattr(real, key), key
    assert preset.rms_norm_eps == pytest.approx(real.rms_norm_eps, rel=1e-6)


def test_llama_3_2_1b_preset_has_the_public_models_parameter_count():
    """The llama-3.2-1b preset is Llama-3.2-1B's shape: its safetensors hold 1,235,814,400
    parameters (the embedding tied to the lm_head)."""
    config = synth.preset_config("llama-3.2-1b")
    assert config.architecture == "LlamaForCausalLM" and config.tie_word_embeddings
    assert sum(int(np.prod(shape)) for shape in config.tensor_shapes().values()) == 1_235_814_400
