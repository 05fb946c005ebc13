"""Engine configuration: one typed dataclass whose fields are the `Engine` keyword arguments and, in
kebab case, the CLI flags of `dserve serve|prefill|decode`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch

from dserve.models.weights import LOAD_FORMATS
from dserve.scheduler.scheduler import SchedulerConfig
from dserve.spec.strategy import SpeculativeConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineConfig:
    model_path: str
    device: str = "auto"
    """`cpu`, `cuda`, `cuda:1`, or `auto` (cuda when available)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """`float32`, `bfloat16`, `float16` or `auto` (float32 on CPU, bfloat16 on GPU)."""
    page_size: int | None = None
    """Tokens per KV page; default 16 on CPU, 64 on GPU."""
    max_total_tokens: int | None = None
    """KV pool size in tokens; default from memory."""
    mem_fraction_static: float = 0.85
    """GPU: fraction of device memory for weights + KV pool."""
    chunked_prefill_size: int = 2048
    """Most prompt tokens one request computes in one step."""
    max_num_batched_tokens: int = 8192
    """Token budget of one step."""
    max_running_requests: int = 256
    """Requests decoding at once per DP group; more wait in the queue."""
    enable_prefix_caching: bool = True
    """Reuse the KV pages of a prompt prefix seen before."""
    load_format: Literal["auto", "dummy"] = "auto"
    """`auto`: the checkpoint's weights; `dummy`: random ones from config.json alone."""
    quantization: Literal["fp8"] | None = None
    """`fp8` with `load_format="dummy"`: random block-FP8 weights (blocks of 128) at real shapes,
    for benchmarks. A checkpoint's own FP8 format is read from its config.json."""
    indexer_cache_dtype: Literal["auto", "fp8"] = "auto"
    """Sparse-attention models (DeepSeek-V3.2, GLM-5): the indexer's keys in the model's dtype
    (`auto`), or `fp8`: e4m3 with a float32 scale per token, as those models serve them."""
    attention_backend: Literal["auto", "torch", "triton", "flashinfer"] = "auto"
    """`torch` (reference, any device); `triton` (kernels, CUDA graphs); `flashinfer`
    (FlashInfer's kernels, bf16/fp16, CUDA graphs); `auto`: triton on a GPU, torch on the CPU."""
    mla_expand_min_tokens: int | None = None
    """MLA spans of at least this many new tokens (prompt chunks) attend in the expanded form,
    as prefills run: each context latent decompressed through kv_b_proj into per-head keys
    (192) and values (128), then causal attention (the Triton kernel `triton_expanded` on a
    GPU); shorter spans of the same pass (decode tokens, short extends) stay absorbed over the
    latent cache. 0: never. None (default): 128 on a GPU, never on the CPU (where the torch
    backend is the reference). On an H100 at 128 heads the expanded form took 0.89 ms for 128
    new tokens over an 8k prefix against 1.78 absorbed, 2.8 against 13.2 ms for a 4k prompt
    (`python -m bench.extend_attention --kinds mla --cases 128:8192,4096:0`)."""
    cuda_graph_max_bs: int = 256
    """Triton and flashinfer backends: decode-like passes of up to this many sequences (at most
    512) replay CUDA graphs."""
    disable_cuda_graph: bool = False
    """Run every step eagerly."""
    disable_overlap_schedule: bool = False
    """Plan each step only after the one before has reported (no overlapped scheduling)."""
    random_seed: int = 0
    """Seeds unseeded sampling."""
    load_progress: bool = True
    """A progress bar while the checkpoint loads."""
    tp_size: int = 1
    """Ranks of the instance; attention groups of tp_size // dp_size ranks."""
    dp_size: int = 1
    """DP attention: groups with their own requests and KV pages."""
    ep_size: int = 1
    """MoE experts split over ep_size slots of all ranks."""
    pp_size: int = 1
    """Pipeline stages: the decoder layers split into this many contiguous ranges, each run by
    tp_size ranks (the instance has pp_size * tp_size ranks)."""
    pp_layer_partition: str | None = None
    """Layers per pipeline stage, e.g. `3,3,2` (default: even, the remainder on the last
    stages)."""
    nnodes: int = 1
    """Hosts the instance spans: node 0 runs the front and its share of the ranks, each other
    node only ranks (the same command on every host, with its `--node-rank`)."""
    node_rank: int = 0
    """This host's place among the `nnodes` hosts."""
    dist_init_addr: str | None = None
    """HOST:PORT of node 0's rendezvous (torch.distributed's TCP store); needed with nnodes > 1."""
    node_join_timeout_s: float = 60.0
    """How long the hosts wait for each other at start."""
    pp_micro_batches: int | None = None
    """With pipeline stages: steps in flight at once, each over its own requests (default:
    pp_size)."""
    collective_timeout_s: float = 120.0
    """A collective waiting longer fails its rank."""
    step_timeout_s: float = 600.0
    """The front gives up on ranks that return no step result in this time."""
    speculative_algorithm: Literal["mtp", "eagle3"] | None = None
    """`mtp` (the checkpoint's NextN layer) or `eagle3` (a separate draft)."""
    speculative_draft_model_path: str | None = None
    """EAGLE-3 draft checkpoint."""
    speculative_num_steps: int = 1
    """Draft passes per step (the depth of the draft tree)."""
    speculative_eagle_topk: int = 1
    """Branches kept per draft pass (1: a chain; more: a tree)."""
    speculative_num_draft_tokens: int | None = None
    """Tokens per verify, root included (default steps*topk+1)."""
    speculative_naive: bool = False
    """Verify and draft extend in one forward call (steps 1, topk 1)."""

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype == "auto":
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.attention_backend == "auto":
            self.attention_backend = "torch" if self.device == "cpu" else "triton"
        if self.page_size is None:
            self.page_size = 16 if self.device == "cpu" else 64
        if self.cuda_graph_max_bs > 512:
            raise ValueError(f"cuda_graph_max_bs must be at most 512, got {self.cuda_graph_max_bs}")
        for name in (
            "page_size",
            "chunked_prefill_size",
            "max_num_batched_tokens",
            "max_running_requests",
            "cuda_graph_max_bs",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(
                f"max_total_tokens ({self.max_total_tokens}) must hold at least one page "
                f"({self.page_size} tokens)"
            )
        for name in ("tp_size", "dp_size", "ep_size", "pp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tp_size % self.dp_size:
            raise ValueError(
                f"tp_size = {self.tp_size} does not divide by dp_size = {self.dp_size}"
            )
        if self.tp_size % self.ep_size:
            raise ValueError(
                f"tp_size = {self.tp_size} does not divide by ep_size = {self.ep_size}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.quantization not in (None, "fp8") or (
            self.quantization and self.load_format != "dummy"
        ):
            raise ValueError(
                f"quantization={self.quantization!r}: only 'fp8' with load_format='dummy' (an FP8 "
                f"checkpoint's format is read from its config.json)"
            )
        if self.indexer_cache_dtype not in ("auto", "fp8"):
            raise ValueError(
                f"indexer_cache_dtype must be auto or fp8, got {self.indexer_cache_dtype!r}"
            )
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}"
            )
        self._check_speculative()
        self._check_pipeline()
        self._check_nodes()

    def _check_nodes(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in [0, nnodes) and nnodes >= 1, got node_rank="
                f"{self.node_rank}, nnodes={self.nnodes}"
            )
        if self.world_size % self.nnodes:
            raise ValueError(
                f"the instance's {self.world_size} ranks (tp_size x pp_size) do not divide over "
                f"nnodes = {self.nnodes} hosts"
            )
        addr = self.dist_init_addr or ""
        host, _, port = addr.rpartition(":")
        if self.nnodes > 1 and not (host and port.isdigit()):
            raise ValueError(
                f"nnodes = {self.nnodes} needs dist_init_addr HOST:PORT (node 0's rendezvous), "
                f"got {self.dist_init_addr!r}"
            )

    def _check_pipeline(self) -> None:
        if self.pp_micro_batches is None:
            self.pp_micro_batches = self.pp_size
        if self.pp_micro_batches < 1:
            raise ValueError(f"pp_micro_batches must be >= 1, got {self.pp_micro_batches}")
        if self.pp_layer_partition is not None:
            stages = self.pp_layer_partition.split(",")
            if len(stages) != self.pp_size or not all(s.strip().isdigit() for s in stages):
                raise ValueError(
                    f"pp_layer_partition must give {self.pp_size} layer counts (one per "
                    f"stage, e.g. 3,2), got {self.pp_layer_partition!r}"
                )

    @property
    def layer_counts(self) -> list[int] | None:
        """The layers of each pipeline stage as given (None: split evenly)."""
        if self.pp_layer_partition is None:
            return None
        return [int(s) for s in self.pp_layer_partition.split(",")]

    def _check_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo is None:
            return
        if algo not in ("mtp", "eagle3"):
            raise ValueError(f"speculative_algorithm must be mtp or eagle3, got {algo!r}")
        if algo == "eagle3" and not self.speculative_draft_model_path:
            raise ValueError(
                "speculative_algorithm='eagle3' needs speculative_draft_model_path (the EAGLE-3 "
                "checkpoint directory)"
            )
        if self.speculative_num_steps < 1:
            raise ValueError(
                f"speculative_num_steps must be >= 1, got {self.speculative_num_steps}"
            )
        steps, topk = self.speculative_num_steps, self.speculative_eagle_topk
        if topk < 1:
            raise ValueError(f"speculative_eagle_topk must be >= 1, got {topk}")
        if self.speculative_num_draft_tokens is None:
            self.speculative_num_draft_tokens = steps * topk + 1
        # the root and every node the draft passes propose
        most = topk + (steps - 1) * topk * topk + 1
        if topk == 1 and self.speculative_num_draft_tokens != steps + 1:
            raise ValueError(
                f"with speculative_eagle_topk=1 a verify checks speculative_num_steps + 1 = "
                f"{steps + 1} tokens, got speculative_num_draft_tokens="
                f"{self.speculative_num_draft_tokens}"
            )
        if not 2 <= self.speculative_num_draft_tokens <= most:
            raise ValueError(
                f"speculative_num_draft_tokens must be in [2, {most}] with speculative_num_steps={steps} "
                f"and speculative_eagle_topk={topk}, got {self.speculative_num_draft_tokens}"
            )
        if self.speculative_naive and (steps, topk, self.speculative_num_draft_tokens) != (1, 1, 2):
            raise ValueError(
                "speculative_naive runs steps 1, topk 1, 2 draft tokens; got speculative_num_steps="
                f"{steps}, speculative_eagle_topk={topk}, speculative_num_draft_tokens="
                f"{self.speculative_num_draft_tokens}"
            )

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.dp_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def scheduler(self) -> SchedulerConfig:
        """Each DP group's scheduling limits, from these fields."""
        micro_batches = self.pp_micro_batches if self.pp_size > 1 else 1
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            chunked_prefill_size=self.chunked_prefill_size,
            max_running_requests=self.max_running_requests,
            micro_batches=micro_batches,
        )

    def speculative(self) -> SpeculativeConfig:
        """The speculation settings, from these fields."""
        return SpeculativeConfig(
            algorithm=self.speculative_algorithm,
            num_steps=self.speculative_num_steps,
            eagle_topk=self.speculative_eagle_topk,
            num_draft_tokens=self.speculative_num_draft_tokens,
            naive=self.speculative_naive,
        )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
