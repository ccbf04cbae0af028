"""The user API: StepConfig validates by field, TrainState is a pytree built by create,
train_step/grad_step take exactly (state, batch), grads are the caller's, save/load resume."""

from __future__ import annotations

import inspect

import pytest
import torch

import odcfn
from odcfn.tree import tree_leaves, tree_map
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture
from tests.util import tiny


def test_train_step_and_grad_step_take_exactly_state_and_batch():
    for fn in (odcfn.train_step, odcfn.grad_step):
        assert list(inspect.signature(fn).parameters) == ["state", "batch"]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"comm": "allreduce"}, "StepConfig.comm"),
        ({"balance": "magic"}, "unknown balancer 'magic'"),
        ({"balance": 3}, "balance must be"),
        ({"comm": "collective", "balance": "work_stealing"}, "needs comm='odc'"),
        ({"max_tokens_per_microbatch": 0}, "StepConfig.max_tokens_per_microbatch"),
        ({"max_tokens_per_microbatch": True}, "StepConfig.max_tokens_per_microbatch"),
        ({"options": {"prefetch": 1}}, "StepConfig.options"),
        ({"compute_dtype": torch.int32}, "StepConfig.compute_dtype"),
        ({"max_grad_norm": -1.0}, "StepConfig.max_grad_norm"),
        ({"max_grad_norm": float("nan")}, "StepConfig.max_grad_norm"),
        ({"cost": 5}, "StepConfig.cost"),
    ],
)
def test_step_config_names_the_bad_field(kw, field):
    with pytest.raises((TypeError, ValueError), match=field.replace("(", r"\(").replace(")", r"\)")):
        odcfn.StepConfig(**kw)


def test_train_state_is_a_pytree_and_create_checks_its_inputs():
    cfg, model, full = tiny()

    def fn(rank, tr):
        st = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.sgd(0.1), transport=tr)
        assert st.mesh is tr.mesh and st.step == 0 and st.config == odcfn.StepConfig()
        leaves = tree_leaves(st)
        assert len(leaves) == len(st.params) + len(tree_leaves(st.opt_state)) + 1  # + the step
        doubled = tree_map(lambda x: x * 2, st)
        assert isinstance(doubled, odcfn.TrainState) and doubled.model is model and doubled.step == 0
        for bad, msg in (
            (dict(model="m"), "model must be an odcfn.Model"),
            (dict(optimizer=None), "optimizer must be an odcfn.Optimizer"),
            (dict(transport=object()), "transport must be an odcfn transport"),
            (dict(config={"comm": "odc"}), "config must be an odcfn.StepConfig"),
            (dict(step=-1), "step must be an int >= 0"),
            (dict(params=[1, 2]), "params must be a dict"),
        ):
            kw = dict(params=full, model=model, optimizer=odcfn.sgd(0.1), transport=tr) | bad
            with pytest.raises((TypeError, ValueError), match=msg):
                odcfn.TrainState.create(**kw)
        return True

    assert all(odcfn.run_local(fn, 2))


def test_grad_step_grads_are_not_overwritten_by_the_next_step():
    cfg, model, full = tiny()
    b1, b2 = (odcfn.random_batch([5, 8, 3], cfg.vocab_size, seed=s) for s in (1, 2))

    def fn(rank, tr):
        st = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.sgd(0.1), transport=tr)
        g1, _ = odcfn.grad_step(st, b1)
        keep = {k: v.clone() for k, v in g1.items()}
        odcfn.grad_step(st, b2)
        return all(torch.equal(g1[k], keep[k]) for k in keep)

    assert all(odcfn.run_local(fn, 2))


def test_save_load_state_resumes_bit_identically(tmp_path):
    cfg, model, full = tiny()
    # one sample per rank: each accumulator is a + b into zero, so every run is bit-identical
    batch = odcfn.random_batch([6, 9], cfg.vocab_size, seed=3)

    def fn(rank, tr):
        def fresh(seed):
            p = full if seed == 0 else odcfn.models.init_params(cfg, seed=seed)
            return odcfn.TrainState.create(params=p, model=model, optimizer=odcfn.adamw(1e-2), transport=tr)

        st, _ = odcfn.train_step(fresh(0), batch)
        odcfn.save(tmp_path / "ck", st)
        want, _ = odcfn.train_step(st, batch)
        back = odcfn.load(tmp_path / "ck", fresh(7))
        got, _ = odcfn.train_step(back, batch)
        assert back.step == 1 and got.step == 2
        odcfn.tree_assert_allclose(got.params, want.params, rtol=0, atol=0, what=f"params, rank {rank}")
        odcfn.tree_assert_allclose(got.opt_state, want.opt_state, rtol=0, atol=0, what=f"opt, rank {rank}")
        return True

    assert all(odcfn.run_local(fn, 2))
    with pytest.raises(TypeError, match="state must be a TrainState"):
        odcfn.save(tmp_path / "x", {"params": 1})


def test_odc_on_a_collectives_only_transport_is_refused_before_any_communication(mp_pool):  # noqa: F811
    out = mp_pool.run(collective_only_worker, 2)
    assert all("comm='odc' needs a point-to-point transport" in msg for msg in out)


def collective_only_worker():
    cfg, model, full = tiny()
    mesh = odcfn.Mesh.from_env()
    with odcfn.CollectiveTransport(mesh, timeout=30) as tr:
        state = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.sgd(0.1), transport=tr)
        before = tr.collectives.calls.copy() if hasattr(tr.collectives, "calls") else None
        try:
            odcfn.grad_step(state, odcfn.random_batch([4, 5], cfg.vocab_size))
        except TypeError as e:
            after = tr.collectives.calls.copy() if before is not None else None
            assert before == after, "refused after communicating"
            return str(e)
    return "no error"
