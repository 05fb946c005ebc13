"""Attention backend on FlashInfer's kernels (`--attention-backend flashinfer`), optional at install time.

MLA (absorbed) runs `flashinfer.mla.BatchMLAPagedAttentionWrapper` over the paged latent cache: the
pool's [pages, page_size, rank + rope] buffer is handed over as its two column views (the kernels take
page and token strides, so the page-major pool needs no copy). MHA/GQA runs
`BatchPrefillWithPagedKVCacheWrapper` over the K and V buffers (layout NHD), every span causal (one
decode token, a few draft tokens or a prompt chunk alike). A batch that holds a draft tree's mask runs
on the Triton kernels instead (FlashInfer's MLA kernel takes no mask). New tokens are stored into pages
by the Triton store kernel; the pages FlashInfer reads are listed on the device
(`triton_pages.gather_pages`, with no host sync).

FlashInfer's kernels take bf16/fp16 only, and a plan (page lists, split work) made on the host per
batch: these steps run eagerly, not under CUDA graphs (`runs_static` is False). The plan is made at
the first layer of a pass, which is when the softmax scale is known.

Install: FlashInfer compiles its kernels on first use with the host's nvcc (see the README's
"GPU hosts" for the version that works with torch 2.11 / CUDA 13).
"""

from __future__ import annotations

import torch

from dserve.attention.backend import AttentionBackend, ForwardBatch
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

    def plan(self, batch: ForwardBatch) -> None:
        self.batch = batch
        self.planned_scale = None
        self.tree = batch.tree_masks is not None and any(m is not None for m in batch.tree_masks)
        if self.tree:
            if self.triton is None:
                from dserve.attention.triton_backend import TritonBackend

                self.triton = TritonBackend(self.pool)
            self.triton.plan(batch)
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
        if self.planned_scale != scale:
            self._plan_mla(q_latent.shape[1], rank, cache.shape[-1] - rank, scale, q_latent.dtype)
        return self.wrapper.run(
            query=(q_latent.contiguous(), q_rope.contiguous()),
            kv_cache=(cache[..., :rank], cache[..., rank:]),
        )

    def _plan_mla(self, heads: int, rank: int, rope: int, scale: float, dtype: torch.dtype) -> None:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

        if not isinstance(self.wrapper, BatchMLAPagedAttentionWrapper):
            self.wrapper = BatchMLAPagedAttentionWrapper(self.workspace)
        m = self.metadata
        self.wrapper.plan(
            metadata=MLAPlanMetadata.csr(
                m["qo_indptr"], m["kv_indptr"], m["kv_indices"], m["kv_lens"]
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
        self.planned_scale = scale

    # ---- MHA ----------------------------------------------------------------------------------------
    def forward_mha(self, layer, q, k, v, scale):
        if self.tree:
            return self.triton.forward_mha(layer, q, k, v, scale)
        keys, values = self.pool.buffers[layer]
        store_tokens(self.batch.out_slots, [(keys, k), (values, v)])
        if not q.shape[0]:
            return q.new_empty(0, q.shape[1], values.shape[-1])
        if self.planned_scale != scale:
            self._plan_mha(q.shape[1], keys.shape[2], q.shape[2], values.shape[3], scale, q.dtype)
        return self.wrapper.run(q.contiguous(), (keys, values))

    def _plan_mha(
        self, heads: int, kv_heads: int, head_dim: int, v_dim: int, scale: float, dtype
    ) -> None:
        fi = self.flashinfer
        if not isinstance(self.wrapper, fi.BatchPrefillWithPagedKVCacheWrapper):
            self.wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        m = self.metadata
        self.wrapper.plan(
            m["qo_indptr"],
            m["kv_indptr"],
            m["kv_indices"],
            m["last_page_lens"],
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
        self.planned_scale = scale


def page_lists(batch: ForwardBatch, page_size: int) -> dict:
    """The batch in FlashInfer's CSR form (int32, on the batch's device): query offsets, page offsets,
    the sequences' pages one after another, context lengths and tokens in each last page."""
    device = batch.page_table.device
    q_lens = torch.tensor(batch.q_lens, dtype=torch.int32)
    kv_lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
    pages = (kv_lens + page_size - 1) // page_size
    zero = torch.zeros(1, dtype=torch.int32)
    kv_indptr = torch.cat([zero, pages.cumsum(0, dtype=torch.int32)])
    host = {
        "qo_indptr": torch.cat([zero, q_lens.cumsum(0, dtype=torch.int32)]),
        "kv_indptr": kv_indptr,
        "kv_lens": kv_lens,
        "last_page_lens": kv_lens - (pages - 1) * page_size,
    }
    lists = {k: v.to(device, non_blocking=True) for k, v in host.items()}
    # the pages themselves, gathered on the device: no count read back to the host
    total = int(kv_indptr[-1])
    lists["kv_indices"] = gather_pages(batch.page_table, lists["kv_indptr"], total)
    return lists
