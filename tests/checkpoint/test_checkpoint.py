"""Sharded checkpoints: round trip, reshard on load, bit-identical resume, atomic commit."""

from __future__ import annotations

import json
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import odcfn
from odcfn.checkpoint.sharded import latest, read_manifest, read_shards, write_shards
from odcfn.models import QwenConfig, init_params, qwen_model

# 2 layers, odd sizes so shards need padding for W = 2, 3, 4
CFG = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
MODEL = qwen_model(CFG)
FULL = init_params(CFG, seed=3)


def _batch(step: int) -> odcfn.Batch:
    # two samples: one microbatch per rank at W=2, so ODC accumulation is a commutative
    # a + b into zero and every run is deterministic
    return odcfn.random_batch([6 + step % 3, 5], CFG.vocab_size, seed=100 + step)


def _train(params, opt_state, steps, rank, tr, W, comm="odc"):
    state = odcfn.TrainState.create(
        params=params, opt_state=opt_state, model=MODEL, optimizer=odcfn.adamw(1e-2), transport=tr,
        config=odcfn.StepConfig(comm=comm, balance="round_robin"),
    )
    for step in steps:
        state, _ = odcfn.train_step(state, _batch(step))
    return state.params, state.opt_state


def _trained_state(W: int, steps: int = 2):
    """Per-rank (params, opt_state) after ``steps`` AdamW steps at world size W."""

    def fn(rank, tr):
        p = odcfn.shard(FULL, MODEL, odcfn.Mesh(W, rank))
        return _train(p, odcfn.adamw(1e-2).init(p), range(steps), rank, tr, W)

    return odcfn.run_local(fn, W)


def _full(states, W, which):
    """Unshard the params (which=None) or an optimizer moment ('mu'/'nu') of all ranks."""
    mesh = odcfn.Mesh(W)
    shards = [s[0] if which is None else s[1][which] for s in states]
    return odcfn.unshard(shards, MODEL, mesh)


def _save_all(path, states, W, step, extra=None):
    def fn(rank, tr):
        p, o = states[rank]
        return write_shards(path, p, o, step, model=MODEL, mesh=odcfn.Mesh(W, rank), extra=extra)

    odcfn.run_local(fn, W)


def test_round_trip_same_world_is_exact(tmp_path):
    W = 2
    states = _trained_state(W)
    _save_all(tmp_path / "ck", states, W, step=2, extra={"epoch": 0, "cursor": 4})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "manifest.json",
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    ]
    doc = read_manifest(tmp_path / "ck")
    assert doc["step"] == 2 and doc["extra"] == {"epoch": 0, "cursor": 4}
    for r in range(W):
        p, o, step = read_shards(tmp_path / "ck", model=MODEL, mesh=odcfn.Mesh(W, r))
        assert step == 2
        assert o["count"] == states[r][1]["count"] == 2
        for k in p:
            assert torch.equal(p[k], states[r][0][k]), k
            assert torch.equal(o["mu"][k], states[r][1]["mu"][k]), k
            assert torch.equal(o["nu"][k], states[r][1]["nu"][k]), k


@pytest.mark.parametrize("W_new", [1, 3, 4])
def test_reshard_on_load(tmp_path, W_new):
    W = 2
    states = _trained_state(W, steps=1)
    _save_all(tmp_path / "ck", states, W, step=1)
    loaded = [read_shards(tmp_path / "ck", model=MODEL, mesh=odcfn.Mesh(W_new, r)) for r in range(W_new)]
    for which in (None, "mu", "nu"):
        want = _full(states, W, which)
        got = odcfn.unshard(
            [ld[0] if which is None else ld[1][which] for ld in loaded], MODEL, odcfn.Mesh(W_new)
        )
        odcfn.tree_assert_allclose(got, want, rtol=0, atol=0, what=f"{which or 'params'} W={W_new}")
    # padding of the new layout is zero (the layout's invariant), not stale data
    for r, (p, _, _) in enumerate(loaded):
        layout = odcfn.make_layout(MODEL, odcfn.Mesh(W_new, r))
        for u in layout.units:
            lo, hi = u.shard_range(r)
            if hi > u.numel:
                assert not p[u.name][max(0, u.numel - lo) :].any()


def test_hybrid_mesh_saves_node0_and_loads_full(tmp_path):
    # 4 ranks, 2 per node, hybrid: node 1 replicates node 0's shards and writes nothing
    def fn(rank, tr):
        mesh = odcfn.Mesh(4, rank, 2, "hybrid")
        p = odcfn.shard(FULL, MODEL, mesh)
        p, o = _train_h(p, rank, tr, mesh)
        write_shards(tmp_path / "h", p, o, 1, model=MODEL, mesh=mesh)
        return p

    out = odcfn.run_local(fn, 4, ranks_per_node=2, sharding="hybrid")
    assert sorted(p.name for p in (tmp_path / "h").glob("rank-*")) == [
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    ]
    want = odcfn.unshard(out[:2], MODEL, odcfn.Mesh(4, 0, 2, "hybrid"))
    got = odcfn.unshard(
        [read_shards(tmp_path / "h", model=MODEL, mesh=odcfn.Mesh(3, r))[0] for r in range(3)],
        MODEL,
        odcfn.Mesh(3),
    )
    odcfn.tree_assert_allclose(got, want, rtol=0, atol=0)


def _train_h(p, rank, tr, mesh):
    state = odcfn.TrainState.create(
        params=p, model=MODEL, optimizer=odcfn.sgd(0.1), transport=tr,
        config=odcfn.StepConfig(balance="round_robin"),
    )
    state, _ = odcfn.train_step(state, _batch(0))
    return state.params, state.opt_state


@pytest.mark.parametrize("comm", ["odc", "collective"])
def test_resume_is_bit_identical(tmp_path, comm):
    W, total, cut = 2, 4, 2

    def uninterrupted(rank, tr):
        p = odcfn.shard(FULL, MODEL, odcfn.Mesh(W, rank))
        return _train(p, odcfn.adamw(1e-2).init(p), range(total), rank, tr, W, comm)

    def first_half(rank, tr):
        p = odcfn.shard(FULL, MODEL, odcfn.Mesh(W, rank))
        p, o = _train(p, odcfn.adamw(1e-2).init(p), range(cut), rank, tr, W, comm)
        write_shards(tmp_path / "ck", p, o, cut, model=MODEL, mesh=odcfn.Mesh(W, rank))

    def second_half(rank, tr):  # a fresh "process": state only from disk
        p, o, step = read_shards(tmp_path / "ck", model=MODEL, mesh=odcfn.Mesh(W, rank))
        return _train(p, o, range(step, total), rank, tr, W, comm)

    ref = odcfn.run_local(uninterrupted, W)
    odcfn.run_local(first_half, W)
    got = odcfn.run_local(second_half, W)
    for r in range(W):
        for k in ref[r][0]:
            assert torch.equal(got[r][0][k], ref[r][0][k]), (r, k)
            assert torch.equal(got[r][1]["nu"][k], ref[r][1]["nu"][k]), (r, k)
        assert got[r][1]["count"] == ref[r][1]["count"] == total
    # and training actually moved the weights (the comparison is not vacuous)
    start = odcfn.shard(FULL, MODEL, odcfn.Mesh(W, 0))
    assert not torch.equal(ref[0][0]["embed"], start["embed"])


def test_uncommitted_checkpoint_is_rejected_and_latest_skips_it(tmp_path):
    W = 1
    p = odcfn.shard(FULL, MODEL, odcfn.Mesh(1))
    o = odcfn.sgd(0.1, momentum=0.9).init(p)
    write_shards(tmp_path / "step-1", p, o, 1, model=MODEL, mesh=odcfn.Mesh(W))
    write_shards(tmp_path / "step-3", p, o, 3, model=MODEL, mesh=odcfn.Mesh(W))
    write_shards(tmp_path / "step-2", p, o, 2, model=MODEL, mesh=odcfn.Mesh(W))
    assert latest(tmp_path).name == "step-3"
    (tmp_path / "step-3" / "manifest.json").unlink()  # as if rank 0 died before committing
    assert latest(tmp_path).name == "step-2"
    with pytest.raises(FileNotFoundError, match="not a committed odcfn checkpoint"):
        read_shards(tmp_path / "step-3", model=MODEL, mesh=odcfn.Mesh(W))
    assert latest(tmp_path / "nothing-here") is None
    # no temp files left behind by the atomic writes
    assert not [f for f in tmp_path.rglob(".*tmp*")]


def test_missing_rank_file_times_out_with_a_clear_error(tmp_path):
    p = odcfn.shard(FULL, MODEL, odcfn.Mesh(2, 0))
    with pytest.raises(TimeoutError, match=r"files of ranks \[1\] for step 1"):
        write_shards(tmp_path / "ck", p, {}, 1, model=MODEL, mesh=odcfn.Mesh(2, 0), timeout=0.2)
    assert list(tmp_path.iterdir()) == []  # neither the checkpoint nor its staging directory


def test_overwriting_needs_consent_and_a_failed_overwrite_keeps_the_old_checkpoint(tmp_path):
    """Saving into a committed checkpoint: refused without overwrite=True; with it, a save that
    never completes (rank 1 never writes) leaves the old checkpoint whole and loadable."""
    states = _trained_state(2, steps=1)
    _save_all(tmp_path / "ck", states, 2, step=1)
    before = {f.name: f.read_bytes() for f in (tmp_path / "ck").iterdir()}
    p, o = states[0]
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_shards(tmp_path / "ck", p, o, 2, model=MODEL, mesh=odcfn.Mesh(2, 0))
    with pytest.raises(TimeoutError, match=r"files of ranks \[1\] for step 2"):
        write_shards(
            tmp_path / "ck", p, o, 2, model=MODEL, mesh=odcfn.Mesh(2, 0), timeout=0.2, overwrite=True
        )
    assert {f.name: f.read_bytes() for f in (tmp_path / "ck").iterdir()} == before
    assert read_shards(tmp_path / "ck", model=MODEL, mesh=odcfn.Mesh(2, 0))[2] == 1
    assert [f.name for f in tmp_path.iterdir()] == ["ck"]  # no staging directory left


def test_load_rejects_a_different_model(tmp_path):
    p = odcfn.shard(FULL, MODEL, odcfn.Mesh(1))
    write_shards(tmp_path / "ck", p, {}, 0, model=MODEL, mesh=odcfn.Mesh(1))
    other = qwen_model(QwenConfig(vocab_size=37, d_model=16, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=24))
    with pytest.raises(ValueError, match="units"):
        read_shards(tmp_path / "ck", model=other, mesh=odcfn.Mesh(1))
    wider = qwen_model(QwenConfig(vocab_size=38, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24))
    with pytest.raises(ValueError, match=r"embed\.embed_tokens\.weight.*vocab_size"):
        read_shards(tmp_path / "ck", model=wider, mesh=odcfn.Mesh(1))
    doc = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    doc["format"] = "something-else"
    (tmp_path / "ck" / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="not an odcfn checkpoint"):
        read_shards(tmp_path / "ck", model=MODEL, mesh=odcfn.Mesh(1))


def test_save_rejects_bad_input(tmp_path):
    p = odcfn.shard(FULL, MODEL, odcfn.Mesh(1))
    with pytest.raises(ValueError, match="step"):
        write_shards(tmp_path / "a", p, {}, -1, model=MODEL, mesh=odcfn.Mesh(1))
    with pytest.raises(ValueError, match="shape"):
        write_shards(tmp_path / "b", p, {}, 0, model=MODEL, mesh=odcfn.Mesh(2, 0))
    with pytest.raises(TypeError, match="cannot save a set"):
        write_shards(tmp_path / "c", p, {"odd": {1, 2}}, 0, model=MODEL, mesh=odcfn.Mesh(1))


def test_replicated_tensors_and_nested_state_round_trip(tmp_path):
    p = odcfn.shard(FULL, MODEL, odcfn.Mesh(1))
    state = {
        "count": 7,
        "lr": 0.5,
        "name": "x",
        "flag": None,
        "scale": torch.tensor([2.0, 3.0]),
        "inner": ({"m": {k: v * 2 for k, v in p.items()}}, [1, 2]),
    }
    write_shards(tmp_path / "ck", p, state, 5, model=MODEL, mesh=odcfn.Mesh(1))
    _, o, step = read_shards(tmp_path / "ck", model=MODEL, mesh=odcfn.Mesh(2, 1))
    assert step == 5 and o["count"] == 7 and o["lr"] == 0.5 and o["name"] == "x" and o["flag"] is None
    assert torch.equal(o["scale"], state["scale"])
    assert isinstance(o["inner"], tuple) and o["inner"][1] == [1, 2]
    want = odcfn.shard(odcfn.unshard([state["inner"][0]["m"]], MODEL, odcfn.Mesh(1)), MODEL, odcfn.Mesh(2, 1))
    odcfn.tree_assert_allclose(o["inner"][0]["m"], want, rtol=0, atol=0)


@settings(max_examples=12, deadline=None)
@given(
    w_old=st.integers(1, 5),
    w_new=st.integers(1, 5),
    vocab=st.integers(3, 41),
    layers=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_reshard_property(w_old, w_new, vocab, layers, seed):
    """Any model size, any old and new world size: the loaded shards are exactly the new
    mesh's shards of what was saved (params and a per-unit optimizer moment)."""
    cfg = QwenConfig(vocab_size=vocab, d_model=8, n_layers=layers, n_heads=2, n_kv_heads=1, d_ff=12)
    model = qwen_model(cfg)
    g = torch.Generator().manual_seed(seed)
    full = odcfn.tree_map(lambda t: torch.randn(t.shape, generator=g), init_params(cfg))
    moment = odcfn.tree_map(lambda t: torch.rand(t.shape, generator=g), full)
    with tempfile.TemporaryDirectory() as d:

        def fn(rank, tr):
            mesh = odcfn.Mesh(w_old, rank)
            p, m = odcfn.shard(full, model, mesh), odcfn.shard(moment, model, mesh)
            write_shards(d, p, {"count": 3, "m": m}, 3, model=model, mesh=mesh)

        odcfn.run_local(fn, w_old)
        for r in range(w_new):
            mesh = odcfn.Mesh(w_new, r)
            p, o, step = read_shards(d, model=model, mesh=mesh)
            assert step == 3 and o["count"] == 3
            odcfn.tree_assert_allclose(p, odcfn.shard(full, model, mesh), rtol=0, atol=0)
            odcfn.tree_assert_allclose(o["m"], odcfn.shard(moment, model, mesh), rtol=0, atol=0)


def test_a_replica_rank_that_comes_after_the_commit_finds_the_save_done(tmp_path):
    """Hybrid sharding: node 1's ranks write nothing, so node 0 can commit before a slow replica
    rank even starts its part. That rank must find this very save committed, not a clash with
    an older checkpoint (two torchrun agents under load: the replica's background save raised
    FileExistsError). A different save at the same path is still refused."""
    path = tmp_path / "late"
    mesh2 = odcfn.Mesh(4, 2, 2, "hybrid")  # node 1's first rank: a replica, no file of its own
    opt = odcfn.sgd(0.1)

    def node0(rank, tr):
        mesh = odcfn.Mesh(4, rank, 2, "hybrid")
        p = odcfn.shard(FULL, MODEL, mesh)
        return write_shards(path, p, opt.init(p), 1, model=MODEL, mesh=mesh, timeout=10)

    odcfn.run_local(node0, 2)  # ranks 0 and 1: node 0 commits alone
    assert read_manifest(path)["step"] == 1
    p = odcfn.shard(FULL, MODEL, mesh2)
    assert write_shards(path, p, opt.init(p), 1, model=MODEL, mesh=mesh2, timeout=10) == path
    assert sorted(f.name for f in path.glob("rank-*")) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    with pytest.raises(FileExistsError, match="committed checkpoint"):  # a later save, same path
        write_shards(path, p, opt.init(p), 1, model=MODEL, mesh=mesh2, timeout=10)
