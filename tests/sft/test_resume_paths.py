"""Resume compares what paths hold, not how they were typed: the same run resumed from another
working directory, through an absolute config path, or with its data file moved, continues;
``--resume-anyway`` relaxes changed hyperparameters and data (and says so) but never loads a
checkpoint as another model."""

from __future__ import annotations

import json
import shutil

import pytest

from odcfn import cli
from odcfn.data.records import synthetic_records, write_jsonl

RUN = (
    'out_dir = "out"\n[model]\nvocab_size = 40\nd_model = 16\nn_layers = 1\nn_heads = 2\nn_kv_heads = 1\n'
    'd_ff = 16\n[data]\npath = "train.jsonl"\nbatch_size = 2\n[train]\nsteps = 1\nlr = 1e-2\nworld_size = 1\n'
    "[checkpoint]\nevery = 1\n"
)


def _steps(run_dir):
    return [json.loads(x)["step"] for x in (run_dir / "out" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def run1(tmp_path, monkeypatch):
    """``odcfn train --config run1/run.toml`` run from tmp_path: one step done."""
    d = tmp_path / "run1"
    d.mkdir()
    write_jsonl(d / "train.jsonl", synthetic_records([5, 9, 7, 12], 40, seed=0))
    (d / "run.toml").write_text(RUN)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--config", "run1/run.toml", "--quiet"]) == 0
    return d


def test_resume_from_another_directory_and_through_an_absolute_path(run1, monkeypatch):
    monkeypatch.chdir(run1)  # the same config, typed from inside its directory
    assert cli.main(["--debug", "train", "--config", "run.toml", "--quiet", "--steps", "2"]) == 0
    monkeypatch.chdir("/")
    assert cli.main(["--debug", "train", "--config", str(run1 / "run.toml"), "--quiet", "--steps", "3"]) == 0
    assert _steps(run1) == [1, 2, 3]


def test_a_moved_data_file_with_the_same_contents_resumes_other_contents_do_not(run1, capsys):
    shutil.move(run1 / "train.jsonl", run1 / "moved.jsonl")
    cfg = run1 / "run.toml"
    cfg.write_text(RUN.replace('"train.jsonl"', '"moved.jsonl"'))
    assert cli.main(["--debug", "train", "--config", str(cfg), "--quiet", "--steps", "2"]) == 0
    write_jsonl(run1 / "moved.jsonl", synthetic_records([5, 9, 7, 12], 40, seed=1))
    with pytest.raises(ValueError, match=r"the contents of data\.path .*moved\.jsonl \(sha256 differs\)"):
        cli.main(["--debug", "train", "--config", str(cfg), "--quiet", "--steps", "3"])
    assert _steps(run1) == [1, 2]


def test_a_moved_tokenizer_directory_is_compared_by_contents(tmp_path):
    from odcfn.sft.config import config_from_dict
    from odcfn.sft.resume_check import path_digests, resume_conflicts, stored_config

    for name, text in [("a", "v1"), ("b", "v1"), ("c", "v2")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(text)

    def cfg(tok):
        return config_from_dict({"data": {"path": "d.jsonl", "tokenizer": tok}, "train": {"steps": 1}},
                                base_dir=tmp_path)

    then = cfg("a")
    stored, digests = stored_config(then), path_digests(then)
    assert resume_conflicts(stored, cfg("b"), (digests, path_digests(cfg("b")))) == []
    other = resume_conflicts(stored, cfg("c"), (digests, path_digests(cfg("c"))))
    assert other[0].startswith("data.tokenizer")


def test_resume_anyway_relaxes_hyperparameters_but_never_loads_another_model(run1, capsys):
    cfg = run1 / "run.toml"
    cfg.write_text(RUN.replace("lr = 1e-2", "lr = 3e-2"))
    assert cli.main(["train", "--config", str(cfg), "--quiet", "--steps", "2", "--resume-anyway"]) == 0
    err = capsys.readouterr().err
    assert "resuming" in err and "anyway" in err and "train.lr 0.01 -> 0.03" in err  # said, not silent
    cfg.write_text(RUN.replace("d_model = 16", "d_model = 8"))
    with pytest.raises(ValueError, match=r"model\.d_model 16 -> 8.*another model.*--resume-anyway does not"):
        cli.main(["--debug", "train", "--config", str(cfg), "--quiet", "--steps", "3", "--resume-anyway"])
    assert _steps(run1) == [1, 2]
