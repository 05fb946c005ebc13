"""CUDA graphs for decode-like passes: one captured forward per padded token count.

A pass qualifies when every DP group's part of it (its `PassShape`, which every rank derives from
the same plan, so all decide alike) has at most the largest bucket's tokens, a context within the
buffers' and spans that every attention backend of the pass runs from device tensors alone
(`AttentionBackend.runs_static`: a few causal tokens per span on the decode kernels; with naive
speculation the draft's backend too). Decode steps, chain verifies and the naive fused step
qualify, and so do the two-pass draft's chain passes (its catch-up after a verify, a chain's
further steps); prompts and trees run eagerly. Under TP, DP attention and EP the collectives are
captured with the rest. With DP attention every group pads its pass to the same bucket, so the
gathers before the MoE have one shape on every rank; a group with nothing to do runs the bucket
with padding only.

Target passes and draft passes have their own `StaticSteps`. A draft pass reads rows of the
previous pass's hidden states (`ForwardBatch.hidden_rows`), whose tensor is another each pass:
they are gathered into the draft's static input on the device before the replay, one set of
graphs per width of those states (an EAGLE-3 draft's catch-up reads the target's three aux
states, its further passes its own state).

A sparse-attention (DSA) model's indexer scores and top-k span the widest context of the
pass, so its graphs come in context widths too (x4 apart from 4096): a pass takes the smallest
width that holds its longest context.

The pass's tokens are padded up to the next bucket. A pad token reads the first context slot of
the batch's first sequence, writes its KV into a scratch page the KV manager never hands out (each
pool's last page), and is routed to no expert (`ForwardBatch.real_tokens`). Per pass the host
packs the per-token ints (ids, positions, slots, span, context length, the fused draft's inputs),
the wanted logits rows and the page table into one pinned buffer; one non-blocking copy fills the
graph's static buffer and the graph replays, with no host sync. A backend that plans on the host
(FlashInfer) plans from the packed context lengths before the replay (`prepare_static`). A token
id the host does not have yet (a request's newest token, sampled by the step before:
`batch.pending_token`) is read from the device inside the graph.

A graph computes the layers into output buffers that every bucket of its set shares; the LM head
then runs on the wanted rows only. The naive fused step, whose draft reads the target's argmax,
computes the target's logits inside the graph, into one shared buffer too. Those buffers are what
graphs keep beside the KV pool, and `output_bytes` counts them before the pool is sized. Graphs
are captured at start, largest first, into one memory pool: a capture's temporaries die with it and
the next capture reuses their memory.

A pipeline stage captures its own layers the same way: a stage after the first receives what the
previous stage sent straight into a static input (`ModelRunner.stage_input`; `run` copies a
tensor received elsewhere) before the replay (pad rows keep earlier rows' states:
their tokens write only the scratch page and reach no expert), and a stage before the last sends
a copy of its static output (the next pass reuses the buffer while the send may still read it).
The sends and receives stay outside the graphs; the last stage's LM head runs as without stages.

On a CPU (tests under the Triton interpreter) nothing is captured: the same static buffers,
padding and row selection run eagerly, so the CPU suite checks all but the capture.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import torch

from dserve.attention.backend import ForwardBatch, FusedDraft, PassShape

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
        n += _bucket_step(n)
    return sizes + [max_tokens]


def _bucket_step(n: int) -> int:
    """How far the bucket after `n` tokens is (`token_buckets`)."""
    if n < 8:
        return n  # doubling
    for below, step in ((64, 8), (128, 16), (256, 32)):
        if n < below:
            return step
    return 64


SPARSE_FIRST_CONTEXT = 4096  # the narrowest graphs of a sparse-attention model


def context_buckets(max_context: int, sparse: bool) -> list[int]:
    """The context widths graphs are captured for: all of it, or for sparse attention (whose
    indexer scores and top-k span the pass's widest context) widths x4 apart from
    SPARSE_FIRST_CONTEXT up to it, so a short context does not pay for the longest."""
    widths = [max_context]
    if sparse:
        width = SPARSE_FIRST_CONTEXT
        while width < max_context:
            widths.insert(-1, width)
            width *= 4
    return widths


def output_widths(runner, hidden_width: int | None) -> dict[str, tuple[int, torch.dtype]]:
    """The shared output buffers of a set of graphs: name -> (row width, dtype)."""
    dtype = runner.config.torch_dtype
    if hidden_width is not None:  # draft passes: the draft's hidden states
        return {"hidden": (runner.draft.cfg.hidden_size, dtype)}
    if not runner.ctx.stage.last:  # what the next stage receives
        return {"hidden": (runner.stage_output_width(), dtype)}
    cfg = runner.model_config
    if runner.config.speculative_naive:  # the target's logits, the draft's hidden states
        return {
            "logits": (cfg.vocab_size, torch.float32),
            "hidden": (runner.draft.cfg.hidden_size, dtype),
        }
    widths = {"hidden": (cfg.hidden_size, dtype)}
    if runner.aux_layers:  # EAGLE-3 reads these layers' outputs
        widths["feed"] = (len(runner.aux_layers) * cfg.hidden_size, dtype)
    return widths


def received_width(runner, hidden_width: int | None) -> int | None:
    """The row width of a set's static input from the previous pipeline stage: the target's
    passes on a stage after the first (None elsewhere)."""
    if hidden_width is not None or runner.ctx.stage.first:
        return None
    return runner.stage_input_width()


def output_bytes(runner, max_tokens: int, hidden_width: int | None) -> int:
    """What a set's shared buffers take (its outputs, and a later stage's input): counted
    before the KV pool is sized."""
    widths = list(output_widths(runner, hidden_width).values())
    received = received_width(runner, hidden_width)
    if received is not None:
        widths.append((received, runner.config.torch_dtype))
    return sum(max_tokens * w * torch.empty((), dtype=d).element_size() for w, d in widths)


def sparse_scores_bytes(max_tokens: int, max_context: int) -> int:
    """A sparse-attention (DSA) model's captured passes also hold the indexer's scores of every
    token over the widest context (float32, in the graphs' memory pool): counted before the KV
    pool is sized (256 tokens over 200k positions: 0.2 GB)."""
    return max_tokens * max_context * 4


class StaticSteps:
    """The static buffers of decode-like passes and, on a GPU, their captured graphs.

    One int64 buffer holds, in order, the logits rows to select, the per-token fields and the page
    table ([tokens, max_pages] rows); a pass copies it from its pinned twin up to the last table
    row it uses, in one copy. The host side is filled through numpy views (cheaper per call than
    torch)."""

    def __init__(self, runner, max_tokens: int, hidden_width: int | None = None):
        """Target passes, or with `hidden_width` the draft's passes reading states that wide."""
        self.runner, self.device = runner, runner.device
        self.hidden_width = hidden_width
        page_size = runner.pool.layout.page_size
        self.scratch_slot = runner.num_pages * page_size  # the page past the manager's
        self.max_pages = runner.max_pages
        self.max_context = self.max_pages * page_size
        self.buckets = token_buckets(max_tokens)
        sparse = runner.index_pool is not None
        self.contexts = context_buckets(self.max_context, sparse)
        naive = runner.config.speculative_naive and runner.draft is not None  # the last stage
        self.fused = naive and hidden_width is None
        if hidden_width is not None:
            self.backends = [runner.draft_backend]
        else:
            self.backends = [runner.backend] + ([runner.draft_backend] if self.fused else [])
        most = self.buckets[-1]
        self.table_start = (2 + len(FIELDS)) * most
        size = self.table_start + most * self.max_pages
        pinned = self.device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self.flat = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.select, self.ints, self.table = self._views(self.flat)
        host_views = self._views(self.host)
        self.host_select, self.host_ints, self.host_table = (t.numpy() for t in host_views)
        self.rows = torch.arange(most, device=self.device)
        self.outputs = {
            name: torch.zeros(most, width, dtype=dtype, device=self.device)
            for name, (width, dtype) in output_widths(runner, hidden_width).items()
        }
        dtype = runner.config.torch_dtype
        if hidden_width is not None:  # the draft's input states, gathered before each replay
            self.hidden = torch.zeros(most, hidden_width, dtype=dtype, device=self.device)
        self.received = None  # a later stage: what the previous one sent
        width = received_width(runner, hidden_width)
        if width is not None:
            self.received = torch.zeros(most, width, dtype=dtype, device=self.device)
        pad = dict(out_slots=self.scratch_slot, token_ctx_lens=1, from_target=-1)  # the rest 0
        self.pad = np.array([pad.get(name, 0) for name in FIELDS], dtype=np.int64)[:, None]
        self.copied = torch.cuda.Event() if pinned else None  # the host buffer is free again
        # (padded tokens, context width) -> its graph
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def _views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        most = self.buckets[-1]
        ints = flat[2 * most : self.table_start].view(len(FIELDS), most)
        return flat[: 2 * most], ints, flat[self.table_start :].view(most, self.max_pages)

    @property
    def usable(self) -> bool:
        """Whether the backends of the pass (the draft's too, fused) run one token statically."""
        return all(b.runs_static(PassShape(1, 1, 1)) for b in self.backends)

    def bucket_for(self, shapes: list[PassShape]) -> tuple[int, int] | None:
        """The (tokens, context) bucket every group pads the pass to, or None where a group's
        part does not fit."""
        most = max(shape.tokens for shape in shapes)
        fits = all(
            shape.tokens <= self.buckets[-1]
            and shape.max_seq_len <= self.max_context
            and all(backend.runs_static(shape) for backend in self.backends)
            for shape in shapes
        )
        if not fits or most == 0:
            return None
        longest = max(shape.max_seq_len for shape in shapes)
        tokens = next(b for b in self.buckets if b >= most)
        context = next(c for c in self.contexts if c >= longest)
        return tokens, context

    def static_batch(self, n: int, context: int) -> ForwardBatch:
        """The batch a graph of `n` tokens over contexts up to `context` is captured for: its
        tensors are the static buffers."""
        f = dict(zip(FIELDS, self.ints[:, :n]))
        fused = None
        if self.fused:
            fused = FusedDraft(f["next_ids"], f["from_target"], self.rows[:n])
        dp_size = self.runner.ctx.dp.size
        return ForwardBatch(
            input_ids=f["input_ids"],
            positions=f["positions"],
            q_lens=[1] * n,
            seq_lens=[context] * n,
            page_table=self.table[:n],
            out_slots=f["out_slots"],
            logits_rows=self.rows[:n],
            fused_draft=fused,
            token_seqs=f["token_seqs"],
            token_ctx_lens=f["token_ctx_lens"],
            real_tokens=f["real_tokens"],
            dp_num_tokens=[n] * dp_size if dp_size > 1 else None,
        )

    def _layers(self, batch: ForwardBatch) -> None:
        """What the graph runs: the layers (the fused step: and the target's head), into the
        shared outputs."""
        n, out = batch.num_tokens, self.outputs
        batch = replace(batch, input_ids=self.runner.read_pending(batch.input_ids))
        if self.hidden_width is not None:
            out["hidden"][:n].copy_(self.runner.draft_layers(batch, self.hidden[:n]))
            return
        received = None if self.received is None else self.received[:n]
        if self.fused:
            logits, draft_hidden, _ = self.runner.fused_layers(batch, received)
            out["logits"][:n].copy_(logits)
            out["hidden"][:n].copy_(draft_hidden)
            return
        hidden, feed = self.runner.target_layers(batch, received)
        out["hidden"][:n].copy_(hidden)
        if "feed" in out:
            out["feed"][:n].copy_(feed)

    def capture(self) -> None:
        """One graph per bucket, largest first, sharing one memory pool."""
        started = time.monotonic()
        self.host_ints[:] = self.pad
        self.flat.copy_(self.host)
        pool = torch.cuda.graph_pool_handle()
        for context in reversed(self.contexts):
            for n in reversed(self.buckets):
                self.graphs[n, context] = self._capture(n, context, pool)
        torch.cuda.synchronize(self.device)
        what = "steps"
        if self.hidden_width is not None:
            what = f"draft passes over states of width {self.hidden_width}"
        seconds = time.monotonic() - started
        log.info(
            "captured %d CUDA graphs of %s (up to %d tokens, contexts up to %s) in %.1f s",
            len(self.graphs),
            what,
            self.buckets[-1],
            ", ".join(map(str, self.contexts)),
            seconds,
        )

    def _capture(self, n: int, context: int, pool) -> torch.cuda.CUDAGraph:
        batch = self.static_batch(n, context)
        self._prepare_backends(n)
        for _ in range(2):  # compile the kernels, settle the allocator
            self._layers(batch)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._layers(batch)
        return graph

    def run(
        self, batch: ForwardBatch, bucket: tuple[int, int], received: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits at the batch's rows, hidden states at every padded row) of one pass padded to
        the `bucket`'s tokens; a draft pass reads `states` rows named by `batch.hidden_rows`. A
        pipeline stage: `received` is what the previous stage sent (its batch's rows); before the
        last stage, (what the next one receives, None)."""
        n, context = bucket
        if self.copied is not None:
            self.copied.synchronize()  # the last pass's copy has left the pinned buffer
        wanted = self._pack(batch, n)
        end = self.table_start + max(batch.page_table.shape[0], 1) * self.max_pages
        self.flat[:end].copy_(self.host[:end], non_blocking=True)
        self._prepare_backends(n)
        if self.copied is not None:
            self.copied.record()
        if self.hidden_width is not None and batch.num_tokens:  # padding only: nothing to read
            rows = self.ints[ROW["hidden_rows"], :n]
            torch.index_select(self.runner.last_hidden, 0, rows, out=self.hidden[:n])
        inbox = self.received
        if inbox is not None and batch.num_tokens and received.data_ptr() != inbox.data_ptr():
            inbox[: batch.num_tokens].copy_(received)  # not received in place
        if bucket in self.graphs:
            self.graphs[bucket].replay()
        else:  # the CPU: the same buffers, run eagerly
            self._layers(self.static_batch(n, context))
        return self._heads(self.select[:wanted], n, batch)

    def _prepare_backends(self, n: int) -> None:
        """What a backend that plans on the host does before a pass (`prepare_static`), from
        the packed context lengths."""
        ctx_lens = self.host_ints[ROW["token_ctx_lens"], :n]
        for backend in self.backends:
            backend.prepare_static(n, ctx_lens)

    def _heads(self, select: torch.Tensor, n: int, batch: ForwardBatch):
        """The LM heads on the wanted rows; the states a following draft pass reads."""
        out, runner = self.outputs, self.runner
        if self.hidden_width is not None:
            logits = runner.draft.compute_logits(out["hidden"][select])
            return logits, out["hidden"][:n]
        if not runner.ctx.stage.last:  # a copy: the next pass writes the buffer as it is sent
            return out["hidden"][: batch.num_tokens].clone(), None
        if not self.fused:
            logits = runner.model.compute_logits(out["hidden"][select])
            return logits, out.get("feed", out["hidden"])[:n]
        k = len(batch.logits_rows)  # the target's rows, then the draft's
        target = out["logits"][select[:k]]
        draft = runner.draft.compute_logits(out["hidden"][select[k:]])
        return torch.cat([target, draft]), None

    def _pack(self, batch: ForwardBatch, n: int) -> int:
        """Fill the pinned buffer from `batch` (host tensors), padded to `n` tokens; how many
        logits rows the pass wants."""
        t, h = batch.num_tokens, self.host_ints
        h[:, t:n] = self.pad
        for name in ("input_ids", "positions", "out_slots", "token_seqs", "token_ctx_lens"):
            h[ROW[name], :t] = getattr(batch, name).numpy()
        if batch.hidden_rows is not None:
            h[ROW["hidden_rows"], :t] = batch.hidden_rows.numpy()
        h[ROW["real_tokens"], :t] = 1
        select = batch.logits_rows.numpy()
        if batch.fused_draft is not None:  # the graph's draft reads the target's argmax at rows
            fused = batch.fused_draft
            h[ROW["next_ids"], :t] = fused.next_ids.numpy()
            from_target = fused.from_target.numpy()
            rows = select[np.maximum(from_target, 0)] if len(select) else 0
            h[ROW["from_target"], :t] = np.where(from_target >= 0, rows, -1)
            select = np.concatenate([select, fused.logits_rows.numpy()])
        self.host_select[: len(select)] = select
        seqs, width = batch.page_table.shape
        self.host_table[:seqs, :width] = batch.page_table.numpy()
        if seqs == 0:  # a group with nothing to do: its pad tokens read page 0
            self.host_table[0, :] = 0
        return len(select)
