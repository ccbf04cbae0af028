"""The transport protocol: how bytes move between ranks, behind one interface.

A transport serves one rank. Per minibatch the runtime calls ``begin_step`` (publish this rank's
parameter shards as the new version, expose fresh gradient accumulators), then any number of
point-to-point ``gather``/``scatter_accumulate`` (ODC) or collective ``all_gather``/
``reduce_scatter`` (FSDP baseline), then ``flush`` (point-to-point: wait until every push into
this rank's accumulators has landed), then exactly one ``sync`` (the global all-reduce).
``fetch_add(counter, n)`` atomically adds to one of many integer counters shared by the whole
world and fresh every step (work stealing hands out work through them).

Semantics every implementation keeps (DESIGN.md):
- a gather during step t returns exactly the shards the owners published for step t
  (version counters, never extra barriers);
- concurrent scatter-accumulates into one owner never lose an update;
- a dead or stuck peer surfaces as ``TransportError`` within ``timeout`` seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

import torch

from odcfn.sharding import Layout, Mesh

__all__ = ["Counters", "Done", "Handle", "Transport", "TransportError", "all_reduce_flat"]


class TransportError(RuntimeError):
    """A peer died, timed out or broke the protocol."""


class Handle(Protocol):
    def wait(self) -> None: ...


class Done:
    """A handle for work that completed synchronously."""

    def wait(self) -> None:
        return None


def all_reduce_flat(grads: Mapping[str, torch.Tensor], reduce: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Sum ``grads`` in place over a group through one flat buffer (names sorted, so every rank
    lays it out alike): ``reduce`` takes the flat tensor and returns the group's sum. Returns
    the bytes moved."""
    names = sorted(grads)
    flat = torch.cat([grads[n].reshape(-1) for n in names])
    total = reduce(flat)
    for n, piece in zip(names, total.split([grads[n].numel() for n in names])):
        grads[n].copy_(piece.view_as(grads[n]))
    return flat.numel() * flat.element_size()


@dataclass
class Counters:
    """What a transport did; tests assert on these (e.g. exactly one sync per ODC step)."""

    syncs: int = 0
    collectives: int = 0
    gathers: int = 0
    scatters: int = 0
    gather_bytes: int = 0
    scatter_bytes: int = 0
    collective_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __sub__(self, other: Counters) -> Counters:
        return Counters(**{k: v - getattr(other, k) for k, v in asdict(self).items()})

    def copy(self) -> Counters:
        return Counters(**asdict(self))


@runtime_checkable
class Transport(Protocol):
    mesh: Mesh
    counters: Counters

    def begin_step(
        self, layout: Layout, shards: Mapping[str, torch.Tensor], compute_dtype: torch.dtype
    ) -> None:
        """Publish this rank's parameter shards (cast to ``compute_dtype``, the dtype gathers
        deliver) as the next version, and expose zeroed fp32 gradient accumulators for it."""

    def gather(self, unit: str, out: torch.Tensor) -> Handle:
        """Fill ``out`` (padded full flat params of ``unit``) from the shard group's owners."""

    def scatter_accumulate(self, unit: str, grad: torch.Tensor) -> Handle:
        """Add each owner's slice of ``grad`` (padded full flat) into that owner's accumulator."""

    def all_gather(self, unit: str, out: torch.Tensor) -> None:
        """Collective version of ``gather``: every rank of the shard group calls it in order."""

    def reduce_scatter(self, unit: str, grad: torch.Tensor) -> None:
        """Collective version of ``scatter_accumulate``."""

    def flush(self) -> None:
        """Wait until this rank's pushes have landed and every peer's pushes into this rank's
        accumulators have landed (point-to-point completion, not a global barrier)."""

    def replica_all_reduce(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Hybrid sharding: sum gradient shards over the replica group, in place."""

    def sync(self, stats: torch.Tensor) -> torch.Tensor:
        """THE global sync of the minibatch: all-reduce (sum) a small fp64 stats vector."""

    def grad_shards(self) -> dict[str, torch.Tensor]:
        """This rank's accumulated gradient shards for the current step (valid after flush)."""

    def fetch_add(self, counter: int, n: int = 1) -> int:
        """Atomically add ``n`` (may be 0 or negative) to shared integer counter number ``counter``
        and return its value before the add. Counters are shared by all ranks of the world and are
        zero at the start of every step (fresh after each ``begin_step``); ``n=0`` reads one."""

    def close(self) -> None: ...
