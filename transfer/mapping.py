"""Which prefill rank sends which part of a room's KV to which decode rank.

Ranks here are attention-TP ranks inside one attention group: the prefill group that computed the
request (`prefill_tp` ranks) and the decode DP group that will run it (`decode_tp` ranks).

- MLA: the latent is the same on every attention rank, so each decode rank takes it from exactly
  one prefill rank, picked so that rooms and decode ranks spread over the prefill ranks. Every other
  prefill rank is a dummy for that decode rank: it sends only its completion.
- MHA/GQA: each decode rank needs the KV heads it holds. Each head range comes from a prefill rank
  holding it (head slicing when the TP sizes differ; when heads are replicated over ranks, holders
  take turns). Prefill ranks holding none of a decode rank's heads are dummies for it.
A decode rank knows before any byte moves how many routes (senders) complete the room for it.

With pipeline parallelism on either side, each (prefill stage, decode stage) pair whose layers
overlap is one such pairing of attention groups, for the layers they share (paired by the model's
layer id, never by position within a stage); ranks are then numbered by slot, stage by stage
(slot = stage x attention TP + attention rank), and a route carries its layer range.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Route:
    prefill_rank: int
    decode_rank: int
    dummy: bool  # sends only its completion
    src_head: int = 0  # MHA: first KV head to read, local to the prefill rank
    dst_head: int = 0  # MHA: first KV head to write, local to the decode rank
    num_heads: int = 0  # MHA: heads in the range (0 for MLA and dummies)
    first_layer: int = 0  # the model's layers [first_layer, stop_layer) the route moves
    stop_layer: int = 0


def held_heads(rank: int, tp: int, num_kv_heads: int) -> list[int]:
    """Global KV heads an attention rank holds: a share when heads >= ranks, else one replicated head."""
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(
                f"num_key_value_heads = {num_kv_heads} does not divide by {tp} attention ranks"
            )
        n = num_kv_heads // tp
        return list(range(rank * n, (rank + 1) * n))
    if tp % num_kv_heads:
        raise ValueError(
            f"{tp} attention ranks is not a multiple of num_key_value_heads = {num_kv_heads}"
        )
    return [rank // (tp // num_kv_heads)]


def plan_routes(
    kind: str, prefill_tp: int, decode_tp: int, room: int = 0, num_kv_heads: int = 0
) -> list[Route]:
    """Every (prefill rank, decode rank) pair that takes part in moving one room, real or dummy."""
    if prefill_tp < 1 or decode_tp < 1:
        raise ValueError(
            f"attention TP sizes must be >= 1, got prefill {prefill_tp}, decode {decode_tp}"
        )
    if kind in ("mla", "index"):  # replicated over attention-TP ranks: one sender each
        return _mla_routes(prefill_tp, decode_tp, room)
    if kind == "mha":
        return _mha_routes(prefill_tp, decode_tp, room, num_kv_heads)
    raise ValueError(f"unknown KV layout kind {kind!r} (mla, mha or index)")


def _mla_routes(prefill_tp: int, decode_tp: int, room: int) -> list[Route]:
    routes = []
    for d in range(decode_tp):
        source = (room + d) % prefill_tp
        routes += [Route(p, d, dummy=p != source) for p in range(prefill_tp)]
    return routes


def _mha_routes(prefill_tp: int, decode_tp: int, room: int, num_kv_heads: int) -> list[Route]:
    holders: dict[int, list[int]] = {}
    for p in range(prefill_tp):
        for head in held_heads(p, prefill_tp, num_kv_heads):
            holders.setdefault(head, []).append(p)
    routes = []
    for d in range(decode_tp):
        wanted = held_heads(d, decode_tp, num_kv_heads)
        ranges: list[list[int]] = []  # [prefill rank, first global head, count]
        for head in wanted:
            options = holders[head]
            p = options[(room + d) % len(options)]
            if ranges and ranges[-1][0] == p and ranges[-1][1] + ranges[-1][2] == head:
                ranges[-1][2] += 1
            else:
                ranges.append([p, head, 1])
        senders = {p for p, _, _ in ranges}
        for p, head, count in ranges:
            src = held_heads(p, prefill_tp, num_kv_heads).index(head)
            routes.append(Route(p, d, False, src, wanted.index(head), count))
        routes += [Route(p, d, dummy=True) for p in range(prefill_tp) if p not in senders]
    return routes


def plan_pipeline_routes(
    kind: str,
    prefill_tp: int,
    prefill_stages: list[tuple[int, int]],
    decode_tp: int,
    decode_stages: list[tuple[int, int]],
    room: int = 0,
    num_kv_heads: int = 0,
) -> list[Route]:
    """`plan_routes` for every pair of stages that share layers (`*_stages`: each stage's layers
    [first, stop)); ranks are slots of the DP group over all stages."""
    routes = []
    for sd, (d_first, d_stop) in enumerate(decode_stages):
        for sp, (p_first, p_stop) in enumerate(prefill_stages):
            first, stop = max(d_first, p_first), min(d_stop, p_stop)
            if first >= stop:
                continue
            for r in plan_routes(kind, prefill_tp, decode_tp, room + sp, num_kv_heads):
                slots = dict(
                    prefill_rank=sp * prefill_tp + r.prefill_rank,
                    decode_rank=sd * decode_tp + r.decode_rank,
                )
                routes.append(replace(r, **slots, first_layer=first, stop_layer=stop))
    return routes


def expected_senders(routes: list[Route], decode_rank: int) -> int:
    """Completions a decode rank waits for before the room may start decoding."""
    return sum(1 for r in routes if r.decode_rank == decode_rank)


def routes_from(routes: list[Route], prefill_rank: int) -> list[Route]:
    """What one prefill rank does for a room: its real sends and the ranks it is a dummy for."""
    return [r for r in routes if r.prefill_rank == prefill_rank]
