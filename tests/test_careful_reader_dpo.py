"""Issue 40's preference findings, each with the test that would have caught it: pairs checked
when ``odcfn train`` reads them (9), a resumed full fine-tuning run whose reference base changed
(4), and odd pairs named before training (21). Tiny model, 2 threads ranks, seconds."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import odcfn
from odcfn import cli

ROOT = Path(__file__).parent.parent
TOKENIZER = ROOT / "examples" / "chat" / "tokenizer"  # shipped: no download


def _pairs(n: int) -> list[dict]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 4), rng.randint(0, 4)
        out.append({"prompt": f"{a} + {b} =", "chosen": f" {a + b}", "rejected": f" {(a + b + 1) % 10}"})
    return out


def _setup(tmp: Path, *, steps: int = 2, every: int = 0, model: str | None = None,
           records: list[dict] | None = None) -> Path:
    (tmp / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records or _pairs(8)))
    model = model or "vocab_size = 300\nd_model = 32\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\nd_ff = 64\n"
    cfg = tmp / "run.toml"
    cfg.write_text(
        f'out_dir = "out"\n[model]\n{model}'
        f'[data]\npath = "pairs.jsonl"\ntokenizer = "{TOKENIZER}"\nbatch_size = 4\n'
        f'[train]\ntask = "dpo"\nsteps = {steps}\nlr = 1e-2\nworld_size = 2\n'
        f"max_tokens_per_microbatch = 64\n[dpo]\nbeta = 0.5\n[checkpoint]\nevery = {every}\n"
    )
    return cfg


@pytest.fixture
def passes(monkeypatch):
    """rank 0's ``odcfn.log_probs`` calls (the reference pass makes them)."""
    calls: list[int] = []
    real = odcfn.log_probs

    def counting(state, batch, **kw):
        if state.mesh.rank == 0:
            calls.append(len(batch))
        return real(state, batch, **kw)

    monkeypatch.setattr(odcfn, "log_probs", counting)
    return calls


# --- 9: every pair checked when it is read ---------------------------------------------------------


def test_a_pair_whose_members_differ_in_prompt_is_named_by_line_before_the_reference_pass(
        tmp_path, passes, capsys, monkeypatch):
    """A tokenizer whose chat template merges the prompt's last token into the answer gives the
    members different prompts; ``odcfn train`` must name the line when it reads the file, not a
    pair index of some minibatch after the whole reference pass. Failed before: exit 2 only at
    step 1, after 2 reference passes, naming "preference pair 2 (batch samples 4, 5)"."""
    import odcfn.data.preference as pref

    real = pref.tokenize_pair

    def merging(tok, rec, where="record"):
        c, r = real(tok, rec, where)
        if where.endswith(":3"):  # line 3: the rejected member's prompt lost its last token
            keep = torch.arange(r.length) != 1
            r = odcfn.Sample(r.tokens[keep], r.loss_mask[keep])
        return c, r

    monkeypatch.setattr(pref, "tokenize_pair", merging)
    cfg = _setup(tmp_path)
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'pairs.jsonl'}:3: " in err and "differ in prompt" in err, err
    assert passes == []  # refused when read: no reference pass ran
