"""ModelConfig: every rejection names the key and the value; accepted configs round-trip."""
import json
import math

import pytest

from onegraph.config import ConfigError, ModelConfig
from onegraph.synth import PRESETS, preset_config


def qwen3(**changes):
    raw = json.loads(json.dumps(PRESETS["tiny-dense"]))
    raw.update(changes)
    return raw


def moe(**changes):
    raw = json.loads(json.dumps(PRESETS["tiny-moe"]))
    raw.update(changes)
    return raw


def llama(**changes):
    raw = json.loads(json.dumps(PRESETS["tiny-llama"]))
    raw.update(changes)
    return raw


def rejects(raw, *fragments):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(raw, source="cfg.json")
    message = str(info.value)
    assert message.startswith("cfg.json"), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


LLAMA3_ROPE = PRESETS["llama-3.2-1b"]["rope_scaling"]   # Llama-3.2-1B's


# ---- rejections: (config, fragments that must appear in the message) --------------------------
REJECTIONS = {
    "unknown architecture": (qwen3(architectures=["GPT2LMHeadModel"]), "architectures", "GPT2LMHeadModel"),
    "architectures missing": ({k: v for k, v in qwen3().items() if k != "architectures"}, "architectures"),
    "rope_scaling yarn": (qwen3(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling", "yarn"),
    "rope_scaling llama3 without its other keys": (qwen3(rope_scaling={"type": "llama3", "factor": 8.0}),
                                                    "rope_scaling", "llama3", "'low_freq_factor'"),
    "rope_scaling llama3 with high <= low": (qwen3(rope_scaling=dict(LLAMA3_ROPE, high_freq_factor=1.0)),
                                             "rope_scaling", "high_freq_factor > low_freq_factor"),
    "rope_scaling llama3 with factor 0": (qwen3(rope_scaling=dict(LLAMA3_ROPE, factor=0)), "'factor'"),
    "rope_scaling freq_factors of the wrong length": (
        qwen3(rope_scaling={"rope_type": "freq_factors", "factors": [1.0, 2.0]}), "factors=2 values", "8 positive"),
    "rope_scaling linear without factor": (qwen3(rope_scaling={"rope_type": "linear"}), "rope_scaling", "factor"),
    "rope_scaling not an object": (qwen3(rope_scaling="linear"), "rope_scaling", "'linear'"),
    "attention_bias true": (qwen3(attention_bias=True), "attention_bias=True"),
    "top-k above expert count": (moe(num_experts_per_tok=9), "num_experts_per_tok=9", "num_experts=8"),
    "top-k zero": (moe(num_experts_per_tok=0), "num_experts_per_tok=0"),
    "moe_intermediate_size zero": (moe(moe_intermediate_size=0), "moe_intermediate_size=0"),
    "mlp_only_layers out of range": (moe(mlp_only_layers=[7]), "mlp_only_layers=[7]", "layer 7"),
    "mlp_only_layers not a list": (moe(mlp_only_layers="1"), "mlp_only_layers='1'"),
    "dense layer without intermediate_size": (moe(intermediate_size=0), "intermediate_size=0"),
    "GQA not dividing": (qwen3(num_key_value_heads=4), "num_key_value_heads=4", "num_attention_heads=6"),
    "odd head_dim": (qwen3(head_dim=15), "head_dim=15", "even"),
    "Llama head_dim x heads != hidden": (llama(head_dim=16), "head_dim=16", "num_attention_heads=6", "hidden_size=120"),
    "hidden_size not divisible, no head_dim": (
        {k: v for k, v in llama(hidden_size=100).items() if k != "head_dim"}, "hidden_size=100", "num_attention_heads=6"),
    "missing vocab_size": ({k: v for k, v in qwen3().items() if k != "vocab_size"}, "'vocab_size'", "missing"),
    "missing num_experts (MoE)": ({k: v for k, v in moe().items() if k != "num_experts"}, "'num_experts'", "missing"),
    "string where int": (qwen3(hidden_size="96"), "hidden_size='96'", "integer"),
    "float where int": (qwen3(num_hidden_layers=3.0), "num_hidden_layers=3.0", "integer"),
    "bool where int": (qwen3(vocab_size=True), "vocab_size=True", "integer"),
    "string where bool": (qwen3(tie_word_embeddings="yes"), "tie_word_embeddings='yes'", "true or false"),
    "string where number": (qwen3(rms_norm_eps="1e-6"), "rms_norm_eps='1e-6'", "number"),
    "negative size": (qwen3(intermediate_size=-1), "intermediate_size=-1", "positive"),
    "zero layers": (qwen3(num_hidden_layers=0), "num_hidden_layers=0", "positive"),
    "zero eps": (qwen3(rms_norm_eps=0), "rms_norm_eps=0", "positive"),
    "negative rope_theta": (qwen3(rope_theta=-1.0), "rope_theta=-1.0", "positive"),
    "gelu": (qwen3(hidden_act="gelu"), "hidden_act='gelu'"),
    "eos outside vocab": (qwen3(eos_token_id=[5, 512]), "eos_token_id=[5, 512]", "0..511"),
    "neither architectures nor model_type": (
        {k: v for k, v in qwen3().items() if k != "architectures"}, "architectures=None", "model_type=None",
        "LlamaForCausalLM", "qwen3_moe"),
    "unknown model_type, no architectures": (
        {**{k: v for k, v in qwen3().items() if k != "architectures"}, "model_type": "gpt2"},
        "model_type='gpt2'", "Qwen3ForCausalLM", "qwen3, qwen3_moe, llama"),
    "architectures not a list": (qwen3(architectures="Qwen3ForCausalLM"), "architectures='Qwen3ForCausalLM'", "list"),
    "model_type of another family": (qwen3(model_type="llama"), "model_type='llama'", "Qwen3ForCausalLM"),
    "rope_theta and rope_parameters disagree": (
        qwen3(rope_theta=1e6, rope_parameters={"rope_type": "default", "rope_theta": 5e5}), "rope_theta=1000000.0",
        "rope_parameters="),
    "rope_scaling and rope_parameters disagree": (
        qwen3(rope_scaling={"type": "linear", "factor": 2.0},
              rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}),
        "rope_scaling={'type': 'linear', 'factor': 2.0}", "'factor': 4.0"),
    "rope_scaling linear, rope_parameters default": (
        qwen3(rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_parameters={"rope_type": "default"}),
        "rope_scaling=", "disagrees", "rope_parameters="),
    "num_experts and num_local_experts disagree": (moe(num_local_experts=16), "num_experts=8", "num_local_experts=16"),
    "torch_dtype and dtype disagree": (qwen3(torch_dtype="bfloat16", dtype="float16"), "torch_dtype='bfloat16'",
                                       "dtype='float16'"),
}


@pytest.mark.parametrize("case", list(REJECTIONS))
def test_rejection_names_key_and_value(case):
    raw, *fragments = REJECTIONS[case]
    rejects(raw, *fragments)


def test_not_an_object():
    rejects([1, 2], "JSON object", "list")


def test_from_file_missing_and_malformed(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        ModelConfig.from_file(str(tmp_path / "nope.json"))
    bad = tmp_path / "config.json"
    bad.write_text('{"architectures": ["Qwen3ForCausalLM"],\n "vocab_size": 5,,}')
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_file(str(tmp_path))  # a folder means its config.json
    assert str(bad) in str(info.value) and "line 2" in str(info.value)
    bad.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ConfigError, match="not UTF-8"):
        ModelConfig.from_file(str(bad))


def test_message_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(qwen3(head_dim=15)))
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_file(str(path))
    assert str(info.value).startswith(str(path))


# ---- acceptance -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_through_config_json(name):
    cfg = preset_config(name)
    again = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_hf_dict())), source=cfg.source)
    assert again == cfg


# Parameter counts of the public checkpoints: model.safetensors.index.json "total_size" / 2
# (bf16) for Qwen3-8B and Qwen3-30B-A3B; Qwen3-0.6B stores a copy of the tied embedding as
# lm_head.weight, which is not a parameter of the model.
PUBLIC_PARAMS = {"qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360, "qwen3-30b-a3b": 30_532_122_624}


@pytest.mark.parametrize("name", list(PUBLIC_PARAMS))
def test_real_presets_have_the_public_parameter_count(name):
    shapes = preset_config(name).tensor_shapes()
    assert sum(math.prod(s) for s in shapes.values()) == PUBLIC_PARAMS[name]


def test_tensor_table_details():
    dense = preset_config("tiny-dense").tensor_shapes()
    assert dense["model.layers.0.self_attn.q_proj.weight"] == (96, 96)
    assert dense["model.layers.0.self_attn.k_proj.weight"] == (32, 96)
    assert dense["model.layers.2.self_attn.q_norm.weight"] == (16,)
    assert "lm_head.weight" in dense
    assert "lm_head.weight" not in preset_config("tiny-tied").tensor_shapes()
    llama_shapes = preset_config("tiny-llama").tensor_shapes()
    assert not any("q_norm" in n or "k_norm" in n for n in llama_shapes)
    mixed = preset_config("tiny-moe")
    shapes = mixed.tensor_shapes()
    assert [mixed.is_moe_layer(i) for i in range(3)] == [True, False, True]
    assert shapes["model.layers.0.mlp.gate.weight"] == (8, 96)
    assert shapes["model.layers.0.mlp.experts.7.down_proj.weight"] == (96, 48)
    assert shapes["model.layers.1.mlp.gate_proj.weight"] == (136, 96)
    assert "model.layers.1.mlp.gate.weight" not in shapes


def test_decoder_sparse_step():
    cfg = preset_config("tiny-moe", mlp_only_layers=[], decoder_sparse_step=2, num_hidden_layers=4)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


def test_optional_keys_take_hf_defaults():
    raw = qwen3()
    for key in ("num_key_value_heads", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "rope_scaling"):
        raw.pop(key, None)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.num_key_value_heads == cfg.num_attention_heads == 6
    assert not cfg.tie_word_embeddings and cfg.rope_scaling is None
    raw = llama()
    raw.pop("head_dim")
    raw.pop("rope_theta")
    cfg = ModelConfig.from_dict(raw)
    assert cfg.head_dim == 20 and cfg.rope_theta == 10000.0


def test_linear_rope_scaling_accepted():
    cfg = ModelConfig.from_dict(qwen3(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert cfg.rope_linear_factor == 2.0


def test_llama3_rope_scaling_accepted_under_either_key():
    new = ModelConfig.from_dict(qwen3(rope_scaling=LLAMA3_ROPE))
    old = ModelConfig.from_dict(qwen3(rope_scaling={"type": "llama3", **{k: v for k, v in LLAMA3_ROPE.items()
                                                                        if k != "rope_type"}}))
    assert new == old and new.rope_scaling == LLAMA3_ROPE and new.rope_linear_factor == 1.0


def test_transformers_v5_key_names():
    """transformers >= 5 saves 'num_local_experts' and a 'rope_parameters' object."""
    classic = moe(rope_theta=5e5)
    v5 = {k: v for k, v in classic.items() if k not in ("num_experts", "rope_theta")}
    v5.update(num_local_experts=8, rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    assert ModelConfig.from_dict(v5, source="v5") == ModelConfig.from_dict(classic, source="v5")
    linear = dict(v5, rope_parameters={"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0})
    assert ModelConfig.from_dict(linear).rope_linear_factor == 2.0
    rejects(dict(v5, rope_parameters={"rope_theta": 5e5, "rope_type": "yarn", "factor": 4.0}), "rope_scaling", "yarn")
    rejects(dict(v5, rope_parameters=5e5), "rope_parameters=500000.0")


@pytest.mark.parametrize("preset, model_type", [("tiny-dense", "qwen3"), ("tiny-moe", "qwen3_moe"),
                                                ("tiny-llama", "llama")])
def test_model_type_names_the_architecture_when_architectures_is_absent(preset, model_type):
    raw = json.loads(json.dumps(PRESETS[preset]))
    expected = ModelConfig.from_dict(raw, source="cfg.json")
    del raw["architectures"]
    raw["model_type"] = model_type
    assert ModelConfig.from_dict(raw, source="cfg.json") == expected
    assert ModelConfig.from_dict(dict(raw, architectures=[]), source="cfg.json") == expected


def test_rope_scaling_spellings_give_one_config():
    """The old 'type' key, 'rope_type', an explicit default and rope_parameters agree."""
    linear = ModelConfig.from_dict(qwen3(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert ModelConfig.from_dict(qwen3(rope_scaling={"type": "linear", "factor": 2.0})) == linear
    both = qwen3(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0},
                 rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6})
    assert ModelConfig.from_dict(both) == linear
    assert ModelConfig.from_dict(qwen3(rope_scaling={"rope_type": "default"})).rope_scaling is None


# Shapes and ids shared by the transformers-saved configs and their classic twins.
_HF_COMMON = dict(vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=[2, 7], hidden_act="silu", attention_bias=False)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_transformers_saved_config_reads_as_its_classic_twin(tmp_path, family):
    """transformers 5 writes no 'architectures' for a bare config, 'dtype' for torch_dtype,
    rope_parameters for rope_theta / rope_scaling and num_local_experts for num_experts:
    the folder it saves must read as the same ModelConfig as the classic spelling."""
    transformers = pytest.importorskip("transformers")
    common = dict(_HF_COMMON)
    rope = {"rope_type": "linear", "factor": 2.0} if family == "llama" else None
    classic = dict(common, rope_theta=500_000.0, rope_scaling=None if rope is None else {"type": "linear", "factor": 2.0},
                   torch_dtype="float16")
    if family == "llama":
        hf = transformers.LlamaConfig(**common, rope_parameters={"rope_theta": 500_000.0, **rope}, dtype="float16")
        classic.update(architectures=["LlamaForCausalLM"])
    elif family == "qwen3":
        hf = transformers.Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
                                      dtype="float16")
        classic.update(architectures=["Qwen3ForCausalLM"])
    else:
        moe_keys = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                        decoder_sparse_step=1, mlp_only_layers=[1])
        hf = transformers.Qwen3MoeConfig(**common, **moe_keys, dtype="float16",
                                         rope_parameters={"rope_type": "default", "rope_theta": 500_000.0})
        classic.update(architectures=["Qwen3MoeForCausalLM"], **moe_keys)
    hf.save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    # What transformers 5 writes: the keys this reader must understand.
    assert "architectures" not in saved and saved["model_type"] == family
    assert saved["dtype"] == "float16" and "torch_dtype" not in saved
    assert "rope_parameters" in saved and "rope_theta" not in saved and "rope_scaling" not in saved
    path = str(tmp_path / "config.json")
    assert ModelConfig.from_file(path) == ModelConfig.from_dict(classic, source=path)


def _folder(tmp_path, config: dict, generation=None):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return str(tmp_path)


@pytest.mark.parametrize("config_eos, generation_eos, expected", [
    (7, [9, 7, 11], (7, 9, 11)),        # the union, config.json's first, duplicates dropped
    ([7, 9], 11, (7, 9, 11)),           # an int in generation_config.json
    ([7, 7, 9], None, (7, 9)),          # duplicates in config.json alone
    (None, [5, 6], (5, 6)),             # only generation_config.json names them
    (7, {}, (7,)),                      # generation_config.json without eos_token_id
])
def test_eos_token_ids_join_generation_config(tmp_path, config_eos, generation_eos, expected):
    generation = generation_eos if isinstance(generation_eos, dict) else {"eos_token_id": generation_eos}
    cfg = ModelConfig.from_file(_folder(tmp_path, qwen3(eos_token_id=config_eos), generation))
    assert cfg.eos_token_ids == expected


def test_eos_token_ids_without_generation_config(tmp_path):
    assert ModelConfig.from_file(_folder(tmp_path, qwen3(eos_token_id=[4, 3]))).eos_token_ids == (4, 3)


@pytest.mark.parametrize("generation, fragments", [
    ({"eos_token_id": "2"}, ("eos_token_id='2'", "token id")),
    ({"eos_token_id": [2, True]}, ("eos_token_id=[2, True]",)),
    ({"eos_token_id": [2, 512]}, ("eos_token_id=[2, 512]", "0..511")),
    ([2], ("JSON object", "list")),
])
def test_bad_generation_config_names_the_file(tmp_path, generation, fragments):
    folder = _folder(tmp_path, qwen3(), generation)
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_file(folder)
    message = str(info.value)
    assert message.startswith(str(tmp_path / "generation_config.json")), message
    for fragment in fragments:
        assert fragment in message, message
