"""Front side of a step: scheduled spans plus their page tables -> the `ForwardBatch` the ranks run."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dserve.attention.backend import ForwardBatch
from dserve.scheduler.kv_manager import KVCacheManager
from dserve.scheduler.scheduler import Span
from dserve.spec.tree import ancestor_mask, depths, is_chain


@dataclass
class Seq:
    """One sequence of a pass: `tokens` written at consecutive cache indices from `start` of the
    page table `key`, with the logits of local rows `logits_rows`. By default a token's rotary
    position is its cache index and it sees the context causally; a draft tree gives `positions`
    and `mask` [len(tokens), tail]: which of the context's last `tail` cache indices each token
    sees (all before them are seen by every token). A draft pass names, per token, the row of the
    previous pass's hidden states it reads (`hidden_rows`)."""

    key: str
    start: int
    tokens: list[int]
    logits_rows: list[int]
    hidden_rows: list[int] = field(default_factory=list)
    positions: list[int] | None = None
    mask: torch.Tensor | None = None


def build_step_batches(plans: list[list[Span]], kvs: list[KVCacheManager]) -> list[ForwardBatch]:
    """One batch per DP group (empty where a group has no work: its ranks still join the MoE
    collectives); with several groups each batch carries every group's token count."""
    return with_dp_counts([build_batch(spans, kv) for spans, kv in zip(plans, kvs)])


def with_dp_counts(batches: list[ForwardBatch]) -> list[ForwardBatch]:
    if len(batches) > 1:
        counts = [b.num_tokens for b in batches]
        for b in batches:
            b.dp_num_tokens = counts
    return batches


def span_seq(span: Span) -> Seq:
    """A span as a sequence: a prompt chunk or decode token (logits after its last token when it
    completes the request), or a token and its draft to verify (logits after every token; a tree's
    nodes at their depth past the root, each seeing its ancestors)."""
    if not span.draft:
        return Seq(
            span.req.rid, span.start, span.tokens, [span.length - 1] if span.completes else []
        )
    seq = Seq(span.req.rid, span.start, span.tokens, list(range(span.length)))
    if not is_chain(span.parents):
        assert span.length == len(span.draft) + 1, "a draft tree follows exactly one token"
        seq.positions = [span.start] + [span.start + d for d in depths(span.parents)]
        seq.mask = ancestor_mask(span.parents)
    return seq


def build_batch(spans: list[Span], kv: KVCacheManager) -> ForwardBatch:
    return assemble([span_seq(span) for span in spans], kv)


def build_draft_batch(seqs: list[Seq], kv: KVCacheManager) -> ForwardBatch:
    """A draft pass (even an empty one: a DP group without drafts still joins the collectives); the
    draft pool shares `kv`'s page tables."""
    batch = assemble(seqs, kv)
    batch.hidden_rows = torch.tensor([r for s in seqs for r in s.hidden_rows], dtype=torch.int64)
    return batch


def assemble(seqs: list[Seq], kv: KVCacheManager) -> ForwardBatch:
    """Sequences -> a batch."""
    ids, positions, slots, logits_rows = [], [], [], []
    max_pages = max([len(kv.tables[s.key]) for s in seqs], default=0)
    table = np.zeros(
        (len(seqs), max_pages), dtype=np.int64
    )  # rows filled by numpy: cheaper than torch per row
    for i, s in enumerate(seqs):
        end = s.start + len(s.tokens)
        logits_rows.extend(len(ids) + r for r in s.logits_rows)
        ids.extend(s.tokens)
        positions.extend(range(s.start, end) if s.positions is None else s.positions)
        slots.extend(kv.slots(s.key, s.start, end))
        pages = kv.tables[s.key]
        table[i, : len(pages)] = pages
    as_long = lambda values: torch.tensor(values, dtype=torch.int64)
    masks = [s.mask for s in seqs]
    return ForwardBatch(
        input_ids=as_long(ids),
        positions=as_long(positions),
        q_lens=[len(s.tokens) for s in seqs],
        seq_lens=[s.start + len(s.tokens) for s in seqs],
        page_table=torch.from_numpy(table),
        out_slots=as_long(slots),
        logits_indices=as_long(logits_rows),
        tree_masks=masks if any(m is not None for m in masks) else None,
    )
