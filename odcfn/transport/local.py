"""In-process transport: W ranks as W threads of one process, sharing memory directly.

Used by the core tests and notebooks. It keeps every semantic of the real transports: one-sided
gathers gated by per-rank version counters, scatter-accumulates under a per-owner lock (no lost
updates), point-to-point completion counters for ``flush``, exactly one global all-reduce in
``sync``, ``fetch_add`` counters fresh every step, and timeouts instead of hangs.
``LocalCollectives`` is the threads' ``Collectives``; ``run_local(fn, W, transport=factory)``
runs any transport (e.g. the CUDA-IPC fabric on CPU) on W threads of one ``LocalWorld``.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch

from odcfn.kernels.quant import Wire, WireState, publish, unpublish
from odcfn.sharding import Layout, Mesh
from odcfn.transport.base import (
    MAX_COUNTERS,
    Counters,
    Done,
    Handle,
    StepCollectives,
    TransportError,
    check_counter,
)
from odcfn.transport.heartbeat import Patience
from odcfn.transport.versions import StaleLocal, reuse_view

__all__ = ["LocalCollectives", "LocalTransport", "LocalWorld", "run_local"]

T = TypeVar("T")


class LocalWorld:
    """Shared state of W in-process ranks. ``world.transport(r)`` is rank r's transport."""

    def __init__(
        self,
        world_size: int,
        *,
        ranks_per_node: int | None = None,
        sharding: str = "full",
        timeout: float = 60.0,
    ) -> None:
        self.mesh = Mesh(world_size, 0, ranks_per_node, sharding)  # validates
        self.world_size = world_size
        self.timeout = timeout
        self.cond = threading.Condition()
        self.version = [0] * world_size
        self.published: list[dict[str, torch.Tensor]] = [{} for _ in range(world_size)]
        self.acc: list[dict[str, torch.Tensor]] = [{} for _ in range(world_size)]
        self.acc_locks = [threading.Lock() for _ in range(world_size)]
        self.done: dict[tuple[int, int], int] = defaultdict(int)  # (owner, step) -> pushers done
        self.shared: dict[tuple[int, int], int] = {}  # (step, counter) -> value, for fetch_add
        self.aborted: str | None = None
        self.beats = [0] * world_size  # each rank's progress (odcfn.transport.heartbeat)
        self._arrived: dict[tuple[int, ...], list[int]] = {}  # group -> exchanges entered per member
        self._groups: dict[tuple[int, ...], tuple[threading.Barrier, list[Any]]] = {}
        self._groups_lock = threading.Lock()
        self._store: Any = None
        # hpZ: rank -> unit -> (step, this rank's slice of the unit's group shard)
        self.secondary: list[dict[str, tuple[int, torch.Tensor]]] = [{} for _ in range(world_size)]
        self.versions: Any = None  # the VersionBoard of bounded staleness (odcfn.transport.versions)

    def transport(self, rank: int) -> LocalTransport:
        return LocalTransport(self, self.mesh.with_rank(rank))

    @property
    def store(self) -> Any:
        """A torch.distributed ``HashStore`` shared by the ranks (rendezvous and ``fetch_add``
        of the arena transports when they run on threads)."""
        with self._groups_lock:
            if self._store is None:
                from torch.distributed import HashStore

                self._store = HashStore()
                self._store.set_timeout(timedelta(seconds=self.timeout))
            return self._store

    def abort(self, why: str) -> None:
        with self.cond:
            self.aborted = self.aborted or why
            self.cond.notify_all()
        with self._groups_lock:
            for barrier, _ in self._groups.values():
                barrier.abort()

    def wait_for(self, pred: Callable[[], bool], what: str, peers: Sequence[int] | None = None) -> None:
        """Wait for ``pred``; the timeout counts from the last progress of ``peers`` (default:
        every rank), so a busy peer keeps us waiting and a stuck one does not."""
        ranks = range(self.world_size) if peers is None else peers
        patience = Patience(self.timeout, what, lambda: sum(self.beats[p] for p in ranks))
        with self.cond:
            while True:
                ok = self.cond.wait_for(lambda: pred() or self.aborted is not None, min(1.0, self.timeout))
                if self.aborted is not None:
                    raise TransportError(f"aborted while waiting for {what}: {self.aborted}")
                if ok:
                    return
                if patience.expired():
                    raise TransportError(
                        f"timed out after {self.timeout}s waiting for {what} (dead or stuck peer? "
                        f"no progress from it for {self.timeout}s)"
                    )

    def exchange(self, group: Sequence[int], rank: int, value: Any) -> list[Any]:
        """Every member of ``group`` contributes ``value``; all get the list in group order."""
        group = tuple(group)
        with self._groups_lock:
            if group not in self._groups:
                self._groups[group] = (threading.Barrier(len(group)), [None] * len(group))
            barrier, slots = self._groups[group]
        slots[group.index(rank)] = value
        # meet first where a busy peer can be told from a stuck one; the barrier then finds all
        with self.cond:
            counts = self._arrived.setdefault(group, [0] * len(group))
            counts[group.index(rank)] += 1
            n = counts[group.index(rank)]
            self.cond.notify_all()
        self.wait_for(lambda: min(counts) >= n, f"ranks {list(group)} at a collective (rank {rank})", group)
        try:
            barrier.wait(self.timeout)
            out = list(slots)
            barrier.wait(self.timeout)  # nobody overwrites a slot before all have read
        except threading.BrokenBarrierError:
            raise TransportError(
                f"rank {rank}: collective over ranks {list(group)} broke: "
                f"{self.aborted or f'a peer did not arrive within {self.timeout}s'}"
            ) from None
        return out


class LocalCollectives:
    """``Collectives`` between the in-process ranks (threads) of a ``LocalWorld``."""

    def __init__(self, world: LocalWorld, rank: int) -> None:
        self.world, self.rank = world, rank
        self.calls: Counter[str] = Counter()

    def all_gather(self, group: tuple[int, ...], mine: torch.Tensor, out: torch.Tensor) -> None:
        torch.cat(self.world.exchange(group, self.rank, mine.detach().clone()), out=out)
        self.calls["all_gather"] += 1

    def reduce_scatter(self, group: tuple[int, ...], grad: torch.Tensor, out: torch.Tensor) -> None:
        parts = self.world.exchange(group, self.rank, grad.detach().clone())
        i, n = group.index(self.rank), out.numel()
        out.copy_(torch.stack([p[i * n : (i + 1) * n] for p in parts]).sum(0))  # group order
        self.calls["reduce_scatter"] += 1

    def all_reduce(self, group: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
        out = torch.stack(self.world.exchange(group, self.rank, x.detach().clone())).sum(0)
        self.calls["all_reduce"] += 1
        return out

    def barrier(self) -> None:
        self.world.exchange(range(self.world.world_size), self.rank, None)
        self.calls["barrier"] += 1

    def close(self) -> None:
        return None


class LocalTransport(StepCollectives):
    max_counters = MAX_COUNTERS

    def __init__(self, world: LocalWorld, mesh: Mesh) -> None:
        self.world = world
        self.mesh = mesh
        self.collectives = LocalCollectives(world, mesh.rank)
        self.counters = Counters()
        self.step = 0
        self.layout: Layout | None = None
        self._stale: StaleLocal | None = None
        # gathered bytes by source rank: primary shards, and hpZ group shards (gather_group)
        self.peer_bytes: Counter[int] = Counter()
        self.group_bytes: Counter[int] = Counter()
        self._wire = WireState()

    ordered_versions = True  # versions(..., ordered=True): deterministic accumulation (versions_det)
    supports_wire = True  # begin_step(..., wire=): block-quantized gathers and pushes

    def versions(self, ring: int, start: int, ordered: bool = False) -> StaleLocal:
        """This rank's bounded-staleness side (τ >= 1, ``odcfn.transport.versions``), made on first
        use and kept for the transport's life: it holds the owner's version ring. ``ordered``:
        each owner sums a step's pushes in rank order (``odcfn.transport.versions_det``)."""
        self._stale = reuse_view(self._stale, ring, ordered, lambda: StaleLocal(self, ring, start, ordered))
        return self._stale

    # --- per step ---------------------------------------------------------------------------
    def begin_step(
        self,
        layout: Layout,
        shards: Mapping[str, torch.Tensor],
        compute_dtype: torch.dtype,
        wire: Wire | None = None,
    ) -> None:
        w, r = self.world, self.mesh.rank
        self.layout = layout
        fmt = self._wire.use(wire).wire.gather_format
        self.step += 1
        # Zero the accumulators *before* publishing: a peer pushes into a unit only after it
        # gathered that unit from us at this step's version.
        for u in layout.units:
            acc = w.acc[r].get(u.name)
            if u.frozen:  # never scattered into: no accumulator
                w.acc[r].pop(u.name, None)
            elif acc is None or acc.numel() != u.shard_size:
                w.acc[r][u.name] = torch.zeros(u.shard_size, dtype=torch.float32)
            else:
                acc.zero_()
            pub = publish(w.published[r].get(u.name), shards[u.name].detach(), compute_dtype, fmt)
            w.published[r][u.name] = pub
        with w.cond:
            w.version[r] = self.step
            w.cond.notify_all()
            # a rank starting step t means every rank is past step t-2's sync: drop those counters
            for key in [k for k in w.shared if k[0] < self.step - 1]:
                del w.shared[key]

    def _owners(self) -> tuple[int, ...]:
        return self.mesh.shard_group

    def gather(self, unit: str, out: torch.Tensor) -> Handle:
        size = self.layout[unit].shard_size
        fmt = self._wire.wire.gather_format
        for i, owner in enumerate(self._owners()):
            step = self.step
            self.world.wait_for(
                lambda o=owner, s=step: self.world.version[o] >= s,
                f"rank {owner} to publish step {step} (gather of {unit!r} by rank {self.mesh.rank})",
            )
            src = self.world.published[owner][unit]
            unpublish(src, out[i * size : (i + 1) * size], fmt)
            if owner != self.mesh.rank:
                self.counters.gather_bytes += src.numel() * src.element_size()
                self.peer_bytes[owner] += src.numel() * src.element_size()
        self.counters.gathers += 1
        return Done()

    # --- hierarchical shards (hpZ) ------------------------------------------------------------
    def publish_secondary(self, unit: str, full: torch.Tensor, group: int) -> None:
        """Keep this rank's slice of ``full`` (the unit's gathered copy) as its share of the
        ``group``-rank group shard for this step; a later call in the same step is a no-op (the
        parameters do not change inside a minibatch, and peers may be reading it)."""
        w, r = self.world, self.mesh.rank
        held = w.secondary[r].get(unit)
        if held is not None and held[0] == self.step:
            return
        members = self.mesh.secondary_group(group)
        n = full.numel() // group
        j = members.index(r)
        piece = full[j * n : (j + 1) * n].detach().clone()
        with w.cond:
            w.secondary[r][unit] = (self.step, piece)
            w.cond.notify_all()

    def gather_group(self, unit: str, out: torch.Tensor, group: int) -> Handle:
        """Fill ``out`` from the secondary shards of this rank's ``group``-rank group only."""
        w, step = self.world, self.step
        members = self.mesh.secondary_group(group)
        n = out.numel() // group
        for j, peer in enumerate(members):
            w.wait_for(
                lambda p=peer: w.secondary[p].get(unit, (0,))[0] >= step,
                f"rank {peer} to build its group shard of {unit!r} at step {step} (rank {self.mesh.rank})",
                members,
            )
            src = w.secondary[peer][unit][1]
            out[j * n : (j + 1) * n].copy_(src)
            if peer != self.mesh.rank:
                self.counters.gather_bytes += src.numel() * src.element_size()
                self.group_bytes[peer] += src.numel() * src.element_size()
        self.counters.gathers += 1
        return Done()

    def scatter_accumulate(self, unit: str, grad: torch.Tensor) -> Handle:
        size = self.layout[unit].shard_size
        owners = self._owners()
        grad, moved = self._wire.push(unit, grad, len(owners))  # what travels, as the owner adds it
        for i, owner in enumerate(owners):
            piece = grad[i * size : (i + 1) * size]
            with self.world.acc_locks[owner]:
                self.world.acc[owner][unit].add_(piece)
            if owner != self.mesh.rank:
                self.counters.scatter_bytes += moved[i]
        self.counters.scatters += 1
        return Done()

    def _published(self, unit: str) -> torch.Tensor:
        return self.world.published[self.mesh.rank][unit]

    def _accumulator(self, unit: str) -> torch.Tensor:
        return self.world.acc[self.mesh.rank][unit]

    def flush(self) -> None:
        w, r, step = self.world, self.mesh.rank, self.step
        with w.cond:
            for owner in self._owners():
                w.done[(owner, step)] += 1
            w.cond.notify_all()
        n = len(self._owners())
        w.wait_for(lambda: w.done[(r, step)] >= n, f"peers to finish pushing into rank {r} at step {step}")
        with w.cond:
            w.done.pop((r, step - 1), None)

    def grad_shards(self) -> dict[str, torch.Tensor]:
        return self.world.acc[self.mesh.rank]

    def beat(self) -> None:
        """This rank made progress (the executor, after each plan step): see ``wait_for``."""
        self.world.beats[self.mesh.rank] += 1  # only this rank's thread writes its entry

    @property
    def timeout(self) -> float:
        """The world's timeout: how long a wait goes on without progress from the peers."""
        return self.world.timeout

    def peer_progress(self) -> int:
        """The other ranks' summed progress (``beat``s): a wait outside the transport times out
        from its last change (``odcfn.transport.heartbeat.Patience``)."""
        r = self.mesh.rank
        return sum(b for p, b in enumerate(self.world.beats) if p != r)

    def fetch_add(self, counter: int, n: int = 1) -> int:
        check_counter(counter, self.max_counters, "LocalTransport")
        w, step = self.world, self.step
        with w.cond:
            old = w.shared.get((step, counter), 0)
            w.shared[(step, counter)] = old + n
            return old

    def close(self) -> None:
        return None


def run_local(
    fn: Callable[[int, Any], T],
    world_size: int,
    *,
    transport: Callable[[LocalWorld, int], Any] | None = None,
    ranks_per_node: int | None = None,
    sharding: str = "full",
    timeout: float = 60.0,
) -> list[T]:
    """Run ``fn(rank, transport)`` on ``world_size`` in-process ranks (threads); return the
    per-rank results. ``transport(world, rank)`` makes rank ``rank``'s transport on the shared
    ``LocalWorld`` (default ``world.transport(rank)``; the world offers ``mesh``, ``store`` and
    ``LocalCollectives(world, rank)``); each is closed after ``fn`` returns. If any rank raises,
    the others are aborted and the first error re-raised."""
    if transport is not None and not callable(transport):
        raise TypeError(
            "run_local: transport must be a factory (world, rank) -> transport, "
            f"got {type(transport).__name__}"
        )
    if not callable(fn):
        raise TypeError(f"run_local: fn must be callable (rank, transport), got {type(fn).__name__}")
    world = LocalWorld(world_size, ranks_per_node=ranks_per_node, sharding=sharding, timeout=timeout)
    make = transport if transport is not None else LocalWorld.transport
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []

    def body(rank: int) -> None:
        tr = None
        try:
            tr = make(world, rank)
            results[rank] = fn(rank, tr)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append((rank, e))
            world.abort(f"rank {rank} raised {type(e).__name__}: {e}")
        finally:
            if tr is not None:
                tr.close()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = min(errors, key=lambda e: 0 if not isinstance(e[1], TransportError) else 1)
        raise first[1]
    return results
