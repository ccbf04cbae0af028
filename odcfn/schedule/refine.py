"""Local search for the balancers: the max rank load (LB-Mini) and the collective time (LB-Micro).

Both are steepest descent: every round evaluates every candidate move at once (numpy over all
items), applies the best strictly improving one and stops when none is left or after ``rounds``.
Everything is deterministic: ties go to the lowest index (numpy's ``argmax`` / ``argmin``).

The collective time of an assignment is what a collective (FSDP) schedule waits for: every rank
issues the same collectives for its j-th microbatch, so slot j lasts as long as the heaviest j-th
microbatch, and the step lasts ``sum over slots j of max over ranks r of cost(mb[r][j])`` (ranks
with fewer microbatches pad with empty ones). Sorting every rank's microbatches heaviest first
minimises it for given microbatches (pairing the largest with the largest).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["collective_time", "refine_loads", "refine_slots"]

_EPS = 1e-12
_PAIR_LIMIT = 12  # two-for-two exchanges scan every pair of a subset: small subsets only,
_PAIR_PARTNERS = 8  # and only with the lightest few subsets


def collective_time(mb_costs: Sequence[Sequence[float]]) -> float:
    """``sum_j max_r`` of each rank's j-th heaviest microbatch cost (missing ones count 0)."""
    profiles = [sorted(c, reverse=True) for c in mb_costs]
    m = max((len(p) for p in profiles), default=0)
    return float(sum(max(p[j] if j < len(p) else 0.0 for p in profiles) for j in range(m)))


def refine_loads(
    parts: Sequence[Sequence[int]],
    costs: Sequence[float],
    *,
    moves: bool,
    rounds: int = 160,
    exchanges: int = 0,
) -> list[list[int]]:
    """Lower the max load: move one item (if ``moves``) or swap two items between the heaviest
    subset and *any* other whenever that lowers the pair's maximum below the current maximum;
    when none does, swap the lightest subset up (the pair's minimum rises, nothing reaches the
    maximum). Before that, up to ``exchanges`` times (with small subsets), an exchange of one
    or two items for one or two with one of the lightest subsets.
    Every step narrows a pair, so the sum of squared loads falls: no cycles. Swaps keep subset
    sizes; moves and uneven exchanges do not (``moves=False`` skips both)."""
    k = len(parts)
    parts = [list(p) for p in parts]
    n = len(costs)
    if k < 2 or n == 0:
        return parts
    c = np.asarray(costs, dtype=np.float64)
    owner = np.empty(n, dtype=np.int64)
    for r, p in enumerate(parts):
        owner[p] = r
    loads = np.bincount(owner, weights=c, minlength=k)
    for _ in range(rounds):
        h = int(np.argmax(loads))
        mine = np.asarray(parts[h], dtype=np.int64)
        if mine.size == 0:
            break
        top = loads[h]
        best, move = top - _EPS * max(1.0, top), None  # the new pair max to beat
        # swaps: item i of h <-> item j elsewhere, d = c_i - c_j > 0
        d = c[mine][:, None] - c[None, :]
        pair = np.maximum(top - d, loads[owner][None, :] + d)
        pair[(d <= 0) | (owner == h)[None, :]] = np.inf
        a, b = np.unravel_index(int(np.argmin(pair)), pair.shape)
        if pair[a, b] < best:
            best, move = float(pair[a, b]), (int(mine[a]), int(b))
        if moves and len(mine) > 1:
            # a move's best target is the lightest other subset, whatever the item
            o2 = int(np.argmin(np.where(np.arange(k) == h, np.inf, loads)))
            pm = np.maximum(top - c[mine], loads[o2] + c[mine])
            a2 = int(np.argmin(pm))
            if pm[a2] < best:
                best, move = float(pm[a2]), (int(mine[a2]), -1 - o2)
        if move is not None:
            _apply(parts, owner, loads, c, h, *move)
            continue
        if exchanges > 0 and max(len(p) for p in parts) <= _PAIR_LIMIT:
            ex = _exchange(parts, c, loads, h, top - _EPS * max(1.0, top), even=not moves)
            exchanges -= 1
            if ex is not None:
                out, o, back = ex
                for i in out:
                    parts[h].remove(i)
                    parts[o].append(i)
                    owner[i] = o
                for j in back:
                    parts[o].remove(j)
                    parts[h].append(j)
                    owner[j] = h
                delta = c[list(out)].sum() - c[list(back)].sum()
                loads[h] -= delta
                loads[o] += delta
                continue
        # the heaviest is stuck: raise the lightest instead (swap up with any subset that
        # stays above it, none reaching the max), which can unstick it next round
        h = int(np.argmin(loads))
        mine = np.asarray(parts[h], dtype=np.int64)
        low = loads[h]
        d = c[None, :] - c[mine][:, None]  # item j elsewhere comes in, item i goes out
        other = loads[owner][None, :]
        pair = np.minimum(low + d, other - d)
        bad = (d <= 0) | (owner == h)[None, :] | (low + d >= top) | (mine.size == 0)
        pair = np.where(bad, -np.inf, pair)
        if pair.size == 0:
            break
        a, b = np.unravel_index(int(np.argmax(pair)), pair.shape)
        if not pair[a, b] > low + _EPS * max(1.0, top):
            break
        _apply(parts, owner, loads, c, h, int(mine[a]), int(b))
    return parts


def _apply(
    parts: list[list[int]], owner: np.ndarray, loads: np.ndarray, c: np.ndarray, h: int, i: int, j: int
) -> None:
    """Item i leaves subset h for item j's subset, j comes back (a swap), or for subset
    ``-1 - j`` when ``j < 0`` (a move)."""
    o = int(owner[j]) if j >= 0 else -1 - j
    parts[h].remove(i)
    parts[o].append(i)
    owner[i] = o
    loads[h] -= c[i]
    loads[o] += c[i]
    if j >= 0:
        parts[o].remove(j)
        parts[h].append(j)
        owner[j] = h
        loads[h] += c[j]
        loads[o] -= c[j]


def _exchange(
    parts: Sequence[Sequence[int]], c: np.ndarray, loads: np.ndarray, h: int, beat: float, *, even: bool
) -> tuple[tuple[int, ...], int, tuple[int, ...]] | None:
    """The best exchange of one or two items of subset ``h`` for one or two of one of the
    lightest subsets whose new pair maximum is below ``beat`` (what single swaps miss)."""
    units: list[tuple[int, ...]] = []
    unit_owner: list[int] = []
    partners = np.argsort(loads, kind="stable")[:_PAIR_PARTNERS].tolist()
    for r in [h] + [r for r in partners if r != h]:
        p = parts[r]
        for x in range(len(p)):
            units.append((p[x],))
            unit_owner.append(r)
            for y in range(x + 1, len(p)):
                units.append((p[x], p[y]))
                unit_owner.append(r)
    uo = np.asarray(unit_owner, dtype=np.int64)
    cu = np.fromiter((sum(c[i] for i in u) for u in units), dtype=np.float64, count=len(units))
    mine = np.flatnonzero(uo == h)
    if mine.size == 0:
        return None
    d = cu[mine][:, None] - cu[None, :]
    pair = np.maximum(loads[h] - d, loads[uo][None, :] + d)
    ok = (d > 0) & (uo != h)[None, :]
    if even:
        size = np.fromiter((len(u) for u in units), dtype=np.int64, count=len(units))
        ok &= size[mine][:, None] == size[None, :]
    pair = np.where(ok, pair, np.inf)
    a, b = np.unravel_index(int(np.argmin(pair)), pair.shape)
    if not pair[a, b] < beat:
        return None
    return units[int(mine[a])], int(uo[b]), units[int(b)]


def refine_slots(
    mbs: Sequence[Sequence[Sequence[int]]],
    costs: Sequence[float],
    lengths: Sequence[int],
    cap: int,
    *,
    rounds: int = 200,
) -> list[list[list[int]]]:
    """Lower the collective time of rank -> microbatches (each rank keeps its sample count and
    at most ``m`` = the largest microbatch count; every microbatch stays under ``cap`` tokens).

    A move takes an item out of a slot's heaviest microbatch A: it swaps with a lighter item of
    any other microbatch B (any rank), or moves to another microbatch of A's rank (or one of its
    empty padding slots). It is scored with every microbatch kept at its slot: slot(A) drops to
    ``max(second heaviest there, new A)``, slot(B) rises to ``max(its max, new B)``. Re-sorting
    the ranks afterwards can only lower the time further, so each applied move lowers it.
    """
    world = len(mbs)
    m = max((len(r) for r in mbs), default=0)
    n = len(costs)
    if world < 1 or m == 0:
        return [[list(mb) for mb in r] for r in mbs]
    nb = world * m  # microbatch b = rank * m + position in that rank's list (padding included)
    lists: list[list[int]] = [[] for _ in range(nb)]
    for r, rank_mbs in enumerate(mbs):
        for p, mb in enumerate(rank_mbs):
            lists[r * m + p] = list(mb)
    c = np.asarray(costs, dtype=np.float64)
    tok = np.asarray(lengths, dtype=np.int64)
    mb_of = np.full(n, -1, dtype=np.int64)
    for b, mb in enumerate(lists):
        mb_of[mb] = b
    placed = mb_of >= 0  # items of this call (a caller may pass a subset)
    mb_cost = np.bincount(mb_of[placed], weights=c[placed], minlength=nb)
    mb_tok = np.bincount(mb_of[placed], weights=tok[placed], minlength=nb)
    cols = np.arange(m)
    for _ in range(rounds):
        # slot of each microbatch: its position in its rank's heaviest-first order
        grid = mb_cost.reshape(world, m)
        order = np.argsort(-grid, axis=1, kind="stable")
        slot = np.empty((world, m), dtype=np.int64)
        np.put_along_axis(slot, order, np.broadcast_to(cols, (world, m)), axis=1)
        slot = slot.reshape(nb)
        by_slot = np.take_along_axis(grid, order, axis=1)  # [rank, slot]
        crit_rank = np.argmax(by_slot, axis=0)
        height = by_slot[crit_rank, cols]
        masked = by_slot.copy()
        masked[crit_rank, cols] = -np.inf
        second = masked.max(axis=0) if world > 1 else np.zeros(m)
        # one row per item of every slot's heaviest microbatch A
        crit = crit_rank * m + order[crit_rank, cols]
        rows = [(i, j) for j in range(m) for i in lists[crit[j]]]
        if not rows:
            break
        items = np.fromiter((i for i, _ in rows), dtype=np.int64, count=len(rows))
        rj = np.fromiter((j for _, j in rows), dtype=np.int64, count=len(rows))
        ra = crit[rj][:, None]
        h, s2 = height[rj][:, None], second[rj][:, None]
        ci, ti = c[items][:, None], tok[items][:, None]
        # swaps with every item k elsewhere (any rank): d = c_i - c_k > 0
        d = ci - c[None, :]
        b = mb_of[None, :]
        jb = slot[b]
        new_a = h - d
        rise_b = np.maximum(mb_cost[b] + d - height[jb], 0.0)
        gain = np.where(
            jb == rj[:, None],
            h - np.maximum(np.maximum(s2, new_a), mb_cost[b] + d),
            h - np.maximum(s2, new_a) - rise_b,
        )
        ok = (d > 0) & (b != ra) & placed[None, :]
        ok &= (mb_tok[ra] - ti + tok[None, :] <= cap) & (mb_tok[b] - tok[None, :] + ti <= cap)
        gain = np.where(ok, gain, -np.inf)
        x, y = np.unravel_index(int(np.argmax(gain)), gain.shape)
        best_gain, best = _EPS * max(1.0, float(height.sum())), None
        if gain[x, y] > best_gain:
            best_gain, best = float(gain[x, y]), (int(ra[x, 0]), int(items[x]), int(mb_of[y]), int(y))
        # moves to another microbatch of A's rank (its empty padding ones included)
        bbs = (ra // m) * m + cols[None, :]
        g = h - np.maximum(s2, h - ci) - np.maximum(mb_cost[bbs] + ci - height[slot[bbs]], 0.0)
        g = np.where((bbs != ra) & (mb_tok[bbs] + ti <= cap), g, -np.inf)
        x2, y2 = np.unravel_index(int(np.argmax(g)), g.shape)
        if g[x2, y2] > best_gain:
            best_gain, best = float(g[x2, y2]), (int(ra[x2, 0]), int(items[x2]), int(bbs[x2, y2]), -1)
        if best is None:
            break
        a, i, b, k = best
        lists[a].remove(i)
        lists[b].append(i)
        mb_of[i] = b
        for src, dst, item in ((a, b, i),) + (((b, a, k),) if k >= 0 else ()):
            mb_cost[src] -= c[item]
            mb_cost[dst] += c[item]
            mb_tok[src] -= tok[item]
            mb_tok[dst] += tok[item]
        if k >= 0:
            lists[b].remove(k)
            lists[a].append(k)
            mb_of[k] = a
    return [[lists[r * m + p] for p in range(m) if lists[r * m + p]] for r in range(world)]


def level_pack(costs: Sequence[float], lengths: Sequence[int], world: int, cap: int) -> list[list[list[int]]]:
    """Collective-first construction, like first-fit-decreasing-height strip packing: items
    heaviest first, each into the (rank, slot) cell that raises the collective time least with
    cells kept at their slots -- under a slot's height if it fits anywhere (then the fullest
    such cell), else the cell that overshoots least (an empty slot costs the item's own cost).
    Ranks take floor or ceil(n / world) items, so counts stay equal."""
    n = len(costs)
    base, extra = divmod(n, world)
    width = base + (extra > 0)  # no rank ever needs more cells than items
    # cells flattened as slot * world + rank; only opened slots and the next one are scanned
    cell = np.zeros(width * world)
    room = np.full(width * world, cap, dtype=np.int64)  # -1 once the rank's count is full
    height = np.zeros(width * world)  # the slot's height, repeated per cell
    count = [0] * world
    items: list[list[int]] = [[] for _ in range(width * world)]
    order = sorted(range(n), key=lambda i: (-costs[i], i))
    opened = at_ceil = 0
    for i in order:
        span = min(opened + 1, width) * world
        ci, ti = costs[i], lengths[i]
        new = cell[:span] + ci
        ok = room[:span] >= ti
        top = height[:span]
        key = np.where(ok & (new <= top), new, -np.inf)  # fits under its slot: fullest first
        b = int(key.argmax())
        if key[b] == -np.inf:  # fits under no height: the least overshoot
            b = int(np.where(ok, new - top, np.inf).argmin())
        j, r = divmod(b, world)
        items[b].append(i)
        nb = float(new[b])
        cell[b] = nb
        room[b] -= ti
        if nb > height[b]:
            height[j * world : (j + 1) * world] = nb
        opened = max(opened, j + 1)
        count[r] += 1
        if count[r] == base + 1:
            room[r::world] = -1
            at_ceil += 1
            if at_ceil == extra:  # the ceil quota is used up: ranks at base are full too
                for q in range(world):
                    if count[q] == base:
                        room[q::world] = -1
        elif count[r] == base and at_ceil >= extra:
            room[r::world] = -1
    return [[items[j * world + r] for j in range(width) if items[j * world + r]] for r in range(world)]
