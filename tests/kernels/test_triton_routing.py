"""The Triton router and pair sort against torch: `route` against `models.layers.moe.route`
(DeepSeek-V3's sigmoid with bias and group-limited top-k, V2's softmax greedy and group-limited,
GLM-4.5's 160 experts in one group), and `sort_pairs` against the sort written with torch's
device ops (argsort, scatter, searchsorted). Under TRITON_INTERPRET=1 on a CPU host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.kernels.triton_routing import capacity, route, sort_pairs  # noqa: E402
from dserve.models.layers import moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on the GPU where there is one: part of `-m gpu`


def torch_sort(ids, first, num_local, block_m):
    """The pairs grouped by local expert with torch's ops: a stable argsort by expert, each
    pair's place from the runs' padded starts, the run blocks' experts by searchsorted."""
    flat = ids.reshape(-1) - first
    here = (flat >= 0) & (flat < num_local)
    flat = torch.where(here, flat, num_local)
    n = flat.numel()
    size = capacity(n, num_local, block_m)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    counts = torch.bincount(flat, minlength=num_local + 1)
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    run_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    clamped = expert.clamp(max=num_local - 1)
    rank = torch.arange(n, device=ids.device) - start[expert]
    place = run_end[clamped] - padded[clamped] + rank
    place = torch.where(expert < num_local, place, size)  # one dropped slot
    pairs = torch.full((size + 1,), n, dtype=torch.int64, device=ids.device)
    pairs.scatter_(0, place, order)
    block_start = torch.arange(0, size, block_m, device=ids.device)
    block_expert = torch.searchsorted(run_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_local, block_expert, -1)
    return pairs[:size], block_expert


def test_pairs_are_grouped_by_expert_in_padded_runs():
    ids = torch.tensor([[2, 0], [0, 5], [2, 1]], device=DEVICE)  # expert 5 is elsewhere
    pairs, block_expert = sort_pairs(ids, first=0, num_local=4, block_m=4)
    n = ids.numel()
    assert block_expert.tolist()[:3] == [0, 1, 2]
    assert all(e == -1 for e in block_expert.tolist()[3:])
    runs = pairs.view(-1, 4).tolist()
    assert runs[0] == [1, 2, n, n]  # expert 0: pairs (0, 1) and (1, 0)
    assert runs[1] == [5, n, n, n] and runs[2] == [0, 4, n, n]
    assert 3 not in pairs.tolist()  # the pair routed to expert 5


@pytest.mark.parametrize(
    "tokens,top_k,total,first,num_local,block_m",
    [
        (1, 8, 32, 0, 32, 16),
        (37, 2, 8, 4, 4, 4),  # an expert-parallel slice
        (300, 8, 64, 0, 64, 16),  # several chunks
        (5, 8, 256, 0, 256, 16),  # many experts, most runs empty
        (20, 8, 160, 40, 40, 16),  # GLM-4.5's 160 experts, a rank of 40 (not a power of 2)
    ],
)
def test_sort_matches_the_torch_sort(tokens, top_k, total, first, num_local, block_m):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(total, generator=gen)[:top_k] for _ in range(tokens)])
    ids[::3, 0] = -1  # padding rows of a padded step route nowhere
    ids = ids.to(DEVICE)
    got = sort_pairs(ids, first, num_local, block_m)
    want = torch_sort(ids, first, num_local, block_m)
    assert torch.equal(got[0], want[0])
    assert got[1].tolist() == want[1].tolist()


V3 = dict(
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)
CONFIGS = {
    "deepseek_v3": (64, True, V3),
    "glm4_moe": (160, True, {**V3, "n_group": 1, "topk_group": 1}),
    "v2_greedy": (
        64,
        False,
        {**V3, "scoring_func": "softmax", "topk_method": "greedy", "norm_topk_prob": False},
    ),
    "v2_grouped": (
        64,
        False,
        {
            **V3,
            "scoring_func": "softmax",
            "topk_method": "group_limited_greedy",
            "num_experts_per_tok": 6,
        },
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_route_matches_the_torch_route(name):
    """Same experts and weights per token; the rows marked as padding go nowhere (-1)."""
    num_experts, with_bias, fields = CONFIGS[name]
    cfg = SimpleNamespace(**fields)
    gen = torch.Generator().manual_seed(num_experts)
    tokens = 9
    logits = torch.randn(tokens, num_experts, generator=gen).to(DEVICE)
    bias = None
    if with_bias:
        bias = (torch.rand(num_experts, generator=gen) * 0.1).to(DEVICE)
    real = torch.ones(tokens, dtype=torch.int32, device=DEVICE)
    real[-2:] = 0
    weights, ids = route(logits, bias, cfg, real)
    want_weights, want_ids = moe.route(logits, bias, cfg)
    ids, order = ids[:-2].sort(dim=-1)
    want_ids, want_order = want_ids[:-2].sort(dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(
        weights[:-2].gather(1, order), want_weights[:-2].gather(1, want_order)
    )
    assert (route(logits, bias, cfg, real)[1][-2:] == -1).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 128, 4096])
def test_at_deepseek_v3_shapes(tokens):
    """256 experts in 8 groups, top 4 groups, top 8: the router and the sort (all experts
    here, and one expert-parallel rank of 8) against torch on the GPU."""
    cfg = SimpleNamespace(**V3)
    gen = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, 256, generator=gen).cuda()
    bias = (torch.rand(256, generator=gen) * 0.1).cuda()
    weights, ids = route(logits, bias, cfg)
    want_weights, want_ids = moe.route(logits, bias, cfg)
    ids, order = ids.sort(dim=-1)
    want_ids, want_order = want_ids.sort(dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order))
    for first, num_local in ((0, 256), (96, 32)):
        got = sort_pairs(want_ids, first, num_local, 16)
        want = torch_sort(want_ids, first, num_local, 16)
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1].long(), want[1])
