"""Multi-process ODC on one machine: the CPU analogue of CUDA IPC over /dev/shm.

Each rank owns one shared-memory segment that every peer maps (``shm_layout`` gives its words:
control words, ``fetch_add`` counters, published shards, accumulators, hpZ slices).

- ``gather``: the reader waits until the owner's ``version`` equals this step, then copies the
  owner's shard itself; the owner does nothing (one-sided). The owner writes the shard, then the
  version ("data, then flag": x86-64 keeps stores in order; other architectures are refused at
  construction, ``shm_sync.check_store_order``).
- ``scatter_accumulate``: writer-side ``add_`` into the owner's accumulator, chunk by chunk, each
  chunk under its own kernel byte-range lock (bench/shm_accumulate.py and docs/transports.md
  measure this against an owner-side accumulate thread; plain concurrent ``add_`` loses updates).
- ``begin_step`` zeroes the accumulators before it publishes the new version: a peer pushes into
  a unit only after gathering it at this step's version, so one accumulator buffer suffices.
- ``flush``: point-to-point completion: each client writes "done with step t" into a slot of its
  own in every owner's ``ctrl``; the owner waits for all its clients' slots (no atomics needed).
- ``sync`` (the one global all-reduce), ``all_gather``/``reduce_scatter``/``replica_all_reduce``
  are ``base.StepCollectives`` over ``TorchCollectives`` (gloo) by default, so one transport
  serves ``comm="odc"`` and ``"collective"``; ``collectives="shm"`` runs them over /dev/shm
  instead (``shm_collective.ShmCollectives``: the collective baseline on ODC's own wire).
- ``publish_secondary`` / ``gather_group`` (hierarchical shards, ``shm_hpz``): a rank's slice of
  a unit's k-rank group copy, stamped with its step; the group's peers read it one-sided.
- ``fetch_add``: read-modify-write of one counter of rank 0's segment under a byte-range lock.
  A counter stored at an older step counts as 0 (reset lazily, no zeroing pass; a later step
  is an error). The region is sparse in the file: untouched counters cost no memory.

Segments are created at the first ``begin_step`` (when the layout is known) and again only if the
layout or compute dtype changes: every rank creates its file, all map all files between two
barriers, then each unlinks its own, so nothing is left in /dev/shm even if a rank is killed
later. Waits poll with a short sleep and end in ``TransportError`` when a peer dies (its pid is
in ``ctrl``), aborts (its ``abort`` flag, set when a rank leaves the context on an exception) or
does not answer within ``timeout``.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections import Counter
from collections.abc import Mapping

import numpy as np
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
    world_group,
)
from odcfn.transport.collective import TorchCollectives
from odcfn.transport.shm_collective import ShmCollectives
from odcfn.transport.shm_hpz import ShmSecondary
from odcfn.transport.shm_layout import (
    ABORT,
    ARRIVE,
    BEAT,
    DONE,
    PID,
    VERSION,
    SegLayout,
    describe,
    dtype_code,
)
from odcfn.transport.shm_sync import RangeLock, Segment, check_store_order, map_segments, shm_dir, wait_until
from odcfn.transport.versions import reuse_view
from odcfn.transport.versions_shm import StaleShm

__all__ = ["ShmTransport"]

_COUNTER_LOCK = 0  # lock byte for fetch_add; accumulator chunk locks use byte offsets >= the acc region


class ShmTransport(StepCollectives):
    """The full transport protocol for W local processes: ODC over /dev/shm, collectives and the
    sync over gloo. ``with ShmTransport(odcfn.Mesh.from_env()) as tr: ...``. An existing default
    process group (torchrun's, the caller's) is used; otherwise one is created from the
    torchrun environment (``TorchCollectives``).

    ``chunk_elems``: scatter-accumulate granularity (elements per lock); smaller chunks let more
    writers into one owner's unit at once, larger ones pay fewer lock round trips.
    ``fetch_add`` serves counters ``0 .. max_counters - 1``.
    ``collectives``: ``"gloo"`` (torch.distributed) or ``"shm"`` (``ShmCollectives``: every
    collective a barrier over this machine's shared memory, the same wire as the ODC ops).
    """

    max_counters = MAX_COUNTERS

    def __init__(
        self, mesh: Mesh, *, timeout: float = 60.0, chunk_elems: int = 1 << 16, collectives: str = "gloo"
    ) -> None:
        check_store_order("ShmTransport")  # before any rendezvous: every rank refuses alike
        if not isinstance(chunk_elems, int) or chunk_elems < 1:
            raise ValueError(f"chunk_elems must be a positive int, got {chunk_elems!r}")
        if collectives not in ("gloo", "shm"):
            raise ValueError(f"collectives must be 'gloo' or 'shm', got {collectives!r}")
        if collectives == "shm":
            self.collectives = ShmCollectives(mesh, timeout=timeout)
        else:
            self.collectives = TorchCollectives(mesh, "cpu", backend="gloo", timeout=timeout)
        self.dist = self.collectives  # its former name, still used by bench/shm_accumulate.py
        self.collectives_kind = collectives
        self.mesh, self.timeout, self.chunk = mesh, float(timeout), chunk_elems
        self.counters = Counters()
        self.step = 0
        self.layout: Layout | None = None
        # one name per transport instance, agreed on by all ranks; launch/the test pool set a
        # per-job prefix so they can sweep leftovers of a rank killed during setup
        # (rank 0's random number, summed with zeros: plain tensors, nothing unpickled)
        pick = torch.tensor([secrets.randbits(62) if mesh.rank == 0 else 0], dtype=torch.int64)
        tag = f"{int(self.collectives.all_reduce(world_group(mesh), pick)[0]):016x}"
        self._stem = f"{os.environ.get('ODCFN_SHM_PREFIX', 'odcfn')}-{tag}"
        self._gen = 0
        self._seg: SegLayout | None = None
        self._segs: list[Segment] = []
        self._ctrl: list[np.ndarray] = []
        self._counters: np.ndarray | None = None  # rank 0's (step, value) pairs
        self._pub: list[dict[str, torch.Tensor]] = []
        self._acc: list[dict[str, torch.Tensor]] = []
        self._closed = False
        self._arrivals = 0
        self._stale: StaleShm | None = None
        self._wire = WireState()
        # gathered bytes by source rank: primary shards, and hpZ group shards (gather_group)
        self.peer_bytes: Counter[int] = Counter()
        self.group_bytes: Counter[int] = Counter()
        self._hpz = ShmSecondary(self)

    ordered_versions = True  # versions(..., ordered=True): deterministic accumulation
    supports_wire = True  # begin_step(..., wire=): block-quantized gathers and pushes

    def versions(self, ring: int, start: int, ordered: bool = False) -> StaleShm:
        """This rank's bounded-staleness side (τ >= 1, ``odcfn.transport.versions_shm``), made on
        first use and kept for the transport's life: it holds the owner's version ring.
        ``ordered``: each owner sums a step's pushes in rank order (one part per rank)."""
        self._stale = reuse_view(self._stale, ring, ordered, lambda: StaleShm(self, ring, start, ordered))
        return self._stale

    # --- setup ---------------------------------------------------------------------------------
    def _path(self, rank: int) -> str:
        return os.path.join(shm_dir(), f"{self._stem}-g{self._gen}-r{rank}")

    def _agree(self, seg: SegLayout, dtype: torch.dtype) -> None:
        """Every rank checks that all ranks map the same layout and dtype, before any file
        exists: a disagreement then reads the same on every rank, naming what differs (one
        all-reduce of small integers, exact in float64; only when segments are (re)mapped)."""
        w, r = self.mesh.world_size, self.mesh.rank
        units = [k[0] for k in seg.key[0]]
        digest = hashlib.sha256(repr(seg.key[0]).encode()).digest()
        fmt = seg.key[3]  # the gather format, coded with the dtype: both decide the published bytes
        code = dtype_code(dtype, fmt)
        mine = [float(code), float(len(units)),
                float(sum(seg.sizes.values())), float(int.from_bytes(digest[:6], "little"))]
        vec = torch.zeros(4 * w, dtype=torch.float64)
        vec[4 * r : 4 * r + 4] = torch.tensor(mine, dtype=torch.float64)
        got = self.collectives.all_reduce(world_group(self.mesh), vec).view(w, 4).tolist()
        if len({row[0] for row in got}) > 1:
            names = ", ".join(f"rank {p}: {describe(int(c))}" for p, (c, *_) in enumerate(got))
            raise ValueError("ranks disagree on the compute dtype or StepConfig.gather_format of the "
                             f"published shards ({names})")
        if len({tuple(row[1:]) for row in got}) > 1:
            names = "; ".join(
                f"rank {p}: {int(n)} units, {int(e)} elements per shard"
                for p, (_, n, e, _h) in enumerate(got)
            )
            raise ValueError(
                f"ranks disagree on the parameter layout (a different model, world or sharding?): {names}"
            )

    def _map(self, seg: SegLayout, dtype: torch.dtype) -> None:
        """Create this rank's segment, map every rank's between two barriers, unlink ours."""
        self._release()
        self._agree(seg, dtype)
        self._gen += 1
        w = self.mesh.world_size
        mapped = map_segments(
            self._path, seg.nbytes, self.mesh.rank, range(w), self.collectives.barrier,
            lambda own: own.view(0, DONE + w, torch.int64).__setitem__(PID, os.getpid()),
        )
        segs = [mapped[p] for p in range(w)]
        self._seg, self._segs = seg, segs
        self._arrivals = 0  # syncs counted in these (fresh, zeroed) ctrl words
        self._ctrl = [s.view(0, DONE + w, torch.int64).numpy() for s in segs]
        self._counters = segs[0].view(seg.counters, MAX_COUNTERS * 2, torch.int64).numpy().reshape(-1, 2)
        fmt = seg.key[3]
        sized = (lambda n: (seg.sizes[n], dtype)) if fmt is None else (
            lambda n: (fmt.nbytes(seg.sizes[n]), torch.uint8))
        self._pub = [{n: s.view(o, *sized(n)) for n, o in seg.pub.items()} for s in segs]
        self._acc = [{n: s.view(o, seg.sizes[n], torch.float32) for n, o in seg.acc.items()} for s in segs]

    def _release(self) -> None:
        self._ctrl, self._counters, self._pub, self._acc = [], None, [], []
        for s in self._segs:
            s.close()
        self._segs, self._seg = [], None

    # --- waiting -------------------------------------------------------------------------------
    def _aborted(self) -> str | None:
        for p, c in enumerate(self._ctrl):
            if c[ABORT] and p != self.mesh.rank:
                return f"rank {p} aborted"
        return None

    def _wait(self, pred, what: str, peers: tuple[int, ...]) -> None:
        others = [p for p in peers if p != self.mesh.rank]
        wait_until(
            pred, timeout=self.timeout, what=f"{what} (rank {self.mesh.rank}, step {self.step})",
            check=self._aborted, peers=[(p, lambda p=p: int(self._ctrl[p][PID])) for p in others],
            progress=lambda: sum(int(self._ctrl[p][BEAT]) for p in others),
        )

    def beat(self) -> None:
        """This rank made progress (the executor calls it after each plan step): peers waiting
        on it wait on (``odcfn.transport.heartbeat``). Only this rank writes its own word."""
        if self._ctrl:
            self._ctrl[self.mesh.rank][BEAT] += 1

    def peer_progress(self) -> int:
        """The other ranks' summed progress (their ``beat`` words): a wait outside the transport
        times out from its last change (``odcfn.transport.heartbeat.Patience``)."""
        return sum(int(self._ctrl[p][BEAT]) for p in range(len(self._ctrl)) if p != self.mesh.rank)

    def _need_step(self) -> None:
        if self._seg is None or self.layout is None:
            raise TransportError("begin_step must come before any communication")

    # --- the protocol --------------------------------------------------------------------------
    def begin_step(
        self, layout: Layout, shards: Mapping[str, torch.Tensor], compute_dtype: torch.dtype,
        wire: Wire | None = None,
    ) -> None:
        if self._closed:
            raise TransportError("ShmTransport is closed")
        fmt = self._wire.use(wire).wire.gather_format
        seg = SegLayout.build(layout, compute_dtype, self.mesh.world_size, fmt)
        if self._seg is None or self._seg.key != seg.key:
            self._map(seg, compute_dtype)
        self.layout = layout
        self.step += 1
        r = self.mesh.rank
        for u in layout.units:
            if not u.frozen:
                self._acc[r][u.name].zero_()  # before publishing: see the module docstring
            publish(self._pub[r][u.name], shards[u.name], compute_dtype, fmt)  # in place: sizes agree
        self._ctrl[r][VERSION] = self.step  # data, then flag

    def gather(self, unit: str, out: torch.Tensor) -> Handle:
        self._need_step()
        size, step, me = self.layout[unit].shard_size, self.step, self.mesh.rank
        fmt = self._gather_format()
        for i, owner in enumerate(self.mesh.shard_group):
            if owner != me:
                c = self._ctrl[owner]
                self._wait(lambda c=c: c[VERSION] >= step, f"rank {owner} to publish {unit!r}", (owner,))
            src = self._pub[owner][unit]
            unpublish(src, out[i * size : (i + 1) * size], fmt)
            if owner != me:
                self.counters.gather_bytes += src.numel() * src.element_size()
                self.peer_bytes[owner] += src.numel() * src.element_size()
        self.counters.gathers += 1
        return Done()

    def publish_secondary(self, unit: str, full: torch.Tensor, group: int) -> None:
        """Keep this rank's slice of ``full`` (the unit's gathered copy) as its share of the
        ``group``-rank group shard for this step (``shm_hpz``); again in the same step: a no-op."""
        self._need_step()
        self._hpz.publish(unit, full, group)

    def gather_group(self, unit: str, out: torch.Tensor, group: int) -> Handle:
        """Fill ``out`` from the secondary slices of this rank's ``group``-rank group only."""
        self._need_step()
        return self._hpz.gather(unit, out, group)

    def scatter_accumulate(self, unit: str, grad: torch.Tensor) -> Handle:
        self._need_step()
        size, me, chunk = self.layout[unit].shard_size, self.mesh.rank, self.chunk
        base = self._seg.acc[unit]
        # the rounding a quantized push makes, and its bytes: the writer adds into the mapped
        # accumulator itself, so the format's bytes are what a fabric would carry
        grad, moved = self._wire.push(unit, grad, len(self.mesh.shard_group))
        for i, owner in enumerate(self.mesh.shard_group):
            piece, acc, fd = grad[i * size : (i + 1) * size], self._acc[owner][unit], self._segs[owner].fd
            for lo in range(0, size, chunk):
                hi = min(lo + chunk, size)
                with RangeLock(fd, base + lo * 4, self.timeout, f"rank {owner}'s {unit!r}[{lo}:{hi}]"):
                    acc[lo:hi].add_(piece[lo:hi])
            if owner != me:
                self.counters.scatter_bytes += moved[i]
        self.counters.scatters += 1
        return Done()

    def flush(self) -> None:
        self._need_step()
        me, step, group = self.mesh.rank, self.step, self.mesh.shard_group
        for owner in group:  # our pushes into every owner are done (the lock syscalls fence them)
            self._ctrl[owner][DONE + me] = step
        mine = self._ctrl[me]
        self._wait(
            lambda: all(mine[DONE + c] >= step for c in group),
            "peers to finish pushing into this rank", group,
        )

    def _published(self, unit: str) -> torch.Tensor:
        self._need_step()
        return self._pub[self.mesh.rank][unit]

    def _accumulator(self, unit: str) -> torch.Tensor:
        self._need_step()
        return self._acc[self.mesh.rank][unit]

    def sync(self, stats: torch.Tensor) -> torch.Tensor:
        if self._ctrl and (why := self._aborted()) is not None:  # it left: do not wait for it
            raise TransportError(f"rank {self.mesh.rank}: cannot sync at step {self.step}: {why}")
        if self._ctrl:
            # meet here first, where waiting on a busy peer can be told from waiting on a dead
            # one; the gloo all-reduce below then finds every rank there and its own fixed
            # timeout never runs out on a peer that is only slow
            me, w = self.mesh.rank, self.mesh.world_size
            self._arrivals += 1
            n = self._arrivals
            self._ctrl[me][ARRIVE] = n
            self._wait(lambda: all(self._ctrl[p][ARRIVE] >= n for p in range(w)), "every rank at the sync",
                       tuple(range(w)))
            self._hpz.release()  # every rank is here: done reading this step's hpZ slices
        return super().sync(stats)

    def grad_shards(self) -> dict[str, torch.Tensor]:
        self._need_step()
        return self._acc[self.mesh.rank]

    def fetch_add(self, counter: int, n: int = 1) -> int:
        check_counter(counter, self.max_counters, "ShmTransport")
        self._need_step()
        cell = self._counters[counter]  # (step, value) in rank 0's segment
        with RangeLock(self._segs[0].fd, _COUNTER_LOCK, self.timeout, f"shared counter {counter}"):
            if cell[0] > self.step:  # resetting it would wipe a later step's counts
                raise TransportError(
                    f"rank {self.mesh.rank}: shared counter {counter} is already in use at step "
                    f"{int(cell[0])}, this rank is at step {self.step} (fetch_add after the step's sync?)"
                )
            old = int(cell[1]) if cell[0] == self.step else 0  # a stale step: fresh, i.e. 0
            cell[0], cell[1] = self.step, old + n
        return old

    # --- lifetime ------------------------------------------------------------------------------
    def abort(self) -> None:
        """Tell peers waiting on this rank to give up now rather than at their timeout."""
        if self._ctrl:
            self._ctrl[self.mesh.rank][ABORT] = 1
        if self._stale is not None:
            self._stale.abort()
        getattr(self.collectives, "abort", lambda: None)()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._stale is not None:
            self._stale.close()
        self._release()
        self.collectives.close()

    def __enter__(self) -> ShmTransport:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.abort()
        self.close()

    def __del__(self) -> None:
        try:
            self._release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
