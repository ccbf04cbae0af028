"""Balancers (pure Python, no ranks): every sample once under the cap, against verl-style
packing, brute-force optima and the paper's reference; plus the simulator's quality report."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odcfn.schedule.balance import (
    BALANCERS,
    _lpt,
    _spread,
    collective_time,
    get_balancer,
    kk_partition,
    lb_micro,
    lb_mini,
    local_sort,
    rank_loads,
    round_robin,
)
from odcfn.schedule.cost import (
    DEFAULT_COST,
    QuadraticCost,
    TokenCost,
    microbatch_cost,
)
from odcfn.schedule.refine import refine_loads
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture (multi-process test)

COSTS = [DEFAULT_COST, TokenCost(), QuadraticCost(1.0, 0.0)]


@st.composite
def problems(draw, max_n=40):
    cap = draw(st.integers(4, 300))
    lengths = draw(st.lists(st.integers(1, cap), min_size=1, max_size=max_n))
    world = draw(st.integers(1, 9))
    cost = draw(st.sampled_from(COSTS))
    return lengths, world, cap, cost


def _ids(assignment):
    return sorted(i for mbs in assignment for mb in mbs for i in mb)


# --- properties shared by every balancer ------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(problems(), st.sampled_from(sorted(BALANCERS)))
def test_every_sample_once_under_the_cap_and_deterministic(problem, name):
    lengths, world, cap, cost = problem
    fn = get_balancer(name, cost=cost)
    a = fn(lengths, world, cap)
    assert len(a) == world
    assert _ids(a) == list(range(len(lengths)))
    for mbs in a:
        for mb in mbs:
            assert mb, "balancers emit no empty microbatches (collective compile pads)"
            assert sum(lengths[i] for i in mb) <= cap
    assert fn(list(lengths), world, cap) == a  # same input -> same output


def _mb_costs(assignment, lengths, cost):
    return [[microbatch_cost(cost, [lengths[i] for i in mb]) for mb in mbs] for mbs in assignment]


def _verl_style(lengths, world, cap, cost):
    """verl's LB-Micro construction: the equal-count KK rank split, each rank spread over the
    same (fewest first-fit) number of microbatches."""
    costs = [cost(n) for n in lengths]
    return _spread(kk_partition(costs, world, equal_counts=True), lengths, costs, cap)


@settings(max_examples=60, deadline=None)
@given(problems())
def test_lb_micro_equal_counts_heaviest_first_and_never_worse_than_verl_style(problem):
    lengths, world, cap, cost = problem
    a = lb_micro(lengths, world, cap, cost=cost)
    counts = [sum(len(mb) for mb in mbs) for mbs in a]
    assert max(counts) - min(counts) <= 1
    for mbs in a:  # heaviest first (a rank with fewer microbatches is padded by compile_plan)
        c = [microbatch_cost(cost, [lengths[i] for i in mb]) for mb in mbs]
        assert c == sorted(c, reverse=True)
    got = collective_time(_mb_costs(a, lengths, cost))
    costs = [cost(n) for n in lengths]
    verl = collective_time(_mb_costs(_verl_style(lengths, world, cap, cost), lengths, cost))
    assert got <= verl * (1 + 1e-9)
    assert got <= (max(costs) + sum(costs) / world) * (1 + 1e-9)  # the sorted-chunks candidate's bound
    assert got >= max(rank_loads(a, lengths, cost)) * (1 - 1e-12)


def test_collective_time_pairs_heaviest_with_heaviest():
    assert collective_time([[3.0, 1.0], [2.0]]) == 3.0 + 1.0
    assert collective_time([[1.0, 3.0], [2.0, 2.0]]) == 3.0 + 2.0  # sorted per rank first
    assert collective_time([[], [5.0]]) == 5.0


def test_lb_micro_packs_under_the_slot_height_instead_of_spreading():
    """Ranks {9, 1} and {4, 4} under a cap of 9: the first needs two microbatches, so every rank
    gets two slots. Spreading the second rank too (verl's construction) costs 9 + 4; packing its
    4 + 4 under the 9 costs 9 + 1, the optimum."""
    cost, lengths = TokenCost(), [9, 4, 1, 4]
    assert collective_time(_mb_costs(_verl_style(lengths, 2, 9, cost), lengths, cost)) == 13.0
    a = lb_micro(lengths, 2, 9, cost=cost)
    assert sorted(a) == [((0,), (2,)), ((1, 3),)]
    assert collective_time(_mb_costs(a, lengths, cost)) == 10.0 == _best_collective_time(lengths, 2, 9, cost)


# --- against the exact optimum on small instances (brute force) -------------------------------


def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in _set_partitions(rest):
        for k in range(len(p)):
            yield p[:k] + [[first] + p[k]] + p[k + 1 :]
        yield [[first]] + p


def _best_collective_time(lengths, world, cap, cost):
    """min over rank splits with floor/ceil(n / W) samples each and over every split of each
    rank into microbatches under the cap of sum_j max_r (rank r's j-th heaviest microbatch)."""
    n = len(lengths)
    lo, hi = n // world, -(-n // world)
    profiles = {}

    def of(items):
        key = tuple(items)
        if key not in profiles:
            profiles[key] = [
                sorted((sum(cost(lengths[i]) for i in mb) for mb in p), reverse=True)
                for p in _set_partitions(list(items))
                if all(sum(lengths[i] for i in mb) <= cap for mb in p)
            ]
        return profiles[key]

    best = float("inf")
    for ranks in itertools.product(range(world), repeat=n):
        if any(r > max(ranks[:i], default=-1) + 1 for i, r in enumerate(ranks)):
            continue  # rank labels in order of first use: each split once up to relabelling
        groups = [[i for i in range(n) if ranks[i] == r] for r in range(world)]
        if any(not lo <= len(g) <= hi for g in groups):
            continue
        for combo in itertools.product(*(of(g) for g in groups)):
            m = max(len(p) for p in combo)
            best = min(best, sum(max(p[j] if j < len(p) else 0.0 for p in combo) for j in range(m)))
    return best


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=2, max_size=7), st.integers(2, 3), st.sampled_from(COSTS[1:]))
def test_lb_micro_against_the_exact_optimum(lengths, world, cost):
    """Proved bound: LB-Micro's collective time <= max cost + total / W (its sorted-chunks
    candidate: slot j's heaviest sample weighs at most the mean of slot j-1), and both terms
    are lower bounds of the optimum, so <= 2 x optimum."""
    cap = max(max(lengths), 50)
    got = collective_time(_mb_costs(lb_micro(lengths, world, cap, cost=cost), lengths, cost))
    best = _best_collective_time(lengths, world, cap, cost)
    costs = [cost(n) for n in lengths]
    assert best * (1 - 1e-9) <= got <= (max(costs) + sum(costs) / world) * (1 + 1e-9)
    assert got <= 2 * best * (1 + 1e-9)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=9), st.integers(2, 3))
def test_lb_mini_against_the_exact_optimum(lengths, world):
    """Brute force over all partitions. Proved bound: LB-Mini's max load <= (4/3 - 1/(3W)) x
    optimum (raw LPT is a candidate: Graham's bound; refinement never raises the max), and
    never above KK refined by the same swaps."""
    cost = TokenCost()
    best = min(
        max(sum(n for n, r in zip(lengths, ranks) if r == k) for k in range(world))
        for ranks in itertools.product(range(world), repeat=len(lengths))
    )
    got = max(rank_loads(lb_mini(lengths, world, 50, cost=cost), lengths, cost))
    assert best <= got <= best * (4 / 3 - 1 / (3 * world)) + 1e-9
    costs = [float(n) for n in lengths]
    kk = refine_loads(kk_partition(costs, world), costs, moves=True)
    assert got <= max(sum(lengths[i] for i in p) for p in kk)


@settings(max_examples=80, deadline=None)
@given(problems())
def test_lb_mini_never_worse_than_kk_plus_swaps_nor_lpt(problem):
    lengths, world, cap, cost = problem
    costs = [cost(n) for n in lengths]
    mini = max(rank_loads(lb_mini(lengths, world, cap, cost=cost), lengths, cost))
    for start in (kk_partition(costs, world), _lpt(costs, world)):
        ref = max(sum(costs[i] for i in p) for p in refine_loads(start, costs, moves=True))
        assert mini <= ref * (1 + 1e-12)
    assert mini >= max(max(costs), sum(costs) / world) * (1 - 1e-12)


def test_kk_two_way_textbook_example():
    # differencing {8,7,6,5,4}: 8-7=1; 6-5=1; 4-1=3; 3-1=2 -> parts differ by 2
    parts = kk_partition([8, 7, 6, 5, 4], 2)
    sums = sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts)
    assert sums == [14, 16]
    assert sorted(i for p in parts for i in p) == list(range(5))


def test_kk_equal_counts_chunks():
    costs = [10, 9, 8, 7, 6, 5, 4]
    parts = kk_partition(costs, 3, equal_counts=True)
    assert sorted(len(p) for p in parts) == [2, 2, 3]
    assert sorted(i for p in parts for i in p) == list(range(7))


def test_local_sort_deals_sorted_one_per_microbatch():
    lengths = [5, 1, 9, 3, 7, 2]
    a = local_sort(lengths, 2, 10, cost=TokenCost())
    # sorted: 9 (id 2), 7 (4), 5 (0), 3 (3), 2 (5), 1 (1); dealt alternately
    assert a == (((2,), (0,), (5,)), ((4,), (3,), (1,)))


def test_round_robin_unchanged():
    assert round_robin([3, 3, 3, 3, 3], 2, 6) == (((0, 2), (4,)), ((1, 3),))


def test_lb_micro_beats_round_robin_on_skew():
    lengths = [100, 1, 1, 1, 90, 2, 2, 2]
    cost = TokenCost()
    rr = max(rank_loads(round_robin(lengths, 2, 100), lengths, cost))
    micro = max(rank_loads(lb_micro(lengths, 2, 100, cost=cost), lengths, cost))
    assert micro < rr


def test_errors_name_the_culprit():
    with pytest.raises(ValueError, match="sample 1 has 12 tokens"):
        lb_mini([3, 12], 2, 10)
    with pytest.raises(ValueError, match="world_size"):
        lb_micro([3, 4], 0, 10)
    with pytest.raises(ValueError, match="empty minibatch"):
        local_sort([], 2, 10)
    with pytest.raises(ValueError, match="unknown balancer 'nope'"):
        get_balancer("nope")
    with pytest.raises(ValueError, match="dynamic"):
        get_balancer("work_stealing")


def test_simulate_quality_reports_both_balancers_over_the_bound(capsys):
    import argparse

    from odcfn.schedule import sweep

    cells = sweep.balancer_quality(["aime-rl"], [4], [1, 4], minibatches=2)
    assert [(c["devices"], c["samples_per_device"]) for c in cells] == [(4, 1), (4, 4)]
    one, four = cells
    assert one["lb_micro"] == pytest.approx(1.0) and one["lb_mini"] == pytest.approx(1.0)  # 1 each
    assert four["lb_micro"] >= 1.0 - 1e-12 and four["lb_mini"] >= 1.0 - 1e-12
    p = argparse.ArgumentParser()
    sweep.add_arguments(p)
    args = p.parse_args(["--quality", "--devices", "4", "--samples-per-device", "4", "--datasets", "aime-rl",
                         "--minibatches", "2"])
    assert sweep.main(args) == 0
    out = capsys.readouterr().out
    assert "LB-Micro coll. time/bound" in out and f"{four['lb_micro']:.4f}" in out
