"""The RL loss through the sharded runtime: for every aggregation mode, clip setting and KL type,
world size 1-4, balancer (work stealing included), ODC and collective, the gradient shards, the
loss and the loss's metrics equal the independent single-process reference
(``odcfn.reference.reference_rl_loss`` on transformers' logits); the loss does not move with the
microbatch cap; exactly one sync per minibatch; bad extras fail on every rank before any
communication."""

from __future__ import annotations

import os

import pytest
import torch
import transformers  # noqa: F401  (the RL equivalence tests run HF's own model)
from hypothesis import given, settings
from hypothesis import strategies as st

import odcfn
from odcfn import losses
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.reference import reference_rl_loss
from tests.losses.test_losses import loss_configs
from tests.rl_ref import away_from_kinks, hf_logits_fn, rollout_batch
from tests.util import ref_shards, run_grad_step

CFG = QwenConfig(vocab_size=23, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=20)
RTOL, ATOL = 2e-4, 2e-6


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return odcfn.tree_map(lambda t: t + torch.randn(t.shape, generator=g) * 0.3, init_params(CFG))


def reference(full, batch, dtype=torch.float64, **cfg):
    """In float64: the reference carries none of float32's error, the tolerance is odcfn's."""
    params = odcfn.tree_map(lambda t: t.to(dtype).requires_grad_(), full)
    loss, metrics = reference_rl_loss(hf_logits_fn(CFG, params, dtype), batch, **cfg)
    leaves, treedef = odcfn.tree.tree_flatten(params)
    grads = [g.float() for g in torch.autograd.grad(loss, leaves)]
    return float(loss.detach()), metrics, odcfn.tree.tree_unflatten(treedef, grads)


def _atol(grads, grads_fp32=None) -> float:
    """float32's absolute error grows with the gradient's scale (KL and entropy terms) and with
    how much a gradient entry cancels (a sum of large terms of both signs): the second is
    measured on the draw itself, as the error of transformers' own float32 gradient against the
    float64 one; odcfn's float32 (other summation order) may err a few times as much."""
    scale = max(1.0, max(float(g.abs().max()) for g in odcfn.tree.tree_leaves(grads)))
    if grads_fp32 is None:
        return ATOL * scale
    pairs = zip(odcfn.tree.tree_leaves(grads_fp32), odcfn.tree.tree_leaves(grads))
    return max(ATOL * scale, 8 * max(float((a - b).abs().max()) for a, b in pairs))


POLICIES = [("odc", "round_robin"), ("odc", "lb_mini"), ("odc", "lb_micro"), ("odc", "work_stealing"),
            ("collective", "lb_micro"), ("collective", "local_sort")]


@settings(max_examples=int(os.environ.get("ODCFN_EXAMPLES", 20)))
@given(cfg=loss_configs(), world=st.integers(1, 4), policy=st.sampled_from(POLICIES), data=st.data())
def test_sharded_policy_gradient_equals_reference(cfg, world, policy, data):
    n = data.draw(st.integers(1, 7))
    lengths = data.draw(st.lists(st.integers(2, 10), min_size=n, max_size=n))
    prompts = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    seed = data.draw(st.integers(0, 2**16))
    cap = data.draw(st.integers(max(lengths), 3 * max(lengths)))
    full, model = _params(seed), qwen_model(CFG)
    # no token within float32's reach of a clip/KL branch point: both sides take the same branch
    batch = rollout_batch(lengths, prompts, CFG.vocab_size, seed=seed, prox=cfg.get("decoupled", False))
    batch = away_from_kinks(batch, CFG, full, cfg)
    want_loss, want_metrics, want_grads = reference(full, batch, **cfg)
    loss32, metrics32, grads32 = reference(full, batch, dtype=torch.float32, **cfg)
    atol = _atol(want_grads, grads32)
    # the loss is a mean of O(1) per-token terms (ratios, entropies) that may cancel to a small
    # sum: float32's error is absolute, ~1e-6 per term whatever the sum; 8x transformers' own
    # float32 error on the draw where that is larger
    loss_atol = max(1e-5, 8 * abs(float(loss32) - float(want_loss)))
    metric_atol = {k: max(1e-5, 8 * abs(float(metrics32[k]) - float(v))) for k, v in want_metrics.items()}
    want = ref_shards(want_grads, model, world)
    comm, balance = policy
    out = run_grad_step(full, batch, model, world, comm=comm, balance=balance,
                        max_tokens_per_microbatch=cap, loss=losses.policy_gradient(**cfg))
    for rank, (grads, m) in enumerate(out):
        odcfn.tree_assert_allclose(grads, want[rank], rtol=RTOL, atol=atol,
                                   what=f"{policy} rank {rank}")
        assert m.loss == pytest.approx(want_loss, rel=1e-5, abs=loss_atol)
        for k, v in want_metrics.items():
            assert m.extra[k] == pytest.approx(float(v), rel=1e-5, abs=metric_atol[k]), k
        assert m.counters.syncs == 1
        if comm == "odc":
            assert m.counters.collectives == 0


def test_loss_and_gradient_do_not_move_with_the_microbatch_cap():
    batch = rollout_batch([9, 3, 7, 5, 8, 2], [2, 1, 3, 0, 4, 1], CFG.vocab_size, seed=5)
    full, model = _params(5), qwen_model(CFG)
    modes = [("seq-mean-token-mean", None), ("seq-mean-token-sum-norm", 12.0), ("token-mean", None)]
    for mode, scale in modes:
        loss = losses.policy_gradient(loss_agg_mode=mode, loss_scale_factor=scale, kl_loss_coef=0.1,
                                      entropy_coeff=0.01)
        runs = [run_grad_step(full, batch, model, 2, balance="lb_mini", max_tokens_per_microbatch=cap,
                              loss=loss) for cap in (9, 14, 60)]
        mbs = [sum(len(m.plan.microbatches) for _, m in r) for r in runs]
        assert mbs[0] > mbs[-1], mbs  # the caps did split the minibatch differently
        for r in runs[1:]:
            for (g0, m0), (g, m) in zip(runs[0], r):
                assert m.loss == pytest.approx(m0.loss, rel=1e-6), mode
                assert m.extra == pytest.approx(m0.extra, rel=1e-5, abs=1e-7)
                odcfn.tree_assert_allclose(g, g0, rtol=RTOL, atol=ATOL, what=mode)


def test_cross_entropy_loss_object_equals_the_default():
    batch = rollout_batch([9, 3, 7, 5], [2, 1, 3, 0], CFG.vocab_size, seed=6, kl=False)
    full, model = _params(6), qwen_model(CFG)
    a = run_grad_step(full, batch, model, 3, balance="lb_mini")
    b = run_grad_step(full, batch, model, 3, balance="lb_mini", loss=losses.cross_entropy())
    for (ga, ma), (gb, mb) in zip(a, b):
        assert mb.loss == pytest.approx(ma.loss, rel=1e-6)
        odcfn.tree_assert_allclose(gb, ga, rtol=1e-5, atol=1e-7)
        assert mb.extra == {} and ma.extra == {}


def test_bad_extras_fail_before_any_communication_on_every_rank():
    batch = rollout_batch([6, 5, 7], [1, 1, 1], CFG.vocab_size, kl=False)
    full, model = _params(0), qwen_model(CFG)
    loss = losses.policy_gradient(kl_loss_coef=0.05)

    def fn(rank, tr):
        state = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.sgd(0.0), transport=tr,
                                        config=odcfn.StepConfig(loss=loss))
        before = tr.counters.copy()
        try:
            odcfn.grad_step(state, batch)
        except ValueError as e:
            return str(e), tr.counters - before
        return None, None

    for msg, counters in odcfn.run_local(fn, 2):
        assert msg is not None and "samples[0] lacks ['ref_logprobs']" in msg
        assert counters.syncs == counters.gathers == counters.collectives == 0

    with pytest.raises(TypeError, match="StepConfig.loss must be a loss object"):
        run_grad_step(full, batch, model, 1, loss="policy_gradient")


def test_bf16_compute_keeps_the_loss_in_fp32():
    batch = rollout_batch([9, 3, 7, 5], [2, 1, 3, 0], CFG.vocab_size, seed=7)
    full, model = _params(7), qwen_model(CFG)
    loss = losses.policy_gradient(kl_loss_coef=0.1, entropy_coeff=0.01, loss_agg_mode="seq-mean-token-mean")
    want_loss, want_metrics, _ = reference(full, batch, kl_loss_coef=0.1, entropy_coeff=0.01,
                                           loss_agg_mode="seq-mean-token-mean")
    for _, m in run_grad_step(full, batch, model, 2, loss=loss, compute_dtype=torch.bfloat16):
        assert m.loss == pytest.approx(want_loss, rel=2e-2, abs=2e-3)  # bf16 weights, fp32 loss
        assert m.extra["entropy"] == pytest.approx(float(want_metrics["entropy"]), rel=2e-2)


def test_ranks_with_different_advantages_are_refused():
    full, model = _params(0), qwen_model(CFG)
    batches = [rollout_batch([6, 5, 7], [1, 1, 1], CFG.vocab_size, seed=s) for s in (0, 0)]
    a = batches[1].samples[0]
    extras = dict(a.extras, advantages=a.extras["advantages"] + 1.0)  # same tokens, other rewards
    batches[1] = odcfn.Batch((odcfn.Sample(a.tokens, a.loss_mask, extras), *batches[1].samples[1:]))

    def fn(rank, tr):
        state = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.sgd(0.0), transport=tr,
                                        config=odcfn.StepConfig(loss=losses.policy_gradient()))
        odcfn.grad_step(state, batches[rank])

    with pytest.raises(ValueError, match="ranks disagree on the minibatch"):
        odcfn.run_local(fn, 2)
