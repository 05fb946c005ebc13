"""One rank's model, KV pool and attention backend: runs a `ForwardBatch` and returns logits.

Pool sizing: `max_total_tokens` when given; on a GPU otherwise what `mem_fraction_static` of the
device memory leaves after the weights; on the CPU 16384 tokens.
"""
from __future__ import annotations

import logging

import torch

from dserve.attention.backend import ForwardBatch, create_backend
from dserve.models.config import ModelConfig
from dserve.models.loader import load_model, parameter_bytes
from dserve.models.parallel import SINGLE, ParallelContext
from dserve.runtime.config import EngineConfig
from dserve.scheduler.kv_pool import KVLayout, KVPool

log = logging.getLogger("dserve.runtime")
CPU_DEFAULT_TOKENS = 16384


def kv_layout(cfg: ModelConfig, page_size: int, dtype: torch.dtype, attn_tp_size: int = 1) -> KVLayout:
    if cfg.attention_kind == "mla":  # the latent is replicated over attention-TP ranks
        return KVLayout("mla", cfg.num_hidden_layers, page_size, dtype,
                        latent_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim, kv_lora_rank=cfg.kv_lora_rank)
    heads = max(cfg.num_key_value_heads // attn_tp_size, 1)
    return KVLayout("mha", cfg.num_hidden_layers, page_size, dtype, num_kv_heads=heads,
                    head_dim=cfg.head_dim, v_head_dim=cfg.head_dim)


def pool_pages(config: EngineConfig, layout: KVLayout, device: torch.device) -> int:
    if config.max_total_tokens is not None:
        tokens = config.max_total_tokens
    elif device.type == "cuda":
        torch.cuda.empty_cache()  # blocks cached by torch's allocator count as used in mem_get_info
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.mem_fraction_static - (total - free)
        if budget < layout.bytes_per_page:
            raise ValueError(f"no memory left for the KV cache: {free / 2**30:.1f} GiB free of "
                             f"{total / 2**30:.1f} GiB with mem_fraction_static={config.mem_fraction_static}")
        tokens = int(budget // layout.bytes_per_token)
    else:
        tokens = CPU_DEFAULT_TOKENS
    return max(tokens // layout.page_size, 1)


class ModelRunner:
    def __init__(self, config: EngineConfig, ctx: ParallelContext = SINGLE, device: str | None = None):
        self.config, self.ctx = config, ctx
        self.device = torch.device(device or config.device)
        self.model_config, self.model = load_model(config.model_path, self.device, config.torch_dtype, ctx,
                                                   progress=config.load_progress)
        layout = kv_layout(self.model_config, config.page_size, config.torch_dtype, ctx.attn.size)
        self.pool = KVPool(layout, pool_pages(config, layout, self.device), self.device)
        self.backend = create_backend(config.attention_backend, self.pool)
        log.info("KV pool: %d pages x %d tokens = %d tokens, %.2f MB (%s, %d layers, %s)", self.pool.num_pages,
                 layout.page_size, self.pool.num_tokens, self.pool.total_bytes / 1e6, layout.kind,
                 layout.num_layers, config.dtype)

    @property
    def parameter_bytes(self) -> int:
        return parameter_bytes(self.model)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [N, vocab] (float32, on the rank's device) for the batch's `logits_indices` rows."""
        batch = batch.to(self.device)
        hidden = self.model(batch, self.backend)
        return self.model.compute_logits(hidden[batch.logits_indices])
