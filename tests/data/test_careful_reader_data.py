"""Issue 40's findings about what a test run and a data file leave unsaid, each with the test that
would have caught it: unknown fields of a token JSONL (18) and a checkout left as it was found
(15)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from odcfn import cli
from odcfn.data.records import read_jsonl, synthetic_records

MODEL = "[model]\nvocab_size = 40\nd_model = 16\nn_layers = 2\nn_heads = 2\nn_kv_heads = 1\nd_ff = 24\n"


def _write(tmp: Path, records: list[dict]) -> Path:
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = tmp / "run.toml"
    cfg.write_text(f'out_dir = "out"\n{MODEL}[data]\npath = "train.jsonl"\nbatch_size = 2\n'
                   '[train]\nsteps = 1\nworld_size = 2\n[checkpoint]\nevery = 0\n')
    return cfg


# --- 18: unknown fields of a token record ----------------------------------------------------------


def test_a_per_token_extra_in_a_token_record_is_refused_by_line(tmp_path, capsys):
    """``routed_experts`` (routing replay's per-token expert indices) in a token JSONL: the user
    meant it to count. Failed before: the run trained exactly as without it, without a word."""
    recs = synthetic_records([6, 7, 5, 8], 40)
    recs[2]["routed_experts"] = [[[0, 1]]] * 5
    cfg = _write(tmp_path, recs)
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'train.jsonl'}:3: field 'routed_experts' is a per-token extra" in err, err
    assert "input_ids, loss_mask or labels" in err, err


def test_other_unknown_fields_are_named_once(tmp_path):
    """Fields such as an id ride along in many datasets: named once per file with the first line
    that has each, not refused. Failed before: nothing was said."""
    recs = synthetic_records([6, 7, 5, 8], 40)
    for i, r in enumerate(recs):
        r["id"] = i
    recs[3]["source"] = "web"
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.warns(UserWarning) as got:
        data = read_jsonl(path, vocab_size=40)
    assert len(data) == 4 and len(got) == 1, [str(w.message) for w in got]
    msg = str(got[0].message)
    want = f"{path}: fields not read: 'id' (4 lines, first {path}:1), 'source' (1 line, first {path}:4)"
    assert want in msg, msg
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join(json.dumps(r) + "\n" for r in synthetic_records([4, 5], 40)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a file of known fields only: no warning
        read_jsonl(clean)


def test_unknown_fields_are_named_once_per_run_with_rank_processes(tmp_path, capfd):
    """With ``train.backend = "processes"`` every rank reads the file again: the launcher names the
    fields, the ranks stay quiet (before the fix of the second read: the launcher and rank 0)."""
    recs = synthetic_records([6, 7, 5, 8], 40)
    for i, r in enumerate(recs):
        r["id"] = i
    cfg = _write(tmp_path, recs)
    cfg.write_text(cfg.read_text().replace("[train]\n", '[train]\nbackend = "processes"\n'))
    with pytest.warns(UserWarning, match="fields not read: 'id' \\(4 lines") as got:  # the launcher's read
        assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    assert sum("fields not read" in str(w.message) for w in got) == 1
    err = capfd.readouterr().err  # the rank processes' own stderr
    assert "fields not read" not in err, err
