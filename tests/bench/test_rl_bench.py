"""The RL section of ``odcfn bench`` and its data (tiny settings, threads; no timing assertions)."""

from __future__ import annotations

import argparse
import json

import torch

from odcfn import bench
from odcfn.bench.rl import RL_POLICIES, rl_batch, rl_lengths, rl_max_tokens
from odcfn.bench.workload import Workload, make_batch, make_lengths

TINY = ["--d-model", "16", "--n-layers", "1", "--length-scale", "512", "--backend", "thread"]


def test_rl_batches_are_grpo_groups():
    b = rl_batch(12, 4, 16, 97, seed=3)
    assert len(b) == 12 and max(b.lengths) <= rl_max_tokens(16)
    for g in range(0, 12, 4):
        group = b.samples[g:g + 4]
        p = int((~group[0].loss_mask).sum())
        assert p >= 1
        for s in group:  # one prompt per group, no loss on it
            assert torch.equal(s.tokens[:p], group[0].tokens[:p]) and not s.loss_mask[:p].any()
            assert s.loss_mask[p:].all()
        adv = torch.tensor([float(s.extras["advantages"][0]) for s in group])
        assert abs(float(adv.sum())) < 1e-5  # group-normalised
        shorter = torch.tensor([s.length for s in group], dtype=torch.float)
        assert (adv[shorter <= shorter.median()] > 0).all() or adv.abs().max() < 1e-6
    assert rl_lengths(12, 4, 16, 3) == rl_lengths(12, 4, 16, 3)
    w = Workload(dataset="aime-rl", length_scale=16, samples_per_rank=6)
    assert make_lengths(w, 2) == make_batch(w, 2).lengths
    assert w.loss is not None and Workload().loss is None


def test_bench_rl_section(capsys):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--json", "--quick", "--only", "rl", "--steps", "1", "--warmup", "0",
                         "--cost", "default", "--samples-per-rank", "4", *TINY])
    assert bench.main(args) == 0
    r = json.loads(capsys.readouterr().out)
    rl = r["rl"]
    assert set(rl["policies"]) == set(RL_POLICIES)
    assert rl["losses_match"] is True  # the same GRPO loss whatever the schedule
    counts = rl["samples_per_rank_by_step"]
    for policy in ("collective+lb-micro", "odc+lb-micro"):  # verl's equal-count rule
        assert all(len(set(step)) == 1 for step in counts[policy]), counts
    assert all(sum(step) == 8 for p in RL_POLICIES for step in counts[p])
    assert rl["policies"]["odc+lb-mini"]["syncs_per_minibatch"] == 1
    for k in ("rl_odc_lb_mini_over_collective_lb_micro", "rl_odc_lb_micro_over_collective_lb_micro",
              "rl_log_probs_over_train_step"):
        assert r["ratios"][k] > 0, k
    assert r["targets"]["rl_odc_lb_mini_over_collective_lb_micro"]["target"] == 1.10
    sim = {(x["devices"], x["samples_per_device"]): x for x in rl["simulated"]}
    assert set(sim) == {(8, 2), (8, 4)} and all(x["collective+lb-micro"] == 1.0 for x in sim.values())
    assert sim[(8, 2)]["odc+lb-mini"] > 1.0  # one-sided: the simulator's bubbles are deterministic
