"""Two-pass speculative decoding with the checkpoint's MTP layer or an EAGLE-3 draft: chains
(topk 1) or trees (topk > 1).

A step is one target pass over the scheduled spans. A decoding request's span is its newest token
(the root) followed by its draft tree's nodes (`spec/tree.py`); the rank verifies it
(`spec/verify.py`) and then runs the draft passes that grow the next tree, all before it answers.

The draft first catches up over every span it follows (prompt chunks too): at position i it reads
the target's hidden state h_i and token i + 1, writing its own KV into the same pages of its own
pool. A verified span is caught up over as many rows as it has, the kept ones first: rows past
the accepted path write draft KV at positions that the next passes overwrite before anything
reads them, and so every group's pass has a token count the front knows when it plans the step
(DP attention needs every group's count; CUDA graphs need few shapes). The draft's logits after
the last kept row give the root's topk children. Each further pass expands the best `topk` leaves
so far (by the sum of the draft's log-probabilities along the path), each reading its parent's
draft hidden state and seeing its own ancestors' draft KV (in the draft pool past the request's
tokens, pages the front allocated with the step). The `num_draft_tokens - 1` best-scoring nodes
make the tree the next step verifies.

Requests with penalties or logprobs do not draft (their per-token processing depends on the tokens
before); they decode one token per step in the same batches.
"""

from __future__ import annotations

import torch

from dserve.attention.backend import PassShape
from dserve.scheduler.kv_manager import KVCacheManager
from dserve.scheduler.scheduler import Span
from dserve.spec.strategy import Speculation, SpeculativeConfig
from dserve.spec.tree import Candidate, select
from dserve.step.batch import Seq, assemble_draft
from dserve.step.plan import GroupPlan, StepPlan
from dserve.step.rank_state import RankSpan


class TwoPass(Speculation):
    """The front's half: which spans draft, and the pages of each tree's nodes."""

    def __init__(self, config: SpeculativeConfig):
        super().__init__(config.num_steps, config.num_draft_tokens - 1)
        self.topk = config.eagle_topk

    def flags(self, span: Span, kv: KVCacheManager) -> tuple[bool, bool]:
        req = span.req
        if not req.params.takes_drafts:
            return False, False
        if not span.completes:
            return True, False
        nodes = (self.num_steps - 1) * self.topk  # the expanded nodes, past the kept tokens
        return True, kv.allocate_slots(req.rid, span.start + span.length + nodes)


def catch_up_shape(group: GroupPlan) -> PassShape:
    spans = [s for s in group.spans if s.catch_up]
    return PassShape(
        sum(s.length for s in spans),
        max((s.length for s in spans), default=0),
        max((s.start + s.length for s in spans), default=0),
    )


def expansion_shape(group: GroupPlan, step: int, topk: int) -> PassShape:
    """Pass `step` of a group's trees (its longest context at most: the tree's base is at most
    the span's end)."""
    spans = [s for s in group.spans if s.proposes]
    longest = max((s.start + s.length for s in spans), default=0)
    return PassShape(len(spans) * topk, topk, longest + step * topk, topk > 1)


def top_children(logits: torch.Tensor, topk: int) -> list[list[tuple[float, int]]]:
    """Per row of a draft pass's `logits`, its `topk` (log-probability, token) pairs: computed
    where the logits are, and only these cross to the host."""
    top = logits.float().log_softmax(dim=-1).topk(topk, dim=-1)
    return [list(zip(v, i)) for v, i in zip(top.values.tolist(), top.indices.tolist())]


class TwoPassDrafter:
    """The rank's half: the draft passes after a step's target pass."""

    def __init__(self, config: SpeculativeConfig, steps):
        self.num_steps, self.topk = config.num_steps, config.eagle_topk
        self.num_nodes = config.num_draft_tokens - 1
        self.steps = steps  # the rank's StepRunner: tables and model

    def fuse(self, batch, spans: list[RankSpan]) -> None:
        """Nothing joins the target's pass."""

    def propose(self, plan: StepPlan, spans: list[RankSpan], draft_logits) -> None:
        """Run the draft passes (every rank the same number, empty where its group has nothing)
        and leave each proposing span's next tree in `draft_out`."""
        groups = plan.groups
        if not any(s.catch_up for g in groups for s in g.spans):
            return
        seqs, trees = self._catch_up(spans)
        logits = self._run(seqs, [catch_up_shape(g) for g in groups])
        top = top_children(logits, self.topk)
        for i, tree in enumerate(trees):
            tree.add(top[i : i + 1], [tree.root_row], [-1], self.topk)
        if not any(s.proposes for g in groups for s in g.spans):
            return
        for step in range(1, self.num_steps):
            seqs = [tree.expansion(step, self.topk) for tree in trees]
            shapes = [expansion_shape(g, step, self.topk) for g in groups]
            top, row = top_children(self._run(seqs, shapes), self.topk), 0
            for tree in trees:
                k = len(tree.frontier)
                tree.add(top[row : row + k], list(range(row, row + k)), tree.frontier, self.topk)
                row += k
        for tree in trees:
            tree.span.draft_out = select(tree.candidates, self.num_nodes)

    def _run(self, seqs: list[Seq], shapes: list[PassShape]) -> torch.Tensor:
        steps = self.steps
        rows = steps.requests.tables.rows([s.holder for s in seqs])
        batch = assemble_draft(seqs, rows, steps.page_size)
        return steps.runner.forward(batch, shapes)

    def _catch_up(self, spans: list[RankSpan]):
        """The draft over every span it follows, as many rows as the span has (the kept ones
        first), and a growing tree for each span that proposes (its last kept row is the root)."""
        seqs, trees, pass_row = [], [], 0
        for span in spans:
            p, req = span.plan, span.req
            if not p.catch_up:
                continue
            kept, pad = span.kept, p.length - len(span.kept)
            tokens = req.tokens_at(p.start + 1, p.start + 1 + len(kept)) + [0] * pad
            hidden = [span.row + k for k in kept] + [span.row] * pad
            rows = [len(kept) - 1] if p.proposes else []
            seqs.append(Seq(p.slot, p.start, tokens, rows, hidden_rows=hidden))
            if p.proposes:
                trees.append(GrowingTree(span, pass_row + len(kept) - 1))
            pass_row += p.length
        return seqs, trees


class GrowingTree:
    """One request's draft tree while the draft passes run. Expanded nodes take the cache indices
    past the request's kept tokens, `topk` per pass: pass j's at base + (j-1)*topk ... base +
    j*topk - 1."""

    def __init__(self, span: RankSpan, root_row: int):
        self.span, self.root_row = span, root_row
        self.base = span.plan.start + len(span.kept)
        self.candidates: list[Candidate] = []
        self.frontier: list[int] = []  # candidates the next pass expands
        self.rows: list[int] = []  # per frontier node: the row of the pass that proposed it
        self.offsets: dict[int, int] = {}  # expanded candidate -> its cache index - base

    def add(self, top, rows: list[int], parents: list[int], topk: int) -> None:
        """The topk children of each of `parents` (candidate ids, -1: the root), `top` per parent
        the draft's (log-probability, token) pairs after it (`top_children`, computed at `rows`
        of the pass); the best topk become the frontier."""
        new = []
        for b, parent in enumerate(parents):
            above = self.candidates[parent] if parent >= 0 else None
            score = above.score if above else 0.0
            depth = above.depth + 1 if above else 1
            for value, token in top[b]:
                self.candidates.append(Candidate(token, parent, score + value, depth))
                new.append((len(self.candidates) - 1, rows[b]))
        best = sorted(new, key=lambda x: -self.candidates[x[0]].score)[:topk]
        self.frontier, self.rows = [c for c, _ in best], [r for _, r in best]

    def expansion(self, step: int, topk: int) -> Seq:
        """The frontier as a sequence of draft pass `step`: each node at its depth, reading its
        proposer's hidden state, seeing its expanded ancestors and itself."""
        start = step - 1
        for b, c in enumerate(self.frontier):
            self.offsets[c] = start * topk + b
        tokens = [self.candidates[c].token for c in self.frontier]
        slot = self.span.plan.slot
        rows = list(range(len(tokens)))
        seq = Seq(slot, self.base + start * topk, tokens, rows, hidden_rows=self.rows)
        if topk > 1:
            mask = torch.zeros(len(tokens), step * topk, dtype=torch.bool)
            for b, c in enumerate(self.frontier):
                while c >= 0:
                    mask[b, self.offsets[c]] = True
                    c = self.candidates[c].parent
            seq.positions, seq.mask = [self.base + start] * len(tokens), mask
        return seq
