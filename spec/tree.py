"""Draft trees: the shape of a step's proposals, and walking them to verify.

A request's draft is a list of nodes in breadth-first order (parents before children, siblings best
first), each a token and the index of its parent (-1: the request's newest token, the root). A chain
(topk 1) is the tree whose node i has parent i - 1. The target verifies the whole tree in one pass:
the root and the nodes are consecutive tokens of the span, node i at position root + depth(i), each
seeing the context, its ancestors and itself (`ancestor_mask`).

Verification walks down from the root. Greedy: take the child whose token is the target's argmax.
Sampling: a draft that is all on its token (the draft proposes its top-k, it does not sample) is
accepted with probability p(token) under the target's processed distribution p; on rejection that
token leaves p (zeroed, renormalised) and the next sibling is tried on what is left; when no child is
taken, the bonus token is drawn from what is left. This is recursive rejection sampling with point
masses: each emitted token is distributed exactly as the target's own draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def is_chain(parents) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def depths(parents) -> list[int]:
    """Depth of each node (a child of the root has depth 1)."""
    out = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def ancestor_mask(parents) -> torch.Tensor:
    """[n + 1, n + 1] bool over (root, nodes...): row i sees column j when j is i or an ancestor of i."""
    n = len(parents)
    mask = torch.eye(n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i + 1] |= mask[p + 1]
    return mask


def well_formed(tokens, parents, vocab_size: int, max_nodes: int, max_depth: int) -> bool:
    """Whether a draft from a peer is a tree of token ids no larger and no deeper than ours, its
    parents before their children (else the decode drops it and drafts anew)."""
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
    return (
        isinstance(tokens, list)
        and isinstance(parents, list)
        and len(tokens) == len(parents) <= max_nodes
        and all(is_int(t) and 0 <= t < vocab_size for t in tokens)
        and all(is_int(p) and -1 <= p < i for i, p in enumerate(parents))
        and max(depths(parents), default=0) <= max_depth
    )


def children(parents, node: int) -> list[int]:
    """Draft nodes whose parent is `node` (-1: the root), in tree order."""
    return [i for i, p in enumerate(parents) if p == node]


def accept_greedy(tokens, parents, target: list[int]) -> tuple[list[int], list[int]]:
    """(accepted node indices along the path, emitted tokens) given the target's argmax `target`
    after the root and each node (1 + len(tokens) ids)."""
    path, node = [], -1
    while True:
        want = target[node + 1]
        match = next((c for c in children(parents, node) if tokens[c] == want), None)
        if match is None:
            return path, [tokens[i] for i in path] + [want]
        path.append(match)
        node = match


def accept_sampled(tokens, parents, probs: torch.Tensor, generator) -> tuple[list[int], list[int]]:
    """The same walk for sampling; `probs` [1 + len(tokens), vocab] are the target's processed
    distributions after the root and each node."""
    path, node = [], -1
    while True:
        p = probs[node + 1].clone()
        taken = None
        for c in children(parents, node):
            if torch.rand((), generator=generator) < p[tokens[c]]:
                taken = c
                break
            p[tokens[c]] = 0.0
            total = p.sum()
            if total <= 0:  # p(token) rounded below 1 with nothing else left: it is the only choice
                taken = c
                break
            p /= total
        if taken is None:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return path, [tokens[i] for i in path] + [bonus]
        path.append(taken)
        node = taken


@dataclass
class Candidate:
    token: int
    parent: int  # index of the parent candidate, -1 for the root
    score: float  # sum of the draft's log-probabilities along the path
    depth: int


def select(candidates: list[Candidate], count: int) -> tuple[list[int], list[int]]:
    """The `count` best-scoring candidates as a tree (tokens, parents) in breadth-first order. A
    child never scores above its parent and wins ties against nothing shallower, so every chosen
    node's parent is chosen too."""
    best = sorted(
        range(len(candidates)), key=lambda i: (-candidates[i].score, candidates[i].depth, i)
    )[:count]
    order = sorted(best, key=lambda i: (candidates[i].depth, -candidates[i].score, i))
    index = {c: n for n, c in enumerate(order)}
    tokens = [candidates[i].token for i in order]
    parents = [-1 if candidates[i].parent < 0 else index[candidates[i].parent] for i in order]
    return tokens, parents
