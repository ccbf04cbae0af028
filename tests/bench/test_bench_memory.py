"""``odcfn bench --memory``'s machinery: a point runs in a fresh process and reports its step's
peak; a point over its budget is recorded as ``oom`` (its address-space cap), not a crash; the
summary derives the head's share, the largest T in budget and the speed ratio from the points."""

from __future__ import annotations

from odcfn.bench import memory as M

MIB = 1 << 20


def test_a_point_measures_its_step_and_a_point_over_budget_is_oom():
    ok = M.run_point({"contender": "fused", "loss": "ce", "V": 512, "T": 64, "budget": 2048 * MIB})
    assert ok["status"] == "ok", ok
    assert 0 < ok["peak_bytes"] < 2048 * MIB and ok["step_s"] > 0
    # the unfused head's fp32 logits alone are T x V x 4 = 256 MiB here: over a 64 MiB budget
    big = M.run_point({"contender": "unfused", "loss": "ce", "V": 16384, "T": 4096, "budget": 64 * MIB})
    assert big["status"] == "oom", big


def _p(c, loss, V, T, peak=None, status="ok", step_s=None, steps=1):
    return {"contender": c, "loss": loss, "V": V, "T": T, "status": status, "peak_bytes": peak,
            "step_s": step_s, "steps": steps}


def test_summary_derives_share_largest_and_speed():
    B, S = M.BIG_V, M.SMALL_V
    pts = [_p("fused", "ce", B, 1024, 300, step_s=2.0, steps=2), _p("fused", "ce", S, 1024, 100),
           _p("fused", "ce", B, 4096, 500), _p("fused", "ce", S, 4096, 200),
           _p("unfused", "ce", B, 1024, 900, step_s=2.5, steps=2), _p("unfused", "ce", S, 1024, 150),
           _p("unfused", "ce", B, 4096, status="oom"), _p("unfused", "ce", S, 4096, 250)]
    r = M.summarise(pts, budget=1000)
    assert r["head_share_bytes"]["fused/ce"] == {1024: 200, 4096: 300}
    assert r["head_share_bytes"]["unfused/ce"] == {1024: 750, 4096: None}
    assert r["largest_tokens_in_budget"] == {"fused/ce": 4096, "unfused/ce": 1024}
    assert r["speed"][1024]["fused_vs_unfused_throughput"] == 2.5 / 2.0
    text = M.render(r)
    assert "oom" in text and "1.25x" in text
