"""Auxiliary-loss-free balancing: a per-expert bias shifts the router's top-k choice (never its
weights) and moves toward the minibatch's under-loaded experts after every step."""

from __future__ import annotations

import pytest
import torch

import odcfn
from odcfn.models import QwenConfig, QwenMoeConfig, init_params, qwen_model
from odcfn.moe.router import route
from tests.moe.test_moe import _sharp, leaf_grads

CFG = QwenMoeConfig(
    vocab_size=31,
    d_model=16,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    d_ff=12,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    norm_topk_prob=True,
)


def _run(fn, world=2, params=None, **config):
    model = qwen_model(CFG)

    def worker(rank, transport):
        state = odcfn.TrainState.create(
            params=_sharp(CFG, 1) if params is None else params,
            model=model,
            optimizer=odcfn.adamw(1e-3),
            transport=transport,
            config=odcfn.StepConfig(**config),
        )
        return fn(state)

    return odcfn.run_local(worker, world_size=world)


def test_the_bias_shifts_the_choice_and_never_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.9])
    idx, w = route(logits, 2, norm_topk_prob=False, layer=0, log=None, bias_E=bias)
    probs = torch.softmax(logits, -1)
    assert idx.tolist() == [[3, 0]] or idx.tolist() == [[0, 3]]  # expert 3 chosen for its bias
    assert torch.allclose(w, probs.gather(1, idx))  # weighted by its own probability


def test_the_bias_moves_toward_underloaded_experts_by_the_rate():
    batch = odcfn.random_batch([9, 12, 7, 5, 14], 31, seed=0)

    def two_steps(state):
        s1, m1 = odcfn.train_step(state, batch)
        s2, m2 = odcfn.train_step(s1, batch)
        return state.router_bias, s1.router_bias, s2.router_bias, m1, m2

    out = _run(two_steps, expert_bias_rate=0.05, max_tokens_per_microbatch=16)
    b0, b1, b2, m1, m2 = out[0]
    assert torch.equal(b0, torch.zeros(2, 6))
    for before, after, m in ((b0, b1, m1), (b1, b2, m2)):
        loads = torch.stack([m.extra[f"moe/load/layers.{i}"] for i in range(2)])
        delta = torch.sign(loads.mean(-1, keepdim=True) - loads)
        want = before + 0.05 * (delta - delta.mean(-1, keepdim=True)).float()
        torch.testing.assert_close(after, want)
        assert (after - before)[loads > loads.mean(-1, keepdim=True)].max() < 0  # busiest experts: down
    for other in out[1:]:  # every rank computes the same bias
        assert torch.equal(other[2], b2)


def test_sharded_step_with_a_bias_equals_the_reference():
    bias = torch.tensor([[1.5, 0.0, 0.0, -1.5, 0.0, 0.0], [0.0, -2.0, 0.0, 0.0, 2.0, 0.0]])
    params, batch = _sharp(CFG, 2), odcfn.random_batch([9, 12, 7, 5], 31, seed=3)
    model = qwen_model(CFG)
    p = odcfn.tree_map(lambda t: t.clone().requires_grad_(), params)
    loss = odcfn.model.reference_loss(model, p, batch, router_bias=bias)
    loss.backward()
    plain_loss, _ = leaf_grads(params, batch, model)
    assert abs(float(loss) - plain_loss) > 1e-6  # the bias changed which experts ran

    def grads(state):
        state = state.replace(router_bias=bias.clone())
        return odcfn.grad_step(state, batch)

    for comm in ("odc", "collective"):
        out = _run(grads, params=params, comm=comm, expert_bias_rate=0.1, max_tokens_per_microbatch=16)
        assert out[0][1].loss == pytest.approx(float(loss), rel=1e-5)
        for unit in params:
            want = torch.cat(
                [
                    (t.grad if t.grad is not None else torch.zeros_like(t)).reshape(-1)
                    for t in odcfn.tree.tree_leaves(p[unit])
                ]
            )
            got = torch.cat([g[unit] for g, _ in out])[: want.numel()]
            assert float((got - want).abs().max()) <= 2e-5 * (float(want.abs().max()) + 1e-12) + 1e-9, unit


def test_balancing_evens_out_the_expert_load():
    """The same 30 minibatches from the same start: with the bias the expert load's max/mean
    over the last 15 steps is clearly lower than without it (the routers' own imbalance; the
    data and the init are fixed, so the run is deterministic)."""
    params = _sharp(CFG, 7)
    batches = [odcfn.random_batch([40, 36, 44, 30], 31, seed=s) for s in range(30)]

    def train(state):
        spread = []
        for b in batches:
            state, m = odcfn.train_step(state, b)
            spread.append(max(m.extra[f"moe/load_max_over_mean/layers.{i}"] for i in range(2)))
        return sum(spread[-15:]) / 15

    off = _run(train, world=1, params=params, max_tokens_per_microbatch=48)[0]
    on = _run(train, world=1, params=params, expert_bias_rate=0.01, max_tokens_per_microbatch=48)[0]
    assert on < 0.93 * off, (on, off)  # measured: 1.32 vs 1.61


def test_checkpoints_keep_the_bias_and_ranks_must_agree(tmp_path):
    batch = odcfn.random_batch([9, 12, 7, 5], 31, seed=4)

    def save_load(state):
        state, _ = odcfn.train_step(state, batch)
        odcfn.save(tmp_path / "ck", state)
        fresh = state.replace(router_bias=torch.zeros_like(state.router_bias))
        return state.router_bias, odcfn.load(tmp_path / "ck", fresh).router_bias

    for saved, loaded in _run(save_load, expert_bias_rate=0.05, max_tokens_per_microbatch=16):
        assert saved.abs().sum() > 0 and torch.equal(saved, loaded)

    def disagree(state):
        if state.mesh.rank == 1:
            state = state.replace(router_bias=state.router_bias + 0.5)
        with pytest.raises(ValueError, match="disagree"):
            odcfn.train_step(state, batch)

    _run(disagree, expert_bias_rate=0.05, max_tokens_per_microbatch=16)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="expert_bias_rate"):
        odcfn.StepConfig(expert_bias_rate=-0.1)
    dense = QwenConfig(vocab_size=31, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=12)

    def make(rank, transport):
        odcfn.TrainState.create(
            params=init_params(dense),
            model=qwen_model(dense),
            optimizer=odcfn.adamw(1e-3),
            transport=transport,
            config=odcfn.StepConfig(expert_bias_rate=0.1),
        )

    with pytest.raises(ValueError, match="mixture of experts"):
        odcfn.run_local(make, world_size=1)
