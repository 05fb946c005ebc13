"""DeepSeek's FlashMLA (the `sgl-flash-mla` wheel SGLang ships) as a peer
in the benchmarks, on the same pages and queries as ours:

- the dense decode (`bench.mla_decode --backend flashmla`);
- sparse attention's two Hopper kernels over the same selected
  positions (`bench.sparse_decode --flashmla`): the bf16 one
  (`flash_mla_sparse_fwd`, SGLang's `flashmla_sparse` backend, which it
  also runs for decode over a bf16 cache) and the FP8 decode
  (`flash_mla_with_kvcache` with indices: DeepSeek-V3.2's cache of 656
  bytes a token, SGLang's `flashmla_kv`), whose bytes differ from ours.

Hopper only, and only where the wheel is installed; the legacy kernels
(`use_legacy=True`) are the ones built for SM90.
"""

from __future__ import annotations

import torch

from bench.cuda_timing import graph_seconds

TILE = 128  # the FP8 cache's columns a float32 scale covers
FP8_TOKEN_BYTES = 512 + 4 * 4 + 64 * 2  # e4m3 latents, 4 scales, bf16 rope


def dense_decode(q_latent, q_rope, cache, table, lens, scale: float):
    """FlashMLA's dense decode over the same pages, a callable: q_latent
    [B, H, 512] and q_rope [B, H, 64] (in one tensor of 576 columns, as it
    takes them), `cache` [pages, page size, 576] (copied where it is not
    contiguous), `lens` int32 -> [B, H, 512]. Its split schedule is made
    by a first call, outside any graph, as SGLang plans it once a batch."""
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    batch, heads, rank = q_latent.shape
    q = torch.cat([q_latent, q_rope], -1).view(batch, 1, heads, -1)
    pages, page_size, width = cache.shape
    kv = cache.contiguous().view(pages, page_size, 1, width)
    meta, _ = get_mla_metadata()

    def run() -> torch.Tensor:
        out, _ = flash_mla_with_kvcache(
            q, kv, table, lens, rank, meta, softmax_scale=scale, use_legacy=True
        )
        return out.view(batch, heads, rank)

    run()
    return run


def dense_seconds(q_latent, q_rope, cache, table, lens, repeats: int) -> float:
    """`dense_decode`'s time (scale 0.07), as a CUDA graph replay."""
    run = dense_decode(q_latent, q_rope, cache, table, lens, 0.07)
    return graph_seconds(run, repeats)


def pool_slots(table, rows, selected, page_size: int) -> torch.Tensor:
    """Each selected context position (-1: none) as FlashMLA's sparse
    kernels index the cache: its slot in the pool (page x page size +
    offset), through row b's page-table row `rows[b]`; int32, -1 kept."""
    pos = selected.long()
    page = table[rows.long()].gather(1, pos.clamp(min=0) // page_size)
    slot = page.long() * page_size + pos % page_size
    return torch.where(pos >= 0, slot, -1).to(torch.int32)


def sparse_bf16(q, cache, slots, scale: float) -> torch.Tensor:
    """FlashMLA's bf16 sparse attention: q [B, H, 576] over the pool's
    `slots` [B, K] of `cache` [pages, page size, 576] -> [B, H, 512]."""
    from flash_mla import flash_mla_sparse_fwd

    kv = cache.view(-1, 1, cache.shape[-1])
    out, _, _ = flash_mla_sparse_fwd(q, kv, slots[:, None], scale, 512, use_legacy=True)
    return out


def fp8_cache(cache: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """`cache` [pages, page size, 576] bf16 in DeepSeek-V3.2's FP8 layout
    ([pages, page size, 1, 656] bytes): each 128 latent columns in e4m3
    over a float32 scale (their largest magnitude over 448), then the 4
    scales, then the rope columns in bf16; `chunk` pages at a time."""
    pages, size, _ = cache.shape
    out = torch.empty(pages, size, FP8_TOKEN_BYTES, dtype=torch.uint8, device=cache.device)
    for p0 in range(0, pages, chunk):
        _fp8_pages(cache[p0 : p0 + chunk], out[p0 : p0 + chunk])
    return out.view(torch.float8_e4m3fn).view(pages, size, 1, FP8_TOKEN_BYTES)


def _fp8_pages(cache: torch.Tensor, out: torch.Tensor) -> None:
    """`fp8_cache` of some pages, into `out` (their bytes)."""
    pages, size, _ = cache.shape
    tiles = cache[..., :512].float().view(pages, size, 4, TILE)
    scales = tiles.abs().amax(-1) / 448.0
    scaled = tiles / scales.clamp(min=1e-30)[..., None]
    e4m3 = scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    out[..., :512] = e4m3.view(pages, size, 512).view(torch.uint8)
    out[..., 512:528] = scales.contiguous().view(torch.uint8).view(pages, size, 16)
    out[..., 528:] = cache[..., 512:].contiguous().view(torch.uint8)


def sparse_fp8_decode(q, kv_fp8, slots, scale: float):
    """FlashMLA's FP8 sparse decode (`fp8_cache`'s layout), a callable:
    q [B, H, 576] over `slots` [B, K] -> [B, H, 512]. Its split schedule
    is made by a first call, outside any graph."""
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    batch, heads, width = q.shape
    q4 = q.view(batch, 1, heads, width)
    indices = slots[:, None]
    meta, _ = get_mla_metadata()

    def run() -> torch.Tensor:
        out, _ = flash_mla_with_kvcache(
            q4,
            kv_fp8,
            None,
            None,
            512,
            meta,
            softmax_scale=scale,
            indices=indices,
            use_legacy=True,
        )
        return out.view(batch, heads, 512)

    run()
    return run
