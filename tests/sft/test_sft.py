"""``odcfn train``: the SFT loop end to end on a small generated JSONL dataset."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import odcfn
from odcfn import cli
from odcfn.checkpoint.sharded import read_manifest, read_shards
from odcfn.data.records import synthetic_records, write_jsonl
from odcfn.models import QwenConfig, qwen_model
from odcfn.sft.config import config_from_dict, load_config

MODEL_TOML = """
[model]
vocab_size = 40
d_model = 16
n_layers = 2
n_heads = 4
n_kv_heads = 2
d_ff = 24
seed = 1
"""
QCFG = QwenConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)


def _setup(tmp_path, *, steps=6, every=3, comm="odc", extra="", world=2, batch=4, n=8):
    write_jsonl(tmp_path / "train.jsonl", synthetic_records([5, 9, 7, 12, 6, 8, 10, 4][:n], 40, seed=0))
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        f'out_dir = "out"\n{MODEL_TOML}\n'
        f'[data]\npath = "train.jsonl"\nbatch_size = {batch}\n'
        f'[train]\nsteps = {steps}\nlr = 1e-2\ncomm = "{comm}"\nworld_size = {world}\n'
        f"max_tokens_per_microbatch = 24\nmax_grad_norm = 1.0\nwarmup_steps = 2\n"
        f"[checkpoint]\nevery = {every}\nkeep = 2\n{extra}"
    )
    return cfg


def _metrics(tmp_path):
    return [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]


def test_train_runs_logs_and_checkpoints(tmp_path, capsys):
    cfg = _setup(tmp_path, steps=6, every=2)
    assert cli.main(["train", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "step      6/6" in out and "odcfn train: steps 0..6 on 2 rank(s) (odc+lb_mini)" in out
    recs = _metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) and r["syncs"] == 1 for r in recs)
    assert [r["epoch"] for r in recs] == [0, 0, 1, 1, 2, 2]  # 8 samples / batch 4
    assert recs[0]["lr"] == pytest.approx(5e-3) and recs[2]["lr"] == pytest.approx(1e-2)  # warmup
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.05  # 3 epochs on 8 samples: it learns
    assert recs[0]["loss_tokens"] < recs[0]["tokens"]  # prompt tokens were masked out
    # every 2 steps, keep = 2: only the two newest committed checkpoints remain
    ckpts = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert ckpts == ["step-00000004", "step-00000006"]
    assert read_manifest(tmp_path / "out" / "checkpoints" / "step-00000006")["step"] == 6


def _final_params(tmp_path, world=2):
    model = qwen_model(QCFG)
    ck = tmp_path / "out" / "checkpoints" / "step-00000006"
    return odcfn.unshard(
        [read_shards(ck, model=model, mesh=odcfn.Mesh(world, r))[0] for r in range(world)],
        model,
        odcfn.Mesh(world),
    )


@pytest.mark.parametrize("comm", ["collective", "odc"])
def test_resume_continues_bit_identically(tmp_path, comm):
    # one microbatch per rank per step (cap 24 > 2 samples): ODC sums are order-independent too
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    cli.main(["train", "--config", str(_setup(a, comm=comm)), "--quiet"])
    cfg_b = _setup(b, comm=comm)
    cli.main(["train", "--config", str(cfg_b), "--steps", "3", "--quiet"])  # "interrupted" at 3
    assert [r["step"] for r in _metrics(b)] == [1, 2, 3]
    cli.main(["train", "--config", str(cfg_b), "--quiet"])  # resumes from step-3
    assert [r["step"] for r in _metrics(b)] == [1, 2, 3, 4, 5, 6]
    ra, rb = _metrics(a), _metrics(b)
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    odcfn.tree_assert_allclose(_final_params(a), _final_params(b), rtol=0, atol=0)


def test_crash_after_last_checkpoint_reruns_without_duplicate_log_lines(tmp_path):
    cfg = _setup(tmp_path, steps=6, every=4)
    cli.main(["train", "--config", str(cfg), "--quiet"])
    losses = [r["loss"] for r in _metrics(tmp_path)]
    # as if the job died after logging step 6 but before committing its checkpoint
    (tmp_path / "out" / "checkpoints" / "step-00000006" / "manifest.json").unlink()
    # leftovers past the resume point (their rank files could pass for the rerun's) are cleared
    # before training; a checkpoint at or before it survives
    stale = tmp_path / "out" / "checkpoints" / "step-00000005"
    stale.mkdir()
    (stale / "rank-00001.safetensors").write_bytes(b"half a file")
    cli.main(["train", "--config", str(cfg), "--quiet"])  # resumes from step 4
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == [
        "step-00000004",
        "step-00000006",
    ]
    recs = _metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in recs] == losses
    # a fresh run starts a fresh log, and no older run's checkpoint can be resumed later
    cli.main(["train", "--config", str(cfg), "--quiet", "--no-resume", "--steps", "2"])
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2]
    assert [p.name for p in (tmp_path / "out" / "checkpoints").iterdir()] == ["step-00000002"]


def test_export_hf_and_json_config(tmp_path):
    toml_cfg = _setup(tmp_path, steps=2, every=2, extra='export_hf = "hf-out"\n', world=1)
    doc = {
        "out_dir": "out",
        "model": {
            "vocab_size": 40,
            "d_model": 16,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "d_ff": 24,
            "seed": 1,
        },
        "data": {"path": "train.jsonl", "batch_size": 4},
        "train": {
            "steps": 2,
            "lr": 1e-2,
            "world_size": 1,
            "max_tokens_per_microbatch": 24,
            "max_grad_norm": 1.0,
            "warmup_steps": 2,
        },
        "checkpoint": {"every": 2, "keep": 2, "export_hf": "hf-out"},
    }
    (tmp_path / "run.json").write_text(json.dumps(doc))
    assert load_config(tmp_path / "run.json") == load_config(toml_cfg)
    assert cli.main(["train", "--config", str(tmp_path / "run.json"), "--quiet"]) == 0
    from odcfn.models import from_hf

    qcfg, params = from_hf(tmp_path / "hf-out")
    assert qcfg == QCFG
    model = qwen_model(QCFG)
    ck = tmp_path / "out" / "checkpoints" / "step-00000002"
    want = odcfn.unshard([read_shards(ck, model=model, mesh=odcfn.Mesh(1))[0]], model, odcfn.Mesh(1))
    odcfn.tree_assert_allclose(params, want, rtol=0, atol=0)


def test_cli_subprocess_end_to_end_bf16_collective(tmp_path):
    """What CI runs: the real console entry point in a fresh interpreter."""
    cfg = _setup(tmp_path, steps=3, every=0, comm="collective")
    text = cfg.read_text().replace("[train]\n", '[train]\ncompute_dtype = "bfloat16"\n')
    cfg.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "odcfn.cli", "train", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "step      3/3" in proc.stdout
    recs = _metrics(tmp_path)
    assert len(recs) == 3 and all(r["collective_bytes"] > 0 and r["gather_bytes"] == 0 for r in recs)
    # every = 0: no periodic checkpoint, the final one only
    assert [p.name for p in (tmp_path / "out" / "checkpoints").iterdir()] == ["step-00000003"]


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"train": {"steps": 1}}, "data.path is required"),
        ({"data": {"path": "x"}}, "train.steps"),
        ({"data": {"path": "x"}, "train": {"steps": 1, "comm": "nccl"}}, "train.comm must be one of"),
        (
            {"data": {"path": "x"}, "train": {"steps": 1, "lr_max": 1}},
            r"unknown keys \['lr_max'\] in \[train\]",
        ),
        ({"data": {"path": "x"}, "train": {"steps": 1}, "optim": {}}, r"unknown top-level keys \['optim'\]"),
        ({"data": {"path": "x"}, "train": {"steps": 1, "world_size": 0}}, "world_size"),
        (
            {"data": {"path": "x"}, "train": {"steps": 1, "weight_decay_mask": "norms"}},
            "train.weight_decay_mask must be one of",
        ),
    ],
)
def test_bad_configs_are_rejected_by_name(doc, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict(doc)


def test_paths_are_relative_to_the_config_file(tmp_path):
    cfg = config_from_dict({"data": {"path": "d.jsonl"}, "train": {"steps": 1}}, base_dir=tmp_path)
    assert cfg.data.path == str(tmp_path / "d.jsonl")
    assert cfg.out_dir == str(tmp_path / "runs/sft")


def test_processes_backend(tmp_path):
    """Same job on 2 spawned processes with the shared-memory transport (odcfn.launch)."""
    cfg = _setup(tmp_path, steps=2, every=2, extra='export_hf = "hf-out"\n')
    cfg.write_text(cfg.read_text().replace("[train]\n", '[train]\nbackend = "processes"\n'))
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2]
    # the final weights came back from both processes and were exported
    from odcfn.models import from_hf

    model = qwen_model(QCFG)
    ck = tmp_path / "out" / "checkpoints" / "step-00000002"
    want = odcfn.unshard(
        [read_shards(ck, model=model, mesh=odcfn.Mesh(2, r))[0] for r in range(2)], model, odcfn.Mesh(2)
    )
    odcfn.tree_assert_allclose(from_hf(tmp_path / "hf-out")[1], want, rtol=0, atol=0)
    # and it matches the in-process run of the same config step for step
    ref = tmp_path / "ref"
    ref.mkdir()
    cli.main(["train", "--config", str(_setup(ref, steps=2, every=2)), "--quiet"])
    for x, y in zip(_metrics(tmp_path), _metrics(ref)):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6)
    assert torch.isfinite(torch.tensor([r["grad_norm"] for r in _metrics(tmp_path)])).all()


def test_init_writes_a_runnable_example(tmp_path, capsys):
    assert cli.main(["train", "--init", str(tmp_path / "ex")]) == 0
    assert (tmp_path / "ex" / "train.jsonl").exists()
    cfg = load_config(tmp_path / "ex" / "run.toml")
    assert cfg.train.balance == "lb_mini" and cfg.train.world_size == 2
    assert cli.main(["train", "--config", str(tmp_path / "ex" / "run.toml"), "--steps", "4"]) == 0
    recs = [json.loads(x) for x in (tmp_path / "ex" / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(0 < r["busy_fraction"] <= 1 for r in recs)
    assert "eta" in capsys.readouterr().out
    assert cli.main(["train"]) == 2  # neither --config nor --init


QWEN3_TIED = replace(QCFG, head_dim=6, qk_norm=True, qkv_bias=False, tie_embeddings=True)


@pytest.mark.parametrize("qcfg", [QCFG, QWEN3_TIED], ids=["qwen2", "qwen3-tied"])
def test_finetune_from_a_local_hf_checkpoint(tmp_path, qcfg):
    """model.hf_path: each rank reads its shards of the HF weights; step 1's loss is the
    single-process loss of those weights on step 0's minibatch; the export is the same family."""
    from odcfn.data.records import batch_at, read_jsonl
    from odcfn.models import from_hf, init_params, to_hf

    params = odcfn.tree_map(lambda t: t + 0.01 * torch.randn(t.shape), init_params(qcfg, seed=5))
    to_hf(tmp_path / "base", params, qcfg, max_shard_bytes=5000)
    cfg = _setup(tmp_path, steps=2, every=0, extra='export_hf = "hf-out"\n')
    text = cfg.read_text()
    cfg.write_text(
        text[: text.index("[model]")] + '[model]\nhf_path = "base"\n' + text[text.index("[data]") :]
    )
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    first = _metrics(tmp_path)[0]["loss"]
    batch = batch_at(read_jsonl(tmp_path / "train.jsonl"), 0, 4)
    want = float(odcfn.reference_loss(qwen_model(qcfg), from_hf(tmp_path / "base")[1], batch))
    assert first == pytest.approx(want, rel=1e-5)
    out_cfg, out = from_hf(tmp_path / "hf-out")
    assert out_cfg == qcfg and ("lm_head" in out["head"]) == (not qcfg.tie_embeddings)


def test_tensorboard_scalars_when_asked(tmp_path, monkeypatch, capsys):
    """log.tensorboard = true writes every numeric metric per step (a stand-in SummaryWriter
    records the calls, so the test runs whether or not tensorboard is installed)."""
    import types

    calls = []

    class Writer:
        def __init__(self, logdir):
            calls.append(("init", logdir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def add_text(self, tag, text, step):  # the run's config, once
            calls.append(("text", tag))

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    cfg = _setup(tmp_path, steps=2, every=0, world=1, extra="[log]\ntensorboard = true\n")
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    assert calls[0] == ("init", str(tmp_path / "out" / "tensorboard")) and calls[-1] == ("close",)
    losses = [(step, v) for tag, v, step in (c for c in calls if len(c) == 3) if tag == "loss"]
    assert losses == [(r["step"], r["loss"]) for r in _metrics(tmp_path)]

    assert ("text", "config") in calls

    # not installed: refused when the config is checked, saying how to install it (no silent fallback)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert cli.main(["train", "--config", str(cfg), "--quiet", "--no-resume"]) == 2
    err = capsys.readouterr().err
    assert "log.tensorboard asks for tensorboard" in err and "pip install 'odcfn[tensorboard]'" in err


def test_unexportable_model_is_refused_before_training(tmp_path):
    cfg = _setup(tmp_path, steps=2, every=0, extra='export_hf = "hf-out"\n')
    cfg.write_text(cfg.read_text().replace("[model]\n", "[model]\nqk_norm = true\n"))  # + q/k/v bias
    with pytest.raises(ValueError, match="qkv_bias == o_bias"):
        cli.main(["--debug", "train", "--config", str(cfg), "--quiet"])
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
