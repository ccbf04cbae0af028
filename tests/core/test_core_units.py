"""Pytree helpers, layouts, the model's math and the plan compiler, each on its own."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import odcfn
from odcfn.batch import pack
from odcfn.models import QwenModule
from odcfn.schedule import (
    AllGather,
    Backward,
    Forward,
    Gather,
    ReduceScatter,
    Release,
    ScatterAccumulate,
    ScheduleOptions,
    Sync,
    compile_plan,
    round_robin,
)
from tests.util import tiny


def test_tree_assert_allclose_names_the_key_path():
    a = {"layers.0": {"mlp": {"up": torch.zeros(3)}}, "head": torch.ones(2)}
    b = {"layers.0": {"mlp": {"up": torch.tensor([0.0, 1.0, 0.0])}}, "head": torch.ones(2)}
    assert odcfn.tree_allclose(a, a)
    assert not odcfn.tree_allclose(a, b)
    with pytest.raises(AssertionError, match=r"layers\.0\.mlp\.up"):
        odcfn.tree_assert_allclose(a, b)
    with pytest.raises(AssertionError, match="only in first"):
        odcfn.tree_assert_allclose({"x": torch.ones(1), "y": torch.ones(1)}, {"x": torch.ones(1)})


@settings(max_examples=30)
@given(world=st.integers(1, 7), rpn_divides=st.booleans(), seed=st.integers(0, 100))
def test_shard_unshard_roundtrip_for_any_world_size(world, rpn_divides, seed):
    cfg, model, full = tiny(seed=seed)
    rpn = next((d for d in range(2, world) if world % d == 0), None) if rpn_divides else None
    mesh = odcfn.Mesh(world, 0, rpn, "hybrid" if rpn else "full")
    layout = odcfn.make_layout(model, mesh)
    shards = [odcfn.shard(full, model, mesh.with_rank(r)) for r in mesh.shard_group]
    for u in layout.units:
        assert all(s[u.name].numel() == u.shard_size for s in shards)
        assert u.padded_numel % mesh.shard_count == 0 and u.padded_numel - u.numel < mesh.shard_count
        tail = torch.cat([s[u.name] for s in shards])[u.numel :]
        assert torch.all(tail == 0), "padding must be zero"
    odcfn.tree_assert_allclose(odcfn.unshard(shards, model, mesh), full, rtol=0, atol=0)
    if rpn:  # replicas across nodes hold identical shards
        other = mesh.with_rank(mesh.rank + rpn)
        odcfn.tree_assert_allclose(odcfn.shard(full, model, other), shards[0], rtol=0, atol=0)


def test_mesh_groups():
    m = odcfn.Mesh(6, 4, ranks_per_node=3, sharding="hybrid")
    assert m.shard_group == (3, 4, 5) and m.replica_group == (1, 4) and m.shard_index == 1
    f = odcfn.Mesh(6, 4, ranks_per_node=3)
    assert f.shard_group == tuple(range(6)) and f.replica_group == (4,)
    with pytest.raises(ValueError, match="ranks_per_node"):
        odcfn.Mesh(6, 0, ranks_per_node=4)
    with pytest.raises(ValueError, match="rank=6"):
        odcfn.Mesh(6, 6)


def test_mesh_from_torchrun_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert odcfn.Mesh.from_env("hybrid") == odcfn.Mesh(4, 3, 2, "hybrid")


def test_packed_attention_never_crosses_samples():
    cfg, model, full = tiny()
    batch = odcfn.random_batch([5, 9, 3], cfg.vocab_size, seed=1)
    packed = model.apply(full, pack(batch, [0, 1, 2]))
    separate = sum(model.apply(full, pack(batch, [i])) for i in range(3))
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-6)
    # and changing one sample's tokens leaves the others' losses untouched
    new = odcfn.Sample(torch.randint(0, cfg.vocab_size, (9,)))
    other = odcfn.Batch((batch.samples[0], new, batch.samples[2]))
    a, b = pack(batch, [0, 1, 2]), pack(other, [0, 1, 2])
    ya = model.units[0].fwd(full["embed"], None, a)
    yb = model.units[0].fwd(full["embed"], None, b)
    for u in model.units[1:-1]:
        ya, yb = u.fwd(full[u.name], ya, a), u.fwd(full[u.name], yb, b)
    torch.testing.assert_close(ya[:5], yb[:5])
    torch.testing.assert_close(ya[14:], yb[14:])


def test_loss_mask_selects_targets():
    cfg, model, full = tiny()
    toks = torch.randint(0, cfg.vocab_size, (8,))
    mask = torch.tensor([0, 0, 0, 1, 1, 0, 1, 0], dtype=torch.bool)
    b = odcfn.Batch((odcfn.Sample(toks, mask),))
    assert b.num_loss_tokens == 3
    logits_free = model.apply(full, pack(b, [0]))
    full_mask = odcfn.Batch((odcfn.Sample(toks),))
    assert float(logits_free) < float(model.apply(full, pack(full_mask, [0])))


def test_module_mirror_matches_pure_model():
    cfg, model, full = tiny()
    mod = QwenModule(cfg)
    mod.load_params(full)
    names = {n for n, _ in mod.named_parameters()}
    want = {f"{u}.{p}" for u, sub in full.items() for p, _ in odcfn.tree.tree_named_leaves(sub)}
    assert names == want
    batch = odcfn.random_batch([6, 4], cfg.vocab_size, seed=2)
    mb = pack(batch, [0, 1])
    torch.testing.assert_close(mod(mb), model.apply(full, mb))


# --- plans --------------------------------------------------------------------------------

UNITS = ("embed", "layers.0", "layers.1", "head")


def _check_buffers(plan):
    """Every compute step finds its unit gathered (and not released since)."""
    live = set()
    for s in plan.steps:
        if isinstance(s, (Gather, AllGather)):
            assert s.unit not in live, f"{s} gathers a live buffer"
            live.add(s.unit)
        elif isinstance(s, Release):
            live.discard(s.unit)
        elif isinstance(s, (Forward, Backward)):
            assert s.unit in live, f"{s} runs without its parameters"
    assert not live, f"buffers left live: {live}"


@settings(max_examples=40)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=9),
    world=st.integers(1, 4),
    prefetch=st.integers(0, 3),
    reshard=st.booleans(),
)
def test_plans_are_well_formed(lengths, world, prefetch, reshard):
    a = round_robin(lengths, world, 10)
    opts = ScheduleOptions(prefetch=prefetch, reshard_after_forward=reshard)
    odc = [compile_plan(UNITS, a, r, "odc", opts) for r in range(world)]
    col = [compile_plan(UNITS, a, r, "collective", opts) for r in range(world)]
    for p in odc + col:
        _check_buffers(p)
        assert p.count(Sync) == 1 and isinstance(p.steps[-1], Sync)
    for p, mbs in zip(odc, a):
        assert p.num_collectives == 0 and len(p.microbatches) == len(mbs)
        assert p.count(Forward) == p.count(Backward) == len(mbs) * len(UNITS)
        assert p.count(ScatterAccumulate) == len(mbs) * len(UNITS)
    # collective: identical collective sequences on every rank, padded with empty microbatches
    seqs = [[s for s in p.steps if isinstance(s, (AllGather, ReduceScatter))] for p in col]
    assert all(s == seqs[0] for s in seqs)
    n = max(len(m) for m in a)
    assert all(len(p.microbatches) == n for p in col)
    gathers_per_mb = 2 * len(UNITS) - 1 if reshard else len(UNITS)
    # the first unit stays gathered from one microbatch's backward into the next one's forward
    assert col[0].num_collectives == n * (len(UNITS) + gathers_per_mb) - (n - 1)


def test_prefetch_moves_gathers_ahead():
    a = (((0,),),)
    p0 = compile_plan(UNITS, a, 0, "odc", ScheduleOptions(prefetch=0))
    p2 = compile_plan(UNITS, a, 0, "odc", ScheduleOptions(prefetch=2))

    def lead(plan, unit):  # compute steps between the first gather of unit and its Forward
        i = plan.steps.index(Gather(unit))
        j = next(k for k, s in enumerate(plan.steps) if isinstance(s, Forward) and s.unit == unit)
        return sum(isinstance(s, (Forward, Backward)) for s in plan.steps[i:j])

    assert [lead(p0, u) for u in UNITS] == [0, 0, 0, 0]
    assert [lead(p2, u) for u in UNITS] == [0, 1, 2, 2]
    text = str(p2)
    assert "Plan(rank=0, comm=odc" in text and "Gather" in text and "Sync" in text


def test_remat_and_reshard_options_in_plan():
    a = (((0, 1),),)
    p = compile_plan(UNITS, a, 0, "odc", ScheduleOptions(reshard_after_forward=False, remat={"layers.0"}))
    assert p.count(Gather) == len(UNITS)  # gathered once, kept through backward
    assert [s.remat for s in p.steps if isinstance(s, Forward)] == [False, True, False, False]
    p = compile_plan(UNITS, a, 0, "odc", ScheduleOptions(reshard_after_forward=True))
    assert p.count(Gather) == 2 * len(UNITS) - 1  # re-gathered for backward, except the head
    with pytest.raises(ValueError, match="nope"):
        compile_plan(UNITS, a, 0, "odc", ScheduleOptions(remat={"nope"}))
