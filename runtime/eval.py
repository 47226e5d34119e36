"""Perplexity of a model over a token sequence, decoded step by step as in generation.

Position t's logits (after feeding tokens[0..t]) score tokens[t+1]; the negative
log-likelihood is taken from a float64 log-softmax of the fp32 logits. Decoding step by step
(rather than the batched prefill) measures the decode path itself: its weight format and KV
cache format, on the GPU or the CPU reference.
"""
from __future__ import annotations

import math

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """logits [..., vocab] -> float64 log-probabilities."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def perplexity(engine, tokens: list[int]) -> dict:
    """Feed tokens[:-1] to a fresh sequence of `engine`; returns {"tokens": scored tokens,
    "nll": mean negative log-likelihood in nats, "perplexity": exp(nll)}."""
    if len(tokens) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {len(tokens)}")
    if len(tokens) - 1 > engine.max_seq_len:
        raise ValueError(f"{len(tokens)} tokens do not fit the context of {engine.max_seq_len}: "
                         f"pass a shorter text or --max-tokens")
    engine.reset()
    total = 0.0
    for t in range(len(tokens) - 1):
        logp = log_softmax(engine.step(tokens[t]))
        total -= float(logp[tokens[t + 1]])
    engine.reset()
    nll = total / (len(tokens) - 1)
    return {"tokens": len(tokens) - 1, "nll": nll, "perplexity": math.exp(nll)}
