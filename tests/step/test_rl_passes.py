"""``odcfn.log_probs`` equals transformers' Qwen2 log-probs (and entropies) on a tiny random
checkpoint loaded with ``odcfn.models.from_hf``, on every rank, with one sync and no scatter;
``odcfn.gather_params`` returns the full params on every rank or on one."""

from __future__ import annotations

import pytest
import torch
import transformers

import odcfn
from odcfn.models import from_hf, qwen_model
from tests.rl_ref import rollout_batch


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(tmp_path_factory, request):
    hf_cfg = transformers.Qwen2Config(
        vocab_size=41, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=24, rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=request.param,
    )
    torch.manual_seed(0)
    ref = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: perturb so they matter
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    path = tmp_path_factory.mktemp("ckpt") / "qwen2"
    ref.save_pretrained(path)
    return ref, path


def _hf_logprobs(ref, batch, temperature):
    lp, ent = [], []
    with torch.no_grad():
        for s in batch.samples:
            ids = s.tokens.long()[None]
            logits = ref(input_ids=ids).logits[0, :-1].double() / temperature
            logp = torch.log_softmax(logits, -1)
            lp.append(logp.gather(-1, ids[0, 1:, None])[:, 0])
            ent.append(-(logp.exp() * logp).sum(-1))
    return lp, ent


@pytest.mark.parametrize("world, comm, balance, temperature, hybrid", [
    (2, "odc", "lb_mini", 1.0, False), (3, "odc", "work_stealing", 0.8, False),
    (2, "collective", "lb_micro", 1.0, False), (4, "odc", "round_robin", 1.3, False),
    (4, "odc", "lb_mini", 1.0, True),
])
def test_log_probs_equal_transformers(checkpoint, world, comm, balance, temperature, hybrid):
    ref, path = checkpoint
    cfg, full = from_hf(path)
    model = qwen_model(cfg)
    batch = rollout_batch([9, 4, 13, 1, 7, 11, 5], [2, 1, 3, 0, 1, 2, 0], cfg.vocab_size, seed=1)
    want_lp, want_ent = _hf_logprobs(ref, batch, temperature)

    def fn(rank, tr):
        state = odcfn.TrainState.create(
            params=full, model=model, optimizer=odcfn.sgd(0.0), transport=tr,
            config=odcfn.StepConfig(comm=comm, balance=balance, max_tokens_per_microbatch=16),
        )
        before = tr.counters.copy()
        lp = odcfn.log_probs(state, batch, temperature=temperature)
        mid = tr.counters.copy()
        both = odcfn.log_probs(state, batch, temperature=temperature, entropy=True)
        return lp, both, mid - before

    mesh = dict(ranks_per_node=2, sharding="hybrid") if hybrid else {}
    for lp, (lp2, ent), counters in odcfn.run_local(fn, world, **mesh):
        assert len(lp) == len(batch)
        for i, s in enumerate(batch.samples):
            # one value per token, aligned like extras and loss_mask: [t] is token t's, [0] = 0
            assert lp[i].shape == (s.length,) and lp[i].dtype == torch.float32
            assert ent[i].shape == (s.length,) and lp[i][0] == 0 and ent[i][0] == 0
            torch.testing.assert_close(lp[i][1:].double(), want_lp[i], rtol=0, atol=1e-5)
            torch.testing.assert_close(lp2[i], lp[i], rtol=0, atol=0)
            torch.testing.assert_close(ent[i][1:].double(), want_ent[i], rtol=0, atol=1e-5)
        assert counters.syncs == 1 and counters.scatters == 0
        units = len(model.units) + sum(len(u.uses) for u in model.units)  # tied: the head reads embed
        if comm == "odc":
            assert counters.collectives == 0 and counters.gathers <= units  # once per unit (and use)
        else:
            assert counters.collectives == units


def test_log_probs_then_train_step_sees_the_same_params(checkpoint):
    """A log-prob pass between train steps changes nothing: the trajectory equals one without."""
    _, path = checkpoint
    cfg, full = from_hf(path)
    model = qwen_model(cfg)
    # one sample per rank: every accumulator is 0 + a + b (commutative), so both runs are exact
    # whatever order the pushes land in
    batches = [odcfn.random_batch([6, 9], cfg.vocab_size, seed=s) for s in range(2)]

    def fn(rank, tr, with_passes):
        state = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.adamw(1e-2), transport=tr)
        out = []
        for b in batches:
            if with_passes:
                out.append(odcfn.log_probs(state, b))
            state, m = odcfn.train_step(state, b)
        return state.params, out

    a = odcfn.run_local(lambda r, t: fn(r, t, False), 2)
    b = odcfn.run_local(lambda r, t: fn(r, t, True), 2)
    for (pa, _), (pb, passes) in zip(a, b):
        odcfn.tree_assert_allclose(pb, pa, rtol=0, atol=0)
        assert len(passes) == 2


@pytest.mark.parametrize("comm", ["odc", "collective"])
def test_gather_params_on_every_rank_or_one(checkpoint, comm):
    _, path = checkpoint
    cfg, full = from_hf(path)
    model = qwen_model(cfg)

    def fn(rank, tr):
        state = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.sgd(0.0), transport=tr,
                                        config=odcfn.StepConfig(comm=comm, balance="lb_micro"))
        before = tr.counters.copy()
        every = odcfn.gather_params(state)
        one = odcfn.gather_params(state, dst=1)
        return every, one, tr.counters - before

    for rank, (every, one, counters) in enumerate(odcfn.run_local(fn, 3)):
        odcfn.tree_assert_allclose(every, full, rtol=0, atol=0)
        if rank == 1:
            odcfn.tree_assert_allclose(one, full, rtol=0, atol=0)
        else:
            assert one is None
        assert counters.syncs == 2 and counters.scatters == 0
    make = lambda tr: odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.sgd(0), transport=tr)
    with pytest.raises(ValueError, match="dst must be a rank"):
        odcfn.run_local(lambda r, tr: odcfn.gather_params(make(tr), dst=2), 2)


def test_gather_params_then_to_hf_loads_in_transformers(checkpoint, tmp_path):
    """The weight sync of an RL loop: sharded state -> gather_params(dst=0) -> to_hf -> the
    inference engine (transformers here) computes the original checkpoint's logits."""
    from odcfn.models import to_hf

    ref, path = checkpoint
    cfg, full = from_hf(path)
    model = qwen_model(cfg)

    def fn(rank, tr):
        state = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.sgd(0.0), transport=tr)
        got = odcfn.gather_params(state, dst=0)
        if got is not None:
            to_hf(tmp_path / "synced", got, cfg)

    odcfn.run_local(fn, 3)
    back = type(ref).from_pretrained(tmp_path / "synced").eval()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=1e-6)
