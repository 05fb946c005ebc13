"""Physical KV cache of one model: per layer, `num_pages` pages of `page_size` token slots.

Three layouts, described by a `KVLayout` so transfer and sizing read one description:
MLA stores one latent vector per token (`kv_lora_rank + qk_rope_head_dim`, replicated over
attention-TP ranks); MHA/GQA stores K and V per KV head this rank holds; "index" is a sparse
attention (DSA) model's indexer keys, one vector of `latent_dim` per token and indexer layer,
replicated like MLA's latent (in FP8, a uint8 pool, a second buffer holds each key's float32
scale: a page of a layer holds its keys, then their scales, so every key row is as aligned as
the keys' width allows). A pool is page-major in
memory: one page holds its slots of every layer and buffer, back to back, so a run of
consecutive pages is one contiguous block and moves as one copy (one UCX message) for all layers.
Each layer's buffers are views of that block, [num_pages, page_size, *token_shape] with a page stride
of the whole page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_BYTES = 4  # a float32 scale, as bytes of a uint8 (FP8 indexer) pool


@dataclass(frozen=True)
class KVLayout:
    kind: str  # "mla", "mha" or "index"
    num_layers: int
    page_size: int
    dtype: torch.dtype
    latent_dim: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim; index: index_head_dim
    kv_lora_rank: int = 0
    num_kv_heads: int = 0  # MHA: heads this rank holds
    head_dim: int = 0
    v_head_dim: int = 0

    @property
    def scaled(self) -> bool:
        """FP8 indexer keys: each key's bytes, and in a second buffer its float32 scale's."""
        return self.kind == "index" and self.dtype == torch.uint8

    @property
    def buffers_per_layer(self) -> int:
        return 2 if self.kind == "mha" or self.scaled else 1

    def token_shapes(self) -> list[tuple[int, ...]]:
        """Per-token shape of each buffer of a layer."""
        if self.scaled:
            return [(self.latent_dim,), (SCALE_BYTES,)]
        if self.kind != "mha":
            return [(self.latent_dim,)]
        return [(self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.v_head_dim)]

    @property
    def bytes_per_token(self) -> int:
        elems = sum(int(torch.Size(s).numel()) for s in self.token_shapes())
        return elems * self.num_layers * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size


class KVPool:
    """`pages` is the whole cache, [num_pages, elements per page]; `buffers[layer][b]` are its views of
    shape [num_pages, page_size, *token_shape]."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str):
        self.layout, self.num_pages, self.device = layout, num_pages, torch.device(device)
        shapes = [(layout.page_size, *shape) for shape in layout.token_shapes()] * layout.num_layers
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        self.pages = torch.zeros((num_pages, sum(sizes)), dtype=layout.dtype, device=self.device)
        views, offset = [], 0
        for shape, size in zip(shapes, sizes):
            views.append(self.pages[:, offset : offset + size].view(num_pages, *shape))
            offset += size
        n = layout.buffers_per_layer
        self.buffers = [views[i : i + n] for i in range(0, len(views), n)]

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.layout.page_size

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.layout.bytes_per_page

    def write(self, layer: int, buffer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store one entry per slot (slot = page * page_size + offset)."""
        b, ps = self.buffers[layer][buffer], self.layout.page_size
        b[slots // ps, slots % ps] = values.to(b.dtype)

    def read(self, layer: int, buffer: int, slots: torch.Tensor) -> torch.Tensor:
        """The entries of `slots`, gathered, [len(slots), *token_shape]."""
        b, ps = self.buffers[layer][buffer], self.layout.page_size
        return b[slots // ps, slots % ps]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's entries of slots `src` to slots `dst` (all read before any is written)."""
        for layer in range(self.layout.num_layers):
            for b in range(self.layout.buffers_per_layer):
                self.write(layer, b, dst, self.read(layer, b, src))
