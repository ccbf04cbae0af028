"""``odcfn export`` of a LoRA run: a merged Hugging Face model by default, a PEFT adapter directory
with ``--adapter``, both without retyping rank/alpha/targets; transformers and PEFT load them and
compute what odcfn computes. ``save_peft`` records the base it was read from."""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers

import odcfn
from odcfn import cli
from odcfn.checkpoint.sharded import read_manifest
from odcfn.data.records import synthetic_records, write_jsonl
from odcfn.models import QwenConfig, from_hf, init_params, to_hf

CFG = QwenConfig(vocab_size=29, d_model=12, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=20)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_run")
    to_hf(root / "base", init_params(CFG, seed=3), CFG)
    write_jsonl(root / "train.jsonl", synthetic_records([5, 9, 7, 12], CFG.vocab_size, seed=0))
    (root / "run.toml").write_text(
        'out_dir = "out"\n[model]\nhf_path = "base"\n[data]\npath = "train.jsonl"\nbatch_size = 2\n'
        "[train]\nsteps = 2\nlr = 5e-2\nworld_size = 1\n[checkpoint]\nevery = 0\n"
        '[lora]\nrank = 2\nalpha = 4.0\ntargets = ["q_proj", "down_proj"]\nuse_rslora = true\n'
    )
    assert cli.main(["train", "--config", str(root / "run.toml"), "--quiet"]) == 0
    return root


def _odcfn_loss(root, batch):
    from odcfn.sft.config import config_from_stored
    from odcfn.sft.export import find_checkpoint
    from odcfn.sft.lora_export import lora_params

    ck = find_checkpoint(root / "out")
    stored = read_manifest(ck)["extra"]["config"]
    _, model, full = lora_params(ck, config_from_stored(stored))
    return float(odcfn.reference_loss(model, full, batch)), full


def _hf_nll(model, batch):
    with torch.no_grad():
        logits = [model(input_ids=s.tokens.long()[None]).logits[0, :-1].float() for s in batch.samples]
    nll = sum(float(torch.nn.functional.cross_entropy(z, s.tokens.long()[1:], reduction="sum"))
              for z, s in zip(logits, batch.samples))
    return nll / batch.num_loss_tokens, logits


def test_merged_and_adapter_exports_load_and_compute_odcfns_loss(run, tmp_path):
    assert cli.main(["export", str(run / "out"), str(tmp_path / "merged")]) == 0
    assert cli.main(["export", str(run / "out"), str(tmp_path / "adapter"), "--adapter"]) == 0
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (conf["r"], conf["lora_alpha"], conf["target_modules"], conf["use_rslora"]) == (
        2, 4, ["down_proj", "q_proj"], True)
    assert conf["base_model_name_or_path"] == str((run / "base").resolve())

    batch = odcfn.random_batch([7, 11], CFG.vocab_size, seed=4)
    want, full = _odcfn_loss(run, batch)
    base = from_hf(run / "base")[1]
    lora_b = full["lora.layers.0"]["self_attn"]["q_proj"]["lora_B"]
    assert not torch.equal(lora_b, torch.zeros_like(lora_b))  # the adapters trained
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    got, merged_logits = _hf_nll(merged, batch)
    assert got == pytest.approx(want, rel=1e-5)
    # PEFT finds the base by itself (base_model_name_or_path) and computes the same logits
    pm = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")).eval()
    got_peft, peft_logits = _hf_nll(pm, batch)
    assert got_peft == pytest.approx(want, rel=1e-5)
    for a, b in zip(peft_logits, merged_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert base.keys() <= full.keys()


def test_adapter_export_of_a_full_run_is_refused(tmp_path, capsys):
    write_jsonl(tmp_path / "train.jsonl", synthetic_records([5, 9], 16, seed=0))
    (tmp_path / "run.toml").write_text(
        '[model]\nvocab_size = 16\nd_model = 8\nn_layers = 1\nn_heads = 2\nn_kv_heads = 1\nd_ff = 8\n'
        '[data]\npath = "train.jsonl"\nbatch_size = 2\n[train]\nsteps = 1\nworld_size = 1\n'
    )
    assert cli.main(["train", "--config", str(tmp_path / "run.toml"), "--quiet"]) == 0
    capsys.readouterr()
    assert cli.main(["export", str(tmp_path / "runs" / "sft"), str(tmp_path / "a"), "--adapter"]) == 2
    assert "is not of a LoRA run" in capsys.readouterr().err


def test_save_peft_records_the_base_from_hf_read(tmp_path):
    from dataclasses import replace

    from odcfn.models import qwen_model

    cfg = replace(CFG, vocab_size=31)  # a base of its own: two read bases of one config are ambiguous
    to_hf(tmp_path / "base", init_params(cfg, seed=1), cfg)
    qcfg, params = from_hf(tmp_path / "base")
    model, params = odcfn.lora.apply(qwen_model(qcfg), params, rank=2, alpha=4.0)
    def save(rank, transport):
        state = odcfn.TrainState.create(params=odcfn.shard(params, model, transport.mesh), model=model,
                                        optimizer=odcfn.sgd(0.1), transport=transport)
        return odcfn.lora.save_peft(tmp_path / "ad", state)

    odcfn.run_local(save, 1, timeout=60)
    conf = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str((tmp_path / "base").resolve())
