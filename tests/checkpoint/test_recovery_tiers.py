"""The memory tier and the choice of a restart's snapshot: write beside the last, verify, switch
the pointer, prune behind it; a snapshot that fails verification is skipped for the previous
good one with a warning naming the file; a run resumed on another number of ranks continues
the same loss trajectory (resharded on load)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

import odcfn
from odcfn.checkpoint.memory_tier import MemoryTier, committed, newest_verified, remove_stale
from odcfn.data.records import synthetic_records, write_jsonl
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.sft.config import config_from_dict
from odcfn.sft.loop import run

CFG = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)


def _save_steps(tier: MemoryTier, steps, W=2):
    model = qwen_model(CFG)

    def fn(rank, tr):
        state = odcfn.TrainState.create(params=init_params(CFG, seed=0), model=model,
                                        optimizer=odcfn.adamw(1e-2), transport=tr)
        for s in steps:
            odcfn.save(tier.path(s), state.replace(step=s))
            if rank == 0:
                tier.publish(tier.path(s))
        return True

    odcfn.run_local(fn, W)


def test_publish_switches_the_pointer_and_keeps_the_previous_snapshot(tmp_path, monkeypatch):
    monkeypatch.setenv("ODCFN_SHM_DIR", str(tmp_path / "shm"))
    tier = MemoryTier(tmp_path / "run")
    assert tier.root.parent == tmp_path / "shm" and tier.root.name.startswith("odcfn-snap-")
    _save_steps(tier, [1, 2])
    assert tier.current() == tier.path(2) and [s for s, _ in committed(tier.root)] == [2, 1]
    _save_steps(tier, [3])
    # the pointer's previous target stays until the next switch; older ones go
    assert tier.current() == tier.path(3) and [s for s, _ in committed(tier.root)] == [3, 2]
    tier.cleanup()
    assert not tier.root.exists()


def test_a_snapshot_failing_verification_is_skipped_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("ODCFN_SHM_DIR", str(tmp_path / "shm"))
    tier = MemoryTier(tmp_path / "run")
    _save_steps(tier, [4, 5])
    disk = tmp_path / "disk"
    disk.mkdir()
    f = tier.path(5) / "rank-00001.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF  # a flipped bit in the data
    f.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match=r"skipping snapshot .*step-00000005.*rank-00001\.safetensors"):
        assert newest_verified([tier.root, disk]) == tier.path(4)
    (tier.path(4) / "rank-00000.safetensors").unlink()
    (tier.path(5) / "manifest.json").unlink()  # uncommitted: not even a candidate
    with pytest.warns(UserWarning, match=r"step-00000004.*rank-00000\.safetensors is missing"):
        assert newest_verified([tier.root, disk]) is None
    (tier.root / ".step-00000009.tmp-abc").mkdir()
    remove_stale(tier.root, 4)
    assert sorted(p.name for p in tier.root.iterdir()) == ["CURRENT", "step-00000004"]


def _config(tmp_path, **train):
    lengths = [5, 9, 7, 12, 6, 8, 10, 4, 11, 5, 7, 9]
    write_jsonl(tmp_path / "train.jsonl", synthetic_records(lengths, 40, seed=0))
    doc = {
        "out_dir": str(tmp_path / "out"),
        "model": {"vocab_size": 40, "d_model": 16, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 24},
        "data": {"path": str(tmp_path / "train.jsonl"), "batch_size": 6},
        # deterministic: the first steps of two runs are compared bit for bit
        "train": {
            "steps": 8, "lr": 1e-2, "world_size": 2, "max_tokens_per_microbatch": 20, "deterministic": True,
            **train,
        },
        "checkpoint": {"every": 4, "memory_every": 1},
        "log": {"progress": False},
    }
    return config_from_dict(doc)


@pytest.mark.parametrize("W_new", [1, 3])
def test_a_run_resumed_on_another_number_of_ranks_continues_the_trajectory(tmp_path, monkeypatch, W_new):
    monkeypatch.setenv("ODCFN_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = _config(tmp_path / "a")
    run(whole)
    part = _config(tmp_path / "b")
    run(replace(part, train=replace(part.train, steps=4)))
    out = run(replace(part, train=replace(part.train, world_size=W_new)))
    assert out[0]["start_step"] == 4 and len(out) == W_new
    la = [json.loads(x) for x in whole.metrics_path.read_text().splitlines()]
    lb = [json.loads(x) for x in part.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in lb] == list(range(1, 9))  # one run's log: nothing lost or doubled
    assert [r["loss"] for r in la[:4]] == [r["loss"] for r in lb[:4]]
    torch.testing.assert_close([r["loss"] for r in lb[4:]], [r["loss"] for r in la[4:]], rtol=1e-5, atol=0)
    assert not any((tmp_path / "shm").iterdir())  # the memory tier is gone at a normal end


def test_resaving_a_path_whose_save_a_kill_interrupted_works(tmp_path, monkeypatch):
    """The previous incarnation (restart count 0) was killed mid-save: its staging directory
    is left with a dead rank's liveness file and the survivor's abort note (the launcher killed
    the survivor before it could remove the directory). The restarted job saves the same path."""
    import socket

    from odcfn.checkpoint import sharded

    root = tmp_path / "step-00000003"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setattr(sharded, "_SAVES", {})
    old = root.with_name(f".{root.name}.tmp-{sharded.attempt_id(root, 0, 3)}")
    old.mkdir(parents=True)
    (old / ".alive-1").write_text(f"{socket.gethostname()} 999999999")  # a pid that is gone
    (old / ".abort-0").write_text("CheckpointError: rank 1 (pid 999999999) died during the save")
    monkeypatch.setattr(sharded, "_SAVES", {})  # a new process
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    model = qwen_model(CFG)

    def fn(rank, tr):
        state = odcfn.TrainState.create(params=init_params(CFG, seed=0), model=model,
                                        optimizer=odcfn.sgd(0.1), transport=tr, step=3)
        return odcfn.save(root, state)

    assert odcfn.run_local(fn, 2) == [root, root]
    assert sorted(p.name for p in tmp_path.iterdir()) == [root.name]  # the leftover is gone


def test_a_run_saved_on_three_ranks_continues_on_two_from_the_same_bytes(tmp_path, monkeypatch):
    """Saved at W=3, resumed at W=2: the W=2 shards read from the W=3 checkpoint hold exactly the
    bytes the three rank files hold (params and AdamW moments; read back with safetensors
    alone), the run continues at the checkpoint's step with finite losses along the W=3 run's
    trajectory (another summation order: within float tolerance), and its log reads as one run."""
    from safetensors.torch import load_file

    from odcfn.checkpoint.sharded import read_manifest, read_shards
    from odcfn.sft.config import model_config
    from odcfn.sharding import make_layout

    monkeypatch.setenv("ODCFN_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = _config(tmp_path / "a", world_size=3)
    run(whole)
    part = _config(tmp_path / "b", world_size=3)
    run(replace(part, train=replace(part.train, steps=5)))
    ck = part.checkpoint_dir / "step-00000005"
    assert read_manifest(ck)["mesh"]["world_size"] == 3
    model = qwen_model(model_config(part))
    files = [load_file(ck / f"rank-{r:05d}.safetensors") for r in range(3)]
    two = [read_shards(ck, model=model, mesh=odcfn.Mesh(2, r)) for r in range(2)]
    assert [step for _, _, step in two] == [5, 5] and all(o["count"] == 5 for _, o, _ in two)
    for u in make_layout(model, odcfn.Mesh(2)).units:
        for key, pick in [("params", lambda p, o: p), ("opt_state/mu", lambda p, o: o["mu"]),
                          ("opt_state/nu", lambda p, o: o["nu"])]:
            saved = torch.cat([f[f"{key}/{u.name}"] for f in files])[: u.numel]
            resharded = torch.cat([pick(p, o)[u.name] for p, o, _ in two])
            assert torch.equal(resharded[: u.numel], saved), (key, u.name)
            assert not resharded[u.numel :].any()  # the new padding is zeros
    out = run(replace(part, train=replace(part.train, world_size=2)))
    assert len(out) == 2 and out[0]["start_step"] == 5 and out[0]["resumed_from"] == str(ck)
    la = [json.loads(x) for x in whole.metrics_path.read_text().splitlines()]
    lb = [json.loads(x) for x in part.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in lb] == list(range(1, 9))  # nothing lost or doubled
    assert [r["loss"] for r in lb[:5]] == [r["loss"] for r in la[:5]]
    assert all(math.isfinite(r["loss"]) for r in lb[5:])
    torch.testing.assert_close([r["loss"] for r in lb[5:]], [r["loss"] for r in la[5:]], rtol=1e-5, atol=0)
    final = read_manifest(part.checkpoint_dir / "step-00000008")
    assert final["step"] == 8 and final["mesh"]["world_size"] == 2
