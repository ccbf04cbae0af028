"""Everything else keeps working on a mixture of experts: LoRA on the attention projections,
bf16 compute, deterministic accumulation, checkpoints across world sizes, gather_params."""

from __future__ import annotations

import pytest
import torch

import odcfn
from odcfn.models import QwenMoeConfig, qwen_model
from odcfn.tree import tree_leaves, tree_map
from tests.moe.test_moe import _sharp, leaf_grads


def _cfg(**kw) -> QwenMoeConfig:
    base = dict(vocab_size=37, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=12, num_experts=6,
                num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=6,
                output_router_logits=True, router_aux_loss_coef=0.2)
    return QwenMoeConfig(**{**base, **kw})


def _run(model, params, batch, world, fn, **config):
    def worker(rank, transport):
        state = odcfn.TrainState.create(params=params, model=model, optimizer=odcfn.adamw(1e-2),
                                        transport=transport, config=odcfn.StepConfig(**config))
        return fn(state)
    return odcfn.run_local(worker, world_size=world)


def test_lora_on_attention_trains_adapters_only_and_equals_reference():
    cfg = _cfg()
    base, params = qwen_model(cfg), _sharp(cfg, 2)
    model, lparams = odcfn.lora.apply(base, params, rank=2, alpha=4.0, targets=("q_proj", "v_proj"))
    g = torch.Generator().manual_seed(0)  # B != 0 so that the adapters change the forward
    for u in odcfn.lora.adapter_units(model):
        lparams[u] = tree_map(lambda t: torch.randn(t.shape, generator=g) * 0.1, lparams[u])
    batch = odcfn.random_batch([11, 5, 8], 37, seed=1)
    ref_loss, ref_grads = leaf_grads(lparams, batch, model)
    out = _run(model, lparams, batch, 2, lambda s: odcfn.grad_step(s, batch), max_tokens_per_microbatch=12)
    adapters = odcfn.lora.adapter_units(model)
    assert set(out[0][0]) == set(adapters)  # only the adapters have gradients
    for u in adapters:
        got = torch.cat([gr[u] for gr, _ in out])[:ref_grads[u].numel()]
        torch.testing.assert_close(got, ref_grads[u], rtol=2e-5, atol=1e-8)
    assert out[0][1].loss == pytest.approx(ref_loss, rel=1e-5)
    for _, m in out:  # frozen experts: gathered on demand, never pushed
        assert m.counters.scatters == sum(1 for s in m.plan.steps if type(s).__name__ == "ScatterAccumulate")
    with pytest.raises(ValueError, match="routed expert"):
        odcfn.lora.apply(base, params, rank=2, alpha=4.0, targets=("up_proj",))


def test_bf16_compute_within_bf16_error():
    cfg = _cfg()
    model, params = qwen_model(cfg), _sharp(cfg, 3)
    batch = odcfn.random_batch([13, 6, 9], 37, seed=2)
    ref_loss, ref_grads = leaf_grads(params, batch, model)
    out = _run(model, params, batch, 2, lambda s: odcfn.grad_step(s, batch), compute_dtype=torch.bfloat16,
               max_tokens_per_microbatch=16)
    assert out[0][1].loss == pytest.approx(ref_loss, rel=2e-2)
    for u, want in ref_grads.items():
        got = torch.cat([gr[u] for gr, _ in out])[:want.numel()]
        err = float((got - want).norm() / (want.norm() + 1e-12))
        assert err < 0.1, (u, err)


def test_deterministic_accumulation_is_bit_identical():
    cfg = _cfg()
    model, params = qwen_model(cfg), _sharp(cfg, 4)
    batch = odcfn.random_batch([13, 6, 9, 4, 11], 37, seed=3)
    runs = [_run(model, params, batch, 2, lambda s: odcfn.grad_step(s, batch)[0], deterministic=True,
                 max_tokens_per_microbatch=16) for _ in range(3)]
    for other in runs[1:]:
        for rank in range(2):
            for u in runs[0][rank]:
                assert torch.equal(runs[0][rank][u], other[rank][u]), u


def test_checkpoint_round_trip_across_world_sizes(tmp_path):
    """Saved at W=2 after one step, loaded at W=3: the next step equals the same step at W=2
    without the checkpoint in between."""
    cfg = _cfg()
    model, params = qwen_model(cfg), _sharp(cfg, 5)
    b1, b2 = odcfn.random_batch([9, 7, 12], 37, seed=4), odcfn.random_batch([5, 14, 8], 37, seed=5)

    def save_after_one(state):
        state, _ = odcfn.train_step(state, b1)
        odcfn.save(tmp_path / "ck", state)
        state, m = odcfn.train_step(state, b2)
        return odcfn.gather_params(state), m.loss

    def load_then_one(state):
        state = odcfn.load(tmp_path / "ck", state)
        state, m = odcfn.train_step(state, b2)
        return odcfn.gather_params(state), m.loss

    (p2, loss2), _ = _run(model, params, b1, 2, save_after_one)
    (p3, loss3), *_ = _run(model, params, b1, 3, load_then_one)
    assert loss3 == pytest.approx(loss2, rel=1e-5)
    for a, b in zip(tree_leaves(p2), tree_leaves(p3)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # the experts were trained (not only the dense units)
    moved = [u for u in p2 if ".experts." in u
             and not torch.allclose(tree_leaves(p2[u])[0], tree_leaves(params[u])[0])]
    assert moved
