"""Attention backend with Triton kernels where they exist, the torch reference elsewhere.

Decode steps of MLA models (one new token per sequence, or a few causal ones such as a chain of
drafts to verify, one kernel row per token) run `triton_mla.mla_decode` over the paged latent cache;
prompt and extend spans, draft trees and MHA models still run the reference code until their
kernels land. Select it with `--attention-backend triton`; on a GPU the choice also
puts the model's RMSNorms (fused with the residual add, `triton_norm.py`) and routed experts (grouped
GEMMs, `triton_moe.py`) on their Triton kernels.
"""
from __future__ import annotations

import os

import torch

from dserve.attention.backend import ForwardBatch
from dserve.attention.torch_backend import TorchBackend


MAX_DECODE_LIKE = 8  # spans up to this many tokens go through the decode kernel, one row per token


class TritonBackend(TorchBackend):
    def __init__(self, pool):
        if pool.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1, which "
                             "runs its kernels in Triton's interpreter, for tests); use the torch backend on the CPU")
        super().__init__(pool)

    def plan(self, batch: ForwardBatch) -> None:
        self.batch = batch
        self.decode = (self.pool.layout.kind == "mla" and bool(batch.q_lens)
                       and all(n <= MAX_DECODE_LIKE for n in batch.q_lens) and batch.tree_masks is None)
        if self.decode:  # the kernel reads the page table itself: no per-sequence reference plan
            # a few causal tokens of a span (a chain verify) are decode rows of their own: token j of
            # span i sees the first seq_len - q_len + j + 1 positions of its sequence's pages
            lens = [s - n + j + 1 for n, s in zip(batch.q_lens, batch.seq_lens) for j in range(n)]
            self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=batch.page_table.device)
            self.max_len = max(lens)
            self.page_table = batch.page_table
            if any(n > 1 for n in batch.q_lens):
                counts = torch.tensor(batch.q_lens, device=batch.page_table.device)
                self.page_table = batch.page_table.repeat_interleave(counts, dim=0)
        else:
            super().plan(batch)

    def forward_mla(self, layer, q_latent, q_rope, latent, scale):
        if not self.decode:
            return super().forward_mla(layer, q_latent, q_rope, latent, scale)
        from dserve.attention.triton_mla import mla_decode

        self.pool.write(layer, 0, self.batch.out_slots, latent)
        return mla_decode(q_latent.contiguous(), q_rope.contiguous(), self.pool.buffers[layer][0],
                          self.page_table, self.seq_lens, scale, max_len=self.max_len)
