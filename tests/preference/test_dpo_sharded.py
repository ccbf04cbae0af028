"""DPO through the sharded runtime: for every loss type, world size 1-3, balancer (work stealing
included), ODC and collective and random pair lengths and microbatch caps, the gradient shards,
the loss and TRL's metrics equal an independent single-process reference (transformers' Qwen2,
plain log_softmax, autograd on unsharded params); with the policy as its own reference the loss
is ln 2 at W = 1-4; pairs are never split; bad input fails on every rank before any
communication."""

from __future__ import annotations

import math
import os

import pytest
import torch
import transformers  # noqa: F401 (a hard requirement of these tests)
from hypothesis import given, settings
from hypothesis import strategies as st

import odcfn
from odcfn import losses
from odcfn.models import QwenConfig, init_params, qwen_model
from tests.dpo_ref import LN2, pair_batch, reference
from tests.util import ref_shards, run_grad_step

CFG = QwenConfig(vocab_size=23, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=20)
RTOL, ATOL = 2e-4, 2e-6
POLICIES = [("odc", "round_robin"), ("odc", "lb_mini"), ("odc", "lb_micro"), ("odc", "work_stealing"),
            ("collective", "lb_micro"), ("collective", "local_sort")]
LOSSES = [("sigmoid", 0.0), ("sigmoid", 0.1), ("robust", 0.2), ("hinge", 0.0), ("ipo", 0.0), ("simpo", 0.05)]


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return odcfn.tree_map(lambda t: t + torch.randn(t.shape, generator=g) * 0.3, init_params(CFG))


shapes = st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(1, 5)), min_size=1, max_size=5)


@settings(max_examples=int(os.environ.get("ODCFN_EXAMPLES", 8)), deadline=None)
@given(kind=st.sampled_from(LOSSES), sft=st.sampled_from([0.0, 0.5]), world=st.integers(1, 3),
       policy=st.sampled_from(POLICIES), pairs=shapes, seed=st.integers(0, 2**16), data=st.data())
def test_sharded_dpo_equals_reference(kind, sft, world, policy, pairs, seed, data):
    batch = pair_batch(pairs, CFG.vocab_size, seed=seed)
    longest = max(p + a + p + b for p, a, b in pairs)
    cap = data.draw(st.integers(longest, 2 * longest))
    loss = losses.dpo(beta=0.7, loss_type=kind[0], label_smoothing=kind[1], sft_weight=sft)
    full, model = _params(seed), qwen_model(CFG)
    want_loss, want_metrics, want_grads = reference(CFG, full, batch, loss)
    scale = max(1.0, max(float(g.abs().max()) for g in odcfn.tree.tree_leaves(want_grads)))
    want = ref_shards(want_grads, model, world)
    comm, balance = policy
    out = run_grad_step(full, batch, model, world, comm=comm, balance=balance,
                        max_tokens_per_microbatch=cap, loss=loss)
    for rank, (grads, m) in enumerate(out):
        odcfn.tree_assert_allclose(grads, want[rank], rtol=RTOL, atol=ATOL * scale,
                                   what=f"{policy} rank {rank}")
        assert m.loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
        for k, v in want_metrics.items():
            if k == "rewards/accuracies":  # a near-tie may flip in float32: bounded by one pair
                assert abs(m.extra[k] - v) <= 1 / len(pairs) + 1e-6
            else:
                assert m.extra[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
        assert m.counters.syncs == 1
        if comm == "odc":
            assert m.counters.collectives == 0
        for mb in m.plan.microbatches:  # whole pairs, chosen then rejected, in every microbatch
            assert len(mb) % 2 == 0 and all(c % 2 == 0 and r == c + 1 for c, r in zip(mb[0::2], mb[1::2]))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_policy_as_its_own_reference_gives_ln2(world):
    """TRL's invariant: at the first step (policy == reference) the sigmoid loss is ln 2; the
    reference log-probs come from odcfn.log_probs of the same state (packed, sharded)."""
    full, model = _params(7), qwen_model(CFG)
    shapes = [(3, 4, 2), (1, 6, 5), (2, 2, 7), (4, 1, 1), (2, 3, 3)]
    batch = pair_batch(shapes, CFG.vocab_size, seed=7, ref=False)

    def fn(rank, tr):
        cfg = odcfn.StepConfig(balance="lb_mini", loss=losses.dpo(beta=0.1), max_tokens_per_microbatch=24)
        state = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.sgd(0.1), transport=tr,
                                        config=cfg)
        ref = odcfn.log_probs(state, batch)
        state, m = odcfn.train_step(state, odcfn.with_ref_logprobs(batch, ref))
        return m

    for m in odcfn.run_local(fn, world, timeout=30):
        assert m.loss == pytest.approx(LN2, abs=1e-6)
        assert m.extra["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
        assert m.extra["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
        assert m.extra["logps/chosen"] < 0 and math.isfinite(m.extra["logps/rejected"])


def test_one_pair_per_microbatch_equals_one_microbatch_of_all():
    full, model = _params(8), qwen_model(CFG)
    batch = pair_batch([(3, 4, 2), (1, 6, 5), (2, 2, 7), (4, 1, 1)], CFG.vocab_size, seed=8)
    loss = losses.dpo(beta=0.3, sft_weight=0.2)
    one = run_grad_step(full, batch, model, 1, balance="lb_mini", loss=loss)  # cap: the longest pair
    every = run_grad_step(full, batch, model, 1, balance="lb_mini", loss=loss, max_tokens_per_microbatch=1000)
    assert len(one[0][1].plan.microbatches) == 4 and len(every[0][1].plan.microbatches) == 1
    (g1, m1), (g2, m2) = one[0], every[0]
    assert m1.loss == pytest.approx(m2.loss, rel=1e-6)
    assert m1.extra == pytest.approx(m2.extra, rel=1e-5, abs=1e-7)
    odcfn.tree_assert_allclose(g1, g2, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", ["cap", "ref", "no_pairs", "prompt"])
def test_bad_input_fails_on_every_rank_before_any_communication(case):
    full, model = _params(0), qwen_model(CFG)
    batch = pair_batch([(2, 3, 3), (6, 5, 6)], CFG.vocab_size, ref=case != "ref")
    if case == "no_pairs":
        batch = odcfn.Batch(batch.samples)
    if case == "prompt":  # pair 1 answers pair 0's prompt; built by hand (preference_batch refuses it)
        batch = odcfn.Batch((*batch.samples[:3], batch.samples[1]), pairs=True)
    want = {"cap": r"preference pair 1 \(samples 2, 3\) has 11 \+ 12 = 23 tokens, more than "
                   r"max_tokens_per_microbatch=20",
            "ref": r"preference pair 0 chosen \(batch sample 0\) lacks extras\['ref_logprobs'\]",
            "no_pairs": "dpo needs a pair batch",
            "prompt": r"preference pair 1 \(batch samples 2, 3\): chosen and rejected differ in prompt"}[case]

    def fn(rank, tr):
        cfg = odcfn.StepConfig(loss=losses.dpo(), max_tokens_per_microbatch=20)
        state = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.sgd(0.0), transport=tr,
                                        config=cfg)
        before = tr.counters.copy()
        with pytest.raises(ValueError, match=want):
            odcfn.grad_step(state, batch)
        return tr.counters - before

    for counters in odcfn.run_local(fn, 2, timeout=30):
        assert counters.syncs == 0 and counters.collectives == 0 and counters.gathers == 0


def test_lora_reference_is_the_base_model():
    """With LoRA the reference is the base (adapters off) from the same state: no second model."""
    base, model = _params(9), qwen_model(CFG)
    lmodel, lparams = odcfn.lora.apply(model, base, rank=2, alpha=4.0)
    g = torch.Generator().manual_seed(9)
    lparams = {k: odcfn.tree_map(lambda t: t + 0.5 * torch.randn(t.shape, generator=g), v)
               if k.startswith("lora.") else v for k, v in lparams.items()}  # adapters that matter
    batch = pair_batch([(3, 4, 2), (1, 6, 5)], CFG.vocab_size, seed=9, ref=False)

    def fn(rank, tr):
        make = lambda p, m: odcfn.TrainState.create(params=p, model=m, optimizer=odcfn.sgd(0.0), transport=tr)
        state = make(lparams, lmodel)
        return (odcfn.log_probs(odcfn.lora_reference(state), batch),
                odcfn.log_probs(state, batch), odcfn.log_probs(make(base, model), batch))

    for ref, policy, want in odcfn.run_local(fn, 2, timeout=30):
        for a, b in zip(ref, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert max(float((c - b).abs().max()) for b, c in zip(want, policy)) > 1e-3
    with pytest.raises(ValueError, match="no LoRA adapters"):
        odcfn.run_local(lambda r, tr: odcfn.lora_reference(
            odcfn.TrainState.create(params=base, model=model, optimizer=odcfn.sgd(0.0), transport=tr)), 1)
