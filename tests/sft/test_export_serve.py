"""An exported run is a folder a server loads as it is: a fresh model trained on TRL-format chat
rows with a tokenizer taken from a model's directory exports with that tokenizer's files and
that directory's ``generation_config.json``; transformers loads it (``AutoTokenizer`` +
``AutoModelForCausalLM``) and generates, greedily, the same tokens as odcfn's own engine on the
trained weights."""

from __future__ import annotations

import json
import shutil

import torch
import transformers

import odcfn
from odcfn import cli
from odcfn.checkpoint.sharded import read_shards
from odcfn.models import qwen_model
from odcfn.rollout import LocalEngine, SamplingParams
from odcfn.sft.config import load_config, model_config
from tests.data.test_chat_data import _tokenizer

VOCAB = 300
U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731


def test_an_export_loads_in_transformers_and_generates_as_odcfn_does(tmp_path, capsys):
    tok_dir = _tokenizer(tmp_path / "tokenizer")
    # a model directory's generation settings beside its tokenizer, as downloaded
    transformers.GenerationConfig(eos_token_id=2, do_sample=True, temperature=0.6, top_p=0.9,
                                  max_new_tokens=11).save_pretrained(tok_dir)
    rows = [{"prompt": [U(q)], "completion": [A(a)]} for q, a in
            [("hello there", "fine, thanks!"), ("two plus two?", "four"), ("the cat?", "sat on the mat")] * 3]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.toml").write_text(
        f'out_dir = "out"\n[model]\nvocab_size = {VOCAB}\nd_model = 32\nn_layers = 2\nd_ff = 64\n'
        f'[data]\npath = "chat.jsonl"\nbatch_size = 3\ntokenizer = "{tok_dir}"\n'
        "[train]\nsteps = 3\nlr = 0.01\nworld_size = 1\n"
    )
    assert cli.main(["train", "--config", str(tmp_path / "run.toml"), "--quiet"]) == 0
    out = tmp_path / "served"
    assert cli.main(["export", str(tmp_path / "out"), str(out)]) == 0
    qcfg = model_config(load_config(tmp_path / "run.toml"))
    shutil.rmtree(tmp_path / "tokenizer")  # the folder stands on its own

    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert (gen.temperature, gen.top_p, gen.max_new_tokens) == (0.6, 0.9, 11)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"

    # odcfn's model on the last checkpoint's weights
    om = qwen_model(qcfg)
    ck = sorted((tmp_path / "out" / "checkpoints").glob("step-*"))[-1]
    one = odcfn.Mesh(1)
    params = odcfn.unshard([read_shards(ck, model=om, mesh=one)[0]], om, one)
    engine = LocalEngine(om, qcfg, params=params)

    for question in ("hello there", "the cat?"):
        text = tok.apply_chat_template([U(question)], add_generation_prompt=True, tokenize=False)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                                eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, len(prompt):]
        ours = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                        stop_token_ids=(tok.eos_token_id,)))[0]
        assert ours.tokens.tolist() == hf.tolist() and len(hf) > 1
