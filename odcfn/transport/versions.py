"""Per-owner parameter versions for bounded staleness (τ >= 1) on in-process ranks (LocalWorld):
the storage of ``odcfn.transport.versions_base.VersionStore`` (its docstring gives the protocol
and why a ring of ``R = τ_max + 1`` versions is enough) as Python objects the threads share.

- **Who applies.** In-process ranks share memory, so the thread that completes an owner's step
  applies it (the last pusher applies for the owner, under the owner's lock): an owner busy
  computing, or between steps, never holds its peers back.
- **Waiting.** A waiter sleeps on the world's condition, woken by every publish, completion and
  released apply lock (never a busy loop while another thread applies), and applies what it
  can on the way. Its timeout counts from the peers' last progress (``LocalWorld.beats``,
  bumped by the executor after each plan step and after each applied update), as the
  synchronous step's waits do: a busy peer is not a dead one.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import torch

from odcfn.sharding import Layout
from odcfn.transport.base import TransportError, check_counter
from odcfn.transport.heartbeat import Patience
from odcfn.transport.versions_base import EMPTY, Apply, VersionStore, bound, reuse_view

# local.py makes the views: its LocalWorld and LocalTransport are typed Any here, never
# imported (local.py imports this module: that would be an import circle)

__all__ = ["StaleLocal", "VersionBoard", "bound", "reuse_view"]

_POLL_S = 0.05  # a waiter re-checks the peers' progress at least this often (beats do not notify)


class VersionBoard:
    """What the ranks of one ``LocalWorld`` share under τ >= 1 (guarded by the world's condition,
    so an abort wakes every waiter)."""

    def __init__(self, world: Any, ring: int, start: int, ordered: bool = False) -> None:
        w = world.world_size
        self.ring, self.start, self.ordered = ring, start, ordered
        self.latest = [start - 1] * w  # newest version each owner published (start - 1: none yet)
        self.tags = [[EMPTY] * ring for _ in range(w)]  # [owner][slot]: the version held (seqlock)
        self.pub: list[list[dict[str, torch.Tensor]]] = [[{} for _ in range(ring)] for _ in range(w)]
        # [owner][slot][part] -> {unit: fp32 sum}: one part added into under acc_locks (arrival
        # order), or, ordered, part r written by rank r alone (odcfn.transport.versions_det)
        self.acc: list[list[list[dict[str, torch.Tensor]]]] = [
            [[{} for _ in range(w if ordered else 1)] for _ in range(ring)] for _ in range(w)
        ]
        self.acc_locks = [threading.Lock() for _ in range(w)]  # concurrent adds never lose updates
        self.done: dict[tuple[int, int], int] = defaultdict(int)  # (owner, step) -> pushers done
        self.stats: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)  # step -> rank -> stats
        self.norm2: dict[int, dict[int, float]] = defaultdict(dict)  # step -> owner -> |g_o|^2
        self.shared: dict[tuple[int, int], int] = {}  # (step, counter) -> value, for fetch_add
        self.appliers: list[Apply | None] = [None] * w  # each owner's update (the step layer's)
        self.apply_locks = [threading.Lock() for _ in range(w)]


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


class StaleLocal(VersionStore):
    """``VersionStore`` over a ``LocalWorld``'s shared ``VersionBoard``; ``ordered``: each owner
    sums a step's pushes in rank order (``odcfn.transport.versions_det``)."""

    def __init__(self, transport: Any, ring: int, start: int, ordered: bool = False) -> None:
        super().__init__(transport, ring, start, ordered, transport.world.timeout)
        self.world = transport.world
        self.max_counters = transport.max_counters
        self.board = _board(self.world, ring, start, ordered)

    # --- storage ----------------------------------------------------------------------------
    def latest(self, owner: int) -> int:
        return self.board.latest[owner]

    def _set_latest(self, owner: int, version: int) -> None:
        b = self.board
        with self.world.cond:
            b.latest[owner] = version
            lo = min(b.latest)
            for k in [k for k in b.shared if k[0] < lo]:  # every rank is past those minibatches
                del b.shared[k]
            for d in (b.stats, b.norm2):  # kept a while: ranks report a step's loss when they see it
                for k in [k for k in d if k < lo - 2 * self.ring - 2]:
                    del d[k]
            self.world.cond.notify_all()

    def _tag(self, owner: int, slot: int) -> int:
        return self.board.tags[owner][slot]

    def _set_tag(self, owner: int, slot: int, tag: int) -> None:
        self.board.tags[owner][slot] = tag

    def _shard(self, owner: int, slot: int, unit: str) -> torch.Tensor:
        return self.board.pub[owner][slot][unit]

    def _write(self, owner: int, slot: int, unit: str, src: torch.Tensor) -> None:
        pub = self.board.pub[owner][slot]
        dst = pub.get(unit)
        if dst is None or dst.dtype != self.dtype or dst.numel() != self.sizes[unit]:
            pub[unit] = src.to(self.dtype, copy=True)
        else:
            dst.copy_(src)

    def _setup(self, layout: Layout, dtype: torch.dtype, apply: Apply) -> None:
        if not self.ORDERED:  # one fp32 shard per slot and trained unit; ordered parts come with pushes
            for (part,) in self.board.acc[self.rank]:
                for u in self.trained:
                    part[u] = torch.zeros(self.sizes[u], dtype=torch.float32)
        self.board.appliers[self.rank] = apply

    def _parts(self, owner: int, slot: int) -> Sequence[MutableMapping[str, torch.Tensor]]:
        return self.board.acc[owner][slot]

    def _add_arrival(self, owner: int, slot: int, unit: str, piece: torch.Tensor) -> None:
        with self.board.acc_locks[owner]:
            self.board.acc[owner][slot][0][unit].add_(piece)

    def _clear(self, owner: int, slot: int) -> None:
        for part in self.board.acc[owner][slot]:
            if self.ORDERED:
                part.clear()  # dropped, never reused: only minibatches in flight hold parts
            else:
                for g in part.values():
                    g.zero_()

    def _ready(self, owner: int) -> int | None:
        k = self.board.latest[owner]
        return k if self.board.done.get((owner, k), 0) >= len(self.owners) else None

    def _rank_stats(self, k: int) -> list[torch.Tensor]:
        with self.world.cond:
            parts = self.board.stats[k]
            if len(parts) < self.mesh.world_size:  # deposits precede done counts: a bug if hit
                raise TransportError(f"step {k}: stats of ranks {sorted(parts)} only")
            return [parts[q] for q in range(self.mesh.world_size)]

    def _applied(self, owner: int, k: int, norm2: float) -> None:
        with self.world.cond:
            self.board.norm2[k][owner] = norm2
            self.board.done.pop((owner, k), None)

    def _figures(self, k: int) -> tuple[list[torch.Tensor], list[float]] | None:
        w = self.mesh.world_size
        with self.world.cond:
            parts, norms = self.board.stats.get(k, {}), self.board.norm2.get(k, {})
            if len(parts) < w or len(norms) < w:
                return None
            return [parts[q] for q in range(w)], [norms[q] for q in range(w)]

    def _finish(self, j: int, stats: torch.Tensor) -> None:
        b = self.board
        with self.world.cond:
            b.stats[j][self.rank] = stats
            for o in self.owners:
                b.done[(o, j)] += 1
            self.world.cond.notify_all()
        self.service()

    # --- applying: whoever sees an owner's step complete applies it -------------------------
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
            while (k := self._ready(o)) is not None:
                self._apply_step(o, k, b.appliers[o])
                n += 1
        finally:
            b.apply_locks[o].release()
            with self.world.cond:  # a waiter that saw o's step ready under our lock may take it now
                self.world.cond.notify_all()
        return n

    def beat(self) -> None:
        self.world.beats[self.rank] += 1  # only this rank's thread writes its entry

    def _block(self, pred: Callable[[], bool], what: str) -> None:
        w, b = self.world, self.board
        peers = [p for p in range(self.mesh.world_size) if p != self.rank]
        patience = Patience(self.timeout, what, lambda: sum(w.beats[p] for p in peers))
        while True:
            self.service()
            with w.cond:
                if w.aborted is not None:
                    raise TransportError(f"aborted while waiting for {what}: {w.aborted}")
                if pred():
                    return
                # a completed step no thread is applying: take it (service, above)
                if any(self._ready(o) is not None and not b.apply_locks[o].locked() for o in self.owners):
                    continue
                if patience.expired():
                    raise TransportError(
                        f"timed out after {self.timeout}s waiting for {what} (dead or stuck peer? "
                        f"no progress from it for {self.timeout}s)"
                    )
                # publishes, completions and released apply locks notify; the timeout only
                # re-reads the peers' progress counters
                w.cond.wait(_POLL_S)

    # --- the executor's counters -------------------------------------------------------------
    def fetch_add(self, counter: int, n: int = 1) -> int:
        check_counter(counter, self.max_counters, "LocalTransport (staleness)")
        with self.world.cond:  # keyed by minibatch: ranks at different minibatches never share one
            old = self.board.shared.get((self.j, counter), 0)
            self.board.shared[(self.j, counter)] = old + n
            return old
