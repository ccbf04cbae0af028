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
from odcfn.sft.ref_logprobs import CACHE_NAME

ROOT = Path(__file__).parents[2]
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
    import odcfn.data.formats as formats

    real = formats.tokenize_pair_row

    def merging(tok, fmt, rec, where):
        c, r = real(tok, fmt, rec, where)
        if where.endswith(":3"):  # line 3: the rejected member's prompt lost its last token
            keep = torch.arange(r.length) != 1
            r = odcfn.Sample(r.tokens[keep], r.loss_mask[keep])
        return c, r

    monkeypatch.setattr(formats, "tokenize_pair_row", merging)
    cfg = _setup(tmp_path)
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'pairs.jsonl'}:3: " in err and "differ in prompt" in err, err
    assert passes == []  # refused when read: no reference pass ran


# --- 4: a resumed full fine-tuning run keeps its reference ------------------------------------------


def _hf_base(path: Path, seed: int) -> None:
    from odcfn.models import QwenConfig, init_params, to_hf

    cfg = QwenConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    to_hf(path, init_params(cfg, seed=seed), cfg)


def test_a_resume_whose_reference_weights_changed_is_refused_unless_asked(tmp_path, passes, capsys,
                                                                         monkeypatch):
    """The base at ``model.hf_path`` is replaced by other weights of the same size between two
    legs of a full fine-tuning DPO run (weights files count by size in the resume check: here every
    file does). Failed before: the resume went on, recomputing the reference from the new weights
    without a word (the cache's key no longer matched)."""
    import odcfn.sft.resume_check as rc

    monkeypatch.setattr(rc, "_WHOLE", -1)  # every file counts by size, as weights over 64 MiB do
    base = tmp_path / "base"
    _hf_base(base, seed=0)
    cfg = _setup(tmp_path, steps=2, every=1, model=f'hf_path = "{base}"\n')
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    assert len(passes) == 2  # 8 pairs in chunks of data.batch_size = 4: the reference pass
    size = (base / "model.safetensors").stat().st_size
    _hf_base(base, seed=1)  # other weights, the same files and sizes
    assert (base / "model.safetensors").stat().st_size == size
    capsys.readouterr()
    passes.clear()
    for cache in (True, False):  # with the cache (its key then fails) and without it
        if not cache:
            (tmp_path / "out" / CACHE_NAME).unlink()
        assert cli.main(["train", "--config", str(cfg), "--quiet", "--steps", "3"]) == 2
        err = capsys.readouterr().err
        assert "was trained against another reference" in err and "--recompute-reference" in err, err
        assert passes == []  # refused before any reference pass
    assert cli.main(["train", "--config", str(cfg), "--quiet", "--steps", "3", "--recompute-reference"]) == 0
    out = capsys.readouterr()
    assert "resuming" in out.err and "against a new reference" in out.err, out.err
    assert len(passes) == 2 and "resumed from" in out.out
    # the new reference is the run's now: a later resume on these weights needs no flag
    assert cli.main(["train", "--config", str(cfg), "--quiet", "--steps", "4"]) == 0


# --- 21: odd pairs are named ----------------------------------------------------------------------


def _odd_records() -> list[dict]:
    recs = _pairs(8)
    recs[1] = {"prompt": "1 + 1 =", "chosen": " 2", "rejected": " 2"}  # a constant ln 2, no gradient
    recs[4] = {"prompt": "2 + 2 =", "chosen": " 4", "rejected": ""}  # an empty answer
    return recs


def test_identical_members_and_empty_answers_are_named_by_line(tmp_path, capsys):
    """Failed before: such pairs trained without a word (the identical one a constant ln 2 and a
    zero gradient)."""
    from odcfn.data.preference import read_preference_jsonl

    cfg = _setup(tmp_path, steps=1, records=_odd_records())
    data = tmp_path / "pairs.jsonl"
    with pytest.warns(UserWarning) as got:
        pairs = read_preference_jsonl(data, TOKENIZER)
    text = " ".join(str(w.message) for w in got)
    assert f"{data}:2" in text and "chosen and rejected are identical" in text, text
    assert f"{data}:5" in text and "rejected is empty" in text, text
    assert len(pairs) == 8  # named, still read
    with pytest.warns(UserWarning, match=r"preference pair 1: chosen and rejected are identical"):
        odcfn.preference_batch(pairs[:2])
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"warning: 2 odd pair(s): {data}:2 chosen and rejected are identical" in out, out
    assert f"{data}:5 rejected is empty" in out, out
