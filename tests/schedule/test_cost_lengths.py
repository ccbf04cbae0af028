"""Cost models (quadratic, FLOPs, fitted, calibrated on the real model) and the synthetic
length samplers (LongAlign-, AIME-RL-like) against the paper's figures."""

from __future__ import annotations

import statistics

import pytest

from odcfn.schedule.cost import (
    DEFAULT_COST,
    QWEN25_7B,
    ModelShape,
    QuadraticCost,
    fit_quadratic,
    flops_cost,
    microbatch_cost,
)
from odcfn.schedule.lengths import DATASETS, aime_rl, get_dataset, longalign
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture (multi-process test)

# --- cost models ------------------------------------------------------------------------------


def test_quadratic_and_microbatch_cost():
    c = QuadraticCost(a=2.0, b=3.0)
    assert c(10) == 2 * 100 + 3 * 10
    assert microbatch_cost(c, [1, 2]) == (2 + 3) + (8 + 6)  # sum over samples, not (1+2)^2
    assert c.scaled(0.5)(10) == 115.0
    with pytest.raises(ValueError, match="QuadraticCost.a"):
        QuadraticCost(-1.0, 1.0)
    with pytest.raises(ValueError, match="a > 0 or b > 0"):
        QuadraticCost(0.0, 0.0)


def test_flops_cost_by_hand():
    m = ModelShape(d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=16, vocab_size=10)
    # per layer: q 64 + k 32 + v 32 + o 64 = 192, mlp 3*8*16 = 384; head 80
    assert m.matmul_params == 2 * (192 + 384) + 80
    c = flops_cost(m)
    assert c.b == 6 * m.matmul_params
    assert c.a == 6 * 8 * 2
    # Qwen2.5-7B: ~6.5B matmul params; attention matches the linear part at ~65K tokens
    assert 6.0e9 < QWEN25_7B.matmul_params < 7.6e9
    assert 50_000 < flops_cost(QWEN25_7B).b / flops_cost(QWEN25_7B).a < 80_000
    assert DEFAULT_COST(1) == pytest.approx(1.0, rel=1e-4)


def test_fit_quadratic_recovers_coefficients():
    lengths = [64, 128, 256, 512, 1024]
    times = [3e-9 * s * s + 2e-6 * s for s in lengths]
    fit = fit_quadratic(lengths, times)
    assert fit.a == pytest.approx(3e-9, rel=1e-6)
    assert fit.b == pytest.approx(2e-6, rel=1e-6)
    linear = fit_quadratic(lengths, [-1e-9 * s * s + 1e-3 * s for s in lengths])
    assert linear.a == 0.0 and linear.b > 0  # constrained to non-negative coefficients
    with pytest.raises(ValueError, match="distinct lengths"):
        fit_quadratic([5, 5], [1.0, 1.0])


def test_calibrate_on_the_real_model_is_positive_and_grows_with_length():
    from odcfn.models import QwenConfig, init_params, qwen_model
    from odcfn.schedule.measure import calibrate

    cfg = QwenConfig(vocab_size=37, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=24)
    cost, fwd = calibrate(qwen_model(cfg), init_params(cfg), (32, 64, 128), vocab_size=37, repeats=1)
    assert cost(128) > cost(32) > 0
    assert 0.0 < fwd < 1.0


# --- synthetic lengths ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_samplers_match_the_paper_means_and_are_deterministic(name):
    ds = get_dataset(name)
    lengths = ds.sample(20_000, seed=3)
    assert statistics.mean(lengths) == pytest.approx(ds.paper_mean, rel=0.05)
    assert max(lengths) <= ds.max_tokens
    assert ds.sample(50, seed=1) == ds.sample(50, seed=1) != ds.sample(50, seed=2)


def test_longalign_range_and_tail():
    lengths = longalign(20_000, seed=0)
    assert min(lengths) >= 8192 and max(lengths) <= 65536
    assert statistics.median(lengths) < statistics.mean(lengths)  # right-skewed: a long tail


def test_aime_wrong_answers_longer_and_truncation_spike():
    right = statistics.mean(aime_rl(10_000, seed=0, p_correct=1.0))
    wrong = statistics.mean(aime_rl(10_000, seed=0, p_correct=0.0))
    assert 2.4 < wrong / right < 3.2
    lengths = aime_rl(20_000, seed=0)
    at_cap = sum(n >= 20480 + 100 for n in lengths) / len(lengths)
    assert at_cap > 0.03  # the truncation spike: prompt + a response clipped at the cap
    assert longalign(4, seed=0, scale=1 / 16) == tuple(round(n / 16) for n in longalign(4, seed=0))
    with pytest.raises(ValueError, match="scale"):
        longalign(3, scale=2.0)
    with pytest.raises(ValueError, match="unknown dataset"):
        get_dataset("c4")
