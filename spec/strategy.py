"""The seam of speculative decoding: a strategy has a front half (which spans draft, what their
results mean) and a rank half (the draft passes, where the weights are).

Plain decoding is the strategy with no drafts: `Speculation` itself, and no drafter. The others:
two-pass MTP / EAGLE-3 drafting, chains or trees (`spec/two_pass.py`), and naive fused drafting
(`spec/naive.py`). Verification of a draft is the same for both (`spec/verify.py`).

A step's result carries, per verified span, the tokens it yields (the accepted drafts and the
target's own) and per drafting span the next draft tree; the front keeps the tree on the request
and the scheduler sends it back to verify in the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

from dserve.scheduler.kv_manager import KVCacheManager
from dserve.scheduler.scheduler import Span
from dserve.spec.tree import depths
from dserve.step.plan import SpanOutcome


@dataclass(frozen=True)
class SpeculativeConfig:
    """The speculation settings, built from `EngineConfig`'s fields (`EngineConfig.speculative`):
    no defaults here, so the two cannot drift."""

    algorithm: str | None
    """`mtp`, `eagle3`, or None (plain decoding)."""
    num_steps: int
    """Draft passes per step (the depth of the draft tree)."""
    eagle_topk: int
    """Branches kept per draft pass."""
    num_draft_tokens: int
    """Tokens per verify, root included."""
    naive: bool
    """The draft fused into the target's pass."""


class Speculation:
    """The front's half; this base drafts nothing (plain decoding)."""

    def __init__(self, num_steps: int = 1, num_nodes: int = 0):
        self.num_steps, self.num_nodes = num_steps, num_nodes
        self.verify_steps = 0
        self.proposed = [0] * num_steps  # per draft depth: verifies with a node there
        self.accepted = [0] * num_steps  # ... and that took it

    def flags(self, span: Span, kv: KVCacheManager) -> tuple[bool, bool]:
        """(catch_up, proposes) of a scheduled span: whether the draft runs over its tokens, and
        whether it proposes a tree after it (pages for the tree's nodes are allocated here)."""
        return False, False

    def settle(self, span: Span, outcome: SpanOutcome) -> None:
        """A span's result arrived: count a verify, keep the next draft tree on the request."""
        req = span.req
        if span.draft:
            self._count(span, len(outcome.tokens) - 1)
        req.draft_tokens, req.draft_parents = list(outcome.draft), list(outcome.draft_parents)

    def _count(self, span: Span, accepted: int) -> None:
        self.verify_steps += 1
        for d in range(max(depths(span.parents), default=0)):
            self.proposed[d] += 1
            self.accepted[d] += d < accepted
        req = span.req
        req.accepted_per_step.append(accepted)
        steps = req.accepted_per_step
        req.extra_meta.update(
            spec_verify_ct=len(steps),
            spec_accept_length=round(sum(steps) / len(steps) + 1, 4),
            spec_accepted_per_step=list(steps),
        )


def make_speculation(config: SpeculativeConfig) -> Speculation:
    """The front's half of the configured strategy."""
    if not config.algorithm:
        return Speculation()
    if config.naive:
        from dserve.spec.naive import Naive

        return Naive(config)
    from dserve.spec.two_pass import TwoPass

    return TwoPass(config)


def make_drafter(config: SpeculativeConfig, steps):
    """The rank's half of the configured strategy (None: plain decoding); `steps` is the rank's
    `StepRunner`."""
    if not config.algorithm:
        return None
    if config.naive:
        from dserve.spec.naive import NaiveDrafter

        return NaiveDrafter()
    from dserve.spec.two_pass import TwoPassDrafter

    return TwoPassDrafter(config, steps)
