"""Balancers: sample lengths -> rank -> ordered microbatches (sample ids) under a token cap.

Every balancer is pure and deterministic: each rank computes the same assignment from the
lengths alone, so no communication is needed to agree on it. Ties are broken by sample id and
rank, never by hash order or randomness.

- ``round_robin``: sample i -> rank i % W, packed in order (no balancing at all).
- ``local_sort``: samples sorted by cost, dealt round-robin, one sample per microbatch.
- ``lb_micro``: equal sample counts per rank, chosen for the collective time (the sum over
  microbatch slots of the heaviest rank's microbatch: what a collective (FSDP) schedule waits
  for, since every rank issues the same collectives for its j-th microbatch). Ranks with fewer
  microbatches are padded with empty ones by the collective compile.
- ``lb_mini``: free partition (unequal counts allowed) minimising the max rank load, never worse
  than Karmarkar-Karp + swaps nor than LPT; then each rank packs its own microbatches. Needs ODC.
- work stealing is dynamic (``odcfn.schedule.steal``): LB-Mini's lists, then idle or fast ranks
  take samples from slow ones at run time, in ``odcfn.step.train.grad_step(balance="work_stealing")``
  and in ``odcfn.schedule.simulate.simulate_work_stealing``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from functools import partial
from operator import itemgetter
from typing import Any

from odcfn._check import is_int
from odcfn.schedule.cost import DEFAULT_COST, CostModel
from odcfn.schedule.plan import Assignment
from odcfn.schedule.refine import collective_time, level_pack, refine_loads, refine_slots

__all__ = [
    "BALANCERS",
    "WORK_STEALING",
    "Balancer",
    "check_assignment",
    "check_lengths",
    "collective_time",
    "get_balancer",
    "kk_partition",
    "lb_micro",
    "lb_mini",
    "local_sort",
    "pack_greedy",
    "rank_loads",
    "round_robin",
]

Balancer = Callable[[Sequence[int], int, int], Assignment]
WORK_STEALING = "work_stealing"
_KK_FREE_LIMIT = 1 << 17
_REFINE_ALL_LIMIT = 1 << 12  # up to here every LB-Mini candidate is refined (a few ms)
_EXCHANGE_WORK = 1024  # LB-Mini's two-for-two exchange steps: 2 at 64 x 8 (each ~0.4 ms there)
# collective-time refinement steps: each scans every item, so fewer on big inputs (12 at 64 x 8)
_SLOT_WORK = 6144


def check_lengths(lengths: Sequence[int], max_tokens: int) -> None:
    """Every sample must fit in one microbatch: raise naming the first one that does not."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens_per_microbatch must be a positive int, got {max_tokens!r}")
    if len(lengths) == 0:
        raise ValueError("cannot balance an empty minibatch")
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"sample {i} has {n} tokens, more than max_tokens_per_microbatch={max_tokens}")


def check_assignment(assignment: Any, lengths: Sequence[int], world_size: int) -> None:
    """A balancer's output (a custom callable's too) must give every sample to exactly one
    microbatch of one of ``world_size`` ranks: else the step would silently drop or double
    samples. Every rank computes the same assignment, so every rank raises alike. (The token cap
    is the balancer's business: packing over it costs memory, not correctness.)"""
    if not isinstance(assignment, Sequence) or len(assignment) != world_size:
        got = len(assignment) if isinstance(assignment, Sequence) else type(assignment).__name__
        raise ValueError(f"the balancer returned {got} rank lists for world_size={world_size}")
    seen: dict[int, tuple[int, int]] = {}
    for r, mbs in enumerate(assignment):
        for j, mb in enumerate(mbs):
            for i in mb:
                if not is_int(i) or not 0 <= i < len(lengths):
                    raise ValueError(
                        f"the balancer put {i!r} in rank {r}'s microbatch {j}: not a sample id in "
                        f"[0, {len(lengths)})"
                    )
                if int(i) in seen:
                    raise ValueError(
                        f"the balancer gave sample {int(i)} twice (rank {seen[int(i)][0]} and rank {r})"
                    )
                seen[int(i)] = (r, j)
    if len(seen) != len(lengths):
        missing = sorted(set(range(len(lengths))) - set(seen))
        raise ValueError(f"the balancer left samples {missing[:16]} unassigned")


def _check_world(world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")


def pack_greedy(
    sample_ids: Sequence[int], lengths: Sequence[int], max_tokens: int
) -> tuple[tuple[int, ...], ...]:
    """Pack samples in the given order into consecutive microbatches of at most ``max_tokens``."""
    mbs: list[list[int]] = []
    used = 0
    for i in sample_ids:
        if not mbs or used + lengths[i] > max_tokens:
            mbs.append([])
            used = 0
        mbs[-1].append(i)
        used += lengths[i]
    return tuple(tuple(m) for m in mbs)


def round_robin(lengths: Sequence[int], world_size: int, max_tokens: int) -> Assignment:
    """Sample i goes to rank i % W; each rank packs its samples in order under the cap."""
    check_lengths(lengths, max_tokens)
    return tuple(
        pack_greedy(range(r, len(lengths), world_size), lengths, max_tokens) for r in range(world_size)
    )


# --- helpers ------------------------------------------------------------------------------


def rank_loads(assignment: Assignment, lengths: Sequence[int], cost: CostModel = DEFAULT_COST) -> list[float]:
    """Total cost per rank."""
    return [sum(cost(lengths[i]) for mb in mbs for i in mb) for mbs in assignment]


def kk_partition(costs: Sequence[float], k: int, *, equal_counts: bool = False) -> list[list[int]]:
    """Largest differencing (Karmarkar-Karp) k-way partition of item ids by cost.

    Each partial solution is a k-tuple of subsets; the two with the largest spread are merged by
    pairing one's heaviest subset with the other's lightest. With ``equal_counts`` the items
    (sorted by cost, padded with zero-cost dummies) start in chunks of k, one item per subset, so
    every merge keeps subset sizes equal: counts end up differing by at most one.
    """
    n = len(costs)
    order = sorted(range(n), key=lambda i: (-costs[i], i))
    # a partial solution: list of (sum, items) with implicit empty subsets up to k, sorted desc
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    if equal_counts:
        padded: list[int | None] = list(order) + [None] * (-n % k)
        for c in range(0, len(padded), k):
            chunk = [(0.0 if i is None else costs[i], [] if i is None else [i]) for i in padded[c : c + k]]
            chunk.sort(key=lambda s: -s[0])
            heap.append((-(chunk[0][0] - chunk[-1][0]), c, chunk))
    else:
        for c, i in enumerate(order):
            spread = costs[i] if k > 1 else 0.0
            heap.append((-spread, c, [(costs[i], [i])]))
    heapq.heapify(heap)
    tie = len(heap) + len(order)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # position i pairs a[i] with b[k-1-i] (the missing subsets are empty); only the overlap
        # k-len(b) <= i < len(a) adds up, extending a's consumed item lists in place
        first = k - len(b)
        merged = a[:first]
        for i in range(first, len(a)):
            (sa, ia), (sb, ib) = a[i], b[k - 1 - i]
            ia.extend(ib)
            merged.append((sa + sb, ia))
        merged += b[: k - max(len(a), first)][::-1]
        merged.sort(key=itemgetter(0), reverse=True)  # stable, like sorting by -sum
        lo = merged[-1][0] if len(merged) == k else 0.0
        tie += 1
        heapq.heappush(heap, (-(merged[0][0] - lo), tie, merged))
    parts = [sorted(items) for _, items in heap[0][2]] if heap else []
    parts += [[] for _ in range(k - len(parts))]
    return sorted(parts, key=lambda p: (-sum(costs[i] for i in p), p))


def _lpt(costs: Sequence[float], k: int) -> list[list[int]]:
    """Greedy: heaviest item to the currently lightest subset."""
    heap = [(0.0, r) for r in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(heap)
        parts[r].append(i)
        heapq.heappush(heap, (load + costs[i], r))
    return parts


def _max_load(parts: Sequence[Sequence[int]], costs: Sequence[float]) -> float:
    return max(sum(costs[i] for i in p) for p in parts)


def _ranked(parts: Sequence[Sequence[int]], costs: Sequence[float]) -> list[list[int]]:
    """Canonical form: items heaviest first inside a rank, ranks heaviest first."""
    key = lambda i: (-costs[i], i)
    out = [sorted(p, key=key) for p in parts]
    return sorted(out, key=lambda p: (-sum(costs[i] for i in p), p))


def _free_partition(costs: Sequence[float], k: int) -> list[list[int]]:
    """KK refined by moves and swaps (when small enough to be quick), else LPT refined; raw
    LPT (so the result is within LPT's 4/3 of the optimum) and the equal-count KK partition
    are candidates too, refined as well when small or when they start better; the best gets
    a few two-for-two exchanges on top."""
    n = len(costs)
    small = n * k <= _KK_FREE_LIMIT  # free KK merges cost O(k) each: O(n k) in all
    first = refine_loads(kk_partition(costs, k) if small else _lpt(costs, k), costs, moves=True)
    best, top = first, _max_load(first, costs)
    others = ([_lpt(costs, k)] if small else []) + [kk_partition(costs, k, equal_counts=True)]
    for p in sorted(others, key=lambda p: _max_load(p, costs)):
        if _max_load(p, costs) < top or n * k <= _REFINE_ALL_LIMIT:
            p = refine_loads(p, costs, moves=True)
        if _max_load(p, costs) < top:
            best, top = p, _max_load(p, costs)
    steps = min(16, max(2, _EXCHANGE_WORK // n))
    return _ranked(refine_loads(best, costs, moves=True, exchanges=steps), costs)


def _ffd(items: Sequence[int], lengths: Sequence[int], cap: int) -> list[list[int]]:
    """First-fit in the given (heaviest-first) order: few microbatches, each under the cap."""
    bins: list[list[int]] = []
    used: list[int] = []
    for i in items:
        for b, u in enumerate(used):
            if u + lengths[i] <= cap:
                bins[b].append(i)
                used[b] += lengths[i]
                break
        else:
            bins.append([i])
            used.append(lengths[i])
    return bins


def _pack_exact(
    items: Sequence[int], m: int, lengths: Sequence[int], costs: Sequence[float], cap: int
) -> list[list[int]] | None:
    """Spread items (heaviest first) over exactly ``m`` microbatches, each to the cheapest one
    it fits in; None if some item fits nowhere."""
    bins: list[list[int]] = [[] for _ in range(m)]
    load = [0.0] * m
    used = [0] * m
    for i in items:
        fits = [b for b in range(m) if used[b] + lengths[i] <= cap]
        if not fits:
            return None
        b = min(fits, key=lambda b: (load[b], b))
        bins[b].append(i)
        load[b] += costs[i]
        used[b] += lengths[i]
    return [b for b in bins if b]


def _heaviest_first(mbs: Sequence[Sequence[int]], costs: Sequence[float]) -> tuple[tuple[int, ...], ...]:
    ordered = sorted(mbs, key=lambda mb: (-sum(costs[i] for i in mb), min(mb)))
    return tuple(tuple(mb) for mb in ordered)


# --- the balancers ------------------------------------------------------------------------


def local_sort(
    lengths: Sequence[int], world_size: int, max_tokens: int, *, cost: CostModel = DEFAULT_COST
) -> Assignment:
    """Sorted by cost (heaviest first), dealt round-robin; one sample per microbatch."""
    check_lengths(lengths, max_tokens)
    _check_world(world_size)
    costs = [cost(n) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (-costs[i], i))
    return tuple(tuple((i,) for i in order[r::world_size]) for r in range(world_size))


def _spread(
    parts: Sequence[Sequence[int]], lengths: Sequence[int], costs: Sequence[float], cap: int
) -> list[list[list[int]]]:
    """Every rank's samples over ``m`` microbatches, ``m`` = the most first-fit needs on any
    rank: cheapest-first by cost, else by tokens, else the rank's own first-fit (fewer, then:
    the collective pads it with empty ones). Never more than ``m``: each slot costs time."""
    m = max(len(_ffd(p, lengths, cap)) for p in parts if p) if any(parts) else 0
    out = []
    for p in parts:
        packed = _pack_exact(p, m, lengths, costs, cap) or _pack_exact(p, m, lengths, lengths, cap)
        out.append(packed if packed is not None else _ffd(p, lengths, cap))
    return out


def _chunks(costs: Sequence[float], k: int) -> list[list[list[int]]]:
    """Sorted by cost, dealt round-robin, one sample per microbatch: always valid, and its
    collective time is at most ``max cost + total / k`` (slot j's heaviest sample is no
    heavier than the mean of slot j-1), i.e. at most twice the optimum."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    return [[[i] for i in order[r::k]] for r in range(k)]


def lb_micro(
    lengths: Sequence[int], world_size: int, max_tokens: int, *, cost: CostModel = DEFAULT_COST
) -> Assignment:
    """Equal sample counts per rank (floor or ceil of n / W), chosen for the collective time:
    the sum over microbatch slots of the heaviest rank's microbatch (``collective_time``).
    Candidates: the slot-first level packing, the equal-count KK partition spread over the
    fewest microbatches, and sorted chunks (the 2x bound); the best is refined on the
    collective time itself. Heaviest microbatch first."""
    check_lengths(lengths, max_tokens)
    _check_world(world_size)
    costs = [cost(n) for n in lengths]
    kk = kk_partition(costs, world_size, equal_counts=True)  # verl's rank split
    candidates = [
        level_pack(costs, lengths, world_size, max_tokens),
        _spread(kk, lengths, costs, max_tokens),
        _chunks(costs, world_size),
    ]
    times = [collective_time([[sum(costs[i] for i in mb) for mb in r] for r in p]) for p in candidates]
    best = candidates[times.index(min(times))]
    best = refine_slots(best, costs, lengths, max_tokens, rounds=min(64, max(8, _SLOT_WORK // len(costs))))
    return tuple(_heaviest_first([sorted(mb, key=lambda i: (-costs[i], i)) for mb in r], costs) for r in best)


def lb_mini(
    lengths: Sequence[int], world_size: int, max_tokens: int, *, cost: CostModel = DEFAULT_COST
) -> Assignment:
    """Free cost-balanced partition (counts may differ), each rank packs its own microbatches
    under the cap (first-fit, heaviest first). Only valid with ODC (``comm="odc"``)."""
    check_lengths(lengths, max_tokens)
    _check_world(world_size)
    costs = [cost(n) for n in lengths]
    parts = _free_partition(costs, world_size)
    return tuple(_heaviest_first(_ffd(p, lengths, max_tokens), costs) for p in parts)


BALANCERS: dict[str, Balancer] = {
    "round_robin": round_robin,
    "local_sort": local_sort,
    "lb_micro": lb_micro,
    "lb_mini": lb_mini,
}


def get_balancer(balance: str | Balancer, *, cost: CostModel | None = None) -> Balancer:
    """A balancer by name (optionally bound to a cost model) or a callable passed through."""
    if callable(balance):
        return balance
    if balance == WORK_STEALING:
        raise ValueError(
            "balance='work_stealing' is dynamic: it has no static assignment; use it through "
            "odcfn.grad_step/train_step (comm='odc') or odcfn.schedule.simulate"
        )
    try:
        fn = BALANCERS[balance]
    except KeyError:
        raise ValueError(
            f"unknown balancer {balance!r}; known: {sorted(BALANCERS) + [WORK_STEALING]}"
        ) from None
    if cost is not None and fn is not round_robin:
        return partial(fn, cost=cost)
    return fn
