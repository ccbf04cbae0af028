"""Where ranks are: world size, this rank, ranks per node, and the two groups derived from them.

Full sharding: one shard group (all ranks). Hybrid sharding: a shard group per node (parameters
sharded inside the node) and a replica group per local rank (the same shard replicated across
nodes); gradients are all-reduced over the replica group once per minibatch, inside the sync.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from odcfn._check import check_int

__all__ = ["Mesh", "Sharding"]

Sharding = Literal["full", "hybrid"]


@dataclass(frozen=True)
class Mesh:
    world_size: int
    rank: int = 0
    ranks_per_node: int | None = None  # None: all ranks on one node
    sharding: Sharding = "full"

    def __post_init__(self) -> None:
        for name in ("world_size", "rank", "ranks_per_node"):
            v = getattr(self, name)
            if v is None and name == "ranks_per_node":
                continue
            check_int(v, f"Mesh.{name}")
        if self.world_size < 1:
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
        """Read the launcher's environment: WORLD_SIZE and RANK, and the ranks per node from
        torchrun's LOCAL_WORLD_SIZE or, absent, Ray's RAY_LOCAL_WORLD_SIZE (all on one node if
        neither is set). The local rank (LOCAL_RANK / RAY_LOCAL_RANK), when set, must agree."""
        env = os.environ
        try:
            world, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
        except KeyError as e:
            raise RuntimeError(
                f"Mesh.from_env: {e.args[0]} is not set (run under torchrun, Ray or odcfn.launch)"
            ) from None
        local_size = next((k for k in ("LOCAL_WORLD_SIZE", "RAY_LOCAL_WORLD_SIZE") if k in env), None)
        mesh = cls(world, rank, _env_int(local_size) if local_size else None, sharding)
        local_rank = next((k for k in ("LOCAL_RANK", "RAY_LOCAL_RANK") if k in env), None)
        if local_rank is not None and local_size is not None and _env_int(local_rank) != mesh.local_rank:
            raise ValueError(
                f"Mesh.from_env: {local_rank}={env[local_rank]} but RANK={rank} with {local_size}="
                f"{env[local_size]} puts this rank at local rank {mesh.local_rank} (ranks must fill "
                "nodes in order)"
            )
        return mesh

    def check_env(self) -> None:
        """Before a rendezvous: a launcher's WORLD_SIZE/RANK, when set, must be this mesh's
        (a mismatch would otherwise wait for ranks that never come, until the store timeout)."""
        for name, mine in (("WORLD_SIZE", self.world_size), ("RANK", self.rank)):
            if name in os.environ and _env_int(name) != mine:
                raise ValueError(
                    f"{self} does not match the launcher's environment: {name}={os.environ[name]}, "
                    f"the mesh has {name.lower()}={mine}"
                )

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

    def secondary_group(self, size: int) -> tuple[int, ...]:
        """Hierarchical shards (``ScheduleOptions.reshard_after_forward=size``): the ``size``
        consecutive ranks of this rank's shard group that hold one secondary copy together
        (one node on real machines); the member at position j holds slice j."""
        n = self.shard_count
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or n % size:
            raise ValueError(
                f"ScheduleOptions.reshard_after_forward={size!r} does not divide the shard group's "
                f"size {n} (the world size under full sharding)"
            )
        start = self.shard_index - self.shard_index % size
        return self.shard_group[start : start + size]

    def owner_of(self, shard_index: int) -> int:
        """The global rank in this rank's shard group that owns ``shard_index``."""
        return self.shard_group[shard_index]


def _env_int(name: str) -> int:
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"the environment variable {name}={text!r} is not an integer") from None
