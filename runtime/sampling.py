"""Token sampling: choosing the next token from the logits, the same way on every path.

The generation loop that calls it is the engine's (runtime/engine.py, Engine.stream); the CPU
(reference) and GPU paths hand it the same logits, so they pick the same tokens.

sample(): temperature 0 is greedy (argmax, ties to the lowest id). Otherwise the distribution
softmax(logits / temperature) is computed in float64, restricted to the top_k most likely ids
(ties at the cut go to the lower id), then to the nucleus (the smallest prefix of the
descending distribution whose mass is >= top_p, never empty), renormalized, and drawn from with
one uniform number from a numpy Generator (inverse CDF), so a seed fixes the tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = no top-k filter
    top_p: float = 1.0         # 1.0 = no nucleus filter
    seed: int | None = None    # None = fresh OS entropy per stream() or generate() call

    def __post_init__(self):
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 = off)")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1] (1 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The distribution a non-greedy sample() draws from.

    logits [vocab] -> (ids [n] int64, probs [n] float64): the kept ids in descending probability
    (ties: lower id first) and their renormalized probabilities (sum 1).
    """
    z = np.asarray(logits, dtype=np.float64) / params.temperature
    z = z - np.max(z)
    p = np.exp(z)
    p /= p.sum()
    ids = np.argsort(-p, kind="stable")                    # descending, ties -> lower id
    if 0 < params.top_k < ids.size:
        ids = ids[:params.top_k]
    probs = p[ids] / p[ids].sum()
    if params.top_p < 1.0:
        # smallest prefix with mass >= top_p; at least one id, at most all of them
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p, side="left")) + 1
        keep = min(max(keep, 1), ids.size)
        ids = ids[:keep]
        probs = probs[:keep] / probs[:keep].sum()
    return ids, probs


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None = None) -> int:
    """Choose the next token id from logits [vocab] (see the module docstring)."""
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"logits must be a non-empty vector, got shape {logits.shape}")
    if np.isnan(logits).any():
        raise ValueError("logits contain NaN")
    if params.greedy:
        return int(np.argmax(logits))                      # first maximum = lowest id
    if rng is None:
        raise ValueError("sampling with temperature > 0 needs a numpy Generator (rng)")
    ids, probs = filtered_distribution(logits, params)
    cdf = np.cumsum(probs)
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(ids[min(index, ids.size - 1)])
