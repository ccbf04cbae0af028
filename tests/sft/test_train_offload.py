"""``[offload]`` in ``odcfn train``: a run with the owners' state in a file tier logs the same
losses and writes the same checkpoints as the in-memory run, bit for bit; bad keys are refused
when the config is read, naming the key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from odcfn import cli
from odcfn.checkpoint.sharded import read_shards
from odcfn.models import qwen_model
from odcfn.sft.config import load_config
from tests.sft.test_sft import QCFG, _setup


def _run(tmp, extra=""):
    cfg = _setup(tmp, steps=3, every=3, extra=extra)
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    losses = [json.loads(x)["loss"] for x in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    ck = tmp / "out" / "checkpoints" / "step-00000003"
    import odcfn

    return losses, [read_shards(ck, model=qwen_model(QCFG), mesh=odcfn.Mesh(2, r))[:2] for r in range(2)]


def test_offloaded_train_equals_in_memory(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "tier").mkdir(parents=True)
    mem = _run(tmp_path / "a")
    off = _run(tmp_path / "b", '[offload]\nbudget_gib = 0.001\npath = "tier"\nprefetch = 1\n')
    assert mem[0] == off[0]
    for (p0, s0), (p1, s1) in zip(mem[1], off[1]):
        assert all(torch.equal(p0[k], p1[k]) for k in p0)
        assert all(
            torch.equal(s0["mu"][k], s1["mu"][k]) and torch.equal(s0["nu"][k], s1["nu"][k]) for k in p0
        )
    assert not list((tmp_path / "b" / "tier").iterdir())


@pytest.mark.parametrize(
    "extra,msg",
    [
        (
            '[offload]\nbudget_gib = 1\npath = "missing"\n',
            r"offload.path: Offload.path=.*missing' is not a directory",
        ),
        ("[offload]\nbudget_gib = -1\n", r"offload.budget_gib"),
        ("[offload]\nbudget_gib = 1\nprefetch = 1.5\n", r"offload.prefetch"),
        ("[offload]\nbudget = 1\n", r"unknown keys \['budget'\] in \[offload\]"),
        (
            "[offload]\nbudget_gib = 1\n[train.staleness]\n'*' = 1\n",
            r"\[offload\] cannot be combined with train.staleness",
        ),
    ],
)
def test_bad_offload_keys_are_named_when_read(tmp_path, extra, msg):
    cfg = _setup(tmp_path, extra=extra)
    cfg.write_text(cfg.read_text().replace("max_grad_norm = 1.0\n", ""))  # staleness refuses clipping
    with pytest.raises((ValueError, TypeError), match=msg):
        load_config(cfg)


def test_a_budget_below_a_unit_is_named_before_the_first_step(tmp_path, capsys):
    (tmp_path / "tier").mkdir()
    cfg = _setup(tmp_path, extra='[offload]\nbudget_gib = 1e-7\npath = "tier"\n')
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) != 0
    assert "Offload.budget_gib=1e-07 is below one unit plus the prefetch window" in capsys.readouterr().err
    assert (
        not (tmp_path / "out" / "metrics.jsonl").exists()
        or not (tmp_path / "out" / "metrics.jsonl").read_text()
    )
    shutil.rmtree(tmp_path / "tier")
