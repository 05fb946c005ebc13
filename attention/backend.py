"""The attention backend interface and the one batch representation every forward pass uses.

A batch is a list of spans: sequence i computes `q_lens[i]` new tokens at the end of a context of
`seq_lens[i]` tokens (prompt chunk, one decode token or several draft tokens alike). There is no
prefill/decode mode: a backend may pick a kernel per span shape, but the model never asks. A span
sees its context causally unless it carries a draft tree's mask.

A backend is bound to one KV pool. `plan(batch)` runs once per forward for per-batch metadata;
`forward_mha` / `forward_mla` run one layer: store the new tokens' K/V (or latent) into their
slots, then attend over the whole context through the page table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import numpy as np
import torch

from dserve.memory.kv_pool import KVPool

MAX_DECODE_LIKE = 8  # spans up to this many tokens go through the decode kernel, one row per token


@dataclass
class FusedDraft:
    """Naive speculation (`spec/naive.py`): the draft runs over the batch's own tokens in the same
    call. Its input at row r is `next_ids[r]`, or where `from_target[r]` >= 0 the target's argmax in
    that row of the target's logits; the draft's logits are wanted at rows `logits_rows`."""

    next_ids: torch.Tensor  # [T]
    from_target: torch.Tensor  # [T]
    logits_rows: torch.Tensor  # [M]

    def to(self, device: torch.device) -> "FusedDraft":
        return FusedDraft(
            *(
                t.to(device, non_blocking=True)
                for t in (self.next_ids, self.from_target, self.logits_rows)
            )
        )


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    """[T] new tokens of all spans, span after span."""
    positions: torch.Tensor
    """[T] their rotary positions in their sequences."""
    q_lens: list[int]
    """New tokens per span."""
    seq_lens: list[int]
    """Context length per span after this step (cached + new)."""
    page_table: torch.Tensor
    """[B, max_pages] page ids of each sequence (padding beyond its pages)."""
    out_slots: torch.Tensor
    """[T] slot (page * page_size + offset) each new token's KV is written to."""
    logits_rows: torch.Tensor
    """[N] rows of the flattened tokens whose logits are wanted."""
    dp_num_tokens: list[int] | None = None
    """With DP attention: every DP group's token count this pass."""
    hidden_rows: torch.Tensor | None = None
    """A draft pass: per token, the row of the previous pass's hidden states it reads (the
    target's or the draft's own)."""
    tree_masks: list[torch.Tensor | None] | None = None
    """Per span, None (causal) or a draft tree's bool [q_len, tail]: which of the context's last
    `tail` positions each new token sees (all positions before those are seen by every token of
    the span)."""
    fused_draft: FusedDraft | None = None
    """Naive speculation: the draft's pass over these tokens too; the logits returned are the
    target's rows, then the draft's."""
    real_tokens: torch.Tensor | None = None
    """A padded static pass: [T], nonzero on the real tokens."""
    moe_real_tokens: torch.Tensor | None = None
    """The same for the rows the MoE layers see: every DP group's, gathered once a pass
    (`ParallelContext.moe_mask`)."""
    token_seqs: torch.Tensor | None = None
    """[T] per token, its span's index (derived when not given)."""
    token_ctx_lens: torch.Tensor | None = None
    """[T] per token, how many context positions it sees causally (its position in the span's
    cache indices + 1; derived when not given)."""

    def __post_init__(self) -> None:
        if self.token_seqs is None or self.token_ctx_lens is None:
            seqs = [i for i, n in enumerate(self.q_lens) for _ in range(n)]
            ctx = [s - n + j + 1 for n, s in zip(self.q_lens, self.seq_lens) for j in range(n)]
            device = self.input_ids.device
            self.token_seqs = torch.tensor(seqs, dtype=torch.int64).to(device)
            self.token_ctx_lens = torch.tensor(ctx, dtype=torch.int64).to(device)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_static(self) -> bool:
        """A padded pass from a CUDA graph's static buffers (`runtime/cuda_graphs.py`)."""
        return self.real_tokens is not None

    def to(self, device: torch.device) -> "ForwardBatch":
        if self.input_ids.device == device:
            return self
        move = lambda t: None if t is None else t.to(device, non_blocking=True)
        return replace(
            self,
            input_ids=move(self.input_ids),
            positions=move(self.positions),
            page_table=move(self.page_table),
            out_slots=move(self.out_slots),
            logits_rows=move(self.logits_rows),
            hidden_rows=move(self.hidden_rows),
            tree_masks=None if self.tree_masks is None else [move(m) for m in self.tree_masks],
            fused_draft=None if self.fused_draft is None else self.fused_draft.to(device),
            token_seqs=move(self.token_seqs),
            token_ctx_lens=move(self.token_ctx_lens),
            real_tokens=move(self.real_tokens),
            moe_real_tokens=move(self.moe_real_tokens),
        )

    def select(self, spans: list[int]) -> tuple[ForwardBatch, torch.Tensor]:
        """A batch of these spans alone (for their attention: it asks for no logits), and its
        rows in this batch."""
        firsts = [sum(self.q_lens[:i]) for i in spans]
        rows = [r for i, f in zip(spans, firsts) for r in range(f, f + self.q_lens[i])]
        rows = torch.tensor(rows, dtype=torch.int64).to(self.input_ids.device)
        index = torch.tensor(spans, dtype=torch.int64).to(self.page_table.device)
        part = ForwardBatch(
            self.input_ids[rows],
            self.positions[rows],
            [self.q_lens[i] for i in spans],
            [self.seq_lens[i] for i in spans],
            self.page_table[index],
            self.out_slots[rows],
            rows[:0],
        )
        return part, rows

    def span_mask(self, i: int) -> torch.Tensor:
        """Span i's [q_len, seq_len] visibility: causal (each new token sees the context up to
        its own position), or its tree mask over the tail."""
        tree = None if self.tree_masks is None else self.tree_masks[i]
        if tree is None:
            q_len, seq_len = self.q_lens[i], self.seq_lens[i]
            positions = torch.arange(seq_len, device=self.page_table.device)
            return positions[None, :] <= positions[seq_len - q_len :, None]
        mask = torch.ones(tree.shape[0], self.seq_lens[i], dtype=torch.bool, device=tree.device)
        mask[:, self.seq_lens[i] - tree.shape[1] :] = tree
        return mask


@dataclass(frozen=True)
class PassShape:
    """What decides whether a pass can run from static buffers (CUDA graphs): its token count,
    longest span, longest context and whether a span carries a draft tree's mask."""

    tokens: int
    max_q_len: int
    max_seq_len: int
    tree: bool = False

    @classmethod
    def of(cls, batch: ForwardBatch) -> PassShape:
        return cls(
            batch.num_tokens,
            max(batch.q_lens, default=0),
            max(batch.seq_lens, default=0),
            batch.tree_masks is not None,
        )


class AttentionBackend(ABC):
    def __init__(self, pool: KVPool, index_pool: KVPool | None = None):
        self.pool = pool
        self.index_pool = index_pool
        """A sparse-attention (DSA) model's indexer keys, page for page beside `pool`."""
        self.expand_min_tokens = 0
        """MLA spans of at least this many new tokens run expanded (0: none)."""
        self.batch: ForwardBatch | None = None
        self._expanded = None  # the pass's `mla_expanded.ExpandedPlan`, made on first use
        self._absorbing = None  # a backend of this kind for the other spans of such a pass

    @property
    def expand_mla(self) -> bool:
        """Whether MLA runs through `forward_mla_expanded` in this pass: a span has at least
        `expand_min_tokens` new tokens (and fits `mla_expanded.MAX_CONTEXT`), no draft trees,
        not sparse attention, not a pass a CUDA graph replays (planned on the host)."""
        b = self.batch
        return (
            self.expand_min_tokens > 0
            and self.index_pool is None
            and b.tree_masks is None
            and max(b.q_lens, default=0) >= self.expand_min_tokens
            and not self.runs_static(PassShape.of(b))
            and bool(self.expanded_plan().spans)
        )

    def expanded_launch(self) -> dict | None:
        """Expanded MLA's attention: the Triton kernel's launch settings (`triton_expanded`:
        rows, block_n, num_warps, num_stages), or None for PyTorch's attention. The kernel on a
        GPU by default."""
        if self.pool.device.type != "cuda":
            return None
        from dserve.attention.triton_backend import EXTEND_TUNE

        return EXTEND_TUNE["expanded"]

    def expanded_plan(self):
        """This pass's `ExpandedPlan` (its spans of at least `expand_min_tokens` new tokens;
        all when that is 0), made once a pass."""
        from dserve.attention.mla_expanded import plan_expanded

        launch, plan = self.expanded_launch(), self._expanded
        rows = None if launch is None else launch["rows"]
        if plan is None or plan.batch is not self.batch or plan.rows != rows:
            ps = self.pool.layout.page_size
            plan = plan_expanded(self.batch, ps, self.expand_min_tokens, rows)
            self._expanded = plan
        return plan

    def forward_mla_expanded(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Expanded MLA (`attention/mla_expanded.py`): q_nope [T, H, N], q_rope [T, H, P],
        latent [T, R + P] (stored first), kv_b_proj's halves w_uk [H, N, R] and w_uv [H, V, R]
        -> attention output [T, H, V]. The spans `expanded_plan` leaves out run absorbed."""
        from dserve.attention.mla_expanded import expanded_mla

        plan = self.expanded_plan()
        self.pool.write(layer, 0, self.batch.out_slots, latent)
        launch = self.expanded_launch()
        out = expanded_mla(self.pool, plan, layer, q_nope, q_rope, w_uk, w_uv, scale, launch)
        if plan.rest is not None:
            self._absorb_rest(layer, plan, out, q_nope, q_rope, latent, w_uk, w_uv, scale)
        return out

    def _absorb_rest(self, layer, plan, out, q_nope, q_rope, latent, w_uk, w_uv, scale):
        """The spans the plan leaves out (short extends, decode tokens) into `out`'s rows,
        absorbed, by a backend of this kind planned on a batch of them."""
        if self._absorbing is None:
            self._absorbing = self.sibling()
        part, rows = self._absorbing, plan.rest_rows
        if part.batch is not plan.rest:
            part.plan(plan.rest)
        q_latent = torch.bmm(q_nope[rows].transpose(0, 1), w_uk).transpose(0, 1)
        o = part.forward_mla(layer, q_latent, q_rope[rows], latent[rows], scale)
        out[rows] = torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def sibling(self) -> AttentionBackend:
        """A backend of this kind on the same pool (for part of a pass)."""
        return type(self)(self.pool)

    def runs_static(self, shape: PassShape) -> bool:
        """Whether the layers can run a pass of this shape from its device tensors alone, with no
        host work that depends on the step's values (what a CUDA graph replay needs); `plan` may
        still read shapes."""
        return False

    def prepare_static(self, tokens: int, ctx_lens: np.ndarray) -> None:
        """Before a static pass of `tokens` padded tokens (a graph's replay, or the eager runs
        before its capture), outside the graph: each token's context length (what it sees
        causally; a pad token sees one position), from the host. A backend that plans on the
        host (FlashInfer) plans here; the others need nothing."""
        return None

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Prepare per-batch metadata; called once before the layers run."""

    @abstractmethod
    def forward_mha(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] -> [T, Hq, Dv]; stores k, v first."""

    @abstractmethod
    def forward_mla(
        self,
        layer: int,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Absorbed MLA: q_latent [T, H, R], q_rope [T, H, P], latent [T, R + P] (normalised c_kv
        then roped k_pe) -> attention-weighted latents [T, H, R]; stores latent first. A sparse
        (DSA) model passes `selection` too: per token the context positions it attends to,
        [T, K] (-1: none), from `forward_indexer`."""

    def forward_indexer(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        weights: torch.Tensor,
        scale: float,
        topk: int,
    ) -> torch.Tensor:
        """DSA's lightning indexer: q [T, H, D], the tokens' keys k [T, D] (stored first in
        `index_pool`'s `layer`), head weights [T, H] (float32) -> per token the `topk` visible
        context positions of the highest sum over heads of weight x ReLU(scale x q.k), [T,
        topk], -1 where fewer are visible."""
        raise NotImplementedError(f"{type(self).__name__} has no sparse attention (DSA) yet")


def create_backend(name: str, pool: KVPool, index_pool: KVPool | None = None) -> AttentionBackend:
    if name == "torch":
        from dserve.attention.torch_backend import TorchBackend

        return TorchBackend(pool, index_pool)
    if name == "triton":
        from dserve.attention.triton_backend import TritonBackend

        return TritonBackend(pool, index_pool)
    if name == "flashinfer":
        from dserve.attention.flashinfer_backend import FlashInferBackend

        if index_pool is not None:
            raise ValueError(
                "attention_backend='flashinfer' has no sparse attention (DSA) yet: serve this "
                "model with attention_backend='triton' or 'torch'"
            )
        return FlashInferBackend(pool)
    raise ValueError(f"unknown attention backend {name!r} (choose from: torch, triton, flashinfer)")
