"""The decoupled policy-gradient objective (policy_gradient(decoupled=True), docs/rl.md): it is
the ordinary objective when the proximal and behaviour policies coincide, its weight is the
constant exp(prox - old) (zeroed above the cap), it runs sharded (W=2, ODC, bounded staleness)
like the one-process step, and bad settings or a missing extra are named."""

from __future__ import annotations

import pytest
import torch

import odcfn
from odcfn import losses
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.step import stale
from tests.rl_ref import rollout_batch

CFG = QwenConfig(vocab_size=29, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=24)


def _per_token(loss, prox_shift, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(64, generator=g) * 3 - 1).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(64, generator=g)
    adv = torch.randn(64, generator=g)
    extras = {"advantages": adv, "old_logprobs": old, "prox_logprobs": old + prox_shift}
    loss_T, _ = loss.per_token(logp, torch.zeros(64), extras)
    (grad,) = torch.autograd.grad(loss_T.sum(), logp)
    return loss_T.detach(), grad, extras


def test_equal_policies_give_the_ordinary_objective_and_the_weight_is_a_constant():
    plain, g_plain, _ = _per_token(losses.policy_gradient(), 0.0)
    dec, g_dec, _ = _per_token(losses.policy_gradient(decoupled=True), 0.0)
    assert torch.equal(plain, dec) and torch.equal(g_plain, g_dec)
    shift = torch.linspace(-1.0, 1.0, 64)
    got, g_got, ex = _per_token(losses.policy_gradient(decoupled=True, clip_ratio_c=1e9), shift)
    # by hand: the surrogate against prox, times the constant exp(prox - old)
    ref = losses.policy_gradient(clip_ratio_c=1e9)
    anchored = {**ex, "old_logprobs": ex["prox_logprobs"]}
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(64, generator=g) * 3 - 1).requires_grad_()  # the same draw as _per_token's
    base_T, _ = ref.per_token(logp, torch.zeros(64), anchored)
    w = (ex["prox_logprobs"] - ex["old_logprobs"]).exp()
    torch.testing.assert_close(got, base_T.detach() * w)
    (g_base,) = torch.autograd.grad((base_T * w).sum(), logp)
    torch.testing.assert_close(g_got, g_base)
    cap = losses.policy_gradient(decoupled=True, clip_ratio_c=1e9, behav_imp_weight_cap=1.5)
    capped, _, _ = _per_token(cap, shift)
    over = w > 1.5
    assert over.any() and (~over).any()
    assert torch.all(capped[over] == 0) and torch.equal(capped[~over], got[~over])


@pytest.mark.parametrize("kw,match", [
    ({"behav_imp_weight_cap": 2.0}, "needs decoupled=True"),
    ({"decoupled": True, "behav_imp_weight_cap": 0.0}, "behav_imp_weight_cap"),
    ({"decoupled": True, "behav_imp_weight_cap": float("nan")}, "behav_imp_weight_cap"),
    ({"decoupled": 1}, "decoupled must be a bool"),
])
def test_bad_settings_are_named(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        losses.policy_gradient(**kw)


def test_a_missing_prox_extra_is_named_before_any_communication():
    batch = rollout_batch([5, 7], [1, 2], CFG.vocab_size, seed=0)
    with pytest.raises(ValueError, match="prox_logprobs"):
        losses.policy_gradient(decoupled=True).validate(batch)


@pytest.mark.parametrize("staleness", [0, 1])
def test_sharded_steps_equal_the_one_process_step(staleness):
    model, full = qwen_model(CFG), init_params(CFG, seed=1)
    batch = rollout_batch([5, 9, 3, 7], [2, 0, 1, 3], CFG.vocab_size, seed=2, prox=True)
    loss = losses.policy_gradient(decoupled=True, behav_imp_weight_cap=2.0)

    def fn(rank, tr):
        st = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.sgd(0.1), transport=tr,
                                     config=odcfn.StepConfig(loss=loss, staleness=staleness))
        st, m = odcfn.train_step(st, batch)
        if staleness:
            st, _ = stale.drain(st)
        return st.params

    one = odcfn.run_local(fn, 1)[0]
    two = odcfn.run_local(fn, 2)
    got = odcfn.unshard(two, model, odcfn.Mesh(2, 0))
    want = odcfn.unshard([one], model, odcfn.Mesh(1, 0))
    for a, b in zip(odcfn.tree.tree_leaves(got), odcfn.tree.tree_leaves(want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    moved = max(float((a - b).abs().max()) for a, b in zip(odcfn.tree.tree_leaves(want),
                                                           odcfn.tree.tree_leaves(full)))
    assert moved > 1e-4  # the step did something
