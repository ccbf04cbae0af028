"""``odcfn train`` checks all of its data before the first step: a sample longer than the
microbatch cap or ``data.max_length``, and a minibatch without loss tokens, are named by
``file:line`` up front (not steps into the run), or handled as the config asks
(``data.long_samples = "truncate" | "drop"``, ``data.skip_empty_minibatches``) and reported in
the run's summary."""

from __future__ import annotations

import json

import pytest

from odcfn import cli
from odcfn.data.records import write_jsonl
from odcfn.sft.config import load_config
from odcfn.sft.prepare import prepare_data

VOCAB = 40


def _rec(n, loss=True, seed=0):
    ids = [(seed * 7 + 3 * i) % VOCAB for i in range(n)]
    return {"input_ids": ids, "loss_mask": [0] + [int(loss)] * (n - 1)}


def _config(tmp_path, records, extra="", data_extra=""):
    path = write_jsonl(tmp_path / "train.jsonl", records)
    # a blank line: line numbers are file lines, not sample indices
    path.write_text(path.read_text().replace("\n", "\n\n", 1))
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        'out_dir = "out"\n[model]\nvocab_size = 40\nd_model = 16\nn_layers = 1\nn_heads = 2\n'
        f'n_kv_heads = 1\nd_ff = 16\n[data]\npath = "train.jsonl"\nbatch_size = 2\nshuffle = false\n'
        f'{data_extra}[train]\nsteps = 4\nworld_size = 2\nmax_tokens_per_microbatch = 16\n'
        f'[checkpoint]\nevery = 0\n{extra}'
    )
    return cfg


LONG = [_rec(6), _rec(8, seed=1), _rec(20, seed=2), _rec(5, seed=3), _rec(7, seed=4), _rec(9, seed=5)]


def test_a_long_sample_is_named_before_the_first_step(tmp_path, capsys):
    cfg = _config(tmp_path, LONG)
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err
    # the third sample is on line 4 (line 2 is blank)
    assert "train.jsonl:4: sample has 20 tokens, more than train.max_tokens_per_microbatch=16" in err
    assert 'data.long_samples = "truncate" or "drop"' in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # refused before any step


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_long_samples_truncated_or_dropped(tmp_path, policy):
    cfg = load_config(_config(tmp_path, LONG, data_extra=f'long_samples = "{policy}"\nmax_length = 18\n'))
    data = prepare_data(cfg, VOCAB)
    lengths = data.dataset.lengths
    assert lengths == ((6, 8, 16, 5, 7, 9) if policy == "truncate" else (6, 8, 5, 7, 9))
    assert data.report()[{"truncate": "truncated", "drop": "dropped"}[policy]] == [f"{cfg.data.path}:4"]
    if policy == "truncate":  # the first 16 tokens, their mask with them
        assert data.dataset.samples[2].tokens.tolist() == LONG[2]["input_ids"][:16]
        assert data.dataset.samples[2].loss_mask.tolist() == [bool(m) for m in LONG[2]["loss_mask"][:16]]
    else:  # the origins of the samples after it stay right
        assert data.dataset.where(2) == f"{cfg.data.path}:5"


EMPTY = [_rec(6), _rec(8, seed=1), _rec(5, loss=False, seed=2), _rec(7, loss=False, seed=3),
         _rec(9, seed=4), _rec(4, seed=5)]


def test_an_empty_loss_minibatch_is_named_or_skipped(tmp_path, capsys):
    cfg = _config(tmp_path, EMPTY)
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "the minibatch of step 2 (" in err and "train.jsonl:4, " in err and "train.jsonl:5)" in err
    assert "data.skip_empty_minibatches = true" in err
    assert not (tmp_path / "out").exists() or not (tmp_path / "out" / "metrics.jsonl").exists()

    text = cfg.read_text().replace("shuffle = false\n", "shuffle = false\nskip_empty_minibatches = true\n")
    cfg.write_text(text.replace("every = 0", "every = 1").replace("steps = 4", "steps = 6"))
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "skipped 2 step(s) whose minibatch has no loss tokens: [2, 5]" in out  # 3 per epoch
    recs = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 3, 4, 6]
    # the data position is the step (a resume continues right), the optimizer counted 4 updates
    from odcfn.checkpoint.sharded import read_manifest, read_shards
    from odcfn.models import qwen_model
    from odcfn.sft.config import model_config
    from odcfn.sharding import Mesh

    ck = tmp_path / "out" / "checkpoints" / "step-00000006"
    assert read_manifest(ck)["step"] == 6
    _, opt_state, step = read_shards(ck, model=qwen_model(model_config(load_config(cfg))), mesh=Mesh(1))
    assert step == 6 and opt_state["count"] == 4
