"""The front's side of speculative decoding: verify a step's draft tree, then run the draft passes
that grow the next one.

A step is one target pass over the scheduled spans. A decoding request's span is its newest token
(the root) followed by its draft tree's nodes (`spec/tree.py`; with topk 1 a chain d1..dk); the
target predicts after each of them. Verification keeps the longest path of drafts the target
agrees with and appends a token of the target's own, so a step yields 1..depth+1 tokens, each the
target's own (greedy) or distributed exactly as the target's draw (sampling). The KV of the nodes
off the path is dropped (their pages go back at once); the path's nodes, computed at their tree
rows, are moved to consecutive positions before the next pass reads the pool (`ForwardBatch.kv_moves`).

Then the draft catches up over every position the target just computed and kept (prompt chunks
too): at position i it reads the target's hidden state h_i and token i+1, writing its own KV into
the same pages of its own pool. Its logits after the last kept position give the root's topk
children. Each further draft pass expands the best `topk` leaves so far (by the sum of the draft's
log-probabilities along the path), each reading its parent's draft hidden state and seeing its own
ancestors' draft KV (in the draft pool past the request's tokens, where the next catch-up writes).
The `num_draft_tokens - 1` best-scoring nodes make the tree the next step verifies.

Requests with penalties or logprobs do not draft (their per-token processing depends on the tokens
before); they decode one token per step in the same batches.
"""

from __future__ import annotations

import torch

from dserve.runtime.batch import Seq, build_draft_batch, with_dp_counts
from dserve.runtime.sampler import processed_probs
from dserve.scheduler.kv_manager import KVCacheManager
from dserve.scheduler.request import Request
from dserve.scheduler.scheduler import Span
from dserve.spec.naive import fused_draft, take_proposals
from dserve.spec.tree import Candidate, accept_greedy, accept_sampled, depths, select


class Speculator:
    def __init__(
        self,
        num_steps: int,
        execute,
        topk: int = 1,
        num_draft_tokens: int | None = None,
        naive: bool = False,
    ):
        self.num_steps, self.topk, self.execute, self.naive = num_steps, topk, execute, naive
        self.fused_firsts: list[
            list
        ] = []  # naive: per group, each span's first row in the draft's logits
        self.fused_logits: list[
            torch.Tensor
        ] = []  # naive: per group, the draft's logits of the step
        self.num_nodes = (num_draft_tokens or num_steps + 1) - 1  # draft tokens one verify checks
        self.verify_steps = 0
        self.proposed = [
            0
        ] * num_steps  # per draft depth: verifies that had a node there, and took one
        self.accepted = [0] * num_steps
        self.moves: dict[
            int, list[tuple[int, int]]
        ] = {}  # DP group -> target-pool (src, dst) slots due

    def verify(
        self,
        span: Span,
        logits: torch.Tensor,
        argmax: list[int],
        kv: KVCacheManager,
        group: int = 0,
    ) -> list[int]:
        """Tokens a verified span yields. `logits` [len(span.draft) + 1, vocab] are the target's
        after each token of the span (on the rank's device), `argmax` their argmax ids. Sets the
        span's `rejected` and `kept`, and queues the moves of the accepted path's KV for the next
        pass of `group`."""
        req = span.req
        if req.params.greedy:
            path, tokens = accept_greedy(span.draft, span.parents, argmax)
        else:  # the walk draws from the request's generator, on the host
            probs = processed_probs(logits, [req] * logits.shape[0]).cpu()
            path, tokens = accept_sampled(span.draft, span.parents, probs, req.generator)
        span.rejected = len(span.draft) - len(path)
        span.kept = [0] + [n + 1 for n in path]
        slot = lambda pos: kv.slots(req.rid, pos, pos + 1)[0]
        self.moves.setdefault(group, []).extend(
            (slot(span.start + 1 + n), slot(span.start + 1 + i))
            for i, n in enumerate(path)
            if n != i
        )
        self._count(span, len(path))
        return tokens

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

    def attach_moves(self, batches: list) -> list:
        """Give each group's pending KV moves to its next batch: they run before anything reads the pool."""
        for group, batch in enumerate(batches):
            moves = self.moves.pop(group, None)
            if moves:
                batch.kv_moves = torch.tensor(moves, dtype=torch.int64).T.contiguous()
        return batches

    def fuse(self, plans: list[list[Span]], batches: list) -> None:
        """Naive mode: the draft's pass joins each group's target pass (`spec/naive.py`)."""
        if self.naive:
            self.fused_firsts = []
            for spans, batch in zip(plans, batches):
                batch.fused_draft, firsts = fused_draft(spans)
                self.fused_firsts.append(firsts)

    def split(self, batches: list, group_logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """Naive mode: the target's logits of each group; the draft's are kept for `propose`."""
        if not self.naive:
            return group_logits
        n = [len(b.logits_indices) for b in batches]
        self.fused_logits = [logits[k:] for logits, k in zip(group_logits, n)]
        return [logits[:k] for logits, k in zip(group_logits, n)]

    def propose(
        self, plans: list[list[Span]], kvs: list[KVCacheManager], pages_of=lambda req: req.rid
    ) -> None:
        """Draft passes after this step's target pass; leaves each drafting request's proposals in
        `req.draft_tokens` / `req.draft_parents`. `pages_of(req)` names the page table of a request,
        or None for one that ended (a prefill instance's request ends at its first token, its pages
        held to be sent: it still drafts, and the drafts travel with the first token). Naive mode
        reads the proposals off the fused pass instead."""
        if self.naive:
            for spans, firsts, draft_logits in zip(plans, self.fused_firsts, self.fused_logits):
                take_proposals(spans, firsts, draft_logits, lambda req: pages_of(req) is not None)
            return
        seqs, growing = self._catch_up(plans, pages_of)
        if not any(seqs):
            return
        everyone = [tree for trees in growing for tree in trees]
        logits = self._run(seqs, kvs)
        for trees, group_logits in zip(growing, logits):
            top = top_children(group_logits, self.topk)
            for i, tree in enumerate(trees):
                tree.add(top[i : i + 1], [tree.root_row], [-1], self.topk)
        for step in range(1, self.num_steps):
            seqs = [
                [t.expansion(step, self.topk) for t in trees if t.allocate(kv, step, self.topk)]
                for trees, kv in zip(growing, kvs)
            ]
            growing = [[t for t in trees if t.alive] for trees in growing]
            if not any(seqs):
                break
            logits = self._run(seqs, kvs)
            for trees, group_logits in zip(growing, logits):
                top, row = top_children(group_logits, self.topk), 0
                for tree in trees:
                    k = len(tree.frontier)
                    tree.add(
                        top[row : row + k], list(range(row, row + k)), tree.frontier, self.topk
                    )
                    row += k
        for tree in everyone:
            tree.req.draft_tokens, tree.req.draft_parents = map(
                list, select(tree.candidates, self.num_nodes)
            )

    def _run(self, seqs: list[list[Seq]], kvs: list[KVCacheManager]) -> list[torch.Tensor]:
        return self.execute(with_dp_counts([build_draft_batch(s, kv) for s, kv in zip(seqs, kvs)]))

    def _catch_up(self, plans: list[list[Span]], pages_of):
        """The draft over every kept position of every drafting request's span in this step, and a
        growing tree for each request that drafts next (its last kept row is the tree's root)."""
        seqs, growing = [], []
        for spans in plans:
            group, trees, row, pass_row = [], [], 0, 0
            for span in spans:
                req, table = span.req, pages_of(span.req)
                if req.params.takes_drafts and table is not None:
                    kept = (
                        span.kept
                        if span.kept is not None
                        else list(range(span.computed_end - span.start))
                    )
                    tokens = req.all_ids[span.start + 1 : span.computed_end + 1]
                    wants = (
                        req.num_computed_tokens == req.num_tokens - 1
                    )  # decoding: the newest token is not in KV
                    group.append(
                        Seq(
                            table,
                            span.start,
                            tokens,
                            [len(tokens) - 1] if wants else [],
                            hidden_rows=[row + k for k in kept],
                        )
                    )
                    req.draft_tokens, req.draft_parents = [], []
                    pass_row += len(tokens)
                    if wants:
                        trees.append(GrowingTree(req, table, pass_row - 1))
                row += span.length
            seqs.append(group)
            growing.append(trees)
        return seqs, growing


def top_children(logits: torch.Tensor, topk: int) -> list[list[tuple[float, int]]]:
    """Per row of a draft pass's `logits`, its `topk` (log-probability, token) pairs: computed where
    the logits are, and only these cross to the host."""
    top = logits.float().log_softmax(dim=-1).topk(topk, dim=-1)
    return [list(zip(v, i)) for v, i in zip(top.values.tolist(), top.indices.tolist())]


class GrowingTree:
    """One request's draft tree while the draft passes run. Expanded nodes take the cache indices
    past the request's tokens, `topk` per pass: pass j's at base + (j-1)*topk ... base + j*topk - 1."""

    def __init__(self, req: Request, table: str, root_row: int):
        self.req, self.table, self.root_row = req, table, root_row
        self.base = req.num_computed_tokens
        self.candidates: list[Candidate] = []
        self.frontier: list[int] = []  # candidates the next pass expands
        self.rows: list[int] = []  # per frontier node: the row of the pass whose logits proposed it
        self.offsets: dict[int, int] = {}  # expanded candidate -> its cache index - base
        self.alive = True

    def add(
        self, top: list[list[tuple[float, int]]], rows: list[int], parents: list[int], topk: int
    ) -> None:
        """The topk children of each of `parents` (candidate ids, -1: the root), `top` per parent
        the draft's (log-probability, token) pairs after it (`top_children`, computed at `rows` of
        the pass); the best topk become the frontier."""
        new = []
        for b, parent in enumerate(parents):
            above = self.candidates[parent] if parent >= 0 else None
            for value, token in top[b]:
                self.candidates.append(
                    Candidate(
                        token,
                        parent,
                        (above.score if above else 0.0) + value,
                        above.depth + 1 if above else 1,
                    )
                )
                new.append((len(self.candidates) - 1, rows[b]))
        best = sorted(new, key=lambda x: -self.candidates[x[0]].score)[:topk]
        self.frontier, self.rows = [c for c, _ in best], [r for _, r in best]

    def allocate(self, kv: KVCacheManager, step: int, topk: int) -> bool:
        """Pages for pass `step`'s nodes; a request the pool cannot grow for stops drafting (it keeps
        the tree it has)."""
        self.alive = kv.allocate_slots(self.table, self.base + step * topk)
        return self.alive

    def expansion(self, step: int, topk: int) -> Seq:
        """The frontier as a sequence of draft pass `step`: each node at its depth, reading its
        proposer's hidden state, seeing its expanded ancestors and itself."""
        start = step - 1
        for b, c in enumerate(self.frontier):
            self.offsets[c] = start * topk + b
        tokens = [self.candidates[c].token for c in self.frontier]
        seq = Seq(
            self.table,
            self.base + start * topk,
            tokens,
            list(range(len(tokens))),
            hidden_rows=self.rows,
        )
        if topk > 1:
            mask = torch.zeros(len(tokens), step * topk, dtype=torch.bool)
            for b, c in enumerate(self.frontier):
                while c >= 0:
                    mask[b, self.offsets[c]] = True
                    c = self.candidates[c].parent
            seq.positions, seq.mask = [self.base + start] * len(tokens), mask
        return seq
