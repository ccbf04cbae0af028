"""Balancers, cost models and synthetic length samplers (pure Python, no ranks)."""

from __future__ import annotations

import itertools
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odcfn.bench.slow import slow_model
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
    QWEN25_7B,
    ModelShape,
    QuadraticCost,
    TokenCost,
    fit_quadratic,
    flops_cost,
    microbatch_cost,
)
from odcfn.schedule.lengths import DATASETS, aime_rl, get_dataset, longalign
from odcfn.schedule.refine import refine_loads
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture (multi-process test)
from tests.util import make_state

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


# --- cost models ------------------------------------------------------------------------------


def test_quadratic_and_microbatch_cost():
    c = QuadraticCost(a=2.0, b=3.0)
    assert c(10) == 2 * 100 + 3 * 10
    assert microbatch_cost(c, [1, 2]) == (2 + 3) + (8 + 6)  # sum over samples, not (1+2)^2
    assert c.scaled(0.5)(10) == 115.0
    with pytest.raises(ValueError, match="QuadraticCost.a"):
        QuadraticCost(-1.0, 1.0)
    with pytest.raises(ValueError, match="a > 0 or b > 0"):
        QuadraticCost(0.0, 0.0)


def test_flops_cost_by_hand():
    m = ModelShape(d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=16, vocab_size=10)
    # per layer: q 64 + k 32 + v 32 + o 64 = 192, mlp 3*8*16 = 384; head 80
    assert m.matmul_params == 2 * (192 + 384) + 80
    c = flops_cost(m)
    assert c.b == 6 * m.matmul_params
    assert c.a == 6 * 8 * 2
    # Qwen2.5-7B: ~6.5B matmul params; attention matches the linear part at ~65K tokens
    assert 6.0e9 < QWEN25_7B.matmul_params < 7.6e9
    assert 50_000 < flops_cost(QWEN25_7B).b / flops_cost(QWEN25_7B).a < 80_000
    assert DEFAULT_COST(1) == pytest.approx(1.0, rel=1e-4)


def test_fit_quadratic_recovers_coefficients():
    lengths = [64, 128, 256, 512, 1024]
    times = [3e-9 * s * s + 2e-6 * s for s in lengths]
    fit = fit_quadratic(lengths, times)
    assert fit.a == pytest.approx(3e-9, rel=1e-6)
    assert fit.b == pytest.approx(2e-6, rel=1e-6)
    linear = fit_quadratic(lengths, [-1e-9 * s * s + 1e-3 * s for s in lengths])
    assert linear.a == 0.0 and linear.b > 0  # constrained to non-negative coefficients
    with pytest.raises(ValueError, match="distinct lengths"):
        fit_quadratic([5, 5], [1.0, 1.0])


def test_calibrate_on_the_real_model_is_positive_and_grows_with_length():
    from odcfn.measure import calibrate
    from odcfn.models import QwenConfig, init_params, qwen_model

    cfg = QwenConfig(vocab_size=37, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=24)
    cost, fwd = calibrate(qwen_model(cfg), init_params(cfg), (32, 64, 128), vocab_size=37, repeats=1)
    assert cost(128) > cost(32) > 0
    assert 0.0 < fwd < 1.0


# --- synthetic lengths ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_samplers_match_the_paper_means_and_are_deterministic(name):
    ds = get_dataset(name)
    lengths = ds.sample(20_000, seed=3)
    assert statistics.mean(lengths) == pytest.approx(ds.paper_mean, rel=0.05)
    assert max(lengths) <= ds.max_tokens
    assert ds.sample(50, seed=1) == ds.sample(50, seed=1) != ds.sample(50, seed=2)


def test_longalign_range_and_tail():
    lengths = longalign(20_000, seed=0)
    assert min(lengths) >= 8192 and max(lengths) <= 65536
    assert statistics.median(lengths) < statistics.mean(lengths)  # right-skewed: a long tail


def test_aime_wrong_answers_longer_and_truncation_spike():
    right = statistics.mean(aime_rl(10_000, seed=0, p_correct=1.0))
    wrong = statistics.mean(aime_rl(10_000, seed=0, p_correct=0.0))
    assert 2.4 < wrong / right < 3.2
    lengths = aime_rl(20_000, seed=0)
    at_cap = sum(n >= 20480 + 100 for n in lengths) / len(lengths)
    assert at_cap > 0.03  # the truncation spike: prompt + a response clipped at the cap
    assert longalign(4, seed=0, scale=1 / 16) == tuple(round(n / 16) for n in longalign(4, seed=0))
    with pytest.raises(ValueError, match="scale"):
        longalign(3, scale=2.0)
    with pytest.raises(ValueError, match="unknown dataset"):
        get_dataset("c4")


# --- work stealing in the real runtime (in-process ranks) ------------------------------------


def _ws_grad_steps(world, lengths, steps=2, ranks_per_node=None, sharding="full", slowdown_of=None, **kw):
    import torch

    import odcfn
    from odcfn.models import QwenConfig, init_params, qwen_model

    cfg = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
    model, full = qwen_model(cfg), init_params(cfg, seed=0)
    batch = odcfn.random_batch(lengths, cfg.vocab_size, seed=1)

    def fn(rank, tr):
        torch.set_num_threads(1)
        mesh = odcfn.Mesh(world, rank, ranks_per_node, sharding)
        p = odcfn.shard(full, model, mesh)
        out = []
        mine = model if slowdown_of is None else slow_model(model, slowdown_of(rank))  # per thread
        for _ in range(steps):  # the counters are fresh every step
            g, m = odcfn.grad_step(make_state(p, mine, tr, **kw), batch)
            out.append(({k: v.clone() for k, v in g.items()}, m))
        return out

    run = odcfn.run_local(fn, world, ranks_per_node=ranks_per_node, sharding=sharding, timeout=30)
    return model, full, batch, run


@pytest.mark.parametrize(
    "world, lengths, rpn, sharding",
    [
        (1, [5, 9, 3, 7, 4, 11, 2], None, "full"),
        (3, [5, 9, 3, 7, 4, 11, 2], None, "full"),
        (4, [6, 10], 2, "hybrid"),  # two ranks never get a sample: they still meet at the sync
    ],
)
@pytest.mark.parametrize("packed", [False, True])
def test_runtime_work_stealing_matches_the_reference_and_runs_each_sample_once(
    world, lengths, rpn, sharding, packed
):
    import math

    import odcfn

    # packed: LB-Mini's microbatches and no helping; else the default (the tail sample by sample)
    packed_lists = odcfn.WorkStealing(split_cost=math.inf, split_tail=0.0, tolerance=None)
    policy = packed_lists if packed else "work_stealing"
    model, full, batch, out = _ws_grad_steps(
        world,
        lengths,
        ranks_per_node=rpn,
        sharding=sharding,
        balance=policy,
        max_tokens_per_microbatch=12,
    )
    loss_ref, g_ref = odcfn.reference_value_and_grad(model, full, batch)
    mesh = odcfn.Mesh(world, 0, rpn, sharding)
    for step in range(2):
        plans = [out[r][step][1].plan for r in range(world)]
        claimed = sorted(i for p in plans for mb in p.microbatches for i in mb)
        assert claimed == list(range(len(lengths))), "every sample exactly once"
        for r in range(world):
            g, m = out[r][step]
            # nothing collective but the replica all-reduce of hybrid sharding, inside the sync
            assert m.counters.syncs == 1 and m.counters.collectives == (sharding == "hybrid")
            assert m.loss == pytest.approx(float(loss_ref), rel=1e-5)
            assert m.plan.count(type(m.plan.steps[-1])) == 1  # one Sync, at the end
            odcfn.tree_assert_allclose(g, odcfn.shard(g_ref, model, mesh.with_rank(r)), rtol=1e-5, atol=1e-7)
            fwd = {e.mb for e in m.events if e.kind == "forward"}
            assert fwd == set(range(len(m.plan.microbatches)))


def test_runtime_work_stealing_takes_work_from_a_slow_rank():
    """Rank 1 computes 8x slower: rank 0 helps with rank 1's list (or steals it once its own is
    done), the slow rank runs less than its LB-Mini list, and the gradients do not change."""
    import odcfn
    from odcfn.schedule import steal_plan

    lengths = [9, 8, 7, 6, 5, 4, 3, 2]
    kw = dict(balance="work_stealing", max_tokens_per_microbatch=9)

    def slow(rank: int) -> float:
        return 8.0 if rank == 1 else 1.0

    model, full, batch, out = _ws_grad_steps(2, lengths, steps=1, slowdown_of=slow, **kw)
    own = steal_plan(lengths, 2, 9, cost=odcfn.schedule.cost.DEFAULT_COST).lists
    ran = [{i for mb in out[r][0][1].plan.microbatches for i in mb} for r in range(2)]
    planned = [{i for mb in own[r] for i in mb} for r in range(2)]
    assert ran[0] | ran[1] == set(range(len(lengths))) and not ran[0] & ran[1]
    assert ran[0] & planned[1], "rank 0 ran some of the slow rank's samples"
    assert ran[1] < planned[1]
    loss_ref, g_ref = odcfn.reference_value_and_grad(model, full, batch)
    for r in range(2):
        g, m = out[r][0]
        assert m.loss == pytest.approx(float(loss_ref), rel=1e-5)
        odcfn.tree_assert_allclose(g, odcfn.shard(g_ref, model, odcfn.Mesh(2, r)), rtol=1e-5, atol=1e-7)


def test_runtime_work_stealing_rejects_collective_and_oversized_samples():
    with pytest.raises(ValueError, match="work_stealing.*comm='odc'"):
        _ws_grad_steps(2, [3, 4], steps=1, balance="work_stealing", comm="collective")
    with pytest.raises(ValueError, match="sample 1 has 9 tokens"):
        _ws_grad_steps(2, [3, 9], steps=1, balance="work_stealing", max_tokens_per_microbatch=8)
    import odcfn

    def too_few_counters(rank, tr):
        tr.max_counters = 5  # a transport with room for fewer counters than 2 ranks x 3 samples need
        mesh = odcfn.Mesh(2, rank)
        p = odcfn.shard(init_params(cfg, seed=0), model, mesh)
        batch = odcfn.random_batch([3, 4, 5], cfg.vocab_size, seed=1)
        before = tr.counters.copy()
        with pytest.raises(ValueError, match="needs 11 shared counters.*has 5"):
            odcfn.grad_step(make_state(p, model, tr, balance="work_stealing"), batch)
        return (tr.counters - before).as_dict()

    from odcfn.models import QwenConfig, init_params, qwen_model

    cfg = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
    model = qwen_model(cfg)
    assert all(not any(c.values()) for c in odcfn.run_local(too_few_counters, 2, timeout=30))
    with pytest.raises(ValueError, match="WorkStealing.tolerance"):
        odcfn.WorkStealing(tolerance=-1.0)
    with pytest.raises(ValueError, match="WorkStealing.split_cost"):
        odcfn.WorkStealing(split_cost=float("nan"))
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="WorkStealing.split_tail"):
            odcfn.WorkStealing(split_tail=bad)


def shm_stealing_worker(lengths, cap, slow_rank):
    """Two work-stealing grad_steps on a ShmTransport (multi-process, counters in /dev/shm)."""
    import odcfn
    from odcfn.kernels.shm import ShmTransport
    from odcfn.models import QwenConfig, init_params, qwen_model

    cfg = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
    model, full = qwen_model(cfg), init_params(cfg, seed=0)
    batch = odcfn.random_batch(lengths, cfg.vocab_size, seed=1)
    mesh = odcfn.Mesh.from_env()
    out = []
    with ShmTransport(mesh, timeout=30) as tr:
        for _ in range(2):
            mine = slow_model(model, 2.0 if mesh.rank == slow_rank else 1.0)
            state = make_state(full, mine, tr, balance="work_stealing", max_tokens_per_microbatch=cap)
            g, m = odcfn.grad_step(state, batch)
            grads = {k: v.detach().clone().numpy() for k, v in g.items()}
            out.append((grads, m.loss, m.plan.microbatches, m.counters.syncs))
    return out


def test_shm_work_stealing_across_processes(mp_pool):  # noqa: F811
    import torch

    import odcfn
    from odcfn.models import QwenConfig, init_params, qwen_model

    lengths, world = [5, 9, 3, 7, 4, 11, 2, 6], 2
    out = mp_pool.run(shm_stealing_worker, world, args=(lengths, 12, 1))
    cfg = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
    model, full = qwen_model(cfg), init_params(cfg, seed=0)
    loss, g_ref = odcfn.reference_value_and_grad(model, full, odcfn.random_batch(lengths, 37, seed=1))
    mesh = odcfn.Mesh(world, 0)
    for step in range(2):
        claimed = sorted(i for r in range(world) for mb in out[r][step][2] for i in mb)
        assert claimed == list(range(len(lengths)))
        for r in range(world):
            grads, got_loss, _, syncs = out[r][step]
            assert syncs == 1 and got_loss == pytest.approx(float(loss), rel=1e-5)
            want = odcfn.shard(g_ref, model, mesh.with_rank(r))
            odcfn.tree_assert_allclose(
                {k: torch.from_numpy(v) for k, v in grads.items()}, want, rtol=1e-5, atol=1e-7
            )


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
