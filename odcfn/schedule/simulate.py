"""A discrete-event simulator of the plans the runtime executes.

It times the *same* ``Plan`` objects ``compile_plan`` produces, step by step, with a cost model
for compute and a bandwidth/latency model for communication, and emits ``odcfn.trace.Event``s
in the runtime's format (so ``bubble_rate``, the Chrome export and the timeline plot work on
both). Work stealing runs the runtime's own decision code (``odcfn.schedule.steal``).

The timing rules are in ``odcfn.schedule.simengine``.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

import numpy as np

from odcfn.schedule.cost import DEFAULT_COST, CostModel
from odcfn.schedule.plan import (
    Assignment,
    Comm,
    Plan,
    ScheduleOptions,
    action_pieces,
    compile_plan,
    owner_steps,
    realised_plan,
    stealing_fragment,
)
from odcfn.schedule.simengine import SYNC, Engine, RankClock, mesh_for, sim_result
from odcfn.schedule.simmodel import (
    A100_COMM,
    ZERO_COMM,
    CommModel,
    SimResult,
    Workload,
    check_slowdowns,
    lower_bound_makespan,
)
from odcfn.schedule.steal import DEFAULT_TOLERANCE, ArrayCounters, StealPlan, rank_program, steal_plan
from odcfn.sharding import Mesh

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
    mesh = mesh_for(mesh, world)
    work = workload or Workload(plans[0].units)
    eng = Engine(work, mesh, comm, record)
    ranks = [RankClock(len(work.units), f, record) for f in check_slowdowns(slowdown, world)]
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
            gid = 0 if codes[r][pc][0] == SYNC else shard_gid[r]
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
    return sim_result(plans, ranks, lengths)


def simulate_work_stealing(
    lengths: Sequence[int],
    world_size: int,
    *,
    workload: Workload,
    cost: CostModel = DEFAULT_COST,
    max_tokens: int | None = None,
    split_cost: float | None = None,
    overhead: float | None = None,
    tolerance: float | None = DEFAULT_TOLERANCE,
    plan: StealPlan | None = None,
    options: ScheduleOptions | None = None,
    comm: CommModel = ZERO_COMM,
    mesh: Mesh | None = None,
    slowdown: Sequence[float] | None = None,
    record: bool = True,
) -> SimResult:
    """Work stealing as the runtime runs it: every rank follows ``steal.rank_program`` (the same
    code) on counters that behave like a transport's ``fetch_add``; decisions are taken in time
    order (ties: lowest rank), each rank's when its compute is free.

    ``overhead`` (seconds; default: what one stolen fragment's transfers add on an idle rank
    under ``comm``, plus the thief's pushes still in flight) is ``steal``'s guard; ``split_cost``
    (default: the sample cost whose compute hides a unit's transfers under ``comm``) is
    ``steal_plan``'s; ``tolerance`` is ``behind``'s. A thief here knows when each victim's
    running work ends (``residual``; the runtime assumes it ends now, the cautious guess).
    ``plan``: the owners' lists as the runtime built them (e.g. with its own cost model),
    instead of ``steal_plan(lengths, ...)``."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not lengths:
        raise ValueError("cannot simulate an empty minibatch")
    options = options or ScheduleOptions()
    mesh = mesh_for(mesh, world_size)
    eng = Engine(workload, mesh, comm, record)
    frag = eng.codes(stealing_fragment(workload.units, 0, options))
    split = eng.hiding_cost() if split_cost is None else split_cost
    sp = plan or steal_plan(lengths, world_size, max_tokens or max(lengths), cost=cost, split_cost=split)
    if sp.world_size != world_size or len(sp.costs) != len(lengths):
        raise ValueError(f"plan is for {sp.world_size} ranks and {len(sp.costs)} samples, not "
                         f"{world_size} and {len(lengths)}")
    base = eng.fragment_time(frag) if overhead is None else overhead
    ranks = [RankClock(len(workload.units), f, record) for f in check_slowdowns(slowdown, world_size)]
    shared = ArrayCounters(sp.num_counters)
    clock = np.zeros(world_size)  # each rank's compute clock: when its running work ends

    def program(r: int):  # noqa: ANN202 - a generator of plan.Action
        st = ranks[r]
        ovh = (lambda: base) if overhead is not None else (lambda: base + max(st.push - st.t, 0.0))
        left = lambda: np.maximum(clock - st.t, 0.0)
        return rank_program(sp, shared, r, tolerance=tolerance, overhead=ovh, residual=left)

    prefix = eng.codes(owner_steps(workload.units, options).prefix)
    programs = [program(r) for r in range(world_size)]
    done: list[list] = [[] for _ in range(world_size)]  # the actions each rank ran
    n_mb = [0] * world_size  # microbatches each rank has run so far
    heap = []
    for r, st in enumerate(ranks):
        eng.run(r, st, prefix, 0, ())
        clock[r] = st.t
        heap.append((st.t, r))
    heapq.heapify(heap)
    while heap:
        _, r = heapq.heappop(heap)
        action = next(programs[r], None)
        if action is None:
            continue  # nothing left worth taking: this rank waits at the sync
        st, samples = ranks[r], action.samples
        done[r].append(action)
        c = (sum(sp.costs[i] for i in samples),)
        for piece in action_pieces(workload.units, action, options):
            eng.run(r, st, eng.codes(piece), 0, c, mb_shift=n_mb[r])
        n_mb[r] += bool(samples)
        clock[r] = st.t
        heapq.heappush(heap, (st.t, r))
    arrivals = [eng.arrive(st, SYNC) for st in ranks]
    start = max(arrivals)
    for r, (st, a) in enumerate(zip(ranks, arrivals)):
        eng.finish(r, st, SYNC, -1, start, a)
    plans = tuple(
        realised_plan(workload.units, r, done[r], options)
        if record
        else Plan(r, "odc", workload.units, tuple(a.samples for a in done[r] if a.samples), ())
        for r in range(world_size)
    )
    return sim_result(plans, ranks, lengths)


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
