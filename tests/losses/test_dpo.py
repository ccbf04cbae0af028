"""DPO-family losses at the head: equal to TRL's own loss code (``DPOTrainer._compute_loss`` and
``CPOTrainer.cpo_loss`` for SimPO) on the same per-token log-probs, in loss, metrics and
gradient; the split of pairs into microbatches changes nothing; bad pair input is named."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import odcfn
from odcfn import losses
from odcfn.batch import pack
from tests.dpo_ref import pair_batch

V = 31
SHAPES = [(3, 4, 2), (1, 1, 5), (5, 3, 3), (2, 6, 1)]


def _ours(batch, loss, logp_all, split):
    """The head's per-microbatch stats summed over ``split`` (lists of pair ids), from one
    per-token log-prob vector per sample (aligned with labels); grads w.r.t. those vectors."""
    w = loss.weights(batch)
    total = 0
    for mb_pairs in split:
        ids = [i for k in mb_pairs for i in (2 * k, 2 * k + 1)]
        mb = pack(batch, ids, loss=loss, weights=w)
        total = total + loss.microbatch_stats(torch.cat([logp_all[i] for i in ids]), mb)
    return total


def _logps(batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in batch.samples:  # position t: the log-prob of label t (token t + 1); 0 where no target
        m = torch.cat([s.loss_mask[1:].float(), torch.zeros(1)])
        out.append(((-4 * torch.rand(s.length, generator=g)) * m).requires_grad_())
    return out


class _Acc:
    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


def _trl_dpo(batch, logps, *, loss_types, loss_weights, beta, label_smoothing=0.0):
    """TRL's DPOTrainer._compute_loss on the same per-token log-probs (padded rows, chosen rows
    first), its model and accelerator replaced by stand-ins that return them."""
    from trl import DPOTrainer

    L = max(batch.lengths)
    rows = [*range(0, len(batch), 2), *range(1, len(batch), 2)]
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    cmask = torch.zeros(len(rows), L, dtype=torch.long)
    lp_rows = []
    for j, i in enumerate(rows):
        s = batch.samples[i]
        ids[j, : s.length] = s.tokens
        cmask[j, : s.length] = s.loss_mask.long()
        lp_rows.append(torch.cat([logps[i][: s.length - 1], torch.zeros(L - s.length)]))
    # TRL's fused head gives 0 (and no gradient) where the label is not a completion token
    log_probs = torch.stack(lp_rows) * cmask[:, 1:]
    ref = [float((s.extras["ref_logprobs"] * s.loss_mask).sum()) for s in batch.samples]
    inputs = {"input_ids": ids, "attention_mask": (cmask >= 0).long(), "completion_mask": cmask,
              "ref_chosen_logps": torch.tensor(ref[0::2]), "ref_rejected_logps": torch.tensor(ref[1::2])}
    zeros = torch.zeros_like(log_probs)

    def model(**kw):
        return SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Acc(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=loss_types,
        loss_weights=loss_weights, beta=beta, label_smoothing=label_smoothing, use_weighting=False,
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1, args=SimpleNamespace(),
    )
    loss = DPOTrainer._compute_loss(fake, model, inputs, False)
    return loss, {k: v[-1] for k, v in fake._metrics["train"].items()}


METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@pytest.mark.parametrize("kind,ls,sft", [("sigmoid", 0.0, 0.0), ("sigmoid", 0.0, 0.7), ("robust", 0.2, 0.0),
                                         ("hinge", 0.0, 0.3), ("ipo", 0.0, 0.0)])
def test_loss_metrics_and_gradient_equal_trl(kind, ls, sft):
    batch = pair_batch(SHAPES, V, seed=1)
    loss = losses.dpo(beta=0.3, loss_type=kind, label_smoothing=ls, sft_weight=sft)
    logps = _logps(batch, seed=2)
    ours = _ours(batch, loss, logps, [[0, 2], [1], [3]])
    g_ours = torch.autograd.grad(ours[0], logps)
    types, weights = ([kind, "sft"], [1.0, sft]) if sft else ([kind], [1.0])
    trl_loss, trl_metrics = _trl_dpo(batch, logps, loss_types=types, loss_weights=weights, beta=0.3,
                                     label_smoothing=ls)
    g_trl = torch.autograd.grad(trl_loss, logps)
    assert float(ours[0].detach()) == pytest.approx(float(trl_loss), rel=1e-6, abs=1e-7)
    figures = dict(zip(loss.metric_names, ours[1:].tolist()))
    for k in METRICS:
        assert figures[k] == pytest.approx(trl_metrics[k], rel=1e-5, abs=1e-6), k
    for a, b in zip(g_ours, g_trl):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_simpo_equals_trl_cpo():
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    batch = pair_batch(SHAPES, V, seed=3, ref=False)
    loss = losses.dpo(beta=2.0, loss_type="simpo", simpo_gamma=0.6, label_smoothing=0.1)
    logps = _logps(batch, seed=4)
    ours = _ours(batch, loss, logps, [[0], [1, 2, 3]])
    # CPO's get_batch_logps sums over completion labels only (masked positions get no gradient)
    masks = [torch.cat([s.loss_mask[1:].float(), torch.zeros(1)]) for s in batch.samples]
    avg = torch.stack([(lp * m).sum() / m.sum() for lp, m in zip(logps, masks)])
    fake = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=0.6, beta=2.0, label_smoothing=0.1,
                           accelerator=_Acc())
    per_pair, rc, rr = CPOTrainer.cpo_loss(fake, avg[0::2], avg[1::2])
    assert float(ours[0].detach()) == pytest.approx(float(per_pair.mean()), rel=1e-6)
    for a, b in zip(torch.autograd.grad(ours[0], logps), torch.autograd.grad(per_pair.mean(), logps)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    figures = dict(zip(loss.metric_names, ours[1:].tolist()))
    assert figures["rewards/chosen"] == pytest.approx(float(rc.mean()), rel=1e-5)
    assert figures["rewards/margins"] == pytest.approx(float((rc - rr).mean()), rel=1e-5, abs=1e-6)
    assert figures["logps/rejected"] == pytest.approx(float(avg[1::2].mean()), rel=1e-5)


def test_any_split_of_pairs_gives_the_same_loss_metrics_and_gradient():
    batch = pair_batch(SHAPES, V, seed=5)
    loss = losses.dpo(beta=0.5, sft_weight=0.4)
    logps = _logps(batch, seed=6)
    splits = [[[0, 1, 2, 3]], [[0], [1], [2], [3]], [[3, 1], [0, 2]]]
    outs = [_ours(batch, loss, logps, s) for s in splits]
    grads = [torch.autograd.grad(o[0], logps) for o in outs]
    for o, g in zip(outs[1:], grads[1:]):
        torch.testing.assert_close(o.detach(), outs[0].detach(), rtol=1e-6, atol=1e-7)
        for a, b in zip(g, grads[0]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_a_split_pair_is_refused_at_the_head():
    batch = pair_batch(SHAPES, V)
    loss = losses.dpo()
    mb = pack(batch, [0, 1, 2], loss=loss, weights=loss.weights(batch))
    with pytest.raises(RuntimeError, match=r"not whole \(chosen, rejected\) pairs"):
        loss.microbatch_stats(torch.zeros(mb.num_tokens), mb)


def _sample(n, answer, ref=None):
    extras = None if ref is None else {"ref_logprobs": torch.zeros(ref)}
    return odcfn.Sample(torch.arange(n) % V, loss_mask=torch.arange(n) >= n - answer, extras=extras)


def test_bad_pair_input_is_named():
    a, b = _sample(5, 2), _sample(4, 1)
    with pytest.raises(ValueError, match="pair 1 rejected .* no loss tokens"):
        odcfn.preference_batch([(a, b), (a, _sample(4, 0))])
    with pytest.raises(ValueError, match="pair 0 must be \\(chosen, rejected\\), got 3 items"):
        odcfn.preference_batch([(a, b, a)])
    with pytest.raises(TypeError, match="pair 0 rejected: expected odcfn.Sample"):
        odcfn.preference_batch([(a, "b")])
    with pytest.raises(TypeError, match="pair 1 rejected: expected odcfn.Sample, got NoneType"):
        odcfn.preference_batch([(a, b), (a, None)])
    with pytest.raises(ValueError, match="pair 0 must be \\(chosen, rejected\\), got 1 items"):
        odcfn.preference_batch([(a,)])
    with pytest.raises(ValueError, match="pair 1 lacks its rejected member"):
        odcfn.Batch((a, b, a), pairs=True)
    batch = odcfn.preference_batch([(a, b), (b, a)])
    with pytest.raises(ValueError, match=r"pair 1 chosen \(batch sample 2\): ref_logprobs has shape \(3,\)"):
        odcfn.with_ref_logprobs(batch, [torch.zeros(5), torch.zeros(4), torch.zeros(3), torch.zeros(5)])
    with pytest.raises(ValueError, match="one per-token tensor per sample \\(4 for 2 pairs\\), got 3"):
        odcfn.with_ref_logprobs(batch, [torch.zeros(5)] * 3)
    with pytest.raises(ValueError, match="pair 0 chosen .* lacks extras\\['ref_logprobs'\\]"):
        losses.dpo().validate(batch)
    losses.dpo(reference_free=True).validate(batch)
    losses.dpo(loss_type="simpo").validate(batch)
    with pytest.raises(ValueError, match="needs a pair batch"):
        losses.dpo(reference_free=True).validate(odcfn.Batch((a, b)))
    for kw, msg in [({"beta": 0.0}, "beta"), ({"beta": -1}, "beta"), ({"loss_type": "kto"}, "kto"),
                    ({"loss_type": "robust", "label_smoothing": 0.5}, "label_smoothing"),
                    ({"sft_weight": -1.0}, "sft_weight")]:
        with pytest.raises(ValueError, match=msg):
            losses.dpo(**kw)


def test_a_pair_whose_members_differ_in_prompt_is_named():
    # same length, one token differs; and one prompt a strict prefix of the other
    with pytest.raises(ValueError, match=r"pair 1 \(batch samples 2, 3\): chosen and rejected differ in "
                                         r"prompt .*first differing token at position \d"):
        pair_batch([(3, 2, 2), (3, 1, 3)], V, same_prompt=[True, False])
    a = _sample(5, 2)
    b = odcfn.Sample(torch.arange(5) % V, loss_mask=torch.arange(5) >= 4)  # prompt 0..3 vs 0..2
    with pytest.raises(ValueError, match=r"pair 0 .*differ in prompt .*3 vs 4 prompt tokens"):
        odcfn.preference_batch([(a, b)])
    # the check also guards a pair batch built by hand, at the loss, before any communication
    with pytest.raises(ValueError, match="pair 0 .*differ in prompt"):
        losses.dpo(reference_free=True).validate(odcfn.Batch((a, b), pairs=True))
    # equal prompts of different token dtypes and a member without a mask (no prompt) vs one
    # whose mask starts at 0 are the same prompt
    c = odcfn.Sample((torch.arange(5) % V).int(), loss_mask=torch.arange(5) >= 3)
    odcfn.preference_batch([(a, c)])
    d, e = odcfn.Sample(torch.arange(4)), odcfn.Sample(torch.arange(3), loss_mask=torch.ones(3))
    odcfn.preference_batch([(d, e)])
