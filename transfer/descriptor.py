"""What a rank tells its transfer peers about itself, once, at registration.

A `RankDescriptor` names the rank (DP group, attention-TP rank of how many), its UCX worker address,
and one `PoolDescriptor` per KV pool it holds: the target model's pool first, a draft model's pool
(possibly of another layout) as a further list entry. Decode and prefill compare descriptors before
any page moves and refuse a peer whose pools would not line up, naming the difference.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dserve.scheduler.kv_pool import KVLayout


class IncompatiblePeer(ValueError):
    """Prefill and decode instances whose KV pools cannot exchange pages."""


PAGE_ORDER = "page-major: layer, buffer, slot, head, dim"


@dataclass(frozen=True)
class PoolDescriptor:
    name: str  # "target", "draft"
    kind: str  # "mla" or "mha"
    num_layers: int
    page_size: int
    dtype: str
    token_shapes: list[list[int]]  # per buffer of a layer, the shape of one token's entry
    total_kv_heads: int = 0  # MHA: the model's KV heads (0 for MLA)
    held_heads: list[int] = field(default_factory=list)  # MHA: global KV heads this rank holds
    order: str = PAGE_ORDER  # how a page's bytes are arranged (scheduler/kv_pool.py)
    message_pages: int = 0  # decode: the most pages it takes in one UCX message (0: a whole run)

    @classmethod
    def from_layout(
        cls,
        name: str,
        layout: KVLayout,
        total_kv_heads: int = 0,
        held_heads: list[int] | None = None,
        message_pages: int = 0,
    ) -> "PoolDescriptor":
        return cls(
            name,
            layout.kind,
            layout.num_layers,
            layout.page_size,
            str(layout.dtype).removeprefix("torch."),
            [list(s) for s in layout.token_shapes()],
            total_kv_heads,
            list(held_heads or []),
            message_pages=message_pages,
        )

    def per_head_shapes(self) -> list[list[int]]:
        """Token shapes with the head dimension taken out (MHA), to compare across TP sizes."""
        return [s[1:] for s in self.token_shapes] if self.kind == "mha" else self.token_shapes


@dataclass(frozen=True)
class RankDescriptor:
    dp_rank: int
    attn_rank: int
    attn_tp: int
    address: str  # the rank's UCX worker address (hex): peers make endpoints from it, no listener
    pools: list[PoolDescriptor]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RankDescriptor":
        pools = [PoolDescriptor(**p) for p in d["pools"]]
        return cls(
            int(d["dp_rank"]), int(d["attn_rank"]), int(d["attn_tp"]), str(d["address"]), pools
        )


@dataclass(frozen=True)
class InstanceDescriptor:
    """A whole instance: the model it serves and every rank, in (dp_rank, attn_rank) order."""

    model: dict  # identity of the weights: architecture and the sizes that shape the KV
    dp_size: int
    attn_tp: int
    ranks: list[RankDescriptor]

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "dp_size": self.dp_size,
            "attn_tp": self.attn_tp,
            "ranks": [r.to_dict() for r in self.ranks],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "InstanceDescriptor":
        return cls(
            dict(d["model"]),
            int(d["dp_size"]),
            int(d["attn_tp"]),
            [RankDescriptor.from_dict(r) for r in d["ranks"]],
        )

    def group(self, dp_rank: int) -> list[RankDescriptor]:
        return [r for r in self.ranks if r.dp_rank == dp_rank]


def check_compatible(
    local: InstanceDescriptor,
    remote: InstanceDescriptor,
    local_role: str = "decode",
    remote_role: str = "prefill",
) -> None:
    """Raise IncompatiblePeer naming the first difference that would make pages not line up."""

    def differ(what: str, mine, theirs) -> None:
        raise IncompatiblePeer(
            f"incompatible {remote_role} peer: {what} differs ({local_role}: {mine}, "
            f"{remote_role}: {theirs})"
        )

    for key in sorted(set(local.model) | set(remote.model)):
        if local.model.get(key) != remote.model.get(key):
            differ(f"model {key}", local.model.get(key), remote.model.get(key))
    mine, theirs = local.ranks[0].pools, remote.ranks[0].pools
    if [p.name for p in mine] != [p.name for p in theirs]:
        differ("KV pools", [p.name for p in mine], [p.name for p in theirs])
    for a, b in zip(mine, theirs):
        for attr in ("order", "kind", "num_layers", "page_size", "dtype", "total_kv_heads"):
            if getattr(a, attr) != getattr(b, attr):
                differ(f"{a.name} pool {attr}", getattr(a, attr), getattr(b, attr))
        if a.per_head_shapes() != b.per_head_shapes():
            differ(f"{a.name} pool layout", a.token_shapes, b.token_shapes)
