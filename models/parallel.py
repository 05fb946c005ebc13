"""Which slice of the model this process holds, and the collectives that combine slices.

A rank sees three groups:
- `attn`: the ranks of its attention group (attention heads, KV heads, embedding and LM head split here);
  with DP attention there are `dp_size` such groups, each serving its own requests.
- `mlp`: every rank of the instance; dense MLPs and MoE layers are split over all of them.
- `dp`: the ranks with the same attention-TP rank across DP groups, used to gather every group's
  tokens before the MLP/MoE and hand each group its rows back after.
MoE experts are split over `ep_size` slots of the `mlp` group (expert parallelism); within a slot
each expert's intermediate dimension is split over the remaining `mlp.size // ep_size` ranks.
With pipeline parallelism the groups above are those of the rank's stage (`stage`): a contiguous
range of the decoder layers, the embedding on the first stage, the final norm and LM head on the
last; hidden states pass from a rank to the rank at the same place in the next stage.
A single-process engine uses `ParallelContext()`, where every collective is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup when size > 1

    def shard_range(self, total: int, what: str) -> tuple[int, int]:
        """[start, end) of this rank's equal share of `total` items; `what` names them in the error."""
        if total % self.size:
            raise ValueError(f"{what} = {total} does not divide by {self.size} ranks")
        n = total // self.size
        return self.rank * n, (self.rank + 1) * n

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.size == 1:
            return [x]
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts


ALONE = TPGroup()  # no tensor parallelism: one rank holds everything


def split_layers(num_layers: int, stages: int, counts: list[int] | None = None) -> list[range]:
    """Each pipeline stage's decoder layers: `counts` per stage, or an even split with the
    remainder on the last stages. Every stage holds at least one layer."""
    if counts is None:
        if stages > num_layers:
            raise ValueError(f"pp_size = {stages} is more stages than the {num_layers} layers")
        base, extra = divmod(num_layers, stages)
        counts = [base + (s >= stages - extra) for s in range(stages)]
    if len(counts) != stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(
            f"pp_layer_partition {','.join(map(str, counts))} does not split the {num_layers} "
            f"layers into {stages} stages of at least one layer each"
        )
    ends = [sum(counts[: s + 1]) for s in range(stages)]
    return [range(end - n, end) for n, end in zip(counts, ends)]


@dataclass(frozen=True)
class Stage:
    """This rank's pipeline stage: its index of `size`, its decoder layers, and the ranks it
    receives hidden states from and sends them to (None at the ends)."""

    index: int = 0
    size: int = 1
    layers: range | None = None
    prev_rank: int | None = None
    next_rank: int | None = None

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def layer_range(self, num_layers: int) -> range:
        return range(num_layers) if self.layers is None else self.layers


@dataclass(frozen=True)
class ParallelContext:
    attn: TPGroup = field(default_factory=TPGroup)
    mlp: TPGroup = field(default_factory=TPGroup)
    dp: TPGroup = field(default_factory=TPGroup)
    ep_size: int = 1
    stage: Stage = field(default_factory=Stage)

    @property
    def moe_tp(self) -> TPGroup:
        """This rank's share of each local expert (no collective: the MoE reduces over `mlp`)."""
        size = self.mlp.size // self.ep_size
        return TPGroup(self.mlp.rank % size, size)

    @property
    def ep_rank(self) -> int:
        return self.mlp.rank // (self.mlp.size // self.ep_size)

    def gather_tokens(self, x: torch.Tensor, dp_num_tokens: list[int] | None) -> torch.Tensor:
        """Every DP group's rows, group after group (identity without DP attention)."""
        if self.dp.size == 1:
            return x
        width = max(dp_num_tokens)
        padded = x.new_zeros(width, *x.shape[1:])
        padded[: x.shape[0]] = x
        parts = self.dp.all_gather(padded)
        return torch.cat([p[:n] for p, n in zip(parts, dp_num_tokens)])

    def moe_mask(self, batch):
        """`batch` with the real-token mask of every DP group's rows for the MoE layers, gathered
        once for the pass (a padded static pass; None otherwise)."""
        if batch.real_tokens is None:
            return batch
        mask = self.gather_tokens(batch.real_tokens, batch.dp_num_tokens)
        return replace(batch, moe_real_tokens=mask)

    def own_tokens(self, x: torch.Tensor, dp_num_tokens: list[int] | None) -> torch.Tensor:
        if self.dp.size == 1:
            return x
        start = sum(dp_num_tokens[: self.dp.rank])
        return x[start : start + dp_num_tokens[self.dp.rank]]


SINGLE = ParallelContext()
