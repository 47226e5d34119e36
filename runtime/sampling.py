"""Token sampling: choosing the next token from the logits, the same way on every path.

The generation loop that calls it is the engine's (runtime/engine.py, Engine.stream); the CPU
(reference) and GPU paths hand it the same logits, so they pick the same tokens.

sample_step() is the sampler of both paths: the numpy mirror of the GPU stage (cuda/sample.cu),
step for step, with the same counter-based generator (philox.py), so a seed gives the same tokens
on the CPU path, the GPU path and the GPU's graph path. For one step (logits l [V] float32, the
counts c [V] of the tokens generated so far, the row `position` whose logits these are):

  1. penalties (float32, where c > 0):  l = l / r if l > 0 else l * r   (repetition_penalty r)
                                        l = l - frequency_penalty * c
                                        l = l - presence_penalty
  2. temperature 0: greedy, the argmax of l (lowest id first); value 0. Else z = l / T (float32).
     A NaN or +inf in the logits, a +inf in z, or z all -inf is an error (NonFiniteLogits),
     never a token; -inf logits are ids that are never drawn (w = 0).
  3. d = z - max(z) (float32); w = float32(exp(float64(d))), so w = 1 at the maximum;
     W = floor(w * 2**40) (uint64): the fixed-point weight every mass comparison uses, so that a
     sum does not depend on its order (GPU blocks add in any order; integers are exact).
  4. order: d descending, ties by the lower id. The kept set is a prefix of it, of length
     n = min(n_k, n_p, n_m):  n_k = top_k (0 or >= V: V);
     n_p = the shortest prefix (of the first n_k) whose mass float64(cumsum W) >= float64(top_p)
           * float64(S_k), S_k = sum of W over the first n_k (top_p 1: n_k);
     n_m = the ids with w >= min_p (a prefix: w is monotone in d; min_p 0: V). n >= 1 always.
  5. draw (the exponential race): token = the kept id with the largest
     float32(float64(d) - log(-log(u))), ties to the lower id, u = philox.uniforms(seed,
     position, id): the Gumbel-max trick, an exact draw from w restricted to the kept ids,
     needing neither a sort of the kept ids nor a prefix sum.
  6. value = float32(d[token] - log(S_n / 2**40)), S_n = sum of W over the kept ids: the
     token's log-probability under the final (filtered, renormalized) distribution; the top
     `logprobs` kept ids (in order) are reported the same way.

The GPU stage rounds exactly as listed (no fused multiply-adds in 1 and 2); only its exp and log
may differ from numpy's in the last bit of a float64, which changes a token only when two race
keys or a top-p comparison meet within that bit.

filtered_distribution() is the float64 textbook distribution of the old numpy sampler (top-k and
top-p only), kept for callers that want probabilities.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .philox import uniforms

MAX_LOGPROBS = 20          # top log-probabilities a step can report (the GPU result's room)
WEIGHT_SCALE = 2.0 ** 40   # fixed-point scale of the weights W (step 3)


class NonFiniteLogits(ValueError):
    """The logits (or logits / temperature) of a step hold a NaN or an infinity."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = no top-k filter
    top_p: float = 1.0         # 1.0 = no nucleus filter
    seed: int | None = None    # None = fresh OS entropy per stream() or generate() call
    min_p: float = 0.0         # 0 = off; keep ids with p >= min_p * p_max
    repetition_penalty: float = 1.0   # 1 = off; > 0
    presence_penalty: float = 0.0     # 0 = off
    frequency_penalty: float = 0.0    # 0 = off
    logprobs: int = 0          # report the top-n log-probabilities, n <= MAX_LOGPROBS

    def __post_init__(self):
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 = off)")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1] (1 = off)")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1] (0 = off)")
        if not (self.repetition_penalty > 0.0 and np.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be a finite number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not np.isfinite(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a finite number (0 = off)")
        if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, (int, np.integer)) \
                or not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs={self.logprobs!r} must be an integer in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))
                                      or not 0 <= self.seed < 2 ** 64):
            raise ValueError(f"seed={self.seed!r} must be an integer in [0, 2**64) or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


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


@dataclass(frozen=True)
class SampleResult:
    token: int
    value: float                          # log-probability of token (0 for greedy)
    top: tuple[tuple[int, float], ...]    # (id, log-probability) of the first `logprobs` kept ids


def _penalized(logits: np.ndarray, params: SamplingParams, counts: np.ndarray | None) -> np.ndarray:
    """Step 1 (float32): the penalties over the ids generated so far (counts > 0)."""
    l = logits.astype(np.float32, copy=True)
    if counts is None:
        return l
    seen = np.asarray(counts) > 0
    c = np.asarray(counts, dtype=np.float32)[seen]
    v = l[seen]
    r = np.float32(params.repetition_penalty)
    v = np.where(v > 0, v / r, v * r).astype(np.float32)
    v = (v - np.float32(params.frequency_penalty) * c).astype(np.float32)
    v = (v - np.float32(params.presence_penalty)).astype(np.float32)
    l[seen] = v
    return l


def sample_step(logits: np.ndarray, params: SamplingParams, position: int,
                counts: np.ndarray | None = None, seed: int | None = None) -> SampleResult:
    """One step of the sampler (module docstring, steps 1-6) on logits [V] of row `position`;
    counts [V]: times each id was generated so far (None: none). seed overrides params.seed
    (Engine.stream draws one when params.seed is None)."""
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"logits must be a non-empty vector, got shape {logits.shape}")
    bad = np.isnan(logits) | (logits == np.inf)
    if bad.any():
        raise NonFiniteLogits(f"the logits of position {position} contain NaN or +inf "
                              f"(first at id {int(np.flatnonzero(bad)[0])})")
    l = _penalized(logits, params, counts)
    with np.errstate(over="ignore"):
        z = l if params.greedy else (l / np.float32(params.temperature)).astype(np.float32)
    if (z == np.inf).any():
        raise NonFiniteLogits(f"the penalized logits at position {position} overflow to +inf")
    if params.greedy:
        return SampleResult(int(np.argmax(z)), 0.0, ())
    if not (z.max() > -np.inf):
        raise NonFiniteLogits(f"logits / temperature ({params.temperature}) at position {position} overflow "
                              "to +inf, or every logit is -inf")
    d = (z - z.max()).astype(np.float32)
    kept, W = _kept_ids(d, params)
    seed_value = params.seed if seed is None else seed
    token = int(_race(d, kept, 0 if seed_value is None else seed_value, position))
    log_total = np.log(np.float64(W[kept].sum(dtype=np.uint64)) / WEIGHT_SCALE)
    value = float(np.float32(np.float64(d[token]) - log_total))
    top = tuple((int(i), float(np.float32(np.float64(d[i]) - log_total)))
                for i in kept[:params.logprobs])
    return SampleResult(token, value, top)


def _race(d: np.ndarray, kept: np.ndarray, seed: int, position):
    """Step 5: the kept id with the largest float32(d - log(-log(u))), ties to the lower id;
    position a row or a vector [m] of rows (then [m] tokens)."""
    u = uniforms(seed, position, kept)
    key = (d[kept].astype(np.float64) - np.log(-np.log(u))).astype(np.float32)
    ids = np.broadcast_to(kept, key.shape)
    best = key.max(axis=-1, keepdims=True)
    return np.where(key == best, ids, np.iinfo(np.int64).max).min(axis=-1)


def _kept_ids(d: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Steps 3-4: d [V] float32 (<= 0, max 0) -> (the kept ids [n], W [V] uint64). The kept
    ids are the first n of the order, in order; only when every id is kept (no filter) are they
    left unordered past the first params.logprobs (the race and the mass do not depend on it)."""
    V = d.size
    w = np.exp(d.astype(np.float64)).astype(np.float32)
    W = np.floor(w.astype(np.float64) * WEIGHT_SCALE).astype(np.uint64)
    n = params.top_k if 0 < params.top_k < V else V
    if params.top_p < 1.0:
        # S_k: over the first n_k, or over every id (a sum of integers: any order)
        total = W[_ranked(d, n)].sum(dtype=np.uint64) if n < V else W.sum(dtype=np.uint64)
        target = np.float64(np.float32(params.top_p)) * np.float64(total)
        m = min(n, 1024)   # the prefix that reaches the target is short unless the tail is flat
        while True:
            cum = np.cumsum(W[_ranked(d, m)], dtype=np.uint64)
            if m == n or np.float64(cum[-1]) >= target:
                break
            m = min(n, 8 * m)
        n = int(np.argmax(cum.astype(np.float64) >= target)) + 1
    if params.min_p > 0.0:
        n = min(n, int(np.count_nonzero(w >= np.float32(params.min_p))))
    if n < V:
        return _ranked(d, n), W
    head = _ranked(d, min(V, max(1, params.logprobs)))
    rest = np.ones(V, dtype=bool)
    rest[head] = False
    return np.concatenate([head, np.flatnonzero(rest)]), W


def _ranked(d: np.ndarray, m: int) -> np.ndarray:
    """The first m ids of the order (d descending, ties by the lower id): the ids at or above
    the m-th largest d (every one that can rank below m, ties included), sorted."""
    V = d.size
    if m >= V:
        return np.lexsort((np.arange(V), -d))
    ids = np.flatnonzero(d >= np.partition(d, V - m)[V - m])
    return ids[np.lexsort((ids, -d[ids]))][:m]


def draws(logits: np.ndarray, params: SamplingParams, seed: int, positions,
          counts: np.ndarray | None = None) -> np.ndarray:
    """sample_step's tokens (temperature > 0) at many rows at once with the same counts:
    positions [m] -> tokens [m]. The kept set does not depend on the row, only the race does."""
    sample_step(logits, params, 0, counts, seed)           # the same checks and errors
    z = (_penalized(np.asarray(logits), params, counts) / np.float32(params.temperature)).astype(np.float32)
    d = (z - z.max()).astype(np.float32)
    return _race(d, _kept_ids(d, params)[0], seed, np.asarray(positions))


def sample(logits: np.ndarray, params: SamplingParams, position: int = 0,
           counts: np.ndarray | None = None) -> int:
    """The next token id from logits [vocab] (sample_step's token)."""
    return sample_step(logits, params, position, counts).token
