"""Mixture-of-experts decode on the GPU: against the numpy reference and graph vs non-graph
(against Hugging Face Qwen3MoeForCausalLM: tests/test_hf_oracle_gpu.py)."""
import pytest

from bounds import assert_below
from gpu_support import assert_graph_matches_nongraph, rel_l2, require_gpu, synthetic
from gpu_support import greedy_decode as _decode
from onegraph.engine import Engine
from onegraph.reference import ReferenceDecoder

pytestmark = pytest.mark.gpu

PROMPT = [3, 17, 99, 250, 4, 61, 200, 8, 45, 123, 7, 300, 11, 90, 150, 33]
# Logits rel. L2 bounds: bounds.py. As in test_engine_gpu.py: fp32 sum order only for fp32 KV;
# rare rounding-boundary flips of one quantization step for bf16/int8 KV. The router adds no
# new error source as long as no two experts tie within rounding (the margin test of the
# synthetic models keeps greedy decisions clear).


@pytest.fixture(scope="module", autouse=True)
def _gpu():
    require_gpu()


@pytest.mark.parametrize("kv", ["fp32", "int8"])
def test_tiny_moe_matches_reference(kv):
    config, tensors = synthetic("tiny-moe")
    assert any(not config.is_moe_layer(l) for l in range(config.num_hidden_layers)), "want a mixed model"
    ref_tokens, ref_logits = _decode(ReferenceDecoder(config, tensors, kv_dtype=kv, max_seq_len=96).step, PROMPT, 64)
    with Engine.from_tensors(config, tensors, kv=kv, max_seq_len=96, device="gpu") as engine:
        tokens, logits = _decode(engine.step, PROMPT, 64)
    assert_below(f"moe/tiny-moe/kv={kv}", max(rel_l2(g, r) for g, r in zip(logits, ref_logits)))
    assert tokens == ref_tokens


def test_moe_graph_replay_is_bit_identical():
    config, tensors = synthetic("tiny-moe")
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=96, device="gpu") as engine:
        assert_graph_matches_nongraph(engine, PROMPT, 64)


@pytest.mark.slow
def test_30b_a3b_shape_matches_reference():
    """The real 30B-A3B layer shapes (128 experts, top 8, hidden 2048), 4 of its 48 layers so
    the numpy reference stays quick."""
    config, tensors = synthetic("qwen3-30b-a3b", layers=4)
    ref_tokens, ref_logits = _decode(ReferenceDecoder(config, tensors, kv_dtype="int8", max_seq_len=96).step,
                                     PROMPT, 64)
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=96, device="gpu") as engine:
        tokens, logits = _decode(engine.step, PROMPT, 64)
    worst = max(rel_l2(g, r) for g, r in zip(logits, ref_logits))
    print(f"qwen3-30b-a3b (4 layers) int8 KV: worst logits rel L2 {worst:.3g}")
    assert_below("moe/qwen3-30b-a3b-4l/kv=int8", worst)
    assert tokens == ref_tokens


@pytest.mark.slow
def test_30b_a3b_shape_decodes_identically_every_time():
    """The 30B-A3B shape (4 layers), graph and non-graph in turn, three times over: every run's
    tokens and every step's logits bit-identical to the first run's. A result that changes from
    run to run is a race that some timings expose (scripts/repeat_decode.py repeats it more)."""
    import numpy as np
    config, tensors = synthetic("qwen3-30b-a3b", layers=4)
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=96, device="gpu") as engine:
        first = None
        for run in range(3):
            for graph in (True, False):
                engine.reset()
                engine.set_graph(graph)
                tokens, logits = _decode(engine.step, PROMPT, 64)
                if first is None:
                    first = tokens, logits
                    continue
                differing = [i for i, (a, b) in enumerate(zip(logits, first[1])) if not np.array_equal(a, b)]
                assert tokens == first[0] and not differing, \
                    f"run {run}, graph={graph}: steps {differing[:5]} differ from the first run"
