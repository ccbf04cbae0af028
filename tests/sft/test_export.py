"""Export for real use: a run fine-tuned from a Hugging Face checkpoint comes back as a model
directory that transformers loads as it is (``AutoModelForCausalLM``, ``AutoTokenizer``,
``GenerationConfig``) with the trained weights, the same loss as odcfn computes, every config
value of the source model, the tokenizer's files and ordinary file permissions; the same from
``odcfn export`` (a checkpoint directory) and from a torchrun job."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import tokenizers  # noqa: F401
import torch
import transformers

import odcfn
from odcfn import cli
from odcfn.checkpoint.sharded import read_shards
from odcfn.data.records import synthetic_records, write_jsonl
from odcfn.models import from_hf, qwen_model

VOCAB = 300
IGNORED = {"dtype", "torch_dtype", "transformers_version", "_name_or_path"}  # not the model's


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny Qwen2 checkpoint with special token ids, a context length, a generation config
    and a tokenizer, as a user downloads one."""
    from tests.data.test_chat_data import _tokenizer

    src = tmp_path_factory.mktemp("src") / "qwen"
    _tokenizer(src)
    conf = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=16, max_position_embeddings=96, bos_token_id=1, eos_token_id=2, rope_theta=5000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(conf).save_pretrained(src)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=True, temperature=0.7,
                                  max_new_tokens=7).save_pretrained(src)
    return src


def _run_config(tmp_path, src, extra=""):
    write_jsonl(tmp_path / "train.jsonl", synthetic_records([5, 9, 7, 12, 6, 8], VOCAB, seed=0))
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        f'out_dir = "out"\n[model]\nhf_path = "{src}"\n[data]\npath = "train.jsonl"\nbatch_size = 2\n'
        f'[train]\nsteps = 2\nlr = 1e-2\nworld_size = 2\n{extra}[checkpoint]\nexport_hf = "hf-train"\n'
    )
    return cfg


def _checkpoint_params(tmp_path, step=2):
    qcfg, _ = from_hf(tmp_path / "hf-export")
    model = qwen_model(qcfg)
    ck = tmp_path / "out" / "checkpoints" / f"step-{step:08d}"
    one = odcfn.Mesh(1)
    return qcfg, model, odcfn.unshard([read_shards(ck, model=model, mesh=one)[0]], model, one)


def test_export_round_trip_through_transformers(tmp_path, source, capsys):
    cfg = _run_config(tmp_path, source)
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    assert cli.main(["export", str(tmp_path / "out"), str(tmp_path / "hf-export")]) == 0
    assert "odcfn export: wrote" in capsys.readouterr().out
    a, b = tmp_path / "hf-train", tmp_path / "hf-export"
    # the launcher's export and the one from the last checkpoint are the same files' contents
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())
    from safetensors.torch import load_file

    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)

    # the trained weights, exactly
    qcfg, model, want = _checkpoint_params(tmp_path)
    odcfn.tree_assert_allclose(from_hf(b)[1], want, rtol=0, atol=0)

    # transformers: every config value of the source, the loss odcfn computes
    src_conf = transformers.AutoConfig.from_pretrained(source).to_dict()
    got_conf = transformers.AutoConfig.from_pretrained(b).to_dict()
    shared = (set(src_conf) & set(got_conf)) - IGNORED
    assert {"bos_token_id", "eos_token_id", "max_position_embeddings", "rope_parameters"} <= shared
    assert {k: got_conf[k] for k in shared} == {k: src_conf[k] for k in shared}
    hf = transformers.AutoModelForCausalLM.from_pretrained(b).eval()
    batch = odcfn.random_batch([7, 12], VOCAB, seed=3)
    with torch.no_grad():
        logits = [hf(input_ids=s.tokens.long()[None]).logits[0, :-1].float() for s in batch.samples]
        nll = sum(float(torch.nn.functional.cross_entropy(z, s.tokens.long()[1:], reduction="sum"))
                  for z, s in zip(logits, batch.samples))
    want_loss = float(odcfn.reference_loss(model, want, batch))
    assert nll / batch.num_loss_tokens == pytest.approx(want_loss, rel=1e-5)
    gen = transformers.GenerationConfig.from_pretrained(b)
    assert (gen.eos_token_id, gen.temperature, gen.max_new_tokens) == (2, 0.7, 7)
    text = "two plus two is four"
    tok = transformers.AutoTokenizer.from_pretrained(b)
    assert tok(text)["input_ids"] == transformers.AutoTokenizer.from_pretrained(source)(text)["input_ids"]

    # files a server process may read: the permissions any new file gets (0666 less the umask)
    umask = os.umask(0)
    os.umask(umask)
    for f in b.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f


def test_torchrun_job_exports_from_its_last_checkpoint(tmp_path, source):
    cfg = _run_config(tmp_path, source, extra='backend = "processes"\n')
    cfg.write_text(cfg.read_text().replace('export_hf = "hf-train"', 'export_hf = "hf-export"\nevery = 0'))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "odcfn.cli", "train", "--config", str(cfg), "--quiet"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Hugging Face model written to" in proc.stdout
    _, _, want = _checkpoint_params(tmp_path)  # the last step's checkpoint, saved for the export
    odcfn.tree_assert_allclose(from_hf(tmp_path / "hf-export")[1], want, rtol=0, atol=0)
    assert (tmp_path / "hf-export" / "tokenizer.json").is_file()


def test_a_fresh_model_exports_with_its_tokenizers_special_ids(tmp_path):
    from odcfn.models import init_params
    from odcfn.sft.config import config_from_dict, model_config
    from odcfn.sft.export import export_params
    from tests.data.test_chat_data import _tokenizer

    tok_dir = _tokenizer(tmp_path / "tok")
    cfg = config_from_dict({"data": {"path": "chat.jsonl", "tokenizer": str(tok_dir)}, "train": {"steps": 1},
                            "model": {"vocab_size": VOCAB, "d_model": 16, "n_layers": 1, "d_ff": 16}},
                           base_dir=tmp_path)
    qcfg = model_config(cfg)
    out = export_params(tmp_path / "hf", init_params(qcfg), qcfg, cfg)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    conf = transformers.AutoConfig.from_pretrained(out)
    assert conf.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert conf.max_position_embeddings == 32768  # Qwen2's own default, stated
    assert conf.pad_token_id is None  # a pad id would change the embedding's gradient
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == tok.eos_token_id
