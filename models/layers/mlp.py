"""Dense gated MLP (SiLU(gate) * up -> down) with gate/up fused and both sliced by tensor parallelism."""

from __future__ import annotations

import torch
from torch import nn

from dserve.models.layers.linear import MergedColumnLinear, RowParallelLinear, column_parts
from dserve.models.parallel import ALONE, TPGroup


class GatedMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, tp: TPGroup = ALONE, reduce: bool = True
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(
            hidden_size, column_parts({"gate": intermediate_size, "up": intermediate_size}, tp)
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), gated=True)

    @staticmethod
    def map_key(suffix: str) -> tuple[str, object] | None:
        """checkpoint suffix (`gate_proj.weight`) -> (parameter suffix, shard id)."""
        for name, shard in (("gate_proj", "gate"), ("up_proj", "up")):
            if suffix == f"{name}.weight":
                return "gate_up_proj.weight", shard
        if suffix == "down_proj.weight":
            return "down_proj.weight", None
        return None
