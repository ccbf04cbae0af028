"""Issue 40, the bounded-staleness findings: the stale step routes with the state's router bias
(item 1), takes the optimizer the state holds at each step and refuses a changed optimizer state
(item 2), and holds every rank to τ, an empty one included, in-process and across processes
(item 5)."""

from __future__ import annotations

import pytest
import torch

import odcfn
from odcfn.models import qwen_model
from odcfn.step import stale
from tests.moe.test_moe import _sharp
from tests.moe.test_moe_bias import CFG as MOE
from tests.util import make_state, tiny

LR = 0.5


# --- item 1: the router bias ---------------------------------------------------------------------


def test_the_stale_step_routes_with_the_router_bias_as_the_synchronous_step_does():
    bias = torch.tensor([[1.5, 0.0, 0.0, -1.5, 0.0, 0.0], [0.0, -2.0, 0.0, 0.0, 2.0, 0.0]])
    model, params = qwen_model(MOE), _sharp(MOE, 2)
    batch = odcfn.random_batch([9, 12, 7, 5], MOE.vocab_size, seed=3)

    def loads(staleness):
        def fn(rank, tr):
            st = odcfn.TrainState.create(params=params, model=model, optimizer=odcfn.sgd(0.1), transport=tr,
                                         config=odcfn.StepConfig(expert_bias_rate=0.1))
            # a learned bias kept fixed (rate 0), e.g. a resumed run that stops balancing
            st = st.replace(router_bias=bias.clone(),
                            config=st.config.replace(expert_bias_rate=0.0, staleness=staleness))
            st, m = odcfn.train_step(st, batch)
            if staleness:  # a stale step reports its figures late: in a later step or at drain
                figs = {**m.extra["reports"], **stale.drain(st)[1]}[0]
            else:
                figs = m.extra
            return [figs[f"moe/load/layers.{i}"].tolist() for i in range(2)]

        out = odcfn.run_local(fn, 2, timeout=30)
        assert out[0] == out[1]
        return out[0]

    sync = loads(0)
    assert loads(1) == sync  # step 0 reads version 0 everywhere: the same routing, the same loads


def test_a_stale_run_with_a_router_bias_equals_its_exact_replay_with_that_bias():
    from odcfn.reference import replay

    bias = torch.tensor([[1.5, 0.0, 0.0, -1.5, 0.0, 0.0], [0.0, -2.0, 0.0, 0.0, 2.0, 0.0]])
    model, params = qwen_model(MOE), _sharp(MOE, 2)
    batches = [odcfn.random_batch([9, 12, 7, 5], MOE.vocab_size, seed=s) for s in range(3)]
    config = odcfn.StepConfig(staleness=1, deterministic=True)

    def fn(rank, tr):
        st = odcfn.TrainState.create(params=params, model=model, optimizer=odcfn.sgd(0.1), transport=tr,
                                     config=odcfn.StepConfig(expert_bias_rate=0.1))
        st = st.replace(router_bias=bias.clone(), config=config)
        ms = []
        for b in batches:
            st, m = odcfn.train_step(st, b)
            ms.append(m)
        return stale.drain(st)[0].params, ms

    out = odcfn.run_local(fn, 2, timeout=30)
    got = odcfn.unshard([p for p, _ in out], model, odcfn.Mesh(2, 0))
    rec = stale.record([m for _, m in out], plans=True)
    kw = {"exact": True, "config": config}
    want = replay(model, params, odcfn.sgd(0.1), batches, rec, router_bias=bias, **kw)
    leaves = odcfn.tree.tree_leaves
    assert all(torch.equal(a, b) for a, b in zip(leaves(got), leaves(want)))
    with pytest.raises(ValueError, match="record does not list"):  # routed elsewhere without the bias
        replay(model, params, odcfn.sgd(0.1), batches, rec, **kw)


# --- item 2: the optimizer the state holds ---------------------------------------------------------


def _drained_then(change, steps=3):
    """Two stale steps (τ = 1), drain; ``change(state)``; ``steps`` more, drain: the full
    params at both drains, rank 0's view."""
    _, model, full = tiny()
    batches = [odcfn.random_batch([5, 9, 3, 7, 4], 37, seed=s) for s in range(2 + steps)]

    def fn(rank, tr):
        st = make_state(full, model, tr, optimizer=odcfn.sgd(LR), staleness=1)
        for b in batches[:2]:
            st, _ = odcfn.train_step(st, b)
        st, _ = stale.drain(st)
        first = {k: v.clone() for k, v in st.params.items()}
        st = change(st)
        for b in batches[2:]:
            st, _ = odcfn.train_step(st, b)
        st, _ = stale.drain(st)
        return first, st.params

    return odcfn.run_local(fn, 2, timeout=30)


def test_a_changed_optimizer_takes_effect_under_staleness():
    for first, last in _drained_then(lambda st: st.replace(optimizer=odcfn.sgd(0.0))):
        for k in first:
            assert torch.equal(first[k], last[k]), k  # lr 0 from step 2 on: nothing moves


def test_a_schedule_passed_through_the_state_takes_effect_under_staleness():
    # an lr per step through the state, the way a hand-written loop would schedule it: lr 0 on
    # every step after the change (each step gets its own optimizer object)
    def loop_lr0(st):
        return st.replace(optimizer=odcfn.sgd(lambda count: 0.0))

    for first, last in _drained_then(loop_lr0, steps=2):
        assert all(torch.equal(first[k], last[k]) for k in first)


def test_a_replaced_optimizer_state_is_refused_under_staleness():
    def reset(st):
        return st.replace(opt_state=st.optimizer.init(st.params))

    with pytest.raises(Exception, match="optimizer state"):
        _drained_then(reset)


def test_an_optimizer_with_another_state_layout_is_refused_under_staleness():
    with pytest.raises(Exception, match="optimizer"):
        _drained_then(lambda st: st.replace(optimizer=odcfn.adamw(1e-3)))
