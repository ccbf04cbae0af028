"""Bounded staleness in the simulator (odcfn.schedule.simstale, ``odcfn simulate --staleness``):
a hand-computed case, τ = 0 against the synchronous simulator, never slower / never more than τ
behind, what a fixed and a moving straggler allow, and the CLI's errors."""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odcfn.schedule.balance import lb_micro, lb_mini
from odcfn.schedule.cost import TokenCost
from odcfn.schedule.lengths import longalign
from odcfn.schedule.simstale import simulate_staleness, stale_timeline
from odcfn.schedule.simulate import A100_COMM, CommModel, Workload, compile_plans, simulate
from odcfn.schedule.sweep import run_cell
from odcfn.sharding import Mesh

TOK = TokenCost()

# rank 0 is slow on minibatch 0, rank 1 on minibatch 2; publishing a version takes 0.5
HAND = [[3.0, 1.0], [1.0, 1.0], [1.0, 3.0]]
# τ=0: every minibatch ends at a sync: (3 + .5) + (1 + .5) + (3 + .5) = 8.5.
# τ=1: minibatch 2 needs version 1 (published at 3 + .5): rank 0 runs 0-3, 3-4, 4-5; rank 1 runs
#      0-1, 1-2, 3.5-6.5; the last version is out at 7.
# τ=2: nobody waits: each rank's own sum (5) plus the last publish.
HAND_MAKESPAN = {0: 8.5, 1: 7.0, 2: 5.5}
HAND_STARTS = {0: [[0, 0], [3.5, 3.5], [5, 5]], 1: [[0, 0], [3, 1], [4, 3.5]], 2: [[0, 0], [3, 1], [4, 2]]}


@pytest.mark.parametrize("tau", [0, 1, 2])
def test_hand_computed_two_devices_three_minibatches(tau):
    tl = stale_timeline(HAND, tau, publish=0.5)
    assert tl.makespan == HAND_MAKESPAN[tau]
    assert tl.starts.tolist() == HAND_STARTS[tau]
    assert tl.limit == 5.5
    assert tl.lags.max() == tau  # each τ is used to the full on this case
    assert tl.wait.tolist() == [{0: 3.5, 1: 2.0, 2: 0.5}[tau]] * 2


@pytest.mark.parametrize("tau", [0, 1, 2])
def test_hand_case_through_the_simulator(tau):
    """The same case from plans: one unit, cost = tokens, free transfers, and a 0.25 s latency
    so that the sync (2 log2(2) latencies) takes 0.5 s."""
    comm = CommModel(intra_latency=0.25)
    work = Workload(("u",))
    lengths = [(3, 1), (1, 1), (1, 3)]
    plans = [compile_plans(work.units, (((0,),), ((1,),)), "odc") for _ in lengths]
    runs = simulate_staleness(plans, lengths, [tau], workload=work, cost=TOK, comm=comm)
    assert runs[tau].makespan == HAND_MAKESPAN[tau]
    assert runs[tau].busy == (5.0, 5.0)
    assert runs[tau].num_samples == 6 and runs[tau].num_tokens == 10


def _draws(devices=16, minibatches=4, spd=2):
    work = Workload.uniform(4, model_bytes=2 * 7.6e9)
    lengths = [longalign(devices * spd, seed=k, scale=1 / 16) for k in range(minibatches)]
    plans = [compile_plans(work.units, lb_mini(ls, devices, 4096, cost=TOK), "odc") for ls in lengths]
    slow = [[1.5 if r == (3 * k) % devices else 1.0 for r in range(devices)] for k in range(minibatches)]
    mesh = Mesh(devices, 0, min(devices, 8))  # nodes of 8: the 16-device draws span two
    return plans, lengths, dict(workload=work, cost=TOK, comm=A100_COMM, mesh=mesh), slow


def test_tau0_is_the_synchronous_simulator_exactly():
    plans, lengths, kw, slow = _draws()
    sync = [simulate(p, ls, slowdown=sd, record=False, **kw) for p, ls, sd in zip(plans, lengths, slow)]
    runs = simulate_staleness(plans, lengths, [0, 1], slowdowns=slow, **kw)
    assert runs[0].makespan == sum(r.makespan for r in sync)  # bit for bit, not approx
    assert runs[0].busy == tuple(map(float, np.sum([r.busy for r in sync], axis=0)))
    assert runs[0].timeline.starts[1:, 0].tolist() == np.cumsum([r.makespan for r in sync])[:-1].tolist()
    assert runs[0].lag_max == 0
    # the synchronous sweep's ODC + LB-Mini row and the staleness sweep's τ = 0 row agree
    from odcfn.schedule.stalesweep import stale_cell

    cell = dict(straggler=1.5, slow_fraction=0.5, minibatches=3)
    (mini,) = [r for r in run_cell("aime-rl", 16, 2, **cell) if r.policy == "odc+lb-mini"]
    rows = stale_cell("aime-rl", 16, 2, [1], **cell)
    assert [r.staleness for r in rows] == [0, 1]  # τ = 0 always: the baseline
    assert rows[0].samples_per_s == pytest.approx(mini.samples_per_s, rel=1e-12)
    assert rows[0].bubble_rate == pytest.approx(mini.bubble_rate, abs=1e-12)
    assert rows[0].speedup == 1.0 and rows[1].speedup >= 1.0


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 7).flatmap(
        lambda w: st.lists(st.lists(st.floats(0.0, 10.0), min_size=w, max_size=w), min_size=1, max_size=9)
    ),
    st.floats(0.0, 2.0),
)
def test_never_slower_never_staler_than_tau(durations, publish):
    prev = None
    for tau in range(5):
        tl = stale_timeline(durations, tau, publish)
        m = len(durations)
        assert 0 <= tl.lags.min() and tl.lags.max() <= min(tau, m - 1)
        for j in range(1, m):  # a rank starts once its own previous minibatch and version j - τ are done
            assert (tl.starts[j] >= tl.done[j - 1]).all()
            assert (tl.starts[j] >= tl.published[max(j - tau, 0)]).all()
        assert (np.diff(tl.published) >= 0).all()
        assert tl.makespan >= tl.limit * (1 - 1e-12) - 1e-12  # no τ beats the busiest device
        if prev is not None:
            assert tl.makespan <= prev  # exactly: τ + 1 only drops constraints
        prev = tl.makespan
    assert stale_timeline(durations, m - 1, publish).makespan == pytest.approx(tl.limit, rel=1e-12, abs=1e-12)


def test_a_device_that_is_always_slow_cannot_be_hidden():
    from odcfn.schedule.stalesweep import stale_cell

    rows = stale_cell("longalign", 16, 4, [1, 2], straggler=1.5, slow_rank=0, minibatches=6)
    assert rows[0].time_to_limit < 1.0001  # τ = 0 already runs at the slow device's own sum
    for r in rows[1:]:
        assert 1.0 <= r.speedup < 1.0001  # the gain is only the hidden sync latency
        assert r.time_to_limit == pytest.approx(1.0, abs=1e-9)


def test_a_moving_slowdown_is_hidden_down_to_the_per_device_limit():
    """Equal work, one random device 1.5x slower each minibatch: synchronously every minibatch
    takes 1.5; with τ >= 1 only the device slowed most often is on the critical path."""
    rng = random.Random(0)
    d = np.ones((64, 8))
    for j in range(64):
        d[j, rng.randrange(8)] = 1.5
    limit = float(d.sum(axis=0).max())
    assert stale_timeline(d, 0).makespan == 96.0
    assert limit == 69.5
    assert stale_timeline(d, 1).makespan == pytest.approx(limit, rel=0.01)
    assert stale_timeline(d, 2).makespan == limit
    # the same through the sweep: a straggler on a third of the minibatches
    from odcfn.schedule.stalesweep import stale_cell

    rows = stale_cell("longalign", 16, 4, [1, 2], straggler=1.5, slow_fraction=0.33, minibatches=8)
    assert rows[0].time_to_limit > 1.05 and rows[1].speedup > 1.05
    assert [r.lag_max for r in rows] == [0, 1, 1] and rows[2].time_to_limit == pytest.approx(1.0)


def test_lb_minis_fixed_rank_order_pins_the_imbalance_unless_permuted():
    """LB-Mini gives its heaviest loads to the lowest ranks in every minibatch, so without noise
    device 0 is the critical path every time and staleness gains nothing; permuting which device
    runs which load (a seeded permutation per minibatch) changes no synchronous step but lets
    τ = 1 hide the per-minibatch imbalance."""
    from odcfn.schedule.stalesweep import stale_cell

    fixed = stale_cell("longalign", 16, 4, [1], minibatches=8)
    moved = stale_cell("longalign", 16, 4, [1], minibatches=8, permute=True)
    assert moved[0].samples_per_s == fixed[0].samples_per_s  # synchronous: order is irrelevant
    assert fixed[1].speedup < 1.0001
    assert moved[1].speedup > 1.03 and moved[1].time_to_limit == pytest.approx(1.0)


def test_staleness_at_1024_devices():
    from odcfn.schedule.stalesweep import stale_cell

    rows = stale_cell("aime-rl", 1024, 1, [1], straggler=1.5, slow_fraction=0.5, minibatches=2)
    assert rows[1].speedup >= 1.0 and rows[1].lag_max <= 1
    assert rows[1].wait_rate <= rows[0].wait_rate


def test_bad_staleness_and_plans_are_refused():
    plans, lengths, kw, _ = _draws(devices=4, minibatches=2)
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="staleness must be an int >= 0"):
            simulate_staleness(plans, lengths, [bad], **kw)
    with pytest.raises(ValueError, match="durations"):
        stale_timeline([[1.0, -1.0]], 1)
    with pytest.raises(ValueError, match="one lengths list per minibatch"):
        simulate_staleness(plans, lengths[:1], [1], **kw)
    units = kw["workload"].units
    coll = [compile_plans(units, lb_micro(ls, 4, 4096, cost=TOK), "collective") for ls in lengths]
    with pytest.raises(ValueError, match="comm='odc'"):
        simulate_staleness(coll, lengths, [1], **kw)


def _cli(argv):
    from odcfn.schedule import sweep

    p = argparse.ArgumentParser(prog="odcfn simulate")
    sweep.add_arguments(p)
    return sweep.main(p.parse_args(argv))


@pytest.mark.parametrize("bad", ["-1", "x", "1.5", "0,-2", ""])
def test_cli_bad_staleness_names_the_flag(bad, capsys):
    with pytest.raises(SystemExit) as e:
        _cli([f"--staleness={bad}"])
    assert e.value.code == 2
    assert "--staleness" in capsys.readouterr().err


def test_cli_bad_noise_flags_name_the_flag(capsys):
    assert _cli(["--staleness", "1", "--slow-fraction", "1.5", "--devices", "8"]) == 2
    assert "--slow-fraction" in capsys.readouterr().err
    assert _cli(["--staleness", "1", "--slow-rank", "8", "--devices", "8"]) == 2
    assert "--slow-rank" in capsys.readouterr().err
    assert _cli(["--permute-ranks", "--devices", "8"]) == 2
    assert "--permute-ranks needs --staleness" in capsys.readouterr().err
    assert _cli(["--quality", "--staleness", "1"]) == 2
    assert "pick one" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # "-1" as its own word is the flag's value, not an option
        _cli(["--staleness", "-1"])
    assert "argument --staleness: expected τ" in capsys.readouterr().err


def test_cli_prints_one_row_per_tau(capsys):
    base = ["--datasets", "aime-rl", "--devices", "8", "--samples-per-device", "2", "--minibatches", "3",
            "--slow-factor", "1.5", "--slow-fraction", "0.5"]
    assert _cli([*base, "--staleness", "1,2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split("|")[1].strip() == "τ" and "x τ=0" in out[0] and "lag mean" in out[0]
    assert [line.split("|")[1].strip() for line in out[2:5]] == ["0", "1", "2"]
    assert "τ in [0, 1, 2]" in out[5] and "x1.5 on 50% of minibatches" in out[5]
    assert _cli([*base, "--staleness", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["staleness"] for r in rows] == [0, 1] and rows[0]["speedup"] == 1.0
    assert rows[1]["samples_per_s"] >= rows[0]["samples_per_s"] and rows[1]["lag_max"] <= 1
