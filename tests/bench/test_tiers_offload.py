"""The offload rows of ``odcfn bench --only tiers``: a point runs both modes, the offloaded one
within its budget plus the in-memory run's activations (a loose bound on this shared machine)."""

from __future__ import annotations

from odcfn.bench import SECTIONS
from odcfn.bench.tiers_offload import GIB, _spawn, render


def test_a_point_runs_both_modes_and_reports_its_peaks(tmp_path):
    shape = {
        "d_model": 32,
        "n_layers": 2,
        "vocab": 64,
        "samples": 2,
        "length": 16,
        "steps": 1,
        "prefetch": 1,
        "budget_gib": 1 / 1024,
        "path": str(tmp_path),
        "cap_bytes": None,
    }
    mem, off = (_spawn({**shape, "mode": m}, timeout=120) for m in ("memory", "offload"))
    assert mem["fits"] and off["fits"] and mem["n_params"] == off["n_params"] > 0
    assert off["state_bytes"] == 12 * off["n_params"]
    assert 0 <= off["step_adds"] <= shape["budget_gib"] * GIB + mem["step_adds"] + (8 << 20)
    assert "tiers" in SECTIONS and list(tmp_path.iterdir()) == []
    row = {
        "memory": mem,
        "offload": off,
        "budget_gib": 1 / 1024,
        "state_over_budget": 0.1,
        "step_time_ratio": 1.0,
    }
    assert "ratio 1.00x" in render({"both_fit": row, "only_offload": row})
