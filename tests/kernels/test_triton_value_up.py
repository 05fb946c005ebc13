"""MLA's value up-projection with o_proj's FP8 input quantization in the same launch
(`kernels/triton_value_up.py`): the product against torch's batched product, and the FP8 form
against the quantization the GEMMs would do on that product. Under TRITON_INTERPRET=1 at small
shapes on a CPU host; on a GPU also at DeepSeek-V3's (128 heads, latent 512, V 128, blocks of
128), bit for bit against `quantize_activations`, and through an FP8 o_proj."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.kernels.triton_fp8 import quantized_form  # noqa: E402
from dserve.kernels.triton_value_up import takes, value_up_quantized  # noqa: E402
from tests.kernels.test_triton_norm import quantized_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on the GPU where there is one: part of `-m gpu`
# the interpreter's bfloat16 dot returns garbage (Triton 3.9): float32 on the CPU
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def operands(tokens: int, heads: int, rank: int, v_dim: int, nope: int = 8):
    """o_latent [T, H, R] and W_UV [H, V, R] as a strided view of a kv_b_proj weight."""
    gen = torch.Generator().manual_seed(tokens * heads + rank + v_dim)
    o = torch.randn(tokens, heads, rank, generator=gen).to(DEVICE, DTYPE)
    kv_b = torch.randn(heads, nope + v_dim, rank, generator=gen) / rank**0.5
    w_uv = kv_b.to(DEVICE, DTYPE)[:, nope:]
    return o, w_uv


def reference(o: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).flatten(1)


def check(tokens: int, heads: int, rank: int, v_dim: int, group: int) -> None:
    o, w_uv = operands(tokens, heads, rank, v_dim)
    out = value_up_quantized(o, w_uv, group)
    want = reference(o, w_uv)
    assert out.shape == want.shape and out.dtype == want.dtype
    # summation order differs from torch's (and the interpreter rounds towards zero)
    torch.testing.assert_close(out.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    found = quantized_form(out, group)
    assert found is not None and quantized_form(out, 2 * group) is None
    padded = -(-tokens // 4) * 4
    assert found.q.shape == (padded, heads * v_dim) and found.scales.shape == (
        padded,
        heads * v_dim // group,
    )
    assert found.scales.stride(0) == 1  # token-major, as cuBLAS reads them
    q_want, s_want = quantized_reference(out.cpu(), group)
    torch.testing.assert_close(found.scales[:tokens].cpu(), s_want, rtol=3e-7, atol=0)
    got = found.q[:tokens].cpu().float()
    assert torch.equal(got.sign(), q_want.float().sign())
    assert not found.q[tokens:].float().any()  # padding rows are zeros
    if DEVICE == "cuda":  # bit for bit what the GEMMs' own quantization writes
        from dserve.kernels.triton_fp8 import quantize_activations

        q, s = quantize_activations(out, group, padded)
        assert torch.equal(q.float(), found.q.float()) and torch.equal(s, found.scales)
    else:  # the interpreter's float32 -> e4m3 cast is not exact (see test_triton_norm)
        assert ((got - q_want.float()).abs() <= q_want.float().abs() / 2).all()


@pytest.mark.parametrize(
    "tokens,heads,rank,v_dim,group",
    [(1, 3, 32, 16, 16), (5, 2, 64, 32, 16), (20, 2, 32, 32, 32)],
)
def test_product_and_its_fp8_form(tokens, heads, rank, v_dim, group):
    check(tokens, heads, rank, v_dim, group)


def test_shapes_it_takes():
    assert takes(512, 128, 128) and takes(32, 32, 16)
    assert not takes(512, 128, 16384)  # per-channel o_proj: a group spans every head
    assert not takes(32, 24, 32) and not takes(24, 32, 32) and not takes(32, 32, 48)


def test_o_proj_reads_the_attached_form_only_for_its_own_group():
    """`models.quant.value_up` takes the kernel only on a GPU for an FP8 o_proj whose groups
    lie in a head; elsewhere torch's product, with nothing attached."""
    from dserve.models.quant import value_up

    o, w_uv = operands(3, 2, 32, 16)

    class Dense(torch.nn.Module):
        weight = torch.zeros(8, 32, dtype=torch.bfloat16)

    out = value_up(o, w_uv, Dense())
    assert getattr(out, "fp8_form", None) is None
    assert torch.equal(out, reference(o, w_uv))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 64, 200])
def test_at_deepseek_v3_shapes(tokens):
    check(tokens, 128, 512, 128, 128)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_an_fp8_o_proj_reads_the_form_it_was_given():
    """Through `models.quant.value_up` and an FP8 o_proj of blocks of 128 (DeepSeek-V3's
    shapes, 256 output rows): the kernel's path gives o_proj's product on the bmm's output."""
    from dserve.models.quant import fp8_linear, rows_contiguous, value_up

    o, w_uv = operands(4, 128, 512, 128)
    o_proj = torch.nn.Module()
    dense = torch.randn(256, 128 * 128, device="cuda") / 128
    o_proj.weight = torch.nn.Parameter(dense.to(torch.float8_e4m3fn), requires_grad=False)
    scale = torch.nn.Parameter(torch.rand(256, 128, device="cuda") + 0.5, requires_grad=False)
    scale.block = 128
    o_proj.weight_scale = rows_contiguous(scale)
    x = value_up(o, w_uv, o_proj)
    assert quantized_form(x, 128) is not None
    got = fp8_linear(x, o_proj)
    want = fp8_linear(reference(o, w_uv), o_proj)  # quantized by the GEMM's own launch
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
