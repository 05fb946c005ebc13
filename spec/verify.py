"""Verifying draft trees on the rank that computed the target's logits (`spec/tree.py` walks).

A verified span keeps the longest path of drafts the target agrees with and yields the target's
own token after it: 1..depth+1 tokens, each the target's own (greedy) or distributed exactly as the
target's draw (sampling; a seeded request's walk draws from a generator of its seed and the
position of the first token it yields). The KV of the nodes off the path is
dropped by the front (their pages go back); the path's nodes, computed at their tree rows, are
moved here to consecutive positions before any later pass reads the pool.
"""

from __future__ import annotations

import torch

from dserve.spec.tree import accept_greedy, accept_sampled
from dserve.step.plan import PlannedSpan
from dserve.step.rank_state import PageTables, RankSpan
from dserve.step.sampler import Sampler, device_ints, processed_probs


def verify_spans(spans: list[RankSpan], logits: torch.Tensor, sampler: Sampler) -> None:
    """Sets each span's `path` and `emitted`. The target's logits after the span's token and
    after each of its nodes are rows `logits_row` .. `logits_row + length` of `logits`."""
    argmax = logits.argmax(dim=-1).tolist() if spans else []  # one small copy, not the logits
    for span in spans:
        p, req = span.plan, span.req
        first, end = span.logits_row, span.logits_row + p.length
        if req.params.greedy:
            path, tokens = accept_greedy(p.draft, p.parents, argmax[first:end])
        else:  # the walk draws on the host, from the request's generator
            probs = processed_probs(logits[first:end], [req] * p.length).cpu()
            generator = sampler.generator_of(req, p.start + 1)
            path, tokens = accept_sampled(p.draft, p.parents, probs, generator)
        span.path, span.emitted = path, tokens


def move_accepted(spans: list[RankSpan], tables: PageTables, page_size: int, pools) -> None:
    """Copy the KV (in each of `pools`: the latents, a sparse model's indexer keys) of each
    accepted path's nodes, computed at their tree rows, to the positions right after the span's
    first token (a chain's are there already)."""
    moves = [(span.plan.slot, span.plan.start, span.path) for span in spans]
    move_paths(moves, tables, page_size, pools)


def move_paths(moves: list[tuple[int, int, list[int]]], tables: PageTables, page_size, pools):
    """`move_accepted` for (slot, start of the span, accepted nodes) triples."""
    src, dst = [], []
    for slot, start, path in moves:
        pages = tables.pages[slot]
        for i, node in enumerate(path):
            if node != i:
                for positions, out in ((start + 1 + node, src), (start + 1 + i, dst)):
                    out.append(
                        int(pages[positions // page_size]) * page_size + positions % page_size
                    )
    if not src:
        return
    device = pools[0].device  # a rank's pools share its device
    src, dst = device_ints(src, device), device_ints(dst, device)
    for pool in pools:
        pool.move(src, dst)


def accepted_path(span: PlannedSpan, emitted: list[int]) -> list[int]:
    """The tree nodes a verify kept, from the tokens it yielded: all but the last are drafts on
    one path from the root (siblings hold distinct tokens), the last is the target's own."""
    path, node = [], -1
    for token in emitted[:-1]:
        children = [i for i, parent in enumerate(span.parents) if parent == node]
        node = next((i for i in children if span.draft[i] == token), None)
        if node is None:
            raise RuntimeError(f"slot {span.slot}: verified tokens leave the draft tree")
        path.append(node)
    return path
