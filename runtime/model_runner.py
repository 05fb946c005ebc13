"""One rank's model, KV pool and attention backend: turns scheduled spans into a forward pass.

Pool sizing: `max_total_tokens` when given; on a GPU otherwise what `mem_fraction_static` of the
device memory leaves after the weights; on the CPU 16384 tokens.
"""
from __future__ import annotations

import logging

import torch

from dserve.attention.backend import ForwardBatch, create_backend
from dserve.models.config import ModelConfig
from dserve.models.loader import load_model
from dserve.runtime.config import EngineConfig
from dserve.scheduler.kv_pool import KVLayout, KVPool
from dserve.scheduler.kv_manager import KVCacheManager
from dserve.scheduler.scheduler import Span

log = logging.getLogger("dserve.runtime")
CPU_DEFAULT_TOKENS = 16384


def kv_layout(cfg: ModelConfig, page_size: int, dtype: torch.dtype, tp_size: int = 1) -> KVLayout:
    if cfg.attention_kind == "mla":
        return KVLayout("mla", cfg.num_hidden_layers, page_size, dtype,
                        latent_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim, kv_lora_rank=cfg.kv_lora_rank)
    heads = max(cfg.num_key_value_heads // tp_size, 1)
    return KVLayout("mha", cfg.num_hidden_layers, page_size, dtype, num_kv_heads=heads,
                    head_dim=cfg.head_dim, v_head_dim=cfg.head_dim)


def pool_pages(config: EngineConfig, layout: KVLayout, device: torch.device) -> int:
    if config.max_total_tokens is not None:
        tokens = config.max_total_tokens
    elif device.type == "cuda":
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
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.model_config, self.model = load_model(config.model_path, self.device, config.torch_dtype,
                                                   progress=config.load_progress)
        layout = kv_layout(self.model_config, config.page_size, config.torch_dtype)
        self.pool = KVPool(layout, pool_pages(config, layout, self.device), self.device)
        self.kv = KVCacheManager(self.pool.num_pages, config.page_size, config.enable_prefix_caching)
        self.backend = create_backend(config.attention_backend, self.pool)
        log.info("KV pool: %d pages x %d tokens = %d tokens, %.2f MB (%s, %d layers, %s)", self.pool.num_pages,
                 layout.page_size, self.pool.num_tokens, self.pool.total_bytes / 1e6, layout.kind,
                 layout.num_layers, config.dtype)

    def build_batch(self, spans: list[Span]) -> ForwardBatch:
        ids, positions, slots, logits_rows = [], [], [], []
        max_pages = max(len(self.kv.tables[s.req.rid]) for s in spans)
        table = torch.zeros(len(spans), max_pages, dtype=torch.int64)
        for i, span in enumerate(spans):
            rid, end = span.req.rid, span.start + span.length
            ids.extend(span.req.all_ids[span.start:end])
            positions.extend(range(span.start, end))
            slots.extend(self.kv.slots(rid, span.start, end))
            pages = self.kv.tables[rid]
            table[i, : len(pages)] = torch.tensor(pages)
            if span.completes:
                logits_rows.append(len(ids) - 1)
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(ids, device=dev), positions=torch.tensor(positions, device=dev),
            q_lens=[s.length for s in spans], seq_lens=[s.start + s.length for s in spans],
            page_table=table.to(dev), out_slots=torch.tensor(slots, device=dev),
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev))

    @torch.inference_mode()
    def forward(self, spans: list[Span]) -> torch.Tensor:
        """Logits [N, vocab] (float32) for the spans that complete, in span order."""
        batch = self.build_batch(spans)
        hidden = self.model(batch, self.backend)
        return self.model.compute_logits(hidden[batch.logits_indices])
