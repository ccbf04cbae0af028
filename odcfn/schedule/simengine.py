"""The simulator's engine: one rank's clocks and how each plan step advances them.

Timing rules (per rank: a compute clock and two FIFO communication streams, one pulling
parameters in and one pushing gradients out: links are full duplex, and FSDP2 too runs
all-gathers and reduce-scatters on separate streams):
- ``Gather``/``ScatterAccumulate``: issued without blocking compute; the transfer starts when its
  stream is free and takes ``latency + bytes * (S-1)/S / bandwidth`` (S = shard-group size;
  inter-node bandwidth when the group spans nodes). Owners do nothing and nobody waits for them.
  A ``Gather`` from a hierarchical shard group (``group=k``, hpZ) is the same transfer over the
  k-rank group: S = k, inter-node only if the group spans nodes (the same rule as hybrid
  sharding's shard group); its ``Reshard`` frees like a ``Release`` (the slice copy is local).
- ``Forward``/``Backward`` of a unit start when the compute clock is free and the unit's latest
  gather has landed; they take ``cost(microbatch) * unit share * (fwd_fraction | 1 -
  fwd_fraction)`` (backward of a remat unit adds its forward again). A rank slowed by ``F``
  computes ``F x`` as long (busy time), as ``odcfn.models.slow.slow_model`` makes a runtime rank do.
- ``AllGather``/``ReduceScatter``: a collective cannot start before every rank of the shard group
  has issued it (max of arrivals); it then occupies every member's stream for the same time.
- ``Sync``: every rank's pushes must have landed; ends ``2 log2(W)`` latencies after the last
  arrival. Step time = the sync's end.
Not modelled: link contention between concurrent point-to-point transfers, kernel launch costs,
hybrid sharding's replica all-reduce inside the sync (groups follow the mesh, bytes do not).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from odcfn.schedule.plan import (
    AllGather,
    Backward,
    Forward,
    Gather,
    Plan,
    ReduceScatter,
    Release,
    Reshard,
    ScatterAccumulate,
    Sync,
)
from odcfn.schedule.simmodel import CommModel, SimResult, Workload
from odcfn.sharding import Mesh
from odcfn.trace import Event

_GATHER, _FWD, _BWD, _SCATTER, _RELEASE, _AG, _RS, SYNC = range(8)
__all__ = ["SYNC", "Engine", "RankClock", "mesh_for", "sim_result"]
_CODE = {
    Gather: _GATHER,
    Forward: _FWD,
    Backward: _BWD,
    ScatterAccumulate: _SCATTER,
    Release: _RELEASE,
    Reshard: _RELEASE,
    AllGather: _AG,
    ReduceScatter: _RS,
    Sync: SYNC,
}
_KIND = ("gather", "forward", "backward", "scatter", "release", "collective", "collective", "sync")


class RankClock:
    """One rank's clocks while it runs a stream of steps."""

    __slots__ = ("arrival", "busy", "events", "pull", "push", "ready", "remat", "slow", "t")

    def __init__(self, n_units: int, slow: float, record: bool) -> None:
        self.t = 0.0  # compute clock: when the next step can be issued
        self.pull = 0.0  # the gather stream is free from here
        self.push = 0.0  # the scatter stream is free from here
        self.ready = [0.0] * n_units  # when each unit's latest gather lands
        self.remat = [False] * n_units
        self.busy = 0.0
        self.arrival = 0.0  # when it reached the sync with its pushes landed (bounded staleness
        # chains minibatches from these: odcfn.schedule.simstale)
        self.slow = slow
        self.events: list[Event] | None = [] if record else None


class Engine:
    def __init__(self, work: Workload, mesh: Mesh, comm: CommModel, record: bool) -> None:
        self.work, self.mesh, self.comm, self.record = work, mesh, comm, record
        self.index = {u: i for i, u in enumerate(work.units)}
        self.deps: list[tuple[int, ...]] = [()] * len(work.units)  # units a unit also reads (tied)
        shares = work.shares()
        self.fwd_share = [s * work.fwd_fraction for s in shares]
        self.bwd_share = [s * (1.0 - work.fwd_fraction) for s in shares]
        group = mesh.shard_count
        spans = group > mesh.node_size
        pbytes = work.per_unit(work.param_bytes)
        gbytes = work.per_unit(work.param_bytes if work.grad_bytes is None else work.grad_bytes)
        self.gather_time = [comm.transfer(b, group, spans) for b in pbytes]
        self._pbytes = pbytes
        self._group_time: dict[int, list[float]] = {}  # hpZ group size -> per-unit gather time
        self.scatter_time = [comm.transfer(b, group, spans) for b in gbytes]
        self.sync_time = comm.sync_time(mesh.world_size, mesh.num_nodes > 1)
        self._codes: dict[int, list[tuple[int, int, int, bool]]] = {}

    def codes(self, steps: Sequence) -> list[tuple[int, int, int, bool]]:
        key = id(steps)
        hit = self._codes.get(key)
        if hit is None:
            try:
                hit = [
                    (
                        _CODE[type(s)],
                        self.index[s.unit] if hasattr(s, "unit") else -1,
                        getattr(s, "mb", -1),
                        # a compute step's remat flag; a gather's hpZ group size (0: owners)
                        getattr(s, "remat", False) or getattr(s, "group", 0),
                    )
                    for s in steps
                ]
            except KeyError as e:
                raise ValueError(
                    f"plan step refers to unit {e.args[0]!r}, not in the workload {self.work.units}"
                ) from None
            for s in steps:  # a tied unit's compute also waits for the gather of what it uses
                if getattr(s, "uses", ()):
                    self.deps[self.index[s.unit]] = tuple(self.index[v] for v in s.uses)
            self._codes[key] = hit
        return hit

    def run(
        self, r: int, st: RankClock, codes: list, pc: int, mb_cost: Sequence[float], mb_shift: int = 0
    ) -> int:
        """Advance rank ``r`` from step ``pc`` until it must wait for others (a collective or
        the sync; returns that step's index) or the steps run out (returns ``len(codes)``)."""
        ev = st.events
        slow = st.slow
        n = len(codes)
        while pc < n:
            code, u, mb, remat = codes[pc]
            if code == _FWD or code == _BWD:
                start = st.t if st.t >= st.ready[u] else st.ready[u]
                for v in self.deps[u]:
                    if st.ready[v] > start:
                        start = st.ready[v]
                c = mb_cost[mb]
                if code == _FWD:
                    dur = c * self.fwd_share[u]
                    st.remat[u] = remat
                else:
                    dur = c * self.bwd_share[u] + (c * self.fwd_share[u] if st.remat[u] else 0.0)
                dur *= slow  # a slow device computes longer: busy time, not a bubble
                st.t = end = start + dur
                st.busy += dur
                if ev is not None:
                    ev.append(Event(r, _KIND[code], self.work.units[u], start, end, mb + mb_shift))
            elif code == _GATHER:
                start = st.t if st.t >= st.pull else st.pull
                took = self.group_gather_time(remat)[u] if remat else self.gather_time[u]
                st.pull = st.ready[u] = end = start + took
                if ev is not None:
                    ev.append(Event(r, _KIND[code], self.work.units[u], start, end))
            elif code == _SCATTER:
                start = st.t if st.t >= st.push else st.push
                st.push = end = start + self.scatter_time[u]
                if ev is not None:
                    ev.append(Event(r, _KIND[code], self.work.units[u], start, end))
            elif code == _RELEASE:
                if st.ready[u] > st.t:  # the runtime waits for a pending gather before freeing
                    st.t = st.ready[u]
                if ev is not None:
                    ev.append(Event(r, "release", self.work.units[u], st.t, st.t))
            else:
                return pc
            pc += 1
        return pc

    def group_gather_time(self, k: int) -> list[float]:
        """Per unit: a gather from the k-rank secondary shards of hierarchical sharding (hpZ)."""
        hit = self._group_time.get(k)
        if hit is None:
            spans = k > self.mesh.node_size
            hit = self._group_time[k] = [self.comm.transfer(b, k, spans) for b in self._pbytes]
        return hit

    def fragment_time(self, codes: list) -> float:
        """How long a fragment of zero compute keeps an idle rank busy: what its transfers add
        to a stolen sample beyond the sample's own compute (an upper bound: compute hides
        some of it)."""
        st = RankClock(len(self.work.units), 1.0, False)
        self.run(0, st, codes, 0, (0.0,))
        return max(st.t, st.pull, st.push)

    def hiding_cost(self) -> float:
        """The smallest sample cost whose per-unit compute covers every unit's transfer, so a
        microbatch of that one sample hides its gathers and pushes behind compute."""
        comm = max(self.gather_time + self.scatter_time, default=0.0)
        if comm <= 0.0:
            return 0.0
        share = min(self.fwd_share + self.bwd_share)
        return comm / share if share > 0.0 else math.inf

    def arrive(self, st: RankClock, code: int) -> float:
        """When this rank can start the collective (``code``): compute has issued it and the
        stream it runs on is free (the sync also waits for both streams: flush)."""
        if code == _AG:
            return max(st.t, st.pull)
        if code == _RS:
            return max(st.t, st.push)
        return max(st.t, st.pull, st.push)

    def finish(self, r: int, st: RankClock, code: int, u: int, start: float, arrival: float) -> None:
        """Complete a collective (or the sync) that started at ``start`` for rank ``r``."""
        if code == SYNC:
            st.arrival = arrival
            end = start + self.sync_time
            st.t = st.pull = st.push = end
            if st.events is not None:
                st.events.append(Event(r, "sync", "", arrival, end))
            return
        if code == _AG:
            st.pull = st.ready[u] = end = start + self.gather_time[u]
        else:
            st.push = end = start + self.scatter_time[u]
        if st.events is not None:
            st.events.append(Event(r, "collective", self.work.units[u], start, end))


def mesh_for(mesh: Mesh | None, world: int) -> Mesh:
    if mesh is None:
        return Mesh(world)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be an odcfn.Mesh, got {type(mesh).__name__}")
    if mesh.world_size != world:
        raise ValueError(f"mesh has world_size={mesh.world_size} but {world} plans were given")
    return mesh


def sim_result(plans: Sequence[Plan], ranks: Sequence[RankClock], lengths: Sequence[int]) -> SimResult:
    ids = [i for p in plans for mb in p.microbatches for i in mb]
    return SimResult(
        plans=tuple(plans),
        events=tuple(tuple(st.events or ()) for st in ranks),
        makespan=max(st.t for st in ranks),
        busy=tuple(st.busy for st in ranks),
        arrivals=tuple(st.arrival for st in ranks),
        num_samples=len(ids),
        num_tokens=sum(lengths[i] for i in ids),
    )


