"""Sampling (greedy, temperature, top-k, top-p) and the shared generation loop."""
from __future__ import annotations

import numpy as np
import pytest

from onegraph.sampling import SamplingParams, filtered_distribution, sample

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

    def draw(params):
        """30 tokens, each sampled from the row of the token before (at row i), with the params'
        seed."""
        token, out = 3, []
        for i in range(30):
            token = sample(table[token % 50], params, position=i)
            out.append(token)
        return out

    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    a = draw(params)
    b = draw(params)
    c = draw(SamplingParams(temperature=1.0, top_p=0.95, seed=43))
    assert a == b
    assert a != c
    assert len(a) == 30


def test_validation_errors():
    for bad in (dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=-1),
                dict(top_k=1.5), dict(top_p=0.0), dict(top_p=1.01)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="NaN"):
        sample(np.array([0.0, np.nan]), SamplingParams())
    with pytest.raises(ValueError, match="vector"):
        sample(np.zeros((2, 2)), SamplingParams())
