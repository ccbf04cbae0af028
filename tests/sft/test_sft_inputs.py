"""Hostile ``odcfn train`` inputs: unparsable or mistyped configs, undecodable data, and a
resume into an out_dir whose run had another config or dataset."""

from __future__ import annotations

import json

import pytest

from odcfn import cli
from odcfn.data.records import read_jsonl, synthetic_records, write_jsonl
from odcfn.sft.config import load_config

BASE = """out_dir = "out"
[model]
vocab_size = 40
d_model = 16
n_layers = 1
n_heads = 2
n_kv_heads = 1
d_ff = 24
[data]
path = "train.jsonl"
batch_size = 4
[train]
steps = 4
lr = 1e-2
world_size = 1
[checkpoint]
every = 2
"""


def _write(tmp_path, text=BASE, name="run.toml"):
    write_jsonl(tmp_path / "train.jsonl", synthetic_records([5, 9, 7, 12, 6, 8, 10, 4], 40, seed=0))
    (tmp_path / name).write_text(text)
    return tmp_path / name


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.replace("lr = 1e-2", 'lr = "fast"'), r"train\.lr must be a number > 0, got str 'fast'"),
        (lambda t: t.replace("steps = 4", "steps = true"),
         r"train\.steps must be an integer >= 1, got bool True"),
        (
            lambda t: t.replace("batch_size = 4", "batch_size = 4.5"),
            r"data\.batch_size must be an integer >= 1, got float",
        ),
        (lambda t: t.replace("d_ff = 24", 'd_ff = "24"'), r"model\.d_ff must be an integer >= 1, got str"),
        (lambda t: t + "keep = 1.5\n", r"checkpoint\.keep must be an integer >= 1 \(or unset\), got float"),
        (lambda t: t.replace("lr = 1e-2", "lr = nan"), r"train\.lr must be a number > 0, got nan"),
        (lambda t: t.replace("steps = 4", "steps = = 4"), "cannot parse the config"),
    ],
    ids=["lr_str", "steps_bool", "batch_float", "dff_str", "keep_float", "lr_nan", "syntax"],
)
def test_config_errors_name_the_file_and_the_field_at_load(tmp_path, edit, match):
    path = _write(tmp_path, edit(BASE))
    with pytest.raises(ValueError, match=match) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path}: ")


def test_json_and_undecodable_configs_name_the_file(tmp_path):
    p = tmp_path / "run.json"
    p.write_text('{"data": {"path": "x.jsonl"}, ')
    with pytest.raises(ValueError, match=f"{p}: cannot parse the config"):
        load_config(p)
    p.write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"{p}: the config must be a table/object"):
        load_config(p)
    t = tmp_path / "bad.toml"
    t.write_bytes(b'out_dir = "\xff"\n')
    with pytest.raises(ValueError, match=f"{t}: cannot parse the config"):
        load_config(t)


def test_invalid_utf8_in_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    good = json.dumps({"input_ids": [1, 2, 3]}).encode()
    path.write_bytes(good + b"\n" + good + b"\n" + b'{"input_ids": [1, 2], "note": "\xc3\x28"}\n')
    with pytest.raises(ValueError, match=rf"{path}:3: not valid UTF-8 \(byte 32 of the line"):
        read_jsonl(path)
    path.write_bytes(good + b"\n\n" + good + b"\n")  # blank lines still skipped, counted
    assert len(read_jsonl(path)) == 2


def _metrics(tmp_path):
    return (tmp_path / "out" / "metrics.jsonl").read_text()


@pytest.mark.parametrize("change", ["lr", "dataset", "model"])
def test_resuming_another_run_is_refused_unless_asked(tmp_path, change):
    cfg = _write(tmp_path)
    cli.main(["train", "--config", str(cfg), "--steps", "2", "--quiet"])
    ck = tmp_path / "out" / "checkpoints" / "step-00000002"
    before, log = {f.name: f.read_bytes() for f in ck.iterdir()}, _metrics(tmp_path)
    if change == "lr":
        cfg.write_text(BASE.replace("lr = 1e-2", "lr = 3e-2"))
        match = r"train\.lr 0\.01 -> 0\.03"
    elif change == "model":
        cfg.write_text(BASE.replace("n_heads = 2", "n_heads = 1"))
        match = r"model\.n_heads 2 -> 1"
    else:  # same path, other contents
        write_jsonl(tmp_path / "train.jsonl", synthetic_records([5, 9, 7, 12, 6, 8, 10, 4], 40, seed=1))
        match = r"the contents of data\.path .*train\.jsonl \(sha256 differs\)"
    with pytest.raises(ValueError, match=rf"belongs to a run with another config: {match}.*--resume-anyway"):
        cli.main(["--debug", "train", "--config", str(cfg), "--quiet"])
    # refused before any step: the checkpoint and the log are as they were
    assert {f.name: f.read_bytes() for f in ck.iterdir()} == before and _metrics(tmp_path) == log
    if change != "model":  # a model of another shape could not load anyway
        cli.main(["train", "--config", str(cfg), "--quiet", "--resume-anyway"])
        assert [json.loads(x)["step"] for x in _metrics(tmp_path).splitlines()] == [1, 2, 3, 4]


def test_resuming_with_more_steps_or_ranks_is_allowed(tmp_path):
    cfg = _write(tmp_path)
    cli.main(["train", "--config", str(cfg), "--steps", "2", "--quiet"])
    cfg.write_text(cfg.read_text().replace("[train]\n", '[train]\nbalance = "local_sort"\n'))  # speed only
    # 2 -> 4 steps, W 1 -> 2, another balancer
    assert cli.main(["train", "--config", str(cfg), "--quiet", "--world-size", "2"]) == 0
    assert [json.loads(x)["step"] for x in _metrics(tmp_path).splitlines()] == [1, 2, 3, 4]
