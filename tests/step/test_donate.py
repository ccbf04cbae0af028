"""``StepConfig(donate=True)``: ``train_step`` updates the state's tensors in place, gives the
same bits as the pure step, and a used-up state is refused everywhere it could be read."""

from __future__ import annotations

import pytest
import torch

import odcfn
from odcfn.models import QwenConfig
from tests.util import tiny

# tied embeddings: the head reads the embed unit's flat buffer (the in-place tied gradient sum)
CFG = QwenConfig(vocab_size=29, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24, tie_embeddings=True)


def _batch(seed: int, n: int = 5) -> odcfn.Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (n,), generator=g).tolist()
    return odcfn.Batch(
        tuple(odcfn.Sample(torch.randint(0, CFG.vocab_size, (t,), generator=g)) for t in lengths)
    )


def _run(make_opt, donate: bool, W: int, steps: int = 3):
    _, model, full = tiny(CFG)

    def fn(rank, tr):
        state = odcfn.TrainState.create(
            params=full, model=model, optimizer=make_opt(), transport=tr,
            config=odcfn.StepConfig(balance="lb_mini", donate=donate, deterministic=True, max_grad_norm=0.5),
        )
        first = {k: v for k, v in state.params.items()}
        for i in range(steps):
            state, _ = odcfn.train_step(state, _batch(i))
        aliased = all(state.params[k].data_ptr() == first[k].data_ptr() for k in first)
        return state.params, state.opt_state, aliased

    return odcfn.run_local(fn, W, timeout=60)


OPTIMIZERS = {
    "adamw": lambda: odcfn.adamw(1e-2, weight_decay=0.1, weight_decay_mask="no_norms_biases"),
    "sgd_momentum": lambda: odcfn.sgd(1e-2, momentum=0.9, weight_decay=0.05),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("W", [1, 2])
def test_donated_step_equals_pure_step_bit_for_bit(name, W):
    pure = _run(OPTIMIZERS[name], donate=False, W=W)
    donated = _run(OPTIMIZERS[name], donate=True, W=W)
    for (p0, s0, alias0), (p1, s1, alias1) in zip(pure, donated):
        assert not alias0 and alias1  # the pure step made new shards; the donated one reused them
        for k in p0:
            assert torch.equal(p0[k], p1[k]), k
        assert odcfn.tree_allclose(s0, s1, rtol=0, atol=0)


def test_donated_state_is_refused_everywhere(tmp_path):
    _, model, full = tiny(CFG)
    world = odcfn.LocalWorld(1)
    state = odcfn.TrainState.create(
        params=full, model=model, optimizer=odcfn.adamw(1e-3), transport=world.transport(0),
        config=odcfn.StepConfig(balance="round_robin", donate=True),
    )
    before = {k: v.clone() for k, v in state.params.items()}
    new, _ = odcfn.train_step(state, _batch(0))
    assert any(not torch.equal(before[k], state.params[k]) for k in before)  # updated in place
    for call in (
        lambda: odcfn.train_step(state, _batch(1)),
        lambda: odcfn.grad_step(state, _batch(1)),
        lambda: odcfn.log_probs(state, _batch(1)),
        lambda: odcfn.gather_params(state),
        lambda: odcfn.save(tmp_path / "ck", state),
    ):
        with pytest.raises(ValueError, match="donated to train_step at step 0"):
            call()
    assert not (tmp_path / "ck").exists()
    new2, _ = odcfn.train_step(new, _batch(1))  # the returned state lives on
    assert new2.step == 2
    odcfn.save(tmp_path / "ck", new2)


def test_donate_must_be_a_bool():
    with pytest.raises(TypeError, match="StepConfig.donate must be a bool"):
        odcfn.StepConfig(donate=1)



@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_update_temporaries_are_spans_not_shards(name, monkeypatch):
    # a vocabulary-sized shard: the update holds its outputs, never shard-sized temporaries
    from odcfn import optim
    from tests.memtrack import TensorBytes

    span = 1 << 12
    monkeypatch.setattr(optim, "SPAN", span)
    opt = odcfn.adamw(1e-2, weight_decay=0.1) if name == "adamw" else odcfn.sgd(1e-2, momentum=0.9)
    n = 1 << 16
    g = torch.Generator().manual_seed(0)
    params, grads = {"u": torch.randn(n, generator=g)}, {"u": torch.randn(n, generator=g)}
    state = opt.init(params)
    scratch = 24 * span * 4  # a couple of dozen span-sized fp32 temporaries at most
    with TensorBytes() as pure:
        new_p, new_s = opt.update(grads, state, params, grad_scale=0.5)
    outputs = (3 if name == "adamw" else 2) * n * 4  # new params and moments
    assert outputs <= pure.peak <= outputs + scratch, pure.peak / (n * 4)
    # in place: the inputs are the outputs; only span-sized temporaries come and go
    p_in = {"u": params["u"].clone()}
    s_in = odcfn.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)
    with TensorBytes() as inplace:
        p3, s3 = opt.update(grads, s_in, p_in, grad_scale=0.5, inplace=True)
    assert inplace.peak <= scratch, inplace.peak / (n * 4)
    assert p3["u"] is p_in["u"] and torch.equal(p3["u"], new_p["u"])
    assert odcfn.tree_allclose(s3, new_s, rtol=0, atol=0)
