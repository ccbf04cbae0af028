"""The ``odcfn`` command line as a user meets it: ``--help``, one-line errors with exit status 2
(``--debug`` for the traceback), flags that mean one thing in every subcommand, the defaults a
minimal ``odcfn train`` config runs with, what a resume with more steps does to the schedule,
and one run per output directory."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from odcfn import cli
from odcfn.data.records import synthetic_records, write_jsonl
from odcfn.sft.config import default_world_size, load_config
from odcfn.sft.lock import LOCK_NAME

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _odcfn(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "odcfn.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def _minimal(tmp_path, extra=""):
    """The smallest config a user writes: a dataset and a step count (a tiny model)."""
    write_jsonl(tmp_path / "train.jsonl", synthetic_records([5, 9, 7, 12, 6, 8, 10, 4], 40, seed=0))
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        '[model]\nvocab_size = 40\nd_model = 16\nn_layers = 1\nn_heads = 2\nn_kv_heads = 1\nd_ff = 16\n'
        f'[data]\npath = "train.jsonl"\nbatch_size = 4\n[train]\nsteps = 2\n{extra}'
    )
    return cfg


def test_help_describes_the_tool_and_user_errors_are_one_line(tmp_path):
    proc = _odcfn("--help")
    assert proc.returncode == 0
    assert "On-Demand Communication" in proc.stdout and "odcfn train --init DIR" in proc.stdout
    assert "export" in proc.stdout and "--debug" in proc.stdout
    cfg = _minimal(tmp_path)
    cfg.write_text(cfg.read_text().replace("batch_size = 4", "batchsize = 4"))  # a typo'd key
    proc = _odcfn("train", "--config", str(cfg))
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    # the file, the field, the fix
    assert str(cfg) in lines[0]
    assert "['batchsize'] in [data] ('batchsize': did you mean 'batch_size'?)" in lines[0]
    assert "--debug" in lines[0]


def test_debug_shows_the_traceback(tmp_path, capsys):
    cfg = _minimal(tmp_path)
    assert cli.main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml" in capsys.readouterr().err
    cfg.write_text(cfg.read_text().replace("steps = 2", "steps = 0"))
    with pytest.raises(ValueError, match="train.steps must be an integer >= 1, got 0"):
        cli.main(["--debug", "train", "--config", str(cfg)])


def _options(name):
    p = argparse.ArgumentParser()
    module = __import__(cli.COMMANDS[name][0], fromlist=["add_arguments"])
    module.add_arguments(p)
    return {s: a for a in p._actions for s in a.option_strings}


def test_a_flag_means_one_thing_in_every_subcommand():
    seen = {}
    for name in cli.COMMANDS:
        for flag, a in _options(name).items():
            if flag in ("-h", "--help"):
                continue
            # a switch in one subcommand and a value in another: two meanings
            seen.setdefault(flag, {})[name] = ("switch" if a.nargs == 0 else "value", a.choices)
    for flag, per_command in seen.items():
        kinds = {k for k, _ in per_command.values()}
        assert len(kinds) == 1, f"{flag} differs across subcommands: {per_command}"
    # --steps counts optimizer steps wherever it appears; --comm is ODC or collective, the
    # simulated network is --network (plan and simulate alike)
    assert set(seen["--steps"]) >= {"demo", "bench", "train"}
    for choices in (c for _, c in seen.get("--comm", {}).values()):
        assert set(choices) <= {"odc", "collective"}
    assert {frozenset(c) for _, c in seen["--network"].values()} == {frozenset({"a100", "zero"})}


def test_minimal_config_runs_odc_lb_mini_on_local_ranks_with_checkpoints(tmp_path, capsys):
    cfg = load_config(_minimal(tmp_path, 'schedule = "cosine"\nwarmup_steps = 1\n'))
    assert (cfg.train.comm, cfg.train.balance) == ("odc", "lb_mini")
    assert cfg.train.world_size == default_world_size() >= min(2, os.cpu_count())
    assert cfg.checkpoint.every > 0 and cfg.checkpoint.keep
    assert cli.main(["train", "--config", str(tmp_path / "run.toml"), "--quiet", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "on 2 rank(s) (odc+lb_mini)" in out
    ck = tmp_path / "runs" / "sft" / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000002"]  # the last step is always saved
    # extending the run: the message says what happens to the decaying schedule
    assert cli.main(["train", "--config", str(tmp_path / "run.toml"), "--quiet", "--world-size", "2",
                     "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "train.steps 2 -> 4 on resume from step 2" in out
    assert "cosine schedule now decays over 4 steps instead of 2" in out
    recs = [json.loads(x) for x in (tmp_path / "runs" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[2]["lr"] == pytest.approx(0.5e-3 * (1 + math.cos(math.pi * 2 / 3)))  # 1e-3 x cosine


def test_a_second_run_into_the_same_out_dir_is_refused_and_a_dead_runs_lock_taken_over(tmp_path, capsys):
    cfg = _minimal(tmp_path, "world_size = 1\n[checkpoint]\nevery = 0\n")
    out = tmp_path / "runs" / "sft"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from odcfn.sft.lock import RunLock; "
         f"RunLock({str(out)!r}).acquire(); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, env=ENV,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        (out / "metrics.jsonl").write_text('{"step": 1}\n')  # the other run's log
        assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert f"in use by another odcfn train run (pid {holder.pid} on host " in err
        assert "--out-dir" in err and len(err.splitlines()) == 1
        assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # not touched
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == holder.pid  # stale: its holder is dead
    t0 = time.perf_counter()
    assert cli.main(["train", "--config", str(cfg), "--quiet", "--no-resume"]) == 0
    assert time.perf_counter() - t0 < 60
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
