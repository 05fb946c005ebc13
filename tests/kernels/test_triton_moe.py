"""The Triton fused MoE against `Experts.forward` (the torch loop over selected experts): all experts
here, and an expert-parallel slice (pairs routed elsewhere left out). Under TRITON_INTERPRET=1 on a
CPU host at small shapes; on a GPU host also at DeepSeek-V3's expert shapes in bfloat16."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.kernels.triton_moe import fused_experts  # noqa: E402
from dserve.models.layers.moe import Experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on the GPU where there is one: part of `-m gpu`


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


@pytest.mark.parametrize("first,num_local", [(0, 8), (4, 4)])
@pytest.mark.parametrize("tokens", [1, 7])
def test_matches_the_torch_experts(first, num_local, tokens):
    check(tokens, 2, 8, num_local, first, 32, 24, torch.float32, 1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 32, 256])
def test_matches_at_deepseek_v3_shapes(tokens):
    check(tokens, 8, 32, 32, 0, 7168, 2048, torch.bfloat16, 3e-2)


def fp8_experts(num_local, rows, k, scheme, gen):
    """(FP8 weights [E, rows, k], scales per row and block [E, rows, K blocks], the same
    weights dequantized in float32)."""
    from dserve.models.quant import dequantize, per_row, quantize

    parts = [
        quantize(torch.randn(rows, k, generator=gen) / k**0.5, scheme) for _ in range(num_local)
    ]
    q = torch.stack([p[0] for p in parts]).to(DEVICE)
    s = torch.stack([per_row(p[1], scheme, rows) for p in parts]).to(DEVICE)
    return q, s, dequantize(q, s, scheme.block_shape(k)[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("block", [128, 32, 16, None])  # None: per channel
@pytest.mark.parametrize("tokens", [1, 33])
def test_fp8_experts_against_the_dequantized_experts(block, tokens):
    """FP8 experts (blocks of 32 to 128 or per channel: W8A8; blocks of 16: weight-only) in bf16
    within one e4m3 rounding of each GEMM's input (2^-4 relative) of the torch experts on the
    dequantized weights in float32; float32 activations dequantize the weights: float32's
    rounding."""
    from dserve.models.quant import Fp8Scheme
    from tests.reference import relative_error

    scheme = Fp8Scheme("channel") if block is None else Fp8Scheme("block", (block, block))
    gen = torch.Generator().manual_seed(tokens + (block or 0))
    hidden, inter, num_local = 256, 192, 8
    q13, s13, w13 = fp8_experts(num_local, 2 * inter, hidden, scheme, gen)
    q2, s2, w2 = fp8_experts(num_local, hidden, inter, scheme, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    ids = torch.stack([torch.randperm(num_local, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen).to(DEVICE)
    ids = ids.to(DEVICE)
    want = reference(x, w13, w2, weights, ids, 0)
    fp8 = dict(scales=(s13, s2), fp8_block=block or 0)
    exact = fused_experts(x, q13, q2, weights, ids, 0, **fp8)
    torch.testing.assert_close(exact, want, rtol=1e-4, atol=1e-4)
    got = fused_experts(x.bfloat16(), q13, q2, weights, ids, 0, **fp8)
    assert relative_error(got, want) < 2**-4
