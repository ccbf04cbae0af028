"""The transport protocol: how bytes move between ranks, in two halves.

**Point-to-point** (what ODC needs; each transport implements it its own way). A transport
serves one rank. Per minibatch the runtime calls ``begin_step`` (publish this rank's parameter
shards as the new version, expose fresh gradient accumulators), then any number of one-sided
``gather`` / ``scatter_accumulate``, then ``flush`` (wait until every push into this rank's
accumulators has landed). ``fetch_add(counter, n)`` atomically adds to one of ``max_counters``
integer counters shared by the world and fresh every step (work stealing hands out work
through them).

**Collectives** (the FSDP baseline, the hybrid replica reduce and THE one ``sync``): a
``Collectives`` object does group collectives on tensors. There is one torch.distributed
implementation (``collective.TorchCollectives``: gloo on CPU, nccl on GPU) that every
multi-process transport uses, and one for in-process threads (``local.LocalCollectives``).
A transport holds one as ``transport.collectives``; the unit-level steps the runtime calls
(``all_gather(unit)``, ``reduce_scatter(unit)``, ``replica_all_reduce``, ``sync``) are written
once, in ``StepCollectives``, on top of it and the transport's own buffers.

Semantics every implementation keeps (DESIGN.md; tests/transport/test_transport_conformance.py checks
them on every transport):
- a gather during step t returns exactly the shards the owners published for step t
  (version counters, never extra barriers);
- concurrent scatter-accumulates into one owner never lose an update;
- a dead or stuck peer surfaces as ``TransportError`` within ``timeout`` seconds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from odcfn.kernels.quant import Format, WireState, unpublish
from odcfn.sharding import Layout, Mesh

__all__ = [
    "MAX_COUNTERS",
    "Collectives",
    "Counters",
    "Done",
    "Handle",
    "PointToPoint",
    "StepCollectives",
    "Transport",
    "TransportError",
    "all_reduce_flat",
    "check_counter",
    "mesh_groups",
    "supports_odc",
    "world_group",
]

MAX_COUNTERS = 1 << 16  # fetch_add counters every transport serves (work stealing's bound)


class TransportError(RuntimeError):
    """A peer died, timed out or broke the protocol."""


class Handle(Protocol):
    def wait(self) -> None: ...


class Done:
    """A handle for work that completed synchronously."""

    def wait(self) -> None:
        return None


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
class Collectives(Protocol):
    """Group collectives on tensors. ``group`` is a tuple of global ranks, always one of the
    mesh's shard groups, replica groups or the whole world; every member calls in the same
    order. ``calls`` counts the calls by op name: what went over the wire."""

    calls: Counter[str]

    def all_gather(self, group: tuple[int, ...], mine: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` <- the members' ``mine``, concatenated in group order."""

    def reduce_scatter(self, group: tuple[int, ...], grad: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` <- this member's block of the sum of the members' ``grad``."""

    def all_reduce(self, group: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
        """The sum of the members' ``x`` (a new tensor on ``x``'s device)."""

    def barrier(self) -> None:
        """Every rank of the world has arrived."""

    def close(self) -> None: ...


@runtime_checkable
class PointToPoint(Protocol):
    """The half ODC needs: one-sided, version-gated, no global barrier."""

    mesh: Mesh
    counters: Counters
    max_counters: int

    def begin_step(
        self, layout: Layout, shards: Mapping[str, torch.Tensor], compute_dtype: torch.dtype
    ) -> None:
        """Publish this rank's parameter shards (cast to ``compute_dtype``, the dtype gathers
        deliver) as the next version, and expose zeroed fp32 gradient accumulators for it."""

    def gather(self, unit: str, out: torch.Tensor) -> Handle:
        """Fill ``out`` (padded full flat params of ``unit``) from the shard group's owners."""

    def scatter_accumulate(self, unit: str, grad: torch.Tensor) -> Handle:
        """Add each owner's slice of ``grad`` (padded full flat) into that owner's accumulator."""

    def flush(self) -> None:
        """Wait until this rank's pushes have landed and every peer's pushes into this rank's
        accumulators have landed (point-to-point completion, not a global barrier)."""

    def grad_shards(self) -> dict[str, torch.Tensor]:
        """This rank's accumulated gradient shards for the current step (valid after flush)."""

    def fetch_add(self, counter: int, n: int = 1) -> int:
        """Atomically add ``n`` (may be 0 or negative) to shared integer counter ``counter``
        (``0 <= counter < max_counters``, else ``ValueError``) and return its value before the
        add. Counters are shared by all ranks of the world and are zero at the start of every
        step (fresh after each ``begin_step``); ``n=0`` reads one."""

    def close(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """What the runtime drives: the per-step lifecycle, the unit-level collective steps
    (``StepCollectives``) and, for ``comm="odc"``, the ``PointToPoint`` ops as well."""

    mesh: Mesh
    counters: Counters
    collectives: Collectives

    def begin_step(
        self, layout: Layout, shards: Mapping[str, torch.Tensor], compute_dtype: torch.dtype
    ) -> None: ...
    def all_gather(self, unit: str, out: torch.Tensor) -> None: ...
    def reduce_scatter(self, unit: str, grad: torch.Tensor) -> None: ...
    def flush(self) -> None: ...
    def replica_all_reduce(self, grads: Mapping[str, torch.Tensor]) -> None: ...
    def sync(self, stats: torch.Tensor) -> torch.Tensor: ...
    def grad_shards(self) -> dict[str, torch.Tensor]: ...
    def close(self) -> None: ...


def supports_odc(transport: Any) -> bool:
    """Whether ``transport`` has the point-to-point half (``comm="odc"``, work stealing)."""
    return all(callable(getattr(transport, op, None)) for op in ("gather", "scatter_accumulate", "fetch_add"))


def check_counter(counter: int, limit: int, who: str) -> None:
    if not isinstance(counter, int) or not 0 <= counter < limit:
        raise ValueError(
            f"counter {counter!r} is out of range: {who} has max_counters={limit} "
            f"(counters 0..{limit - 1})"
        )


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


class StepCollectives:
    """The unit-level collective steps, written once for every transport.

    A transport mixes this in and provides ``mesh``, ``counters``, ``collectives`` and two
    buffer accessors: ``_published(unit)`` (this rank's shard in the compute dtype, valid after
    ``begin_step``) and ``_accumulator(unit)`` (this rank's fp32 gradient accumulator).
    ``_accumulate(acc, x)`` adds a received piece (a transport may override it: the arena
    transports add through their fabric's kernel, under the lock their drain thread shares)."""

    mesh: Mesh
    counters: Counters
    collectives: Collectives

    def _published(self, unit: str) -> torch.Tensor:
        raise NotImplementedError

    def _accumulator(self, unit: str) -> torch.Tensor:
        raise NotImplementedError

    def _accumulate(self, acc: torch.Tensor, x: torch.Tensor) -> None:
        acc.add_(x)

    def _gather_format(self) -> Format | None:
        """The format this step's shards are published in (``begin_step(wire=)``; None: the
        compute dtype)."""
        state = getattr(self, "_wire", None)
        return None if state is None else state.wire.gather_format

    def wire_state(self) -> WireState | None:
        """This rank's side of the wire formats (``begin_step(wire=)``): the error-feedback
        residuals its pushes carry into the next ones, which a checkpoint saves and restores
        (``odcfn.checkpoint.feedback``). None for a transport without wire formats."""
        return getattr(self, "_wire", None)

    def all_gather(self, unit: str, out: torch.Tensor) -> None:
        """Collective version of ``gather``: every rank of the shard group calls it in order. A
        quantized publication is all-gathered as bytes and each member's piece decoded."""
        group, mine, fmt = self.mesh.shard_group, self._published(unit), self._gather_format()
        if fmt is None:
            self.collectives.all_gather(group, mine, out)
            moved = out.numel() * out.element_size()
        else:
            raw = torch.empty(len(group) * mine.numel(), dtype=torch.uint8, device=mine.device)
            self.collectives.all_gather(group, mine, raw)
            k, b = out.numel() // len(group), mine.numel()
            for i in range(len(group)):
                unpublish(raw[i * b : (i + 1) * b], out[i * k : (i + 1) * k], fmt)
            moved = raw.numel()
        self.counters.collectives += 1
        self.counters.collective_bytes += moved

    def reduce_scatter(self, unit: str, grad: torch.Tensor) -> None:
        """Collective version of ``scatter_accumulate`` (summed in fp32, like the accumulators)."""
        acc = self._accumulator(unit)
        piece = torch.empty(acc.numel(), dtype=torch.float32, device=acc.device)
        self.collectives.reduce_scatter(self.mesh.shard_group, grad.to(torch.float32), piece)
        self._accumulate(acc, piece)
        self.counters.collectives += 1
        self.counters.collective_bytes += grad.numel() * grad.element_size()

    def replica_all_reduce(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Hybrid sharding: sum gradient shards over the replica group, in place."""
        group = self.mesh.replica_group
        if len(group) == 1:
            return
        moved = all_reduce_flat(grads, lambda flat: self.collectives.all_reduce(group, flat))
        self.counters.collectives += 1
        self.counters.collective_bytes += moved

    def sync(self, stats: torch.Tensor) -> torch.Tensor:
        """THE global sync of the minibatch: all-reduce (sum) a small fp64 stats vector."""
        out = self.collectives.all_reduce(world_group(self.mesh), stats)
        self.counters.syncs += 1
        return out


def world_group(mesh: Mesh) -> tuple[int, ...]:
    return tuple(range(mesh.world_size))


def mesh_groups(mesh: Mesh) -> Sequence[tuple[int, ...]]:
    """Every distinct shard and replica group with more than one member, in one order that all
    ranks agree on (process-group creation is collective and must happen in the same order)."""
    seen: dict[tuple[int, ...], None] = {}
    for r in range(mesh.world_size):
        m = mesh.with_rank(r)
        for g in (m.shard_group, m.replica_group):
            if len(g) > 1:
                seen.setdefault(g, None)
    return list(seen)


_NORM_SPAN = 1 << 22  # elements per float64 piece of a sum of squares (32 MiB)


def sum_squares(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The float64 sum of squares of ``tensors`` (a gradient's norm²), in spans: a float64 copy
    of a whole vocabulary-sized shard would be big."""
    total = None
    for g in tensors:
        for piece in g.reshape(-1).split(_NORM_SPAN):
            part = piece.double().square().sum()
            total = part if total is None else total + part
    return torch.zeros((), dtype=torch.float64) if total is None else total
