"""Work stealing in the real runtime: in-process ranks and shared-memory processes run every
sample once, match the single-process reference, and take work from a slow rank."""

from __future__ import annotations

import pytest

from odcfn.models.slow import slow_model
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture (multi-process test)
from tests.util import make_state

# --- work stealing in the real runtime (in-process ranks) ------------------------------------


def _ws_grad_steps(world, lengths, steps=2, ranks_per_node=None, sharding="full", slowdown_of=None, **kw):
    import torch

    import odcfn
    from odcfn.models import QwenConfig, init_params, qwen_model

    cfg = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
    model, full = qwen_model(cfg), init_params(cfg, seed=0)
    batch = odcfn.random_batch(lengths, cfg.vocab_size, seed=1)

    def fn(rank, tr):
        torch.set_num_threads(1)
        mesh = odcfn.Mesh(world, rank, ranks_per_node, sharding)
        p = odcfn.shard(full, model, mesh)
        out = []
        mine = model if slowdown_of is None else slow_model(model, slowdown_of(rank))  # per thread
        for _ in range(steps):  # the counters are fresh every step
            g, m = odcfn.grad_step(make_state(p, mine, tr, **kw), batch)
            out.append(({k: v.clone() for k, v in g.items()}, m))
        return out

    run = odcfn.run_local(fn, world, ranks_per_node=ranks_per_node, sharding=sharding, timeout=30)
    return model, full, batch, run


@pytest.mark.parametrize(
    "world, lengths, rpn, sharding",
    [
        (1, [5, 9, 3, 7, 4, 11, 2], None, "full"),
        (3, [5, 9, 3, 7, 4, 11, 2], None, "full"),
        (4, [6, 10], 2, "hybrid"),  # two ranks never get a sample: they still meet at the sync
    ],
)
@pytest.mark.parametrize("packed", [False, True])
def test_runtime_work_stealing_matches_the_reference_and_runs_each_sample_once(
    world, lengths, rpn, sharding, packed
):
    import math

    import odcfn

    # packed: LB-Mini's microbatches and no helping; else the default (the tail sample by sample)
    packed_lists = odcfn.WorkStealing(split_cost=math.inf, split_tail=0.0, tolerance=None)
    policy = packed_lists if packed else "work_stealing"
    model, full, batch, out = _ws_grad_steps(
        world,
        lengths,
        ranks_per_node=rpn,
        sharding=sharding,
        balance=policy,
        max_tokens_per_microbatch=12,
    )
    loss_ref, g_ref = odcfn.reference_value_and_grad(model, full, batch)
    mesh = odcfn.Mesh(world, 0, rpn, sharding)
    for step in range(2):
        plans = [out[r][step][1].plan for r in range(world)]
        claimed = sorted(i for p in plans for mb in p.microbatches for i in mb)
        assert claimed == list(range(len(lengths))), "every sample exactly once"
        for r in range(world):
            g, m = out[r][step]
            # nothing collective but the replica all-reduce of hybrid sharding, inside the sync
            assert m.counters.syncs == 1 and m.counters.collectives == (sharding == "hybrid")
            assert m.loss == pytest.approx(float(loss_ref), rel=1e-5)
            assert m.plan.count(type(m.plan.steps[-1])) == 1  # one Sync, at the end
            odcfn.tree_assert_allclose(g, odcfn.shard(g_ref, model, mesh.with_rank(r)), rtol=1e-5, atol=1e-7)
            fwd = {e.mb for e in m.events if e.kind == "forward"}
            assert fwd == set(range(len(m.plan.microbatches)))


def test_runtime_work_stealing_takes_work_from_a_slow_rank():
    """Rank 1 computes 8x slower: rank 0 helps with rank 1's list (or steals it once its own is
    done), the slow rank runs less than its LB-Mini list, and the gradients do not change."""
    import odcfn
    from odcfn.schedule import steal_plan

    lengths = [9, 8, 7, 6, 5, 4, 3, 2]
    kw = dict(balance="work_stealing", max_tokens_per_microbatch=9)

    def slow(rank: int) -> float:
        return 8.0 if rank == 1 else 1.0

    model, full, batch, out = _ws_grad_steps(2, lengths, steps=1, slowdown_of=slow, **kw)
    own = steal_plan(lengths, 2, 9, cost=odcfn.schedule.cost.DEFAULT_COST).lists
    ran = [{i for mb in out[r][0][1].plan.microbatches for i in mb} for r in range(2)]
    planned = [{i for mb in own[r] for i in mb} for r in range(2)]
    assert ran[0] | ran[1] == set(range(len(lengths))) and not ran[0] & ran[1]
    assert ran[0] & planned[1], "rank 0 ran some of the slow rank's samples"
    assert ran[1] < planned[1]
    loss_ref, g_ref = odcfn.reference_value_and_grad(model, full, batch)
    for r in range(2):
        g, m = out[r][0]
        assert m.loss == pytest.approx(float(loss_ref), rel=1e-5)
        odcfn.tree_assert_allclose(g, odcfn.shard(g_ref, model, odcfn.Mesh(2, r)), rtol=1e-5, atol=1e-7)


def test_runtime_work_stealing_rejects_collective_and_oversized_samples():
    with pytest.raises(ValueError, match="work_stealing.*comm='odc'"):
        _ws_grad_steps(2, [3, 4], steps=1, balance="work_stealing", comm="collective")
    with pytest.raises(ValueError, match="sample 1 has 9 tokens"):
        _ws_grad_steps(2, [3, 9], steps=1, balance="work_stealing", max_tokens_per_microbatch=8)
    import odcfn

    def too_few_counters(rank, tr):
        tr.max_counters = 5  # a transport with room for fewer counters than 2 ranks x 3 samples need
        mesh = odcfn.Mesh(2, rank)
        p = odcfn.shard(init_params(cfg, seed=0), model, mesh)
        batch = odcfn.random_batch([3, 4, 5], cfg.vocab_size, seed=1)
        before = tr.counters.copy()
        with pytest.raises(ValueError, match="needs 11 shared counters.*has 5"):
            odcfn.grad_step(make_state(p, model, tr, balance="work_stealing"), batch)
        return (tr.counters - before).as_dict()

    from odcfn.models import QwenConfig, init_params, qwen_model

    cfg = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
    model = qwen_model(cfg)
    assert all(not any(c.values()) for c in odcfn.run_local(too_few_counters, 2, timeout=30))
    with pytest.raises(ValueError, match="WorkStealing.tolerance"):
        odcfn.WorkStealing(tolerance=-1.0)
    with pytest.raises(ValueError, match="WorkStealing.split_cost"):
        odcfn.WorkStealing(split_cost=float("nan"))
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="WorkStealing.split_tail"):
            odcfn.WorkStealing(split_tail=bad)


def shm_stealing_worker(lengths, cap, slow_rank):
    """Two work-stealing grad_steps on a ShmTransport (multi-process, counters in /dev/shm)."""
    import odcfn
    from odcfn.models import QwenConfig, init_params, qwen_model
    from odcfn.transport.shm import ShmTransport

    cfg = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
    model, full = qwen_model(cfg), init_params(cfg, seed=0)
    batch = odcfn.random_batch(lengths, cfg.vocab_size, seed=1)
    mesh = odcfn.Mesh.from_env()
    out = []
    with ShmTransport(mesh, timeout=30) as tr:
        for _ in range(2):
            mine = slow_model(model, 2.0 if mesh.rank == slow_rank else 1.0)
            state = make_state(full, mine, tr, balance="work_stealing", max_tokens_per_microbatch=cap)
            g, m = odcfn.grad_step(state, batch)
            grads = {k: v.detach().clone().numpy() for k, v in g.items()}
            out.append((grads, m.loss, m.plan.microbatches, m.counters.syncs))
    return out


def test_shm_work_stealing_across_processes(mp_pool):  # noqa: F811
    import torch

    import odcfn
    from odcfn.models import QwenConfig, init_params, qwen_model

    lengths, world = [5, 9, 3, 7, 4, 11, 2, 6], 2
    out = mp_pool.run(shm_stealing_worker, world, args=(lengths, 12, 1))
    cfg = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
    model, full = qwen_model(cfg), init_params(cfg, seed=0)
    loss, g_ref = odcfn.reference_value_and_grad(model, full, odcfn.random_batch(lengths, 37, seed=1))
    mesh = odcfn.Mesh(world, 0)
    for step in range(2):
        claimed = sorted(i for r in range(world) for mb in out[r][step][2] for i in mb)
        assert claimed == list(range(len(lengths)))
        for r in range(world):
            grads, got_loss, _, syncs = out[r][step]
            assert syncs == 1 and got_loss == pytest.approx(float(loss), rel=1e-5)
            want = odcfn.shard(g_ref, model, mesh.with_rank(r))
            odcfn.tree_assert_allclose(
                {k: torch.from_numpy(v) for k, v in grads.items()}, want, rtol=1e-5, atol=1e-7
            )
