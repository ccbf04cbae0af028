"""A discrete-event simulator of the plans the runtime executes.

It times the *same* ``Plan`` objects ``compile_plan`` produces, step by step, with a cost model
for compute and a bandwidth/latency model for communication, and emits ``odcfn.trace.Event``s
in the runtime's format (so ``bubble_rate``, the Chrome export and the timeline plot work on
both). Work stealing is simulated as a dynamic queue with the runtime's claim order.

Timing rules (per rank: a compute clock and two FIFO communication streams, one pulling
parameters in and one pushing gradients out: links are full duplex, and FSDP2 too runs
all-gathers and reduce-scatters on separate streams):
- ``Gather``/``ScatterAccumulate``: issued without blocking compute; the transfer starts when its
  stream is free and takes ``latency + bytes * (S-1)/S / bandwidth`` (S = shard-group size;
  inter-node bandwidth when the group spans nodes). Owners do nothing and nobody waits for them.
- ``Forward``/``Backward`` of a unit start when the compute clock is free and the unit's latest
  gather has landed; they take ``cost(microbatch) * unit share * (fwd_fraction | 1 -
  fwd_fraction)`` (backward of a remat unit adds its forward again). A rank slowed by ``F`` idles
  ``(F - 1) x`` each compute step afterwards, recorded as a ``straggle`` event, as the runtime's
  ``slowdown`` does.
- ``AllGather``/``ReduceScatter``: a collective cannot start before every rank of the shard group
  has issued it (max of arrivals); it then occupies every member's stream for the same time.
- ``Sync``: every rank's pushes must have landed; ends ``2 log2(W)`` latencies after the last
  arrival. Step time = the sync's end.
Not modelled: link contention between concurrent point-to-point transfers, kernel launch costs,
hybrid sharding's replica all-reduce inside the sync (groups follow the mesh, bytes do not).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

from odcfn.schedule.balance import work_stealing_items
from odcfn.schedule.cost import DEFAULT_COST, CostModel
from odcfn.schedule.plan import (
    AllGather,
    Assignment,
    Backward,
    Comm,
    Forward,
    Gather,
    Plan,
    ReduceScatter,
    Release,
    ScatterAccumulate,
    ScheduleOptions,
    Sync,
    compile_plan,
    stealing_fragment,
)
from odcfn.schedule.simmodel import (
    A100_COMM,
    ZERO_COMM,
    CommModel,
    SimResult,
    Workload,
    check_slowdowns,
    lower_bound_makespan,
)
from odcfn.sharding import Mesh
from odcfn.trace import Event

__all__ = [
    "A100_COMM",
    "ZERO_COMM",
    "CommModel",
    "compile_plans",
    "SimResult",
    "Workload",
    "lower_bound_makespan",
    "simulate",
    "simulate_work_stealing",
]


# --- the engine ---------------------------------------------------------------------------

_GATHER, _FWD, _BWD, _SCATTER, _RELEASE, _AG, _RS, _SYNC = range(8)
_CODE = {
    Gather: _GATHER,
    Forward: _FWD,
    Backward: _BWD,
    ScatterAccumulate: _SCATTER,
    Release: _RELEASE,
    AllGather: _AG,
    ReduceScatter: _RS,
    Sync: _SYNC,
}
_KIND = ("gather", "forward", "backward", "scatter", "release", "collective", "collective", "sync")


class _Rank:
    """One rank's clocks while it runs a stream of steps."""

    __slots__ = ("busy", "events", "pull", "push", "ready", "remat", "slow", "t")

    def __init__(self, n_units: int, slow: float, record: bool) -> None:
        self.t = 0.0  # compute clock: when the next step can be issued
        self.pull = 0.0  # the gather stream is free from here
        self.push = 0.0  # the scatter stream is free from here
        self.ready = [0.0] * n_units  # when each unit's latest gather lands
        self.remat = [False] * n_units
        self.busy = 0.0
        self.slow = slow
        self.events: list[Event] | None = [] if record else None


class _Engine:
    def __init__(self, work: Workload, mesh: Mesh, comm: CommModel, record: bool) -> None:
        self.work, self.mesh, self.comm, self.record = work, mesh, comm, record
        self.index = {u: i for i, u in enumerate(work.units)}
        shares = work.shares()
        self.fwd_share = [s * work.fwd_fraction for s in shares]
        self.bwd_share = [s * (1.0 - work.fwd_fraction) for s in shares]
        group = mesh.shard_count
        spans = group > mesh.node_size
        pbytes = work.per_unit(work.param_bytes)
        gbytes = work.per_unit(work.param_bytes if work.grad_bytes is None else work.grad_bytes)
        self.gather_time = [comm.transfer(b, group, spans) for b in pbytes]
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
                        getattr(s, "remat", False),
                    )
                    for s in steps
                ]
            except KeyError as e:
                raise ValueError(
                    f"plan step refers to unit {e.args[0]!r}, not in the workload {self.work.units}"
                ) from None
            self._codes[key] = hit
        return hit

    def run(
        self, r: int, st: _Rank, codes: list, pc: int, mb_cost: Sequence[float], mb_shift: int = 0
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
                c = mb_cost[mb]
                if code == _FWD:
                    dur = c * self.fwd_share[u]
                    st.remat[u] = remat
                else:
                    dur = c * self.bwd_share[u] + (c * self.fwd_share[u] if st.remat[u] else 0.0)
                end = start + dur
                st.busy += dur
                st.t = end + (slow - 1.0) * dur
                if ev is not None:
                    ev.append(Event(r, _KIND[code], self.work.units[u], start, end, mb + mb_shift))
                    if slow > 1.0:
                        ev.append(Event(r, "straggle", self.work.units[u], end, st.t, mb + mb_shift))
            elif code == _GATHER:
                start = st.t if st.t >= st.pull else st.pull
                st.pull = st.ready[u] = end = start + self.gather_time[u]
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

    def arrive(self, st: _Rank, code: int) -> float:
        """When this rank can start the collective (``code``): compute has issued it and the
        stream it runs on is free (the sync also waits for both streams: flush)."""
        if code == _AG:
            return max(st.t, st.pull)
        if code == _RS:
            return max(st.t, st.push)
        return max(st.t, st.pull, st.push)

    def finish(self, r: int, st: _Rank, code: int, u: int, start: float, arrival: float) -> None:
        """Complete a collective (or the sync) that started at ``start`` for rank ``r``."""
        if code == _SYNC:
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


def _mesh_for(mesh: Mesh | None, world: int) -> Mesh:
    if mesh is None:
        return Mesh(world)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be an odcfn.Mesh, got {type(mesh).__name__}")
    if mesh.world_size != world:
        raise ValueError(f"mesh has world_size={mesh.world_size} but {world} plans were given")
    return mesh


def simulate(
    plans: Sequence[Plan],
    lengths: Sequence[int],
    *,
    workload: Workload | None = None,
    cost: CostModel = DEFAULT_COST,
    comm: CommModel = ZERO_COMM,
    mesh: Mesh | None = None,
    slowdown: Sequence[float] | None = None,
    record: bool = True,
) -> SimResult:
    """Time one minibatch: ``plans[r]`` is rank r's plan (as from ``compile_plan``)."""
    if not plans:
        raise ValueError("simulate needs at least one plan")
    for r, p in enumerate(plans):
        if not isinstance(p, Plan) or p.rank != r:
            raise ValueError(
                f"plans[{r}] must be rank {r}'s Plan, got {type(p).__name__} "
                f"for rank {getattr(p, 'rank', '?')}"
            )
    world = len(plans)
    mesh = _mesh_for(mesh, world)
    work = workload or Workload(plans[0].units)
    eng = _Engine(work, mesh, comm, record)
    ranks = [_Rank(len(work.units), f, record) for f in check_slowdowns(slowdown, world)]
    codes = [eng.codes(p.steps) for p in plans]
    mb_costs = [[sum(cost(lengths[i]) for i in mb) for mb in p.microbatches] for p in plans]
    # groups by small int ids (hashing a 1024-tuple per step would dominate the run time)
    groups: list[tuple[int, ...]] = [tuple(range(world))]
    gid_of: dict[tuple[int, ...], int] = {groups[0]: 0}
    shard_gid = []
    for r in range(world):
        g = mesh.with_rank(r).shard_group
        if g not in gid_of:
            gid_of[g] = len(groups)
            groups.append(g)
        shard_gid.append(gid_of[g])
    pcs = [0] * world
    arrived: dict[int, list[int]] = {}  # group id -> ranks parked at its next collective
    full: deque[int] = deque()

    def advance(r: int, pc: int) -> None:
        pcs[r] = pc = eng.run(r, ranks[r], codes[r], pc, mb_costs[r])
        if pc < len(codes[r]):  # parked at a collective or the sync
            gid = 0 if codes[r][pc][0] == _SYNC else shard_gid[r]
            parked = arrived.get(gid)
            if parked is None:
                parked = arrived[gid] = []
            parked.append(r)
            if len(parked) == len(groups[gid]):
                full.append(gid)

    for r in range(world):
        advance(r, 0)
    while full:
        gid = full.popleft()
        group = groups[gid]
        members = sorted(arrived.pop(gid))
        code, u = codes[members[0]][pcs[members[0]]][:2]
        if any(codes[m][pcs[m]][:2] != (code, u) for m in members):
            stuck = {m: plans[m].steps[pcs[m]] for m in members}
            raise ValueError(
                f"plans disagree: ranks {list(group)} meet at different collectives {stuck}; "
                "collective plans must issue the same collectives in the same order"
            )
        arrivals = [eng.arrive(ranks[m], code) for m in members]
        start = max(arrivals)
        for m, t in zip(members, arrivals):
            eng.finish(m, ranks[m], code, u, start, t)
        for m in members:
            advance(m, pcs[m] + 1)
    if arrived:
        stuck = {r: plans[r].steps[pcs[r]] for rs in arrived.values() for r in rs}
        raise ValueError(f"plans deadlock: ranks wait forever at {stuck} (a peer never issues it)")
    return _result(plans, ranks, lengths)


def _result(plans: Sequence[Plan], ranks: Sequence[_Rank], lengths: Sequence[int]) -> SimResult:
    ids = [i for p in plans for mb in p.microbatches for i in mb]
    return SimResult(
        plans=tuple(plans),
        events=tuple(tuple(st.events or ()) for st in ranks),
        makespan=max(st.t for st in ranks),
        busy=tuple(st.busy for st in ranks),
        num_samples=len(ids),
        num_tokens=sum(lengths[i] for i in ids),
    )


def simulate_work_stealing(
    lengths: Sequence[int],
    world_size: int,
    *,
    workload: Workload,
    cost: CostModel = DEFAULT_COST,
    items: Sequence[Sequence[int]] | None = None,
    max_tokens: int | None = None,
    split_tail: float = 1.0,
    options: ScheduleOptions | None = None,
    comm: CommModel = ZERO_COMM,
    mesh: Mesh | None = None,
    slowdown: Sequence[float] | None = None,
    record: bool = True,
) -> SimResult:
    """Work stealing as the runtime does it: the work items (microbatches of one or a few
    samples) wait in one queue (``items``; default ``work_stealing_items(lengths, cost,
    world_size=world_size, max_tokens=max_tokens, split_tail=split_tail)``); whenever a rank is
    free it claims the next one and runs it as a one-microbatch fragment; when the queue is
    empty it goes to the Sync. Ties (ranks free at the same time): lowest rank first."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if items is None:
        items = work_stealing_items(
            lengths, cost, world_size=world_size, max_tokens=max_tokens, split_tail=split_tail
        )
    items = tuple(tuple(it) for it in items)
    if sorted(i for it in items for i in it) != list(range(len(lengths))) or not all(items):
        raise ValueError("work items must be non-empty and hold every sample id exactly once")
    mesh = _mesh_for(mesh, world_size)
    eng = _Engine(workload, mesh, comm, record)
    ranks = [_Rank(len(workload.units), f, record) for f in check_slowdowns(slowdown, world_size)]
    codes = eng.codes(stealing_fragment(workload.units, (0,), 0, options))
    claims: list[list[tuple[int, ...]]] = [[] for _ in range(world_size)]
    free = [(0.0, r) for r in range(world_size)]
    for item in items:
        _, r = heapq.heappop(free)
        st = ranks[r]
        k = len(claims[r])
        claims[r].append(item)
        # the fragment's steps say mb 0; its events say mb k: this rank's k-th claim
        eng.run(r, st, codes, 0, (sum(cost(lengths[i]) for i in item),), mb_shift=k)
        heapq.heappush(free, (st.t, r))
    arrivals = [eng.arrive(st, _SYNC) for st in ranks]
    start = max(arrivals)
    for r, (st, a) in enumerate(zip(ranks, arrivals)):
        eng.finish(r, st, _SYNC, -1, start, a)
    plans = tuple(
        Plan(
            r,
            "odc",
            workload.units,
            tuple(claims[r]),
            _realised(workload.units, claims[r], options) if record else (),
        )
        for r in range(world_size)
    )
    return _result(plans, ranks, lengths)


def _realised(
    units: Sequence[str], claimed: Sequence[Sequence[int]], options: ScheduleOptions | None
) -> tuple:
    steps: list = []
    for k, item in enumerate(claimed):
        steps += stealing_fragment(units, item, k, options)
    return (*steps, Sync())


def compile_plans(
    units: Sequence[str],
    assignment: Assignment,
    comm: Comm = "odc",
    options: ScheduleOptions | None = None,
) -> tuple[Plan, ...]:
    """Every rank's ``compile_plan``, compiled once per distinct microbatch count: a plan's
    steps depend only on how many microbatches it has, so ranks share the step tuples (equal to
    what ``compile_plan`` returns rank by rank, and much cheaper at 1024 ranks)."""
    n_max = max((len(a) for a in assignment), default=0)
    cache: dict[int, tuple] = {}
    plans = []
    for r, mbs in enumerate(assignment):
        mbs = tuple(tuple(m) for m in mbs)
        if comm == "collective":
            mbs = mbs + ((),) * (n_max - len(mbs))
        steps = cache.get(len(mbs))
        if steps is None:
            template = (tuple((0,) for _ in range(len(mbs))),)
            steps = cache[len(mbs)] = compile_plan(units, template, 0, comm, options).steps
        plans.append(Plan(r, comm, tuple(units), mbs, steps))
    return tuple(plans)
