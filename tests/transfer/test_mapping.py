"""Rank mapping rules: every decode rank gets each piece of KV it needs exactly once, from a rank
that holds it, and knows how many senders complete its room."""

from __future__ import annotations

from collections import Counter

import pytest

from dserve.transfer.mapping import (
    expected_senders,
    held_heads,
    plan_pipeline_routes,
    plan_routes,
    routes_from,
)

TP_PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (8, 1), (1, 8), (8, 4)]


@pytest.mark.parametrize("prefill_tp, decode_tp", TP_PAIRS)
def test_mla_each_decode_rank_has_one_real_sender(prefill_tp, decode_tp):
    for room in range(6):
        routes = plan_routes("mla", prefill_tp, decode_tp, room)
        for d in range(decode_tp):
            mine = [r for r in routes if r.decode_rank == d]
            assert sum(not r.dummy for r in mine) == 1
            assert expected_senders(routes, d) == prefill_tp  # dummies report completion too
            assert sorted(r.prefill_rank for r in mine) == list(range(prefill_tp))


def test_mla_traffic_spreads_over_prefill_ranks():
    load = Counter()
    for room in range(64):
        for r in plan_routes("mla", 4, 1, room):
            if not r.dummy:
                load[r.prefill_rank] += 1
    assert set(load.values()) == {16}
    real = [r.prefill_rank for r in plan_routes("mla", 4, 4, room=0) if not r.dummy]
    assert sorted(real) == [0, 1, 2, 3]  # one room: each decode rank reads a different prefill rank


@pytest.mark.parametrize("prefill_tp, decode_tp", TP_PAIRS)
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4, 8])
def test_mha_head_slicing_covers_each_needed_head_once(prefill_tp, decode_tp, num_kv_heads):
    if (num_kv_heads % prefill_tp and prefill_tp % num_kv_heads) or (
        num_kv_heads % decode_tp and decode_tp % num_kv_heads
    ):
        pytest.skip("no valid head split")
    for room in range(3):
        routes = plan_routes("mha", prefill_tp, decode_tp, room, num_kv_heads)
        for d in range(decode_tp):
            wanted = held_heads(d, decode_tp, num_kv_heads)
            got = []
            for r in routes:
                if r.decode_rank != d or r.dummy:
                    continue
                src = held_heads(r.prefill_rank, prefill_tp, num_kv_heads)[
                    r.src_head : r.src_head + r.num_heads
                ]
                dst = wanted[r.dst_head : r.dst_head + r.num_heads]
                # the sender holds exactly these heads
                assert src == dst and len(src) == r.num_heads
                got += dst
            assert sorted(got) == wanted
            assert expected_senders(routes, d) == prefill_tp
            # each prefill rank has a role per decode rank
            assert len(routes_from(routes, 0)) == decode_tp


def test_mha_two_to_one_takes_half_the_heads_from_each():
    routes = [r for r in plan_routes("mha", 2, 1, num_kv_heads=4) if not r.dummy]
    assert [(r.prefill_rank, r.src_head, r.dst_head, r.num_heads) for r in routes] == [
        (0, 0, 0, 2),
        (1, 0, 2, 2),
    ]


def test_bad_mapping_inputs():
    with pytest.raises(ValueError, match="unknown KV layout"):
        plan_routes("gqa?", 1, 1)
    with pytest.raises(ValueError, match="does not divide"):
        plan_routes("mha", 3, 1, num_kv_heads=4)


PARTITIONS = [
    ((4,), (2, 2)),
    ((2, 2), (4,)),
    ((1, 3), (3, 1)),
    ((2, 2), (1, 1, 2)),
    ((3, 1), (3, 1)),
]


def stages_of(partition: tuple[int, ...]) -> list[tuple[int, int]]:
    firsts = [sum(partition[:i]) for i in range(len(partition))]
    return [(f, f + n) for f, n in zip(firsts, partition)]


@pytest.mark.parametrize("prefill_part,decode_part", PARTITIONS)
@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (2, 1), (1, 2), (2, 4)])
@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_pipeline_routes_cover_each_held_layer_once(
    kind, prefill_tp, decode_tp, prefill_part, decode_part
):
    """Each decode slot gets every (layer, head) it holds exactly once, from a prefill slot whose
    stage holds that layer; it waits for a completion from every prefill slot of a stage that
    shares layers with its own, and from no other."""
    heads = 4 if kind == "mha" else 0
    p_stages, d_stages = stages_of(prefill_part), stages_of(decode_part)
    routes = plan_pipeline_routes(kind, prefill_tp, p_stages, decode_tp, d_stages, 3, heads)
    for sd, (first, stop) in enumerate(d_stages):
        for d in range(decode_tp):
            slot = sd * decode_tp + d
            mine = [r for r in routes if r.decode_rank == slot]
            got = Counter()
            for r in mine:
                sp, p = divmod(r.prefill_rank, prefill_tp)
                assert p_stages[sp][0] <= r.first_layer < r.stop_layer <= p_stages[sp][1]
                assert first <= r.first_layer and r.stop_layer <= stop
                if r.dummy:
                    continue
                wanted = held_heads(d, decode_tp, heads) if heads else [0]
                for layer in range(r.first_layer, r.stop_layer):
                    got.update((layer, h) for h in wanted[r.dst_head :][: r.num_heads or 1])
            wanted = held_heads(d, decode_tp, heads) if heads else [0]
            assert got == Counter((layer, h) for layer in range(first, stop) for h in wanted)
            sharing = [sp for sp, (a, b) in enumerate(p_stages) if a < stop and first < b]
            assert sorted({r.prefill_rank for r in mine}) == [
                sp * prefill_tp + p for sp in sharing for p in range(prefill_tp)
            ]
