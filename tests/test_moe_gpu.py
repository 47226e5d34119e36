"""Mixture-of-experts decode on the GPU: against the numpy reference and graph vs non-graph
(against Hugging Face Qwen3MoeForCausalLM: tests/test_hf_oracle_gpu.py)."""
import numpy as np
import pytest

from bounds import assert_below
from gpu_support import assert_graph_matches_nongraph, rel_l2, require_gpu, synthetic
from gpu_support import greedy_decode as _decode
from onegraph.engine import Engine
from onegraph import reference
from onegraph.reference import ReferenceDecoder, moe_topk

pytestmark = pytest.mark.gpu

PROMPT = [3, 17, 99, 250, 4, 61, 200, 8, 45, 123, 7, 300, 11, 90, 150, 33]
# Logits rel. L2 bounds: bounds.py. As in test_engine_gpu.py: fp32 sum order only for fp32 KV;
# rare rounding-boundary flips of one quantization step for bf16/int8 KV. The router adds no
# new error source as long as no two experts tie within those differences: a near tie routes
# the token to another expert on one side, and that step's logits differ by far more than the
# bound (not an error of either side).
#
# The closest routing decision a test may rely on: the 8th and 9th router logits apart by this
# fraction of the largest |router logit|, ten times the ~1e-6 of fp32 summation order (ORDER).
ROUTER_GAP_FLOOR = 1e-5


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
def test_30b_a3b_shape_matches_reference(monkeypatch):
    """The real 30B-A3B layer shapes (128 experts, top 8, hidden 2048), 4 of its 48 layers so
    the numpy reference stays quick, on fp32 KV: the two sides differ by summation order only.
    Not on int8 KV: this run routes tokens within 1.1e-4 of a tie (as a fraction of the largest
    router logit), and a K/V element one int8 step apart, which either side may round either
    way, moves router logits by more; such a step goes to another expert on one side, and both
    sides are right (the numpy reference alone, its GEMVs summed in float64, does the same:
    scripts/routing_margins.py). int8 KV at this shape: run to run and graph against non-graph
    below; its attention layout (32 query heads on 4 KV heads) in test_kernels_gpu.py."""
    config, tensors = synthetic("qwen3-30b-a3b", layers=4)
    gaps = []  # per routing decision: reference.routing_gap

    def topk_with_gap(router_logits, top_k, norm_topk_prob):
        gaps.append(reference.routing_gap(router_logits, top_k))
        return moe_topk(router_logits, top_k, norm_topk_prob)

    monkeypatch.setattr(reference, "moe_topk", topk_with_gap)
    ref_tokens, ref_logits = _decode(ReferenceDecoder(config, tensors, kv_dtype="fp32", max_seq_len=96).step,
                                     PROMPT, 64)
    assert len(gaps) == config.num_hidden_layers * (len(PROMPT) + 64)
    assert min(gaps) > ROUTER_GAP_FLOOR, \
        f"the run routes a token at a near tie (gap {min(gaps):.3g}): choose another prompt or seed"
    with Engine.from_tensors(config, tensors, kv="fp32", max_seq_len=96, device="gpu") as engine:
        tokens, logits = _decode(engine.step, PROMPT, 64)
    worst = max(rel_l2(g, r) for g, r in zip(logits, ref_logits))
    print(f"qwen3-30b-a3b (4 layers) fp32 KV: worst logits rel L2 {worst:.3g}, closest routing gap {min(gaps):.3g}")
    assert_below("moe/qwen3-30b-a3b-4l/kv=fp32", worst)
    assert tokens == ref_tokens


@pytest.mark.slow
def test_30b_a3b_shape_decodes_identically_every_time():
    """The 30B-A3B shape (4 layers), graph and non-graph in turn, three times over: every run's
    tokens and every step's logits bit-identical to the first run's. A result that changes from
    run to run is a race that some timings expose (scripts/repeat_decode.py repeats it more)."""
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
