"""The Triton RMSNorm (+ residual add) kernel against the torch RMSNorm it replaces. On a CPU host it
runs under TRITON_INTERPRET=1 at small shapes (one of them not a power of two); on a GPU host also
at DeepSeek-V3's hidden size in bfloat16."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.kernels.triton_norm import rms_norm  # noqa: E402
from dserve.models.layers.norm import RMSNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on the GPU where there is one: part of `-m gpu`


def check(rows: int, hidden: int, dtype: torch.dtype, device: str, residual: bool) -> None:
    gen = torch.Generator().manual_seed(hidden + rows)
    norm = RMSNorm(hidden, 1e-6).to(device=device, dtype=dtype)
    norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(device=device, dtype=dtype)
    r = (
        (torch.randn(rows, hidden, generator=gen) * 3).to(device=device, dtype=dtype)
        if residual
        else None
    )
    out, total, _ = rms_norm(x, norm.weight, norm.eps, r)
    want_total = r + x if residual else x
    want = norm(want_total)
    assert out.dtype == want.dtype and out.shape == want.shape
    # a bf16 ulp
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(out, want, **tol)
    if residual and (device == "cuda" or dtype == torch.float32):
        assert torch.equal(total, want_total)  # the sum is rounded exactly as torch rounds it
    # Triton's interpreter rounds float32 -> bfloat16 towards zero: one ulp apart at most
    elif residual:
        torch.testing.assert_close(total, want_total, **tol)


@pytest.mark.parametrize("hidden", [64, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_matches_torch_small(hidden, dtype, residual):
    check(5, hidden, dtype, DEVICE, residual)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("rows", [1, 128, 4096])
@pytest.mark.parametrize("residual", [False, True])
def test_matches_torch_at_deepseek_v3_shapes(rows, residual):
    check(rows, 7168, torch.bfloat16, "cuda", residual)


def test_module_takes_the_kernel_only_on_a_gpu():
    norm = RMSNorm(8)
    norm.use_kernel = True
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    out, total = norm.add_and_norm(x, r)  # on the CPU: the torch path, whatever the switch
    assert torch.equal(total, r + x) and torch.equal(out, RMSNorm(8)(r + x))


def quantized_reference(y: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """y's e4m3 values and scales per row and `group` columns, as the GEMMs quantize."""
    rows, cols = y.shape
    groups = -(-cols // group)
    wide = torch.zeros(rows, groups * group)
    wide[:, :cols] = y.float()
    blocks = wide.view(rows, groups, group)
    scales = blocks.abs().amax(-1).clamp_min(1e-10) / 448.0
    q = (blocks / scales[..., None]).clamp(-448.0, 448.0).view(rows, -1)[:, :cols]
    return q.to(torch.float8_e4m3fn), scales


@pytest.mark.parametrize("rows,hidden,group", [(1, 64, 32), (5, 100, 32), (6, 100, 128)])
def test_quantized_output_is_what_the_gemms_would_quantize(rows, hidden, group):
    """The fused quantization writes the norm's rounded output in e4m3 with the scale per
    group a separate quantization would give (all of the row where the group covers it),
    rows padded to a multiple of 4 with zeros, scales token-major."""
    device = DEVICE
    gen = torch.Generator().manual_seed(rows + hidden)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(device, torch.bfloat16)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(device, torch.bfloat16)
    out, _, quantized = rms_norm(x, weight, 1e-6, quant_group=group)
    q_want, s_want = quantized_reference(out.cpu(), group)
    padded = -(-rows // 4) * 4
    assert quantized.q.shape == (padded, hidden) and quantized.scales.stride(0) == 1
    assert quantized.group == min(group, hidden)
    # Triton's float32 division on a GPU is within 2 ulp, not rounded as torch's
    torch.testing.assert_close(quantized.scales[:rows].cpu(), s_want, rtol=3e-7, atol=0)
    got, want = quantized.q[:rows].cpu().float(), q_want.float()
    assert torch.equal(got.sign(), want.sign())
    if device == "cuda":  # at most one e4m3 step apart, from those ulps
        step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(2**-6))) - 3)
        assert ((got - want).abs() <= step).all()
    else:  # the interpreter's float32 -> e4m3 cast is not exact (-126.6 gave -64, not -128)
        assert ((got - want).abs() <= want.abs() / 2).all()
    assert not quantized.q[rows:].float().any()
    if device == "cuda":  # and bit for bit what the GEMMs' own quantization writes
        from dserve.kernels.triton_fp8 import quantize_activations

        q, s = quantize_activations(out, group, padded)
        assert torch.equal(q.float(), quantized.q.float()) and torch.equal(s, quantized.scales)


def test_norm_output_carries_its_fp8_form_to_the_gemms():
    """A norm with `quant_group` attaches the FP8 form to its output, in its group only."""
    from dserve.kernels.triton_fp8 import quantized_form

    device = DEVICE
    norm = RMSNorm(64).to(device=device, dtype=torch.bfloat16)
    norm.use_kernel, norm.quant_group = True, 32
    x = torch.randn(3, 64, device=device, dtype=torch.bfloat16)
    out = norm(x)
    if device == "cpu":  # the torch path: nothing quantized
        assert quantized_form(out, 32) is None
        return
    assert quantized_form(out, 32) is not None
    assert quantized_form(out, 64) is None and quantized_form(out[:2], 32) is None
