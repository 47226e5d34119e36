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

When to draft, and how many (AdaptiveK over StepCosts): a verify step of k drafts costs C(k)
plain tokens (measured online by the engine: running means of the wall time of a plain token,
pipelined on the graph path, and of a verify step per k) and yields E(k) tokens in expectation,
from the acceptance per draft position that recent verify steps show. Drafting happens only when
the best E(k) / C(k) is above 1, with that k; otherwise decoding takes plain steps, which on the
graph path stay pipelined (the drafter is asked after each token while the next step runs). Free
text therefore decodes almost entirely on the plain path, and repetitive text gets long drafts:
the cost of a verify step grows slowly with k, so once drafts are being accepted k_max pays.
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


class StepCosts:
    """Running means of the wall time of a plain token and of a verify step per draft count;
    cost(k) is the verify step of k drafts in plain tokens.

    Until both a plain token and some verify step are measured, cost(k) is the seed
    base + per_draft * k (a small model on a fast GPU, where a verify step costs about three
    pipelined plain steps: a conservative seed, since a larger model's verify step costs
    relatively less). A k never measured is priced from the nearest one measured, plus the
    seed's slope per draft. The drafter's own time is not counted: nothing for prompt lookup,
    a draft model's steps go unpriced."""

    def __init__(self, base: float = 2.5, per_draft: float = 0.14, smoothing: float = 0.1):
        if base <= 0 or per_draft < 0 or not 0 < smoothing <= 1:
            raise ValueError(f"step costs need base > 0, per_draft >= 0, 0 < smoothing <= 1 "
                             f"(got {base}, {per_draft}, {smoothing})")
        self.base, self.per_draft, self.smoothing = base, per_draft, smoothing
        self.plain_s: float | None = None     # mean seconds per plain token
        self.verify_s: dict[int, float] = {}  # draft count -> mean seconds per verify step

    def _mean(self, old: float | None, seconds: float) -> float:
        return seconds if old is None else old + self.smoothing * (seconds - old)

    def plain(self, seconds: float) -> None:
        """A plain token took `seconds` (pipelined: the time since the token before it)."""
        self.plain_s = self._mean(self.plain_s, seconds)

    def verify(self, k: int, seconds: float) -> None:
        """A verify step of k drafts took `seconds`."""
        self.verify_s[k] = self._mean(self.verify_s.get(k), seconds)

    def cost(self, k: int) -> float:
        """A verify step of k drafts, in plain tokens."""
        if self.plain_s is None or not self.verify_s:
            return self.base + self.per_draft * k
        nearest = min(self.verify_s, key=lambda m: (abs(m - k), m))
        return self.verify_s[nearest] / self.plain_s + self.per_draft * (k - nearest)


class AdaptiveK:
    """The draft length of each step: the k that maximises expected tokens per unit of cost,
    0 (a plain step) when no k beats a plain step.

    Acceptance per draft position j (0-based): p[j] is the chance that draft j is accepted
    given that drafts 0..j-1 were. Each verify step that proposed d drafts and accepted a of
    them counts a success at positions 0..a-1 and, when a < d, a failure at position a (the
    later positions were not tried). The counts decay by `decay` per verify step and by
    `plain_decay` per plain step, so the estimate follows recent steps, and
        p[j] = (successes[j] + weight * prior[j]) / (tries[j] + weight),
    prior[0] = `prior`, prior[j] = p[j - 1]: a position never tried is as likely as the one
    before it. A verify step of k drafts yields E(k) = 1 + p[0] + p[0]p[1] + ... + p[0]..p[k-1]
    tokens and costs C(k) plain tokens (StepCosts, measured online); next_k() answers the k in
    1..k_max with the largest E(k) / C(k), or 0 when that is not above 1.

    The prior is optimistic (with the seed costs, no evidence at all makes k_max pay), so a
    generation drafts from its first step and a fully accepted verify step lifts every deeper
    position at once: long accepted runs are reached after one or two verify steps. Rejections
    pull E(k) below C(k) and drafting stops; the plain steps that follow decay the evidence back
    towards the prior, which after a while (the longer, the more evidence there was) makes
    drafting pay again: one verify step probes whether the text has turned repetitive."""

    def __init__(self, k_max: int = 8, costs: StepCosts | None = None, prior: float = 0.8,
                 weight: float = 1.0, decay: float = 0.7, plain_decay: float = 0.95):
        if k_max < 1:
            raise ValueError(f"k_max={k_max} must be >= 1")
        if not 0 < prior < 1 or weight <= 0 or not 0 < decay <= 1 or not 0 < plain_decay <= 1:
            raise ValueError(f"AdaptiveK needs 0 < prior < 1, weight > 0, 0 < decay <= 1 and "
                             f"0 < plain_decay <= 1 (got {prior}, {weight}, {decay}, {plain_decay})")
        self.k_max = k_max
        self.costs = costs or StepCosts()
        self.prior, self.weight, self.decay, self.plain_decay = prior, weight, decay, plain_decay
        self.successes = np.zeros(k_max)   # [k_max] decayed accepted drafts per position
        self.tries = np.zeros(k_max)       # [k_max] decayed verify steps that reached the position

    def acceptance(self) -> np.ndarray:
        """p [k_max]: the estimated chance each draft position is accepted, given the ones before."""
        p = np.empty(self.k_max)
        prior = self.prior
        for j in range(self.k_max):
            prior = p[j] = (self.successes[j] + self.weight * prior) / (self.tries[j] + self.weight)
        return p

    def gains(self) -> np.ndarray:
        """E(k) / C(k) for k = 1..k_max [k_max]: expected tokens of a verify step of k drafts
        per plain token it costs."""
        expected = 1.0 + np.cumsum(np.cumprod(self.acceptance()))
        return expected / np.array([self.costs.cost(k) for k in range(1, self.k_max + 1)])

    def gain(self, k: int) -> float:
        """E(k) / C(k) of a verify step of k drafts (1..k_max)."""
        return float(self.gains()[k - 1])

    def next_k(self) -> int:
        """The draft length for the next step; 0: decode it without drafting."""
        gains = self.gains()
        best = int(np.argmax(gains))
        return best + 1 if gains[best] > 1.0 else 0

    def pays(self, k: int) -> bool:
        """Whether a verify step of k proposed drafts (the drafter may give fewer than asked)
        is expected to beat plain steps."""
        return 1 <= k <= self.k_max and self.gain(k) > 1.0

    def drafts(self, drafter: Drafter, context: Sequence[int], limit: int) -> list[int]:
        """The drafts worth a verify step after context (its last token not yet fed): up to
        min(next_k(), limit) from the drafter, or [] when it proposes none or they would not pay
        (it may give fewer than asked). A policy overrides next_k() and pays(), not this."""
        k = min(self.next_k(), limit)
        drafts = drafter.propose(context, k) if k > 0 else []
        return drafts if drafts and self.pays(len(drafts)) else []

    def plain_steps(self, n: int) -> None:
        """n steps ran without drafting."""
        factor = self.plain_decay ** n
        self.successes *= factor
        self.tries *= factor

    def update(self, proposed: int, accepted: int) -> None:
        """A verify step with `proposed` drafts accepted `accepted` of them."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted={accepted} is outside 0..proposed={proposed}")
        if proposed == 0:
            return
        self.successes *= self.decay
        self.tries *= self.decay
        self.successes[:accepted] += 1
        self.tries[:accepted] += 1
        if accepted < min(proposed, self.k_max):
            self.tries[accepted] += 1


def make_drafter(mode: str) -> Drafter:
    """The drafter of a speculative mode name (SPECULATIVE_MODES). "ngram" matches 2 to 4
    tokens: a single-token match in free text mostly proposes what does not follow, and each
    such verify step costs more than the plain step it replaces, while the repeats that pay
    (quoting, summarising, editing the input) match longer suffixes anyway."""
    if mode == "ngram":
        return NgramDrafter(n_min=2)
    raise ValueError(f"speculative={mode!r} is not one of {SPECULATIVE_MODES}")
