"""One rank's model, KV pool and attention backend: runs a `ForwardBatch` and returns logits.

Pool sizing: `max_total_tokens` when given; on a GPU otherwise what `mem_fraction_static` of the
device memory leaves after the weights and the CUDA graphs' shared outputs; on the CPU 16384
tokens. Decode-like passes replay CUDA graphs where the backend allows it (`cuda_graphs.py`), the
draft's passes too; everything else runs eagerly. `last_token` holds, per request slot, the token
its last step sampled, which the next step reads on the device when the host has not seen it yet.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from dserve.attention.backend import ForwardBatch, PassShape, create_backend
from dserve.memory.kv_pool import KVLayout, KVPool
from dserve.models.config import ModelConfig
from dserve.models.layers.moe import Experts
from dserve.models.layers.norm import RMSNorm
from dserve.models.layers.rotary import RotaryEmbedding
from dserve.models.loader import load_embedding, load_model, parameter_bytes
from dserve.models.parallel import SINGLE, ParallelContext
from dserve.models.quant import quantize_in_norms
from dserve.runtime.config import EngineConfig
from dserve.runtime.cuda_graphs import (
    StaticSteps,
    output_bytes,
    sparse_scores_bytes,
    token_buckets,
)

log = logging.getLogger("dserve.runtime")
CPU_DEFAULT_TOKENS = 16384


def kv_layout(
    cfg: ModelConfig,
    page_size: int,
    dtype: torch.dtype,
    attn_tp_size: int = 1,
    num_layers: int | None = None,
) -> KVLayout:
    """The KV layout of `cfg`'s layers; with `num_layers`, of that many (a pipeline stage's, or a
    draft's)."""
    layers = cfg.num_hidden_layers if num_layers is None else num_layers
    if cfg.attention_kind == "mla":  # the latent is replicated over attention-TP ranks
        return KVLayout(
            "mla",
            layers,
            page_size,
            dtype,
            latent_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim,
            kv_lora_rank=cfg.kv_lora_rank,
        )
    heads = max(cfg.num_key_value_heads // attn_tp_size, 1)
    return KVLayout(
        "mha",
        layers,
        page_size,
        dtype,
        num_kv_heads=heads,
        head_dim=cfg.head_dim,
        v_head_dim=cfg.head_dim,
    )


def index_layout(model, config: EngineConfig) -> KVLayout | None:
    """A sparse-attention (DSA) model's indexer pool: one key per token for each of its (this
    stage's) layers with an indexer, stored as `indexer_cache_dtype` says
    (`attention/index_cache.py`); None for other models."""
    layers = getattr(model, "index_layers", 0)  # (model may be None: no draft)
    if not layers:
        return None
    fp8 = config.indexer_cache_dtype == "fp8"  # keys and their scales in bytes (`scaled`)
    dtype = torch.uint8 if fp8 else config.torch_dtype
    width = model.cfg.index_head_dim
    return KVLayout("index", layers, config.page_size, dtype, latent_dim=width)


def pool_pages(
    config: EngineConfig, layouts: list[KVLayout], device: torch.device, reserved: int = 0
) -> int:
    """Pages per pool; every pool (target, draft) has as many, indexed by the same page tables.
    `reserved` bytes are kept out of the budget (the CUDA graphs' outputs, allocated after)."""
    layout = layouts[0]
    page_bytes = sum(lay.bytes_per_page for lay in layouts)
    if config.max_total_tokens is not None:
        tokens = config.max_total_tokens
    elif device.type == "cuda":
        torch.cuda.empty_cache()  # blocks cached by torch's allocator count as used
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.mem_fraction_static - (total - free) - reserved
        if budget < page_bytes:
            raise ValueError(
                f"no memory left for the KV cache: {free / 2**30:.1f} GiB free of "
                f"{total / 2**30:.1f} GiB with mem_fraction_static="
                f"{config.mem_fraction_static} ({reserved / 2**30:.2f} GiB for CUDA graphs)"
            )
        tokens = int(budget // page_bytes) * layout.page_size
    else:
        tokens = CPU_DEFAULT_TOKENS
    return max(tokens // layout.page_size, 1)


def load_draft(config: EngineConfig, target, device: torch.device, ctx: ParallelContext):
    """The speculative draft, or None: MTP from the target's checkpoint, EAGLE-3 from its own.
    With pipeline stages the draft lives on the last stage; where that stage lacks the target's
    embedding (which the draft shares), it loads its own copy."""
    if not config.speculative_algorithm or not ctx.stage.last:
        return None
    dtype, fmt = config.torch_dtype, config.load_format
    embedding = target.embed_tokens
    if embedding is None:
        embedding = load_embedding(config.model_path, target.cfg, device, dtype, ctx, fmt)
    if config.speculative_algorithm == "mtp":
        from dserve.spec.mtp import load_mtp_draft

        path = config.model_path
        return load_mtp_draft(path, target.cfg, target, device, dtype, ctx, fmt, embedding)
    from dserve.spec.eagle3 import load_eagle3_draft

    path = config.speculative_draft_model_path
    return load_eagle3_draft(path, target, device, dtype, ctx, fmt, embedding)


def aux_layers(config: EngineConfig, num_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs the draft reads besides the final hidden states (EAGLE-3's
    three), known on every pipeline stage: each passes on those it computed."""
    if config.speculative_algorithm != "eagle3":
        return ()
    from dserve.spec.eagle3 import target_aux_layers

    return target_aux_layers(config.speculative_draft_model_path, num_layers)


def uses_static_steps(config: EngineConfig) -> bool:
    """Decode-like passes from static buffers (CUDA graphs on a GPU): the triton and flashinfer
    backends (a pipeline stage's too: its layers, between what it receives and what it
    sends)."""
    backend = config.attention_backend in ("triton", "flashinfer")
    return backend and not config.disable_cuda_graph


def tokens_per_seq(config: EngineConfig) -> int:
    """Most tokens one sequence computes in a decode-like step: one, or a verify's tokens."""
    return config.speculative_num_draft_tokens if config.speculative_algorithm else 1


def max_pages_per_seq(config: EngineConfig, max_context: int, num_pages: int) -> int:
    """The most pages one request holds: its context, and the slots a draft tree takes past it."""
    extra = 0
    if config.speculative_algorithm:
        steps, topk = config.speculative_num_steps, config.speculative_eagle_topk
        extra = config.speculative_num_draft_tokens + steps * topk
    return min(-(-(max_context + extra) // config.page_size), num_pages)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, ctx: ParallelContext = SINGLE, device: str | None = None
    ):
        self.config, self.ctx = config, ctx
        self.device = torch.device(device or config.device)
        self.model_config, self.model = load_model(
            config.model_path,
            self.device,
            config.torch_dtype,
            ctx,
            progress=config.load_progress,
            load_format=config.load_format,
            quantization=config.quantization,
        )
        dtype, attn = config.torch_dtype, ctx.attn.size
        own_layers = len(self.model.layers)  # a pipeline stage's pool holds its layers only
        layouts = [kv_layout(self.model_config, config.page_size, dtype, attn, own_layers)]
        indexed = index_layout(self.model, config)
        self.draft = load_draft(config, self.model, self.device, ctx)
        draft_indexed = index_layout(self.draft, config)
        self.draft_pool = self.draft_index_pool = self.last_hidden = None
        # EAGLE-3 reads their outputs
        self.aux_layers = aux_layers(config, self.model_config.num_hidden_layers)
        if self.draft is not None:
            layouts.append(kv_layout(self.draft.cfg, config.page_size, dtype, attn, 1))
        static = uses_static_steps(config)
        widths = self._static_widths() if static else []
        reserved = sum(output_bytes(self, self.graph_tokens, w) for w in widths)
        if static and indexed:
            longest = self.model_config.max_position_embeddings
            reserved += sparse_scores_bytes(self.graph_tokens, longest)
        if static and config.attention_backend == "flashinfer":  # the target's and the draft's
            backends = 1 + (self.draft is not None)
            reserved += backends * self._flashinfer_graph_bytes()
        sized = layouts + [lay for lay in (indexed, draft_indexed) if lay]
        self.num_pages = pool_pages(config, sized, self.device, reserved)
        num_pages = self.num_pages + static  # and a scratch page for static steps' padding
        max_context = self.model_config.max_position_embeddings
        self.max_pages = max_pages_per_seq(config, max_context, self.num_pages)
        self.pool = KVPool(layouts[0], num_pages, self.device)
        self.index_pool = KVPool(indexed, num_pages, self.device) if indexed else None
        self.backend = create_backend(config.attention_backend, self.pool, self.index_pool)
        self.backend.expand_min_tokens = expand_min_tokens(config, self.device)
        self._use_kernels()
        if self.draft is not None:
            self.draft_pool = KVPool(layouts[1], num_pages, self.device)
            self.draft_index_pool = None
            if draft_indexed:
                self.draft_index_pool = KVPool(draft_indexed, num_pages, self.device)
            self.draft_backend = create_backend(
                config.attention_backend, self.draft_pool, self.draft_index_pool
            )
        slots = config.max_running_requests
        self.last_token = torch.zeros(slots, dtype=torch.int64, device=self.device)
        lay = layouts[0]
        log.info(
            "KV pool: %d pages x %d tokens = %d tokens, %.2f MB (%s, %d layers, %s)",
            self.num_pages,
            lay.page_size,
            self.num_pages * lay.page_size,
            self.pool.total_bytes / 1e6,
            lay.kind,
            lay.num_layers,
            config.dtype,
        )
        self.statics = self._static_steps(widths)
        self.static_passes = 0  # passes run from static buffers so far

    def _use_kernels(self) -> None:
        """The triton and flashinfer backends put norms, rotary and MoE on Triton kernels too,
        the norms quantizing their output for the FP8 linears that read it."""
        if self.config.attention_backend not in ("triton", "flashinfer"):
            return
        draft = list(self.draft.modules()) if self.draft is not None else []
        for module in [*self.model.modules(), *draft]:
            if isinstance(module, (RMSNorm, RotaryEmbedding, Experts)):
                module.use_kernel = True
        quantize_in_norms(self.model)
        if self.draft is not None:
            quantize_in_norms(self.draft)

    @property
    def graph_tokens(self) -> int:
        """The largest bucket of static passes: `cuda_graph_max_bs` sequences' tokens."""
        return self.config.cuda_graph_max_bs * tokens_per_seq(self.config)

    def _flashinfer_graph_bytes(self) -> int:
        """What one FlashInfer backend's graphs keep on the device, at most."""
        from dserve.attention.flashinfer_graphs import graph_bytes

        page_size = self.config.page_size
        longest = self.model_config.max_position_embeddings
        return graph_bytes(token_buckets(self.graph_tokens), -(-longest // page_size))

    def _static_widths(self) -> list[int | None]:
        """One set of static passes for the target (None), and per width of the states the
        two-pass draft's passes read, one for the draft."""
        widths = [None]
        if self.draft is not None and not self.config.speculative_naive:
            hidden = self.model_config.hidden_size
            aux = len(self.aux_layers) * hidden if self.aux_layers else None
            widths += sorted({aux or hidden, self.draft.cfg.hidden_size})
        return widths

    def _static_steps(self, widths: list[int | None]) -> list[StaticSteps]:
        """The static passes the step's backends run; captured on a GPU."""
        out = []
        for width in widths:
            steps = StaticSteps(self, self.graph_tokens, width)
            if steps.usable:
                if self.device.type == "cuda":
                    steps.capture()
                out.append(steps)
        return out

    def release_graphs(self) -> None:
        """Drop the captured CUDA graphs: graphs holding NCCL collectives keep the communicator
        from being destroyed (pytorch#115388), so a rank releases them before leaving its group."""
        for steps in self.statics:
            steps.graphs.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def transfer_pools(self) -> list:
        """The pools the transfer agent moves (`TransferPool`): the target's (a pipeline stage's
        layers), a sparse-attention model's indexer keys, then the draft's and, for a sparse
        model's MTP layer, its indexer keys."""
        from dserve.transfer.descriptor import TransferPool

        cfg = self.model_config
        layers = self._layers()
        pools = [
            TransferPool(
                "target", self.pool, cfg.num_key_value_heads, layers, cfg.num_hidden_layers
            )
        ]
        if self.index_pool is not None:
            held, total = self.model.index_layer_range, self.model.total_index_layers
            pools.append(TransferPool("index", self.index_pool, 0, held, total))
        if self.draft_pool is not None:
            heads = self.draft.cfg.num_key_value_heads
            pools.append(TransferPool("draft", self.draft_pool, heads))
        if self.draft_index_pool is not None:
            pools.append(TransferPool("draft-index", self.draft_index_pool, 0))
        return pools

    @property
    def verified_pools(self) -> list[KVPool]:
        """The target's pools whose entries follow a verified draft tree's accepted path."""
        return [p for p in (self.pool, self.index_pool) if p is not None]

    @property
    def parameter_bytes(self) -> int:
        return parameter_bytes(self.model)

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        shapes: list[PassShape] | None = None,
        received: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One pass of this rank's layers. On the last pipeline stage (every rank, without
        stages): logits [N, vocab] (float32, on the rank's device) at the batch's `logits_rows`
        rows (with naive speculation, the target's rows then the draft's); it keeps what a draft
        pass reads next. On a stage before the last: what the next stage receives (its hidden
        states, then the outputs of the draft's aux layers so far), a tensor of its own.
        `received`: what the previous stage sent (None on the first). `shapes` are every DP
        group's parts of this pass (default: this batch alone): all ranks run the pass statically
        or all eagerly, each group padded to the same bucket."""
        shapes = shapes or [PassShape.of(batch)]
        steps, bucket = self._static_set(batch, shapes)
        if steps is not None:
            out, feed = steps.run(batch, bucket, received)
            self.static_passes += 1
        else:
            if self.ctx.dp.size > 1:
                batch.dp_num_tokens = [shape.tokens for shape in shapes]
            out, feed = self.run_model(batch.to(self.device), received)
        if self.draft is not None:
            self.last_hidden = feed
        return out

    def _static_set(self, batch: ForwardBatch, shapes: list[PassShape]):
        """(the static set that runs this pass, its bucket), or (None, None): eagerly."""
        draft_pass = batch.hidden_rows is not None
        for steps in self.statics:
            if steps.fused == (batch.fused_draft is not None) and self._reads(steps, draft_pass):
                bucket = steps.bucket_for(shapes)
                if bucket is not None:
                    return steps, bucket
        return None, None

    def stage_input(self, batch: ForwardBatch, shapes: list[PassShape], tokens: int):
        """Where a stage after the first receives the pass's `tokens` rows from the one
        before: the static input of the set that will run it (no copy before the replay), else
        a new tensor."""
        steps, _ = self._static_set(batch, shapes)
        if steps is not None and steps.received is not None:
            return steps.received[:tokens]
        width, dtype = self.stage_input_width(), self.config.torch_dtype
        return torch.empty(tokens, width, dtype=dtype, device=self.device)

    def stage_input_width(self) -> int:
        """The width of what this stage receives: hidden states and the aux layers' outputs
        computed on the stages before it."""
        return self.model_config.hidden_size * (1 + len(self._carried_ids()))

    def stage_output_width(self) -> int:
        """The width of what a stage before the last sends: hidden states and the aux layers'
        outputs computed on it and the stages before it."""
        sent = self._aux_before(self._layers().stop)
        return self.model_config.hidden_size * (1 + len(sent))

    def _carried_ids(self) -> list[int]:
        """The aux layers the stages before this one computed (in `aux_layers` order)."""
        return self._aux_before(self._layers().start)

    def _aux_before(self, layer: int) -> list[int]:
        """The aux layers numbered below `layer`, in `aux_layers` order."""
        return [i for i in self.aux_layers if i < layer]

    def _layers(self) -> range:
        """This stage's layers of the target."""
        return self.ctx.stage.layer_range(self.model_config.num_hidden_layers)

    def _unpack(self, received):
        if received is None:
            return None, {}
        parts = received.split(self.model_config.hidden_size, dim=-1)
        return parts[0], dict(zip(self._carried_ids(), parts[1:]))

    def _reads(self, steps: StaticSteps, draft_pass: bool) -> bool:
        """Whether `steps` serve this pass: the target's, or the draft's over states this wide."""
        if not draft_pass:
            return steps.hidden_width is None
        states = self.last_hidden
        return states is not None and states.shape[-1] == steps.hidden_width

    def read_pending(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids with each stand-in -(slot + 1) replaced by that slot's last sampled token."""
        slots = (-ids - 1).clamp(min=0)
        return torch.where(ids >= 0, ids, self.last_token[slots])

    def target_layers(self, batch: ForwardBatch, received: torch.Tensor | None = None):
        """This rank's layers of the target over what the previous stage sent (`received`;
        None on the first stage). On the last stage: (the final hidden states, the states a
        following draft pass reads); on a stage before it: (what the next stage receives,
        None)."""
        hidden, carried = self._unpack(received)
        hidden, outputs = self.model.run_layers(batch, self.backend, self.aux_layers, hidden)
        outputs = {**carried, **outputs}
        aux = [outputs[i] for i in self.aux_layers if i in outputs]
        if not self.ctx.stage.last:
            return (torch.cat([hidden, *aux], dim=-1) if aux else hidden), None
        return hidden, torch.cat(aux, dim=-1) if aux else hidden

    def draft_layers(self, batch: ForwardBatch, states: torch.Tensor) -> torch.Tensor:
        """The two-pass draft's hidden states over `states`, the rows its tokens read."""
        return self.draft(batch, states, self.draft_backend)

    def fused_layers(self, batch: ForwardBatch, received: torch.Tensor | None = None):
        """Naive speculation, on the last stage: (the target's logits at the batch's rows, the
        draft's hidden states over the same tokens, and the target's feed)."""
        hidden, feed = self.target_layers(batch, received)
        return (*self._fused_tail(batch, hidden, feed), feed)

    def _fused_tail(self, batch: ForwardBatch, hidden, feed):
        """The target's logits at the batch's rows, and the draft's hidden states over the same
        tokens, each reading the token after it: the target's argmax where that is not known
        yet."""
        logits = self.model.compute_logits(hidden[batch.logits_rows])
        fused = batch.fused_draft
        if logits.shape[0]:
            argmax = logits.argmax(dim=-1)[fused.from_target.clamp(min=0)]
        else:
            argmax = fused.next_ids
        ids = torch.where(fused.from_target >= 0, argmax, fused.next_ids)
        draft_batch = replace(batch, input_ids=ids, fused_draft=None)
        return logits, self.draft(draft_batch, feed, self.draft_backend)

    def run_model(self, batch: ForwardBatch, received: torch.Tensor | None = None):
        """One eager pass of the target (or, with `hidden_rows`, the draft): its logits at the
        batch's rows (then the fused draft's), and the hidden states a draft pass reads next; on
        a stage before the last, (what the next stage receives, None). `received`: `forward`'s."""
        batch = replace(batch, input_ids=self.read_pending(batch.input_ids))
        if batch.hidden_rows is not None:  # a draft pass reads the last pass's hidden states
            hidden = self.draft_layers(batch, self.last_hidden[batch.hidden_rows])
            return self.draft.compute_logits(hidden[batch.logits_rows]), hidden
        if batch.fused_draft is None:
            hidden, feed = self.target_layers(batch, received)
            if not self.ctx.stage.last:
                return hidden, None
            return self.model.compute_logits(hidden[batch.logits_rows]), feed
        logits, draft_hidden, feed = self.fused_layers(batch, received)
        draft = self.draft.compute_logits(draft_hidden[batch.fused_draft.logits_rows])
        return torch.cat([logits, draft]), feed


def expand_min_tokens(config: EngineConfig, device: torch.device) -> int:
    """`mla_expand_min_tokens`, its default resolved: 128 on a GPU, never on the CPU."""
    if config.mla_expand_min_tokens is not None:
        return config.mla_expand_min_tokens
    return 128 if device.type == "cuda" else 0
