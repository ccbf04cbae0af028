"""``odcfn bench --only staleness`` at a tiny size over 2 processes: the report's keys and columns,
lags within τ, one sync per minibatch at τ = 0 and none above, the held-out loss agreed by every
rank; plus the draw, the run order, the summary by hand and the held-out loss against the
step's own loss (no timing assertions: the machine is shared)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

import odcfn
from odcfn import bench
from odcfn.bench.staleness_runs import VARIANTS, StaleSpec, _eval_loss, noisy_draw, run_order, zipf_batch
from odcfn.bench.staleness_section import render, summarize
from odcfn.bench.workload import Workload
from tests.util import make_state, tiny


def test_noisy_draw_is_a_seeded_third_of_the_timed_minibatches():
    d = noisy_draw(13, 2, 1 / 3, seed=0)
    assert d == noisy_draw(13, 2, 1 / 3, seed=0)
    assert d[0] == -1  # the untimed minibatch is never slow
    assert sum(r >= 0 for r in d) == 4 and all(r in (-1, 0, 1) for r in d)
    draws = [noisy_draw(13, 2, 1 / 3, seed=s) for s in range(20)]
    assert len({tuple(x) for x in draws}) > 1
    for x in draws:  # the slow rank moves: each rank slow equally often within a run
        assert sorted(r for r in x if r >= 0) == [0, 0, 1, 1]
    assert len({tuple(r for r in x if r >= 0) for x in draws}) > 1  # in a random order


def test_run_order_interleaves_and_rotates_tau():
    spec = StaleSpec(Workload(), repeats=3)
    order = run_order(spec)
    assert len(order) == 3 * len(VARIANTS) * 3 and len(set(order)) == len(order)
    firsts = [order[i][2] for i in range(0, len(order), 3)]
    assert set(firsts) == {0, 1, 2}  # no τ always runs first in its block
    for i in range(0, len(order), 3):
        block = order[i:i + 3]
        assert len({(r, v) for r, v, _ in block}) == 1 and sorted(t for _, _, t in block) == [0, 1, 2]


def test_stale_spec_refuses_a_run_without_the_baseline():
    with pytest.raises(ValueError, match="τ = 0"):
        StaleSpec(Workload(), taus=(1, 2))
    with pytest.raises(ValueError, match="variants"):
        StaleSpec(Workload(), variants=("bogus",))


def _fake_run(variant, tau, repeat, walls, syncs=(0.0, 0.0), wait=0.0, elapsed=None):
    steps = [{"wall": w, "sync_s": s, "version_wait_s": wait, "lag": tau, "syncs": int(tau == 0),
              "slow": False} for w, s in zip(walls, syncs)]
    return {"variant": variant, "tau": tau, "repeat": repeat, "steps": steps, "drain_s": 0.0, "cpu_s": 1.0,
            "elapsed": elapsed if elapsed is not None else sum(walls), "eval_loss": 5.0 - tau,
            "train_losses": [6.0, 5.5, 5.0]}


def test_summary_by_hand():
    spec = StaleSpec(Workload(samples_per_rank=2), taus=(0, 1), variants=("noisy",), steps=2, repeats=1)
    # τ = 0: rank 0 busy 1 + 3, rank 1 busy 2 + 1, each waits for the other at the sync
    r0 = [_fake_run("noisy", 0, 0, [2.0, 3.0], syncs=(1.0, 0.0)), _fake_run("noisy", 1, 0, [], elapsed=4.0)]
    r1 = [_fake_run("noisy", 0, 0, [2.0, 3.0], syncs=(0.0, 2.0)), _fake_run("noisy", 1, 0, [], elapsed=3.5)]
    for r in (r0[1], r1[1]):
        r["steps"] = [{"wall": 2.0, "sync_s": 0.0, "version_wait_s": 0.25, "lag": 1, "syncs": 0,
                       "slow": False}] * 2
    res = summarize([{"runs": r0}, {"runs": r1}], spec)
    f0, f1 = res["by_variant"]["noisy"]["0"], res["by_variant"]["noisy"]["1"]
    assert f0["samples_per_s"]["median"] == pytest.approx(8 / 5.0)  # 2 steps x 4 samples / slowest clock
    assert f1["samples_per_s"]["median"] == pytest.approx(8 / 4.0)
    assert f1["over_tau0"]["median"] == pytest.approx(5.0 / 4.0)
    assert res["ratios"] == {"staleness_noisy_tau1_over_tau0": pytest.approx(1.25)}
    assert f0["sync_s"] == pytest.approx(1.5) and f1["version_wait_s"] == pytest.approx(0.5)
    assert (f0["syncs_per_minibatch"], f1["syncs_per_minibatch"], f1["max_lag"]) == (1, 0, 1)
    # all imbalance hidden: the sum of the slowest step times (5) over the busiest rank's busy time (4)
    assert res["bound_over_tau0"]["noisy"]["median"] == pytest.approx(5.0 / 4.0)
    assert f1["per_cpu_s_over_tau0"]["median"] == pytest.approx(1.0)  # 1 CPU-second per rank in both
    assert f0["cpu_share"] == pytest.approx(1 / 5) and f1["cpu_share"] == pytest.approx((1 / 4 + 1 / 3.5) / 2)
    assert f1["eval_loss"]["median"] == 4.0 and f0["train_loss_last2"]["median"] == 5.25


def test_held_out_loss_is_the_step_loss_at_the_same_params():
    # the bench's loss of the drained params equals what train_step reports for the params it
    # started from, on the same minibatch: the two read the log-probs the same way
    cfg, model, full = tiny()
    batch = zipf_batch((5, 9, 3, 7), cfg.vocab_size, seed=4)

    def fn(rank, tr):
        st = make_state(full, model, tr, optimizer=odcfn.sgd(0.1), balance="lb_mini")
        before = _eval_loss(st, batch)
        _, m = odcfn.train_step(st, batch)
        return before, m.loss

    for before, loss in odcfn.run_local(fn, 2, timeout=60):
        assert before == pytest.approx(loss, rel=1e-5)


def test_zipf_tokens_are_skewed_and_deterministic():
    b = zipf_batch((400, 300), 64, seed=1)
    assert b.lengths == (400, 300)
    again = zipf_batch((400, 300), 64, seed=1)
    assert [s.tokens.tolist() for s in b.samples] == [s.tokens.tolist() for s in again.samples]
    counts = sorted(int((b.samples[0].tokens == i).sum()) for i in range(64))
    assert counts[-1] > 8 * max(1, counts[len(counts) // 2])  # the top id far above the median id


def test_bench_staleness_section_over_two_processes(capsys):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    argv = ["--json", "--quick", "--only", "staleness", "--steps", "2", "--samples-per-rank", "2",
            "--d-model", "16", "--n-layers", "1", "--length-scale", "1024", "--cost", "default"]
    assert bench.main(p.parse_args(argv)) == 0
    r = json.loads(capsys.readouterr().out)
    sec = r["staleness"]
    assert sec["config"]["taus"] == [0, 1, 2] and sec["config"]["repeats"] == 2
    assert set(sec["by_variant"]) == set(VARIANTS) == set(sec["bound_over_tau0"])
    noisy = sec["noisy_rank_per_minibatch"]
    assert len(noisy) == 3 and noisy[0] == -1 and sum(x >= 0 for x in noisy) == 1
    columns = {"samples_per_s", "over_tau0", "per_cpu_s_over_tau0", "version_wait_s", "sync_s", "drain_s",
               "max_lag", "cpu_share", "syncs_per_minibatch", "eval_loss", "train_loss_last2",
               "eval_loss_ranks_agree"}
    for v, by_tau in sec["by_variant"].items():
        assert set(by_tau) == {"0", "1", "2"}
        for t, f in by_tau.items():
            assert columns <= set(f), (v, t)
            assert f["max_lag"] <= int(t)  # never read more than τ behind
            assert f["syncs_per_minibatch"] == (1 if t == "0" else 0)
            assert f["eval_loss_ranks_agree"] and math.isfinite(f["eval_loss"]["median"])
            s = f["samples_per_s"]
            assert s["n"] == 2 and 0 < s["min"] <= s["median"] <= s["max"]
        assert by_tau["0"]["over_tau0"]["median"] == 1.0
        assert by_tau["0"]["version_wait_s"] == 0.0
        # the synchronous runs are the same computation each repeat (up to summation order)
        e = by_tau["0"]["eval_loss"]
        assert e["max"] - e["min"] <= 1e-4 * abs(e["median"])
    assert sum(sec["by_variant"]["noisy"]["0"]["slow_steps_per_rank"]) == 1
    assert sum(sec["by_variant"]["long_tail"]["0"]["slow_steps_per_rank"]) == 0
    for key in ("staleness_noisy_tau1_over_tau0", "staleness_equal_tau1_over_tau0"):
        assert r["ratios"][key] == sec["ratios"][key] and r["targets"][key]["measured"] == r["ratios"][key]
    assert r["targets"]["staleness_noisy_tau1_over_tau0"]["target"] == 1.15
    assert r["targets"]["staleness_equal_tau1_over_tau0"]["target"] == 0.98
    text = render(sec)
    assert "(a) long-tail" in text and "(b)" in text and "(c) equal lengths" in text and "max lag" in text


def test_python_m_staleness_is_the_section():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "odcfn.bench.staleness", "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert "python -m odcfn.bench.staleness" in out and "--only" in out
