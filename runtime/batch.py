"""Front side of a step: scheduled spans plus their page tables -> the `ForwardBatch` the ranks run."""
from __future__ import annotations

import torch

from dserve.attention.backend import ForwardBatch
from dserve.scheduler.kv_manager import KVCacheManager
from dserve.scheduler.scheduler import Span


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


def build_batch(spans: list[Span], kv: KVCacheManager) -> ForwardBatch:
    entries = []
    for span in spans:
        if span.draft:  # verify: the target's prediction after every token of the span
            rows = list(range(span.length))
        else:
            rows = [span.length - 1] if span.completes else []
        entries.append((span.req.rid, span.start, span.tokens, rows))
    return assemble(entries, kv)


def build_draft_batch(entries: list[tuple[str, int, list[int], list[int], list[int]]],
                      kv: KVCacheManager) -> ForwardBatch:
    """A draft pass: (page table key, start position, tokens, rows of the previous pass's hidden states
    the tokens read, local rows whose logits are wanted) per sequence; the draft pool shares `kv`'s pages."""
    batch = assemble([(rid, start, tokens, want) for rid, start, tokens, _, want in entries], kv)
    batch.hidden_rows = torch.tensor([r for _, _, _, rows, _ in entries for r in rows], dtype=torch.int64)
    return batch


def assemble(entries: list[tuple[str, int, list[int], list[int]]], kv: KVCacheManager) -> ForwardBatch:
    """(rid, start position, tokens, local rows whose logits are wanted) per sequence -> a batch."""
    ids, positions, slots, logits_rows = [], [], [], []
    max_pages = max([len(kv.tables[rid]) for rid, *_ in entries], default=0)
    table = torch.zeros(len(entries), max_pages, dtype=torch.int64)
    for i, (rid, start, tokens, rows) in enumerate(entries):
        end = start + len(tokens)
        logits_rows.extend(len(ids) + r for r in rows)
        ids.extend(tokens)
        positions.extend(range(start, end))
        slots.extend(kv.slots(rid, start, end))
        pages = kv.tables[rid]
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
    as_long = lambda values: torch.tensor(values, dtype=torch.int64)
    return ForwardBatch(
        input_ids=as_long(ids), positions=as_long(positions), q_lens=[len(e[2]) for e in entries],
        seq_lens=[start + len(tokens) for _, start, tokens, _ in entries], page_table=table,
        out_slots=as_long(slots), logits_indices=as_long(logits_rows))
