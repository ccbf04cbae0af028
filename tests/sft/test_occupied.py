"""Nothing a user has is overwritten unasked: ``odcfn export`` into a non-empty directory and
``odcfn train --init`` over an existing run.toml refuse (naming what is there) unless
``--force``; a rerun of a run already at or past ``train.steps`` says so instead of "final loss
None"."""

from __future__ import annotations

import json

import pytest

from odcfn import cli
from odcfn.data.records import synthetic_records, write_jsonl


def _run(tmp_path, steps=2):
    write_jsonl(tmp_path / "train.jsonl", synthetic_records([5, 9, 7, 12], 40, seed=0))
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        'out_dir = "out"\n[model]\nvocab_size = 40\nd_model = 16\nn_layers = 1\nn_heads = 2\n'
        'n_kv_heads = 1\nd_ff = 16\n[data]\npath = "train.jsonl"\nbatch_size = 2\n'
        f"[train]\nsteps = {steps}\nworld_size = 1\n[checkpoint]\nevery = 1\n"
    )
    return cfg


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    assert cli.main(["train", "--config", str(_run(root, steps=3)), "--quiet"]) == 0
    return root


def test_export_refuses_a_non_empty_directory_unless_forced(trained, tmp_path, capsys):
    target = tmp_path / "base-model"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"another model")
    (target / "config.json").write_text("{}")
    assert cli.main(["export", str(trained / "out"), str(target)]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "config.json, model.safetensors" in err and "--force" in err
    assert (target / "model.safetensors").read_bytes() == b"another model"  # untouched
    assert cli.main(["export", str(trained / "out"), str(target), "--force"]) == 0
    assert json.loads((target / "config.json").read_text())  # our export now
    # a new or empty directory needs no --force
    (tmp_path / "empty").mkdir()
    assert cli.main(["export", str(trained / "out"), str(tmp_path / "empty")]) == 0
    assert cli.main(["export", str(trained / "out"), str(tmp_path / "new")]) == 0


def test_init_refuses_to_overwrite_an_edited_config_unless_forced(tmp_path, capsys):
    assert cli.main(["train", "--init", str(tmp_path)]) == 0
    edited = (tmp_path / "run.toml").read_text().replace("steps = 12", "steps = 99")
    (tmp_path / "run.toml").write_text(edited)
    assert cli.main(["train", "--init", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "run.toml") in err and "--force" in err
    assert (tmp_path / "run.toml").read_text() == edited
    assert cli.main(["train", "--init", str(tmp_path), "--force"]) == 0
    assert "steps = 12" in (tmp_path / "run.toml").read_text()


@pytest.mark.parametrize("steps", [2, 3])
def test_rerun_of_a_finished_run_says_it_is_already_there(trained, steps, capsys):
    metrics = (trained / "out" / "metrics.jsonl").read_text()
    assert cli.main(["train", "--config", str(trained / "run.toml"), "--quiet", "--steps", str(steps)]) == 0
    out = capsys.readouterr().out
    assert "final loss None" not in out
    where = "past" if steps < 3 else "at"
    assert f"nothing to train: {trained / 'out'} is already at step 3" in out
    assert f"{where} the requested train.steps = {steps}" in out and "--steps N with N > 3" in out
    assert (trained / "out" / "metrics.jsonl").read_text() == metrics  # the log is not cut back
    assert (trained / "out" / "checkpoints" / "step-00000003").is_dir()
