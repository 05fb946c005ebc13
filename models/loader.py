"""Build a served model from a checkpoint directory: resolve the architecture, create the modules on
the target device and dtype, and load this rank's slice of every tensor (or, with
`load_format="dummy"`, fill them at random from config.json alone)."""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from dserve.models.config import ModelConfig
from dserve.models.parallel import SINGLE, ParallelContext
from dserve.models.registry import resolve
from dserve.models.weights import fill_weights

log = logging.getLogger("dserve.models")


def load_model(
    model_path: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    ctx: ParallelContext = SINGLE,
    progress: bool = True,
    load_format: str = "auto",
    quantization: str | None = None,
) -> tuple[ModelConfig, torch.nn.Module]:
    """The model of the checkpoint at `model_path`, this rank's part of it, on `device`;
    `quantization="fp8"` with dummy weights makes its decoder layers' linears block FP8."""
    cfg, model_cls = resolve(model_path)
    start = time.perf_counter()
    model = build_on(device, dtype, lambda: model_cls(cfg, ctx))
    if quantization == "fp8":
        from dserve.models.quant import Fp8Scheme, dummy_fp8

        dummy_fp8(model, Fp8Scheme("block", (128, 128)))
    fill_weights(model, model_path, model.map_checkpoint_key, load_format, progress)
    model.eval()
    what = "random weights (load_format=dummy) for" if load_format == "dummy" else "loaded"
    log.info(
        "%s %s (%s) in %.1fs: %.1f MB of parameters on %s",
        what,
        model_path,
        cfg.architecture,
        time.perf_counter() - start,
        parameter_bytes(model) / 1e6,
        device,
    )
    return cfg, model


def build_on(
    device: str | torch.device, dtype: torch.dtype, make: Callable[[], torch.nn.Module]
) -> torch.nn.Module:
    """`make()`'s module with its parameters created on `device` in `dtype` (no copy afterwards)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return make()
    finally:
        torch.set_default_dtype(previous)


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class EmbeddingOnly(torch.nn.Module):
    """The target's token embedding alone: what a draft on a pipeline stage without the
    embedding reads its tokens through."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext):
        super().__init__()
        from dserve.models.layers.linear import VocabParallelEmbedding

        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.attn)

    @staticmethod
    def map_checkpoint_key(key: str):
        from dserve.models.weights import SKIP

        return ("embed_tokens.weight", None) if key == "model.embed_tokens.weight" else SKIP


def load_embedding(
    model_path: str,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    ctx: ParallelContext = SINGLE,
    load_format: str = "auto",
) -> torch.nn.Module:
    """The checkpoint's token embedding (this rank's vocabulary slice) on `device`."""
    module = build_on(device, dtype, lambda: EmbeddingOnly(cfg, ctx))
    fill_weights(module, model_path, module.map_checkpoint_key, load_format, progress=False)
    return module.embed_tokens
