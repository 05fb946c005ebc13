"""FlashInfer's kernels inside CUDA graphs: one planned wrapper per captured token count.

A static pass (`runtime/cuda_graphs.py`) pads its tokens to a bucket and replays the graph of
that many tokens. FlashInfer plans a batch on the host (its work split, written to a workspace
the kernels read), and a wrapper made with `use_cuda_graph=True` keeps its CSR metadata in
buffers of fixed address, so a graph captured once stays valid when the wrapper is planned again
before each replay (SGLang and vLLM run FlashInfer's decode this way). Here:

- every token of a static pass is a request of one query over the context it sees causally
  (`token_ctx_lens`; a pad token sees one position), so decode tokens and chain verifies alike
  need no span structure: `qo_indptr` is 0, 1, ..., n;
- the host knows the context lengths before the replay (`StaticSteps` packs them), so
  `prepare` builds the CSR offsets on the host and plans the wrapper there, with no device sync;
- the page list itself (`kv_indices`) is gathered inside the graph from the static page table,
  each token reading its span's row (`triton_pages.gather_pages` with `rows`);
- the first plan of a wrapper needs the layer's shapes and softmax scale: it happens at the
  first layer of the eager runs before the capture, never inside it.

A plan's copies to the device are asynchronous: FlashInfer's own (its work split, through a pinned
buffer) and the CSR lists (pinned here, so that no copy waits for the stream). A wrapper's lists
are not written again, nor is it planned again, until those copies have run (an event per plan).
"""

from __future__ import annotations

import numpy as np
import torch

from dserve.attention.triton_pages import gather_pages

INT_WORKSPACE_BYTES = 8 << 20  # what a FlashInfer wrapper allocates for its plans on the device


def graph_bytes(buckets: list[int], max_pages: int) -> int:
    """What the wrappers of graphs of these token counts keep on the device, at most: each its
    plan workspace and page list (`max_pages` a token), counted before the KV pool is sized."""
    return sum(INT_WORKSPACE_BYTES + 4 * n * (max_pages + 8) for n in buckets)


def csr_lists(q_lens: list[int] | np.ndarray, kv_lens: list[int] | np.ndarray, page_size: int):
    """FlashInfer's CSR form of spans of `q_lens` new tokens over `kv_lens` context positions, on
    the host (int32): query offsets, page offsets, context lengths, tokens in each last page."""
    q = torch.as_tensor(np.asarray(q_lens, dtype=np.int32))
    kv = torch.as_tensor(np.asarray(kv_lens, dtype=np.int32))
    pages = (kv + page_size - 1) // page_size
    zero = torch.zeros(1, dtype=torch.int32)
    return {
        "qo_indptr": torch.cat([zero, q.cumsum(0, dtype=torch.int32)]),
        "kv_indptr": torch.cat([zero, pages.cumsum(0, dtype=torch.int32)]),
        "kv_lens": kv,
        "last_page_lens": kv - (pages - 1) * page_size,
    }


class GraphPlan:
    """The FlashInfer state of the graphs of `tokens` tokens: the wrapper, its fixed metadata
    buffers, the host CSR of the next replay and the plan's other arguments (known from the
    first layer)."""

    def __init__(self, tokens: int, page_size: int, device: torch.device):
        self.tokens, self.page_size = tokens, page_size
        i32 = dict(dtype=torch.int32, device=device)
        self.qo_indptr = torch.arange(tokens + 1, **i32)
        self.kv_indptr = torch.zeros(tokens + 1, **i32)
        self.kv_lens = torch.ones(tokens, **i32)
        self.last_page_lens = torch.ones(tokens, **i32)
        self.kv_indices: torch.Tensor | None = None  # sized by the page table at the first pass
        # the next pass's CSR lists on the host, pinned: the plan's copies of them are async
        pinned = dict(dtype=torch.int32, pin_memory=True)
        sizes = {"qo_indptr": tokens + 1, "kv_indptr": tokens + 1}
        sizes.update(kv_lens=tokens, last_page_lens=tokens)
        self.host = {name: torch.zeros(size, **pinned) for name, size in sizes.items()}
        self.wrapper = None
        self.make_plan = None  # (wrapper, host CSR, kv_indices) -> None, set by the first layer
        self.planned = torch.cuda.Event()

    def prepare(self, ctx_lens: np.ndarray) -> None:
        """Before a pass: the host's context length of each of the `tokens` tokens; plans the
        wrapper now where its first layer did already (a replay)."""
        self.planned.synchronize()  # the last plan's copies have read the pinned lists
        lists = csr_lists(np.ones(self.tokens, dtype=np.int32), ctx_lens, self.page_size)
        for name, values in lists.items():
            self.host[name].copy_(values)
        if self.make_plan is not None:
            self.plan()
        else:  # the gather before the first plan reads the offsets too
            self.kv_indptr.copy_(self.host["kv_indptr"])

    def gather(self, page_table: torch.Tensor, token_seqs: torch.Tensor) -> None:
        """The pass's page list into the fixed buffer, on the device (captured with the layers):
        token t's pages from row `token_seqs[t]` of the static page table."""
        if self.kv_indices is None:
            capacity = self.tokens * page_table.shape[1]
            self.kv_indices = torch.zeros(capacity, dtype=torch.int32, device=page_table.device)
        gather_pages(
            page_table, self.kv_indptr, self.kv_indices.numel(), self.kv_indices, token_seqs
        )

    def plan(self) -> None:
        """Plan the wrapper on the prepared host CSR (never while a graph is being captured)."""
        assert not torch.cuda.is_current_stream_capturing(), "FlashInfer plans outside a capture"
        total = int(self.host["kv_indptr"][-1])
        self.make_plan(self.wrapper, self.host, self.kv_indices[:total])
        self.planned.record()

    def first_plan(self, wrapper, make_plan) -> None:
        """The first layer of the first pass: the wrapper and how to plan it."""
        self.wrapper, self.make_plan = wrapper, make_plan
        self.plan()
