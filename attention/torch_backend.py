"""Pure-torch reference attention over the paged cache: runs on any device, one sequence at a time.

It gathers each sequence's context through its page table and applies a causal mask at the span's
offset (or the span's draft-tree mask). Fast kernels are checked against this backend.
"""

from __future__ import annotations

import torch

from dserve.attention.backend import AttentionBackend, ForwardBatch
from dserve.attention.index_cache import read_keys, select_top, write_keys


class TorchBackend(AttentionBackend):
    def plan(self, batch: ForwardBatch) -> None:
        ps = self.pool.layout.page_size
        self.batch = batch
        self.ctx_slots, self.masks, self.q_starts = [], [], []
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(batch.q_lens, batch.seq_lens)):
            pos = torch.arange(seq_len, device=batch.page_table.device)
            self.ctx_slots.append(batch.page_table[i, pos // ps] * ps + pos % ps)
            self.masks.append(batch.span_mask(i))  # [q_len, seq_len]
            self.q_starts.append(start)
            start += q_len

    def expanded_launch(self) -> None:
        """Expanded MLA through PyTorch's attention (the reference)."""
        return None

    def _spans(self):
        for i, q_len in enumerate(self.batch.q_lens):
            s = self.q_starts[i]
            yield slice(s, s + q_len), self.ctx_slots[i], self.masks[i]

    def forward_mha(self, layer, q, k, v, scale):
        self.pool.write(layer, 0, self.batch.out_slots, k)
        self.pool.write(layer, 1, self.batch.out_slots, v)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        group = q.shape[1] // k.shape[1]
        for rows, slots, mask in self._spans():
            # [S, Hq, D]
            keys = self.pool.read(layer, 0, slots).to(q.dtype).repeat_interleave(group, dim=1)
            values = self.pool.read(layer, 1, slots).to(q.dtype).repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[rows], keys) * scale
            probs = (
                scores.masked_fill(~mask, float("-inf"))
                .softmax(dim=-1, dtype=torch.float32)
                .to(q.dtype)
            )
            out[rows] = torch.einsum("hqk,khd->qhd", probs, values)
        return out

    def forward_mla(self, layer, q_latent, q_rope, latent, scale, selection=None):
        self.pool.write(layer, 0, self.batch.out_slots, latent)
        rank = q_latent.shape[-1]
        out = q_latent.new_empty(q_latent.shape)
        for rows, slots, mask in self._spans():
            if selection is not None:
                mask = mask & selected(selection[rows], mask.shape[1])
            ctx = self.pool.read(layer, 0, slots).to(q_latent.dtype)  # [S, R + P]
            c_kv, k_rope = ctx[:, :rank], ctx[:, rank:]
            scores = (
                torch.einsum("qhr,kr->hqk", q_latent[rows], c_kv)
                + torch.einsum("qhp,kp->hqk", q_rope[rows], k_rope)
            ) * scale
            probs = (
                scores.masked_fill(~mask, float("-inf"))
                .softmax(dim=-1, dtype=torch.float32)
                .to(q_latent.dtype)
            )
            out[rows] = torch.einsum("hqk,kr->qhr", probs, c_kv)
        return out

    def forward_indexer(self, layer, q, k, weights, scale, topk):
        write_keys(self.index_pool, layer, self.batch.out_slots, k)
        out = torch.empty((q.shape[0], topk), dtype=torch.int64, device=q.device)
        for rows, slots, mask in self._spans():
            keys = read_keys(self.index_pool, layer, slots)  # [S, D]
            # as the references: per head scores, ReLU, then the weighted sum over heads
            scores = torch.relu(torch.matmul(q[rows].float(), keys.T) * scale)  # [q, H, S]
            index = torch.matmul(weights[rows].unsqueeze(1), scores).squeeze(1)  # [q, S]
            out[rows] = select_top(index.masked_fill(~mask, float("-inf")), topk)
        return out


def selected(positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[q, seq_len] bool: True at each row's `positions` (-1 entries select nothing)."""
    mask = torch.zeros(positions.shape[0], seq_len + 1, dtype=torch.bool, device=positions.device)
    mask.scatter_(1, torch.where(positions < 0, seq_len, positions), True)
    return mask[:, :seq_len]
