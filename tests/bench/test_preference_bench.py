"""The preference section of ``odcfn bench`` and its data (tiny settings, threads; no timing
assertions)."""

from __future__ import annotations

import argparse
import json
import statistics

from odcfn import bench
from odcfn.bench.preference import (
    PREFERENCE_POLICIES,
    member_lengths,
    preference_batch_of,
    preference_max_tokens,
    ultrafeedback_like,
)
from odcfn.bench.preference_section import simulate_preference
from odcfn.bench.workload import Workload, make_batch, make_lengths

TINY = ["--d-model", "16", "--n-layers", "1", "--length-scale", "512", "--backend", "thread"]


def test_pairs_are_long_tailed_and_share_their_prompt():
    x = ultrafeedback_like(4000, seed=1)
    assert x == ultrafeedback_like(4000, seed=1) and x != ultrafeedback_like(4000, seed=2)
    prompts, chosen, rejected = ([t[i] for t in x] for i in range(3))
    for v in (prompts, chosen, rejected):  # long right tail: the mean well above the median
        assert statistics.mean(v) > 1.2 * statistics.median(v) and max(v) > 5 * statistics.median(v)
    assert statistics.median(chosen) > statistics.median(rejected)  # the judges' length bias
    b = preference_batch_of(6, 4, 97, seed=3)
    assert b.pairs and len(b) == 12 and b.lengths == member_lengths(6, 4, 3)
    assert 2 * max(b.lengths) <= preference_max_tokens(4)
    for c, r in zip(b.samples[0::2], b.samples[1::2]):
        p = int((~c.loss_mask).sum())
        assert c.tokens[:p].tolist() == r.tokens[:p].tolist() and not r.loss_mask[:p].any()
        assert "ref_logprobs" in c.extras and c.num_loss_tokens >= 1 and r.num_loss_tokens >= 1
    w = Workload(dataset="preference", length_scale=8, samples_per_rank=3)
    assert make_lengths(w, 2) == make_batch(w, 2).lengths and len(make_batch(w, 2)) == 12
    assert w.loss.loss_type == "sigmoid"


def test_simulated_pairs_balance_as_units():
    (row,) = simulate_preference((64,), pairs_per_device=2, minibatches=4)
    assert row["devices"] == 64 and row["collective+lb-micro"] == 1.0
    # deterministic: LB-Mini's free counts remove the equal-count baseline's idle time
    assert row["odc+lb-mini"] > 1.05, row
    # one pair per device leaves nothing to balance: both place one pair on every rank
    (one,) = simulate_preference((8,), pairs_per_device=1, minibatches=1)
    assert one["odc+lb-mini"] == 1.0, one


def test_bench_preference_section(capsys):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--json", "--quick", "--only", "preference", "--steps", "1", "--warmup", "0",
                         "--cost", "default", "--samples-per-rank", "3", *TINY])
    assert bench.main(args) == 0
    r = json.loads(capsys.readouterr().out)
    sec = r["preference"]
    assert set(sec["policies"]) == set(PREFERENCE_POLICIES) and sec["losses_match"] is True
    assert len(sec["runs"]) == 2 and sec["pairs_per_rank"] == 3
    for run in sec["runs"]:
        counts = run["pairs_per_rank_by_step"]
        assert all(len(set(step)) == 1 for step in counts["collective+lb-micro"]), counts  # equal counts
        assert all(sum(step) == 6 for p in PREFERENCE_POLICIES for step in counts[p])
        assert run["policies"]["odc+lb-mini"]["syncs_per_minibatch"] == 1
    s = sec["odc_lb_mini_over_collective_lb_micro"]
    assert s["n"] == 2 and s["min"] <= s["median"] <= s["max"] and s["min"] > 0
    assert r["ratios"]["preference_odc_lb_mini_over_collective_lb_micro"] == s["median"]
    assert r["targets"]["preference_odc_lb_mini_over_collective_lb_micro"]["target"] == 1.10
    assert sec["lengths"]["length_scale"] == 16 and sec["lengths"]["pair_max"] <= preference_max_tokens(16)
    assert [x["devices"] for x in sec["simulated"]] == [8, 8]
    assert {x["pairs_per_device"] for x in sec["simulated"]} == {2, 4}
