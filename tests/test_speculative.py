"""Speculative decoding on the CPU path: the prompt-lookup drafter, the acceptance rule, the
adaptive draft length, the reference's verify and rollback, and Engine.generate(speculative=)
giving plain greedy decoding's tokens and state."""
import numpy as np
import pytest

from gpu_support import synthetic
from onegraph.engine import Engine, EngineError
from onegraph.reference import ReferenceDecoder
from onegraph.sampling import SamplingParams
from onegraph.speculative import AdaptiveK, NgramDrafter, StepCosts, accepted_drafts, make_drafter
from real_model import smollm2_gguf
from speculative_support import EverySixth, PinnedCosts


def lookup_oracle(context, k, n_min=1, n_max=4):
    """Prompt lookup by brute force: the latest earlier match of the longest suffix."""
    end = len(context)
    for n in range(min(n_max, end - 1), n_min - 1, -1):
        suffix = list(context[end - n:])
        for i in range(end - n - 1, -1, -1):
            if list(context[i:i + n]) == suffix:
                return list(context[i + n:i + n + k])
    return []


# ---- the drafter ------------------------------------------------------------------------
@pytest.mark.parametrize("context, k, expected", [
    ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),            # 2-gram [1, 2] at 0
    ([5, 2, 9, 7, 2, 8, 5, 2], 3, [9, 7, 2]),      # the longer match wins over 1-gram [2] at 4
    ([1, 7, 1, 8, 1], 2, [8, 1]),                  # the latest earlier occurrence
    ([1, 2, 3, 4], 4, []),                         # nothing repeats
    ([6], 2, []),                                  # a single token has no earlier occurrence
    ([3, 4, 3, 4, 3], 8, [4, 3]),                  # the continuation ends at the context's end
    ([9, 1, 2, 3, 4, 5, 1, 2, 3, 4], 2, [5, 1]),   # 4-gram, k caps the proposal
])
def test_ngram_drafter_cases(context, k, expected):
    assert NgramDrafter().propose(context, k) == expected
    assert lookup_oracle(context, k) == expected


def test_ngram_drafter_k_zero_and_bad_sizes():
    assert NgramDrafter().propose([1, 2, 1], 0) == []
    with pytest.raises(ValueError, match="n_min <= n_max"):
        NgramDrafter(n_min=3, n_max=2)


def test_ngram_drafter_incremental_index_matches_brute_force():
    """Contexts that grow (a generation), shrink or change (a rebuild) give the oracle's
    proposals at every step."""
    rng = np.random.default_rng(0)
    drafter = NgramDrafter()
    context = [int(t) for t in rng.integers(0, 6, 5)]
    for step in range(300):
        k = int(rng.integers(1, 9))
        assert drafter.propose(context, k) == lookup_oracle(context, k), step
        if step % 97 == 96:
            context = [int(t) for t in rng.integers(0, 6, 7)]           # another sequence
        else:
            context = context + [int(t) for t in rng.integers(0, 6, int(rng.integers(1, 4)))]


def test_make_drafter_refuses_unknown_modes():
    drafter = make_drafter("ngram")
    assert isinstance(drafter, NgramDrafter)
    assert drafter.propose([1, 7, 1, 8, 1], 2) == []            # a 1-gram match only: no draft
    assert drafter.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # 2-gram
    with pytest.raises(ValueError, match="'draft'"):
        make_drafter("draft")


# ---- acceptance and the adaptive draft length ---------------------------------------------
@pytest.mark.parametrize("drafts, verified, expected", [
    ([4, 5, 6], [4, 5, 6, 7], 3),
    ([4, 5, 6], [4, 9, 6, 7], 1),
    ([4, 5, 6], [1, 5, 6, 7], 0),
    ([], [3], 0),
])
def test_accepted_drafts(drafts, verified, expected):
    assert accepted_drafts(drafts, verified) == expected


def test_step_costs_seed_then_measured_means():
    costs = StepCosts(base=2.5, per_draft=0.14, smoothing=0.5)
    assert costs.cost(4) == pytest.approx(2.5 + 4 * 0.14)     # the seed, nothing measured
    costs.plain(1e-3)
    assert costs.cost(4) == pytest.approx(3.06)               # still the seed: no verify step yet
    costs.verify(4, 3e-3)
    assert costs.cost(4) == pytest.approx(3.0)                # 3 ms / 1 ms
    assert costs.cost(6) == pytest.approx(3.0 + 2 * 0.14)     # from k=4 plus the seed's slope
    assert costs.cost(1) == pytest.approx(3.0 - 3 * 0.14)
    costs.plain(2e-3)                                         # mean 1 + 0.5 * (2 - 1) = 1.5 ms
    costs.verify(4, 5e-3)                                     # mean 4 ms
    assert costs.cost(4) == pytest.approx(4 / 1.5)
    costs.verify(8, 6e-3)
    assert costs.cost(7) == pytest.approx(6 / 1.5 - 0.14)     # k=8 is nearer than k=4
    assert costs.cost(6) == pytest.approx(4 / 1.5 + 2 * 0.14)  # equally near: the smaller k
    with pytest.raises(ValueError, match="smoothing"):
        StepCosts(smoothing=0)


def test_adaptive_k_weighs_acceptance_against_cost():
    """Costs C(k) = 1 + 0.5 k, prior 0.8 at weight 1, counts halved per verify step and per
    plain step. E(k) = 1 + p0 + p0 p1 + ...; next_k is the k of the largest E(k) / C(k) > 1."""
    a = AdaptiveK(k_max=8, costs=StepCosts(base=1.0, per_draft=0.5), prior=0.8, weight=1.0,
                  decay=0.5, plain_decay=0.5)
    # No evidence: p = 0.8 everywhere. E(1) / C(1) = 1.8 / 1.5 = 1.2, E(2) / C(2) = 2.44 / 2 =
    # 1.22, E(3) / C(3) = 2.952 / 2.5 = 1.1808.
    assert a.acceptance() == pytest.approx([0.8] * 8)
    assert a.gain(2) == pytest.approx(1.22) and a.gain(3) == pytest.approx(1.1808)
    assert a.next_k() == 2
    # Both drafts accepted: p0 = (1 + 0.8) / 2 = 0.9, p1 = (1 + 0.9) / 2 = 0.95, the untried
    # positions 0.95 too. E(4) = 1 + 0.9 + 0.855 + 0.81225 + 0.7716375 = 4.3388875 over 3;
    # E(5) adds 0.733055625: 5.071943125 / 3.5 = 1.44913 beats E(4) (1.44630) and E(6) (1.44209).
    a.update(2, 2)
    assert a.acceptance()[:3] == pytest.approx([0.9, 0.95, 0.95])
    assert a.gain(4) == pytest.approx(4.3388875 / 3)
    assert a.gain(5) == pytest.approx(5.071943125 / 3.5)
    assert a.next_k() == 5
    # Nothing accepted of 5: counts halve (successes [0.5, 0.5], tries [0.5, 0.5]) and position 0
    # is tried once more (tries [1.5, 0.5]): p0 = 1.3 / 2.5 = 0.52, p1 = 1.02 / 1.5 = 0.68.
    # E(1) / C(1) = 1.52 / 1.5 = 1.0133; E(2) / C(2) = (1.52 + 0.3536) / 2 = 0.9368.
    a.update(5, 0)
    assert a.acceptance()[:2] == pytest.approx([0.52, 0.68])
    assert a.next_k() == 1
    assert a.pays(1) and not a.pays(2)
    # Another miss: successes [0.25, 0.25], tries [1.75, 0.25]; p0 = 1.05 / 2.75 = 0.3818:
    # E(1) = 1.3818 < C(1), and every longer k is worse. Plain steps from here.
    a.update(1, 0)
    assert a.acceptance()[0] == pytest.approx(1.05 / 2.75)
    assert a.next_k() == 0 and not a.pays(1)
    # One plain step halves the counts: p0 = (0.125 + 0.8) / 1.875 = 0.4933, E(1) = 1.4933 < 1.5.
    a.plain_steps(1)
    assert a.next_k() == 0
    # A second: p0 = (0.0625 + 0.8) / 1.4375 = 0.6, E(1) = 1.6 > 1.5; p1 = 0.6625 / 1.0625,
    # E(2) = 1.6 + 0.6 * 0.62353 = 1.97412 < 2. Drafting is back, one draft at a time.
    a.plain_steps(1)
    assert a.acceptance()[0] == pytest.approx(0.6)
    assert a.gain(1) == pytest.approx(1.6 / 1.5) and a.gain(2) == pytest.approx(1.97412 / 2, rel=1e-5)
    assert a.next_k() == 1
    with pytest.raises(ValueError, match="outside"):
        a.update(2, 3)
    with pytest.raises(ValueError, match="k_max=0"):
        AdaptiveK(k_max=0)
    with pytest.raises(ValueError, match="0 < prior < 1"):
        AdaptiveK(prior=1.0)


def test_adaptive_k_with_seed_costs_drafts_long_runs_and_stops_on_free_text():
    """The seed costs C(k) = 2.5 + 0.14 k (a verify step near three plain steps): no evidence
    (p = 0.8) gives E(8) = (1 - 0.8^9) / 0.2 = 4.3289 over C(8) = 3.62, 1.1958, just above
    E(7) / C(7) = 4.1611 / 3.48 = 1.1957; a run of 8 accepted keeps k at 8; a first draft
    rejected (p0 = 0.8 / 2 = 0.4, so E(k) < 1 / 0.6 < C(1)) stops drafting."""
    a = AdaptiveK()
    assert a.gain(8) == pytest.approx((1 - 0.8 ** 9) / 0.2 / 3.62)
    assert a.next_k() == 8
    a.update(8, 8)
    assert a.next_k() == 8
    b = AdaptiveK()
    b.update(8, 0)
    assert b.acceptance()[0] == pytest.approx(0.4)
    assert b.next_k() == 0
    # A verify step of one draft measured at 1.1 plain steps (a large model), 1.24 for two (the
    # seed's slope): p = 0.4 everywhere now pays, E(1) / C(1) = 1.4 / 1.1 = 1.273 beating
    # E(2) / C(2) = 1.56 / 1.24 = 1.258.
    cheap = StepCosts()
    cheap.plain(1e-3)
    cheap.verify(1, 1.1e-3)
    c = AdaptiveK(costs=cheap)
    c.update(8, 0)
    assert c.gain(1) == pytest.approx(1.4 / 1.1) and c.gain(2) == pytest.approx(1.56 / 1.24)
    assert c.next_k() == 1



def test_adaptive_k_drafts_follow_the_policy_hooks():
    """drafts() asks next_k() for the length and pays() for what the drafter gave, so a policy
    that overrides those two (EverySixth) decides on every path that drafts."""
    context = [1, 2, 3, 4, 5, 6, 1, 2]            # the 2-gram [1, 2] proposes 3, 4, 5, 6, 1, 2
    never = AdaptiveK()
    never.update(8, 0)                            # its own gains: no k pays
    assert never.drafts(NgramDrafter(), context, 8) == []
    policy = EverySixth()
    policy.update(8, 0)
    assert policy.drafts(NgramDrafter(), context, 8) == []    # 0 plain steps since: no drafts
    policy.plain_steps(5)
    assert policy.drafts(NgramDrafter(), context, 8) == [3, 4, 5, 6]
    assert policy.drafts(NgramDrafter(), context, 2) == [3, 4]

# ---- the reference's verify and rollback --------------------------------------------------
@pytest.mark.parametrize("kv", ["fp32", "int8"])
def test_reference_verify_equals_steps_and_truncate_rolls_back(kv):
    config, tensors = synthetic("tiny-dense")
    prompt, feed = [3, 17, 99, 250], [7, 41, 300, 12, 5]
    stepped = ReferenceDecoder(config, tensors, kv_dtype=kv, max_seq_len=32)
    stepped.prefill(prompt)
    expected = np.stack([stepped.step(t) for t in feed])
    verifier = ReferenceDecoder(config, tensors, kv_dtype=kv, max_seq_len=32)
    verifier.prefill(prompt)
    got = verifier.verify(feed)
    assert got.shape == (len(feed), config.vocab_size)
    assert np.array_equal(got, expected)
    assert verifier.position == len(prompt) + len(feed)
    # Keep two of the five rows, then feed other tokens: as if the rejected rows never existed.
    verifier.truncate(len(prompt) + 2)
    fresh = ReferenceDecoder(config, tensors, kv_dtype=kv, max_seq_len=32)
    fresh.prefill(prompt + feed[:2])
    assert np.array_equal(verifier.step(88), fresh.step(88))
    with pytest.raises(ValueError, match="outside 0..7"):
        verifier.truncate(8)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        verifier.verify([1] * 26)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verifier.verify([1, config.vocab_size])
    assert verifier.position == 7                 # refused calls changed nothing


# ---- Engine.generate(speculative="ngram") == plain greedy ---------------------------------
REPETITIVE = [3, 17, 99, 250, 4, 61, 200, 8] * 3


def plain_and_speculative(config, tensors, prompt, n, costs=None, **kwargs):
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=128, device="cpu") as plain, \
            Engine.from_tensors(config, tensors, kv="int8", max_seq_len=128, device="cpu") as spec:
        spec.step_costs = costs or PinnedCosts()   # by default: draft whenever the drafter has drafts
        expected = plain.generate(prompt, n, **kwargs)
        got = spec.generate(prompt, n, speculative="ngram", **kwargs)
        return expected, got, plain.history, spec.history, spec.stats()


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-llama", "tiny-moe"])
def test_speculative_generate_equals_plain_greedy(preset):
    config, tensors = synthetic(preset)
    expected, got, plain_history, spec_history, stats = plain_and_speculative(
        config, tensors, REPETITIVE, 40, stop_token_ids=())
    assert got == expected and len(got) == 40
    assert spec_history == plain_history          # the same rows: rejected drafts rolled back
    assert stats["verify_steps"] > 0 and stats["drafted"] > 0
    assert stats["tokens"] == len(REPETITIVE) + 39


@pytest.mark.parametrize("cut", [1, 2, 5, 13])
def test_speculative_generate_stops_where_plain_stops(cut):
    """A stop token inside an accepted run, and max_new_tokens inside one, end the generation at
    the same token, with the same rows held."""
    config, tensors = synthetic("tiny-dense")
    full, _, _, _, _ = plain_and_speculative(config, tensors, REPETITIVE, 30, stop_token_ids=())
    stop = full[cut]
    expected, got, plain_history, spec_history, _ = plain_and_speculative(
        config, tensors, REPETITIVE, 30, stop_token_ids=[stop])
    assert got == expected and got[-1] == stop
    assert spec_history == plain_history
    expected, got, plain_history, spec_history, _ = plain_and_speculative(
        config, tensors, REPETITIVE, cut + 1, stop_token_ids=())
    assert got == expected == full[:cut + 1]
    assert spec_history == plain_history


def test_speculative_generate_drafts_only_when_verify_steps_pay():
    """Verify steps pinned at 20 plain steps (more than the 9 tokens one can give): no verify
    step, plain greedy's tokens; at one plain step, drafts whenever there are any."""
    config, tensors = synthetic("tiny-dense")
    expected, got, plain_history, spec_history, stats = plain_and_speculative(
        config, tensors, REPETITIVE, 40, costs=PinnedCosts(base=20.0), stop_token_ids=())
    assert got == expected and spec_history == plain_history
    assert stats["verify_steps"] == 0
    _, got, _, _, stats = plain_and_speculative(config, tensors, REPETITIVE, 40, stop_token_ids=())
    assert got == expected and stats["verify_steps"] > 0


def test_speculative_generate_measures_step_costs():
    """Unpinned, the engine measures its plain tokens and verify steps (the CPU reference's
    verify step costs several plain steps: drafting then stops) and the tokens stay plain
    greedy's."""
    config, tensors = synthetic("tiny-dense")
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=128, device="cpu") as plain, \
            Engine.from_tensors(config, tensors, kv="int8", max_seq_len=128, device="cpu") as spec:
        expected = plain.generate(REPETITIVE, 40, stop_token_ids=())
        assert spec.generate(REPETITIVE, 40, speculative="ngram", stop_token_ids=()) == expected
        assert spec.history == plain.history
        costs = spec.step_costs
        assert costs.plain_s > 0
        assert bool(costs.verify_s) == (spec.stats()["verify_steps"] > 0)


@pytest.mark.parametrize("cut", [None, 13, 27])
def test_speculative_generate_with_plain_runs_between_verify_steps(monkeypatch, cut):
    """A policy that drafts only every sixth step: runs of plain steps between verify steps
    (the step-by-step path on the CPU), plain greedy's tokens and rows, stop tokens included."""
    monkeypatch.setattr("onegraph.engine.AdaptiveK", EverySixth)
    config, tensors = synthetic("tiny-dense")
    full, _, _, _, _ = plain_and_speculative(config, tensors, REPETITIVE, 48, stop_token_ids=())
    stop = [] if cut is None else [full[cut]]
    expected, got, plain_history, spec_history, stats = plain_and_speculative(
        config, tensors, REPETITIVE, 48, stop_token_ids=stop)
    assert got == expected and spec_history == plain_history
    if cut is None:
        assert stats["verify_steps"] > 0


def test_speculative_generate_refuses_sampling_and_unknown_modes():
    config, tensors = synthetic("tiny-dense")
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="cpu") as engine:
        with pytest.raises(ValueError, match="is not one of"):
            engine.generate([1, 2, 3], 4, speculative="draft")
        with pytest.raises(ValueError, match="decodes greedily"):
            engine.generate([1, 2, 3], 4, SamplingParams(temperature=0.7), speculative="ngram")
        assert engine.position == 0
        with pytest.raises(EngineError, match="exceeds max_seq_len"):
            engine.generate([1, 2, 3], 70, speculative="ngram")
        assert engine.position == 0


@pytest.mark.slow
def test_speculative_generate_real_model_equals_plain():
    """SmolLM2-135M-Instruct (the trained model), asked to repeat a sentence: the drafts come
    from the prompt and the output equals plain greedy decoding."""
    path = smollm2_gguf()
    from onegraph.text import Tokenizer
    tokenizer = Tokenizer.from_model(path)
    text = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the "
            "river bank, while the farmer watches from his porch.")
    prompt = tokenizer.encode_chat([{"role": "user", "content": text}])
    with Engine.from_pretrained(path, kv="int8", max_seq_len=256, device="cpu") as engine:
        engine.step_costs = PinnedCosts()   # draft whenever the drafter has drafts
        expected = engine.generate(prompt, 16)
        plain_history = engine.history
        engine.reset()
        got = engine.generate(prompt, 16, speculative="ngram")
        assert got == expected
        assert engine.history == plain_history
        assert engine.stats()["accepted"] > 0


# ---- Engine.generate(speculative=draft_engine) == plain greedy ----------------------------
def draft_and_plain(config, tensors, draft_tensors, prompt, n, draft_config=None, **kwargs):
    """(plain greedy tokens, speculative tokens with a draft engine, plain history, speculative
    history, the target's stats)."""
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=128, device="cpu") as plain, \
            Engine.from_tensors(config, tensors, kv="int8", max_seq_len=128, device="cpu") as target, \
            Engine.from_tensors(draft_config or config, draft_tensors, kv="int8", max_seq_len=128,
                                device="cpu") as draft:
        target.step_costs = PinnedCosts()   # draft at every step
        expected = plain.generate(prompt, n, **kwargs)
        got = target.generate(prompt, n, speculative=draft, **kwargs)
        return expected, got, plain.history, target.history, target.stats()


PROMPT = [3, 17, 99, 250, 4, 61]


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-llama"])
def test_draft_model_equal_to_target_accepts_every_draft(preset):
    config, tensors = synthetic(preset)
    expected, got, plain_history, spec_history, stats = draft_and_plain(
        config, tensors, tensors, PROMPT, 30, stop_token_ids=())
    assert got == expected and len(got) == 30
    assert spec_history == plain_history
    assert stats["verify_steps"] > 0 and stats["drafted"] > 0
    assert stats["accepted"] == stats["drafted"]


def test_draft_model_of_another_seed_gives_plain_greedy_tokens():
    config, tensors = synthetic("tiny-dense")
    _, other = synthetic("tiny-dense", seed=1)
    expected, got, plain_history, spec_history, stats = draft_and_plain(
        config, tensors, other, PROMPT, 30, stop_token_ids=())
    assert got == expected and len(got) == 30
    assert spec_history == plain_history
    assert stats["verify_steps"] > 0 and stats["accepted"] < stats["drafted"]


@pytest.mark.parametrize("cut", [1, 4, 11])
def test_draft_model_stops_where_plain_stops(cut):
    """A stop token inside an accepted run (every draft is accepted with the target as its own
    draft model), and max_new_tokens inside one."""
    config, tensors = synthetic("tiny-dense")
    full, _, _, _, _ = draft_and_plain(config, tensors, tensors, PROMPT, 24, stop_token_ids=())
    stop = full[cut]
    first = full.index(stop)
    expected, got, plain_history, spec_history, _ = draft_and_plain(
        config, tensors, tensors, PROMPT, 24, stop_token_ids=[stop])
    assert got == expected == full[:first + 1]
    assert spec_history == plain_history
    expected, got, plain_history, spec_history, _ = draft_and_plain(
        config, tensors, tensors, PROMPT, cut + 1, stop_token_ids=())
    assert got == expected == full[:cut + 1]
    assert spec_history == plain_history


def test_draft_model_follows_the_target_across_generations():
    """A second generation on the same target (a chat's next turn) reuses the draft engine's
    rows of the common prefix and still gives plain greedy tokens."""
    config, tensors = synthetic("tiny-dense")
    _, other = synthetic("tiny-dense", seed=1)
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=128, device="cpu") as plain, \
            Engine.from_tensors(config, tensors, kv="int8", max_seq_len=128, device="cpu") as target, \
            Engine.from_tensors(config, other, kv="int8", max_seq_len=128, device="cpu") as draft:
        target.step_costs = PinnedCosts()   # draft at every step
        for turn in ([5, 9, 2], [7, 7, 1, 30]):
            expected = plain.generate(turn, 12, stop_token_ids=())
            got = target.generate(turn, 12, speculative=draft, stop_token_ids=())
            assert got == expected
            assert target.history == plain.history
            # The draft's sequence holds a prefix of the target's context plus some drafts.
            context = list(target.history) + [got[-1]]
            common = next((i for i, (a, b) in enumerate(zip(draft.history, context)) if a != b),
                          min(len(draft.history), len(context)))
            assert common >= len(target.history) - 12


def test_draft_model_refusals():
    config, tensors = synthetic("tiny-dense")
    small_config, small_tensors = synthetic("tiny-llama")
    assert small_config.vocab_size != config.vocab_size
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="cpu") as target, \
            Engine.from_tensors(small_config, small_tensors, kv="int8", max_seq_len=64,
                                device="cpu") as other:
        with pytest.raises(ValueError, match=f"draft model vocabulary {small_config.vocab_size} != "
                                             f"the target model's {config.vocab_size}"):
            target.generate([1, 2, 3], 4, speculative=other)
        with pytest.raises(ValueError, match="an engine of its own"):
            target.generate([1, 2, 3], 4, speculative=target)
        with pytest.raises(ValueError, match="decodes greedily"):
            target.generate([1, 2, 3], 4, SamplingParams(temperature=0.7), speculative=other)
        assert target.position == 0 and other.position == 0


def test_engine_truncate():
    config, tensors = synthetic("tiny-dense")
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="cpu") as engine, \
            Engine.from_tensors(config, tensors, kv="int8", max_seq_len=64, device="cpu") as fresh:
        engine.prefill([3, 17, 99, 250, 4])
        engine.truncate(2)
        assert engine.history == (3, 17)
        fresh.prefill([3, 17])
        assert np.array_equal(engine.step(61), fresh.step(61))
        with pytest.raises(EngineError, match="outside 0..3"):
            engine.truncate(4)
        assert engine.history == (3, 17, 61)


def test_step_speculative_gives_step_greedy_tokens_and_refuses_bad_drafts():
    config, tensors = synthetic("tiny-dense")
    with Engine.from_tensors(config, tensors, kv="int8", max_seq_len=32, device="cpu") as plain, \
            Engine.from_tensors(config, tensors, kv="int8", max_seq_len=32, device="cpu") as spec:
        plain.prefill(PROMPT)
        spec.prefill(PROMPT)
        greedy = plain.decode_greedy(9, 4)
        plain.reset()
        plain.prefill(PROMPT)
        # Drafts equal to the first three greedy tokens, then a wrong one: four tokens come.
        wrong = (greedy[3] + 1) % config.vocab_size
        assert spec.step_speculative(9, greedy[:3] + [wrong]) == greedy
        assert plain.decode_greedy(9, 4) == greedy and spec.history == plain.history
        held = spec.history
        with pytest.raises(EngineError, match="0 drafts; a verify step takes 1..8"):
            spec.step_speculative(5, [])
        with pytest.raises(EngineError, match="outside the vocabulary"):
            spec.step_speculative(5, [1, config.vocab_size])
        with pytest.raises(EngineError, match="max_tokens=0"):
            spec.step_speculative(5, [1], max_tokens=0)
        assert spec.history == held
        # max_tokens cuts the run (the stop-token cut: the generate tests above).
        assert spec.step_speculative(greedy[-1], [3], max_tokens=1) == plain.decode_greedy(greedy[-1], 1)
        assert spec.history == plain.history
