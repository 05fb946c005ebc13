"""The Triton rotary kernel against `RotaryEmbedding.apply`'s torch code: equal bit for bit in bf16
(the kernel rounds each product to the input dtype as torch does) and in the interpreter's float32,
for DeepSeek's interleaved pairs and GLM's partial rotary, on strided views such as a split of q.
Under TRITON_INTERPRET=1 on a CPU host in float32; bf16 (the interpreter does not round its casts
as a GPU does) and the real models' shapes on a GPU, where float32 is only close (FMAs)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host

from dserve.kernels.triton_rotary import apply_rotary  # noqa: E402
from dserve.models.config import RopeConfig  # noqa: E402
from dserve.models.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on the GPU where there is one: part of `-m gpu`


def check(tokens, heads, head_dim, rotary_dim, interleaved, dtype, prefix=0):
    """`prefix` features before the rotary part (q = [nope | rope], the rotary part a strided view)."""
    rope = RopeConfig(rotary_dim=rotary_dim, theta=10000.0, interleaved=interleaved)
    emb = RotaryEmbedding(rope).to(DEVICE)
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(tokens, heads, prefix + head_dim, generator=gen).to(DEVICE, dtype)
    x = full[..., prefix:]
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE)
    cos, sin = emb.cos_sin(positions, dtype)
    ours, ref = apply_rotary(x, cos, sin, interleaved), emb.apply(x, cos, sin)
    if dtype == torch.float32 and DEVICE == "cuda":  # FMAs round once where torch rounds twice
        assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(ours, ref)


@pytest.mark.parametrize("interleaved", [False, True])
def test_full_rotary_equals_torch(interleaved):
    check(
        tokens=7,
        heads=3,
        head_dim=16,
        rotary_dim=16,
        interleaved=interleaved,
        dtype=torch.float32,
        prefix=8,
    )


def test_partial_rotary_copies_the_rest():
    check(tokens=5, heads=20, head_dim=24, rotary_dim=8, interleaved=False, dtype=torch.float32)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="Triton's interpreter rounds float32 -> bf16 casts toward zero; bf16 is checked on a GPU",
)
def test_bf16_rounding_equals_torch():
    check(tokens=4, heads=2, head_dim=16, rotary_dim=16, interleaved=True, dtype=torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes run on a GPU")
@pytest.mark.parametrize(
    "heads,head_dim,rotary_dim,interleaved,prefix",
    [(128, 64, 64, True, 128), (96, 128, 64, False, 0)],
)
def test_real_shapes_equal_torch(heads, head_dim, rotary_dim, interleaved, prefix):
    """DeepSeek-V3's q_rope (a view past 128 nope features) and GLM-4.5's partial rotary, bf16."""
    check(300, heads, head_dim, rotary_dim, interleaved, torch.bfloat16, prefix)
