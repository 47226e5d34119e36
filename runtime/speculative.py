"""Speculative greedy decoding: drafters, the adaptive draft length and the acceptance rule.

A step of batch-1 decoding reads every weight to produce one token. A verify step
(Engine's speculative generation; cuda/verify.cu on the GPU, ReferenceDecoder.verify on the
CPU) feeds the last accepted token and k drafted tokens in one pass and returns the greedy
token after each of the k + 1 positions, each bit-identical to what a decode step at that
position gives. The drafts are accepted while they equal those tokens (accepted_drafts), and
the token after the last accepted one comes free, so every verify step yields between 1 and
k + 1 tokens, exactly the ones plain greedy decoding would have produced. The rows of rejected
drafts are rolled back (their K/V rows become invisible and are overwritten later).

Drafters (one interface, Drafter.propose(context, k)):
  NgramDrafter  prompt lookup: the last n tokens (n = n_max down to n_min) matched against the
                sequence's own earlier tokens (prompt and output); proposes what followed the
                latest match. Free to run; pays on prompts whose answer repeats the input
                (summarise, quote, fix typos in, repeat a paragraph).
  DraftModelDrafter  a smaller model (another Engine over the same vocabulary) decodes k tokens
                greedily ahead on its own sequence; that sequence follows the target's accepted
                tokens, truncated back to the common prefix when drafts were rejected.

AdaptiveK picks k for each step from recent acceptance: it grows while whole drafts are
accepted, shrinks to what was accepted when they are not, and after `patience` verify steps in
a row that accepted nothing it stops drafting for a cool-down (doubling up to max_cooldown while
that repeats), so a prompt with nothing useful to look up decodes almost entirely on the plain
path.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

SPECULATIVE_MODES = ("ngram",)


class Drafter(Protocol):
    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k tokens guessed to follow context (which ends with the last accepted token,
        not yet fed); [] when there is no guess."""


class NgramDrafter:
    """Prompt lookup over the sequence's own tokens. For n from n_max down to n_min: the
    latest earlier occurrence of context's last n tokens that has a continuation; proposes up
    to k tokens of that continuation.

    It keeps an index (n-gram -> latest start) of the context it last saw and extends it when the
    next context extends that one (a generation's contexts only grow), so a step costs the host
    O(tokens added), not O(context); any other context rebuilds the index."""

    def __init__(self, n_min: int = 1, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"ngram sizes need 1 <= n_min <= n_max (got n_min={n_min}, n_max={n_max})")
        self.n_min, self.n_max = n_min, n_max
        self._tokens: list[int] = []
        self._latest: dict[tuple, int] = {}   # n-gram -> latest start i with a token after it

    def _extend(self, context: Sequence[int]) -> None:
        old = len(self._tokens)
        if len(context) < old or list(context[:old]) != self._tokens:
            self._tokens, self._latest, old = [], {}, 0
        tokens = self._tokens
        tokens.extend(int(t) for t in context[old:])
        end = len(tokens)
        for n in range(self.n_min, self.n_max + 1):
            # Starts i with i + n <= end - 1 (a continuation exists); those with i + n <=
            # old - 1 are in the index already.
            for i in range(max(0, old - n), end - n):
                self._latest[tuple(tokens[i:i + n])] = i

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        self._extend(context)
        if k <= 0:
            return []
        tokens = self._tokens
        end = len(tokens)
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            i = self._latest.get(tuple(tokens[end - n:]))
            if i is not None:
                return tokens[i + n:i + n + k]
        return []


class DraftModelDrafter:
    """Drafts from another engine (the draft model) decoding greedily on its selected sequence.

    propose(context, k) truncates that sequence to the longest prefix it shares with context
    (rows of rejected drafts, or of another conversation, go; nothing is re-prefilled), keeping
    at least the last token to feed, feeds the rest of context (its logits give the first
    draft) and decodes k - 1 more greedy steps. The sequence then holds context and all drafts
    but the last, which is what the next call's context starts with when they are accepted.
    The draft engine is the drafter's: whatever its selected sequence holds is replaced."""

    def __init__(self, engine, vocab_size: int):
        """engine: the draft model's Engine; vocab_size: the target model's vocabulary."""
        if engine.config.vocab_size != vocab_size:
            raise ValueError(f"draft model vocabulary {engine.config.vocab_size} != the target model's "
                             f"{vocab_size}: a draft model must share the target's tokenizer")
        self.engine = engine

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        engine = self.engine
        k = min(k, engine.max_seq_len - len(context))   # the draft rows must fit its context
        if k <= 0 or not context:
            return []
        held = engine.history
        common = 0
        limit = min(len(held), len(context) - 1)       # the last token is fed again: its logits
        while common < limit and held[common] == context[common]:
            common += 1
        engine.truncate(common)
        rest = [int(t) for t in context[common:]]
        logits = engine.step(rest[0]) if len(rest) == 1 else engine.prefill(rest)
        first = int(np.argmax(logits))
        return [first] + engine.decode_greedy(first, k - 1)


def accepted_drafts(drafts: Sequence[int], verified: Sequence[int]) -> int:
    """How many drafts the verify step accepts: the longest prefix with drafts[j] ==
    verified[j] (verified[j] is the greedy token after position j, whose input was the last
    accepted token for j = 0 and drafts[j - 1] after)."""
    a = 0
    while a < len(drafts) and a < len(verified) and int(drafts[a]) == int(verified[a]):
        a += 1
    return a


class AdaptiveK:
    """The draft length of each verify step, from what the last ones accepted.

    k starts at k_start; a verify step that accepts all k drafts raises it by one (up to k_max),
    one that accepts a < k drafts sets it to max(k_min, a + 1). After `patience` verify steps
    in a row that accept nothing, next_k() answers 0 (decode without drafting) for a cool-down
    of `cooldown` steps, doubled each time that happens again up to max_cooldown; any accepted
    draft resets the cool-down."""

    def __init__(self, k_max: int = 8, k_min: int = 1, k_start: int = 4, patience: int = 2,
                 cooldown: int = 4, max_cooldown: int = 64):
        if not 1 <= k_min <= k_start <= k_max:
            raise ValueError(f"draft lengths need 1 <= k_min <= k_start <= k_max "
                             f"(got {k_min}, {k_start}, {k_max})")
        if patience < 1 or cooldown < 1 or max_cooldown < cooldown:
            raise ValueError("patience and cooldown must be >= 1, max_cooldown >= cooldown")
        self.k_max, self.k_min, self.patience = k_max, k_min, patience
        self.k = k_start
        self.base_cooldown, self.max_cooldown = cooldown, max_cooldown
        self.cooldown = cooldown
        self.misses = 0        # verify steps in a row that accepted nothing
        self.pause = 0         # plain steps left before drafting again

    def next_k(self) -> int:
        """The draft length for the next step; 0: decode it without drafting."""
        return 0 if self.pause > 0 else self.k

    def plain_steps(self, n: int) -> None:
        """n steps ran without drafting (the cool-down counts them down)."""
        self.pause = max(0, self.pause - n)

    def update(self, proposed: int, accepted: int) -> None:
        """A verify step with `proposed` drafts accepted `accepted` of them."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted={accepted} is outside 0..proposed={proposed}")
        if proposed == 0:
            return
        if accepted == proposed:
            self.k = min(self.k_max, max(self.k, proposed) + 1)
        else:
            self.k = max(self.k_min, accepted + 1)
        if accepted > 0:
            self.misses = 0
            self.cooldown = self.base_cooldown
            return
        self.misses += 1
        if self.misses >= self.patience:
            self.pause = self.cooldown
            self.cooldown = min(self.max_cooldown, 2 * self.cooldown)
            self.misses = 0


def make_drafter(mode: str) -> Drafter:
    """The drafter of a speculative mode name (SPECULATIVE_MODES). "ngram" matches 2 to 4
    tokens: a single-token match in free text mostly proposes what does not follow, and each
    such verify step costs more than the plain step it replaces, while the repeats that pay
    (quoting, summarising, editing the input) match longer suffixes anyway."""
    if mode == "ngram":
        return NgramDrafter(n_min=2)
    raise ValueError(f"speculative={mode!r} is not one of {SPECULATIVE_MODES}")
