"""Triton kernels that decide where a batch's tokens go in the MoE: the router's choice and the
(token, slot) pairs grouped by expert, each in one or two launches with no host sync.

`route` is `models.layers.moe.route` (sigmoid or softmax scores, the correction bias for choice,
group-limited top-k, renormalised and scaled weights) as one program per token; padding rows of
a padded step get expert -1 there too. `sort_pairs` groups the pairs by local expert into runs
padded to BLOCK_M for the grouped GEMMs of `triton_moe`: one kernel counts each chunk's pairs per
expert, a second places every pair (stable: the pair order within a run is the input order) and
writes the padding and each run block's expert. Both replace ~10 and ~15 torch kernels; a CUDA
graph holds them (the shapes depend on the batch size only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    real_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    group_size,
    stride_t,
    scaling,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_REAL: tl.constexpr,
    LIMIT_GROUPS: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    here = offs < num_experts
    logit = tl.load(logits_ptr + t * stride_t + offs, mask=here, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        score = 1.0 / (1.0 + tl.exp(-logit))
    else:
        shifted = tl.exp(logit - tl.max(logit, 0))
        score = shifted / tl.sum(shifted, 0)
    choice = score
    if HAS_BIAS:
        choice += tl.load(bias_ptr + offs, mask=here, other=0.0).to(tl.float32)
    choice = tl.where(here, choice, float("-inf"))
    group = offs // group_size
    if LIMIT_GROUPS:
        # a group's rank: its two best choices (sigmoid) or its best score (softmax)
        groups = tl.arange(0, BLOCK_G)
        member = group[None, :] == groups[:, None]
        in_group = tl.where(member, choice[None, :], float("-inf"))
        best = tl.max(in_group, 1)
        group_score = best
        if SIGMOID:
            first = tl.argmax(in_group, 1)
            rest = tl.where(offs[None, :] == first[:, None], float("-inf"), in_group)
            group_score += tl.max(rest, 1)
        group_score = tl.where(groups < N_GROUP, group_score, float("-inf"))
        kept = tl.zeros([BLOCK_G], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            g = tl.argmax(group_score, 0)
            kept = kept | (groups == g)
            group_score = tl.where(groups == g, float("-inf"), group_score)
        keep = tl.sum(tl.where(member & kept[:, None], 1, 0), 0) > 0
        choice = tl.where(keep, choice, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_K], dtype=tl.int32)
    weight = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        e = tl.argmax(choice, 0)
        chosen = tl.where(slots == k, e, chosen)
        w = tl.sum(tl.where(offs == e, score, 0.0), 0)
        weight = tl.where(slots == k, w, weight)
        choice = tl.where(offs == e, float("-inf"), choice)
    if RENORM:
        weight = weight / (tl.sum(weight, 0) + 1e-20)
    weight = weight * scaling
    if HAS_REAL:
        real = tl.load(real_ptr + t)
        chosen = tl.where(real != 0, chosen, -1)
    out = t * TOP_K + slots
    tl.store(weights_ptr + out, weight, mask=slots < TOP_K)
    tl.store(ids_ptr + out, chosen.to(tl.int64), mask=slots < TOP_K)


def route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    cfg,
    real_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`models.layers.moe.route` in one launch: (weights float32, expert ids int64), each
    [tokens, top_k]; rows whose `real_tokens` entry is 0 get expert -1 (routed nowhere)."""
    tokens, num_experts = logits.shape
    top_k = cfg.num_experts_per_tok
    if cfg.scoring_func not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring_func {cfg.scoring_func!r} is not supported")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    logits = logits.contiguous()
    _route_kernel[(tokens,)](
        logits,
        bias if bias is not None else logits,
        real_tokens if real_tokens is not None else logits,
        weights,
        ids,
        num_experts,
        num_experts // cfg.n_group,
        logits.stride(0),
        float(cfg.routed_scaling_factor),
        SIGMOID=cfg.scoring_func == "sigmoid",
        HAS_BIAS=bias is not None,
        HAS_REAL=real_tokens is not None,
        LIMIT_GROUPS=cfg.topk_method != "greedy",
        N_GROUP=cfg.n_group,
        TOPK_GROUP=cfg.topk_group,
        TOP_K=top_k,
        RENORM=bool(cfg.norm_topk_prob) and top_k > 1,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_G=triton.next_power_of_2(cfg.n_group),
        BLOCK_K=triton.next_power_of_2(top_k),
    )
    return weights, ids


@triton.jit
def _local_expert(ids_ptr, pair, n, first, num_local):
    """Each pair's local expert, or -1 (routed elsewhere, padding, or past the end)."""
    e = tl.load(ids_ptr + pair, mask=pair < n, other=-1) - first
    return tl.where((e >= 0) & (e < num_local) & (pair < n), e, -1)


# A pass's token count reaches these kernels as plain ints: left
# unspecialized (Triton would compile a variant per value of 1 or
# multiple of 16), so a new prompt length never compiles mid-request.
@triton.jit(do_not_specialize=["n"])
def _count_kernel(
    ids_ptr,
    counts_ptr,
    n,
    first,
    num_local,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    c = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s in range(0, CHUNK, SUB):
        pair = c * CHUNK + s + tl.arange(0, SUB)
        e = _local_expert(ids_ptr, pair, n, first, num_local)
        one_hot = (e[:, None] == experts[None, :]).to(tl.int32)
        counts += tl.sum(one_hot, 0)
    tl.store(
        counts_ptr + c * BLOCK_E + experts,
        counts,
        mask=experts < num_local,
    )


@triton.jit(do_not_specialize=["n", "num_chunks", "num_blocks"])
def _place_kernel(
    ids_ptr,
    counts_ptr,
    pairs_ptr,
    block_expert_ptr,
    n,
    first,
    num_local,
    num_chunks,
    num_blocks,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCKS_AT_ONCE: tl.constexpr,
):
    c = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    mine = experts < num_local
    # every expert's pairs in all chunks, and in the chunks before this one
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        chunk = c0 + tl.arange(0, BLOCK_C)
        counts = tl.load(
            counts_ptr + chunk[:, None] * BLOCK_E + experts[None, :],
            mask=(chunk[:, None] < num_chunks) & mine[None, :],
            other=0,
        )
        total += tl.sum(counts, 0)
        before += tl.sum(tl.where(chunk[:, None] < c, counts, 0), 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_end = tl.cumsum(padded, 0)
    run_start = run_end - padded
    # this chunk's pairs to their places, in order
    next_slot = run_start + before
    for s in range(0, CHUNK, SUB):
        pair = c * CHUNK + s + tl.arange(0, SUB)
        e = _local_expert(ids_ptr, pair, n, first, num_local)
        one_hot = (e[:, None] == experts[None, :]).to(tl.int32)
        slot = next_slot[None, :] + tl.cumsum(one_hot, 0) - 1
        place = tl.sum(one_hot * slot, 1)
        tl.store(pairs_ptr + place, pair.to(tl.int64), mask=e >= 0)
        next_slot += tl.sum(one_hot, 0)
    # the padding of the runs, and each run block's expert (-1 past the last run)
    rows = tl.arange(0, BLOCK_M)
    for b0 in range(c * BLOCKS_AT_ONCE, num_blocks, num_chunks * BLOCKS_AT_ONCE):
        block = b0 + tl.arange(0, BLOCKS_AT_ONCE)
        start = block * BLOCK_M
        ended = (run_end[None, :] <= start[:, None]) & mine[None, :]
        expert = tl.sum(ended.to(tl.int32), 1)
        which = experts[None, :] == expert[:, None]
        first_row = tl.sum(tl.where(which, run_start[None, :], 0), 1)
        pairs_in = tl.sum(tl.where(which, total[None, :], 0), 1)
        row = start[:, None] + rows[None, :]
        padding = (row - first_row[:, None] >= pairs_in[:, None]) | (expert[:, None] >= num_local)
        in_range = block[:, None] < num_blocks
        sentinel = tl.zeros([BLOCKS_AT_ONCE, BLOCK_M], dtype=tl.int64) + n
        tl.store(pairs_ptr + row, sentinel, mask=padding & in_range)
        expert = tl.where(expert < num_local, expert, -1)
        tl.store(block_expert_ptr + block, expert, mask=block < num_blocks)


def capacity(pairs: int, num_local: int, block_m: int) -> int:
    """Rows of the sorted buffer: enough for every run padded to `block_m`. At most
    min(experts, pairs) runs are non-empty, each padded by under `block_m` rows: a decode step's
    few pairs make few row blocks, so the grouped GEMMs launch few idle programs."""
    runs = min(num_local, pairs)
    return triton.cdiv(pairs + runs * (block_m - 1), block_m) * block_m


def pairs_bound(ids: torch.Tensor) -> int:
    """The pairs of ids [tokens, top_k] with its token count rounded up to a power of two."""
    tokens = ids.shape[0] if ids.dim() > 1 else ids.numel()
    return triton.next_power_of_2(max(tokens, 1)) * (ids.numel() // max(tokens, 1))


def sort_pairs(
    ids: torch.Tensor, first: int, num_local: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, block_expert): the flat (token, slot) pair indices grouped by local expert, each
    expert's run padded to `block_m` with the sentinel `ids.numel()`, in a buffer of static size;
    and per BLOCK_M run its local expert (-1: padding past the last run). Pairs routed to experts
    outside [first, first + num_local) (or to -1) are left out."""
    n = ids.numel()
    size = capacity(n, num_local, block_m)
    num_blocks = size // block_m
    device = ids.device
    pairs = torch.empty(size, dtype=torch.int64, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_local)
    sub = max(1, min(64, 4096 // block_e))  # one-hot tiles of <= 4096 entries
    # the tiles follow the pairs of the token count's power of two, so every count in one
    # bucket runs one compiled variant (the warm-up passes one prompt per bucket)
    bound = pairs_bound(ids)
    # <= 64 chunks (a place program reads all their counts), <= 256 pairs at small n
    smallest = min(256, triton.next_power_of_2(bound))
    chunk = max(sub, smallest, triton.next_power_of_2(triton.cdiv(bound, 64)))
    num_chunks = triton.cdiv(n, chunk)
    counts = torch.empty(num_chunks, block_e, dtype=torch.int32, device=device)
    flat = ids.reshape(-1)
    _count_kernel[(num_chunks,)](
        flat, counts, n, first, num_local, CHUNK=chunk, SUB=sub, BLOCK_E=block_e
    )
    _place_kernel[(num_chunks,)](
        flat,
        counts,
        pairs,
        block_expert,
        n,
        first,
        num_local,
        num_chunks,
        num_blocks,
        CHUNK=chunk,
        SUB=sub,
        BLOCK_E=block_e,
        BLOCK_C=min(16, triton.next_power_of_2(triton.cdiv(bound, chunk))),
        BLOCK_M=block_m,
        BLOCKS_AT_ONCE=max(1, min(16, 4096 // block_e)),
    )
    return pairs, block_expert
