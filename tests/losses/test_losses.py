"""The loss seam on one process: ``odcfn.losses`` over packed microbatches equals the RL losses
written independently (``odcfn.reference.reference_rl_loss``: per sample, unpacked, padded
matrices), for every aggregation mode, clip setting and KL type, in value, metrics and
gradient; the split into microbatches changes nothing; bad input is named."""

from __future__ import annotations

import os

import pytest
import torch
import transformers  # noqa: F401  (the RL equivalence tests run HF's own model)
from hypothesis import given, settings
from hypothesis import strategies as st

import odcfn
from odcfn import losses
from odcfn.models import QwenConfig, init_params
from odcfn.reference import reference_rl_loss
from tests.rl_ref import hf_hidden_fn, hf_logits_fn, rollout_batch

CFG = QwenConfig(vocab_size=29, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=24)


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return odcfn.tree_map(lambda t: t + torch.randn(t.shape, generator=g) * 0.3, init_params(CFG))


@st.composite
def loss_configs(draw):
    mode = draw(st.sampled_from(losses.AGG_MODES))
    low = draw(st.sampled_from([0.0, 0.1, 0.2]))
    return dict(
        clip_ratio_low=low,
        clip_ratio_high=draw(st.sampled_from([low, 0.28, 0.5])),
        clip_ratio_c=draw(st.sampled_from([1.5, 3.0, 10.0])),
        kl_loss_coef=draw(st.sampled_from([0.0, 0.1, 1.0])),
        kl_loss_type=draw(st.sampled_from(sorted(losses.KL_TYPES))),
        entropy_coeff=draw(st.sampled_from([0.0, 0.01, 0.3])),
        loss_agg_mode=mode,
        loss_scale_factor=float(draw(st.integers(1, 40))) if mode == "seq-mean-token-sum-norm" else None,
        temperature=draw(st.sampled_from([1.0, 0.7])),
        **draw(st.sampled_from([{}, {"decoupled": True}, {"decoupled": True, "behav_imp_weight_cap": 1.5}])),
    )


def _odcfn_value_and_grad(params, batch, loss, split):
    """head_stats over ``split`` microbatches, the final hidden states of each packed sample from
    transformers (the head weight: odcfn's, tied or not)."""
    leaves = odcfn.tree.tree_leaves(params)
    fn = hf_hidden_fn(CFG, params)
    w_VxD = params["head"]["lm_head"]["weight"]
    weights = loss.weights(batch)
    total = None
    for ids in split:
        mb = odcfn.pack(batch, ids, loss=loss, weights=weights)
        h = torch.cat([fn(batch.samples[i].tokens.long()) for i in ids])
        y = losses.head_stats(h, w_VxD, mb)
        total = y if total is None else total + y
    grads = torch.autograd.grad(total[0], leaves)
    return total.detach(), grads


@settings(max_examples=int(os.environ.get("ODCFN_EXAMPLES", 25)))
@given(
    cfg=loss_configs(),
    lengths=st.lists(st.integers(2, 9), min_size=1, max_size=5),
    data=st.data(),
)
def test_policy_gradient_equals_independent_reference(cfg, lengths, data):
    prompts = data.draw(st.lists(st.integers(0, 4), min_size=len(lengths), max_size=len(lengths)))
    seed = data.draw(st.integers(0, 2**16))
    batch = rollout_batch(lengths, prompts, CFG.vocab_size, seed=seed, prox=cfg.get("decoupled", False))
    loss = losses.policy_gradient(**cfg)
    params = odcfn.tree_map(lambda t: t.requires_grad_(), _params(seed))
    leaves = odcfn.tree.tree_leaves(params)
    want, metrics = reference_rl_loss(hf_logits_fn(CFG, params), batch, **cfg)
    want_g = torch.autograd.grad(want, leaves)
    perm = data.draw(st.permutations(range(len(lengths))))
    cut = data.draw(st.integers(1, len(lengths)))
    split = [tuple(perm[:cut]), tuple(perm[cut:])] if cut < len(lengths) else [tuple(perm)]
    got, got_g = _odcfn_value_and_grad(params, batch, loss, split)
    assert torch.allclose(got[0], want.detach(), rtol=1e-5, atol=1e-6), (got[0], want)
    for g, w in zip(got_g, want_g):
        # fp32 on both sides, different summation orders: the absolute error scales with the
        # gradient (hypothesis found 4e-6 on a leaf whose largest entry is ~0.3)
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6 + 2e-5 * float(w.abs().max()))
    sums = dict(zip(loss.metric_names, got[1:]))
    n = batch.num_loss_tokens
    for k, v in metrics.items():
        value = sums[k] / n if k in loss.mean_metrics else sums[k]
        torch.testing.assert_close(value, v, rtol=1e-5, atol=1e-6, msg=k)
    # the loss is its parts
    parts = sums["pg_loss"] + cfg["kl_loss_coef"] * sums["kl_loss"] - cfg["entropy_coeff"] * sums["entropy"]
    torch.testing.assert_close(parts, got[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", losses.AGG_MODES)
def test_cross_entropy_modes_equal_reference(mode):
    batch = rollout_batch([5, 9, 3, 7], [2, 0, 1, 6], CFG.vocab_size, seed=1, kl=False)
    scale = 17.0 if mode == "seq-mean-token-sum-norm" else None
    loss = losses.cross_entropy(mode, scale)
    params = odcfn.tree_map(lambda t: t.requires_grad_(), _params(1))
    want, _ = reference_rl_loss(hf_logits_fn(CFG, params), batch, kind="cross_entropy",
                                loss_agg_mode=mode, loss_scale_factor=scale)
    got, _ = _odcfn_value_and_grad(params, batch, loss, [(3, 0), (2,), (1,)])
    torch.testing.assert_close(got[0], want.detach(), rtol=1e-5, atol=1e-6)


def test_token_mean_cross_entropy_is_the_default_sft_loss():
    batch = rollout_batch([5, 9, 3], [2, 0, 1], CFG.vocab_size, seed=2, kl=False)
    from odcfn.models import qwen_model

    model, params = qwen_model(CFG), _params(2)
    want = odcfn.reference_loss(model, params, batch)
    logits_fn = hf_logits_fn(CFG, params)
    got, _ = reference_rl_loss(logits_fn, batch, kind="cross_entropy")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_aggregation_weights_by_hand():
    s = lambda n, mask: odcfn.Sample(torch.zeros(n, dtype=torch.long), loss_mask=torch.tensor(mask))
    # loss tokens: 2 and 3, and one sample without any
    batch = odcfn.Batch((s(3, [1, 1, 1]), s(4, [0, 1, 1, 1]), s(2, [1, 0])))
    w = lambda *a: [x for t in losses.aggregation_weights(batch, *a) for x in t.tolist()]
    assert w("token-mean") == pytest.approx([0, 0.2, 0.2, 0, 0.2, 0.2, 0.2, 0, 0])
    assert w("seq-mean-token-sum") == pytest.approx([0, 0.5, 0.5, 0, 0.5, 0.5, 0.5, 0, 0])
    assert w("seq-mean-token-mean") == pytest.approx([0, 0.25, 0.25, 0, 1 / 6, 1 / 6, 1 / 6, 0, 0])
    assert w("seq-mean-token-sum-norm", 4.0) == pytest.approx([0, 0.25, 0.25, 0, 0.25, 0.25, 0.25, 0, 0])


def test_pack_aligns_extras_with_labels():
    a = odcfn.Sample(torch.tensor([5, 6, 7]), extras={"x": torch.tensor([1.0, 2.0, 3.0])})
    b = odcfn.Sample(torch.tensor([8, 9]), extras={"x": torch.tensor([4.0, 5.0], dtype=torch.float64)})
    mb = odcfn.pack(odcfn.Batch((a, b)), [1, 0])
    assert mb.labels_T.tolist() == [9, 0, 6, 7, 0]
    assert mb.extras["x"].tolist() == [5.0, 0.0, 2.0, 3.0, 0.0]  # x[t] rides with target token t
    assert mb.extras["x"].dtype == torch.float32


# --- bad input -------------------------------------------------------------------------------


def test_bad_extras_are_named():
    t = torch.arange(4)
    with pytest.raises(ValueError, match=r"extras\['adv'\].*length 4"):
        odcfn.Sample(t, extras={"adv": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"extras\['adv'\] is not finite at token 2"):
        odcfn.Sample(t, extras={"adv": torch.tensor([0.0, 1.0, float("inf"), 0.0])})
    with pytest.raises(TypeError, match=r"extras\['adv'\] must be a float, integer or bool"):
        odcfn.Sample(t, extras={"adv": torch.zeros(4, dtype=torch.complex64)})
    with pytest.raises(TypeError, match="extras must be a dict"):
        odcfn.Sample(t, extras=[1.0])
    ok = odcfn.Sample(t, extras={"adv": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"samples\[1\] has extras \[\]"):
        odcfn.Batch((ok, odcfn.Sample(t)))


def test_missing_extras_name_sample_and_key():
    batch = rollout_batch([4, 5], [1, 1], CFG.vocab_size, kl=False)
    losses.policy_gradient().validate(batch)
    with pytest.raises(ValueError, match=r"samples\[0\] lacks \['ref_logprobs'\]"):
        losses.policy_gradient(kl_loss_coef=0.1).validate(batch)
    sft = odcfn.random_batch([4, 5], CFG.vocab_size)
    with pytest.raises(ValueError, match=r"samples\[0\] lacks \['advantages', 'old_logprobs'\]"):
        losses.policy_gradient().validate(sft)
    # integer extras are per input position (routed experts), not per target: refused by the loss
    ones = lambda s: torch.ones(s.length, dtype=torch.long)
    ints = odcfn.Batch(tuple(
        odcfn.Sample(s.tokens, s.loss_mask, {**s.extras, "advantages": ones(s)}) for s in batch.samples
    ))
    with pytest.raises(TypeError, match=r"extras\['advantages'\].*1-D float.*samples\[0\].*torch.int64"):
        losses.policy_gradient().validate(ints)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(loss_agg_mode="seq-mean"), "loss_agg_mode='seq-mean' does not exist"),
        (dict(loss_agg_mode="seq-mean-token-sum-norm"), "needs loss_scale_factor"),
        (dict(kl_loss_type="k4"), "kl_loss_type='k4' does not exist"),
        (dict(clip_ratio_low=1.2), "clip_ratio_low must be in"),
        (dict(clip_ratio_c=0.5), "clip_ratio_c"),
        (dict(temperature=0.0), "temperature must be > 0"),
    ],
)
def test_bad_loss_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        losses.policy_gradient(**kw)
