"""Rank mapping rules: every decode rank gets each piece of KV it needs exactly once, from a rank
that holds it, and knows how many senders complete its room."""

from __future__ import annotations

from collections import Counter

import pytest

from dserve.transfer.mapping import expected_senders, held_heads, plan_routes, routes_from

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
