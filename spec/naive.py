"""Naive (fused) speculation: steps 1, topk 1, two tokens per verify, and the draft's extend in the
same forward call as the target's verify, so a decode step is one fixed-shape call (one CUDA graph
per batch size on a GPU) instead of a target pass then a draft pass.

The draft runs over exactly the target's tokens (same positions, slots and page tables; its own
pool), reading the target's hidden state at each row. Its input at row r is the token after r:
known for prompt rows inside the span, and otherwise, computed on the device, the target's argmax at
r. For a verify span [root, d1] that is right whatever the verdict: when d1 is accepted it is the
argmax after the root, and when it is rejected the argmax is the token that replaces it; the row of
a rejected d1 is overwritten by the next step (it is that step's root). So greedy requests get the
draft KV and proposals of the two-pass path, token for token. A sampled request's emitted token may
differ from the argmax: its draft then reads another token than the one kept, which lowers its
acceptance but not its exactness (verification never trusts the draft).

The front reads the draft's logits after the root and after d1 and keeps the one after the last
accepted token: the next step's d1.
"""

from __future__ import annotations

import torch

from dserve.attention.backend import FusedDraft
from dserve.scheduler.scheduler import Span


def fused_draft(spans: list[Span]) -> tuple[FusedDraft, list[int | None]]:
    """The draft's part of a fused step over `spans` (laid out as `build_batch` lays them), and per
    span the first of its rows in the draft's logits (None: no proposal from it)."""
    next_ids, from_target, draft_rows, firsts = [], [], [], []
    token_row, logits_row = 0, 0
    for span in spans:
        req = span.req
        logits_rows = span.length if span.draft else int(span.completes)
        first_logits_row = logits_row
        for i in range(span.length):
            position = span.start + i
            by_target = span.draft or (span.completes and i == span.length - 1)
            from_target.append(first_logits_row + (i if span.draft else 0) if by_target else -1)
            next_ids.append(0 if by_target else req.all_ids[position + 1])
        wants = (
            []
            if not logits_rows
            else (list(range(span.length)) if span.draft else [span.length - 1])
        )
        firsts.append(len(draft_rows) if wants and req.params.takes_drafts else None)
        if firsts[-1] is not None:
            draft_rows += [token_row + i for i in wants]
        token_row += span.length
        logits_row += logits_rows
    as_long = lambda v: torch.tensor(v, dtype=torch.int64)
    return FusedDraft(as_long(next_ids), as_long(from_target), as_long(draft_rows)), firsts


def take_proposals(
    spans: list[Span], firsts: list[int | None], draft_logits: torch.Tensor, live
) -> None:
    """Each drafting request's next d1: the draft's argmax after its last kept token. `live(req)`
    says whether it goes on (a prefill's request ended at its first token still sends its draft)."""
    argmax = draft_logits.argmax(dim=-1).tolist()  # one small copy, not the logits
    for span, first in zip(spans, firsts):
        req = span.req
        req.draft_tokens, req.draft_parents = [], []
        if first is None or not live(req) or req.num_computed_tokens != req.num_tokens - 1:
            continue
        row = first + (span.length - 1 - span.rejected if span.draft else 0)
        req.draft_tokens, req.draft_parents = [argmax[row]], [-1]
