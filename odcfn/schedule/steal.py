"""Work stealing: every rank runs its own LB-Mini list; ranks take samples from the lists of
ranks that fall behind, and a rank whose list is done steals from the most loaded one.

The owner takes its list from the head, one microbatch at a time, at the moment it reaches that
microbatch (so work it has not started stays up for grabs); thieves take single samples from the
tail, where LB-Mini's heaviest-first order leaves the lightest. If the devices are equal and the
cost model right, nothing is worth taking and the run *is* LB-Mini; when a rank falls behind (a
straggler, a wrong cost), the others take its remaining samples.

Every decision goes through shared integer counters, zero at the start of each step
(``Transport.fetch_add``), so the runtime on any transport and the simulator run this same code.
For W ranks and N samples:

    [0, W)          head[r]:    how many of r's list positions its owner has announced taking
    [W, 2W)         stolen[r]:  how many tail positions of r's list thieves hold tickets for
    [2W, 3W)        done[r]:    cost r has finished (in quanta: 2^20 = the heaviest sample)
    [3W, 4W)        started[r]: cost r is running now
    [4W, 4W + N)    taken[s]:   sample s; whoever's fetch_add returns 0 runs it (exactly once)

The owner announces positions (``head += k``), then takes each sample's flag; a thief takes a
ticket ``t = stolen[v]++`` (position ``n_v - 1 - t``) and then that sample's flag. Flags make
the race where owner and thieves meet harmless: each sample goes to exactly one rank. Tickets go
out in decreasing position order, so once the owner finds a microbatch fully taken, every later
position has a ticket and its holder will try its flag.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from odcfn.schedule.balance import check_lengths, lb_mini
from odcfn.schedule.cost import DEFAULT_COST, CostModel
from odcfn.schedule.plan import Assignment
from odcfn.schedule.program import Action

__all__ = [
    "DEFAULT_SPLIT_TAIL",
    "DEFAULT_TOLERANCE",
    "WorkStealing",
    "ArrayCounters",
    "Shared",
    "StealPlan",
    "TransportCounters",
    "ahead",
    "behind",
    "claim_own",
    "pick_victim",
    "rank_program",
    "steal",
    "steal_plan",
]

DEFAULT_TOLERANCE = 0.1
DEFAULT_SPLIT_TAIL = 0.2
_QUANTUM = 1 << 20


@dataclass(frozen=True)
class WorkStealing:
    """``train_step(..., balance=WorkStealing(...))``; ``balance="work_stealing"`` is the default.

    ``split_tail``: the last ``split_tail`` of each list's cost (LB-Mini orders heaviest first,
    so its lightest samples) runs sample by sample; the head keeps LB-Mini's packed
    microbatches. Thieves take from the tail, so that is where granularity buys balance: a rank
    1.5x slower than one other needs a fifth of its list taken, among 8 ranks 30%. Each extra
    microbatch costs one more round of gathers and pushes (on CPU shared memory a synchronous
    copy of the model: about 2% of the CPU time of a step when every list is split), so only the
    tail pays it (docs/benchmarks.md: at 4 samples per rank the simulator keeps splitting
    everything's gain from a 1.5x straggler with half its extra microbatches).
    ``split_cost``: besides, an LB-Mini microbatch whose samples each cost at least this much
    (in the cost model's units) runs sample by sample (0: every list sample by sample, the
    former default; the simulator splits where compute hides the transfers:
    ``simulate_work_stealing(split_cost=None)``). ``split_tail=0, split_cost=math.inf`` keeps
    LB-Mini's microbatches: equal to LB-Mini when nobody is slow, but a slow rank has claimed
    most of its list before anyone can tell. Once a rank is behind another it takes even its
    packed microbatches one sample at a time.
    ``tolerance``: how far behind a rank must be before others help it (None: only idle ranks
    steal). ``overhead``: what a steal costs beyond the sample's compute, in cost units.
    """

    split_cost: float = math.inf
    tolerance: float | None = DEFAULT_TOLERANCE
    overhead: float = 0.0
    split_tail: float = DEFAULT_SPLIT_TAIL

    def __post_init__(self) -> None:
        if not self.split_cost >= 0:
            raise ValueError(f"WorkStealing.split_cost must be >= 0, got {self.split_cost!r}")
        if not 0 <= self.split_tail <= 1:
            raise ValueError(f"WorkStealing.split_tail must be in [0, 1], got {self.split_tail!r}")
        if self.tolerance is not None and not self.tolerance >= 0:
            raise ValueError(f"WorkStealing.tolerance must be >= 0 or None, got {self.tolerance!r}")
        if not self.overhead >= 0:
            raise ValueError(f"WorkStealing.overhead must be >= 0, got {self.overhead!r}")


class Shared(Protocol):
    """The counters the ranks share: an atomic fetch-and-add, and a bulk read (a snapshot of
    each counter, not of the block as a whole)."""

    def fetch_add(self, counter: int, n: int) -> int: ...

    def read(self, lo: int, hi: int) -> np.ndarray: ...


class TransportCounters:
    """``Shared`` over a transport's ``fetch_add`` (what the runtime uses)."""

    def __init__(self, fetch_add: Callable[[int, int], int]) -> None:
        self.fetch_add = fetch_add

    def read(self, lo: int, hi: int) -> np.ndarray:
        return np.array([self.fetch_add(i, 0) for i in range(lo, hi)], dtype=np.int64)


class ArrayCounters:
    """``Shared`` in one process (the simulator, tests): decisions are taken one at a time."""

    def __init__(self, n: int) -> None:
        self.values = np.zeros(n, dtype=np.int64)

    def fetch_add(self, counter: int, n: int) -> int:
        v = int(self.values[counter])
        self.values[counter] = v + n
        return v

    def read(self, lo: int, hi: int) -> np.ndarray:
        return self.values[lo:hi].copy()


@dataclass(frozen=True, eq=False)
class StealPlan:
    """Every rank's own list (identical on all ranks: computed from the lengths alone)."""

    lists: Assignment  # rank -> its own microbatches, in the order it runs them
    costs: tuple[float, ...]  # per sample, the cost model's estimate
    # derived from the two above
    order: tuple[tuple[int, ...], ...] = field(init=False, repr=False)  # rank -> position -> sample
    ends: tuple[tuple[int, ...], ...] = field(init=False, repr=False)  # ... -> end of its microbatch
    _n: np.ndarray = field(init=False, repr=False)  # list lengths
    _starts: np.ndarray = field(init=False, repr=False)  # where each list starts in _flat
    _flat: np.ndarray = field(init=False, repr=False)  # all lists, concatenated
    _cum: np.ndarray = field(init=False, repr=False)  # per list: 0 and prefix sums of costs
    _cum_starts: np.ndarray = field(init=False, repr=False)
    _cost: np.ndarray = field(init=False, repr=False)
    _quanta: np.ndarray = field(init=False, repr=False)  # costs as counter increments

    def __post_init__(self) -> None:
        order = [[s for mb in mbs for s in mb] for mbs in self.lists]
        n = np.array([len(o) for o in order], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(n)])[:-1]
        flat = np.array([s for o in order for s in o], dtype=np.int64)
        c = np.asarray(self.costs, dtype=np.float64)
        cum = np.concatenate([np.concatenate([[0.0], np.cumsum(c[o])]) for o in order] or [np.zeros(0)])
        top = float(c.max()) if len(c) else 1.0
        ends = []
        for mbs in self.lists:
            e: list[int] = []
            for mb in mbs:
                e += [len(e) + len(mb)] * len(mb)
            ends.append(tuple(e))
        for name, value in dict(
            order=tuple(tuple(o) for o in order),
            ends=tuple(ends),
            _n=n, _starts=starts, _flat=flat, _cum=cum, _cum_starts=starts + np.arange(len(n)),
            _cost=c, _quanta=np.rint(c / (top or 1.0) * _QUANTUM).astype(np.int64),
        ).items():
            object.__setattr__(self, name, value)

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
        return int(sum(self._quanta[s] for s in samples))

    def block(self, shared: Shared, first: Callable[[int], int]) -> np.ndarray:
        """One counter of every rank, e.g. ``sp.block(shared, sp.done)``."""
        return shared.read(first(0), first(0) + self.world_size)


def steal_plan(
    lengths: Sequence[int],
    world_size: int,
    max_tokens: int,
    *,
    cost: CostModel = DEFAULT_COST,
    split_cost: float = math.inf,
    split_tail: float = 0.0,
) -> StealPlan:
    """LB-Mini's assignment as the owners' lists. An LB-Mini microbatch runs as single-sample
    microbatches instead (an owner then commits to less work at a time) when its samples all
    cost at least ``split_cost`` (worth it when compute hides the extra gathers, which is what
    the simulator's default measures) or when it reaches into the last ``split_tail`` of its
    list's cost (where thieves take from); there only its samples in that tail are split off."""
    check_lengths(lengths, max_tokens)
    costs = tuple(float(cost(n)) for n in lengths)
    lists = []
    for mbs in lb_mini(lengths, world_size, max_tokens, cost=cost):
        total = sum(costs[s] for mb in mbs for s in mb)
        head = (1.0 - split_tail) * total  # cost before the tail starts
        own: list[tuple[int, ...]] = []
        done = 0.0
        for mb in mbs:
            if len(mb) > 1 and min(costs[s] for s in mb) >= split_cost:
                own.extend((s,) for s in mb)
                done += sum(costs[s] for s in mb)
                continue
            keep: list[int] = []  # the samples that end inside the head stay packed
            tail: list[tuple[int, ...]] = []  # the others run one by one
            for s in mb:
                done += costs[s]
                if split_tail > 0 and done > head * (1 + 1e-12):
                    tail.append((s,))
                else:
                    keep.append(s)
            own.extend(([tuple(keep)] if keep else []) + tail)
        lists.append(tuple(own))
    return StealPlan(tuple(lists), costs)


def claim_own(sp: StealPlan, shared: Shared, rank: int, lo: int, hi: int) -> tuple[int, ...]:
    """The owner takes positions [lo, hi) of its list: announce them, then take every sample
    no thief has taken. An empty result means the rest of the list is stolen."""
    shared.fetch_add(sp.head(rank), hi - lo)
    order = sp.order[rank]
    return tuple(s for s in (order[p] for p in range(lo, hi)) if shared.fetch_add(sp.taken(s), 1) == 0)


def pick_victim(
    sp: StealPlan,
    heads: np.ndarray,
    stolen: np.ndarray,
    allowed: np.ndarray,
    overhead: float = 0.0,
    residual: np.ndarray | float = 0.0,
) -> int | None:
    """The allowed rank with the most work left whose tail sample is worth stealing: what it
    has left besides that sample (its other queued samples, plus ``residual``, what remains of
    the work it is running, if known) is at least ``overhead`` (a steal's cost beyond its
    compute), so the thief finishes the sample before the owner would have reached it. Ties:
    the lowest rank."""
    hi = np.maximum(sp._n - stolen, 0)
    lo = np.minimum(heads, hi)
    ok = allowed & (hi > lo)
    if not ok.any():
        return None
    cum, at = sp._cum, sp._cum_starts
    left = cum[at + hi] - cum[at + lo] + residual
    tail = sp._cost[sp._flat[np.maximum(sp._starts + hi - 1, 0)]]
    ok &= left - tail >= overhead
    if not ok.any():
        return None
    return int(np.argmax(np.where(ok, left, -np.inf)))


def behind(sp: StealPlan, shared: Shared, rank: int, tolerance: float) -> np.ndarray:
    """Which ranks are behind this one (a bool per rank): this rank has finished more than
    ``1 + tolerance`` times the work they have even started. Equal devices on LB-Mini lists
    are not: a rank on pace has started at least what another has finished. A slow device is,
    long before the others run out of work."""
    done = sp.block(shared, sp.done)
    late = done[rank] > (1.0 + tolerance) * (done + sp.block(shared, sp.started))
    late[rank] = False
    return late


def ahead(sp: StealPlan, shared: Shared, rank: int, tolerance: float) -> np.ndarray:
    """Which ranks this one is behind (the mirror of ``behind``). Asked when a rank's own list
    ends, it names the ranks a slow device must not steal from: they would finish sooner."""
    done = sp.block(shared, sp.done)
    fast = done > (1.0 + tolerance) * (done[rank] + shared.fetch_add(sp.started(rank), 0))
    fast[rank] = False
    return fast


def steal(
    sp: StealPlan,
    shared: Shared,
    thief: int,
    overhead: float = 0.0,
    among: np.ndarray | None = None,
    residual: np.ndarray | float = 0.0,
) -> int | None:
    """One steal (from the ranks ``among`` marks, if given): a sample id this rank now owns,
    or None when nothing is worth stealing."""
    allowed = np.ones(sp.world_size, dtype=bool) if among is None else among.copy()
    allowed[thief] = False
    while True:
        heads, stolen = sp.block(shared, sp.head), sp.block(shared, sp.stolen)
        v = pick_victim(sp, heads, stolen, allowed, overhead, residual)
        if v is None:
            return None
        pos = len(sp.order[v]) - 1 - shared.fetch_add(sp.stolen(v), 1)
        # a position the owner has announced is the owner's (it may not have flagged it yet)
        if pos >= 0 and pos >= shared.fetch_add(sp.head(v), 0):
            s = sp.order[v][pos]
            if shared.fetch_add(sp.taken(s), 1) == 0:
                return s
        allowed[v] = False  # the owner got there first: the rest of v's list is taken


def rank_program(
    sp: StealPlan,
    shared: Shared,
    rank: int,
    *,
    tolerance: float | None = DEFAULT_TOLERANCE,
    overhead: Callable[[], float] = lambda: 0.0,
    residual: Callable[[], np.ndarray | float] = lambda: 0.0,
) -> Iterator[Action]:
    """One rank's decisions, in order. The caller runs each yielded action to completion before
    asking for the next (the next decision must see the counters as they are then); when the
    generator ends the rank goes to the Sync.

    While its own list lasts, a rank first helps the ranks ``behind`` it (``tolerance``; None:
    never) by stealing their tail samples, then takes its own next microbatch -- only its first
    sample if the rank is itself behind someone, so that a slow device commits to little at a
    time. Once its list is done it steals from anyone not ``ahead`` of it, while ``steal``'s
    guard (``overhead()``, ``residual()``) says it pays."""
    running = 0  # cost quanta of the action in flight, published in ``started``

    def begin(samples: Sequence[int]) -> None:
        nonlocal running
        running = sp.quantum(samples)
        shared.fetch_add(sp.started(rank), running)

    def finish() -> None:
        nonlocal running
        if running:
            shared.fetch_add(sp.done(rank), running)
            shared.fetch_add(sp.started(rank), -running)
            running = 0

    none = np.zeros(sp.world_size, dtype=bool)

    def pace(check: Callable[..., np.ndarray]) -> np.ndarray:
        return check(sp, shared, rank, tolerance) if tolerance is not None else none

    ends = sp.ends[rank]
    pos, n, held = 0, len(ends), True  # the prefix's gathers are held
    while pos < n:
        finish()
        late = pace(behind)
        s = steal(sp, shared, rank, overhead(), late, residual()) if late.any() else None
        if s is not None:
            begin((s,))
            yield Action("help", (s,), True)
            continue
        end = ends[pos]
        if end - pos > 1 and pace(ahead).any():
            end = pos + 1
        got = claim_own(sp, shared, rank, pos, end)
        pos = end
        if not got:
            break  # the rest of its list was stolen
        begin(got)
        held = pos < n
        yield Action("own", got, held)
    finish()
    victims = ~pace(ahead)
    yield Action("stop", (), held)
    while (s := steal(sp, shared, rank, overhead(), victims, residual())) is not None:
        begin((s,))
        yield Action("steal", (s,), False)
        finish()
