"""Work stealing: every rank runs its own LB-Mini list; a rank whose list is done steals single
samples from the tail of the most loaded rank's list.

The owner takes its list from the head, one microbatch at a time, at the moment it reaches that
microbatch (so work it has not started stays up for grabs); thieves take from the tail, where
LB-Mini's heaviest-first order leaves the lightest samples. If nobody is slow and the cost model
is right, nobody finds anything worth stealing and the run *is* LB-Mini; when a rank falls behind
(a straggler, a wrong cost), idle ranks take its remaining samples.

Every decision goes through one primitive, ``fetch_add(counter, n)`` on integer counters shared
by all ranks and zero at the start of each step (``Transport.fetch_add``), so the runtime on any
transport and the simulator run this same code. Counters, for W ranks and N samples:

    [0, W)        head[r]:   how many of r's list positions its owner has announced taking
    [W, 2W)       stolen[r]: how many tail positions of r's list thieves have taken a ticket for
    [2W, 2W + N)  taken[s]:  sample s; whoever's fetch_add returns 0 runs it (exactly once)

The owner announces a microbatch (``head += len``) and then takes each of its samples' flags;
a thief takes a ticket ``t = stolen[v]++`` (list position ``n_v - 1 - t``) and then that
sample's flag. Flags make the race at the meeting point harmless: each sample goes to exactly
one rank. Tickets go out in decreasing position order, so once the owner finds a microbatch
fully taken, every later position has a ticket and someone will take its flag.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Literal

from odcfn.schedule.balance import check_lengths, lb_mini
from odcfn.schedule.cost import DEFAULT_COST, CostModel
from odcfn.schedule.plan import (
    Assignment,
    Backward,
    Forward,
    Plan,
    ScheduleOptions,
    Step,
    Sync,
    owner_steps,
    stealing_fragment,
)

__all__ = [
    "Action",
    "FetchAdd",
    "StealPlan",
    "action_steps",
    "ahead",
    "behind",
    "claim_own",
    "pick_victim",
    "rank_program",
    "realised_plan",
    "steal",
    "steal_plan",
]

DEFAULT_TOLERANCE = 0.1

FetchAdd = Callable[[int, int], int]  # (counter, n) -> value before adding n


@dataclass(frozen=True)
class StealPlan:
    """Every rank's own list (identical on all ranks: computed from the lengths alone)."""

    lists: Assignment  # rank -> its own microbatches, in the order it runs them
    costs: tuple[float, ...]  # per sample, the cost model's estimate

    def __post_init__(self) -> None:
        order = tuple(tuple(s for mb in mbs for s in mb) for mbs in self.lists)
        object.__setattr__(self, "order", order)  # rank -> list positions -> sample
        cum = tuple(tuple(accumulate((self.costs[s] for s in o), initial=0.0)) for o in order)
        object.__setattr__(self, "cum", cum)  # rank -> prefix sums of costs over positions
        ends = []
        for mbs in self.lists:
            e: list[int] = []
            for mb in mbs:
                e += [len(e) + len(mb)] * len(mb)
            ends.append(tuple(e))
        object.__setattr__(self, "ends", tuple(ends))  # rank -> position -> end of its microbatch

    @property
    def world_size(self) -> int:
        return len(self.lists)

    @property
    def num_counters(self) -> int:
        return 4 * self.world_size + len(self.costs)

    def head(self, r: int) -> int:
        return r

    def stolen(self, r: int) -> int:
        return self.world_size + r

    def done(self, r: int) -> int:
        return 2 * self.world_size + r

    def started(self, r: int) -> int:
        return 3 * self.world_size + r

    def taken(self, s: int) -> int:
        return 4 * self.world_size + s

    def quantum(self, samples: Sequence[int]) -> int:
        """Cost as an integer counter increment (2^20 = the heaviest sample)."""
        top = max(self.costs, default=0.0) or 1.0
        return sum(round(self.costs[s] / top * (1 << 20)) for s in samples)

    def queued(self, v: int, head: int, stolen: int) -> tuple[int, int]:
        """Positions [lo, hi) of v's list that nobody has announced or ticketed yet."""
        n = len(self.order[v])  # type: ignore[attr-defined]
        hi = max(n - stolen, 0)
        return min(head, hi), hi


def steal_plan(
    lengths: Sequence[int],
    world_size: int,
    max_tokens: int,
    *,
    cost: CostModel = DEFAULT_COST,
    split_cost: float = math.inf,
) -> StealPlan:
    """LB-Mini's assignment as the owners' lists. ``split_cost``: an LB-Mini microbatch whose
    samples all cost at least this much is run as single-sample microbatches instead (an owner
    then commits to less work at a time, so a slow owner keeps less of it; worth it only when
    compute hides the extra gathers, which is what the simulator's default measures)."""
    check_lengths(lengths, max_tokens)
    costs = tuple(float(cost(n)) for n in lengths)
    lists = []
    for mbs in lb_mini(lengths, world_size, max_tokens, cost=cost):
        own: list[tuple[int, ...]] = []
        for mb in mbs:
            if len(mb) > 1 and min(costs[s] for s in mb) >= split_cost:
                own.extend((s,) for s in mb)
            else:
                own.append(tuple(mb))
        lists.append(tuple(own))
    return StealPlan(tuple(lists), costs)


def claim_own(sp: StealPlan, fetch_add: FetchAdd, rank: int, lo: int, hi: int) -> tuple[int, ...]:
    """The owner takes positions [lo, hi) of its list: announce them, then take every sample
    no thief has taken. An empty result means the rest of the list is stolen."""
    fetch_add(sp.head(rank), hi - lo)
    order = sp.order[rank]  # type: ignore[attr-defined]
    return tuple(s for s in (order[p] for p in range(lo, hi)) if fetch_add(sp.taken(s), 1) == 0)


def pick_victim(
    sp: StealPlan,
    thief: int,
    heads: Sequence[int],
    stolen: Sequence[int],
    overhead: float = 0.0,
    skip: frozenset[int] | set[int] = frozenset(),
    residual: Callable[[int], float] = lambda v: 0.0,
) -> int | None:
    """The rank with the most work left whose tail sample is worth stealing: what it has left
    besides that sample (its other queued samples, plus ``residual(v)``, what remains of the
    work it is running, if known) is at least ``overhead`` (a steal's cost beyond its compute),
    so the thief finishes the sample before the owner would have reached it. Ties: lowest rank."""
    best, best_q = None, -1.0
    for v in range(sp.world_size):
        if v == thief or v in skip:
            continue
        lo, hi = sp.queued(v, heads[v], stolen[v])
        if hi <= lo:
            continue
        cum = sp.cum[v]  # type: ignore[attr-defined]
        q = cum[hi] - cum[lo] + residual(v)
        if q - sp.costs[sp.order[v][hi - 1]] >= overhead and q > best_q:  # type: ignore[attr-defined]
            best, best_q = v, q
    return best


def behind(sp: StealPlan, fetch_add: FetchAdd, rank: int, tolerance: float) -> frozenset[int]:
    """Ranks that are behind this one: this rank has finished more than ``1 + tolerance`` times
    the work they have even started (``done`` and ``started`` counters, in cost quanta). Equal
    devices on LB-Mini lists never are: a rank on pace has started at least what another has
    finished. A slow device is, long before the others run out of work."""
    mine = fetch_add(sp.done(rank), 0)
    return frozenset(
        v
        for v in range(sp.world_size)
        if v != rank and mine > (1.0 + tolerance) * (fetch_add(sp.done(v), 0) + fetch_add(sp.started(v), 0))
    )


def ahead(sp: StealPlan, fetch_add: FetchAdd, rank: int, tolerance: float) -> frozenset[int]:
    """Ranks this one is behind (the mirror of ``behind``). Asked when a rank's own list ends,
    it names the ranks a slow device must not steal from: they would finish the sample sooner."""
    mine = fetch_add(sp.done(rank), 0) + fetch_add(sp.started(rank), 0)
    return frozenset(
        v
        for v in range(sp.world_size)
        if v != rank and fetch_add(sp.done(v), 0) > (1.0 + tolerance) * mine
    )


def steal(
    sp: StealPlan,
    fetch_add: FetchAdd,
    thief: int,
    overhead: float = 0.0,
    among: frozenset[int] | None = None,
    residual: Callable[[int], float] = lambda v: 0.0,
) -> int | None:
    """One steal (from ``among`` only, if given): a sample id this rank now owns, or None when
    nothing is worth stealing."""
    w = sp.world_size
    skip: set[int] = set() if among is None else set(range(w)) - among
    while True:
        heads = [fetch_add(sp.head(v), 0) for v in range(w)]
        stolen = [fetch_add(sp.stolen(v), 0) for v in range(w)]
        v = pick_victim(sp, thief, heads, stolen, overhead, skip, residual)
        if v is None:
            return None
        pos = len(sp.order[v]) - 1 - fetch_add(sp.stolen(v), 1)  # type: ignore[attr-defined]
        # a position the owner has announced is the owner's (it may not have flagged it yet)
        if pos >= 0 and pos >= fetch_add(sp.head(v), 0):
            s = sp.order[v][pos]  # type: ignore[attr-defined]
            if fetch_add(sp.taken(s), 1) == 0:
                return s
        skip.add(v)  # the owner got there first: the rest of v's list is taken


# What a rank does next, as (kind, samples, flag):
# ("own", samples, more): run the next piece of its own list (``more``: its list goes on);
# ("help", (s,), _): leave its list for a moment to run a slow rank's sample, then come back;
# ("stop", (), held): its list is over (``held``: free the units kept for a next microbatch);
# ("steal", (s,), _): run a sample stolen once its own list was over.
Action = tuple[Literal["own", "help", "stop", "steal"], tuple[int, ...], bool]


def rank_program(
    sp: StealPlan,
    fetch_add: FetchAdd,
    rank: int,
    *,
    tolerance: float | None = DEFAULT_TOLERANCE,
    overhead: Callable[[], float] = lambda: 0.0,
    residual: Callable[[int], float] = lambda v: 0.0,
) -> Iterator[Action]:
    """One rank's decisions, in order. The caller runs each yielded action to completion before
    asking for the next (the next decision must see the counters as they are then); when the
    generator ends the rank goes to the Sync.

    While its own list lasts, a rank first helps the ranks ``behind`` it (``tolerance``; None:
    never) by stealing their tail samples, then takes its own next microbatch -- only its first
    sample if the rank is itself behind someone, so that a slow device commits to little at a
    time. Once its list is done it steals from anyone not ``ahead`` of it, while ``steal``'s
    guard (``overhead()``, ``residual``) says it pays."""
    running = 0  # cost quanta of the action in flight, published in ``started``

    def begin(samples: Sequence[int]) -> None:
        nonlocal running
        running = sp.quantum(samples)
        fetch_add(sp.started(rank), running)

    def finish() -> None:
        nonlocal running
        if running:
            fetch_add(sp.done(rank), running)
            fetch_add(sp.started(rank), -running)
            running = 0

    def pace(check: Callable[..., frozenset[int]]) -> frozenset[int]:
        return check(sp, fetch_add, rank, tolerance) if tolerance is not None else frozenset()

    ends = sp.ends[rank]  # type: ignore[attr-defined]
    pos, n, held = 0, len(ends), True  # the prefix's gathers are held
    while pos < n:
        finish()
        late = pace(behind)
        s = steal(sp, fetch_add, rank, overhead(), among=late, residual=residual) if late else None
        if s is not None:
            begin((s,))
            yield ("help", (s,), True)
            continue
        end = ends[pos]
        if end - pos > 1 and pace(ahead):
            end = pos + 1
        got = claim_own(sp, fetch_add, rank, pos, end)
        pos = end
        if not got:
            break  # the rest of its list was stolen
        begin(got)
        held = pos < n
        yield ("own", got, held)
    finish()
    victims = frozenset(range(sp.world_size)) - pace(ahead)
    yield ("stop", (), held)
    while (s := steal(sp, fetch_add, rank, overhead(), among=victims, residual=residual)) is not None:
        begin((s,))
        yield ("steal", (s,), False)
        finish()


def _renumber(steps: Sequence[Step], mb: int) -> tuple[Step, ...]:
    return tuple(replace(s, mb=mb) if isinstance(s, (Forward, Backward)) else s for s in steps)


def action_steps(
    units: Sequence[str], action: Action, mb: int, options: ScheduleOptions | None = None
) -> tuple[Step, ...]:
    """The plan steps of one action; the microbatch it runs (if any) is numbered ``mb`` (the
    rank's count of microbatches so far)."""
    o = owner_steps(units, options)
    kind, _, flag = action
    if kind == "own":
        return _renumber(o.middle if flag else o.last, mb)
    if kind == "stop":
        return o.held if flag else ()
    frag = stealing_fragment(units, (0,), mb, options)
    if kind == "steal":
        return frag
    return (*o.held, *frag, *o.prefix)  # help: free what it holds, run it, re-gather


def realised_plan(
    units: Sequence[str], rank: int, actions: Sequence[Action], options: ScheduleOptions | None = None
) -> Plan:
    """The plan a work-stealing rank actually ran, microbatches numbered in execution order."""
    steps = list(owner_steps(units, options).prefix)
    mbs: list[tuple[int, ...]] = []
    for a in actions:
        steps += action_steps(units, a, len(mbs), options)
        if a[1]:
            mbs.append(a[1])
    return Plan(rank, "odc", tuple(units), tuple(mbs), (*steps, Sync()))
