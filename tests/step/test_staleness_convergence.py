"""Bounded staleness converges: on the learnable task of ``bench/staleness_convergence.py`` (a
Markov-chain language with a known loss floor), τ = 1 and τ = 2 end within 2% of the synchronous
run's held-out loss after the same samples, while actually reading stale versions, and after the
loss fell substantially (so a run that learned nothing, or never ran stale, could not pass)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def conv():
    spec = importlib.util.spec_from_file_location("staleness_convergence",
                                                  ROOT / "bench" / "staleness_convergence.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


STEPS, SAMPLES, VOCAB, LR = 30, 16, 16, 5e-3


def test_stale_runs_track_the_synchronous_loss_and_read_stale_versions(conv):
    """A small version of the docs' run that fits a test. The docs' 2% is measured after 1200
    samples (150 steps, two minutes and more on 2 cores); at 480 samples the loss is still falling,
    where a run that applied some updates late is measurably behind (0.6-7.9% measured at 640
    samples over two seeds), so the bound here is 10%: a stale run that diverged or stalled
    fails it, one that follows the synchronous curve passes."""
    res = conv.compare(steps=STEPS, samples=SAMPLES, vocab=VOCAB, lr=LR, eval_every=STEPS)
    base = res[0]["eval"]
    (n0, start), (n_end, sync_end) = base[0], base[-1]
    assert n0 == 0 and n_end == STEPS * SAMPLES
    assert sync_end < 0.7 * start, base  # it learned: from ~ln(vocab) towards the floor
    assert sync_end > conv.FLOOR - 0.02  # no model beats the task's entropy by more than noise
    assert max(res[0]["lags"]) == 0
    for tau in (1, 2):
        r = res[tau]
        assert r["eval"][0] == base[0]  # the same init, the same held-out batch
        assert r["eval"][-1][0] == n_end  # after the same samples
        end = r["eval"][-1][1]
        assert end < 0.7 * start, r["eval"]
        assert abs(end / sync_end - 1) < 0.10, (tau, conv.table(res))
        # The forced holds make the others run τ steps ahead: the lag reaches τ, never more, and
        # stale versions are read on many steps, not one. A hold cut short by its timeout (a
        # machine too loaded for the others to get τ steps ahead in 10 s) would show here.
        assert max(r["lags"]) == tau and r["timeouts"] == 0, (tau, r["lags"], r["timeouts"])
        assert sum(lag >= 1 for lag in r["lags"]) >= STEPS // 4, r["lags"]
