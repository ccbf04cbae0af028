"""``[eval] every = N`` in ``odcfn train``: the held-out loss (and DPO's rewards) logged every N
steps equals an independent single-process computation on the checkpoint of that step (odcfn's
reference loss for SFT; transformers' own model for DPO, with a reference computed the same way),
and bad eval configs are refused naming the key (issue 39)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import odcfn
from odcfn import cli
from odcfn.batch import Batch
from odcfn.checkpoint.sharded import read_shards
from odcfn.data.records import read_jsonl, synthetic_records, write_jsonl
from odcfn.models import QwenConfig, init_params, qwen_model
from tests.sft.test_sft import QCFG, _setup


def _metrics(tmp: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]


def _params_at(tmp: Path, step: int, model, world: int = 2):
    ck = tmp / "out" / "checkpoints" / f"step-{step:08d}"
    return odcfn.unshard([read_shards(ck, model=model, mesh=odcfn.Mesh(world, r))[0] for r in range(world)],
                         model, odcfn.Mesh(world))


def test_sft_eval_loss_equals_the_single_process_loss_of_the_checkpoint(tmp_path, capsys):
    write_jsonl(tmp_path / "eval.jsonl", synthetic_records([6, 11, 5, 9, 7], 40, seed=3))
    cfg = _setup(tmp_path, steps=4, every=2, extra="[eval]\nevery = 2\n")
    text = cfg.read_text().replace("keep = 2\n", "keep = 4\n")
    cfg.write_text(text.replace('batch_size = 4\n', 'batch_size = 4\neval_path = "eval.jsonl"\n'))
    assert cli.main(["train", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    recs = _metrics(tmp_path)
    assert ["eval/loss" in r for r in recs] == [False, True, False, True]
    assert "eval/loss " in out  # part of the progress line
    model = qwen_model(QCFG)
    held_out = Batch(read_jsonl(tmp_path / "eval.jsonl").samples)  # 5 samples: passes of 4 and 1
    for r in recs[1::2]:
        want = float(odcfn.reference_loss(model, _params_at(tmp_path, r["step"], model), held_out))
        assert r["eval/loss"] == pytest.approx(want, rel=1e-5), r["step"]
        assert r["eval/seconds"] > 0


def test_dpo_eval_figures_equal_transformers_on_the_checkpoint(tmp_path, capsys):
    from tests.dpo_ref import reference as dpo_reference
    from tests.rl_ref import hf_logits_fn
    from tests.sft.test_dpo_train import _pairs
    from tests.sft.test_dpo_train import _setup as dpo_setup

    cfg = dpo_setup(tmp_path, steps=2, every=2)
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _pairs(6, seed=7)))
    text = cfg.read_text().replace("batch_size = 8\n", 'batch_size = 4\neval_path = "held_out.jsonl"\n')
    cfg.write_text(text.replace("keep = 2\n", "keep = 2\n[eval]\nevery = 2\n"))
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    assert "held-out set's computed in 2 pass(es)" in capsys.readouterr().out
    rec = _metrics(tmp_path)[-1]
    from odcfn.sft.config import load_config, model_config
    from odcfn.sft.config_dpo import dpo_loss
    from odcfn.sft.preference import prepare_pairs

    c = load_config(cfg)
    qcfg: QwenConfig = model_config(c)
    pairs = prepare_pairs(c, qcfg.vocab_size).eval
    model = qwen_model(qcfg)
    ref_logits = hf_logits_fn(qcfg, init_params(qcfg, seed=c.model.seed), torch.float64)
    with torch.no_grad():  # the reference: the starting point's per-token log-probs, [0] = 0
        lps = [torch.log_softmax(ref_logits(s.tokens)[:-1], -1).gather(-1, s.tokens[1:, None].long())[:, 0]
               for p in pairs for s in p]
    ref = [torch.cat([torch.zeros(1, dtype=torch.float64), lp]) for lp in lps]
    batch = odcfn.preference_batch(list(pairs), ref_logprobs=[r.float() for r in ref])
    loss, figures, _ = dpo_reference(qcfg, _params_at(tmp_path, 2, model), batch, dpo_loss(c))
    assert rec["eval/loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
              "logps/rejected"):
        assert rec[f"eval/{k}"] == pytest.approx(figures[k], rel=1e-4, abs=1e-5), k
    # a rerun serves the held-out reference from its cache
    assert cli.main(["train", "--config", str(cfg), "--quiet", "--steps", "4"]) == 0
    assert "held-out set's read from" in capsys.readouterr().out


def test_eval_configs_that_cannot_run_are_named(tmp_path, capsys):
    cfg = _setup(tmp_path, steps=2, every=0, extra="[eval]\nevery = 1\n")
    assert cli.main(["train", "--config", str(cfg)]) == 2
    assert "eval.every = 1 needs data.eval_path" in capsys.readouterr().err
    # an eval set without loss tokens: named by file and row
    write_jsonl(tmp_path / "eval.jsonl", [{"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}])
    cfg.write_text(cfg.read_text().replace('batch_size = 4\n', 'batch_size = 4\neval_path = "eval.jsonl"\n'))
    assert cli.main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "eval.jsonl" in err and "has no loss tokens" in err
