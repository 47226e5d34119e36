"""The device sampling stage (OG_OUTPUT_SAMPLED, cuda/sample.cu) against the reference sampler
(sampling.sample_step) fed the GPU's own logits, on the graph, pipelined and non-graph paths."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import require_gpu, synthetic
from onegraph.engine import Engine
from onegraph.sampling import SamplingParams, sample_step

pytestmark = pytest.mark.gpu

PROMPT = [1, 2, 3, 4, 5]
STEPS = 1000
PARAMS = [
    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                   presence_penalty=0.2, frequency_penalty=0.1, seed=123),
    SamplingParams(temperature=1.0, seed=7),                       # no filter: the race over all ids
    SamplingParams(temperature=1.2, top_p=0.8, seed=2 ** 63 + 5),  # top-p over the whole vocabulary
    SamplingParams(temperature=0.0, repetition_penalty=1.5, seed=1),   # greedy after penalties
]


@pytest.fixture(scope="module", autouse=True)
def _gpu():
    require_gpu()


@pytest.fixture(scope="module")
def model():
    return synthetic("tiny-dense")


def engine(model, graph: bool) -> Engine:
    config, tensors = model
    e = Engine.from_tensors(config, tensors, kv="fp32", max_seq_len=STEPS + len(PROMPT) + 8, device="gpu")
    e.set_graph(graph)
    return e


def reference_tokens(model, params: SamplingParams, tokens: list[int]) -> list[int]:
    """sample_step over the GPU's own logits (a logits-output engine fed the same tokens): what
    each sampled step must have chosen."""
    with engine(model, graph=False) as oracle:
        logits = oracle.prefill(PROMPT)
        counts = np.zeros(logits.size, np.int32)
        position = len(PROMPT) - 1
        want = [sample_step(logits, params, position, counts).token]
        for token in tokens[:-1]:
            logits = oracle.step(token)
            counts[token] += 1
            position += 1
            want.append(sample_step(logits, params, position, counts).token)
    return want


@pytest.mark.parametrize("params", PARAMS, ids=["all-filters", "no-filter", "top-p", "greedy-penalized"])
@pytest.mark.parametrize("graph", [True, False], ids=["graph-pipelined", "nongraph"])
def test_gpu_stage_picks_the_reference_tokens(model, params, graph):
    with engine(model, graph) as e:
        tokens = e.generate(PROMPT, STEPS, params, stop_token_ids=())
        if graph:
            assert e.stats()["graph_steps"] > 0
    assert len(tokens) == STEPS
    assert tokens == reference_tokens(model, params, tokens)


def test_graph_step_by_step_equals_pipelined_and_cpu(model):
    params = PARAMS[0]
    with engine(model, graph=True) as e:
        pipelined = e.generate(PROMPT, 200, params, stop_token_ids=())
    with engine(model, graph=True) as e:   # graph steps one at a time (no chaining)
        first = sample_step(e.prefill(PROMPT), params, len(PROMPT) - 1).token
        e._gpu.set_sampling(e._seqs[e._current].lib_id, params, params.seed)
        stepped, token = [first], first
        for _ in range(199):
            token, _ = e._step(token, "sampled")
            stepped.append(token)
    assert stepped == pipelined


def test_stop_token_cancels_the_chained_step(model):
    params = PARAMS[1]
    with engine(model, graph=True) as e:
        full = e.generate(PROMPT, 100, params, stop_token_ids=())
    stop = full[40]
    with engine(model, graph=True) as e:
        cut = e.generate(PROMPT, 100, params, stop_token_ids=[stop])
        assert e.position == len(PROMPT) + len(cut) - 1
    assert cut == full[:full.index(stop) + 1]


def test_stream_closed_early_leaves_the_fed_tokens(model):
    params = PARAMS[0]
    with engine(model, graph=True) as e:
        full = e.generate(PROMPT, 60, params, stop_token_ids=())
        e.reset()
        tokens = e.stream(PROMPT, 60, params, stop_token_ids=())
        got = [next(tokens) for _ in range(25)]
        tokens.close()               # the launched chained step is waited for and dropped
        assert got == full[:25]
        assert e.history == tuple(PROMPT + got[:-1])


def test_changing_temperature_does_not_recapture(model):
    with engine(model, graph=True) as e:
        e.generate(PROMPT, 20, SamplingParams(temperature=0.7, seed=1), stop_token_ids=())
        captures = e.stats()["captures"]
        e.reset()
        e.generate(PROMPT, 20, SamplingParams(temperature=1.3, top_k=5, seed=2), stop_token_ids=())
        assert e.stats()["captures"] == captures
