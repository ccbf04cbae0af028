"""Per-owner parameter versions for bounded staleness (τ >= 1) across local processes.

The same protocol as ``odcfn.transport.versions`` (in-process ranks; its docstring gives the
semantics and why a ring of ``R = τ_max + 1`` versions is enough), over /dev/shm like
``ShmTransport``. Each rank owns one segment every peer maps::

    ctrl    int64[8 + W + 2S]     latest | pid | abort | beat | ring | start | - | - |
                                  done[client] | stats_tag[S] | norm_tag[S]
    floats  float64[S + S*CAP]    norm²[S] (this owner's |g|² of step k, at k % S) |
                                  stats[S][CAP] (this rank's deposited stats of step j, at j % S)
    counts  int64[R+1][2^16][2]   (minibatch, value) of each fetch_add counter (rank 0's only)
    pub     [R][unit]             this owner's published versions, compute dtype (v at v % R)
    acc     [R][P][trained unit]  fp32 accumulators of steps (k at k % R): P = 1 part, added into
                                  under locks in arrival order; or, deterministic, P = W parts,
                                  part q written by rank q alone and summed in rank order at apply
                                  (``odcfn.transport.versions_det``: the same arithmetic)

Every word has one writer: ``latest``, ``norm``, ``stats`` and the ring slots are written by the
owning rank; ``done[c]`` by client ``c`` (the number of minibatches it completed, monotone). Each
publication writes the data first, then its flag or tag (x86-64 keeps stores in order; other
architectures are refused, ``shm_sync.check_store_order``). Accumulator adds are chunked under
byte-range locks, as in ``ShmTransport``.

**Who applies.** An owner's optimizer state lives in its own process, so only it can apply its
steps. A daemon thread of the owner process (the *applier*) polls its ``done`` words and, once
every client completed step ``k``, sums the ranks' deposited stats in rank order (the fingerprint
check and the loss ride them), runs the step layer's ``apply``, zeroes slot ``k % R``, records
its norm² and publishes version ``k + 1``. So an owner that is computing a long microbatch, or
is between steps in user code, does not hold its peers back. The thread only applies: it never
waits on a peer. An exception in it (disagreeing ranks, a non-finite gradient) raises ABORT for
the peers and is re-raised by this rank's next call.

Stats and norms are kept ``S = 2R + 2`` steps: a rank reports step ``k`` (its loss) at the end
of its step ``k + R + 1`` at the latest, before any rank can deposit step ``k + S``; a tag that
does not match (a report read far too late) raises rather than reading another step's figures.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from odcfn.sharding import Layout
from odcfn.transport.base import MAX_COUNTERS, Done, Handle, TransportError, check_counter, sum_squares
from odcfn.transport.shm_sync import RangeLock, Segment, map_segments, shm_dir, wait_until
from odcfn.transport.versions_det import rank_order_sum

__all__ = ["StaleShm"]

LATEST, PID, ABORT, BEAT, RING, START, DONE = 0, 1, 2, 3, 4, 5, 8  # ctrl words
CAP = 1 << 15  # float64 stats per deposit (loss, metrics, expert loads, fingerprint riders)
_ALIGN = 64
_COUNTER_LOCK = 0  # the byte locked around fetch_add (accumulator locks use offsets past it)
Apply = Callable[[int, dict[str, torch.Tensor], torch.Tensor], Mapping[str, torch.Tensor]]


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Offsets:
    """Byte offsets inside every rank's segment (identical on all ranks)."""

    def __init__(self, layout: Layout, dtype: torch.dtype, world: int, ring: int, parts: int) -> None:
        self.S, self.C = 2 * ring + 2, ring + 1
        self.nctrl = DONE + world + 2 * self.S
        self.floats = _align(self.nctrl * 8)
        self.counts = _align(self.floats + (self.S + self.S * CAP) * 8)
        off = _align(self.counts + self.C * MAX_COUNTERS * 2 * 8)
        esize = torch.empty((), dtype=dtype).element_size()
        self.pub: list[dict[str, int]] = [{} for _ in range(ring)]
        self.acc: list[list[dict[str, int]]] = [[{} for _ in range(parts)] for _ in range(ring)]
        for slot in range(ring):
            for u in layout.units:
                self.pub[slot][u.name], off = off, _align(off + u.shard_size * esize)
            for part in self.acc[slot]:
                for u in layout.units:
                    if not u.frozen:  # never pushed into: no accumulator
                        part[u.name], off = off, _align(off + u.shard_size * 4)
        self.nbytes = off


class StaleShm:
    """Rank ``r``'s side of the versions over /dev/shm; the executor's transport for one
    minibatch between ``open`` and ``complete`` (the same interface as ``versions.StaleLocal``)."""

    def __init__(self, transport: Any, ring: int, start: int, ordered: bool = False) -> None:
        self.tr, self.ORDERED = transport, ordered
        self.mesh, self.counters = transport.mesh, transport.counters
        self.collectives = transport.collectives
        self.max_counters, self.timeout = MAX_COUNTERS, transport.timeout
        self.ring, self.start_version, self.rank = ring, start, self.mesh.rank
        self.owners = self.mesh.shard_group
        self.owner: Any = None  # the step layer's owner state (params, optimizer state)
        self.layout: Layout | None = None
        self.dtype: torch.dtype | None = None
        self.j = start
        self.taus: dict[str, int] = {}
        self.pinned: dict[str, int] = {}
        self.reads: list[tuple[str, int]] = []
        self.wait_s = 0.0
        self._segs: list[Segment] = []
        self._ctrl: list[np.ndarray] = []
        self._apply: Apply | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- setup ----------------------------------------------------------------------------
    def start(
        self, layout: Layout, shards: Mapping[str, torch.Tensor], dtype: torch.dtype, apply: Apply
    ) -> None:
        """Map every rank's segment (a collective: every rank's first stale step), publish the
        starting version and start the applier."""
        w, r = self.mesh.world_size, self.rank
        self._agree(layout, dtype)
        off = self.off = _Offsets(layout, dtype, w, self.ring, w if self.ORDERED else 1)
        stem = f"{self.tr._stem}-stale{self.start_version}"

        def init(own: Segment) -> None:
            ctrl = own.view(0, off.nctrl, torch.int64)
            ctrl[LATEST], ctrl[PID] = self.start_version - 1, os.getpid()  # nothing published yet
            ctrl[RING], ctrl[START] = self.ring, self.start_version

        path = lambda p: os.path.join(shm_dir(), f"{stem}-r{p}")  # noqa: E731
        mapped = map_segments(path, off.nbytes, r, range(w), self.collectives.barrier, init)
        self._segs = [mapped[p] for p in range(w)]
        self._ctrl = [s.view(0, off.nctrl, torch.int64).numpy() for s in self._segs]
        self._norm = [s.view(off.floats, off.S, torch.float64) for s in self._segs]
        self._stats = [s.view(off.floats + off.S * 8, off.S * CAP, torch.float64).view(off.S, CAP)
                       for s in self._segs]
        self._counts = self._segs[0].view(off.counts, off.C * MAX_COUNTERS * 2, torch.int64).numpy()
        self._counts = self._counts.reshape(off.C, MAX_COUNTERS, 2)
        self._pub = [[{n: s.view(o, layout[n].shard_size, dtype) for n, o in slot.items()}
                      for slot in off.pub] for s in self._segs]
        self._acc = [[[{n: s.view(o, layout[n].shard_size, torch.float32) for n, o in part.items()}
                       for part in slot] for slot in off.acc] for s in self._segs]  # [owner][slot][part]
        self.trained = [u.name for u in layout.units if not u.frozen]
        self.sizes = {u.name: u.shard_size for u in layout.units}
        self.layout, self.dtype, self._apply = layout, dtype, apply
        self._publish(self.start_version, shards)
        self._thread = threading.Thread(target=self._applier, name=f"odcfn-applier-{r}", daemon=True)
        self._thread.start()

    def _agree(self, layout: Layout, dtype: torch.dtype) -> None:
        """Ranks with another τ, starting step, layout or dtype: one all-reduce of small integers,
        the same error on every rank, before any segment exists."""
        w, r = self.mesh.world_size, self.rank
        esize = torch.empty((), dtype=dtype).element_size()
        mine = [float(self.ring), float(self.start_version), float(len(layout.units)),
                float(sum(u.shard_size for u in layout.units)), float(esize), float(self.ORDERED)]
        vec = torch.zeros(len(mine) * w, dtype=torch.float64)
        vec[len(mine) * r:len(mine) * (r + 1)] = torch.tensor(mine, dtype=torch.float64)
        rows = self.collectives.all_reduce(tuple(range(w)), vec).view(w, len(mine)).tolist()
        for i, what in ((0, "StepConfig.staleness differs between ranks: versions kept (max τ + 1)"),
                        (1, "ranks started bounded staleness at different steps (every rank must pass "
                            "its TrainState at the same step)"),
                        (2, "ranks disagree on the parameter layout (units)"),
                        (3, "ranks disagree on the parameter layout (elements per shard)"),
                        (4, "ranks disagree on the compute dtype (bytes per element)"),
                        (5, "StepConfig.deterministic differs between ranks under StepConfig.staleness "
                            "(1: rank-order sums)")):
            if len({row[i] for row in rows}) > 1:
                ranks = ", ".join(f"rank {p}: {int(row[i])}" for p, row in enumerate(rows))
                raise ValueError(f"{what}: {ranks}")

    # --- versions -------------------------------------------------------------------------
    def _publish(self, version: int, shards: Mapping[str, torch.Tensor]) -> None:
        slot = self._pub[self.rank][version % self.ring]
        for u in self.layout.units:
            slot[u.name].copy_(shards[u.name].detach())
        self._ctrl[self.rank][LATEST] = version  # data, then flag

    def latest(self, owner: int) -> int:
        return int(self._ctrl[owner][LATEST])

    @property
    def applied(self) -> int:
        """This owner's newest version (its shards after the updates of steps below it)."""
        return self.latest(self.rank)

    def open(self, j: int, taus: Mapping[str, int]) -> None:
        """Begin minibatch ``j`` with each unit's bound ``taus``."""
        self.raise_error()
        self.j, self.taus = j, dict(taus)
        self.pinned, self.reads, self.wait_s = {}, [], 0.0

    # --- the applier ----------------------------------------------------------------------
    def _ready(self) -> int | None:
        ctrl = self._ctrl[self.rank]
        k = int(ctrl[LATEST])
        return k if all(int(ctrl[DONE + c]) >= k + 1 for c in self.owners) else None

    def _applier(self) -> None:
        pause = 1e-4
        while not self._stop.is_set():
            k = self._ready()
            if k is None:
                self._stop.wait(pause)
                # a few ms of latency against steps of 100s of ms; a shorter cap costs a
                # measurable share of a core in wake-ups (bench: 3.5% at 2 ms under load)
                pause = min(pause * 2, 5e-3)
                continue
            pause = 1e-4
            try:
                self._apply_step(k)
            except BaseException as e:  # noqa: BLE001 - re-raised by the main thread's next call
                self._error = e
                self._ctrl[self.rank][ABORT] = 1
                return

    def _apply_step(self, k: int) -> None:
        off, w = self.off, self.mesh.world_size
        stats = None
        for q in range(w):  # rank order: the same sum on every owner
            tag = int(self._ctrl[q][DONE + w + k % off.S])
            if tag != k + 1:  # deposits precede done bumps: a protocol bug if hit
                raise TransportError(f"step {k}: rank {q}'s stats slot holds step {tag - 1}")
            n = int(self._stats[q][k % off.S][0])
            part = self._stats[q][k % off.S][1:1 + n]
            stats = part.clone() if stats is None else stats.add_(part)
        parts = self._acc[self.rank][k % self.ring]
        grads = rank_order_sum(parts, self.trained, self.sizes) if self.ORDERED else parts[0]
        norm2 = float(sum_squares(grads.values()))
        shards = self._apply(k, grads, stats)
        for part in parts:
            for g in part.values():
                g.zero_()  # before the publish below frees the slot for step k + R's pushes
        self._norm[self.rank][k % off.S] = norm2
        self._ctrl[self.rank][DONE + w + off.S + k % off.S] = k + 1
        self._publish(k + 1, shards)
        self.beat()

    def raise_error(self) -> None:
        """Re-raise what the applier thread hit, as itself (a ``ValueError`` of disagreeing
        ranks stays one)."""
        if self._error is not None:
            raise self._error

    def service(self) -> int:
        """The applier thread applies; here only its failure surfaces."""
        self.raise_error()
        return 0

    # --- waiting ----------------------------------------------------------------------------
    def _aborted(self) -> str | None:
        self.raise_error()
        for p, c in enumerate(self._ctrl):
            if c[ABORT] and p != self.rank:
                return f"rank {p} aborted"
        return None

    def wait(self, pred: Callable[[], bool], what: str) -> None:
        others = [p for p in range(self.mesh.world_size) if p != self.rank]
        t0 = time.perf_counter()
        try:
            wait_until(
                pred, timeout=self.timeout, what=f"{what} (rank {self.rank}, minibatch {self.j})",
                check=self._aborted, peers=[(p, lambda p=p: int(self._ctrl[p][PID])) for p in others],
                progress=lambda: sum(int(self._ctrl[p][BEAT]) for p in others),
            )
        finally:
            self.wait_s += time.perf_counter() - t0

    def wait_applied(self, n: int) -> None:
        """Until every owner has applied every step below ``n``."""
        self.wait(lambda: min(self.latest(o) for o in range(self.mesh.world_size)) >= n,
                  f"every owner to apply the steps below {n}")

    def beat(self) -> None:
        if self._ctrl:
            self._ctrl[self.rank][BEAT] += 1

    def report(self, k: int) -> tuple[torch.Tensor, float] | None:
        """Step ``k``'s summed stats and global gradient norm² once every rank and owner has
        delivered them, else None."""
        off, w = self.off, self.mesh.world_size
        tags = [int(self._ctrl[q][DONE + w + k % off.S]) for q in range(w)]
        ntags = [int(self._ctrl[q][DONE + w + off.S + k % off.S]) for q in range(w)]
        if any(t > k + 1 for t in tags + ntags):
            raise TransportError(f"rank {self.rank}: step {k}'s figures were overwritten before it read them")
        if any(t != k + 1 for t in tags + ntags):
            return None
        stats = None
        for q in range(w):
            part = self._stats[q][k % off.S][1:1 + int(self._stats[q][k % off.S][0])]
            stats = part.clone() if stats is None else stats.add_(part)
        return stats, sum(float(self._norm[q][k % off.S]) for q in range(w))

    # --- the executor's transport for minibatch j ---------------------------------------------
    def gather(self, unit: str, out: torch.Tensor) -> Handle:
        size = self.layout[unit].shard_size
        v = self.pinned.get(unit)
        if v is None:
            need = max(self.j - self.taus.get(unit, 0), self.start_version)
            self.wait(lambda: min(self.latest(o) for o in self.owners) >= need,
                      f"version >= {need} of unit {unit!r}")
            v = self.pinned[unit] = min(self.latest(o) for o in self.owners)
        for i, owner in enumerate(self.owners):
            src = self._pub[owner][v % self.ring][unit]
            out[i * size:(i + 1) * size].copy_(src)
            if owner != self.rank:
                self.counters.gather_bytes += src.numel() * src.element_size()
        self.reads.append((unit, v))
        self.counters.gathers += 1
        return Done()

    def scatter_accumulate(self, unit: str, grad: torch.Tensor) -> Handle:
        size, j, chunk = self.layout[unit].shard_size, self.j, self.tr.chunk
        for i, owner in enumerate(self.owners):
            if self.latest(owner) < j - self.ring + 1:  # the slot still holds step j - R, unapplied
                self.wait(lambda o=owner: self.latest(o) >= j - self.ring + 1,
                          f"rank {owner} to apply step {j - self.ring} (push of {unit!r})")
            piece = grad[i * size:(i + 1) * size]
            if self.ORDERED:  # this rank's own part: no other writer, so no lock
                self._acc[owner][j % self.ring][self.rank][unit].add_(piece)
            else:
                acc = self._acc[owner][j % self.ring][0][unit]
                base, fd = self.off.acc[j % self.ring][0][unit], self._segs[owner].fd
                for lo in range(0, size, chunk):
                    hi = min(lo + chunk, size)
                    with RangeLock(fd, base + lo * 4, self.timeout, f"rank {owner}'s {unit!r}[{lo}:{hi}]"):
                        acc[lo:hi].add_(piece[lo:hi])
            if owner != self.rank:
                self.counters.scatter_bytes += piece.numel() * piece.element_size()
        self.counters.scatters += 1
        return Done()

    def fetch_add(self, counter: int, n: int = 1) -> int:
        check_counter(counter, self.max_counters, "ShmTransport (staleness)")
        cell = self._counts[self.j % self.off.C][counter]  # keyed by minibatch: ranks may differ
        with RangeLock(self._segs[0].fd, _COUNTER_LOCK, self.timeout, f"shared counter {counter}"):
            if cell[0] > self.j:  # ranks span at most R minibatches; C = R + 1 slots
                raise TransportError(f"shared counter {counter} already serves minibatch {int(cell[0])}, "
                                     f"rank {self.rank} is at {self.j}")
            old = int(cell[1]) if cell[0] == self.j else 0
            cell[0], cell[1] = self.j, old + n
        return old

    def complete(self, stats: torch.Tensor) -> None:
        """This rank's pushes of minibatch ``j`` have landed (each under its lock): deposit its
        stats in its own segment, then count it done at each owner."""
        off, w, j = self.off, self.mesh.world_size, self.j
        flat = stats.detach().to("cpu", torch.float64).reshape(-1)
        if flat.numel() + 1 > CAP:
            raise ValueError(f"bounded staleness carries at most {CAP - 1} stats per step, this step has "
                             f"{flat.numel()} (expert loads of a very large mixture?)")
        row = self._stats[self.rank][j % off.S]
        row[1:1 + flat.numel()].copy_(flat)
        row[0] = flat.numel()
        self._ctrl[self.rank][DONE + w + j % off.S] = j + 1  # data, then tag
        for o in self.owners:
            self._ctrl[o][DONE + self.rank] = j + 1
        self.raise_error()

    def flush(self) -> None:  # pushes land synchronously; completion is ``complete``
        return None

    # --- lifetime ---------------------------------------------------------------------------
    def abort(self) -> None:
        if self._ctrl:
            self._ctrl[self.rank][ABORT] = 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(self.timeout, 1.0))
        self._thread = None
        self._ctrl, self._pub, self._acc, self._stats, self._norm = [], [], [], [], []
        self._counts = None
        for s in self._segs:
            s.close()
        self._segs = []
