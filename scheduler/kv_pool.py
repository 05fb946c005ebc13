"""Physical KV cache of one model: per layer, `num_pages` pages of `page_size` token slots.

Two layouts, described by a `KVLayout` so transfer and sizing read one description:
MLA stores one latent vector per token (`kv_lora_rank + qk_rope_head_dim`, replicated over
attention-TP ranks); MHA/GQA stores K and V per KV head this rank holds. A page of one layer is
contiguous in memory, so moving a run of pages is one copy per layer and buffer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    kind: str  # "mla" or "mha"
    num_layers: int
    page_size: int
    dtype: torch.dtype
    latent_dim: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim
    kv_lora_rank: int = 0
    num_kv_heads: int = 0  # MHA: heads this rank holds
    head_dim: int = 0
    v_head_dim: int = 0

    @property
    def buffers_per_layer(self) -> int:
        return 1 if self.kind == "mla" else 2

    def token_shapes(self) -> list[tuple[int, ...]]:
        """Per-token shape of each buffer of a layer."""
        if self.kind == "mla":
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
    """Tensors `buffers[layer][b]` of shape [num_pages, page_size, *token_shape]."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str):
        self.layout, self.num_pages, self.device = layout, num_pages, torch.device(device)
        self.buffers = [
            [torch.zeros((num_pages, layout.page_size, *shape), dtype=layout.dtype, device=self.device)
             for shape in layout.token_shapes()]
            for _ in range(layout.num_layers)
        ]

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.layout.page_size

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.layout.bytes_per_page

    def slots(self, layer: int, buffer: int) -> torch.Tensor:
        """A layer buffer viewed as [num_slots, *token_shape], slot = page * page_size + offset."""
        b = self.buffers[layer][buffer]
        return b.view(-1, *b.shape[2:])
