"""Naive (fused) speculation: steps 1, topk 1, two tokens per verify, and the draft's extend in the
same forward call as the target's verify, so a decode step is one fixed-shape call (one CUDA graph
per batch size on a GPU) instead of a target pass then a draft pass.

The draft runs over exactly the target's tokens (same positions, slots and page tables; its own
pool), reading the target's hidden state at each row. Its input at row r is the token after r:
known for prompt rows inside the span, and otherwise, computed on the device, the target's argmax
at r. For a verify span [root, d1] that is right whatever the verdict: when d1 is accepted it is
the argmax after the root, and when it is rejected the argmax is the token that replaces it; the
row of a rejected d1 is overwritten by the next step (it is that step's root). So greedy requests
get the draft KV and proposals of the two-pass path, token for token. A sampled request's emitted
token may differ from the argmax: its draft then reads another token than the one kept, which
lowers its acceptance but not its exactness (verification never trusts the draft).

The rank reads the draft's logits after the root and after d1 and keeps the one after the last
accepted token: the next step's d1.
"""

from __future__ import annotations

import torch

from dserve.attention.backend import FusedDraft
from dserve.scheduler.kv_manager import KVCacheManager
from dserve.scheduler.scheduler import Span
from dserve.spec.strategy import Speculation, SpeculativeConfig
from dserve.step.rank_state import RankSpan


class Naive(Speculation):
    """The front's half: every span's tokens feed the fused draft; drafting requests propose."""

    def __init__(self, config: SpeculativeConfig):
        super().__init__(1, 1)

    def flags(self, span: Span, kv: KVCacheManager) -> tuple[bool, bool]:
        drafts = span.req.params.takes_drafts
        return drafts, drafts and span.completes


class NaiveDrafter:
    """The rank's half: the draft's inputs join the target's pass; its proposals after."""

    def __init__(self):
        self.firsts: list[int | None] = []

    def fuse(self, batch, spans: list[RankSpan]) -> None:
        """The draft's part of the pass over `spans` (laid out as the target's), and per span the
        first of its rows in the draft's logits (None: no proposal from it)."""
        next_ids, from_target, draft_rows = [], [], []
        self.firsts = []
        for span in spans:
            p, req = span.plan, span.req
            after = []
            if not p.draft:
                after = req.tokens_at(p.start + 1, p.start + p.length + 1 - p.samples)
            for i in range(p.length):
                by_target = bool(p.draft) or (p.samples and i == p.length - 1)
                from_target.append(_target_row(span, i) if by_target else -1)
                next_ids.append(0 if by_target else after[i])
            wants = _proposing_rows(p)
            self.firsts.append(len(draft_rows) if wants and p.proposes else None)
            if self.firsts[-1] is not None:
                draft_rows += [span.row + i for i in wants]
        ints = [torch.tensor(v, dtype=torch.int64) for v in (next_ids, from_target, draft_rows)]
        batch.fused_draft = FusedDraft(*ints)

    def propose(self, plan, spans: list[RankSpan], draft_logits) -> None:
        """Each proposing span's next d1: the draft's argmax after its last kept token."""
        argmax = draft_logits.argmax(dim=-1).tolist()  # one small copy, not the logits
        for span, first in zip(spans, self.firsts):
            if first is None:
                continue
            p = span.plan
            row = first + (len(span.kept) - 1 if p.draft else 0)
            span.draft_out = ([argmax[row]], [-1])


def _target_row(span: RankSpan, i: int) -> int:
    """The target's logits row that token `i` of `span` reads: its own in a verify, the span's
    last (the token sampled after it) otherwise."""
    if span.plan.draft:
        return span.logits_row + i
    return span.logits_row


def _proposing_rows(p) -> list[int]:
    """The span's rows whose draft outputs may propose: every node of a verify, else the last
    row of a span that samples."""
    if p.draft:
        return list(range(p.length))
    if p.samples:
        return [p.length - 1]
    return []
