"""Attention backend with Triton kernels where they exist, the torch reference elsewhere.

Decode steps (one new token per sequence, or a few causal ones such as a chain of drafts to verify,
one kernel row per token) run `triton_mla.mla_decode` over the paged latent cache of MLA models and
`triton_mha.mha_decode` over the paged K/V of MHA/GQA models; prompt and extend spans and draft
trees still run the reference code until their kernels land. Select it with `--attention-backend
triton`; on a GPU the choice also puts the model's RMSNorms (fused with the residual add,
`triton_norm.py`) and routed experts (grouped GEMMs, `triton_moe.py`) on their Triton kernels.
"""
from __future__ import annotations

import os

from dserve.attention.backend import ForwardBatch
from dserve.attention.torch_backend import TorchBackend


MAX_DECODE_LIKE = 8  # spans up to this many tokens go through the decode kernel, one row per token


class TritonBackend(TorchBackend):
    def __init__(self, pool):
        if pool.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1, which "
                             "runs its kernels in Triton's interpreter, for tests); use the torch backend on the CPU")
        super().__init__(pool)

    def runs_static(self, batch: ForwardBatch) -> bool:
        """Spans of a few causal tokens: the decode kernels read everything they need from the batch's
        device tensors (one query row per token, with its span's page-table row and context)."""
        return bool(batch.q_lens) and all(n <= MAX_DECODE_LIKE for n in batch.q_lens) and batch.tree_masks is None

    def plan(self, batch: ForwardBatch) -> None:
        self.batch = batch
        self.decode = self.runs_static(batch)
        if self.decode:  # no per-sequence plan: the longest context only sizes the kernel's splits
            self.max_len = max(batch.seq_lens)
        else:
            super().plan(batch)

    def forward_mha(self, layer, q, k, v, scale):
        if not self.decode:
            return super().forward_mha(layer, q, k, v, scale)
        from dserve.attention.triton_mha import mha_decode

        b = self.batch
        self.pool.write(layer, 0, b.out_slots, k)
        self.pool.write(layer, 1, b.out_slots, v)
        keys, values = self.pool.buffers[layer]
        return mha_decode(q.contiguous(), keys, values, b.page_table, b.token_ctx_lens, scale,
                          row_seqs=b.token_seqs, max_len=self.max_len)

    def forward_mla(self, layer, q_latent, q_rope, latent, scale):
        if not self.decode:
            return super().forward_mla(layer, q_latent, q_rope, latent, scale)
        from dserve.attention.triton_mla import mla_decode

        b = self.batch
        self.pool.write(layer, 0, b.out_slots, latent)
        return mla_decode(q_latent.contiguous(), q_rope.contiguous(), self.pool.buffers[layer][0], b.page_table,
                          b.token_ctx_lens, scale, max_len=self.max_len, row_seqs=b.token_seqs)
