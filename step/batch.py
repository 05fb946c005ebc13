"""Sequences of a forward pass -> the `ForwardBatch` the model runs, on the rank that runs it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dserve.attention.backend import ForwardBatch


@dataclass
class Seq:
    """One sequence of a pass: `tokens` written at consecutive cache indices from `start` of the
    page table `tables[holder]` (on a rank a slot), with the logits of local rows `logits_rows`. A negative token
    -(s + 1) stands for the token slot s sampled last, read on the device (`pending_token`). By
    default a token's rotary position is its cache index and it sees the context causally; a draft
    tree gives `positions` and `mask` [len(tokens), tail]: which of the context's last `tail` cache
    indices each token sees (all before them are seen by every token). A draft pass names, per
    token, the row of the previous pass's hidden states it reads (`hidden_rows`)."""

    holder: object
    start: int
    tokens: list[int]
    logits_rows: list[int]
    hidden_rows: list[int] = field(default_factory=list)
    positions: list[int] | None = None
    mask: torch.Tensor | None = None


def pending_token(slot: int) -> int:
    """The stand-in id of the token `slot` sampled in the step before, not yet on the host."""
    return -(slot + 1)


def assemble(seqs: list[Seq], page_table: np.ndarray, page_size: int) -> ForwardBatch:
    """Sequences -> a batch; `page_table` [len(seqs), pages] holds each sequence's page ids."""
    q_lens = [len(s.tokens) for s in seqs]
    seq_of = np.repeat(np.arange(len(seqs)), q_lens)
    first = np.cumsum([0] + q_lens[:-1]) if seqs else np.zeros(0, dtype=np.int64)
    starts = np.array([s.start for s in seqs], dtype=np.int64)
    cache = starts[seq_of] + np.arange(len(seq_of)) - first[seq_of]
    slots = page_table[seq_of, cache // page_size] * page_size + cache % page_size
    positions = cache.copy()
    ids, logits_rows = [], []
    for s, offset in zip(seqs, first.tolist()):
        ids.extend(s.tokens)
        logits_rows.extend(offset + r for r in s.logits_rows)
        if s.positions is not None:
            positions[offset : offset + len(s.tokens)] = s.positions
    masks = [s.mask for s in seqs]
    return ForwardBatch(
        input_ids=_long(ids),
        positions=torch.from_numpy(positions),
        q_lens=q_lens,
        seq_lens=(starts + q_lens).tolist() if seqs else [],
        page_table=torch.from_numpy(np.ascontiguousarray(page_table, dtype=np.int64)),
        out_slots=torch.from_numpy(slots.astype(np.int64)),
        logits_rows=_long(logits_rows),
        tree_masks=masks if any(m is not None for m in masks) else None,
    )


def assemble_draft(seqs: list[Seq], page_table: np.ndarray, page_size: int) -> ForwardBatch:
    """A draft pass (even an empty one: a DP group without drafts still joins the collectives):
    the batch, and per token the row of the previous pass's hidden states it reads."""
    batch = assemble(seqs, page_table, page_size)
    batch.hidden_rows = _long([r for s in seqs for r in s.hidden_rows])
    return batch


def table_rows(tables: Mapping[object, Sequence[int]], holders: list) -> np.ndarray:
    """The page tables of `holders` (a KV manager's, say) as rows of one array, zero-padded."""
    width = max((len(tables[h]) for h in holders), default=0)
    rows = np.zeros((len(holders), width), dtype=np.int64)
    for i, holder in enumerate(holders):
        rows[i, : len(tables[holder])] = tables[holder]
    return rows


def _long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)
