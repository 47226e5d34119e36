"""Sampling (greedy, temperature, top-k, top-p) and the shared generation loop."""
from __future__ import annotations

import numpy as np
import pytest

from onegraph.sampling import SamplingParams, filtered_distribution, generate, sample

LOGITS = np.array([1.0, 3.0, 2.5, 3.0, -1.0, 0.0, 2.0, -np.inf], np.float32)


def softmax64(z):
    z = np.asarray(z, np.float64)
    p = np.exp(z - z.max())
    return p / p.sum()


def test_greedy_is_argmax_with_ties_to_lowest_id():
    assert sample(LOGITS, SamplingParams()) == 1            # ids 1 and 3 tie at 3.0
    assert sample(np.array([0.0, 5.0, 4.0]), SamplingParams(temperature=0.0)) == 1
    assert sample(np.full(10, -2.0, np.float32), SamplingParams()) == 0


def test_temperature_distribution():
    ids, probs = filtered_distribution(LOGITS, SamplingParams(temperature=0.5))
    expected = softmax64(LOGITS.astype(np.float64) / 0.5)
    np.testing.assert_array_equal(ids[:4], [1, 3, 2, 6])        # descending, tie -> lower id
    np.testing.assert_allclose(probs, expected[ids], rtol=1e-12)
    np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-12)
    # higher temperature flattens, lower sharpens
    _, hot = filtered_distribution(LOGITS, SamplingParams(temperature=5.0))
    _, cold = filtered_distribution(LOGITS, SamplingParams(temperature=0.1))
    assert hot[0] < probs[0] < cold[0]


def test_top_k_filter():
    ids, probs = filtered_distribution(LOGITS, SamplingParams(temperature=1.0, top_k=3))
    np.testing.assert_array_equal(ids, [1, 3, 2])
    p = softmax64(LOGITS)[[1, 3, 2]]
    np.testing.assert_allclose(probs, p / p.sum(), rtol=1e-12)
    # the tie at the cut goes to the lower id
    ids, _ = filtered_distribution(LOGITS, SamplingParams(temperature=1.0, top_k=1))
    np.testing.assert_array_equal(ids, [1])
    # top_k >= vocab keeps everything
    ids, _ = filtered_distribution(LOGITS, SamplingParams(temperature=1.0, top_k=100))
    assert ids.size == LOGITS.size


def test_top_p_keeps_smallest_prefix_reaching_the_mass():
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    for top_p, kept in [(0.35, [1]), (0.45, [1, 3]), (0.69, [1, 3]), (0.71, [1, 3, 2]),
                        (0.95, [1, 3, 2, 0]), (1.0, [1, 3, 2, 0])]:
        ids, probs = filtered_distribution(logits, SamplingParams(temperature=1.0, top_p=top_p))
        np.testing.assert_array_equal(ids, kept, err_msg=f"top_p={top_p}")
        p = np.array([0.1, 0.4, 0.2, 0.3])[kept]
        np.testing.assert_allclose(probs, p / p.sum(), rtol=1e-9)
    # top-p applies to the top-k-renormalized distribution: within {1, 3}, 0.4/0.7 = 0.571
    ids, _ = filtered_distribution(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.55))
    np.testing.assert_array_equal(ids, [1])
    ids, _ = filtered_distribution(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.6))
    np.testing.assert_array_equal(ids, [1, 3])


def test_top_k_1_and_tiny_top_p_equal_greedy():
    rng = np.random.default_rng(0)
    for _ in range(50):
        logits = rng.standard_normal(1000).astype(np.float32)
        want = sample(logits, SamplingParams())
        assert sample(logits, SamplingParams(temperature=1.3, top_k=1), position=5) == want
        assert sample(logits, SamplingParams(temperature=0.7, top_p=1e-9), position=6) == want
        assert sample(logits, SamplingParams(temperature=0.7, min_p=1.0), position=7) == want


def test_same_seed_same_tokens():
    rng = np.random.default_rng(7)
    table = rng.standard_normal((50, 64)).astype(np.float32)     # a toy "model": logits by token

    def step_fn(token):
        return table[token % 50]

    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    a = generate(step_fn, [1, 2, 3], 30, params)
    b = generate(step_fn, [1, 2, 3], 30, params)
    c = generate(step_fn, [1, 2, 3], 30, SamplingParams(temperature=1.0, top_p=0.95, seed=43))
    assert a == b
    assert a != c
    assert len(a) == 30


class Recorder:
    """A step_fn that records what it was fed; its greedy choice after token t is t + 1."""

    def __init__(self, vocab=16):
        self.fed = []
        self.vocab = vocab

    def __call__(self, token):
        self.fed.append(token)
        logits = np.zeros(self.vocab, np.float32)
        logits[(token + 1) % self.vocab] = 10.0
        return logits


def test_generate_feeds_prompt_then_samples():
    step = Recorder()
    seen = []
    out = generate(step, [3, 4, 5], 4, on_token=seen.append)
    assert out == [6, 7, 8, 9] == seen
    assert step.fed == [3, 4, 5, 6, 7, 8]                       # the last new token is not fed


def test_generate_stops_on_stop_token_and_includes_it():
    step = Recorder()
    assert generate(step, [3], 10, stop_token_ids=[6, 12]) == [4, 5, 6]
    assert step.fed == [3, 4, 5]
    assert generate(Recorder(), [3], 2, stop_token_ids=[9]) == [4, 5]   # max_new_tokens first


def test_generate_uses_prefill_fn():
    step = Recorder()
    prefilled = []

    def prefill(tokens):
        prefilled.append(list(tokens))
        return step(tokens[-1])

    assert generate(step, [1, 2, 3], 2, prefill_fn=prefill) == [4, 5]
    assert prefilled == [[1, 2, 3]]


def test_generate_zero_new_tokens_feeds_the_prompt():
    step = Recorder()
    assert generate(step, [1, 2], 0) == []
    assert step.fed == [1, 2]


def test_validation_errors():
    with pytest.raises(ValueError, match="empty"):
        generate(Recorder(), [], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(Recorder(), [1], -1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(Recorder(), [1], 2.5)
    for bad in (dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=-1),
                dict(top_k=1.5), dict(top_p=0.0), dict(top_p=1.01)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="NaN"):
        sample(np.array([0.0, np.nan]), SamplingParams())
    with pytest.raises(ValueError, match="vector"):
        sample(np.zeros((2, 2)), SamplingParams())


def test_generate_greedy_takes_the_greedy_step_after_the_prompt():
    # greedy_step_fn replaces step_fn + argmax for every new token after the first (which comes
    # from the prompt's logits); the tokens are the same as without it.
    step, greedy_fed = Recorder(), []

    def greedy_step(token):
        greedy_fed.append(token)
        return int(np.argmax(step(token)))

    seen = []
    out = generate(step, [3, 4, 5], 4, on_token=seen.append, greedy_step_fn=greedy_step)
    assert out == [6, 7, 8, 9] == seen == generate(Recorder(), [3, 4, 5], 4)
    assert greedy_fed == [6, 7, 8]
    assert step.fed == [3, 4, 5, 6, 7, 8]
    assert generate(Recorder(), [3], 10, stop_token_ids=[6], greedy_step_fn=lambda t: t + 1) == [4, 5, 6]
    assert generate(Recorder(), [3], 0, greedy_step_fn=lambda t: 1 / 0) == []


def test_generate_sampling_ignores_the_greedy_step():
    params = SamplingParams(temperature=1.0, seed=7)

    def never(token):
        raise AssertionError("a greedy step while sampling")

    assert generate(Recorder(), [1, 2], 6, params, greedy_step_fn=never) == generate(Recorder(), [1, 2], 6, params)
