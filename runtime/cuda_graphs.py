"""CUDA graphs for decode-like steps: one captured forward per padded token count.

A step qualifies when it has no DP attention (other groups' token counts change the collectives),
at most the largest bucket's tokens, and every attention backend it uses can run it from device
tensors alone (`AttentionBackend.runs_static`: spans of a few causal tokens on the decode kernels;
with naive speculation the draft's backend too). Decode steps, chain verifies and the naive fused
step qualify, and so do the two-pass draft's passes over a few tokens per request (its catch-up
after a verify, a chain's further steps); prompts and trees run eagerly.

Target steps and draft passes have their own `StaticSteps`. A draft pass reads rows of the previous
pass's hidden states (`ForwardBatch.hidden_rows`), whose tensor is another each step: they are
gathered into the draft's static input on the device before the replay, one set of graphs per width
of those states (an EAGLE-3 draft's catch-up reads the target's three aux states, its further passes
its own state).

The step's tokens are padded up to the next bucket. A pad token reads the first context slot of the
batch's first sequence, writes its KV into a scratch page the KV manager never hands out (each
pool's last page), and is routed to no expert (`ForwardBatch.real_tokens`). Per step the host packs
the per-token ints (ids, positions, slots, span, context length, the fused draft's inputs, which are
real), the wanted logits rows and the page table into one pinned buffer; one non-blocking copy fills
the graph's static buffer and the graph replays, with no host sync. The graph computes logits at
every padded row (the target's, then the draft's); the wanted rows are picked from them on the
device.

Graphs are captured at start, largest first, into one memory pool. On a CPU (tests under the
Triton interpreter) nothing is captured: the same static buffers, padding and row selection run
eagerly, so the CPU suite checks all but the capture.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from dserve.attention.backend import ForwardBatch, FusedDraft

log = logging.getLogger("dserve.runtime")
FIELDS = (
    "input_ids",
    "positions",
    "out_slots",
    "token_seqs",
    "token_ctx_lens",
    "next_ids",
    "from_target",
    "real_tokens",
    "hidden_rows",
)
ROW = {name: i for i, name in enumerate(FIELDS)}


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts: 1, 2, 4, 8, then steps of 8 to 64, of 16 to 128, of 32 to 256, of 64
    beyond; the last is `max_tokens`."""
    sizes, n = [], 1
    while n < max_tokens:
        sizes.append(n)
        n = n * 2 if n < 8 else n + (8 if n < 64 else 16 if n < 128 else 32 if n < 256 else 64)
    return sizes + [max_tokens]


class StaticSteps:
    """The static buffers of decode-like steps and, on a GPU, their captured graphs.

    One int64 buffer holds, in order, the logits rows to select, the per-token fields and the page
    table ([tokens, max_pages] rows); a step copies it from its pinned twin up to the last table row
    it uses, in one copy. The host side is filled through numpy views (cheaper per call than torch)."""

    def __init__(self, runner, max_tokens: int, max_context: int, hidden_width: int | None = None):
        """Target steps, or with `hidden_width` the draft's passes reading hidden states that wide."""
        self.runner, self.device = runner, runner.device
        self.hidden_width = hidden_width
        page_size = runner.pool.layout.page_size
        self.scratch_slot = (
            runner.num_pages * page_size
        )  # the first slot of the page past the manager's
        self.max_pages = min(-(-max_context // page_size), runner.num_pages)
        self.max_context = self.max_pages * page_size
        self.buckets = token_buckets(max_tokens)
        self.fused = runner.config.speculative_naive and hidden_width is None
        self.backends = (
            [runner.draft_backend]
            if hidden_width is not None
            else [runner.backend] + ([runner.draft_backend] if self.fused else [])
        )
        most, fields = self.buckets[-1], len(FIELDS)
        self.table_start = (2 + fields) * most
        size = self.table_start + most * self.max_pages
        pinned = self.device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self.flat = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.select, self.ints, self.table = self._views(self.flat)
        self.host_select, self.host_ints, self.host_table = (
            t.numpy() for t in self._views(self.host)
        )
        self.rows = torch.arange(most, device=self.device)
        if hidden_width is not None:  # the draft's input states, gathered here before each replay
            self.hidden = torch.zeros(
                most, hidden_width, dtype=runner.config.torch_dtype, device=self.device
            )
        pad = dict(out_slots=self.scratch_slot, token_ctx_lens=1, from_target=-1)  # the rest 0
        self.pad = np.array([pad.get(name, 0) for name in FIELDS], dtype=np.int64)[:, None]
        self.copied = torch.cuda.Event() if pinned else None  # the host buffer is free again
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}

    def _views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        most = self.buckets[-1]
        return (
            flat[: 2 * most],
            flat[2 * most : self.table_start].view(len(FIELDS), most),
            flat[self.table_start :].view(most, self.max_pages),
        )

    @property
    def usable(self) -> bool:
        """Whether the model's backends (the draft's too, for the fused step) run a one-token step statically."""
        batch = self.static_batch(1)
        return all(b.runs_static(batch) for b in self.backends)

    def static_batch(self, n: int) -> ForwardBatch:
        """The batch a graph of `n` tokens is captured for: its tensors are the static buffers."""
        f = dict(zip(FIELDS, self.ints[:, :n]))
        fused = FusedDraft(f["next_ids"], f["from_target"], self.rows[:n]) if self.fused else None
        return ForwardBatch(
            input_ids=f["input_ids"],
            positions=f["positions"],
            q_lens=[1] * n,
            seq_lens=[self.max_context] * n,
            page_table=self.table[:n],
            out_slots=f["out_slots"],
            logits_indices=self.rows[:n],
            fused_draft=fused,
            token_seqs=f["token_seqs"],
            token_ctx_lens=f["token_ctx_lens"],
            real_tokens=f["real_tokens"],
        )

    def fits(self, batch: ForwardBatch) -> bool:
        draft_pass = batch.hidden_rows is not None
        if draft_pass != (self.hidden_width is not None):
            return False
        states = self.runner.last_hidden  # what a draft pass reads: as wide as this set's input?
        if draft_pass and (states is None or states.shape[-1] != self.hidden_width):
            return False
        return (
            batch.dp_num_tokens is None
            and 0 < batch.num_tokens <= self.buckets[-1]
            and batch.input_ids.device.type == "cpu"
            and (batch.fused_draft is not None) == self.fused
            and batch.page_table.shape[1] <= self.max_pages
            and max(batch.seq_lens) <= self.max_context
            and self.backends[0].runs_static(batch)
        )

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        n = batch.num_tokens
        if self.hidden_width is None:
            return self.runner.run_model(batch)
        return self.runner.run_draft(batch, self.hidden[:n])

    def capture(self) -> None:
        """One graph per bucket, largest first, sharing one memory pool."""
        started = time.monotonic()
        self.host_ints[:] = self.pad
        self.flat.copy_(self.host)
        pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.buckets):
            batch = self.static_batch(n)
            for _ in range(2):  # compile the kernels, settle the allocator
                self._forward(batch)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = self._forward(batch)
            self.graphs[n] = (graph, outputs)
        torch.cuda.synchronize(self.device)
        what = (
            "steps"
            if self.hidden_width is None
            else f"draft passes over states of width {self.hidden_width}"
        )
        log.info(
            "captured %d CUDA graphs of %s (up to %d tokens, contexts up to %d) in %.1f s",
            len(self.graphs),
            what,
            self.buckets[-1],
            self.max_context,
            time.monotonic() - started,
        )

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits at the batch's rows, hidden states at every padded row) of one step."""
        n = next(b for b in self.buckets if b >= batch.num_tokens)
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copy has left the pinned buffer
        wanted = self._pack(batch, n)
        end = self.table_start + batch.page_table.shape[0] * self.max_pages
        self.flat[:end].copy_(self.host[:end], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if self.hidden_width is not None:
            torch.index_select(
                self.runner.last_hidden, 0, self.ints[ROW["hidden_rows"], :n], out=self.hidden[:n]
            )
        if n in self.graphs:
            graph, (logits, hidden) = self.graphs[n]
            graph.replay()
        else:  # the CPU: the same buffers, run eagerly
            logits, hidden = self._forward(self.static_batch(n))
        return torch.index_select(logits, 0, self.select[:wanted]), hidden

    def _pack(self, batch: ForwardBatch, n: int) -> int:
        """Fill the pinned buffer from `batch` (host tensors), padded to `n` tokens; how many logits
        rows the step wants."""
        t, h = batch.num_tokens, self.host_ints
        h[:, t:n] = self.pad
        for name in ("input_ids", "positions", "out_slots", "token_seqs", "token_ctx_lens"):
            h[ROW[name], :t] = getattr(batch, name).numpy()
        if batch.hidden_rows is not None:
            h[ROW["hidden_rows"], :t] = batch.hidden_rows.numpy()
        h[ROW["real_tokens"], :t] = 1
        select = batch.logits_indices.numpy()
        if (
            batch.fused_draft is not None
        ):  # the graph's draft reads the target's argmax at token rows
            fused = batch.fused_draft
            h[ROW["next_ids"], :t] = fused.next_ids.numpy()
            from_target = fused.from_target.numpy()
            rows = select[np.maximum(from_target, 0)] if len(select) else 0
            h[ROW["from_target"], :t] = np.where(from_target >= 0, rows, -1)
            select = np.concatenate([select, n + fused.logits_indices.numpy()])
        self.host_select[: len(select)] = select
        seqs, width = batch.page_table.shape
        self.host_table[:seqs, :width] = batch.page_table.numpy()
        return len(select)
