"""Straggler emulation (odcfn.models.slow.slow_model): the same math, one sleep per unit forward and
one per unit backward (the last gradient leaving the unit), proportional to the unit's time."""

from __future__ import annotations

import pytest

import odcfn
from odcfn.models import slow as slow_mod
from odcfn.models.slow import slow_model
from tests.util import make_state, tiny


def test_slow_model_keeps_gradients_and_sleeps_once_per_unit_and_direction(monkeypatch):
    cfg, model, full = tiny()
    batch = odcfn.random_batch([5, 9, 3], cfg.vocab_size, seed=2)
    sleeps = []
    monkeypatch.setattr(slow_mod.time, "sleep", lambda s: sleeps.append(s))

    def fn(rank, tr, m):
        return odcfn.grad_step(make_state(full, m, tr, max_tokens_per_microbatch=9), batch)

    want = odcfn.run_local(lambda r, t: fn(r, t, model), 1)[0]
    got = odcfn.run_local(lambda r, t: fn(r, t, slow_model(model, 3.0)), 1)[0]
    odcfn.tree_assert_allclose(got[0], want[0], rtol=0, atol=0)
    n_mb, n_units = len(got[1].plan.microbatches), len(model.units)
    assert len(sleeps) == 2 * n_mb * n_units  # forward and backward of every unit, every microbatch
    assert all(s >= 0 for s in sleeps) and sum(sleeps) > 0


def test_slow_model_refuses_speedups_and_is_identity_at_one():
    _, model, _ = tiny()
    assert slow_model(model, 1.0) is model
    for bad in (0.5, -1, True, "2"):
        with pytest.raises(ValueError, match="factor must be a number >= 1.0"):
            slow_model(model, bad)
