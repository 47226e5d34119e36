"""The reference sampler (sampling.sample_step) and its generator (philox.py), held against
published known answers and against distributions computed here, independently, in float64."""
from __future__ import annotations

import numpy as np
import pytest

from onegraph.philox import philox4x32_10, uniforms
from onegraph.sampling import NonFiniteLogits, SamplingParams, draws, sample_step

# Random123's kat_vectors (the curand Philox4x32-10): counter[4], key[2] -> output[4].
PHILOX_KAT = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


@pytest.mark.parametrize("counter,key,want", PHILOX_KAT)
def test_philox_known_answers(counter, key, want):
    assert philox4x32_10(counter, key).tolist() == want


def test_uniforms_layout():
    # token id i at row p under seed s: word i & 3 of philox((i >> 2, p, 0, 0), (s lo, s hi))
    seed, position, ids = 0x0123456789ABCDEF, 77, np.array([0, 5, 6, 7, 4097, 151935])
    got = uniforms(seed, position, ids)
    for i, u in zip(ids, got):
        word = philox4x32_10([i >> 2, position, 0, 0], [seed & 0xFFFFFFFF, seed >> 32])[i & 3]
        assert u == (int(word) + 0.5) / 2 ** 32
    rows = uniforms(seed, np.array([3, 77]), ids)
    np.testing.assert_array_equal(rows[1], got)
    assert 0.0 < got.min() and got.max() < 1.0


# ---- the distribution, written independently: float64, textbook definitions ----
V = 50
LOGITS = np.random.default_rng(2024).normal(0.0, 1.5, V).astype(np.float32)
COUNTS = np.zeros(V, np.int64)
COUNTS[[int(np.argmax(LOGITS)), 3, 7, 11]] = [2, 1, 3, 1]     # ids already generated
COUNTS[int(np.argmin(LOGITS))] = 1                             # a negative logit penalized


def expected_distribution(params: SamplingParams, counts=None) -> np.ndarray:
    """probs [V] float64 of the filtered, renormalized distribution (0 outside it)."""
    l = LOGITS.astype(np.float64)
    if counts is not None:
        seen = counts > 0
        r = params.repetition_penalty
        l[seen] = np.where(l[seen] > 0, l[seen] / r, l[seen] * r)
        l[seen] -= params.frequency_penalty * counts[seen] + params.presence_penalty
    p = np.exp(l / params.temperature - np.max(l / params.temperature))
    p /= p.sum()
    order = sorted(range(V), key=lambda i: (-p[i], i))
    if params.top_k:
        order = order[:params.top_k]
    q = p[order] / p[order].sum()
    if params.top_p < 1.0:
        mass = 0.0
        for n, x in enumerate(q, 1):
            mass += x
            if mass >= params.top_p:
                break
        assert abs(mass - params.top_p) > 1e-4 and abs(mass - x - params.top_p) > 1e-4  # no near-tie
        order = order[:n]
    if params.min_p:
        assert np.all(np.abs(p[order] / p.max() - params.min_p) > 1e-4)
        order = [i for i in order if p[i] >= params.min_p * p.max()]
    out = np.zeros(V)
    out[order] = p[order] / p[order].sum()
    return out


CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.3, top_k=7),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, min_p=0.15),
    dict(temperature=0.9, top_k=12, top_p=0.85),
    dict(temperature=1.1, top_p=0.9, min_p=0.05),
    dict(temperature=0.8, top_k=20, top_p=0.95, min_p=0.02),
    dict(temperature=1.0, top_k=100),                      # top_k past the vocabulary: off
    dict(temperature=1.0, repetition_penalty=1.3),
    dict(temperature=1.0, presence_penalty=0.7, frequency_penalty=0.4),
    dict(temperature=0.9, top_k=15, top_p=0.9, min_p=0.03, repetition_penalty=1.2,
         presence_penalty=0.3, frequency_penalty=0.2),
]
N_DRAWS = 100_000


def chi_square_critical(df: int) -> float:
    """The 99.9% point of chi-square(df) (Wilson-Hilferty; within 1% for df >= 3): a correct
    sampler exceeds it with probability 1e-3 (the seeds are fixed anyway)."""
    z = 3.090232                                   # the standard normal's 99.9% point
    return df * (1.0 - 2.0 / (9.0 * df) + z * np.sqrt(2.0 / (9.0 * df))) ** 3


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_chi_square_against_the_exact_distribution(config):
    params = SamplingParams(**config)
    penalized = any(k.endswith("penalty") for k in config)
    counts = COUNTS if penalized else None
    want = expected_distribution(params, counts)
    tokens = draws(LOGITS, params, seed=99, positions=np.arange(N_DRAWS), counts=counts)
    seen = np.bincount(tokens, minlength=V)
    assert seen[want == 0].sum() == 0                               # filtered ids never drawn
    kept = want > 0
    expected = N_DRAWS * want[kept]
    chi2 = float(((seen[kept] - expected) ** 2 / expected).sum())
    assert chi2 < chi_square_critical(int(kept.sum()) - 1), (chi2, int(kept.sum()))


def test_draws_equal_step_by_step():
    params = SamplingParams(temperature=0.9, top_k=15, top_p=0.9, repetition_penalty=1.2)
    tokens = draws(LOGITS, params, seed=5, positions=np.arange(40, 60), counts=COUNTS)
    assert tokens.tolist() == [sample_step(LOGITS, params, p, COUNTS, seed=5).token for p in range(40, 60)]


def test_value_and_top_logprobs_are_the_final_distribution():
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, min_p=0.02, logprobs=20)
    want = expected_distribution(params)
    result = sample_step(LOGITS, params, position=3, seed=11)
    assert result.value == pytest.approx(np.log(want[result.token]), abs=1e-5)
    kept = sorted(np.flatnonzero(want), key=lambda i: (-want[i], i))
    assert [i for i, _ in result.top] == kept[:20]
    np.testing.assert_allclose([lp for _, lp in result.top], np.log(want[kept[:20]]), atol=1e-5)


def test_edge_cases():
    argmax = int(np.argmax(LOGITS))
    for params in (SamplingParams(temperature=1.0, top_p=1e-9), SamplingParams(temperature=2.0, top_k=1),
                   SamplingParams(temperature=1.0, min_p=1.0)):
        for p in range(20):                                   # all but one id filtered
            r = sample_step(LOGITS, params, p, seed=p)
            assert r.token == argmax and r.value == 0.0
    assert sample_step(LOGITS, SamplingParams(), 0).token == argmax          # temperature 0
    masked = LOGITS.copy()
    masked[:V - 2] = -np.inf                                  # -inf: never drawn
    got = {sample_step(masked, SamplingParams(temperature=5.0), p, seed=1).token for p in range(200)}
    assert got == {V - 2, V - 1}
    for bad in (np.nan, np.inf):
        broken = LOGITS.copy()
        broken[9] = bad
        with pytest.raises(NonFiniteLogits, match="id 9"):
            sample_step(broken, SamplingParams(temperature=1.0), 4)
        with pytest.raises(NonFiniteLogits):
            sample_step(broken, SamplingParams(), 4)
    with pytest.raises(NonFiniteLogits, match="overflow"):
        sample_step(np.array([3e38, 1.0], np.float32), SamplingParams(temperature=0.01), 0)
    with pytest.raises(NonFiniteLogits):
        sample_step(np.full(4, -np.inf, np.float32), SamplingParams(temperature=1.0), 0)


def test_seed_and_position_fix_the_draw():
    params = SamplingParams(temperature=1.0)
    a = [sample_step(LOGITS, params, p, seed=1).token for p in range(64)]
    assert a == [sample_step(LOGITS, params, p, seed=1).token for p in range(64)]
    assert a != [sample_step(LOGITS, params, p, seed=2).token for p in range(64)]
    assert len(set(a)) > 5


@pytest.mark.parametrize("bad", [dict(min_p=-0.1), dict(min_p=1.5), dict(repetition_penalty=0.0),
                                 dict(presence_penalty=float("inf")), dict(logprobs=21),
                                 dict(seed=-1), dict(seed=2 ** 64)])
def test_params_validation(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
