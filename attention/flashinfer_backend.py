"""Attention backend on FlashInfer's kernels (`--attention-backend flashinfer`), optional at install time.

MLA (absorbed) runs `flashinfer.mla.BatchMLAPagedAttentionWrapper` over the paged latent cache: the
pool's [pages, page_size, rank + rope] buffer is handed over as its two column views (the kernels take
page and token strides, so the page-major pool needs no copy). MHA/GQA runs
`BatchPrefillWithPagedKVCacheWrapper` over the K and V buffers (layout NHD), every span causal (one
decode token, a few draft tokens or a prompt chunk alike). A batch that holds a draft tree's mask runs
on the Triton kernels instead (FlashInfer's MLA kernel takes no mask). New tokens are stored into pages
by the Triton store kernel; the pages FlashInfer reads are listed on the device
(`triton_pages.gather_pages`, with no host sync).

FlashInfer's kernels take bf16/fp16 only, and a plan (split work) made on the host per batch. An
eager pass plans at its first layer, which is when the softmax scale is known. Decode-like passes
run under CUDA graphs (`runs_static`): one wrapper per captured token count, planned on the host
before each replay (`flashinfer_graphs.py`).

Install: FlashInfer compiles its kernels on first use with the host's nvcc (see the README's
"GPU hosts" for the version that works with torch 2.11 / CUDA 13).
"""

from __future__ import annotations

import numpy as np
import torch

from dserve.attention.backend import MAX_DECODE_LIKE, AttentionBackend, ForwardBatch, PassShape
from dserve.attention.flashinfer_graphs import GraphPlan, csr_lists
from dserve.attention.triton_pages import gather_pages
from dserve.attention.triton_store import store_tokens

WORKSPACE_BYTES = 128 << 20
INSTALL_HINT = (
    "attention_backend='flashinfer' needs the flashinfer-python package (0.7.2.post1 is the version known "
    "to work with torch 2.11 / CUDA 13: pip install flashinfer-python==0.7.2.post1; its kernels compile "
    "on first use with nvcc); or use --attention-backend triton"
)


def import_flashinfer():
    try:
        import flashinfer
    except ImportError as e:
        raise ValueError(f"{INSTALL_HINT} ({e})") from e
    return flashinfer


def check_shapes(layout) -> None:
    """FlashInfer's MLA kernels (SM90: fa2/fa3) take a latent of a multiple of 128 and a rotary part of
    a multiple of 64 (DeepSeek-V3: 512 and 64); a clear error at start for other models."""
    if layout.kind != "mla":
        return
    rank, rope = layout.kv_lora_rank, layout.latent_dim - layout.kv_lora_rank
    if rank % 128 or rope % 64:
        raise ValueError(
            f"FlashInfer's MLA kernels need kv_lora_rank a multiple of 128 and qk_rope_head_dim a "
            f"multiple of 64 (DeepSeek-V3: 512 and 64); this model has {rank} and {rope}: use "
            "--attention-backend triton"
        )


class FlashInferBackend(AttentionBackend):
    def __init__(self, pool):
        if pool.device.type != "cuda":
            raise ValueError(
                "attention_backend='flashinfer' needs a CUDA device; use the torch backend on the CPU"
            )
        if pool.layout.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"FlashInfer's kernels take bfloat16 or float16 KV, not {pool.layout.dtype}; "
                "use --dtype bfloat16 (or the triton backend for float32)"
            )
        check_shapes(pool.layout)
        self.flashinfer = import_flashinfer()
        super().__init__(pool)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        self.wrapper = None
        self.triton = None  # draft trees: the Triton extend kernels
        self.graphs: dict[int, GraphPlan] = {}  # static passes, by token count
        self.graph: GraphPlan | None = None  # this pass's, where it is static

    def runs_static(self, shape: PassShape) -> bool:
        """Spans of a few causal tokens: each token is one query over its own context, planned
        on the host before the replay (`prepare_static`)."""
        return shape.max_q_len <= MAX_DECODE_LIKE and not shape.tree

    def prepare_static(self, tokens: int, ctx_lens: np.ndarray) -> None:
        graph = self.graphs.get(tokens)
        if graph is None:
            graph = GraphPlan(tokens, self.pool.layout.page_size, self.pool.device)
            self.graphs[tokens] = graph
        graph.prepare(ctx_lens)

    def plan(self, batch: ForwardBatch) -> None:
        self.batch = batch
        self.planned_scale = None
        self.graph = None
        self.tree = batch.tree_masks is not None and any(m is not None for m in batch.tree_masks)
        if self.tree:
            if self.triton is None:
                from dserve.attention.triton_backend import TritonBackend

                self.triton = TritonBackend(self.pool)
            self.triton.plan(batch)
            return
        if batch.is_static:  # a CUDA graph's pass: its pages gathered on the device
            self.graph = self.graphs[batch.num_tokens]
            self.graph.gather(batch.page_table, batch.token_seqs)
            return
        self.metadata = page_lists(batch, self.pool.layout.page_size)

    # ---- MLA ----------------------------------------------------------------------------------------
    def forward_mla(self, layer, q_latent, q_rope, latent, scale):
        if self.tree:
            return self.triton.forward_mla(layer, q_latent, q_rope, latent, scale)
        cache = self.pool.buffers[layer][0]
        store_tokens(self.batch.out_slots, [(cache, latent)])
        rank = q_latent.shape[-1]
        if not q_latent.shape[0]:  # an empty step (a DP group without tokens): nothing to plan
            return q_latent.new_empty(q_latent.shape)
        shapes = (q_latent.shape[1], rank, cache.shape[-1] - rank, scale, q_latent.dtype)
        wrapper = self._mla_wrapper(*shapes)
        return wrapper.run(
            query=(q_latent.contiguous(), q_rope.contiguous()),
            kv_cache=(cache[..., :rank], cache[..., rank:]),
        )

    def _mla_wrapper(self, heads: int, rank: int, rope: int, scale: float, dtype):
        from flashinfer.mla import BatchMLAPagedAttentionWrapper as Wrapper

        def make(graph: GraphPlan | None):
            if graph is None:
                return Wrapper(self.workspace)
            return Wrapper(
                self.workspace,
                use_cuda_graph=True,
                qo_indptr=graph.qo_indptr,
                kv_indptr=graph.kv_indptr,
                kv_indices=graph.kv_indices,
                kv_len_arr=graph.kv_lens,
            )

        planner = lambda: self._mla_planner(heads, rank, rope, scale, dtype)  # noqa: E731
        return self._wrapper(make, planner, scale)

    def _wrapper(self, make, planner, scale: float):
        """The pass's wrapper, planned at its first layer: a static pass's graph wrapper (made
        and planned once, planned again before each replay), or the eager one. `make(graph)`
        makes a wrapper (graph None: the eager one); `planner()` gives its plan function."""
        graph = self.graph
        if graph is not None:
            if graph.wrapper is None:
                graph.first_plan(make(graph), planner())
            return graph.wrapper
        if self.planned_scale != scale:
            if self.wrapper is None:
                self.wrapper = make(None)
            m = self.metadata
            planner()(self.wrapper, m, m["kv_indices"])
            self.planned_scale = scale
        return self.wrapper

    def _mla_planner(self, heads: int, rank: int, rope: int, scale: float, dtype):
        """Plans an MLA wrapper on host CSR lists (`csr_lists`) and device page indices."""
        from flashinfer.mla import MLAPlanMetadata

        def make_plan(wrapper, lists: dict, kv_indices: torch.Tensor) -> None:
            wrapper.plan(
                metadata=MLAPlanMetadata.csr(
                    lists["qo_indptr"], lists["kv_indptr"], kv_indices, lists["kv_lens"]
                ),
                num_heads=heads,
                head_dim_ckv=rank,
                head_dim_kpe=rope,
                page_size=self.pool.layout.page_size,
                causal=True,
                sm_scale=scale,
                q_data_type=dtype,
                kv_data_type=self.pool.layout.dtype,
                query_layout="split",
                kv_cache_layout="split",
            )

        return make_plan

    # ---- MHA ----------------------------------------------------------------------------------------
    def forward_mha(self, layer, q, k, v, scale):
        if self.tree:
            return self.triton.forward_mha(layer, q, k, v, scale)
        keys, values = self.pool.buffers[layer]
        store_tokens(self.batch.out_slots, [(keys, k), (values, v)])
        if not q.shape[0]:
            return q.new_empty(0, q.shape[1], values.shape[-1])
        shapes = (q.shape[1], keys.shape[2], q.shape[2], values.shape[3], scale, q.dtype)
        return self._mha_wrapper(*shapes).run(q.contiguous(), (keys, values))

    def _mha_wrapper(self, heads, kv_heads, head_dim, v_dim, scale, dtype):
        Wrapper = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper

        def make(graph: GraphPlan | None):
            if graph is None:
                return Wrapper(self.workspace, "NHD")
            return Wrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=graph.qo_indptr,
                paged_kv_indptr_buf=graph.kv_indptr,
                paged_kv_indices_buf=graph.kv_indices,
                paged_kv_last_page_len_buf=graph.last_page_lens,
            )

        shapes = (heads, kv_heads, head_dim, v_dim, scale, dtype)
        return self._wrapper(make, lambda: self._mha_planner(*shapes), scale)

    def _mha_planner(self, heads, kv_heads, head_dim, v_dim, scale, dtype):
        """Plans an MHA wrapper on host CSR lists (`csr_lists`) and device page indices."""

        def make_plan(wrapper, lists: dict, kv_indices: torch.Tensor) -> None:
            wrapper.plan(
                lists["qo_indptr"],
                lists["kv_indptr"],
                kv_indices,
                lists["last_page_lens"],
                heads,
                kv_heads,
                head_dim,
                self.pool.layout.page_size,
                head_dim_vo=v_dim,
                causal=True,
                sm_scale=scale,
                q_data_type=dtype,
                kv_data_type=self.pool.layout.dtype,
            )

        return make_plan


def page_lists(batch: ForwardBatch, page_size: int) -> dict:
    """The batch in FlashInfer's CSR form (int32): query offsets, page offsets, context lengths
    and tokens in each last page on the host (FlashInfer plans there: no device sync), and the
    sequences' pages one after another on the batch's device (`kv_indices`)."""
    lists = csr_lists(batch.q_lens, batch.seq_lens, page_size)
    device = batch.page_table.device
    kv_indptr = lists["kv_indptr"].to(device, non_blocking=True)
    total = int(lists["kv_indptr"][-1])
    lists["kv_indices"] = gather_pages(batch.page_table, kv_indptr, total)
    return lists
