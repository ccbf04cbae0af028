"""The plan simulator: hand-computed timelines, bounds, work stealing, the sweep and the CLIs."""

from __future__ import annotations

import argparse
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odcfn.schedule.balance import lb_micro, lb_mini
from odcfn.schedule.cost import TokenCost
from odcfn.schedule.lengths import longalign
from odcfn.schedule.plan import compile_plan
from odcfn.schedule.simulate import (
    A100_COMM,
    ZERO_COMM,
    CommModel,
    Workload,
    compile_plans,
    lower_bound_makespan,
    simulate,
    simulate_work_stealing,
)
from odcfn.schedule.steal import steal_plan
from odcfn.sharding import Mesh
from odcfn.trace import bubble_rate

TOK = TokenCost()


def _compute(res, rank):
    return [
        (e.kind, e.name, e.mb, e.start, e.end) for e in res.events[rank] if e.kind in ("forward", "backward")
    ]


# --- hand-computed timelines (zero communication cost unless stated) -----------------------------


def test_odc_two_units_by_hand():
    # cost = tokens; fwd share 1/4, each unit half: 4 tokens -> F 0.5, B 1.5 per unit
    work = Workload(("a", "b"), fwd_fraction=0.25)
    plans = compile_plans(work.units, (((0,),), ((1,),)), "odc")
    res = simulate(plans, [4, 8], workload=work, cost=TOK)
    assert _compute(res, 0) == [
        ("forward", "a", 0, 0.0, 0.5),
        ("forward", "b", 0, 0.5, 1.0),
        ("backward", "b", 0, 1.0, 2.5),
        ("backward", "a", 0, 2.5, 4.0),
    ]
    assert _compute(res, 1) == [
        ("forward", "a", 0, 0.0, 1.0),
        ("forward", "b", 0, 1.0, 2.0),
        ("backward", "b", 0, 2.0, 5.0),
        ("backward", "a", 0, 5.0, 8.0),
    ]
    sync0 = [e for e in res.events[0] if e.kind == "sync"]
    assert [(e.start, e.end) for e in sync0] == [(4.0, 8.0)]  # rank 0 waits at the one sync
    assert res.makespan == 8.0
    assert res.busy == (4.0, 8.0)
    assert res.bubble_rate == 0.25 == bubble_rate(res.events, res.makespan)


def test_collective_waits_at_every_collective_odc_does_not():
    # two units, two microbatches with opposite imbalance: r0 = [8, 4], r1 = [4, 8] tokens
    work = Workload(("a", "b"), fwd_fraction=0.25)
    lengths = [8, 4, 4, 8]
    assignment = (((0,), (1,)), ((2,), (3,)))
    odc = simulate(compile_plans(work.units, assignment, "odc"), lengths, workload=work, cost=TOK)
    coll = simulate(compile_plans(work.units, assignment, "collective"), lengths, workload=work, cost=TOK)
    assert odc.makespan == 12.0 and odc.bubble_rate == 0.0
    # r1 finishes mb0 at 4 and runs mb1's forward of unit a (kept gathered across the boundary),
    # then waits for the all-gather of b until r0 joins it at 8; it ends at 15, r0 idles 12..15.
    assert _compute(coll, 1) == [
        ("forward", "a", 0, 0.0, 0.5),
        ("forward", "b", 0, 0.5, 1.0),
        ("backward", "b", 0, 1.0, 2.5),
        ("backward", "a", 0, 2.5, 4.0),
        ("forward", "a", 1, 4.0, 5.0),
        ("forward", "b", 1, 8.0, 9.0),
        ("backward", "b", 1, 9.0, 12.0),
        ("backward", "a", 1, 12.0, 15.0),
    ]
    assert _compute(coll, 0)[4:] == [
        ("forward", "a", 1, 8.0, 8.5),
        ("forward", "b", 1, 8.5, 9.0),
        ("backward", "b", 1, 9.0, 10.5),
        ("backward", "a", 1, 10.5, 12.0),
    ]
    assert coll.makespan == 15.0 and abs(coll.bubble_rate - 0.2) < 1e-12


def test_comm_costs_by_hand():
    # transfer = latency + bytes * (S-1)/S / bw = 0.5 + 200 / 2 / 100 = 1.5; sync = 2*log2(2)*0.5
    work = Workload(("u",), param_bytes=200.0, fwd_fraction=0.25)
    comm = CommModel(intra_bandwidth=100.0, intra_latency=0.5)
    res = simulate(
        compile_plans(work.units, (((0,),), ((1,),)), "odc"), [4, 8], workload=work, cost=TOK, comm=comm
    )
    kinds = [(e.kind, e.start, e.end) for e in res.events[1] if e.kind != "release"]
    assert kinds == [
        ("gather", 0.0, 1.5),
        ("forward", 1.5, 3.5),
        ("backward", 3.5, 9.5),
        ("scatter", 9.5, 11.0),
        ("sync", 11.0, 12.0),
    ]
    assert res.makespan == 12.0


def test_work_stealing_by_hand_with_a_straggler():
    work = Workload(("u",), fwd_fraction=0.25)
    kw = dict(workload=work, cost=TOK, max_tokens=4)
    # LB-Mini's lists (cap 4: one sample per microbatch): r0 = 0 then 3, r1 = 1 then 2 (5 each)
    res = simulate_work_stealing([4, 3, 2, 1], 2, **kw)
    assert [p.microbatches for p in res.plans] == [((0,), (3,)), ((1,), (2,))]
    assert res.makespan == 5.0  # equal devices: nothing worth stealing, exactly LB-Mini
    slow = simulate_work_stealing([4, 3, 2, 1], 2, slowdown=[1.0, 2.0], **kw)
    # r1 needs 6 for sample 1. At 4, r0 has finished 4 > 1.1 x the 3 r1 has started: r1 is
    # behind, so r0 helps with r1's queued sample 2 [4, 6], then runs its own 3 [6, 7]; at 6 r1
    # finds its sample 2 taken and nothing worth stealing: it waits at the sync
    assert [p.microbatches for p in slow.plans] == [((0,), (2,), (3,)), ((1,),)]
    assert slow.makespan == 7.0
    assert slow.busy == (7.0, 6.0)  # the slow device's 3 cost units take it 6 s of compute
    assert sum(e.duration for e in slow.events[1] if e.kind in ("forward", "backward")) == 6.0
    never = simulate_work_stealing([4, 3, 2, 1], 2, slowdown=[1.0, 2.0], tolerance=None, **kw)
    # without helping, r0 steals r1's queued sample 2 only once its own list is done, at 5
    # (worth it: r1 would reach it at 6); r1 then finds it taken
    assert [p.microbatches for p in never.plans] == [((0,), (3,), (2,)), ((1,),)]
    assert never.makespan == 7.0


def test_realised_work_stealing_plans_replay_statically():
    """The dynamic run's realised plans, simulated as static plans, give the same timeline."""
    lengths = longalign(24, seed=1, scale=1 / 64)
    work = Workload.uniform(3)
    dyn = simulate_work_stealing(lengths, 4, workload=work, cost=TOK)
    assert sorted(i for p in dyn.plans for mb in p.microbatches for i in mb) == list(range(24))
    for p in dyn.plans:
        assert p.steps[-1].__class__.__name__ == "Sync" and p.count(type(p.steps[-1])) == 1
    replay = simulate(dyn.plans, lengths, workload=work, cost=TOK)
    assert replay.makespan == pytest.approx(dyn.makespan, rel=1e-12)
    assert replay.busy == pytest.approx(dyn.busy, rel=1e-12)


def test_compile_plans_equals_compile_plan():
    units = ("a", "b", "c")
    lengths = [5, 9, 3, 7, 4, 12, 1, 8]
    for comm, bal in (("odc", lb_mini), ("collective", lb_micro), ("collective", lb_mini)):
        a = bal(lengths, 3, 12)
        assert compile_plans(units, a, comm) == tuple(compile_plan(units, a, r, comm) for r in range(3))


def test_mismatched_collective_plans_raise():
    units = ("u",)
    p0 = compile_plan(units, (((0,), (1,)), ((2,), (3,))), 0, "collective")
    p1 = compile_plan(units, (((0,),), ((2,),)), 1, "collective")  # one microbatch fewer
    with pytest.raises(ValueError, match="plans disagree|deadlock"):
        simulate((p0, p1), [1, 1, 1, 1], workload=Workload(units), cost=TOK)
    with pytest.raises(ValueError, match="rank 1's Plan"):
        simulate((p0, p0), [1, 1, 1, 1], workload=Workload(units), cost=TOK)
    with pytest.raises(ValueError, match="not in the workload"):
        simulate((compile_plan(("x",), (((0,),),), 0),), [1], workload=Workload(units), cost=TOK)


# --- properties ---------------------------------------------------------------------------------


@st.composite
def setups(draw):
    world = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, 64), min_size=1, max_size=24))
    units = draw(st.integers(1, 3))
    comm = draw(st.sampled_from([ZERO_COMM, CommModel(1e3, 5e2, 1e-2, 2e-2)]))
    slow = draw(st.lists(st.sampled_from([1.0, 1.5, 2.0]), min_size=world, max_size=world))
    return world, lengths, units, comm, slow


@settings(max_examples=40, deadline=None)
@given(setups())
def test_no_schedule_beats_the_lower_bound(setup):
    world, lengths, units, comm, slow = setup
    work = Workload.uniform(units, model_bytes=100.0)
    mesh = Mesh(world, 0, 2 if world % 2 == 0 else None)
    kw = dict(workload=work, cost=TOK, comm=comm, mesh=mesh, slowdown=slow)
    bound = lower_bound_makespan(lengths, world, TOK, slow)
    runs = [
        simulate(compile_plans(work.units, lb_mini(lengths, world, 64, cost=TOK), "odc"), lengths, **kw),
        simulate(
            compile_plans(work.units, lb_micro(lengths, world, 64, cost=TOK), "collective"), lengths, **kw
        ),
        simulate_work_stealing(lengths, world, **kw),
    ]
    for res in runs:
        assert res.makespan >= bound * (1 - 1e-12)
        assert res.num_samples == len(lengths) and res.num_tokens == sum(lengths)
        assert res.bubble_rate == pytest.approx(bubble_rate(res.events, res.makespan), abs=1e-12)


@settings(max_examples=25, deadline=None)
@given(setups())
def test_realised_plans_replay_with_comm_and_stragglers(setup):
    world, lengths, units, comm, slow = setup
    work = Workload.uniform(units, model_bytes=100.0)
    kw = dict(workload=work, cost=TOK, comm=comm, slowdown=slow)
    dyn = simulate_work_stealing(lengths, world, **kw)
    replay = simulate(dyn.plans, lengths, **kw)
    assert replay.makespan == pytest.approx(dyn.makespan, rel=1e-12)
    assert [len(e) for e in replay.events] == [len(e) for e in dyn.events]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(1, 64), min_size=1, max_size=24))
def test_zero_comm_orderings(world, lengths):
    """With free communication: collective never beats ODC on the same assignment, and work
    stealing is never worse than LB-Mini (equal devices, exact costs)."""
    work = Workload(("u",), fwd_fraction=0.5)  # integer costs stay exact in binary
    a = lb_micro(lengths, world, 64, cost=TOK)
    odc = simulate(compile_plans(work.units, a, "odc"), lengths, workload=work, cost=TOK)
    coll = simulate(compile_plans(work.units, a, "collective"), lengths, workload=work, cost=TOK)
    assert coll.makespan >= odc.makespan
    mini = simulate(
        compile_plans(work.units, lb_mini(lengths, world, 64, cost=TOK), "odc"),
        lengths,
        workload=work,
        cost=TOK,
    )
    ws = simulate_work_stealing(lengths, world, workload=work, cost=TOK, max_tokens=64)
    assert ws.makespan <= mini.makespan
    assert mini.makespan == max(
        max(lengths), max(sum(lengths[i] for mb in p.microbatches for i in mb) for p in mini.plans)
    )


def test_work_stealing_rejects_bad_input():
    work = Workload(("u",))
    with pytest.raises(ValueError, match="empty minibatch"):
        simulate_work_stealing([], 2, workload=work)
    with pytest.raises(ValueError, match="world_size"):
        simulate_work_stealing([1, 2], 0, workload=work)
    with pytest.raises(ValueError, match="plan is for 3 ranks"):
        simulate_work_stealing([1, 2], 2, workload=work, plan=steal_plan([1, 2], 3, 2))
    with pytest.raises(ValueError, match="sample 0 has 3 tokens"):
        simulate_work_stealing([3, 1], 2, workload=work, max_tokens=2)


def test_1024_devices_8_samples_32_units_in_seconds():
    lengths = longalign(1024 * 8, seed=0)
    work = Workload.uniform(32, model_bytes=15e9)
    mesh = Mesh(1024, 0, 8)
    t0 = time.perf_counter()
    odc = simulate(
        compile_plans(work.units, lb_mini(lengths, 1024, 65536), "odc"),
        lengths,
        workload=work,
        comm=A100_COMM,
        mesh=mesh,
        record=False,
    )
    ws = simulate_work_stealing(lengths, 1024, workload=work, comm=A100_COMM, mesh=mesh, record=False)
    elapsed = time.perf_counter() - t0
    assert elapsed < 30.0, f"took {elapsed:.1f} s"  # ~3 s on an idle core
    assert odc.num_samples == ws.num_samples == 8192
    assert 0.0 <= odc.bubble_rate < 0.1


# --- the sweep (odcfn simulate) reproduces the paper's trends -----------------------------------


def test_no_gain_at_one_sample_per_device_gain_at_more():
    from odcfn.schedule.sweep import run_cell

    one = {r.policy: r for r in run_cell("longalign", 16, 1, minibatches=2)}
    four = {r.policy: r for r in run_cell("longalign", 16, 4, minibatches=2)}
    assert one["odc+lb-mini"].speedup == pytest.approx(1.0, abs=0.01)
    assert four["odc+lb-mini"].speedup > 1.15
    eight = {r.policy: r for r in run_cell("longalign", 16, 8, minibatches=2)}
    mini = eight["odc+lb-mini"]
    assert mini.bubble_rate - mini.lower_bound_bubble_rate < 0.03  # near the bound at 8/device


def test_work_stealing_absorbs_a_straggler():
    from odcfn.schedule.sweep import run_cell

    rows = {r.policy: r for r in run_cell("longalign", 16, 4, straggler=1.5, minibatches=4)}
    assert rows["odc+work-stealing"].speedup >= 1.4
    assert rows["odc+work-stealing"].speedup > rows["odc+lb-mini"].speedup > 1.05


def test_simulate_cli_json_and_table(capsys):
    from odcfn.schedule import sweep

    p = argparse.ArgumentParser()
    sweep.add_arguments(p)
    args = p.parse_args(
        [
            "--devices",
            "8",
            "--samples-per-device",
            "1,2",
            "--datasets",
            "aime-rl",
            "--minibatches",
            "1",
            "--json",
            "--straggler",
            "1.2",
        ]
    )
    assert sweep.main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 * 3
    keys = {
        "dataset",
        "devices",
        "samples_per_device",
        "policy",
        "straggler",
        "bubble_rate",
        "lower_bound_bubble_rate",
        "samples_per_s",
    }
    assert all(keys <= set(r) for r in rows)
    assert {r["policy"] for r in rows} == {"collective+lb-micro", "odc+lb-mini", "odc+work-stealing"}
    assert all(r["straggler"] == 1.2 and r["dataset"] == "aime-rl" for r in rows)
    assert (
        sweep.main(
            p.parse_args(
                [
                    "--devices",
                    "8",
                    "--samples-per-device",
                    "2",
                    "--datasets",
                    "longalign",
                    "--minibatches",
                    "1",
                ]
            )
        )
        == 0
    )
    assert "longalign" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        p.parse_args(["--datasets", "c4"])


def test_plan_cli_prints_every_rank(capsys):
    from odcfn.schedule import show

    p = argparse.ArgumentParser()
    show.add_arguments(p)
    assert show.main(p.parse_args(["--devices", "3", "--samples-per-device", "2", "--show-steps"])) == 0
    out = capsys.readouterr().out
    assert all(f"rank   {r}:" in out for r in range(3)) and "Plan(rank=2" in out
    assert show.main(p.parse_args(["--balance", "work_stealing", "--comm", "collective"])) == 2


def test_workload_of_a_real_model_simulates_its_plans():
    from odcfn.models import QwenConfig, qwen_model

    cfg = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
    model = qwen_model(cfg)
    work = Workload.of_model(model, param_bytes=4.0, grad_bytes=2.0)
    assert work.units == model.unit_names
    assert sum(work.param_bytes.values()) == 4.0 * cfg.num_params
    assert sum(work.grad_bytes.values()) == 2.0 * cfg.num_params
    assert work.shares()[1] == pytest.approx(work.shares()[2]) and sum(work.shares()) == pytest.approx(1.0)
    lengths = [5, 9, 3, 7]
    plans = compile_plans(model.unit_names, lb_mini(lengths, 2, 12, cost=TOK), "odc")
    res = simulate(plans, lengths, workload=work, cost=TOK, comm=CommModel(1e4, 1e4, 1e-3, 1e-3))
    assert res.makespan >= lower_bound_makespan(lengths, 2, TOK)
    gathers = [e for e in res.events[0] if e.kind == "gather" and e.name == "layers.0"]
    assert gathers[0].duration == pytest.approx(1e-3 + work.param_bytes["layers.0"] / 2 / 1e4)


@pytest.mark.parametrize(
    "dataset, devices, spd", [("aime-rl", 16, 4), ("aime-rl", 64, 8), ("longalign", 32, 2)]
)
def test_work_stealing_is_never_worse_than_lb_mini_without_a_straggler(dataset, devices, spd):
    """The cells where a shared FIFO queue lost to LB-Mini (short samples, A100 comm): owners
    keep LB-Mini's lists, so with equal devices there is nothing to take and nothing is lost."""
    from odcfn.schedule.sweep import run_cell

    rows = {r.policy: r for r in run_cell(dataset, devices, spd, minibatches=2)}
    assert rows["odc+work-stealing"].samples_per_s >= rows["odc+lb-mini"].samples_per_s * (1 - 1e-9)
