"""One rank's model, KV pool and attention backend: runs a `ForwardBatch` and returns logits.

Pool sizing: `max_total_tokens` when given; on a GPU otherwise what `mem_fraction_static` of the
device memory leaves after the weights; on the CPU 16384 tokens. Decode-like steps replay CUDA
graphs where the backend allows it (`cuda_graphs.py`), the draft's passes too; everything else runs
eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from dserve.attention.backend import ForwardBatch, create_backend
from dserve.models.config import ModelConfig
from dserve.models.layers.moe import Experts
from dserve.models.layers.norm import RMSNorm
from dserve.models.layers.rotary import RotaryEmbedding
from dserve.models.loader import load_model, parameter_bytes
from dserve.models.parallel import SINGLE, ParallelContext
from dserve.runtime.config import EngineConfig
from dserve.runtime.cuda_graphs import StaticSteps
from dserve.scheduler.kv_pool import KVLayout, KVPool

log = logging.getLogger("dserve.runtime")
CPU_DEFAULT_TOKENS = 16384


def kv_layout(
    cfg: ModelConfig,
    page_size: int,
    dtype: torch.dtype,
    attn_tp_size: int = 1,
    num_layers: int | None = None,
) -> KVLayout:
    """The KV layout of `cfg`'s layers (the target's); with `num_layers`, of a draft with that many."""
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


def pool_pages(config: EngineConfig, layouts: list[KVLayout], device: torch.device) -> int:
    """Pages per pool; every pool (target, draft) has as many, indexed by the same page tables."""
    layout = layouts[0]
    page_bytes = sum(lay.bytes_per_page for lay in layouts)
    if config.max_total_tokens is not None:
        tokens = config.max_total_tokens
    elif device.type == "cuda":
        torch.cuda.empty_cache()  # blocks cached by torch's allocator count as used in mem_get_info
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.mem_fraction_static - (total - free)
        if budget < page_bytes:
            raise ValueError(
                f"no memory left for the KV cache: {free / 2**30:.1f} GiB free of "
                f"{total / 2**30:.1f} GiB with mem_fraction_static={config.mem_fraction_static}"
            )
        tokens = int(budget // page_bytes) * layout.page_size
    else:
        tokens = CPU_DEFAULT_TOKENS
    return max(tokens // layout.page_size, 1)


def load_draft(config: EngineConfig, target, device: torch.device, ctx: ParallelContext):
    """The speculative draft model, or None: MTP from the target's checkpoint, EAGLE-3 from its own."""
    if config.speculative_algorithm == "mtp":
        from dserve.spec.mtp import load_mtp_draft

        return load_mtp_draft(
            config.model_path,
            target.cfg,
            target,
            device,
            config.torch_dtype,
            ctx,
            config.load_format,
        )
    if config.speculative_algorithm == "eagle3":
        from dserve.spec.eagle3 import load_eagle3_draft

        return load_eagle3_draft(
            config.speculative_draft_model_path,
            target,
            device,
            config.torch_dtype,
            ctx,
            config.load_format,
        )
    return None


def uses_static_steps(config: EngineConfig) -> bool:
    """Decode-like steps from static buffers (CUDA graphs on a GPU): with the triton backend, one rank."""
    return (
        config.attention_backend == "triton"
        and not config.disable_cuda_graph
        and config.world_size == 1
    )


def tokens_per_seq(config: EngineConfig) -> int:
    """Most tokens one sequence computes in a decode-like step: one, or a verify's draft tokens."""
    return config.speculative_num_draft_tokens if config.speculative_algorithm else 1


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
        )
        layout = kv_layout(self.model_config, config.page_size, config.torch_dtype, ctx.attn.size)
        self.draft, self.draft_pool, self.last_hidden = (
            load_draft(config, self.model, self.device, ctx),
            None,
            None,
        )
        self.aux_layers = getattr(
            self.draft, "aux_layers", ()
        )  # EAGLE-3 reads these target layers' outputs
        layouts = [layout]
        if self.draft is not None:
            layouts.append(
                kv_layout(self.draft.cfg, config.page_size, config.torch_dtype, ctx.attn.size, 1)
            )
        self.num_pages = pool_pages(config, layouts, self.device)  # what the KV manager hands out
        static = uses_static_steps(config)
        num_pages = self.num_pages + static  # and a scratch page for the padding of static steps
        self.pool = KVPool(layout, num_pages, self.device)
        self.backend = create_backend(config.attention_backend, self.pool)
        if config.attention_backend in (
            "triton",
            "flashinfer",
        ):  # Triton kernels for norms, rotary, MoE too
            for module in [
                *self.model.modules(),
                *(self.draft.modules() if self.draft is not None else []),
            ]:
                if isinstance(module, (RMSNorm, RotaryEmbedding, Experts)):
                    module.use_kernel = True
        if self.draft is not None:
            self.draft_pool = KVPool(layouts[1], num_pages, self.device)
            self.draft_backend = create_backend(config.attention_backend, self.draft_pool)
        log.info(
            "KV pool: %d pages x %d tokens = %d tokens, %.2f MB (%s, %d layers, %s)",
            self.num_pages,
            layout.page_size,
            self.num_pages * layout.page_size,
            self.pool.total_bytes / 1e6,
            layout.kind,
            layout.num_layers,
            config.dtype,
        )
        self.statics = self._static_steps() if static else []

    def _static_steps(self) -> list[StaticSteps]:
        """Static decode-like target steps, and the two-pass draft's passes (per width of the states
        they read), where every backend of the step runs them; captured on a GPU."""
        widths = [None]
        if self.draft is not None and not self.config.speculative_naive:
            aux = len(self.aux_layers) * self.model_config.hidden_size if self.aux_layers else None
            widths += sorted({aux or self.model_config.hidden_size, self.draft.cfg.hidden_size})
        out = []
        for width in widths:
            steps = StaticSteps(
                self,
                self.config.cuda_graph_max_bs * tokens_per_seq(self.config),
                self.model_config.max_position_embeddings,
                width,
            )
            if steps.usable:
                if self.device.type == "cuda":
                    steps.capture()
                out.append(steps)
        return out

    @property
    def transfer_pools(self) -> list:
        """(pool, config of its layers) for the transfer agent: the target's, then the draft's."""
        pools = [(self.pool, self.model_config)]
        return pools + [(self.draft_pool, self.draft.cfg)] if self.draft_pool is not None else pools

    @property
    def parameter_bytes(self) -> int:
        return parameter_bytes(self.model)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [N, vocab] (float32, on the rank's device) for the batch's `logits_indices` rows."""
        if batch.kv_moves is not None:  # the accepted path of last step's draft tree, into place
            moves = batch.kv_moves.to(self.device, non_blocking=True)
            self.pool.move(moves[0], moves[1])
            batch = replace(batch, kv_moves=None)  # done: not copied again with the batch
        static = next((steps for steps in self.statics if steps.fits(batch)), None)
        if static is not None:
            logits, feed = static.run(batch)
        else:
            logits, feed = self.run_model(batch.to(self.device))
        if self.draft is not None:
            self.last_hidden = feed
        return logits

    def run_model(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the target (or, with `hidden_rows`, the draft): its logits at the batch's rows
        (then the fused draft's), and the hidden states a following draft pass reads."""
        if batch.hidden_rows is not None:  # a draft pass reads the previous pass's hidden states
            return self.run_draft(batch, self.last_hidden[batch.hidden_rows])
        hidden, aux = self.model.forward_with_aux(batch, self.backend, self.aux_layers)
        feed = hidden if aux is None else aux
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        if batch.fused_draft is not None:
            logits = torch.cat([logits, self._fused_draft(batch, logits, feed)])
        return logits, feed

    def run_draft(
        self, batch: ForwardBatch, states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the two-pass draft over `states` (the rows of the previous pass's hidden
        states its tokens read): its logits at the batch's rows, and its hidden states."""
        hidden = self.draft(batch, states, self.draft_backend)
        return self.draft.compute_logits(hidden[batch.logits_indices]), hidden

    def _fused_draft(
        self, batch: ForwardBatch, logits: torch.Tensor, feed: torch.Tensor
    ) -> torch.Tensor:
        """Naive speculation: the draft over the target's tokens, each reading the token after it
        (the target's argmax where that is not known yet); its logits at the wanted rows."""
        fused = batch.fused_draft
        argmax = (
            logits.argmax(dim=-1)[fused.from_target.clamp(min=0)]
            if logits.shape[0]
            else fused.next_ids
        )
        ids = torch.where(fused.from_target >= 0, argmax, fused.next_ids)
        draft_batch = replace(
            batch, input_ids=ids, logits_indices=fused.logits_indices, fused_draft=None
        )
        hidden = self.draft(draft_batch, feed, self.draft_backend)
        return self.draft.compute_logits(hidden[fused.logits_indices])
