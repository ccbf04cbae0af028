"""``odcfn bench --only rl-loop`` at its tiny size over 2 processes: every field of the report is
there and well formed, both contenders got the same rollouts, the engine's sync holds no second
copy of the model while gather + load_state_dict holds one on rank 0; ``LiveBytes`` counts what
it is for. No timing assertions: the machine is shared."""

from __future__ import annotations

import types

import torch

from odcfn.bench.rl_loop import render, section
from odcfn.bench.rl_loop_runs import LiveBytes, LoopSpec
from odcfn.bench.workload import Workload


def test_live_bytes_counts_new_storages_and_watched_frees():
    old = torch.zeros(1000)  # 4000 bytes alive before the block, held weakly by the tracker
    with LiveBytes([old]) as live:
        a = torch.ones(500)  # +2000: the peak
        del old  # -4000, seen at the next op
        b = a * 2  # +2000
    assert live.peak == 2000 and live.current == 0 and b.numel() == 500
    keep = torch.zeros(10)
    with LiveBytes([keep]) as live:
        keep.add_(1)  # in place: nothing new
    assert live.peak == 0


def test_the_section_reports_its_fields_at_tiny_size():
    log = []
    ctx = types.SimpleNamespace(backend="process", workload=Workload(world_size=2), progress=False,
                                log=log.append)
    sec = section(ctx, shape="tiny")
    it, sy, asy = sec["iteration"], sec["sync"], sec["async"]
    assert it["rollouts_identical"] is True
    for who in ("collective+lb-micro", "odc+lb-mini"):
        d = it["by_contender"][who]
        for p in ("gen", "update_actor", "step", "weight_sync"):
            got = d[f"timing_s/{p}"]
            assert got["n"] == LoopSpec.shape("tiny").repeats and got["median"] > 0
    for key in ("update", "iteration"):
        assert it["ratios"][key]["median"] > 0
    # the engine's sync frees its old weights first: nothing above what it held before; gather to
    # rank 0 + load_state_dict holds one full copy there, nothing on rank 1
    eng, hf = sy["memory_per_rank"]["engine"], sy["memory_per_rank"]["gather_load"]
    assert all(m["live_peak_over_model"] < 0.05 and m["live_after_bytes"] <= 1024 for m in eng)
    assert 0.95 < hf[0]["live_peak_over_model"] < 1.1 and hf[1]["live_peak_over_model"] < 0.05
    assert sy["wall_s"]["engine"]["n"] == sy["wall_s"]["gather_load"]["n"] == 1
    for mode in ("sync", "async"):
        m = asy["by_mode"][mode]
        assert len(m["reward_curve"]) == LoopSpec.shape("tiny").async_iters
        assert all(0.0 <= x <= 1.0 for x in m["reward_curve"]) and m["iters_per_s"]["median"] > 0
    assert asy["async_over_sync"]["median"] > 0 and asy["sync_gen_over_train"] > 0
    bound = asy["overlap_bound"]  # Linux: the loop thread's schedstat gives the overlap's room
    assert bound["async_over_sync_one_core_per_rank"]["median"] > 0
    assert 0 <= bound["sync_idle_share"]["median"] <= 1
    for mode in ("greedy", "sample", "stop"):
        assert sec["ratios"][f"engine_over_hf_tokens_per_s_{mode}"] > 0
    assert set(sec["ratios"]) >= {"update_odc_lb_mini_over_collective_lb_micro",
                                  "iteration_odc_lb_mini_over_collective_lb_micro",
                                  "async_over_sync_iters_per_s"}
    assert len(sec["load_average"]["start"]) == 3 and sec["config"]["shape"] == "tiny"
    text = render(sec)
    for phrase in ("RL loop", "update", "weight sync", "async vs sync", "reward mean", "tokens/s",
                   "bound with one core per rank"):
        assert phrase in text, (phrase, text)


def test_the_section_is_skipped_without_processes():
    ctx = types.SimpleNamespace(backend="thread", workload=Workload(world_size=2), progress=False, log=print)
    assert "skipped" in section(ctx, quick=True)
    assert "needs real processes" in render(section(ctx, quick=True))
