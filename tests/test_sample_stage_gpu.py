"""The sampling stage (cuda/sample.cu) alone on given logits (og_test_sample): its draws against
the float64 distribution written out in test_sampling_reference.py (chi-square over 100k draws
on a 50-token vocabulary, every filter and their combinations), token for token against the
reference sampler (sampling.draws), and its edge cases."""
from __future__ import annotations

import numpy as np
import pytest

import capi_testing as ct
from gpu_support import require_gpu
from onegraph import capi
from onegraph.sampling import SamplingParams, draws, sample_step
from test_sampling_reference import (CONFIGS, COUNTS, LOGITS, N_DRAWS, V, chi_square_critical,
                                     expected_distribution)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _gpu():
    require_gpu()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_chi_square_against_the_exact_distribution(config):
    params = SamplingParams(**config)
    penalized = any(k.endswith("penalty") for k in config)
    counts = COUNTS if penalized else None
    want = expected_distribution(params, counts)
    tokens, values, _ = ct.sample(LOGITS, params, np.arange(N_DRAWS), counts, seed=99)
    seen = np.bincount(tokens, minlength=V)
    assert seen[want == 0].sum() == 0                               # filtered ids never drawn
    kept = want > 0
    expected = N_DRAWS * want[kept]
    chi2 = float(((seen[kept] - expected) ** 2 / expected).sum())
    assert chi2 < chi_square_critical(int(kept.sum()) - 1), (chi2, int(kept.sum()))
    # each draw's value is its token's log-probability under the final distribution
    np.testing.assert_allclose(values[:1000], np.log(want[tokens[:1000]]), atol=1e-5)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_draws_are_the_reference_samplers(config):
    """The same Philox race: the stage picks the reference's token at every row (they may differ
    only where two race keys meet within the last bit of a float64 exp/log: not at these rows)."""
    params = SamplingParams(**config)
    counts = COUNTS if any(k.endswith("penalty") for k in config) else None
    positions = np.arange(5000, 7000)
    tokens, _, _ = ct.sample(LOGITS, params, positions, counts, seed=2 ** 63 + 17)
    assert tokens.tolist() == draws(LOGITS, params, 2 ** 63 + 17, positions, counts).tolist()


def test_top_logprobs_are_the_references():
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, min_p=0.02, logprobs=20, seed=11)
    _, _, top = ct.sample(LOGITS, params, [3])
    want = sample_step(LOGITS, params, 3).top
    assert [i for i, _ in top] == [i for i, _ in want]
    np.testing.assert_allclose([lp for _, lp in top], [lp for _, lp in want], atol=1e-6)


def test_filters_that_leave_one_id_give_the_argmax():
    argmax = int(np.argmax(LOGITS))
    for params in (SamplingParams(temperature=1.0, top_p=1e-9), SamplingParams(temperature=2.0, top_k=1),
                   SamplingParams(temperature=1.0, min_p=1.0), SamplingParams(temperature=0.7, top_p=1e-30)):
        tokens, values, _ = ct.sample(LOGITS, params, np.arange(200), seed=3)
        assert set(tokens.tolist()) == {argmax}
        assert np.all(values == 0.0)                              # probability 1 after the cut
    tokens, _, _ = ct.sample(LOGITS, SamplingParams(), np.arange(5))     # temperature 0: greedy
    assert set(tokens.tolist()) == {argmax}


def test_top_k_past_the_vocabulary_is_off():
    positions = np.arange(3000)
    off, _, _ = ct.sample(LOGITS, SamplingParams(temperature=1.0), positions, seed=8)
    for k in (V, V + 1, 10 ** 6):
        got, _, _ = ct.sample(LOGITS, SamplingParams(temperature=1.0, top_k=k), positions, seed=8)
        assert got.tolist() == off.tolist()


def test_minus_inf_logits_are_never_drawn():
    masked = LOGITS.copy()
    masked[:V - 2] = -np.inf
    tokens, _, _ = ct.sample(masked, SamplingParams(temperature=5.0), np.arange(400), seed=1)
    assert set(tokens.tolist()) == {V - 2, V - 1}


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(),
                                    SamplingParams(temperature=0.9, top_k=5, top_p=0.8)],
                         ids=["sampled", "greedy", "filtered"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_logits_are_an_error_with_a_message(params, bad):
    broken = LOGITS.copy()
    broken[9] = bad
    with pytest.raises(capi.LibraryError) as info:
        ct.sample(broken, params, [4])
    assert info.value.status == capi.OG_E_NONFINITE_LOGITS
    assert "NaN or +inf" in str(info.value)


def test_overflow_and_all_minus_inf_are_an_error():
    for logits, params in ((np.array([3e38, 1.0], np.float32), SamplingParams(temperature=0.01)),
                           (np.full(4, -np.inf, np.float32), SamplingParams(temperature=1.0))):
        with pytest.raises(capi.LibraryError) as info:
            ct.sample(logits, params, [0])
        assert info.value.status == capi.OG_E_NONFINITE_LOGITS
