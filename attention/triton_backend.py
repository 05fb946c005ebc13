"""Attention backend with Triton kernels where they exist, the torch reference elsewhere.

Decode steps (one new token per sequence, or a few causal ones such as a chain of drafts to verify,
one kernel row per token) run `triton_mla.mla_decode` over the paged latent cache of MLA models and
`triton_mha.mha_decode` over the paged K/V of MHA/GQA models, split over the context. Prompt
chunks, extends and draft trees run `triton_extend` (blocks of query tokens, causal or tree masks);
long prompt chunks of MLA models, in the expanded form, `triton_expanded`.
New tokens' KV goes into the pages through `triton_store`. Select it with `--attention-backend
triton`; on a GPU the choice also puts the model's RMSNorms (fused with the residual add,
`kernels/triton_norm.py`), rotary embeddings (`kernels/triton_rotary.py`) and routed experts
(grouped GEMMs, `kernels/triton_moe.py`) on their Triton kernels. Sparse attention (DSA): the indexer's scores by
`triton_dsa.indexer_scores` (over FP8 keys on Hopper, `gluon_indexer`'s with FP8 queries:
`indexer_kernel`), the top-k by `triton_topk` on a GPU (torch's `select_top` on the CPU),
and the sparse MLA by `mla_decode` over each token's selected positions, one row per token
(prompt chunks too).
"""

from __future__ import annotations

import os

import torch
import triton

from dserve.attention.backend import MAX_DECODE_LIKE, AttentionBackend, ForwardBatch, PassShape
from dserve.attention.index_cache import key_scales, select_top, stored_parts
from dserve.attention.triton_store import store_tokens

# the DSA top-k's row histograms kept for passes of up to this many tokens (1 KB a token; its
# last kernel zeroes them again for the next call: no memset per layer); longer passes take
# fresh ones. The top-k is `triton_topk.select_top_triton` at every shape: on an H100 it took
# 19-62 us at 1-128 rows of 32k, 26-185 at 128k, where torch's took 51-106 and 62-304 and the
# selects before it (by rows and width: many programs over byte digits, or one program a row,
# or torch's) 23 / 47 / 66 and 29 / 105 / 246 at 1 / 32 / 128 rows
# (bench/notes/session32-h100-2026-11-27.md).
TOP_HIST_ROWS = 1024
# Extend launches: `rows` (token, head) rows per program, keys per block, warps, pipelining depth
# (None: Triton's default); MLA programs take `block_h` heads of a token. MLA: 64 heads of one token,
# 64 keys a block, 3 stages ran 1.4x faster than 16 heads of 4 tokens with 32 keys on an H100
# (`python -m bench.extend_attention --tune ...`, bench/notes/flashinfer-2026-11-23.md). MHA/GQA
# programs take `block_g` query heads of a KV head (None: all of them): 128 tokens of one head,
# 64 keys a block ran 4.3x faster than 4 tokens of 16 heads (96/8 heads of 128, 4k prompt: 1.96
# against 8.29 ms, bench/notes/session22-h100-2026-11-24.md). Expanded MLA (`triton_expanded`,
# one head of `rows` tokens a program, 128 + 64-wide keys): the MHA launch, to be swept.
EXTEND_TUNE = {
    "mla": {"rows": 64, "block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 3},
    "mha": {"rows": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, "block_g": 1},
    "expanded": {"rows": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
}


class TritonBackend(AttentionBackend):
    def __init__(self, pool, index_pool=None):
        if pool.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1, which "
                "runs its kernels in Triton's interpreter, for tests); use the torch backend on the CPU"
            )
        super().__init__(pool, index_pool)
        self.extend_tune = {
            kind: dict(tune) for kind, tune in EXTEND_TUNE.items()
        }  # benches may change it
        self.top_hist = None
        # Hopper's warp-specialized MLA decode (attention/gluon_mla.py) where it serves the
        # shapes; benches and kernel checks turn it off to time or check the Triton kernel
        self.gluon_mla = True
        # and its indexer scores over FP8 keys with FP8 queries (attention/gluon_indexer.py)
        self.gluon_indexer = True
        if index_pool is not None and pool.device.type == "cuda":
            from dserve.attention.triton_topk import top_hist

            self.top_hist = top_hist(TOP_HIST_ROWS, pool.device)

    def expanded_launch(self) -> dict:
        """Expanded MLA through the Triton kernel, here under the interpreter too."""
        return self.extend_tune["expanded"]

    def sibling(self) -> TritonBackend:
        made = TritonBackend(self.pool)
        made.extend_tune = self.extend_tune
        return made

    def runs_static(self, shape: PassShape) -> bool:
        """Spans of a few causal tokens: the decode kernels read everything they need from the
        batch's device tensors (one query row per token, with its span's page-table row and
        context)."""
        return shape.max_q_len <= MAX_DECODE_LIKE and not shape.tree

    def plan(self, batch: ForwardBatch) -> None:
        self.batch = batch
        self.decode = bool(batch.q_lens) and self.runs_static(PassShape.of(batch))
        # the longest context sizes the decode kernel's splits; extend plans are made per block size
        self.max_len = max(batch.seq_lens, default=0)
        self.extend_plans = {}

    def extend_plan(self, block_m: int):
        from dserve.attention.triton_extend import plan_extend

        if block_m not in self.extend_plans:
            b = self.batch
            self.extend_plans[block_m] = plan_extend(
                b.q_lens, b.seq_lens, b.tree_masks, block_m, b.page_table.device
            )
        return self.extend_plans[block_m]

    def forward_mha(self, layer, q, k, v, scale):
        b = self.batch
        keys, values = self.pool.buffers[layer]
        store_tokens(b.out_slots, [(keys, k), (values, v)])
        if self.decode:
            from dserve.attention.triton_mha import mha_decode

            return mha_decode(
                q.contiguous(),
                keys,
                values,
                b.page_table,
                b.token_ctx_lens,
                scale,
                row_seqs=b.token_seqs,
                max_len=self.max_len,
            )
        from dserve.attention.triton_extend import mha_extend

        tune = self.extend_tune["mha"]
        group = tune["block_g"] or triton.next_power_of_2(q.shape[1] // k.shape[1])
        plan = self.extend_plan(max(1, tune["rows"] // group))
        return mha_extend(
            q.contiguous(),
            keys,
            values,
            b.page_table,
            plan,
            scale,
            block_n=tune["block_n"],
            num_warps=tune["num_warps"],
            num_stages=tune["num_stages"],
            block_g=tune["block_g"],
        )

    def forward_indexer(self, layer, q, k, weights, scale, topk):
        b = self.batch
        buffers = self.index_pool.buffers[layer]  # the keys (FP8: and their scales)
        scaled = self.index_pool.layout.scaled
        store_tokens(b.out_slots, list(zip(buffers, stored_parts(k, scaled))))
        scales = key_scales(buffers[1]) if scaled else None
        q = q.contiguous()
        scores_kernel = indexer_kernel(q, buffers[0], scales, self.gluon_indexer)
        scores = scores_kernel(
            q,
            weights.contiguous(),
            buffers[0],
            b.page_table,
            b.token_seqs,
            b.token_ctx_lens,
            scale,
            self.max_len,
            key_scales=scales,
        )
        if b.tree_masks is not None:  # draft trees see their ancestors only
            scores = scores.masked_fill(~self._visible(), float("-inf"))
        if not scores.is_cuda:
            return select_top(scores, topk)
        from dserve.attention import triton_topk

        if not torch.cuda.is_current_stream_capturing():  # the warm-up's first pass
            triton_topk.compile_every_chunk(topk, str(scores.device))
        kept = scores.shape[0] <= TOP_HIST_ROWS
        hist = self.top_hist if kept else None
        return triton_topk.select_top_triton(scores, topk, b.token_ctx_lens, hist)

    def _visible(self) -> torch.Tensor:
        """[T, max_len]: which context positions each token sees (causal, or its tree)."""
        b, pad = self.batch, torch.nn.functional.pad
        masks = [b.span_mask(i) for i in range(len(b.q_lens))]
        return torch.cat([pad(m, (0, self.max_len - m.shape[1])) for m in masks])

    def _decode_kernel(self, q_latent, cache, selection):
        return mla_decode_kernel(q_latent, cache, selection is not None, self.gluon_mla)

    def forward_mla(self, layer, q_latent, q_rope, latent, scale, selection=None):
        b = self.batch
        cache = self.pool.buffers[layer][0]
        store_tokens(b.out_slots, [(cache, latent)])
        lens, width = b.token_ctx_lens, self.max_len
        if selection is not None:  # sparse: every token a row over its selected positions
            lens, width = None, selection.shape[1]
            selection = selection.contiguous()
        if selection is not None or self.decode:
            return self._decode_kernel(q_latent, cache, selection)(
                _unit_stride(q_latent),
                _unit_stride(q_rope),
                cache,
                b.page_table,
                lens,
                scale,
                max_len=width,
                row_seqs=b.token_seqs,
                selected=selection,
            )
        from dserve.attention.triton_extend import mla_extend

        tune = self.extend_tune["mla"]
        block_h = min(tune["block_h"], triton.next_power_of_2(q_latent.shape[1]))
        plan = self.extend_plan(max(1, tune["rows"] // block_h))
        return mla_extend(
            q_latent.contiguous(),
            q_rope.contiguous(),
            cache,
            b.page_table,
            plan,
            scale,
            block_h=block_h,
            block_n=tune["block_n"],
            num_warps=tune["num_warps"],
            num_stages=tune["num_stages"],
        )


def rounds_queries(q, keys, scales, gluon: bool = True) -> bool:
    """Whether the indexer's scores round these queries to e4m3: on Hopper
    with FP8 keys, where the Gluon kernel serves them (the production
    indexer's arithmetic: e4m3 on both sides, within tolerance of the
    16-bit queries')."""
    from dserve.attention import gluon_indexer

    return gluon and gluon_indexer.supported(q, keys, scales)


def indexer_kernel(q, keys, scales, gluon: bool = True):
    """The indexer's scores function for these queries and keys: the Gluon
    kernel with FP8 queries where it `rounds_queries`, else the Triton
    kernel."""
    from functools import partial

    from dserve.attention import gluon_indexer, triton_dsa

    if rounds_queries(q, keys, scales, gluon):
        return partial(gluon_indexer.indexer_scores, q_fp8=True)
    return triton_dsa.indexer_scores


def mla_decode_kernel(q_latent, cache, sparse: bool, gluon: bool = True):
    """The MLA decode to run, dense or over `sparse` attention's selected positions:
    Gluon's on Hopper where it serves the shapes (any heads: DP attention's 128, GLM-5's
    64, 16 at TP 8), else Triton's. Both take `triton_mla.mla_decode`'s arguments."""
    from dserve.attention import gluon_mla, triton_mla

    if gluon and gluon_mla.supported(q_latent, cache):
        return gluon_mla.mla_decode
    return triton_mla.mla_decode


def _unit_stride(x):
    """`x` as the decode kernels take it: any row strides, consecutive columns."""
    return x if x.stride(-1) == 1 else x.contiguous()
