"""Hostile checkpoints: corrupted, edited or reordered files fail loudly naming the path; a save
that dies (a rank killed, a rank with bad input) never destroys the committed checkpoint, leaves
no staging files, and is noticed by the peers at once rather than at the save timeout."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from safetensors.torch import save_file

import odcfn
from odcfn.checkpoint.sharded import CheckpointError, read_manifest, read_shards, write_shards
from odcfn.models import QwenConfig, init_params, qwen_model
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture

CFG = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
MODEL = qwen_model(CFG)
FULL = init_params(CFG, seed=3)
TIMEOUT = 60.0  # the save timeout; a death must be noticed far sooner


def _save2(path, step=1, **kw):
    def fn(rank, tr):
        mesh = odcfn.Mesh(2, rank)
        p = odcfn.shard(FULL, MODEL, mesh)
        write_shards(path, p, odcfn.sgd(0.1, momentum=0.9).init(p), step, model=MODEL, mesh=mesh, **kw)

    odcfn.run_local(fn, 2)


def _edit(path, fn):
    m = path / "manifest.json"
    doc = json.loads(m.read_text())
    fn(doc)
    m.write_text(json.dumps(doc))


def _load(path, rank=0, world=2):
    return read_shards(path, model=MODEL, mesh=odcfn.Mesh(world, rank))


def test_a_flipped_byte_fails_the_sha256_naming_the_file(tmp_path):
    _save2(tmp_path / "ck")
    f = tmp_path / "ck" / "rank-00001.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01  # inside tensor data: safetensors alone would load it silently
    f.write_bytes(bytes(data))
    _load(tmp_path / "ck", rank=0)  # rank 0 of the same mesh never reads rank 1's file
    with pytest.raises(CheckpointError, match=r"ck.*rank-00001.safetensors does not match the sha256"):
        _load(tmp_path / "ck", rank=1)
    with pytest.raises(CheckpointError, match="sha256"):
        _load(tmp_path / "ck", rank=0, world=1)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d["files"].reverse(), r"files\[0\] is 'rank-00001.safetensors' of rank 1"),
        (lambda d: d["files"].pop(), "lists 1 files for 2 shards"),
        (lambda d: d["units"]["embed"].update(shard_size=d["units"]["embed"]["shard_size"] + 8),
         r"/embed has shape \(\d+,\), the manifest's shard_size is"),
        (lambda d: d["units"]["embed"].update(shard_size=1), "cannot hold numel"),
        (lambda d: d["files"][1].update(rank=0), r"files\[1\] is 'rank-00001.safetensors' of rank 0"),
        (lambda d: d.update(step=7), "is rank 0's of step 1, the manifest says rank 0 of step 7"),
        (lambda d: d.pop("tree"), "'tree'"),
    ],
    ids=["permuted", "shortened", "shard_size", "shard_size_small", "rank", "step", "no_tree"],
)
def test_an_edited_manifest_is_refused_naming_the_path(tmp_path, edit, match):
    _save2(tmp_path / "ck")
    _edit(tmp_path / "ck", edit)
    with pytest.raises(CheckpointError, match=match) as e:
        _load(tmp_path / "ck", rank=0, world=1)
    assert str(tmp_path / "ck") in str(e.value)


def test_a_broken_manifest_names_its_path(tmp_path):
    _save2(tmp_path / "ck")
    (tmp_path / "ck" / "manifest.json").write_text('{"format": "odcfn-checkpoint", ')
    with pytest.raises(CheckpointError, match=r"ck: cannot read manifest.json"):
        read_manifest(tmp_path / "ck")
    (tmp_path / "ck" / "manifest.json").write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointError, match="ck: cannot read manifest.json"):
        _load(tmp_path / "ck")


def test_a_swapped_rank_file_from_another_save_is_refused(tmp_path):
    _save2(tmp_path / "a", step=1)
    _save2(tmp_path / "b", step=1)
    # same step, same mesh, both valid files: the manifest's hash tells them apart
    with torch.no_grad():
        p = odcfn.shard(odcfn.tree_map(lambda t: t + 1, FULL), MODEL, odcfn.Mesh(2, 1))
    target = tmp_path / "b" / "rank-00001.safetensors"
    meta = {"step": "1", "rank": "1", "format": "odcfn-checkpoint"}
    save_file({f"params/{k}": v for k, v in p.items()}, str(target), metadata=meta)
    with pytest.raises(CheckpointError, match="sha256"):
        _load(tmp_path / "b", rank=1)


# --- dying during a save: multi-process -------------------------------------------------------


def dying_save_worker(path: str, victim: int, how: str):
    """Both ranks save step 1, then step 2 over it with overwrite=True; ``victim`` dies (or
    fails) in the middle of the second save. The survivor reports what it saw and how long."""
    import odcfn.checkpoint.sharded as ck

    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    p = odcfn.shard(FULL, MODEL, mesh)
    o = odcfn.sgd(0.1, momentum=0.9).init(p)
    ck.write_shards(path, p, o, 1, model=MODEL, mesh=mesh, timeout=TIMEOUT)
    if mesh.rank == victim:
        if how == "kill" and victim == 0:  # rank 1's file is written, rank 0 dies before the commit
            ck.Staging.commit = lambda self, overwrite: os.kill(os.getpid(), signal.SIGKILL)
        elif how == "kill":  # dies while writing its file
            ck.save_file = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        else:  # bad input on one rank only
            p = {k: v[:-1] for k, v in p.items()}
    t0 = time.monotonic()
    try:
        ck.write_shards(path, {k: v + 1 for k, v in p.items()}, o, 2, model=MODEL, mesh=mesh, timeout=TIMEOUT,
                overwrite=True)
        return "saved", time.monotonic() - t0
    except (CheckpointError, ValueError) as e:
        return f"{type(e).__name__}: {e}", time.monotonic() - t0


@pytest.mark.parametrize("victim, how", [(1, "kill"), (0, "kill"), (1, "bad_input")])
def test_a_rank_dying_mid_save_is_noticed_and_the_old_checkpoint_survives(mp_pool, tmp_path, victim, how):  # noqa: F811
    path = tmp_path / "ck"
    survivor = 1 - victim
    if how == "bad_input":  # the victim raised its own ValueError; the survivor learnt why
        results = mp_pool.run(dying_save_worker, 2, args=(str(path), victim, how), timeout=120)
        assert results[victim][0].startswith("ValueError") and "shape" in results[victim][0]
        outcome, took = results[survivor]
        assert "rank 1 failed: ValueError" in outcome and "shape" in outcome, outcome
    else:
        with pytest.raises(odcfn.LaunchError) as info:
            mp_pool.run(dying_save_worker, 2, args=(str(path), victim, how), timeout=120)
        assert "died" in info.value.errors[victim]
        outcome, took = info.value.results[survivor]
        assert outcome.startswith("CheckpointError") and f"rank {victim} (pid" in outcome, outcome
        assert "died during the save" in outcome
    assert took < TIMEOUT / 4, took  # liveness, not the timeout (measured: 0.28-0.35 s)
    # the committed step-1 checkpoint is intact: loadable, step 1, the original values
    p, _, step = read_shards(path, model=MODEL, mesh=odcfn.Mesh(1))
    assert step == 1
    odcfn.tree_assert_allclose(p, odcfn.shard(FULL, MODEL, odcfn.Mesh(1)), rtol=0, atol=0)
    assert [f.name for f in tmp_path.iterdir()] == ["ck"]  # no staging directory or *.tmp-* left
    assert not [f for f in path.iterdir() if "tmp" in f.name or f.name.startswith(".")]


def test_odcfn_save_of_a_state_refuses_to_overwrite_unless_asked(tmp_path):
    def fn(rank, tr):
        state = odcfn.TrainState.create(params=FULL, model=MODEL, optimizer=odcfn.sgd(0.1), transport=tr)
        odcfn.save(tmp_path / "ck", state)
        with pytest.raises(FileExistsError, match="overwrite=True"):
            odcfn.save(tmp_path / "ck", state.replace(step=5))
        odcfn.save(tmp_path / "ck", state.replace(step=5), overwrite=True)
        return odcfn.load(tmp_path / "ck", state).step

    assert odcfn.run_local(fn, 1) == [5]
