"""Bad input fails clearly and before any communication; ODC syncs exactly once; collective
mode performs exactly the collectives its plan lists."""

from __future__ import annotations

import pytest
import torch

import odcfn
from odcfn.schedule import ScheduleOptions
from tests.util import make_state, run_grad_step, tiny


def _grad_on_all(full, batch, model, world=2, params_fn=None, **kw):
    """Run grad_step on every rank; return the list of transports' counters and the errors."""
    counters = []

    def fn(rank, tr):
        p = full if params_fn is None else params_fn(tr.mesh)
        try:
            odcfn.grad_step(make_state(p, model, tr, **kw), batch)
        finally:
            counters.append(tr.counters.copy())

    with pytest.raises((ValueError, TypeError)) as info:
        odcfn.run_local(fn, world, timeout=10)
    assert all(c == odcfn.Counters() for c in counters), "an error must come before any communication"
    return str(info.value)


def test_sample_longer_than_cap():
    cfg, model, full = tiny()
    batch = odcfn.random_batch([4, 30, 5], cfg.vocab_size)
    msg = _grad_on_all(full, batch, model, max_tokens_per_microbatch=16)
    assert "sample 1 has 30 tokens" in msg and "16" in msg


def test_params_not_matching_model():
    cfg, model, full = tiny()
    batch = odcfn.random_batch([4, 5], cfg.vocab_size)

    def missing(mesh):
        p = odcfn.shard(full, model, mesh)
        del p["layers.1"]
        return p

    assert "missing units ['layers.1']" in _grad_on_all(full, batch, model, params_fn=missing)

    def wrong_size(mesh):
        p = odcfn.shard(full, model, mesh)
        p["head"] = p["head"][:-1]
        return p

    assert "params['head'] has shape" in _grad_on_all(full, batch, model, params_fn=wrong_size)

    def wrong_dtype(mesh):
        p = odcfn.shard(full, model, mesh)
        p["embed"] = p["embed"].double()
        return p

    assert "float64" in _grad_on_all(full, batch, model, params_fn=wrong_dtype)

    def two_devices(mesh):
        p = odcfn.shard(full, model, mesh)
        p["head"] = p["head"].to("meta")
        return p

    assert "all shards of a rank live on one device" in _grad_on_all(
        full, batch, model, params_fn=two_devices
    )


def test_shard_rejects_mismatched_full_params():
    cfg, model, full = tiny()
    bad = odcfn.tree_map(lambda x: x, full)
    bad["layers.0"]["mlp"]["up_proj"]["weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj\.weight has shape \(3, 3\)"):
        odcfn.shard(bad, model, odcfn.Mesh(2))
    bad = odcfn.tree_map(lambda x: x, full)
    del bad["head"]["norm"]
    with pytest.raises(ValueError, match=r"params\['head'\] has leaves"):
        odcfn.shard(bad, model, odcfn.Mesh(2))
    with pytest.raises(ValueError, match="dtype torch.float16"):
        odcfn.shard(odcfn.tree_map(lambda x: x.half(), full), model, odcfn.Mesh(2))


def test_empty_and_malformed_batches():
    with pytest.raises(ValueError, match="Batch is empty"):
        odcfn.Batch(())
    with pytest.raises(ValueError, match="Sample.tokens is empty"):
        odcfn.Sample(torch.zeros(0, dtype=torch.long))
    with pytest.raises(TypeError, match="int64 or int32"):
        odcfn.Sample(torch.zeros(3))
    with pytest.raises(ValueError, match="loss_mask must have"):
        odcfn.Sample(torch.zeros(3, dtype=torch.long), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="no loss tokens"):
        odcfn.Batch((odcfn.Sample(torch.zeros(1, dtype=torch.long)),))
    cfg, model, full = tiny()
    msg = _grad_on_all(full, [1, 2], model)
    assert "batch must be an odcfn.Batch" in msg
    batch = odcfn.random_batch([3, 4], cfg.vocab_size)
    assert "comm must be" in _grad_on_all(full, batch, model, comm="allreduce")
    assert "unknown balancer" in _grad_on_all(full, batch, model, balance="magic")


def test_shards_of_another_mesh_are_refused():
    cfg, model, full = tiny()
    batch = odcfn.random_batch([3, 4], cfg.vocab_size)
    msg = _grad_on_all(full, batch, model, params_fn=lambda mesh: odcfn.shard(full, model, odcfn.Mesh(3, 0)))
    assert "has shape" in msg  # sharded for 3 ranks, the transport serves 2


def test_dead_peer_times_out_instead_of_hanging():
    cfg, model, full = tiny()
    batch = odcfn.random_batch([3, 4, 5], cfg.vocab_size)

    def fn(rank, tr):
        if rank == 1:
            return None  # never publishes, never syncs
        odcfn.grad_step(make_state(full, model, tr), batch)

    with pytest.raises(odcfn.TransportError, match="timed out after 1.0s"):
        odcfn.run_local(fn, 2, timeout=1.0)


@pytest.mark.parametrize("reshard", [True, False])
def test_exactly_one_sync_in_odc_and_planned_collectives_in_collective(reshard):
    cfg, model, full = tiny()
    batch = odcfn.random_batch([3, 9, 4, 7, 2], cfg.vocab_size, seed=5)
    opts = ScheduleOptions(reshard_after_forward=reshard, prefetch=1)
    for _, m in run_grad_step(full, batch, model, 3, comm="odc", options=opts, max_tokens_per_microbatch=9):
        assert m.counters.syncs == 1 and m.counters.collectives == 0
        assert m.counters.gathers == m.plan.count(odcfn.schedule.Gather) > 0
        assert m.counters.scatters == m.plan.count(odcfn.schedule.ScatterAccumulate) > 0
    out = run_grad_step(full, batch, model, 3, comm="collective", options=opts, max_tokens_per_microbatch=9)
    for _, m in out:
        assert m.counters.syncs == 1
        assert m.counters.collectives == m.plan.num_collectives > 0
        assert m.counters.gathers == m.counters.scatters == 0


def test_train_step_counts_one_sync_per_minibatch_over_several_steps():
    cfg, model, full = tiny()
    batches = [odcfn.random_batch([3, 5, 8], cfg.vocab_size, seed=s) for s in range(3)]

    def fn(rank, tr):
        state = make_state(full, model, tr, odcfn.sgd(0.1))
        for b in batches:
            state, _ = odcfn.train_step(state, b)
        return tr.counters

    for c in odcfn.run_local(fn, 2):
        assert c.syncs == len(batches) and c.collectives == 0
