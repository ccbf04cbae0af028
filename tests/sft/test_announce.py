"""Every ``odcfn train`` run opens by saying what will run: model, what is trained, data, ranks
and backend, checkpointing; and warns when its ranks oversubscribe the cores."""

from __future__ import annotations

from dataclasses import replace

import pytest

from odcfn import cli
from odcfn.sft.announce import cores, oversubscription
from odcfn.sft.config import load_config

RUN = """out_dir = "out"
[model]
vocab_size = 32
d_model = 16
n_layers = 1
n_heads = 2
n_kv_heads = 1
d_ff = 16
tie_embeddings = true
[data]
path = "train.jsonl"
batch_size = 2
[train]
steps = 1
world_size = 1
[checkpoint]
every = 5
"""


def _run(tmp_path, capsys, extra=""):
    rows = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    (tmp_path / "train.jsonl").write_text("".join(f'{{"input_ids": {r}}}\n' for r in rows))
    (tmp_path / "run.toml").write_text(RUN + extra)
    assert cli.main(["train", "--config", str(tmp_path / "run.toml"), "--quiet"]) == 0
    return [x.removeprefix("odcfn train: ") for x in capsys.readouterr().out.splitlines()]


def test_the_first_lines_say_what_will_run(tmp_path, capsys):
    lines = _run(tmp_path, capsys)
    model, trained, data, ranks, ck = lines[:5]
    # embed 32x16 + 1 layer + final norm, tied: no separate head matrix
    assert model.startswith("model: qwen2 (fresh, seed 0): 1 layers, d_model 16, d_ff 16, 2 heads / 1 kv")
    assert "vocab 32, tied embeddings" in model and "parameters" in model
    assert trained.startswith("trained: every parameter (full fine-tuning")
    assert data == (f"data: {tmp_path}/train.jsonl (token records): 3 samples, 12 tokens; minibatch 2 "
                    "samples, 1 steps per epoch, shuffled")
    assert ranks.startswith("ranks: 1 (threads), odc + lb_mini")
    assert ck == f"checkpoints: {tmp_path}/out/checkpoints, every 5 steps and after the last (newest 3 kept)"


def test_a_lora_run_says_rank_and_targets(tmp_path, capsys):
    lines = _run(tmp_path, capsys, '[lora]\nrank = 2\ntargets = ["q_proj", "down_proj"]\n')
    assert lines[1].startswith("trained: LoRA rank 2, alpha 16, dropout 0 on q_proj, down_proj: ")
    assert "the base is frozen" in lines[1]


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_ranks_beyond_the_cores_are_warned_about(tmp_path, backend):
    (tmp_path / "train.jsonl").write_text('{"input_ids": [1, 2]}\n')
    (tmp_path / "run.toml").write_text(RUN)
    cfg = load_config(tmp_path / "run.toml")
    over = replace(cfg, train=replace(cfg.train, world_size=cores() + 1, backend=backend))
    warn = oversubscription(over, threads_per_rank=1)
    assert warn is not None and f"train.world_size = {cores() + 1} ranks ({backend}" in warn
    fits = replace(cfg, train=replace(cfg.train, backend=backend))
    assert oversubscription(fits, threads_per_rank=1) is None
