"""The Triton fused MoE against `Experts.forward` (the torch loop over selected experts): all experts
here, and an expert-parallel slice (pairs routed elsewhere left out). Under TRITON_INTERPRET=1 on a
CPU host at small shapes; on a GPU host also at DeepSeek-V3's expert shapes in bfloat16."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.attention.triton_moe import fused_experts, sort_pairs  # noqa: E402
from dserve.models.layers.moe import Experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, w13, w2, weights, ids, first):
    """`Experts.forward` on the given stacked weights."""
    experts = Experts.__new__(Experts)
    torch.nn.Module.__init__(experts)
    experts.w13, experts.w2 = torch.nn.Parameter(w13, False), torch.nn.Parameter(w2, False)
    experts.first, experts.num_local, experts.use_kernel = first, w13.shape[0], False
    return experts.forward(x, weights, ids)


def check(tokens, top_k, total_experts, num_local, first, hidden, inter, dtype, tol):
    gen = torch.Generator().manual_seed(tokens * 7 + first)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(num_local, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(num_local, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, dtype)
    ids = torch.stack(
        [torch.randperm(total_experts, generator=gen)[:top_k] for _ in range(tokens)]
    ).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    got = fused_experts(x, w13, w2, weights, ids, first)
    want = reference(x, w13, w2, weights, ids, first)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_pairs_are_grouped_by_expert_in_padded_runs():
    ids = torch.tensor([[2, 0], [0, 5], [2, 1]])  # expert 5 is not here (4 local experts)
    pairs, block_expert = sort_pairs(ids, first=0, num_local=4, block_m=4)
    n = ids.numel()
    assert block_expert.tolist()[:3] == [0, 1, 2] and all(
        e == -1 for e in block_expert.tolist()[3:]
    )
    runs = pairs.view(-1, 4).tolist()
    assert runs[0] == [1, 2, n, n]  # expert 0: pairs (0, 1) and (1, 0)
    assert runs[1] == [5, n, n, n] and runs[2] == [0, 4, n, n]
    assert 3 not in pairs.tolist()  # the pair routed to expert 5


@pytest.mark.parametrize("first,num_local", [(0, 8), (4, 4)])
@pytest.mark.parametrize("tokens", [1, 7])
def test_matches_the_torch_experts(first, num_local, tokens):
    check(tokens, 2, 8, num_local, first, 32, 24, torch.float32, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 32, 256])
def test_matches_at_deepseek_v3_shapes(tokens):
    check(tokens, 8, 32, 32, 0, 7168, 2048, torch.bfloat16, 3e-2)
