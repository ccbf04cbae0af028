"""The one registry of scheduling policies, and the program a rank runs under one.

``train_step``, ``odcfn simulate``, ``odcfn plan``, the demo and the benchmarks all take a policy
by the names here (or a ``Balancer`` callable, or a ``WorkStealing`` config). A policy turns a
minibatch's lengths into each rank's *program*: an iterator of plan pieces. A static balancer's
program is its compiled plan as one piece; work stealing's is decided piece by piece at run time
through shared counters. The runtime and the simulator each have one loop over pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from odcfn.schedule.balance import BALANCERS, WORK_STEALING, Balancer, check_assignment, get_balancer
from odcfn.schedule.cost import DEFAULT_COST, CostModel
from odcfn.schedule.plan import Comm, ScheduleOptions, compile_plan
from odcfn.schedule.program import Piece, owner_steps, stealing_pieces
from odcfn.schedule.steal import StealPlan, TransportCounters, WorkStealing, rank_program, steal_plan

__all__ = [
    "BASELINE",
    "POLICIES",
    "HEADLINE",
    "SCHEDULES",
    "Policy",
    "PolicyInfo",
    "Schedule",
    "policy_info",
    "prepare_program",
    "resolve_policy",
]

Policy = str | Balancer | WorkStealing


@dataclass(frozen=True)
class PolicyInfo:
    name: str
    collective: bool  # usable with comm="collective" (a static assignment, known in advance)
    equal_counts: bool  # every rank gets the same number of microbatches (verl's constraint)
    summary: str


POLICIES: dict[str, PolicyInfo] = {
    "round_robin": PolicyInfo("round_robin", True, False, "sample i to rank i mod W, packed in order"),
    "local_sort": PolicyInfo("local_sort", True, False, "each rank sorts and packs its round-robin share"),
    "lb_micro": PolicyInfo(
        "lb_micro", True, True, "equal microbatch counts, cost-balanced slots (what collective FSDP uses)"
    ),
    "lb_mini": PolicyInfo("lb_mini", True, False, "free cost-balanced partition (ODC: counts may differ)"),
    WORK_STEALING: PolicyInfo(
        WORK_STEALING, False, False, "LB-Mini's lists; samples move at run time from ranks behind"
    ),
}
assert set(POLICIES) == set(BALANCERS) | {WORK_STEALING}, "a balancer is missing from POLICIES"


@dataclass(frozen=True)
class Schedule:
    """A way to run a minibatch that reports compare: a comm mode and a policy of POLICIES."""

    name: str  # stable key in reports, e.g. "odc+lb-mini"
    comm: Comm
    balance: str

    def __post_init__(self) -> None:
        resolve_policy(self.balance, self.comm)  # unknown, or unable to serve this comm: refused


def _schedules(*specs: tuple[str, Comm, str]) -> dict[str, Schedule]:
    return {name: Schedule(name, comm, balance) for name, comm, balance in specs}


def policy_info(policy: Policy) -> PolicyInfo | None:
    """The registry entry of a policy given by name or as ``WorkStealing``; None for a callable."""
    if isinstance(policy, WorkStealing):
        return POLICIES[WORK_STEALING]
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"unknown balancer {policy!r}; known: {sorted(POLICIES)}")
        return POLICIES[policy]
    if callable(policy):
        return None
    raise TypeError(
        "balance must be a policy name, a balancer callable or odcfn.WorkStealing, "
        f"got {type(policy).__name__}"
    )


def resolve_policy(policy: Policy, comm: Comm, cost: CostModel | None = None) -> Balancer | WorkStealing:
    """The balancer (bound to ``cost``) or the ``WorkStealing`` config a policy stands for; a
    ValueError if it cannot serve ``comm``."""
    info = policy_info(policy)
    if info is not None and comm == "collective" and not info.collective:
        raise ValueError(
            f"balance={info.name!r} needs comm='odc' (got comm={comm!r}): collectives need every rank "
            "to run the same microbatches in lockstep, known in advance"
        )
    if isinstance(policy, WorkStealing):
        return policy
    if policy == WORK_STEALING:
        return WorkStealing()
    return get_balancer(policy, cost=cost)


def prepare_program(
    policy: Policy,
    lengths: Sequence[int],
    *,
    units: Sequence[str],
    world_size: int,
    rank: int,
    max_tokens: int,
    comm: Comm = "odc",
    options: ScheduleOptions | None = None,
    cost: CostModel | None = None,
    fetch_add: Callable[[int, int], int] | None = None,
    max_counters: int | None = None,
) -> Iterator[Piece]:
    """Rank ``rank``'s program for one minibatch. Every check (lengths against the cap, options,
    counters) runs here, before the caller communicates; the returned iterator is lazy (work
    stealing decides each piece when the previous one has run, on ``fetch_add``)."""
    chosen = resolve_policy(policy, comm, cost)
    if isinstance(chosen, WorkStealing):
        if options is not None and options.hpz:
            raise ValueError(
                f"ScheduleOptions.reshard_after_forward={options.hpz} (hierarchical shards) is not "
                "served with work stealing: use a static balancer"
            )
        sp = steal_plan(
            lengths, world_size, max_tokens, cost=cost or DEFAULT_COST, split_cost=chosen.split_cost,
            split_tail=chosen.split_tail,
        )
        if max_counters is not None and sp.num_counters > max_counters:
            raise ValueError(
                f"work stealing needs {sp.num_counters} shared counters for {len(lengths)} samples on "
                f"{world_size} ranks; this transport has {max_counters}: use a smaller minibatch"
            )
        if fetch_add is None:
            raise ValueError("work stealing needs the transport's fetch_add")
        owner_steps(units, options)  # bad options fail here, not mid-step
        return _stealing(sp, chosen, units, rank, fetch_add, options)
    assignment = chosen(lengths, world_size, max_tokens)
    check_assignment(assignment, lengths, world_size)
    plan = compile_plan(units, assignment, rank, comm, options)
    return iter((Piece(plan.steps, plan.microbatches),))


def _stealing(
    sp: StealPlan,
    policy: WorkStealing,
    units: Sequence[str],
    rank: int,
    fetch_add: Callable[[int, int], int],
    options: ScheduleOptions | None,
) -> Iterator[Piece]:
    shared = TransportCounters(fetch_add)
    actions = rank_program(sp, shared, rank, tolerance=policy.tolerance, overhead=lambda: policy.overhead)
    return stealing_pieces(units, actions, options)


# What the demo, ``odcfn bench`` and ``odcfn simulate`` compare, by these names.
SCHEDULES: dict[str, Schedule] = _schedules(
    ("collective+lb-micro", "collective", "lb_micro"),  # what collective FSDP users run today
    ("odc+lb-mini", "odc", "lb_mini"),
    ("odc+work-stealing", "odc", WORK_STEALING),
    ("odc+lb-micro", "odc", "lb_micro"),
    # the collective baseline again; ``odcfn bench`` runs it with its collectives over the same
    # shared memory as ODC (ShmTransport(collectives="shm")), so only synchronisation differs
    ("collective-shm+lb-micro", "collective", "lb_micro"),
)
BASELINE = "collective+lb-micro"
# the three schedules every report puts side by side: today's collective FSDP, ODC with
# minibatch-level balancing, ODC with run-time work stealing
HEADLINE = ("collective+lb-micro", "odc+lb-mini", "odc+work-stealing")
