"""Per-owner parameter versions for bounded staleness (τ >= 1) across local processes: the storage
of ``odcfn.transport.versions_base.VersionStore`` (its docstring gives the protocol and why a ring
of ``R = τ_max + 1`` versions is enough) over /dev/shm like ``ShmTransport``. Each rank owns one
segment every peer maps::

    ctrl    int64[8 + W + 2S + R]  latest | pid | abort | beat | ring | start | - | - |
                                   done[client] | stats_tag[S] | norm_tag[S] | slot_tag[R]
    floats  float64[S + S*CAP]     norm²[S] (this owner's |g|² of step k, at k % S) |
                                   stats[S][CAP] (this rank's deposited stats of step j, at j % S)
    counts  int64[R+1][2^16][2]    (minibatch, value) of each fetch_add counter (rank 0's only)
    pub     [R][unit]              this owner's published versions, compute dtype (v at v % R)
    acc     [R][P][trained unit]   fp32 accumulators of steps (k at k % R): P = 1 part, added into
                                   under locks in arrival order; or, deterministic, P = W parts,
                                   part q written by rank q alone and summed in rank order at apply
                                   (``odcfn.transport.versions_det``: the same arithmetic)

Every word has one writer: ``latest``, ``norm``, ``stats``, the slot tags and the ring slots are
written by the owning rank; ``done[c]`` by client ``c`` (the number of minibatches it completed,
monotone). Each publication writes the data first, then its flag or tag (x86-64 keeps stores in
order, and loads too; other architectures are refused, ``shm_sync.check_store_order``); a slot's
tag is set to ``WRITING`` before its data (the seqlock of ``versions_base``). Accumulator adds are
chunked under byte-range locks, as in ``ShmTransport``.

**Who applies.** An owner's optimizer state lives in its own process, so only it can apply its
steps. A daemon thread of the owner process (the *applier*) polls its ``done`` words and, once
every client completed step ``k``, applies it (``VersionStore._apply_step``). So an owner that is
computing a long microbatch, or is between steps in user code, does not hold its peers back. The
thread only applies: it never waits on a peer. An exception in it (disagreeing ranks, a
non-finite gradient) raises ABORT for the peers and is re-raised by this rank's next call.

**Deterministic memory.** The W parts of a slot are ``W`` fp32 shards per trained unit, i.e.
one copy of the trained parameters per slot. Each slot's parts are whole pages, released to the
kernel (``fallocate`` punching a hole: the pages read as zeros again) once the step is applied,
so, as in-process, only steps in flight hold them (docs/staleness.md gives the measured figure).

Stats and norms are kept ``S = 2R + 2`` steps: a rank reports step ``k`` (its loss) at the end
of its step ``k + R + 1`` at the latest, before any rank can deposit step ``k + S``; a tag that
does not match (a report read far too late) raises rather than reading another step's figures.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import numpy as np
import torch

from odcfn.sharding import Layout
from odcfn.transport.base import MAX_COUNTERS, TransportError, check_counter
from odcfn.transport.shm_sync import RangeLock, Segment, map_segments, punch_hole, shm_dir, wait_until
from odcfn.transport.versions_base import EMPTY, Apply, VersionStore, bound

__all__ = ["StaleShm", "bound"]

LATEST, PID, ABORT, BEAT, RING, START, DONE = 0, 1, 2, 3, 4, 5, 8  # ctrl words
CAP = 1 << 15  # float64 stats per deposit (loss, metrics, expert loads, fingerprint riders)
_ALIGN = 64
_PAGE = 4096  # a slot's accumulator parts start and end on a page: released whole
_COUNTER_LOCK = 0  # the byte locked around fetch_add (accumulator locks use offsets past it)
_DISAGREE = (  # what each value of StaleShm._agree's row means, when ranks differ on it
    "StepConfig.staleness differs between ranks: versions kept (max τ + 1)",
    "ranks started bounded staleness at different steps (every rank must pass its TrainState at the "
    "same step)",
    "ranks disagree on the parameter layout (units)",
    "ranks disagree on the parameter layout (elements per shard)",
    "ranks disagree on the compute dtype (bytes per element)",
    "StepConfig.deterministic differs between ranks under StepConfig.staleness (1: rank-order sums)",
)


def _align(n: int, to: int = _ALIGN) -> int:
    return -(-n // to) * to


class _Offsets:
    """Byte offsets inside every rank's segment (identical on all ranks)."""

    def __init__(self, layout: Layout, dtype: torch.dtype, world: int, ring: int, parts: int) -> None:
        self.S, self.C = 2 * ring + 2, ring + 1
        self.tags = DONE + world + 2 * self.S  # slot_tag[R]
        self.nctrl = self.tags + ring
        self.floats = _align(self.nctrl * 8)
        self.counts = _align(self.floats + (self.S + self.S * CAP) * 8)
        off = _align(self.counts + self.C * MAX_COUNTERS * 2 * 8)
        esize = torch.empty((), dtype=dtype).element_size()
        self.pub: list[dict[str, int]] = [{} for _ in range(ring)]
        self.acc: list[list[dict[str, int]]] = [[{} for _ in range(parts)] for _ in range(ring)]
        self.acc_span: list[tuple[int, int]] = []  # [slot] -> (start, end) bytes of its parts
        for slot in range(ring):
            for u in layout.units:
                self.pub[slot][u.name], off = off, _align(off + u.shard_size * esize)
            off = lo = _align(off, _PAGE)
            for part in self.acc[slot]:
                for u in layout.units:
                    if not u.frozen:  # never pushed into: no accumulator
                        part[u.name], off = off, _align(off + u.shard_size * 4)
            off = _align(off, _PAGE)
            self.acc_span.append((lo, off))
        self.nbytes = off


class StaleShm(VersionStore):
    """``VersionStore`` over /dev/shm segments, one per rank (the layout above)."""

    max_counters = MAX_COUNTERS

    def __init__(self, transport: Any, ring: int, start: int, ordered: bool = False) -> None:
        super().__init__(transport, ring, start, ordered, transport.timeout)
        self.tr = transport
        self._segs: list[Segment] = []
        self._ctrl: list[np.ndarray] = []
        self._apply: Apply | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- setup ----------------------------------------------------------------------------
    def _setup(self, layout: Layout, dtype: torch.dtype, apply: Apply) -> None:
        """Map every rank's segment (a collective: every rank's first stale step)."""
        w, r = self.mesh.world_size, self.rank
        self._agree(layout, dtype)
        off = self.off = _Offsets(layout, dtype, w, self.ring, w if self.ORDERED else 1)
        stem = f"{self.tr._stem}-stale{self.start_version}"

        def init(own: Segment) -> None:
            ctrl = own.view(0, off.nctrl, torch.int64)
            ctrl[LATEST], ctrl[PID] = self.start_version - 1, os.getpid()  # nothing published yet
            ctrl[RING], ctrl[START] = self.ring, self.start_version
            ctrl[off.tags : off.tags + self.ring] = EMPTY

        path = lambda p: os.path.join(shm_dir(), f"{stem}-r{p}")  # noqa: E731
        mapped = map_segments(path, off.nbytes, r, range(w), self.collectives.barrier, init)
        self._segs = [mapped[p] for p in range(w)]
        self._ctrl = [s.view(0, off.nctrl, torch.int64).numpy() for s in self._segs]
        self._norm = [s.view(off.floats, off.S, torch.float64) for s in self._segs]
        self._stats = [
            s.view(off.floats + off.S * 8, off.S * CAP, torch.float64).view(off.S, CAP) for s in self._segs
        ]
        self._counts = self._segs[0].view(off.counts, off.C * MAX_COUNTERS * 2, torch.int64).numpy()
        self._counts = self._counts.reshape(off.C, MAX_COUNTERS, 2)
        self._pub = [
            [{n: s.view(o, layout[n].shard_size, dtype) for n, o in slot.items()} for slot in off.pub]
            for s in self._segs
        ]
        self._acc = [
            [
                [
                    {n: s.view(o, layout[n].shard_size, torch.float32) for n, o in part.items()}
                    for part in slot
                ]
                for slot in off.acc
            ]
            for s in self._segs
        ]  # [owner][slot][part]
        self._apply = apply

    def start(self, layout: Layout, shards: Any, dtype: torch.dtype, apply: Apply) -> None:
        """Map the segments, publish the starting version, then start the applier."""
        super().start(layout, shards, dtype, apply)
        self._thread = threading.Thread(target=self._applier, name=f"odcfn-applier-{self.rank}", daemon=True)
        self._thread.start()

    def _agree(self, layout: Layout, dtype: torch.dtype) -> None:
        """Ranks with another τ, starting step, layout or dtype: one all-reduce of small integers,
        the same error on every rank, before any segment exists."""
        w, r = self.mesh.world_size, self.rank
        esize = torch.empty((), dtype=dtype).element_size()
        mine = [
            self.ring,
            self.start_version,
            len(layout.units),
            sum(u.shard_size for u in layout.units),
            esize,
            int(self.ORDERED),
        ]  # small integers: exact in float64
        vec = torch.zeros(len(mine) * w, dtype=torch.float64)
        vec[len(mine) * r : len(mine) * (r + 1)] = torch.tensor(mine, dtype=torch.float64)
        rows = self.collectives.all_reduce(tuple(range(w)), vec).view(w, len(mine)).tolist()
        for i, what in enumerate(_DISAGREE):
            if len({row[i] for row in rows}) > 1:
                ranks = ", ".join(f"rank {p}: {int(row[i])}" for p, row in enumerate(rows))
                raise ValueError(f"{what}: {ranks}")

    # --- storage ----------------------------------------------------------------------------
    def latest(self, owner: int) -> int:
        return int(self._ctrl[owner][LATEST])

    def _set_latest(self, owner: int, version: int) -> None:
        self._ctrl[owner][LATEST] = version  # only the owner publishes: its own word

    def _tag(self, owner: int, slot: int) -> int:
        return int(self._ctrl[owner][self.off.tags + slot])

    def _set_tag(self, owner: int, slot: int, tag: int) -> None:
        self._ctrl[owner][self.off.tags + slot] = tag

    def _shard(self, owner: int, slot: int, unit: str) -> torch.Tensor:
        return self._pub[owner][slot][unit]

    def _write(self, owner: int, slot: int, unit: str, src: torch.Tensor) -> None:
        self._pub[owner][slot][unit].copy_(src)

    def _parts(self, owner: int, slot: int) -> Sequence[MutableMapping[str, torch.Tensor]]:
        return self._acc[owner][slot]

    def _add_arrival(self, owner: int, slot: int, unit: str, piece: torch.Tensor) -> None:
        size, chunk = piece.numel(), self.tr.chunk
        acc, fd = self._acc[owner][slot][0][unit], self._segs[owner].fd
        base = self.off.acc[slot][0][unit]
        for lo in range(0, size, chunk):
            hi = min(lo + chunk, size)
            with RangeLock(fd, base + lo * 4, self.timeout, f"rank {owner}'s {unit!r}[{lo}:{hi}]"):
                acc[lo:hi].add_(piece[lo:hi])

    def _clear(self, owner: int, slot: int) -> None:
        lo, hi = self.off.acc_span[slot]
        # deterministic parts are a copy of the trained params per slot: give their pages back
        if self.ORDERED and punch_hole(self._segs[owner].fd, lo, hi - lo):
            return
        for part in self._acc[owner][slot]:
            for g in part.values():
                g.zero_()

    def _ready(self, owner: int) -> int | None:
        ctrl = self._ctrl[owner]
        k = int(ctrl[LATEST])
        return k if all(int(ctrl[DONE + c]) >= k + 1 for c in self.owners) else None

    def _rank_stats(self, k: int) -> list[torch.Tensor]:
        off, w, out = self.off, self.mesh.world_size, []
        for q in range(w):
            tag = int(self._ctrl[q][DONE + w + k % off.S])
            if tag != k + 1:  # deposits precede done counts: a protocol bug if hit
                raise TransportError(f"step {k}: rank {q}'s stats slot holds step {tag - 1}")
            out.append(self._deposit(q, k))
        return out

    def _deposit(self, q: int, k: int) -> torch.Tensor:
        row = self._stats[q][k % self.off.S]
        return row[1 : 1 + int(row[0])]

    def _applied(self, owner: int, k: int, norm2: float) -> None:
        off, w = self.off, self.mesh.world_size
        self._norm[owner][k % off.S] = norm2
        self._ctrl[owner][DONE + w + off.S + k % off.S] = k + 1  # data, then tag

    def _figures(self, k: int) -> tuple[list[torch.Tensor], list[float]] | None:
        off, w = self.off, self.mesh.world_size
        tags = [int(self._ctrl[q][DONE + w + k % off.S]) for q in range(w)]
        ntags = [int(self._ctrl[q][DONE + w + off.S + k % off.S]) for q in range(w)]
        if any(t > k + 1 for t in tags + ntags):
            raise TransportError(f"rank {self.rank}: step {k}'s figures were overwritten before it read them")
        if any(t != k + 1 for t in tags + ntags):
            return None
        return [self._deposit(q, k) for q in range(w)], [float(self._norm[q][k % off.S]) for q in range(w)]

    def _finish(self, j: int, stats: torch.Tensor) -> None:
        """Deposit the stats in this rank's own segment, then count it done at each owner."""
        off, w = self.off, self.mesh.world_size
        if stats.numel() + 1 > CAP:
            raise ValueError(
                f"bounded staleness carries at most {CAP - 1} stats per step, this step has "
                f"{stats.numel()} (expert loads of a very large mixture?)"
            )
        row = self._stats[self.rank][j % off.S]
        row[1 : 1 + stats.numel()].copy_(stats)
        row[0] = stats.numel()
        self._ctrl[self.rank][DONE + w + j % off.S] = j + 1  # data, then tag
        for o in self.owners:
            self._ctrl[o][DONE + self.rank] = j + 1
        self.raise_error()

    # --- the applier ----------------------------------------------------------------------
    def _applier(self) -> None:
        pause = 1e-4
        while not self._stop.is_set():
            k = self._ready(self.rank)
            if k is None:
                self._stop.wait(pause)
                # a few ms of latency against steps of 100s of ms; a shorter cap costs a
                # measurable share of a core in wake-ups (bench: 3.5% at 2 ms under load)
                pause = min(pause * 2, 5e-3)
                continue
            pause = 1e-4
            try:
                self._apply_step(self.rank, k, self._apply)
            except BaseException as e:  # noqa: BLE001 - re-raised by the main thread's next call
                self._error = e
                self._ctrl[self.rank][ABORT] = 1
                return

    def raise_error(self) -> None:
        """Re-raise what the applier thread hit, as itself (a ``ValueError`` of disagreeing
        ranks stays one)."""
        if self._error is not None:
            raise self._error

    def service(self) -> int:
        """The applier thread applies; here only its failure surfaces."""
        self.raise_error()
        return 0

    def open(self, j: int, taus: Any) -> None:
        self.raise_error()
        super().open(j, taus)

    # --- waiting ----------------------------------------------------------------------------
    def _aborted(self) -> str | None:
        self.raise_error()
        for p, c in enumerate(self._ctrl):
            if c[ABORT] and p != self.rank:
                return f"rank {p} aborted"
        return None

    def _block(self, pred: Callable[[], bool], what: str) -> None:
        others = [p for p in range(self.mesh.world_size) if p != self.rank]
        wait_until(
            pred,
            timeout=self.timeout,
            what=what,
            check=self._aborted,
            peers=[(p, lambda p=p: int(self._ctrl[p][PID])) for p in others],
            progress=lambda: sum(int(self._ctrl[p][BEAT]) for p in others),
        )

    def beat(self) -> None:
        if self._ctrl:
            self._ctrl[self.rank][BEAT] += 1

    # --- the executor's counters -------------------------------------------------------------
    def fetch_add(self, counter: int, n: int = 1) -> int:
        check_counter(counter, self.max_counters, "ShmTransport (staleness)")
        cell = self._counts[self.j % self.off.C][counter]  # keyed by minibatch: ranks may differ
        with RangeLock(self._segs[0].fd, _COUNTER_LOCK, self.timeout, f"shared counter {counter}"):
            if cell[0] > self.j:  # ranks span at most R minibatches; C = R + 1 slots
                raise TransportError(
                    f"shared counter {counter} already serves minibatch {int(cell[0])}, "
                    f"rank {self.rank} is at {self.j}"
                )
            old = int(cell[1]) if cell[0] == self.j else 0
            cell[0], cell[1] = self.j, old + n
        return old

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
