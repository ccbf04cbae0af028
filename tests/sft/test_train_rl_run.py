"""``odcfn train`` with ``train.task = "rl"`` end to end on 2 ranks (threads), a tiny model built
from ``[model]``, the shipped local tokenizer and the local engine: one metrics line per
iteration with verl's names and a progress line each; a run killed (SIGKILL) after a checkpoint
and resumed draws the same prompts and the same samples as an uninterrupted run, so its metrics
lines equal that run's; LoRA (the base as the KL reference) and asynchronous mode run too."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from odcfn import cli

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "examples" / "chat" / "tokenizer"  # shipped: no download

# a reward with signal even for an untrained model: the share of even token ids in the answer
REWARD = ("def even_share(prompt, completion):\n"
          "    ids = completion.tokens.tolist()\n"
          "    return sum(t % 2 == 0 for t in ids) / max(1, len(ids))\n")


def _setup(tmp: Path, *, steps: int = 4, rl: str = "", extra: str = "", ckpt: str = "") -> Path:
    # prompts of different lengths: prompt_length/mean tells which prompts an iteration drew
    rows = [{"prompt": " + ".join(str(k) for k in range(1 + i % 4)) + " =", "answer": str(i)}
            for i in range(16)]
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "reward.py").write_text(REWARD)
    cfg = tmp / "run.toml"
    cfg.write_text(
        'out_dir = "out"\n[model]\nvocab_size = 300\nd_model = 32\nn_layers = 2\nn_heads = 4\n'
        f'n_kv_heads = 2\nd_ff = 64\n[data]\npath = "prompts.jsonl"\ntokenizer = "{TOKENIZER}"\n'
        f'batch_size = 4\n[train]\ntask = "rl"\nsteps = {steps}\nlr = 1e-2\nworld_size = 2\n'
        f'deterministic = true\n[checkpoint]\nevery = 2\n{ckpt}'
        '[rollout]\nmax_tokens = 6\nmax_model_len = 32\n'
        f'[rl]\nreward = "{tmp / "reward.py"}:even_share"\ngroup_size = 4\n{rl}{extra}'
    )
    return cfg


def _metrics(tmp: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]


def _same(rec: dict) -> dict:
    """What a rerun must reproduce: everything but wall-clock figures."""
    return {k: v for k, v in rec.items() if not k.startswith(("timing_s/", "perf/throughput"))}


def test_a_killed_and_resumed_run_continues_with_the_same_prompts_and_samples(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    rl = "kl_loss_coef = 0.05\n"  # full fine-tuning: a frozen reference of the initial weights
    assert cli.main(["train", "--config", str(_setup(a, rl=rl))]) == 0  # uninterrupted
    out = capsys.readouterr().out
    assert "task: rl, reward" in out and "kl low_var_kl x 0.05 to the initial model" in out
    lines = [x for x in out.splitlines() if x.startswith("iter ")]
    assert [x.split()[1] for x in lines] == ["1/4", "2/4", "3/4", "4/4"]
    assert all(all(w in x for w in (" reward ", " resp ", " gen ", " upd ", "ETA")) for x in lines)
    ra = _metrics(a)
    assert [r["step"] for r in ra] == [1, 2, 3, 4] and [r["trainer_step"] for r in ra] == [1, 2, 3, 4]
    for name in ("critic/score/mean", "critic/score/max", "critic/score/min", "critic/advantages/mean",
                 "response_length/mean", "response_length/max", "response_length/clip_ratio", "timing_s/gen",
                 "timing_s/ref", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/weight_sync",
                 "timing_s/step", "perf/throughput", "rollout/logprob_diff/mean", "rollout/logprob_diff/max",
                 "rollout/dropped_groups", "rollout/staleness/mean", "actor/pg_loss", "actor/kl_loss"):
        assert all(math.isfinite(r[name]) for r in ra), name
    assert len({r["prompt_length/mean"] for r in ra}) > 1  # the iterations drew different prompts
    assert ra[-1]["actor/kl_loss"] > 0  # the policy has moved from its reference
    # a real kill: the CLI process dies (SIGKILL) at the start of iteration 3, after 2's checkpoint
    # (written synchronously: a background write still in flight at the kill is lost, as it should be)
    cfg = _setup(b, rl=rl, ckpt="async_save = false\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ODCFN_TEST_KILL_AT": "step:3:0"}
    proc = subprocess.run([sys.executable, "-m", "odcfn.cli", "train", "--config", str(cfg), "--quiet"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert [r["step"] for r in _metrics(b)] == [1, 2]
    capsys.readouterr()
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    assert "resumed from" in capsys.readouterr().out
    rb = _metrics(b)
    assert [r["step"] for r in rb] == [1, 2, 3, 4]
    for x, y in zip(ra, rb):  # the same prompts, samples, rewards and updates, iteration by iteration
        x, y = _same(x), _same(y)
        assert x.keys() == y.keys()
        for k in x:
            if k != "time":
                assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-6), (x["step"], k)
    # a rerun past the end trains nothing and says so
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    assert "nothing to train" in capsys.readouterr().out


def test_lora_takes_its_base_as_reference_and_async_and_stale_modes_run(tmp_path, capsys):
    a, b, c = tmp_path / "lora", tmp_path / "async", tmp_path / "stale"
    a.mkdir(), b.mkdir(), c.mkdir()
    cfg = _setup(a, steps=2, rl="kl_loss_coef = 0.05\n", extra="[lora]\nrank = 4\ntargets = [\"q_proj\"]\n")
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    assert "to the base (adapters off)" in capsys.readouterr().out
    r = _metrics(a)
    assert [x["step"] for x in r] == [1, 2] and r[0]["actor/kl_loss"] == pytest.approx(0, abs=1e-7)
    cfg = _setup(b, steps=3, rl="async_rollouts = true\n")
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    r = _metrics(b)
    assert [x["step"] for x in r] == [1, 2, 3]
    # iteration 1 generates on the spot; 2 and 3 were generated during the update before them
    assert r[0]["rollout/staleness/max"] == 0 and r[1]["rollout/staleness/max"] == 1
    # bounded staleness: every save drains first, so the checkpoint holds exactly its step's updates
    cfg = _setup(c, steps=2, extra="")
    cfg.write_text(cfg.read_text().replace("deterministic = true\n", "deterministic = true\nstaleness = 1\n"))
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    assert [x["step"] for x in _metrics(c)] == [1, 2]
    assert (c / "out" / "checkpoints" / "step-00000002").is_dir()
