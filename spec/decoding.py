"""The front's side of speculative decoding (chain drafts, topk 1): verify a step's draft tokens,
then run the draft passes that propose the next ones.

A step is one target pass over the scheduled spans. A decoding request's span is its last token
followed by its draft tokens d1..dk; the target predicts after each of them. Verification keeps
the longest prefix of drafts the target agrees with and appends a token of the target's own, so a
step yields 1..k+1 tokens. Greedy: agreeing is being the target's argmax, and the output is the
target's token for token. Sampling: the draft is the draft model's argmax (a distribution q that is
all on d), so speculative sampling accepts d with probability p(d) under the target's processed
distribution p (temperature, top-k/p, min-p) and otherwise draws from p without d, renormalised;
every token is then distributed exactly as without speculation. The KV of rejected drafts is
dropped (their pages go back at once).

Then the draft catches up over every position the target just computed and kept (prompt chunks
too): at position i it reads the target's hidden state h_i and token i+1, writing its own KV into
the same pages of its own pool. Its prediction after the last kept position is d1; each further
draft pass feeds d_j and the draft's own hidden state back in for d_{j+1}.

Requests with penalties or logprobs do not draft (their per-token processing depends on the tokens
before); they decode one token per step in the same batches.
"""
from __future__ import annotations

import torch

from dserve.runtime.batch import build_draft_batch, with_dp_counts
from dserve.runtime.sampler import processed_probs
from dserve.scheduler.kv_manager import KVCacheManager
from dserve.scheduler.request import Request
from dserve.scheduler.scheduler import Span


def drafts_for(req: Request) -> bool:
    p = req.params
    return (not p.return_logprob and p.repetition_penalty == 1.0 and not p.frequency_penalty
            and not p.presence_penalty)


def accept_greedy(draft: tuple[int, ...], logits: torch.Tensor) -> list[int]:
    target = logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target[accepted]:
        accepted += 1
    return list(draft[:accepted]) + [target[accepted]]


def accept_sampled(draft: tuple[int, ...], logits: torch.Tensor, req: Request) -> list[int]:
    """Speculative sampling against a draft that is all on its token (the draft's argmax)."""
    probs = processed_probs(logits, [req] * logits.shape[0])
    out = []
    for j, token in enumerate(draft):
        if torch.rand((), generator=req.generator) < probs[j, token]:
            out.append(token)
            continue
        residual = probs[j].clone()
        residual[token] = 0.0
        if residual.sum() <= 0:  # p(token) rounded below 1 with nothing else left: it is the only choice
            out.append(token)
            continue
        return out + [int(torch.multinomial(residual / residual.sum(), 1, generator=req.generator))]
    return out + [int(torch.multinomial(probs[len(draft)], 1, generator=req.generator))]


class Speculator:
    def __init__(self, num_steps: int, execute):
        self.num_steps, self.execute = num_steps, execute
        self.verify_steps = 0
        self.proposed = [0] * num_steps  # per draft position: drafts verified, and accepted
        self.accepted = [0] * num_steps

    def verify(self, span: Span, logits: torch.Tensor) -> list[int]:
        """Tokens a verified span yields. `logits` [len(span.draft) + 1, vocab] are the target's
        after each token of the span."""
        req = span.req
        if req.params.greedy:
            tokens = accept_greedy(span.draft, logits)
        else:
            tokens = accept_sampled(span.draft, logits, req)
        accepted = len(tokens) - 1
        span.rejected = len(span.draft) - accepted
        self.verify_steps += 1
        for j in range(len(span.draft)):
            self.proposed[j] += 1
            self.accepted[j] += j < accepted
        req.accepted_per_step.append(accepted)
        steps = req.accepted_per_step
        req.extra_meta.update(spec_verify_ct=len(steps), spec_accept_length=round(sum(steps) / len(steps) + 1, 4),
                              spec_accepted_per_step=list(steps))
        return tokens

    def propose(self, plans: list[list[Span]], kvs: list[KVCacheManager], pages_of=lambda req: req.rid) -> None:
        """Draft passes after this step's target pass; leaves each drafting request's proposals in
        `req.draft_tokens`. `pages_of(req)` names the page table of a request, or None for one that
        ended (a prefill instance's request ends at its first token, its pages held to be sent: it
        still drafts, and the drafts travel with the first token)."""
        entries, owners = self._catch_up(plans, pages_of)
        for step in range(self.num_steps):
            if not any(entries):
                return
            batches = with_dp_counts([build_draft_batch(e, kv) for e, kv in zip(entries, kvs)])
            group_logits = self.execute(batches)
            for reqs, logits in zip(owners, group_logits):
                for req, token in zip(reqs, logits.argmax(dim=-1).tolist()):
                    req.draft_tokens.append(token)
            if step + 1 < self.num_steps:
                entries, owners = self._next_step(entries, owners, kvs, pages_of)

    def _catch_up(self, plans: list[list[Span]], pages_of):
        """The draft over every kept position of every drafting request's span in this step."""
        entries, owners = [], []
        for spans in plans:
            group, reqs, row = [], [], 0
            for span in spans:
                req, kept, table = span.req, span.computed_end - span.start, pages_of(span.req)
                if drafts_for(req) and table is not None:
                    wants = req.num_computed_tokens == req.num_tokens - 1  # decoding: only the newest token is not in KV
                    tokens = req.all_ids[span.start + 1:span.computed_end + 1]
                    group.append((table, span.start, tokens, list(range(row, row + kept)),
                                  [kept - 1] if wants else []))
                    req.draft_tokens = []
                    if wants:
                        reqs.append(req)
                row += span.length
            entries.append(group)
            owners.append(reqs)
        return entries, owners

    def _next_step(self, entries, owners, kvs, pages_of):
        """One more draft token per request: d_j at the next position, reading the draft's own
        hidden state after d_{j-1}. A request the pool cannot grow for stops drafting."""
        next_entries, next_owners = [], []
        for group, reqs, kv in zip(entries, owners, kvs):
            last_rows, row = {}, 0
            for table, _, tokens, _, _ in group:
                row += len(tokens)
                last_rows[table] = row - 1
            out, keep = [], []
            for req in reqs:
                table = pages_of(req)
                position = req.num_computed_tokens + len(req.draft_tokens) - 1
                if not kv.allocate_slots(table, position + 1):
                    continue
                out.append((table, position, [req.draft_tokens[-1]], [last_rows[table]], [0]))
                keep.append(req)
            next_entries.append(out)
            next_owners.append(keep)
        return next_entries, next_owners
