"""Which slice of the model this process holds: tensor-parallel rank and size, and the collective to combine.

A single-process engine uses `ParallelContext()` (rank 0 of 1), where every collective is a no-op.
The parallel-ranks issue fills in the process group; layers and weight loaders only read this object.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None  # torch.distributed ProcessGroup when tp_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.tp_group)
        return x

    def shard_range(self, total: int, what: str) -> tuple[int, int]:
        """[start, end) of this rank's equal share of `total` items; `what` names them in the error."""
        if total % self.tp_size:
            raise ValueError(f"{what} = {total} does not divide by tp_size = {self.tp_size}")
        n = total // self.tp_size
        return self.tp_rank * n, (self.tp_rank + 1) * n


SINGLE = ParallelContext()
