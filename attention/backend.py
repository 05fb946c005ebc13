"""The attention backend interface and the one batch representation every forward pass uses.

A batch is a list of spans: sequence i computes `q_lens[i]` new tokens at the end of a context of
`seq_lens[i]` tokens (prompt chunk, one decode token or several draft tokens alike). There is no
prefill/decode mode: a backend may pick a kernel per span shape, but the model never asks.

A backend is bound to one KV pool. `plan(batch)` runs once per forward for per-batch metadata;
`forward_mha` / `forward_mla` run one layer: store the new tokens' K/V (or latent) into their
slots, then attend over the whole context through the page table.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from dserve.scheduler.kv_pool import KVPool


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] new tokens of all spans, span after span
    positions: torch.Tensor  # [T] their positions in their sequences
    q_lens: list[int]  # new tokens per span
    seq_lens: list[int]  # context length per span after this step (cached + new)
    page_table: torch.Tensor  # [B, max_pages] page ids of each sequence (padding beyond its pages)
    out_slots: torch.Tensor  # [T] slot (page * page_size + offset) each new token's KV is written to
    logits_indices: torch.Tensor  # [N] rows of the flattened tokens whose logits are wanted
    dp_num_tokens: list[int] | None = None  # with DP attention: every DP group's token count this step
    hidden_rows: torch.Tensor | None = None  # a draft pass: per token, the row of the previous pass's
    #                                          hidden states it reads (the target's or the draft's own)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device) -> "ForwardBatch":
        if self.input_ids.device == device:
            return self
        move = lambda t: t.to(device, non_blocking=True)
        return ForwardBatch(move(self.input_ids), move(self.positions), self.q_lens, self.seq_lens,
                            move(self.page_table), move(self.out_slots), move(self.logits_indices),
                            self.dp_num_tokens, None if self.hidden_rows is None else move(self.hidden_rows))


class AttentionBackend(ABC):
    def __init__(self, pool: KVPool):
        self.pool = pool

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Prepare per-batch metadata; called once before the layers run."""

    @abstractmethod
    def forward_mha(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] -> [T, Hq, Dv]; stores k, v first."""

    @abstractmethod
    def forward_mla(self, layer: int, q_latent: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                    scale: float) -> torch.Tensor:
        """Absorbed MLA: q_latent [T, H, R], q_rope [T, H, P], latent [T, R + P] (normalised c_kv
        then roped k_pe) -> attention-weighted latents [T, H, R]; stores latent first."""


def create_backend(name: str, pool: KVPool) -> AttentionBackend:
    if name == "torch":
        from dserve.attention.torch_backend import TorchBackend

        return TorchBackend(pool)
    if name == "triton":
        from dserve.attention.triton_backend import TritonBackend

        return TritonBackend(pool)
    if name == "flashinfer":
        raise ValueError("the flashinfer backend comes with the GPU path; install it with "
                         "`pip install dserve[flashinfer]` once that lands, or use --attention-backend torch")
    raise ValueError(f"unknown attention backend {name!r} (choose from: torch, triton)")
