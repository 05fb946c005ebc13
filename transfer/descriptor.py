"""What a rank tells its transfer peers about itself, once, at registration.

A `RankDescriptor` names the rank (pipeline stage, DP group, attention-TP rank of how many), its
UCX worker address, and one `PoolDescriptor` per KV pool it holds: the target model's pool first,
then a sparse-attention model's indexer pool, then a draft model's pool (possibly of another
layout). A pool says which of the
model's layers it holds (a pipeline stage holds a contiguous range), so ranks pair by global layer
id whatever the two sides' partitions. Decode and prefill compare descriptors before any page moves
and refuse a peer whose pools would not line up, naming the difference.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dserve.memory.kv_pool import KVLayout, KVPool


class IncompatiblePeer(ValueError):
    """Prefill and decode instances whose KV pools cannot exchange pages."""


PAGE_ORDER = "page-major: layer, buffer, slot, head, dim"


@dataclass(frozen=True)
class TransferPool:
    """A pool a rank offers its transfer agent: "target", "index" (a sparse-attention model's
    indexer keys) or "draft", all indexed by the same page ids."""

    name: str
    pool: KVPool
    num_kv_heads: int  # the model's KV heads (MHA: a rank holds its share); 0 otherwise
    layers: range | None = None  # the pool's layers this rank holds (a pipeline stage's)
    total_layers: int = 0  # the pool's layers in the whole model (with `layers`)


@dataclass(frozen=True)
class PoolDescriptor:
    name: str  # "target", "index", "draft"
    kind: str  # "mla", "mha" or "index"
    num_layers: int  # layers this rank holds
    page_size: int
    dtype: str
    token_shapes: list[list[int]]  # per buffer of a layer, the shape of one token's entry
    total_kv_heads: int = 0  # MHA: the model's KV heads (0 for MLA)
    held_heads: list[int] = field(default_factory=list)  # MHA: global KV heads this rank holds
    order: str = PAGE_ORDER  # how a page's bytes are arranged (memory/kv_pool.py)
    message_pages: int = 0  # decode: the most pages it takes in one UCX message (0: a whole run)
    first_layer: int = 0  # the model's index of the first layer held (a pipeline stage's start)
    model_layers: int = 0  # layers of the whole model (0: num_layers, all held)

    @property
    def layers(self) -> tuple[int, int]:
        """The model's layers [first, stop) this rank holds."""
        return (self.first_layer, self.first_layer + self.num_layers)

    @property
    def total_layers(self) -> int:
        return self.model_layers or self.num_layers

    @classmethod
    def from_layout(
        cls,
        name: str,
        layout: KVLayout,
        total_kv_heads: int = 0,
        held_heads: list[int] | None = None,
        message_pages: int = 0,
        first_layer: int = 0,
        model_layers: int = 0,
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
            first_layer=first_layer,
            model_layers=model_layers,
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
    stage: int = 0  # pipeline stage

    @property
    def key(self) -> tuple[int, int, int]:
        """Where the rank sits: (DP group, stage, attention rank); ranks sort by it."""
        return (self.dp_rank, self.stage, self.attn_rank)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RankDescriptor":
        pools = [PoolDescriptor(**p) for p in d["pools"]]
        return cls(
            int(d["dp_rank"]),
            int(d["attn_rank"]),
            int(d["attn_tp"]),
            str(d["address"]),
            pools,
            int(d.get("stage", 0)),
        )


@dataclass(frozen=True)
class InstanceDescriptor:
    """A whole instance: the model it serves and every rank, in (dp_rank, stage, attn_rank)
    order."""

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
        """A DP group's ranks over every stage; a rank's index here is its slot in routes."""
        return [r for r in self.ranks if r.dp_rank == dp_rank]

    def stage_layers(self, pool: int) -> list[tuple[int, int]]:
        """Per stage, the layers [first, stop) its ranks hold of pool `pool`."""
        return stage_layers(self.group(0), pool)


def stage_layers(group: list[RankDescriptor], pool: int) -> list[tuple[int, int]]:
    """Per stage of a DP group's ranks, the layers of pool `pool` its ranks hold ((0, 0) on a
    stage without that pool: a draft's lives on the last stage only)."""
    firsts = [r for r in group if r.attn_rank == 0]
    return [r.pools[pool].layers if pool < len(r.pools) else (0, 0) for r in firsts]


def all_pools(ranks: list[RankDescriptor]) -> list[PoolDescriptor]:
    """The pools of the rank that holds every kind of them (a last stage holds the draft's)."""
    return max(ranks, key=lambda r: len(r.pools)).pools


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
    mine, theirs = all_pools(local.ranks), all_pools(remote.ranks)
    if [p.name for p in mine] != [p.name for p in theirs]:
        differ("KV pools", [p.name for p in mine], [p.name for p in theirs])
    for a, b in zip(mine, theirs):
        for attr in ("order", "kind", "total_layers", "page_size", "dtype", "total_kv_heads"):
            if getattr(a, attr) != getattr(b, attr):
                differ(f"{a.name} pool {attr}", getattr(a, attr), getattr(b, attr))
        if a.per_head_shapes() != b.per_head_shapes():
            differ(f"{a.name} pool layout", a.token_shapes, b.token_shapes)
    for i, pool in enumerate(mine):
        stages = (local.stage_layers(i), remote.stage_layers(i))
        for held in stages:
            layers = [layer for first, stop in held for layer in range(first, stop)]
            if layers != list(range(pool.total_layers)):
                raise IncompatiblePeer(
                    f"incompatible {remote_role} peer: the {pool.name} pool's layers per "
                    f"pipeline stage do not cover the model's {pool.total_layers} layers once "
                    f"({local_role}: {stages[0]}, {remote_role}: {stages[1]})"
                )
