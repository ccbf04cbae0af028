"""``odcfn bench --only moe`` at a tiny size: the report's fields and their internal consistency
(no timing assertions: the machine is shared), plus the computed bytes formula by hand."""

from __future__ import annotations

import argparse
import json

import pytest

from odcfn import bench
from odcfn.bench.moe_section import a2a_vs_fetch, render


def test_fetch_vs_all_to_all_formula_by_hand():
    # Qwen3-30B-A3B, bf16: a layer's experts are 128 x 3 x 768 x 2048 x 2 bytes (1.2 GB); a token
    # crosses twice (dispatch and combine) to each of its 8 experts: 2 x 8 x 2048 x 2 bytes
    a = a2a_vs_fetch(2048, 128, 8, 768)
    assert a["computed"] and a["crossover_tokens_per_rank"] == 18432
    r = a["rows"][-1]  # 64K tokens: every expert is hit
    assert r["experts_hit"] == pytest.approx(128)
    assert r["fetch_bytes"] == pytest.approx(128 * 3 * 768 * 2048 * 2)
    assert r["all_to_all_bytes"] == 2 * 8 * 2048 * 65536 * 2
    assert [x["tokens_per_rank"] for x in a["rows"]] == [4096, 16384, 65536]


def test_bench_moe_section_report(capsys):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--json", "--only", "moe", "--moe-shape", "tiny", "--samples-per-rank", "2",
                         "--length-scale", "512", "--steps", "1"])
    assert bench.main(args) == 0
    r = json.loads(capsys.readouterr().out)
    m = r["moe"]
    v = m["vs_fsdp2"]
    assert v["losses_match"], v  # transformers' Qwen3-MoE under FSDP2 trains the same function
    assert set(v) >= {"odc", "fsdp2", "samples_per_s_odc_over_fsdp2", "per_minibatch_speedup"}
    assert v["samples_per_s_odc_over_fsdp2"] == pytest.approx(
        v["odc"]["samples_per_s"] / v["fsdp2"]["samples_per_s"])
    pm = v["per_minibatch_speedup"]
    assert pm["min"] <= pm["median"] <= pm["max"] and pm["n"] == 1
    mem = m["memory"]
    assert mem["odc_bytes"]["median"] > 0 and mem["fsdp2_bytes"]["median"] > 0
    eb, E = m["expert_bytes"], m["config"]["model"]["num_experts"]
    assert eb["expert_bytes_fp32"] == 3 * 16 * 32 * 4
    assert 0 < eb["odc_gathered_per_rank_step"] <= eb["all_experts_same_microbatches_per_rank_step"]
    assert eb["peak_resident_experts_per_layer"]["all_experts"] == E
    assert 1 <= eb["peak_resident_experts_per_layer"]["odc"] <= min(E, m["config"]["expert_group"])
    assert set(eb["odc_gathered_per_layer_rank_step"]) == {"layers.0", "layers.1"}
    n_max = max(v["fsdp2"]["microbatches_per_rank"][0])  # FSDP2 all-gathers all E, fwd + bwd, per layer
    assert eb["fsdp2_lb_micro_all_experts_per_rank_step"] == n_max * 2 * 2 * E * eb["expert_bytes_fp32"]
    assert all(a["computed"] for a in m["a2a_vs_fetch"].values())
    ec = m["expert_compute"]
    assert ec["input_grads_agree"]  # every contender computed the same input gradient
    assert {"odcfn_routed_ffn", "odcfn_on_demand", "transformers_eager", "transformers_grouped_mm"} \
        <= set(ec["seconds"])
    assert ec["fastest_transformers"] in ec["seconds"]
    ratios = r["ratios"]
    assert ratios["moe_odc_lb_mini_over_torch_fsdp2"] == v["samples_per_s_odc_over_fsdp2"]
    assert ratios["moe_peak_memory_odc_over_torch_fsdp2"] == mem["odc_over_fsdp2"]["median"]
    assert r["targets"]["moe_odc_lb_mini_over_torch_fsdp2"]["target"] == 1.15
    assert r["losses_match"] is True
    text = render(m)
    assert "9. MoE" in text and "COMPUTED" in text and "transformers_grouped_mm" in text
