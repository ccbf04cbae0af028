"""A discrete-event simulator of the plans the runtime executes.

It times the *same* ``Plan`` objects ``compile_plan`` produces, step by step, with a cost model
for compute and a bandwidth/latency model for communication, and emits ``odcfn.trace.Event``s
in the runtime's format (so ``bubble_rate``, the Chrome export and the timeline plot work on
both). Work stealing runs the runtime's own decision code (``odcfn.schedule.steal``).

The timing rules are in ``odcfn.schedule.simengine``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from odcfn.schedule.cost import DEFAULT_COST, CostModel
from odcfn.schedule.plan import Assignment, Comm, Plan, ScheduleOptions, compile_plan
from odcfn.schedule.program import Piece, assemble_plan, stealing_fragment, stealing_pieces
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
    "run_programs",
    "simulate",
    "simulate_work_stealing",
]


def run_programs(
    eng: Engine,
    ranks: Sequence[RankClock],
    programs: Sequence[Iterator[Piece]],
    piece_cost: Callable[[tuple[int, ...]], float],
    clock: np.ndarray | None = None,
) -> list[list[Piece]]:
    """THE simulator loop: every rank runs its program piece by piece; ranks are advanced in
    time order (ties: lowest rank), each asking its program for the next piece when its compute
    is free (so a work-stealing decision sees the counters as they are then); a collective or
    the sync starts when its whole group has arrived. Returns the pieces each rank ran.
    ``clock`` (optional) is kept at each rank's compute clock, for programs that read it."""
    world = len(ranks)
    mesh = eng.mesh
    groups: list[tuple[int, ...]] = [tuple(range(world))]  # small int ids: hashing a 1024-tuple
    gid_of: dict[tuple[int, ...], int] = {groups[0]: 0}  # per step would dominate the run time
    shard_gid = []
    for r in range(world):
        g = mesh.with_rank(r).shard_group
        if g not in gid_of:
            gid_of[g] = len(groups)
            groups.append(g)
        shard_gid.append(gid_of[g])
    ran: list[list[Piece]] = [[] for _ in range(world)]
    cur: list[tuple | None] = [None] * world  # (codes, pc, mb costs, mb shift)
    n_mb = [0] * world
    arrived: dict[int, list[int]] = {}  # group id -> ranks parked at its next collective
    heap = [(0.0, r) for r in range(world)]
    while heap:
        _, r = heapq.heappop(heap)
        st = ranks[r]
        if cur[r] is None:
            piece = next(programs[r], None)
            if piece is None:
                continue  # its program is over (after its Sync)
            ran[r].append(piece)
            costs = [piece_cost(mb) for mb in piece.microbatches]
            cur[r] = (eng.codes(piece.steps), 0, costs, n_mb[r])
            n_mb[r] += len(piece.microbatches)
        codes, pc, costs, shift = cur[r]
        pc = eng.run(r, st, codes, pc, costs, mb_shift=shift)
        if pc == len(codes):
            cur[r] = None
            if clock is not None:
                clock[r] = st.t
            heapq.heappush(heap, (st.t, r))
            continue
        cur[r] = (codes, pc, costs, shift)
        gid = 0 if codes[pc][0] == SYNC else shard_gid[r]
        parked = arrived.setdefault(gid, [])
        parked.append(r)
        if len(parked) < len(groups[gid]):
            continue
        members = sorted(arrived.pop(gid))
        step = [cur[m][0][cur[m][1]][:2] for m in members]
        if any(s != step[0] for s in step):
            stuck = {m: ran[m][-1].steps[cur[m][1]] for m in members}
            raise ValueError(
                f"plans disagree: ranks {list(groups[gid])} meet at different collectives {stuck}; "
                "collective plans must issue the same collectives in the same order"
            )
        code, u = step[0]
        arrivals = [eng.arrive(ranks[m], code) for m in members]
        start = max(arrivals)
        for m, t in zip(members, arrivals):
            eng.finish(m, ranks[m], code, u, start, t)
            codes_m, pc_m, costs_m, shift_m = cur[m]
            cur[m] = (codes_m, pc_m + 1, costs_m, shift_m)
            heapq.heappush(heap, (ranks[m].t, m))
    if arrived:
        stuck = {r: ran[r][-1].steps[cur[r][1]] for rs in arrived.values() for r in rs}
        raise ValueError(f"plans deadlock: ranks wait forever at {stuck} (a peer never issues it)")
    return ran


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
    """Time one minibatch: ``plans[r]`` is rank r's plan (as from ``compile_plan``), run as a
    program of one piece."""
    if not plans:
        raise ValueError("simulate needs at least one plan")
    for r, p in enumerate(plans):
        if not isinstance(p, Plan) or p.rank != r:
            raise ValueError(
                f"plans[{r}] must be rank {r}'s Plan, got {type(p).__name__} "
                f"for rank {getattr(p, 'rank', '?')}"
            )
    world = len(plans)
    work = workload or Workload(plans[0].units)
    eng = Engine(work, mesh_for(mesh, world), comm, record)
    ranks = [RankClock(len(work.units), f, record) for f in check_slowdowns(slowdown, world)]
    programs = [iter((Piece(p.steps, p.microbatches),)) for p in plans]
    run_programs(eng, ranks, programs, lambda mb: sum(cost(lengths[i]) for i in mb))
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
    """Work stealing as the runtime runs it: every rank's program is the runtime's own
    (``program.stealing_pieces`` over ``steal.rank_program``) on counters that behave like a
    transport's ``fetch_add``, run by the same loop as static plans.

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
    eng = Engine(workload, mesh_for(mesh, world_size), comm, record)
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

    def program(r: int) -> Iterator[Piece]:
        st = ranks[r]
        ovh = (lambda: base) if overhead is not None else (lambda: base + max(st.push - st.t, 0.0))
        left = lambda: np.maximum(clock - st.t, 0.0)  # noqa: E731
        actions = rank_program(sp, shared, r, tolerance=tolerance, overhead=ovh, residual=left)
        return stealing_pieces(workload.units, actions, options)

    programs = [program(r) for r in range(world_size)]
    ran = run_programs(eng, ranks, programs, lambda mb: sum(sp.costs[i] for i in mb), clock)
    units = workload.units
    plans = tuple(
        assemble_plan(r, "odc", units, pieces)
        if record
        else Plan(r, "odc", units, tuple(m for p in pieces for m in p.microbatches), ())
        for r, pieces in enumerate(ran)
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
            # the other ranks empty: the plan still sees the world size (hpZ's group check)
            template = (tuple((0,) for _ in range(len(mbs))),) + ((),) * (len(assignment) - 1)
            steps = cache[len(mbs)] = compile_plan(units, template, 0, comm, options).steps
        plans.append(Plan(r, comm, tuple(units), mbs, steps))
    return tuple(plans)
