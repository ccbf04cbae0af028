"""Per-owner parameter versions for bounded staleness (τ >= 1) on in-process ranks (LocalWorld).

The synchronous step (τ = 0) publishes one version per minibatch and meets once in ``sync``.
Here nothing is global:

- **Versions.** Owner ``o`` keeps its last ``R = τ_max + 1`` published versions in a ring
  (``pub[o][v % R]``); version ``v`` is its shards after the updates of steps ``< v``.
- **Gathers.** The first gather of unit ``u`` in minibatch ``j`` pins a version: the newest
  version every owner of ``u`` has published, waiting only while that is ``< j - τ(u)``. Later
  gathers of ``u`` in ``j`` (the backward's re-gather, tied uses) read the same version, so a
  unit's forward and backward always see the same weights. What each gather read is recorded.
- **Pushes** of minibatch ``j`` go into the ring's accumulator slot ``j % R`` of each owner.
- **Completion.** After its last push of ``j`` a rank deposits its stats and bumps a per-owner
  ``done(o, j)`` counter. An owner whose ``done`` count reached its group's size applies step
  ``j`` (the step layer's ``apply`` callback: the optimizer), zeroes the slot and publishes
  ``j + 1``. The thread that completes the step runs it at once (in-process ranks share
  memory: the last pusher applies for the owner, under the owner's lock), so an owner busy
  computing, or between steps, never holds its peers back.

Why the ring is big enough: a reader in minibatch ``j`` pins ``v >= j - τ_max`` and an owner can
publish ``v + R`` only after step ``v + R - 1 >= j`` completed, which needs this reader's
``done(j)``, bumped after its last gather. A read that would race a publish raises (never torn).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from odcfn.sharding import Layout
from odcfn.transport.base import Done, Handle, TransportError, check_counter, sum_squares

# local.py makes the views: its LocalWorld and LocalTransport are typed Any here, never
# imported (local.py imports this module: that would be an import circle)

__all__ = ["StaleLocal", "VersionBoard", "reuse_view"]

Apply = Callable[[int, dict[str, torch.Tensor], torch.Tensor], Mapping[str, torch.Tensor]]
_POLL_S = 0.05  # a waiter re-checks at least this often (its own completions may need applying)


class VersionBoard:
    """What the ranks of one ``LocalWorld`` share under τ >= 1 (guarded by the world's condition,
    so an abort wakes every waiter)."""

    def __init__(self, world: Any, ring: int, start: int, ordered: bool = False) -> None:
        w = world.world_size
        self.ring, self.start, self.ordered = ring, start, ordered
        self.latest = [start - 1] * w  # newest version each owner published (start - 1: none yet)
        self.pub: list[list[dict[str, torch.Tensor]]] = [[{} for _ in range(ring)] for _ in range(w)]
        self.acc: list[list[dict[str, torch.Tensor]]] = [[{} for _ in range(ring)] for _ in range(w)]
        self.acc_locks = [threading.Lock() for _ in range(w)]  # concurrent adds never lose updates
        # ordered (deterministic) mode: [owner][slot][rank] -> {unit: that rank's own sum}, each
        # written by its rank alone and summed in rank order at apply (odcfn.transport.versions_det)
        self.parts: list[list[list[dict[str, torch.Tensor]]]] = (
            [[[{} for _ in range(w)] for _ in range(ring)] for _ in range(w)] if ordered else [])
        self.done: dict[tuple[int, int], int] = defaultdict(int)  # (owner, step) -> pushers done
        self.stats: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)  # step -> rank -> stats
        self.norm2: dict[int, dict[int, float]] = defaultdict(dict)  # step -> owner -> |g_o|^2
        self.shared: dict[tuple[int, int], int] = {}  # (step, counter) -> value, for fetch_add
        self.appliers: list[Apply | None] = [None] * w  # each owner's update (the step layer's)
        self.apply_locks = [threading.Lock() for _ in range(w)]


def reuse_view(view: Any, ring: int, ordered: bool, make: Callable[[], Any]) -> Any:
    """A transport's versions side: made on first use, then kept for the transport's life (it
    holds the owner's version ring), refusing a later config with another ring or another
    ``deterministic`` (rank-order sums)."""
    if view is None:
        return make()
    if view.ORDERED != ordered:
        raise ValueError(
            f"StepConfig.deterministic changed on this transport under staleness: its versions "
            f"were made with deterministic={view.ORDERED}"
        )
    if view.ring != ring:
        raise ValueError(
            f"StepConfig.staleness changed on this transport: it keeps {view.ring} versions, "
            f"the config asks for {ring}"
        )
    return view


def _board(world: Any, ring: int, start: int, ordered: bool = False) -> VersionBoard:
    with world._groups_lock:
        if world.versions is None:
            world.versions = VersionBoard(world, ring, start, ordered)
        b = world.versions
    if b.ordered != ordered:
        raise ValueError(
            "StepConfig.deterministic differs between ranks under StepConfig.staleness: every rank "
            "must use the same value (the owners sum pushes in one order or the other)"
        )
    if b.ring != ring:
        raise ValueError(
            f"StepConfig.staleness differs between ranks: this rank keeps {ring} versions, a peer "
            f"{b.ring} (every rank must use the same staleness)"
        )
    if b.start != start:
        raise ValueError(
            f"ranks started bounded staleness at different steps ({b.start} and {start}): "
            "every rank must pass its TrainState at the same step"
        )
    return b


class StaleLocal:
    """Rank ``r``'s side of the versions; it also serves as the executor's transport for one
    minibatch (``gather``, ``scatter_accumulate``, ``fetch_add``) between ``open`` and
    ``complete``. The owner's ``apply(step, grads, stats)`` (given to ``start`` by the step layer)
    returns its new shards for version ``step + 1``."""

    ORDERED = False  # deterministic accumulation: the subclass in odcfn.transport.versions_det

    def __init__(self, transport: Any, ring: int, start: int) -> None:
        self.world = transport.world
        self.mesh, self.counters = transport.mesh, transport.counters
        self.collectives = transport.collectives
        self.max_counters, self.timeout = transport.max_counters, self.world.timeout
        self.board = _board(self.world, ring, start, self.ORDERED)
        self.ring, self.rank = ring, self.mesh.rank
        self.owners = self.mesh.shard_group
        self.owner: Any = None  # the step layer's owner state (params, optimizer state) lives here
        self.layout: Layout | None = None
        self.dtype: torch.dtype | None = None
        self.j = start
        self.taus: dict[str, int] = {}
        self.pinned: dict[str, int] = {}
        self.reads: list[tuple[str, int]] = []  # (unit, version) of every gather of this minibatch
        self.wait_s = 0.0

    # --- versions ---------------------------------------------------------------------------
    def publish(self, owner: int, version: int, shards: Mapping[str, torch.Tensor]) -> None:
        """Make ``shards`` (fp32 masters) ``owner``'s ``version``, in the compute dtype."""
        b = self.board
        slot = b.pub[owner][version % self.ring]
        for u in self.layout.units:
            src = shards[u.name].detach()
            dst = slot.get(u.name)
            if dst is None or dst.dtype != self.dtype or dst.numel() != u.shard_size:
                slot[u.name] = src.to(self.dtype, copy=True)
            else:
                dst.copy_(src)
        with self.world.cond:
            b.latest[owner] = version
            lo = min(b.latest)
            for k in [k for k in b.shared if k[0] < lo]:  # every rank is past those minibatches
                del b.shared[k]
            for d in (b.stats, b.norm2):  # kept a while: ranks report a step's loss when they see it
                for k in [k for k in d if k < lo - 2 * self.ring - 2]:
                    del d[k]
            self.world.cond.notify_all()

    def start(
        self, layout: Layout, shards: Mapping[str, torch.Tensor], dtype: torch.dtype, apply: Apply
    ) -> None:
        """Publish the starting version, allocate the accumulator ring and register the owner's
        ``apply`` (first stale step)."""
        self.layout, self.dtype = layout, dtype
        self._allocate(layout)
        self.board.appliers[self.rank] = apply
        self.publish(self.rank, self.board.start, shards)

    # --- accumulation (the hooks the ordered subclass replaces) ----------------------------
    def _allocate(self, layout: Layout) -> None:
        """This owner's accumulator ring (arrival order: one fp32 shard per slot and unit)."""
        for slot in self.board.acc[self.rank]:
            for u in layout.units:
                if not u.frozen:  # never pushed into: no accumulator
                    slot[u.name] = torch.zeros(u.shard_size, dtype=torch.float32)

    def _add(self, owner: int, unit: str, piece: torch.Tensor) -> None:
        """Add this rank's ``piece`` of minibatch ``j`` into ``owner``'s slot, as it arrives."""
        with self.board.acc_locks[owner]:
            self.board.acc[owner][self.j % self.ring][unit].add_(piece)

    def _step_grads(self, owner: int, k: int) -> dict[str, torch.Tensor]:
        """``owner``'s gradient shards of step ``k`` (every rank's pushes landed)."""
        return self.board.acc[owner][k % self.ring]

    def _clear(self, owner: int, k: int) -> None:
        """Step ``k`` applied: ready ``owner``'s slot for step ``k + ring``."""
        for g in self.board.acc[owner][k % self.ring].values():
            g.zero_()

    def open(self, j: int, taus: Mapping[str, int]) -> None:
        """Begin minibatch ``j`` with each unit's bound ``taus``."""
        self.j, self.taus = j, dict(taus)
        self.pinned, self.reads, self.wait_s = {}, [], 0.0

    @property
    def applied(self) -> int:
        """This owner's newest version (its shards after the updates of steps below it)."""
        return self.board.latest[self.rank]

    # --- completion: whoever sees an owner's step complete applies it ----------------------
    def _ready(self, owner: int) -> int | None:
        k = self.board.latest[owner]
        return k if self.board.done.get((owner, k), 0) >= len(self.owners) else None

    def wait(self, pred: Callable[[], bool], what: str) -> None:
        w, t0 = self.world, time.perf_counter()
        deadline = t0 + self.timeout
        try:
            while True:
                self.service()
                with w.cond:
                    if w.aborted is not None:
                        raise TransportError(f"aborted while waiting for {what}: {w.aborted}")
                    if pred():
                        return
                    if any(self._ready(o) is not None for o in self.owners):
                        continue
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        raise TransportError(
                            f"timed out after {self.timeout}s waiting for {what} (dead or stuck peer?)"
                        )
                    w.cond.wait(min(left, _POLL_S))
        finally:
            self.wait_s += time.perf_counter() - t0

    def wait_applied(self, n: int) -> None:
        """Until every owner has applied every step below ``n``."""
        b = self.board
        self.wait(lambda: min(b.latest) >= n, f"every owner to apply the steps below {n}")

    def service(self) -> int:
        """Apply every completed step of the owners this rank pushes into (its own included), in
        order. An owner busy computing, or between steps, would apply late: so the thread that
        completes a step applies it, under the owner's lock (one applier per owner at a time)."""
        return sum(self._service(o) for o in self.owners)

    def _service(self, o: int) -> int:
        b, n = self.board, 0
        if not b.apply_locks[o].acquire(blocking=False):  # another thread is applying o's steps
            return 0
        try:
            while True:
                with self.world.cond:
                    k = self._ready(o)
                    if k is None:
                        return n
                    parts = b.stats[k]
                    if len(parts) < self.mesh.world_size:  # deposits precede done bumps: a bug if hit
                        raise TransportError(f"step {k}: stats of ranks {sorted(parts)} only")
                    stats = parts[0].clone()
                    for q in range(1, self.mesh.world_size):  # rank order: the same sum everywhere
                        stats += parts[q]
                    apply = b.appliers[o]
                grads = self._step_grads(o, k)
                norm2 = float(sum_squares(grads.values()))
                with self.world.cond:
                    b.norm2[k][o] = norm2
                shards = apply(k, grads, stats)
                self._clear(o, k)
                with self.world.cond:
                    b.done.pop((o, k), None)
                self.publish(o, k + 1, shards)
                n += 1
        finally:
            b.apply_locks[o].release()

    def report(self, k: int) -> tuple[torch.Tensor, float] | None:
        """Step ``k``'s summed stats and global gradient norm² once every rank and owner has
        delivered them, else None."""
        b, w = self.board, self.mesh.world_size
        with self.world.cond:
            parts, norms = b.stats.get(k, {}), b.norm2.get(k, {})
            if len(parts) < w or len(norms) < w:
                return None
            stats = parts[0].clone()
            for q in range(1, w):
                stats += parts[q]
            return stats, sum(norms[q] for q in range(w))

    # --- the executor's transport for minibatch j -------------------------------------------
    def gather(self, unit: str, out: torch.Tensor) -> Handle:
        b, size = self.board, self.layout[unit].shard_size
        v = self.pinned.get(unit)
        if v is None:
            need = max(self.j - self.taus.get(unit, 0), b.start)  # nothing older than the start
            self.wait(lambda: min(b.latest[o] for o in self.owners) >= need,
                      f"version >= {need} of unit {unit!r} (rank {self.rank}, minibatch {self.j})")
            with self.world.cond:
                v = self.pinned[unit] = min(b.latest[o] for o in self.owners)
        for i, owner in enumerate(self.owners):
            src = b.pub[owner][v % self.ring][unit]
            out[i * size:(i + 1) * size].copy_(src)
            if b.latest[owner] >= v + self.ring:  # the slot was reused under the copy: never expected
                raise TransportError(f"torn read of {unit!r} version {v} from rank {owner}")
            if owner != self.rank:
                self.counters.gather_bytes += src.numel() * src.element_size()
        self.reads.append((unit, v))
        self.counters.gathers += 1
        return Done()

    def scatter_accumulate(self, unit: str, grad: torch.Tensor) -> Handle:
        b, size, j = self.board, self.layout[unit].shard_size, self.j
        for i, owner in enumerate(self.owners):
            if b.latest[owner] < j - self.ring + 1:  # the slot still holds step j - R, unapplied
                self.wait(lambda o=owner: b.latest[o] >= j - self.ring + 1,
                          f"rank {owner} to apply step {j - self.ring} (push of {unit!r}, minibatch {j})")
            piece = grad[i * size:(i + 1) * size]
            self._add(owner, unit, piece)
            if owner != self.rank:
                self.counters.scatter_bytes += piece.numel() * piece.element_size()
        self.counters.scatters += 1
        return Done()

    def fetch_add(self, counter: int, n: int = 1) -> int:
        check_counter(counter, self.max_counters, "LocalTransport (staleness)")
        with self.world.cond:  # keyed by minibatch: ranks at different minibatches never share one
            old = self.board.shared.get((self.j, counter), 0)
            self.board.shared[(self.j, counter)] = old + n
            return old

    def complete(self, stats: torch.Tensor) -> None:
        """This rank's pushes of minibatch ``j`` have landed: deposit its stats (they ride to the
        owners instead of a sync) and count it done at each owner."""
        b = self.board
        with self.world.cond:
            b.stats[self.j][self.rank] = stats.detach().to("cpu", torch.float64, copy=True)
            for o in self.owners:
                b.done[(o, self.j)] += 1
            self.world.cond.notify_all()
        self.service()

    def flush(self) -> None:  # pushes land synchronously here; completion is ``complete``
        return None

    def close(self) -> None:
        return None
