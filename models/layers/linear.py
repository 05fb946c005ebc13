"""Linear layers that know their tensor-parallel slice, each parameter with its own checkpoint loader.

Column-parallel layers split output features over ranks, row-parallel layers split input features
and sum over ranks; merged layers (q/k/v, gate/up) hold several checkpoint tensors in one matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dserve.models.parallel import ALONE, TPGroup
from dserve.models.quant import FP8, fp8_gated_linear, fp8_linear
from dserve.models.weights import TensorSource, attach_loader, copy_checked, replicated_loader


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def matmul(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ layer.weight.T (+ bias): the FP8 product where the checkpoint's weight is FP8."""
    if layer.weight.dtype == FP8:
        y = fp8_linear(x, layer)
        return y + bias if bias is not None else y
    return F.linear(x, layer.weight, bias)


def gated_matmul(layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """(SiLU(gate) * up) @ layer.weight.T for gate_up [..., 2I], gate then up: for an FP8
    weight on a GPU, the activation quantized in the launch that computes it."""
    if layer.weight.dtype == FP8:
        y = fp8_gated_linear(gate_up, layer)
        if y is not None:
            return y
    gate, up = gate_up.chunk(2, dim=-1)
    return matmul(layer, F.silu(gate) * up)


class ReplicatedLinear(nn.Module):
    """The same full matrix on every rank (small projections such as MLA's latent down-projection)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = attach_loader(_param(out_features, in_features), replicated_loader)
        self.bias = attach_loader(_param(out_features), replicated_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(self, x, self.bias)


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor inside a merged column-parallel matrix: where it goes and what it reads."""

    name: str
    local_offset: int  # first output row of this part in the local matrix
    local_size: int  # output rows this rank holds
    source_start: int  # first output row read from the checkpoint tensor
    source_size: int  # output rows of the whole checkpoint tensor (shape check)


class MergedColumnLinear(nn.Module):
    """Several checkpoint matrices fused along the output dimension, each sliced for this rank."""

    def __init__(self, in_features: int, parts: list[Part], bias: bool = False):
        super().__init__()
        self.parts = {p.name: p for p in parts}
        out = sum(p.local_size for p in parts)
        self.weight = attach_loader(_param(out, in_features), self._load)
        self.weight.expected_shards = list(self.parts)
        self.bias = None
        if bias:
            self.bias = attach_loader(_param(out), self._load)
            self.bias.expected_shards = list(self.parts)
        self.output_sizes = [p.local_size for p in parts]

    def _load(self, param: torch.Tensor, source: TensorSource, shard: str) -> None:
        part = self.parts[shard]
        if source.shape[0] != part.source_size:
            raise source.fail(f"{source.shape[0]} output rows, expected {part.source_size}")
        value = source.read(0, part.source_start, part.source_start + part.local_size)
        copy_checked(param.data.narrow(0, part.local_offset, part.local_size), value, source)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(self, x, self.bias)


def column_parts(sizes: dict[str, int], tp: TPGroup) -> list[Part]:
    """Parts split evenly over ranks (gate/up, a plain column-parallel matrix)."""
    parts, offset = [], 0
    for name, total in sizes.items():
        start, end = tp.shard_range(total, f"{name} output size")
        parts.append(Part(name, offset, end - start, start, total))
        offset += end - start
    return parts


def qkv_parts(num_heads: int, num_kv_heads: int, head_dim: int, tp: TPGroup) -> list[Part]:
    """q heads split over ranks; KV heads split too, or replicated when there are fewer than ranks."""
    q0, q1 = tp.shard_range(num_heads, "num_attention_heads")
    if num_kv_heads >= tp.size:
        k0, k1 = tp.shard_range(num_kv_heads, "num_key_value_heads")
    else:
        if tp.size % num_kv_heads:
            raise ValueError(
                f"{tp.size} attention ranks is not a multiple of num_key_value_heads = {num_kv_heads}"
            )
        k0 = tp.rank // (tp.size // num_kv_heads)
        k1 = k0 + 1
    q_rows, kv_rows = (q1 - q0) * head_dim, (k1 - k0) * head_dim
    return [
        Part("q", 0, q_rows, q0 * head_dim, num_heads * head_dim),
        Part("k", q_rows, kv_rows, k0 * head_dim, num_kv_heads * head_dim),
        Part("v", q_rows + kv_rows, kv_rows, k0 * head_dim, num_kv_heads * head_dim),
    ]


class ColumnParallelLinear(MergedColumnLinear):
    """Output features split over ranks; a single checkpoint tensor (shard id None)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = ALONE
    ):
        start, end = tp.shard_range(out_features, "output features")
        super().__init__(in_features, [Part(None, 0, end - start, start, out_features)], bias)


class RowParallelLinear(nn.Module):
    """Input features split over ranks; partial products summed across ranks, bias added once."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        tp: TPGroup = ALONE,
        reduce: bool = True,
    ):
        super().__init__()
        self.tp = tp
        # False: the caller sums this partial product with others, then reduces once
        self.reduce = reduce
        self.in_start, self.in_end = tp.shard_range(in_features, "input features")
        self.weight = attach_loader(_param(out_features, self.in_end - self.in_start), self._load)
        self.bias = attach_loader(_param(out_features), replicated_loader) if bias else None

    def _load(self, param: torch.Tensor, source: TensorSource, shard: object = None) -> None:
        copy_checked(param, source.read(1, self.in_start, self.in_end), source)

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """x @ W.T summed over ranks; `gated`: x is [..., 2I], gate then up, and the input
        SiLU(gate) * up (`gated_matmul`)."""
        y = gated_matmul(self, x) if gated else matmul(self, x)
        if self.reduce:
            y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over ranks; rows outside this rank's range read zero."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = ALONE):
        super().__init__()
        self.tp = tp
        self.start, self.end = tp.shard_range(vocab_size, "vocab_size")
        self.weight = attach_loader(_param(self.end - self.start, hidden_size), self._load)

    def _load(self, param: torch.Tensor, source: TensorSource, shard: object = None) -> None:
        copy_checked(param, source.read(0, self.start, self.end), source)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.start) & (ids < self.end)
        out = F.embedding(torch.where(inside, ids - self.start, 0), self.weight)
        return self.tp.all_reduce(out * inside.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection over the vocabulary split by rank; logits gathered to the full vocabulary."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.tp.all_gather(F.linear(hidden, self.weight)), dim=-1)
