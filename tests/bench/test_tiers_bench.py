"""``odcfn bench --only tiers``: registered; its byte counts equal the formats' sizes for the plan
that ran (fp8/int8 gathers and int8 pushes at (1 + 4/128) / 2 of bf16 on a model whose shards
fill whole blocks); the simulator's bytes-per-element factor reaches its step time (fewer
gather bytes never make ODC slower, and the bf16 figure is the one the cell had before)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from odcfn.bench import SECTIONS
from odcfn.bench.tiers import bytes_per_step, simulate_formats
from odcfn.bench.workload import Workload, model_config


def test_tiers_is_a_section():
    assert "tiers" in SECTIONS


def test_bytes_rows_are_exact_and_half_of_bf16():
    ctx = SimpleNamespace(
        workload=Workload(model=model_config(64, 1, 256), world_size=2, samples_per_rank=1, length_scale=256)
    )
    rows = {(r["gather_format"], r["push_format"]): r for r in bytes_per_step(ctx)["rows"]}
    for r in rows.values():
        assert (r["gather_bytes"], r["scatter_bytes"]) == (
            r["expected_gather_bytes"],
            r["expected_scatter_bytes"],
        )
    half = (1 + 4 / 128) / 2
    assert rows[("fp8_e4m3", "bf16")]["gather_vs_bf16"] == pytest.approx(half, rel=1e-3)
    assert rows[("bf16", "int8")]["push_vs_bf16"] == pytest.approx(half, rel=1e-3)


def test_simulator_takes_the_bytes_factor():
    from odcfn.schedule.simcells import cell_setup

    (row,) = simulate_formats((8,), 1, (1,))
    assert row["step_s_fp8_e4m3"] <= row["step_s_bf16"]
    _, _, _, _, work = cell_setup("longalign", 8, 28, None, None)
    _, _, _, _, half = cell_setup("longalign", 8, 28, None, None, gather_bytes=1.0, push_bytes=1.0)
    assert half.per_unit(half.param_bytes)[0] * 2 == work.per_unit(work.param_bytes)[0]
    assert half.per_unit(half.grad_bytes)[0] * 2 == work.per_unit(work.grad_bytes)[0]
