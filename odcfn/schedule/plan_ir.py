"""The plan IR: the steps of one rank's program for one minibatch, and the ``Plan`` that holds
them (a tuple of frozen steps). ``odcfn.schedule.plan`` compiles plans and re-exports these names.

ODC mode: each rank runs its own microbatches (counts may differ) with point-to-point
``Gather``/``ScatterAccumulate`` and meets the others only at the final ``Sync``.
Collective mode (the FSDP baseline): ``AllGather``/``ReduceScatter`` that every rank in the shard
group issues in the same order, so ranks with fewer microbatches run empty ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

__all__ = [
    "AllGather",
    "Assignment",
    "Backward",
    "COLLECTIVE_STEPS",
    "Comm",
    "Forward",
    "Gather",
    "Plan",
    "ReduceScatter",
    "Release",
    "Reshard",
    "ScatterAccumulate",
    "Step",
    "Sync",
]

Comm = Literal["odc", "collective"]
# rank -> ordered microbatches -> sample indices into the minibatch
Assignment = tuple[tuple[tuple[int, ...], ...], ...]


@dataclass(frozen=True)
class Gather:
    """Pull the unit's full parameters from their owners (one-sided; owners do nothing).

    ``group`` > 0 (hierarchical shards, ``ScheduleOptions.reshard_after_forward=k``): pull them
    instead from the secondary shards of this rank's ``group``-rank group (``Reshard``), so the
    transfer never leaves the group (one node on real machines)."""

    unit: str
    group: int = 0


@dataclass(frozen=True)
class AllGather:
    """Collective all-gather of the unit's parameters over the shard group."""

    unit: str


@dataclass(frozen=True)
class Forward:
    unit: str
    mb: int
    remat: bool = False  # keep only the input; recompute the unit inside Backward
    uses: tuple[str, ...] = ()  # other units whose gathered parameters it reads (tied weights)
    # > 0: a routed gather inside the step (a mixture of experts, ODC): after the unit's router
    # has run, only the experts its tokens chose are gathered, at most this many at once, each
    # group released when its tokens are done (the set is decided at run time)
    routed: int = 0


@dataclass(frozen=True)
class Backward:
    unit: str
    mb: int
    uses: tuple[str, ...] = ()  # their gradient from this use adds to their own backward's
    # > 0: the used experts re-gathered in groups of at most this many, and each one's gradient
    # scatter-accumulated into its owners as soon as it is complete (unused experts: no bytes)
    routed: int = 0


@dataclass(frozen=True)
class ScatterAccumulate:
    """Push each slice of the unit's gradient into its owner's fp32 accumulator."""

    unit: str


@dataclass(frozen=True)
class ReduceScatter:
    """Collective reduce-scatter of the unit's gradient into this rank's accumulator."""

    unit: str


@dataclass(frozen=True)
class Release:
    """Free the unit's gathered parameters (its buffer's storage)."""

    unit: str


@dataclass(frozen=True)
class Reshard:
    """Free the unit's gathered parameters but keep this rank's ``1/group`` slice of them as its
    secondary shard, readable by the peers of its ``group``-rank group until the Sync (the
    parameters do not change inside a minibatch, so it is built once per minibatch)."""

    unit: str
    group: int


@dataclass(frozen=True)
class Sync:
    """The one global synchronisation of the minibatch (loss, token count, grad-norm^2)."""


Step = Union[Gather, AllGather, Forward, Backward, ScatterAccumulate, ReduceScatter, Release, Reshard, Sync]
COLLECTIVE_STEPS = (AllGather, ReduceScatter)


@dataclass(frozen=True)
class Plan:
    rank: int
    comm: Comm
    units: tuple[str, ...]
    microbatches: tuple[tuple[int, ...], ...]  # sample ids of each microbatch (may be empty)
    steps: tuple[Step, ...]

    def count(self, kind: type) -> int:
        return sum(isinstance(s, kind) for s in self.steps)

    @property
    def num_collectives(self) -> int:
        return sum(isinstance(s, COLLECTIVE_STEPS) for s in self.steps)

    def __str__(self) -> str:
        mbs = " ".join(f"mb{i}={list(m)}" for i, m in enumerate(self.microbatches)) or "none"
        lines = [
            f"Plan(rank={self.rank}, comm={self.comm}, {len(self.microbatches)} microbatches: "
            f"{mbs}, {len(self.steps)} steps)"
        ]
        for i, s in enumerate(self.steps):
            args = []
            if hasattr(s, "unit"):
                args.append(s.unit)
            if hasattr(s, "mb"):
                args.append(f"mb{s.mb}")
            if getattr(s, "remat", False):
                args.append("remat")
            if getattr(s, "uses", ()):
                args.append("uses " + ",".join(s.uses))
            if getattr(s, "group", 0):
                args.append(
                    f"group {s.group}: secondary shard"
                    if isinstance(s, Reshard)
                    else f"from the {s.group}-rank group's secondary shards"
                )
            if getattr(s, "routed", 0):
                args.append(f"routed gather: chosen experts, <={s.routed} at once")
            lines.append(f"  {i:4d}  {type(s).__name__:<18}{' '.join(args)}".rstrip())
        return "\n".join(lines)
