"""Activations O(T): per-sample causal attention reaches a kernel that never holds the T x T
scores, and a step with every unit rematerialised holds memory linear in the tokens.

Memory is counted as live tensor bytes op by op (``tests/memtrack.TensorBytes``): exact and
independent of the allocator and of other processes. Doubling T doubles an O(T) step's peak and
quadruples an O(T^2) one's; the positive control (SDPA on 3-D inputs, the math kernel) shows the
counter sees the difference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import odcfn
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.models.qwen import causal_attention
from odcfn.schedule import Forward
from odcfn.sft.config import TrainSection
from tests.memtrack import TensorBytes
from tests.util import run_grad_step, tiny

CFG = QwenConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)


def _attention_peak(T: int, batched: bool) -> int:
    g = torch.Generator().manual_seed(T)
    q = torch.randn(4, T, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, T, 8, generator=g, requires_grad=True) for _ in range(2))
    with TensorBytes() as m:
        if batched:
            o = causal_attention(q, k, v)
        else:  # the 3-D call the model made before: the math kernel, T x T scores
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.square().sum().backward()
    return m.peak


def test_counter_sees_quadratic_attention():
    # the control: if this failed the O(T) assertions below could not fail either
    ratio = _attention_peak(1024, batched=False) / _attention_peak(512, batched=False)
    assert ratio > 3.5, ratio


def test_attention_memory_is_linear_in_tokens():
    ratio = _attention_peak(2048, batched=True) / _attention_peak(1024, batched=True)
    assert ratio < 2.2, ratio


def _reference_attention(q, k, v):
    """float64 causal GQA attention written out: query head h reads kv head h // (H / G)."""
    H, T, K = q.shape
    rep = H // k.shape[0]
    k, v = k.double().repeat_interleave(rep, 0), v.double().repeat_interleave(rep, 0)
    s = q.double() @ k.transpose(1, 2) / math.sqrt(K)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    return s.softmax(-1) @ v


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1)])
def test_causal_attention_matches_float64(heads):
    H, G = heads
    g = torch.Generator().manual_seed(H * 10 + G)
    q = torch.randn(H, 37, 16, generator=g)
    k, v = torch.randn(G, 37, 16, generator=g), torch.randn(G, 37, 16, generator=g)
    got = causal_attention(q, k, v)
    torch.testing.assert_close(got.double(), _reference_attention(q, k, v), rtol=1e-5, atol=1e-5)
    # the CUDA fp32 branch repeats kv heads for the memory-efficient kernel: the same mapping
    rep = H // G
    same = F.scaled_dot_product_attention(q[None], k.repeat_interleave(rep, 0)[None],
                                          v.repeat_interleave(rep, 0)[None], is_causal=True)[0]
    torch.testing.assert_close(same, got, rtol=1e-5, atol=1e-6)


def _step_peak(T: int) -> int:
    """Peak live bytes of one grad_step on one sample of T tokens, every unit rematerialised."""
    model, params = qwen_model(CFG), init_params(CFG)
    batch = odcfn.random_batch([T], CFG.vocab_size, seed=T)

    def fn(rank, tr):
        state = odcfn.TrainState.create(params=params, model=model, optimizer=odcfn.sgd(0.0),
                                        transport=tr, config=odcfn.StepConfig(remat=True))
        with TensorBytes() as m:  # dispatch modes are per thread: enter it on the rank's own
            odcfn.grad_step(state, batch)
        return m.peak

    return odcfn.run_local(fn, 1)[0]


def test_rematerialised_step_memory_is_linear_in_tokens():
    small, large = _step_peak(1024), _step_peak(2048)
    assert large / small < 2.2, (small, large)


def test_remat_switch_recomputes_every_unit_and_keeps_the_gradient():
    cfg, model, full = tiny()
    batch = odcfn.random_batch([9, 5, 12], cfg.vocab_size, seed=3)
    (g_plain, _), = run_grad_step(full, batch, model, 1)
    (g_remat, m), = run_grad_step(full, batch, model, 1, remat=True)
    forwards = [s for s in m.plan.steps if isinstance(s, Forward)]
    assert forwards and all(s.remat for s in forwards)
    assert {s.unit for s in forwards} == set(model.unit_names)
    for name in g_plain:
        torch.testing.assert_close(g_remat[name], g_plain[name], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("bad", ["all", 1, None])
def test_remat_switch_rejects_non_bools(bad):
    with pytest.raises(TypeError, match="StepConfig.remat"):
        odcfn.StepConfig(remat=bad)
    with pytest.raises(ValueError, match="train.remat"):
        TrainSection(steps=1, remat=bad)
