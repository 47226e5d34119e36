"""Token sampling and the generation loop, shared by the CPU (reference) and GPU paths.

Both paths hand ``generate`` a ``step_fn(token) -> logits [vocab]``; everything about choosing
the next token lives here, so the two paths pick the same tokens from the same logits.

sample(): temperature 0 is greedy (argmax, ties to the lowest id). Otherwise the distribution
softmax(logits / temperature) is computed in float64, restricted to the top_k most likely ids
(ties at the cut go to the lower id), then to the nucleus (the smallest prefix of the
descending distribution whose mass is >= top_p, never empty), renormalized, and drawn from with
one uniform number from a numpy Generator (inverse CDF), so a seed fixes the tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = no top-k filter
    top_p: float = 1.0         # 1.0 = no nucleus filter
    seed: int | None = None    # None = fresh OS entropy per generate() call

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


def generate(step_fn: Callable[[int], np.ndarray], prompt_ids: Sequence[int], max_new_tokens: int,
             params: SamplingParams = SamplingParams(), stop_token_ids: Iterable[int] = (),
             on_token: Callable[[int], None] | None = None,
             prefill_fn: Callable[[list[int]], np.ndarray] | None = None,
             greedy_step_fn: Callable[[int], int] | None = None,
             greedy_decode_fn: Callable | None = None) -> list[int]:
    """Feed the prompt, then sample up to max_new_tokens tokens; returns the new tokens.

    step_fn(token) -> logits [vocab] decodes one token. prefill_fn(tokens) -> logits of the last
    token, if given, feeds the whole prompt at once (the reference decoder's prefill skips the
    lm_head of all but the last token). Generation stops after a token of stop_token_ids (it is
    included in the result) or after max_new_tokens. on_token(token) is called for each new
    token as it is chosen. The last new token is not fed back to step_fn: the model state then
    holds the prompt and all but the last new token. greedy_step_fn(token) -> the greedy next
    token, if given, replaces step_fn + sample for greedy params after the prompt (an engine
    takes the argmax on the device; it must raise ValueError on NaN logits as sample() does).
    greedy_decode_fn(token, max_steps, stop_token_ids, on_token) -> tokens, if given, replaces
    that loop as a whole (Engine.decode_greedy: the same tokens, its steps pipelined).
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids is empty: generation needs at least one prompt token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    stop = {int(t) for t in stop_token_ids}
    rng = np.random.default_rng(params.seed)

    if prefill_fn is not None:
        logits = prefill_fn(prompt)
    else:
        for token in prompt:
            logits = step_fn(token)

    new_tokens: list[int] = []
    if max_new_tokens == 0:
        return new_tokens
    token = sample(logits, params, rng)
    while True:
        new_tokens.append(token)
        if on_token is not None:
            on_token(token)
        if token in stop or len(new_tokens) == max_new_tokens:
            return new_tokens
        if params.greedy and greedy_decode_fn is not None:
            return new_tokens + list(greedy_decode_fn(token, max_new_tokens - len(new_tokens), stop, on_token))
        if params.greedy and greedy_step_fn is not None:
            token = int(greedy_step_fn(token))
        else:
            token = sample(step_fn(token), params, rng)
