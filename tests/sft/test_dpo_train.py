"""``odcfn train`` with ``train.task = "dpo"``: preference pairs through the CLI (threads backend,
2 ranks), TRL's ln 2 at the first step, a preference that is learned, the reference pass run
once and cached (rerun, resume, kill), a bad cache recomputed, never used, and the reference of a
resumed run still the starting point (LoRA: the base)."""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401 (a hard requirement of these tests)

import odcfn
from odcfn import cli
from odcfn.sft.ref_logprobs import CACHE_NAME

ROOT = Path(__file__).parents[2]
TOKENIZER = ROOT / "examples" / "chat" / "tokenizer"  # shipped: no download


def _pairs(n: int, seed: int = 0) -> list[dict]:
    """A learnable toy preference: the right sum over a wrong one."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, wrong = rng.randint(0, 4), rng.randint(0, 4), rng.randint(0, 9)
        wrong = wrong if wrong != a + b else (a + b + 1) % 10
        out.append({"prompt": f"{a} + {b} =", "chosen": f" {a + b}", "rejected": f" {wrong}"})
    return out


def _setup(tmp: Path, *, steps: int = 4, every: int = 2, pairs: int = 16, dpo: str = "beta = 0.5",
           lora: str = "", model_seed: int = 0) -> Path:
    (tmp / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _pairs(pairs)))
    cfg = tmp / "run.toml"
    cfg.write_text(
        f'out_dir = "out"\n[model]\nvocab_size = 300\nd_model = 32\nn_layers = 2\nn_heads = 4\n'
        f'n_kv_heads = 2\nd_ff = 64\nseed = {model_seed}\n'
        f'[data]\npath = "pairs.jsonl"\ntokenizer = "{TOKENIZER}"\nbatch_size = 8\n'
        f'[train]\ntask = "dpo"\nsteps = {steps}\nlr = 1e-2\nworld_size = 2\n'
        f"max_tokens_per_microbatch = 64\ndeterministic = true\n"
        f"[dpo]\n{dpo}\n[checkpoint]\nevery = {every}\nkeep = 2\n{lora}"
    )
    return cfg


def _metrics(tmp: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def passes(monkeypatch):
    """Counts ``odcfn.log_probs`` calls of rank 0 (the reference pass calls it per chunk)."""
    calls: list[int] = []
    real = odcfn.log_probs

    def counting(state, batch, **kw):
        if state.mesh.rank == 0:
            calls.append(len(batch))
        return real(state, batch, **kw)

    monkeypatch.setattr(odcfn, "log_probs", counting)
    return calls


def _cache(tmp: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(tmp / "out" / CACHE_NAME))["logprobs"]


def test_first_loss_is_ln2_and_the_preference_is_learned(tmp_path, passes, capsys):
    cfg = _setup(tmp_path, steps=16, every=0)
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "task: dpo, loss sigmoid, beta 0.5" in out and "16 pairs" in out
    assert "reference log-probs: computed in 2 forward pass(es)" in out
    assert passes == [16, 16]  # 16 pairs in chunks of data.batch_size = 8 pairs: 2 passes
    recs = _metrics(tmp_path)
    first = recs[0]
    # TRL's invariant: the policy is its own reference at step 0, so every margin is 0
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/margins"] == pytest.approx(0, abs=1e-6) and first["rewards/accuracies"] == 0
    for k in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert all(math.isfinite(r[k]) for r in recs), k
    late = [r["rewards/accuracies"] for r in recs[-4:]]
    assert sum(late) / len(late) >= 0.7, late
    assert sum(r["loss"] for r in recs[-4:]) / 4 < math.log(2) - 0.15
    assert recs[-1]["rewards/margins"] > 0


def test_the_cache_serves_reruns_and_resumes_and_a_killed_run_resumes(tmp_path, passes, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    cli.main(["train", "--config", str(_setup(a, steps=6)), "--quiet"])  # uninterrupted
    cfg = _setup(b, steps=6)
    # a real kill: the CLI process dies (SIGKILL) at the start of step 5, after step 4's checkpoint
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ODCFN_TEST_KILL_AT": "step:5:0"}
    proc = subprocess.run([sys.executable, "-m", "odcfn.cli", "train", "--config", str(cfg), "--quiet"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    written = (b / "out" / CACHE_NAME).stat().st_mtime_ns
    passes.clear()
    capsys.readouterr()
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0  # resumes at 4, cache verified
    out = capsys.readouterr().out
    assert "resumed from" in out and "reference log-probs: read from" in out
    assert passes == [] and (b / "out" / CACHE_NAME).stat().st_mtime_ns == written
    ra, rb = _metrics(a), _metrics(b)
    assert [r["step"] for r in rb] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rb] == pytest.approx([r["loss"] for r in ra], rel=1e-6, abs=1e-7)
    # a fresh start into the same out_dir reuses the cache too: its key still matches
    assert cli.main(["train", "--config", str(cfg), "--quiet", "--no-resume", "--steps", "2"]) == 0
    assert passes == [] and "reference log-probs: read from" in capsys.readouterr().out


def test_a_corrupted_or_mismatched_cache_is_recomputed_not_used(tmp_path, passes, capsys):
    cfg = _setup(tmp_path, steps=1, every=0)
    cli.main(["train", "--config", str(cfg), "--quiet"])
    good = _cache(tmp_path).clone()
    path = tmp_path / "out" / CACHE_NAME
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40  # one bit of one stored value
    path.write_bytes(bytes(raw))
    passes.clear()
    capsys.readouterr()
    cli.main(["train", "--config", str(cfg), "--quiet", "--no-resume"])
    assert "is corrupted (its values do not hash" in capsys.readouterr().out and len(passes) == 2
    assert torch.equal(_cache(tmp_path), good)  # rewritten with the true values
    path.write_bytes(path.read_bytes()[:100])  # a torn write
    cli.main(["train", "--config", str(cfg), "--quiet", "--no-resume"])
    assert "is unreadable" in capsys.readouterr().out
    # another reference model (another initial seed) or another data file: recomputed
    cfg = _setup(tmp_path, steps=1, every=0, model_seed=3)
    cli.main(["train", "--config", str(cfg), "--quiet", "--no-resume"])
    assert "was made for another reference model" in capsys.readouterr().out
    cfg = _setup(tmp_path, steps=1, every=0, pairs=17, model_seed=3)
    passes.clear()
    cli.main(["train", "--config", str(cfg), "--quiet", "--no-resume"])
    assert "was made for another data file" in capsys.readouterr().out and len(passes) == 3


def test_cache_checks_unit():
    """``read_cache`` against every way a file can be wrong, without a model."""
    import tempfile

    from odcfn.sft.ref_logprobs import read_cache, write_cache

    key = {"format": "1", "data_sha256": "d", "tokens_sha256": "t", "reference_sha256": "r",
           "compute_dtype": "float32"}
    values = (torch.randn(3), torch.randn(5))
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / CACHE_NAME
        assert read_cache(p, key, [3, 5]) == (None, "none yet")
        write_cache(p, key, values)
        got, why = read_cache(p, key, [3, 5])
        assert why == "" and all(torch.equal(x, y) for x, y in zip(got, values))
        assert "another compute_dtype" in read_cache(p, {**key, "compute_dtype": "bfloat16"}, [3, 5])[1]
        assert "another tokenization" in read_cache(p, {**key, "tokens_sha256": "u"}, [3, 5])[1]
        assert "holds (8,) values, the data has 9 tokens" in read_cache(p, key, [4, 5])[1]
        assert not list(Path(d).glob(".*.tmp"))  # the atomic write left nothing behind


@pytest.mark.parametrize("lora", ["", "[lora]\nrank = 2\n"], ids=["full", "lora"])
def test_a_resumed_run_recomputes_the_reference_of_its_start(tmp_path, passes, capsys, lora):
    """Without its cache, a resumed run's reference is still the initial model (LoRA: the base,
    adapters off), not the trained policy it resumed."""
    cfg = _setup(tmp_path, steps=4, lora=lora)
    cli.main(["train", "--config", str(cfg), "--quiet"])
    first = _cache(tmp_path).clone()
    assert _metrics(tmp_path)[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert _metrics(tmp_path)[-1]["rewards/margins"] != 0  # the policy has moved from the reference
    (tmp_path / "out" / CACHE_NAME).unlink()
    passes.clear()
    cli.main(["train", "--config", str(cfg), "--quiet", "--steps", "5"])
    assert "resumed from" in capsys.readouterr().out and len(passes) == 2
    torch.testing.assert_close(_cache(tmp_path), first, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dpo", ['loss_type = "simpo"\nbeta = 2.0', "reference_free = true"])
def test_reference_free_losses_skip_the_pass(tmp_path, passes, capsys, dpo):
    cfg = _setup(tmp_path, steps=2, every=0, dpo=dpo)
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    assert "reference log-probs: none (reference-free loss)" in capsys.readouterr().out
    assert passes == [] and not (tmp_path / "out" / CACHE_NAME).exists()
    assert all(math.isfinite(r["rewards/margins"]) for r in _metrics(tmp_path))


@pytest.mark.parametrize(("edit", "expect"), [
    ({"dpo": "beta = 0"}, "config: dpo.beta must be a number > 0, got 0"),
    ({"dpo": 'loss_type = "kto"'}, "config: dpo.loss_type must be one of ['sigmoid', 'robust',"),
    ({"dpo": 'loss_type = "robust"\nlabel_smoothing = 0.5'},
     'config: dpo.label_smoothing must be < 0.5 with dpo.loss_type = "robust", got 0.5'),
    ({"dpo": "sft_weight = -1.0"}, "config: dpo.sft_weight must be a number >= 0, got -1.0"),
    ({"dpo": "reference_free = 1"}, "config: dpo.reference_free must be true or false, got int 1"),
    ({"task": "ppo"}, "config: train.task must be one of ['sft', 'dpo', 'rl'], got 'ppo'"),
    ({"task": "sft"}, 'config: dpo.beta is set but train.task is "sft"'),
    ({"tokenizer": None}, 'config: train.task = "dpo" needs data.tokenizer'),
    ({"long": "truncate"}, 'config: data.long_samples = "truncate" cannot serve train.task = "dpo"'),
])
def test_bad_config_values_name_the_file_and_the_key(tmp_path, capsys, edit, expect):
    cfg = _setup(tmp_path, dpo=edit.get("dpo", "beta = 0.5"))
    text = cfg.read_text().replace('task = "dpo"', f'task = "{edit.get("task", "dpo")}"')
    if "tokenizer" in edit:
        text = text.replace(f'tokenizer = "{TOKENIZER}"\n', "")
    if "long" in edit:
        text = text.replace("batch_size = 8\n", f'batch_size = 8\nlong_samples = "{edit["long"]}"\n')
    cfg.write_text(text)
    assert cli.main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{cfg}: {expect}" in err, err


def test_bad_pairs_are_named_by_line_before_training(tmp_path, capsys):
    cfg = _setup(tmp_path)
    data = tmp_path / "pairs.jsonl"
    lines = data.read_text().splitlines()
    lines[2] = json.dumps({"prompt": "1 + 1 =", "chosen": " 2"})
    data.write_text("\n".join(lines) + "\n")
    assert cli.main(["train", "--config", str(cfg)]) == 2
    assert f"{data}:3: no 'rejected' column; the file is in the preference format" in capsys.readouterr().err
    lines[2] = json.dumps({"prompt": "1 + 1 =", "chosen": " 2" * 40, "rejected": " 3"})
    data.write_text("\n".join(lines) + "\n")
    assert cli.main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{data}:3: the pair has" in err and "more than train.max_tokens_per_microbatch=64" in err
    cfg.write_text(cfg.read_text().replace("batch_size = 8\n", 'batch_size = 8\nlong_samples = "drop"\n'))
    assert cli.main(["train", "--config", str(cfg), "--quiet", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "15 pairs" in out and "dropped 1 pair(s) too long" in out and f"{data}:3" in out


def test_the_docs_config_is_a_valid_dpo_config():
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the package's own dependency (pyproject: tomli)
        import tomli as tomllib

    from odcfn.sft.config import config_from_dict

    text = (ROOT / "docs" / "preference.md").read_text()
    (block,) = re.findall(r"```toml\n(.*?)```", text, re.S)
    cfg = config_from_dict(tomllib.loads(block))  # every key and cross-check, without the files
    assert cfg.train.task == "dpo" and cfg.dpo.uses_reference


def test_another_model_seed_does_not_resume_a_dpo_run(tmp_path, capsys):
    """A fresh model's seed is its reference: resuming with another would mix two references."""
    cli.main(["train", "--config", str(_setup(tmp_path, steps=2, every=0)), "--quiet"])
    cfg = _setup(tmp_path, steps=3, every=0, model_seed=3)
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 2
    assert "model.seed 0 -> 3" in capsys.readouterr().err
