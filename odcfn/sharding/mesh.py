"""Where ranks are: world size, this rank, ranks per node, and the two groups derived from them.

Full sharding: one shard group (all ranks). Hybrid sharding: a shard group per node (parameters
sharded inside the node) and a replica group per local rank (the same shard replicated across
nodes); gradients are all-reduced over the replica group once per minibatch, inside the sync.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

__all__ = ["Mesh", "Sharding"]

Sharding = Literal["full", "hybrid"]


@dataclass(frozen=True)
class Mesh:
    world_size: int
    rank: int = 0
    ranks_per_node: int | None = None  # None: all ranks on one node
    sharding: Sharding = "full"

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"Mesh.world_size must be a positive int, got {self.world_size!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Mesh.rank={self.rank} is outside [0, {self.world_size})")
        rpn = self.node_size
        if rpn < 1 or self.world_size % rpn:
            raise ValueError(
                f"Mesh.ranks_per_node={self.ranks_per_node} does not divide world_size={self.world_size}"
            )
        if self.sharding not in ("full", "hybrid"):
            raise ValueError(f"Mesh.sharding must be 'full' or 'hybrid', got {self.sharding!r}")

    @classmethod
    def from_env(cls, sharding: Sharding = "full") -> Mesh:
        """Read the torchrun environment (WORLD_SIZE, RANK, LOCAL_WORLD_SIZE)."""
        try:
            world = int(os.environ["WORLD_SIZE"])
            rank = int(os.environ["RANK"])
        except KeyError as e:
            raise RuntimeError(
                f"Mesh.from_env: {e.args[0]} is not set (run under torchrun or odcfn.launch)"
            ) from None
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return cls(world, rank, local, sharding)

    def with_rank(self, rank: int) -> Mesh:
        return Mesh(self.world_size, rank, self.ranks_per_node, self.sharding)

    @property
    def node_size(self) -> int:
        return self.world_size if self.ranks_per_node is None else self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.node_size

    @property
    def node(self) -> int:
        return self.rank // self.node_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.node_size

    # --- groups (tuples of global ranks, ordered) ---------------------------------------
    @property
    def shard_group(self) -> tuple[int, ...]:
        """Ranks that together hold one full copy of the parameters, in shard order."""
        if self.sharding == "full":
            return tuple(range(self.world_size))
        base = self.node * self.node_size
        return tuple(range(base, base + self.node_size))

    @property
    def replica_group(self) -> tuple[int, ...]:
        """Ranks holding the same shard as this rank (just this rank under full sharding)."""
        if self.sharding == "full":
            return (self.rank,)
        return tuple(n * self.node_size + self.local_rank for n in range(self.num_nodes))

    @property
    def shard_count(self) -> int:
        return len(self.shard_group)

    @property
    def shard_index(self) -> int:
        """Which shard this rank owns."""
        return self.shard_group.index(self.rank)

    def owner_of(self, shard_index: int) -> int:
        """The global rank in this rank's shard group that owns ``shard_index``."""
        return self.shard_group[shard_index]
