"""Policies and costs that make speculative generation's choices known in advance, for tests
of its tokens and state (CPU and GPU)."""
from onegraph.speculative import AdaptiveK, StepCosts


class PinnedCosts(StepCosts):
    """Step costs that ignore measurements: C(k) = base + per_draft * k always. The default
    (a verify step costs one plain step) makes every k pay, so AdaptiveK drafts k_max tokens
    whenever the drafter has any: the CPU reference's verify step costs many plain steps, and
    measured costs would stop the drafting these tests check."""

    def __init__(self, base: float = 1.0, per_draft: float = 0.0):
        super().__init__(base=base, per_draft=per_draft)

    def plain(self, seconds: float) -> None:
        pass

    def verify(self, k: int, seconds: float) -> None:
        pass


class EverySixth(AdaptiveK):
    """Drafts 4 tokens once 5 plain steps have run since the last verify step, whatever the
    acceptance: plain runs stop for a verify step (on the graph path: the drafter asked after
    each pipelined token) and start again at known points."""

    def __init__(self, costs=None):
        super().__init__(costs=costs)
        self.plain = 0

    def next_k(self) -> int:
        return 4 if self.plain >= 5 else 0

    def pays(self, k: int) -> bool:
        return k >= 1

    def plain_steps(self, n: int) -> None:
        self.plain += n

    def update(self, proposed: int, accepted: int) -> None:
        self.plain = 0
