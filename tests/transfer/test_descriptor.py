"""Layout descriptors: what a rank tells its peers, and the refusal of a peer whose pages would not
line up, naming the difference."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from dserve.memory.kv_pool import KVLayout
from dserve.transfer.descriptor import (
    IncompatiblePeer,
    InstanceDescriptor,
    PoolDescriptor,
    RankDescriptor,
    check_compatible,
)
from dserve.transfer.messages import CTRL_BYTES, Control, page_runs

MODEL = {"architecture": "DeepseekV3ForCausalLM", "num_hidden_layers": 3, "kv_lora_rank": 32}


def instance(
    page_size=16, dtype=torch.float32, tp=1, model=MODEL, kind="mla", extra_pools=(), order=None
):
    if kind == "mla":
        layout = KVLayout("mla", 3, page_size, dtype, latent_dim=48, kv_lora_rank=32)
        pools = [PoolDescriptor.from_layout("target", layout)]
    else:
        layout = KVLayout(
            "mha", 3, page_size, dtype, num_kv_heads=4 // tp, head_dim=32, v_head_dim=32
        )
        pools = [PoolDescriptor.from_layout("target", layout, 4, list(range(4 // tp)))]
    if order is not None:
        pools = [dataclasses.replace(p, order=order) for p in pools]
    pools += list(extra_pools)
    ranks = [RankDescriptor(0, r, tp, f"{r:04x}", pools) for r in range(tp)]
    return InstanceDescriptor(dict(model), 1, tp, ranks)


def test_round_trip_through_dict():
    d = instance(kind="mha", tp=2)
    assert InstanceDescriptor.from_dict(d.to_dict()) == d


def test_compatible_across_tp_sizes():
    # head slicing lines up
    check_compatible(instance(kind="mha", tp=1), instance(kind="mha", tp=2))
    check_compatible(instance(tp=1), instance(tp=2))


@pytest.mark.parametrize(
    "other,what",
    [
        (instance(page_size=8), "target pool page_size differs (decode: 16, prefill: 8)"),
        (
            instance(dtype=torch.bfloat16),
            "target pool dtype differs (decode: float32, prefill: bfloat16)",
        ),
        (
            instance(model={**MODEL, "kv_lora_rank": 64}),
            "model kv_lora_rank differs (decode: 32, prefill: 64)",
        ),
        (instance(kind="mha"), "target pool kind differs (decode: mla, prefill: mha)"),
        (instance(order="layer-major"), "target pool order differs (decode: page-major"),
        (
            instance(
                extra_pools=[
                    PoolDescriptor("draft", "mha", 1, 16, "float32", [[2, 32], [2, 32]], 2, [0, 1])
                ]
            ),
            "KV pools differs",
        ),
        (  # a sparse-attention model's indexer keys on one side only
            instance(extra_pools=[PoolDescriptor("index", "index", 3, 16, "float32", [[32]])]),
            "KV pools differs (decode: ['target'], prefill: ['target', 'index'])",
        ),
    ],
)
def test_incompatible_peer_names_the_difference(other, what):
    with pytest.raises(IncompatiblePeer, match=re.escape(what)):
        check_compatible(instance(), other)


def test_control_records_are_size_limited_and_validated():
    ok = Control.unpack(Control(True, None, b"token 5").pack())
    assert ok == Control(True, None, b"token 5")
    huge = Control.unpack(Control(True, None, b"x" * CTRL_BYTES).pack())
    assert huge.ok is False and "over the limit" in huge.error
    assert Control.unpack(b"\xff" * 16).ok is False
    assert page_runs([4, 5, 6, 9, 10, 2]) == [(0, 3), (3, 2), (5, 1)]
    assert page_runs([4, 5, 6, 7, 8, 2], longest=2) == [(0, 2), (2, 2), (4, 1), (5, 1)]


def staged(partition: tuple[int, ...], tp: int = 1) -> InstanceDescriptor:
    """An MLA instance whose pipeline stages hold `partition` layers each."""
    ranks, first = [], 0
    for stage, count in enumerate(partition):
        layout = KVLayout("mla", count, 16, torch.float32, latent_dim=48, kv_lora_rank=32)
        pool = PoolDescriptor.from_layout("target", layout, first_layer=first, model_layers=3)
        ranks += [RankDescriptor(0, r, tp, f"{stage}{r:03x}", [pool], stage) for r in range(tp)]
        first += count
    return InstanceDescriptor(dict(MODEL), 1, tp, ranks)


def test_pipeline_partitions_pair_by_layer_id():
    """Any two partitions of the same layers line up (the descriptor carries each stage's
    range); a side that does not hold every layer once is refused, naming both partitions."""
    check_compatible(staged((1, 2)), staged((3,)))
    check_compatible(staged((2, 1), tp=2), staged((1, 1, 1)))
    assert staged((1, 2)).stage_layers(0) == [(0, 1), (1, 3)]
    assert InstanceDescriptor.from_dict(staged((1, 2)).to_dict()) == staged((1, 2))
    with pytest.raises(IncompatiblePeer, match=r"total_layers differs \(decode: 3, prefill: 2\)"):
        check_compatible(staged((3,)), instance_with_layers(2))
    gap = staged((1, 2))
    gap = dataclasses.replace(gap, ranks=gap.ranks[1:])  # the stage holding layer 0 is missing
    with pytest.raises(IncompatiblePeer, match=r"do not cover .* \(decode: \[\(0, 3\)\], prefill"):
        check_compatible(staged((3,)), gap)


def instance_with_layers(count: int) -> InstanceDescriptor:
    layout = KVLayout("mla", count, 16, torch.float32, latent_dim=48, kv_lora_rank=32)
    ranks = [RankDescriptor(0, 0, 1, "0000", [PoolDescriptor.from_layout("target", layout)])]
    return InstanceDescriptor(dict(MODEL), 1, 1, ranks)
