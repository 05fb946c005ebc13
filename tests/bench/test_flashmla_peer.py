"""The FlashMLA peer's inputs (`bench.flashmla`), built on the CPU: the
selected positions as pool slots, and DeepSeek-V3.2's FP8 cache layout,
which must decode back to the cache within e4m3's rounding (the kernels
themselves run in `tests/attention/test_gluon_mla.py` on a GPU)."""

from __future__ import annotations

import torch

from bench.flashmla import FP8_TOKEN_BYTES, fp8_cache, pool_slots


def test_positions_become_their_pool_slots():
    """Row b reads page-table row rows[b]; -1 stays -1."""
    table = torch.tensor([[7, 2, 5], [1, 0, 3]], dtype=torch.int32)
    rows = torch.tensor([1, 0])
    selected = torch.tensor([[0, 65, 130, -1], [3, 64, 129, 191]])
    slots = pool_slots(table, rows, selected, 64)
    want = [[1 * 64, 0 * 64 + 1, 3 * 64 + 2, -1], [7 * 64 + 3, 2 * 64, 5 * 64 + 1, 5 * 64 + 63]]
    assert slots.dtype == torch.int32
    assert slots.tolist() == want


def test_the_fp8_layout_decodes_to_the_cache():
    """Each token: 512 e4m3 bytes, four float32 scales (one a 128
    columns), 64 bf16 rope columns, 656 bytes; in chunks of pages."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(5, 64, 576, generator=gen).to(torch.bfloat16)
    cache[2, 3, :128] = 0  # a tile of zeros: scale 0, no NaN
    packed = fp8_cache(cache, chunk=2).view(5, 64, FP8_TOKEN_BYTES)
    raw = packed.view(torch.uint8)
    values = raw[..., :512].view(torch.float8_e4m3fn).float().view(5, 64, 4, 128)
    scales = raw[..., 512:528].contiguous().view(torch.float32).view(5, 64, 4)
    latents = (values * scales[..., None]).view(5, 64, 512)
    rope = raw[..., 528:].contiguous().view(torch.bfloat16)
    assert torch.equal(rope, cache[..., 512:])
    assert not latents.isnan().any()
    err = (latents - cache[..., :512].float()).abs()
    # e4m3 keeps 3 mantissa bits (half a step: 1/16 of the value), and its
    # subnormals' step is 2^-9 of the scale
    step = scales.repeat_interleave(128, -1) * 2.0**-10
    assert (err <= cache[..., :512].float().abs() / 16 + step + 1e-7).all()
    assert latents[2, 3, :128].eq(0).all()
