"""Hierarchical shards (hpZ, ``ScheduleOptions(reshard_after_forward=k)``): gradients equal the
single-process reference, and the backward's gathers never leave the k-rank group."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import odcfn
from odcfn.models import init_params, qwen_model
from odcfn.schedule import ScheduleOptions
from odcfn.schedule.plan import Gather, Reshard
from tests.step.test_equivalence import assignments, configs
from tests.util import fixed_balancer, make_state, ref_shards, run_grad_step, tiny

RTOL, ATOL = 2e-4, 2e-6
W, K = 4, 2  # two simulated nodes: ranks {0, 1} and {2, 3}
# rank 2 has no samples: it still builds its slice of the group shards rank 3 reads
ASSIGNMENT = (((0,), (1, 2)), ((3,),), (), ((4,), (5,)))


def _run(full, model, batch, reshard):
    opts = ScheduleOptions(prefetch=1, reshard_after_forward=reshard)

    def fn(rank, tr):
        state = make_state(full, model, tr, balance=fixed_balancer(ASSIGNMENT), options=opts)
        grads, metrics = odcfn.grad_step(state, batch)
        return grads, metrics, dict(tr.peer_bytes), dict(tr.group_bytes)

    return odcfn.run_local(fn, W, timeout=30)


def test_hpz_equals_reference_and_backward_stays_in_group():
    cfg, model, full = tiny()
    batch = odcfn.random_batch([5, 9, 3, 7, 4, 6], cfg.vocab_size, seed=1)
    loss_ref, grads_ref = odcfn.reference_value_and_grad(model, full, batch)
    want = ref_shards(grads_ref, model, W)
    hpz = _run(full, model, batch, K)
    flat = _run(full, model, batch, True)
    layout = odcfn.sharding.make_layout(model, odcfn.Mesh(W))
    for rank, ((grads, m, peer, group), (_, _, peer_flat, _)) in enumerate(zip(hpz, flat)):
        odcfn.tree_assert_allclose(grads, want[rank], rtol=RTOL, atol=ATOL, what=f"hpZ rank {rank}")
        assert abs(m.loss - float(loss_ref)) <= 1e-5 * abs(float(loss_ref))
        assert m.counters.syncs == 1 and m.counters.collectives == 0
        mine = set(range(rank - rank % K, rank - rank % K + K))
        # the backward's gathers: from the group's secondary shards only
        assert set(group) <= mine - {rank}
        steps = m.plan.steps
        from_group = [s for s in steps if isinstance(s, Gather) and s.group]
        if any(isinstance(s, odcfn.schedule.plan.Backward) for s in steps):
            assert from_group and set(group) == mine - {rank}
        # primary gathers (forward and the shard builds) pay every owner; nothing else does
        primary = [s.unit for s in steps if isinstance(s, Gather) and not s.group]
        per_owner = {u: layout[u].shard_size * 4 for u in layout.names}  # fp32
        for owner in set(range(W)) - {rank}:
            assert peer.get(owner, 0) == sum(per_owner[u] for u in primary), (rank, owner)
        # and the plain re-gathering run crossed the group for its backward too
        cross = sum(b for o, b in peer.items() if o not in mine)
        cross_flat = sum(b for o, b in peer_flat.items() if o not in mine)
        if from_group:
            assert cross < cross_flat


def test_hpz_plan_shows_group_shards():
    units = ["embed", "layers.0", "head"]
    plan = odcfn.schedule.compile_plan(
        units, (((0,),), ((1,),)), 0, "odc", ScheduleOptions(reshard_after_forward=2)
    )
    assert [s.unit for s in plan.steps if isinstance(s, Reshard)] == ["embed", "layers.0"]
    assert [s.unit for s in plan.steps if isinstance(s, Gather) and s.group == 2] == ["layers.0", "embed"]
    text = str(plan)
    assert "Reshard" in text and "2-rank group" in text


@pytest.mark.parametrize("k", [3, 0, -1, 2.0, "2"])
def test_bad_k_refused_before_any_communication(k):
    if k in (3,):
        cfg, model, full = tiny()
        batch = odcfn.random_batch([5, 9], cfg.vocab_size, seed=1)

        def fn(rank, tr):
            state = make_state(full, model, tr, options=ScheduleOptions(reshard_after_forward=k))
            before = tr.counters.copy()
            with pytest.raises(ValueError, match="reshard_after_forward=3"):
                odcfn.grad_step(state, batch)
            assert tr.counters == before and tr.collectives.calls.total() == 0
            return True

        assert all(odcfn.run_local(fn, 4, timeout=30))
    else:
        with pytest.raises(ValueError, match="reshard_after_forward"):
            ScheduleOptions(reshard_after_forward=k)


@st.composite
def hpz_cases(draw):
    cfg = draw(configs())  # tied embeddings too: the head's use of embed re-gathers from the group
    world, rpn, sharding = draw(st.sampled_from([(2, None, "full"), (4, None, "full"), (4, 2, "hybrid")]))
    group = rpn or world
    k = draw(st.sampled_from([d for d in range(1, group + 1) if group % d == 0]))
    lengths = draw(st.lists(st.integers(2, 10), min_size=1, max_size=5))
    assignment = draw(assignments(len(lengths), world))  # empty ranks, unequal counts
    opts = ScheduleOptions(prefetch=draw(st.integers(0, 2)), reshard_after_forward=k)
    return cfg, world, rpn, sharding, lengths, assignment, opts, draw(st.integers(0, 2**16))


@settings(max_examples=int(os.environ.get("ODCFN_EXAMPLES", 4)), deadline=None)
@given(hpz_cases())
def test_hpz_property_equals_reference(case):
    cfg, world, rpn, sharding, lengths, assignment, opts, seed = case
    model, full = qwen_model(cfg), init_params(cfg, seed=seed)
    batch = odcfn.random_batch(lengths, cfg.vocab_size, seed=seed)
    _, grads_ref = odcfn.reference_value_and_grad(model, full, batch)
    want = ref_shards(grads_ref, model, world, rpn, sharding)
    out = run_grad_step(
        full,
        batch,
        model,
        world,
        ranks_per_node=rpn,
        sharding=sharding,
        balance=fixed_balancer(assignment),
        options=opts,
    )
    for rank, (grads, metrics) in enumerate(out):
        odcfn.tree_assert_allclose(grads, want[rank], rtol=RTOL, atol=ATOL, what=f"rank {rank} k={opts.hpz}")
        assert metrics.counters.syncs == 1


def test_hpz_with_staleness_refused_before_any_communication():
    cfg, model, full = tiny()
    batch = odcfn.random_batch([5, 9], cfg.vocab_size, seed=1)

    def fn(rank, tr):
        opts = ScheduleOptions(reshard_after_forward=2)
        state = make_state(full, model, tr, options=opts, staleness=1)
        with pytest.raises(ValueError, match=r"reshard_after_forward=2.*staleness=0"):
            odcfn.train_step(state, batch)
        assert tr.counters.gathers == 0 and tr.collectives.calls.total() == 0
        return True

    assert all(odcfn.run_local(fn, 2, timeout=30))
