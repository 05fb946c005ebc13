"""The Triton RMSNorm (+ residual add) kernel against the torch RMSNorm it replaces. On a CPU host it
runs under TRITON_INTERPRET=1 at small shapes (one of them not a power of two); on a GPU host also
at DeepSeek-V3's hidden size in bfloat16."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.kernels.triton_norm import rms_norm  # noqa: E402
from dserve.models.layers.norm import RMSNorm  # noqa: E402


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
    out, total = rms_norm(x, norm.weight, norm.eps, r)
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
    check(5, hidden, dtype, "cuda" if torch.cuda.is_available() else "cpu", residual)


@pytest.mark.gpu
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
