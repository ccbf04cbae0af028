"""Training still works with low-precision communication: on the small task of
``odcfn.bench.tiers_train`` (fixed seed), fp8 gathers with bf16 pushes, and int8 pushes with error
feedback, end within 2% of the held-out loss of the bf16 run, and that run learned (its loss fell
well below the initial one, toward the task's floor ln 3). 20 steps of a smaller model here
(~10 s of CPU: three short trainings); the 200-step run and its plot: ``odcfn bench --only
tiers``, docs/memory.md."""

from __future__ import annotations

import math

from odcfn.bench.tiers_train import CONFIG, RUNS, training_curves

SMALL = CONFIG.__class__(**{**CONFIG.__dict__, "d_model": 16, "d_ff": 32})


def test_fp8_gathers_and_int8_pushes_train_within_2_percent_of_bf16():
    keep = ("bf16", "fp8 gathers + bf16 pushes", "int8 pushes + error feedback")
    r = training_curves(20, every=20, lr=2e-2, runs={k: RUNS[k] for k in keep}, config=SMALL)
    assert r["final"]["bf16"] < 0.75 * r["initial"]  # it learned: the comparison means something
    assert r["final"]["bf16"] > math.log(3) * 0.95  # and cannot beat the task's floor
    for name in keep[1:]:
        assert abs(r["rel_to_bf16"][name]) <= 0.02, (name, r["final"])
