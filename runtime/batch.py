"""Front side of a step: scheduled spans plus their page tables -> the `ForwardBatch` the ranks run."""
from __future__ import annotations

import torch

from dserve.attention.backend import ForwardBatch
from dserve.scheduler.kv_manager import KVCacheManager
from dserve.scheduler.scheduler import Span


def build_step_batches(plans: list[list[Span]], kvs: list[KVCacheManager]) -> list[ForwardBatch]:
    """One batch per DP group (empty where a group has no work: its ranks still join the MoE
    collectives); with several groups each batch carries every group's token count."""
    batches = [build_batch(spans, kv) for spans, kv in zip(plans, kvs)]
    if len(batches) > 1:
        counts = [b.num_tokens for b in batches]
        for b in batches:
            b.dp_num_tokens = counts
    return batches


def build_batch(spans: list[Span], kv: KVCacheManager) -> ForwardBatch:
    ids, positions, slots, logits_rows = [], [], [], []
    max_pages = max([len(kv.tables[s.req.rid]) for s in spans], default=0)
    table = torch.zeros(len(spans), max_pages, dtype=torch.int64)
    for i, span in enumerate(spans):
        rid, end = span.req.rid, span.start + span.length
        ids.extend(span.req.all_ids[span.start:end])
        positions.extend(range(span.start, end))
        slots.extend(kv.slots(rid, span.start, end))
        pages = kv.tables[rid]
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
        if span.completes:
            logits_rows.append(len(ids) - 1)
    as_long = lambda values: torch.tensor(values, dtype=torch.int64)
    return ForwardBatch(
        input_ids=as_long(ids), positions=as_long(positions), q_lens=[s.length for s in spans],
        seq_lens=[s.start + s.length for s in spans], page_table=table, out_slots=as_long(slots),
        logits_indices=as_long(logits_rows))
