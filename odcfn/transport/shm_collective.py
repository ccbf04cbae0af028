"""Collectives over /dev/shm: the collective FSDP baseline on the same wire as ODC.

``ShmCollectives`` implements the ``Collectives`` protocol with the shared-memory mappings and
the bounded waits of ``ShmTransport`` (``shm_sync``), so that ``ShmTransport(mesh,
collectives="shm")`` runs ``comm="collective"`` with the same bytes over the same memory as
``comm="odc"``. Only the synchronisation differs: every collective is a barrier of its group.
That isolates what ODC's removal of per-layer barriers buys from what shared memory buys
over gloo's sockets.

Per rank, one control segment (``ctrl``: pid, abort flag, one arrival counter per group) and,
per group, a staging segment with two buffers used alternately. Call ``n`` of a group:

- write this rank's input into its staging buffer ``n % 2``;
- arrive (``ctrl[group] = n``, after the data: x86-64 keeps stores in order) and wait until
  every member has arrived at ``n``;
- read what the operation needs from the members' buffers ``n % 2``:
  all-gather copies every member's block; reduce-scatter sums the members' slices of this
  rank's block; all-reduce sums the members' whole buffers -- always in group order, so the
  result does not depend on timing and every rank of an all-reduce gets the same bits.

One barrier per call suffices: a rank writes buffer ``n % 2`` again only at call ``n + 2``,
after it has passed barrier ``n + 1``, which every member reaches only after its reads of call
``n``. A staging buffer too small for a call is replaced by a larger one by every member at
once (they all see the same sizes: a collective's sizes agree across its group), between two
barriers; files are unlinked right after mapping (nothing survives a crash).
"""

from __future__ import annotations

import os
import secrets
from collections import Counter

import torch

from odcfn.sharding import Mesh
from odcfn.transport.base import TransportError, mesh_groups, world_group
from odcfn.transport.collective import TorchCollectives
from odcfn.transport.shm_sync import Segment, check_store_order, map_segments, shm_dir, wait_until

__all__ = ["ShmCollectives"]

PID, ABORT, ARRIVED = 0, 1, 8  # ctrl int64 words; ARRIVED + g: arrival count of group g
_ALIGN = 64
_MIN_STAGING = 1 << 16  # bytes per buffer at first use; grows to the largest call


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Staging:
    """One group's two staging buffers on every member (mapped), and their capacity."""

    def __init__(self, segs: dict[int, Segment], capacity: int) -> None:
        self.segs, self.capacity = segs, capacity

    def buf(self, rank: int, which: int, nbytes: int) -> torch.Tensor:
        off = which * _align(self.capacity)
        return self.segs[rank].bytes[off : off + nbytes]

    def close(self) -> None:
        for s in self.segs.values():
            s.close()
        self.segs = {}


class _Alone:
    """The staging of a group of one: this rank's own input."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x.reshape(-1).view(torch.uint8)

    def buf(self, rank: int, which: int, nbytes: int) -> torch.Tensor:
        return self.x[:nbytes]


class ShmCollectives:
    """``Collectives`` for W local processes over /dev/shm. Construct on every rank in the same
    order (it agrees on a name and maps the control segments over a gloo ``TorchCollectives``,
    ``self.bootstrap``, which it closes on ``close``). ``calls`` counts the collectives issued,
    by op name, as ``TorchCollectives`` does."""

    def __init__(self, mesh: Mesh, *, timeout: float = 60.0) -> None:
        check_store_order("ShmCollectives")  # its arrival counters are flags written after data
        self.bootstrap = TorchCollectives(mesh, "cpu", backend="gloo", timeout=timeout)
        self.mesh, self.timeout = mesh, float(timeout)
        self.calls: Counter[str] = Counter()
        self.groups = [world_group(mesh), *(g for g in mesh_groups(mesh) if g != world_group(mesh))]
        self._gid = {g: i for i, g in enumerate(self.groups)}
        self._epoch = [0] * len(self.groups)  # this rank's calls per group so far
        self._staging: dict[int, _Staging] = {}
        self._gen = 0
        pick = torch.tensor([secrets.randbits(62) if mesh.rank == 0 else 0], dtype=torch.int64)
        tag = f"{int(self.bootstrap.all_reduce(world_group(mesh), pick)[0]):016x}"
        self._stem = f"{os.environ.get('ODCFN_SHM_PREFIX', 'odcfn')}-{tag}-coll"
        words = ARRIVED + len(self.groups)
        self._ctrl_segs = self._map_all("ctrl", words * 8, world_group(mesh), self.bootstrap.barrier)
        self._ctrl = {p: s.view(0, words, torch.int64).numpy() for p, s in self._ctrl_segs.items()}
        self._ctrl[mesh.rank][PID] = os.getpid()
        self.bootstrap.barrier()  # every pid is published before anyone waits on it
        self._closed = False

    # --- mapping ------------------------------------------------------------------------------
    def _path(self, what: str, rank: int) -> str:
        return os.path.join(shm_dir(), f"{self._stem}-{what}-r{rank}")

    def _map_all(self, what: str, nbytes: int, group: tuple[int, ...], barrier) -> dict[int, Segment]:
        """Create this rank's file, map every member's between two ``barrier()``s, remove all
        members' files (a member killed in between leaves nothing behind)."""
        return map_segments(lambda p: self._path(what, p), nbytes, self.mesh.rank, group, barrier)

    def _stage(self, gid: int, nbytes: int) -> _Staging:
        st = self._staging.get(gid)
        if st is not None and st.capacity >= nbytes:
            return st
        # every member of the group needs the same size now: grow together, between barriers
        cap = max(_MIN_STAGING, 1 << max(nbytes - 1, 1).bit_length())
        if st is not None:
            cap = max(cap, 2 * st.capacity)
            st.close()  # peers keep their own mappings of our old file until they replace them
        self._gen += 1
        group = self.groups[gid]
        segs = self._map_all(f"g{gid}-s{self._gen}", 2 * _align(cap), group,
                             lambda: self._arrive(gid, "staging setup"))
        self._staging[gid] = _Staging(segs, cap)
        return self._staging[gid]

    # --- the barrier --------------------------------------------------------------------------
    def _aborted(self) -> str | None:
        for p, c in self._ctrl.items():
            if p != self.mesh.rank and c[ABORT]:
                return f"rank {p} aborted"
        return None

    def _arrive(self, gid: int, op: str) -> int:
        """Arrive at this group's next barrier and wait for every member; returns its number."""
        self._epoch[gid] += 1
        n, me, group = self._epoch[gid], self.mesh.rank, self.groups[gid]
        slot = ARRIVED + gid
        self._ctrl[me][slot] = n  # after this rank's data (x86-64 keeps stores in order)
        ctrl = self._ctrl
        try:
            wait_until(
                lambda: all(ctrl[p][slot] >= n for p in group),
                timeout=self.timeout, what=f"{op} #{n} of group {group} (rank {me})",
                check=self._aborted,
                peers=[(p, lambda p=p: int(ctrl[p][PID])) for p in group if p != me],
            )
        except TransportError as e:
            late = [p for p in group if ctrl[p][slot] < n]
            who = f"rank {late[0]}" if len(late) == 1 else f"ranks {', '.join(map(str, late))}"
            raise TransportError(f"{e}; not arrived: {who}") from None
        return n

    def _begin(self, group: tuple[int, ...], op: str) -> int | None:
        """The group's id; None for this rank alone (nothing to wait for)."""
        if self._closed:
            raise TransportError("ShmCollectives is closed")
        group = tuple(group)
        if group == (self.mesh.rank,):
            return None
        if group not in self._gid:
            raise ValueError(f"{group} is not a group of {self.mesh}")
        if self.mesh.rank not in group:
            raise ValueError(f"rank {self.mesh.rank} is not in group {group} ({op})")
        return self._gid[group]

    def _exchange(self, gid: int | None, x: torch.Tensor, op: str) -> tuple[_Staging, int, int]:
        """Write ``x`` into this rank's buffer of the coming call and pass the barrier;
        returns the staging, which buffer, and the byte count."""
        x = x.detach().contiguous()
        nbytes = x.numel() * x.element_size()
        if gid is None:  # a group of one: its own input is the whole exchange
            self.calls[op] += 1
            return _Alone(x), 0, nbytes
        st = self._stage(gid, nbytes)
        which = (self._epoch[gid] + 1) % 2
        st.buf(self.mesh.rank, which, nbytes).view(x.dtype).copy_(x.reshape(-1))
        self._arrive(gid, op)
        self.calls[op] += 1
        return st, which, nbytes

    # --- Collectives --------------------------------------------------------------------------
    def all_gather(self, group: tuple[int, ...], mine: torch.Tensor, out: torch.Tensor) -> None:
        gid = self._begin(group, "all_gather")
        if out.numel() != mine.numel() * len(group) or out.dtype != mine.dtype:
            raise ValueError(f"all_gather: out must hold {len(group)} x {mine.numel()} {mine.dtype}, "
                             f"got {out.numel()} {out.dtype}")
        st, which, nbytes = self._exchange(gid, mine, "all_gather")
        flat, k = out.view(-1), mine.numel()
        for i, p in enumerate(group):
            flat[i * k : (i + 1) * k].copy_(st.buf(p, which, nbytes).view(mine.dtype))

    def reduce_scatter(self, group: tuple[int, ...], grad: torch.Tensor, out: torch.Tensor) -> None:
        gid = self._begin(group, "reduce_scatter")
        k = out.numel()
        if grad.numel() != k * len(group):
            raise ValueError(
                f"reduce_scatter: grad must hold {len(group)} x {k} elements, got {grad.numel()}"
            )
        g = grad.to(out.dtype)
        st, which, nbytes = self._exchange(gid, g, "reduce_scatter")
        i = group.index(self.mesh.rank)
        flat = out.view(-1)
        for j, p in enumerate(group):  # group order: the same sum whatever the timing
            piece = st.buf(p, which, nbytes).view(out.dtype)[i * k : (i + 1) * k]
            if j == 0:
                flat.copy_(piece)
            else:
                flat.add_(piece)

    def all_reduce(self, group: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
        gid = self._begin(group, "all_reduce")
        st, which, nbytes = self._exchange(gid, x, "all_reduce")
        total = torch.empty(x.numel(), dtype=x.dtype)
        for j, p in enumerate(group):  # group order: every rank gets the same bits
            piece = st.buf(p, which, nbytes).view(x.dtype)
            if j == 0:
                total.copy_(piece)
            else:
                total.add_(piece)
        return total.view(x.shape).to(x.device)

    def barrier(self) -> None:
        gid = self._begin(world_group(self.mesh), "barrier")
        if gid is not None:
            self._arrive(gid, "barrier")
        self.calls["barrier"] += 1

    # --- lifetime -----------------------------------------------------------------------------
    def abort(self) -> None:
        """Tell peers waiting in a collective for this rank to give up now."""
        if not self._closed:
            self._ctrl[self.mesh.rank][ABORT] = 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for st in self._staging.values():
            st.close()
        self._staging = {}
        self._ctrl = {}
        for s in self._ctrl_segs.values():
            s.close()
        self._ctrl_segs = {}
        self.bootstrap.close()
