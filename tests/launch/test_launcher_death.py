"""A killed launcher takes its ranks with it: ``kill -9`` of ``odcfn train`` (backend
"processes") leaves no rank training, and a rerun into the same out_dir never trains beside a
survivor (its metrics log has every step once, in order)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from odcfn.data.records import synthetic_records, write_jsonl
from odcfn.sft.lock import LOCK_NAME, RankLock, RunDirLocked, RunLock

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _alive(pid: int) -> bool:
    try:  # a zombie (dead, not yet reaped by whoever inherited it) is dead
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _steps(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in path.read_text().splitlines()] if path.exists() else []


def test_sigkill_of_the_launcher_leaves_no_rank_and_a_rerun_never_interleaves(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", synthetic_records([5, 9, 7, 12, 6, 8, 10, 4], 40, seed=0))
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        'out_dir = "out"\n[model]\nvocab_size = 40\nd_model = 16\nn_layers = 1\nn_heads = 2\nn_kv_heads = 1\n'
        'd_ff = 16\n[data]\npath = "train.jsonl"\nbatch_size = 4\n'
        '[train]\nsteps = 100000\nworld_size = 2\nbackend = "processes"\ntimeout = 30\n'
        "[checkpoint]\nevery = 5\nasync_save = false\n"
    )
    metrics = tmp_path / "out" / "metrics.jsonl"
    ranks: list[int] = []
    launcher = subprocess.Popen([sys.executable, "-m", "odcfn.cli", "train", "--config", str(cfg), "--quiet"],
                                env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        t_end = time.monotonic() + 120
        while len(_steps(metrics)) < 8:  # mid-run, past a checkpoint or two
            assert launcher.poll() is None, launcher.stderr.read().decode()
            assert time.monotonic() < t_end, "the run did not start"
            time.sleep(0.2)
        ranks = [c for c in _children(launcher.pid) if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
        assert len(ranks) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        t0 = time.monotonic()
        while any(_alive(r) for r in ranks) and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert not any(_alive(r) for r in ranks), "a rank outlived its killed launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for r in ranks:  # a failing run leaves no orphan behind
            if _alive(r):
                os.kill(r, signal.SIGKILL)
    done = _steps(metrics)
    time.sleep(1.0)
    assert _steps(metrics) == done  # nobody writes any more
    # the rerun resumes from the last checkpoint; its log reads as one run
    target = max(done) + 3
    rerun = subprocess.run([sys.executable, "-m", "odcfn.cli", "train", "--config", str(cfg), "--quiet",
                            "--steps", str(target)], env=ENV, capture_output=True, text=True, timeout=180)
    assert rerun.returncode == 0, rerun.stderr
    assert _steps(metrics) == list(range(1, target + 1))


def test_a_live_rank_keeps_the_out_dir_locked(tmp_path):
    """The launcher's lock is free (its process died) but a rank of that run still lives."""
    rank = subprocess.Popen(
        [sys.executable, "-c", "import time; from odcfn.sft.lock import RankLock; "
         f"RankLock({str(tmp_path)!r}, 1).acquire(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env=ENV,
    )
    try:
        assert rank.stdout.readline().strip() == "held"
        with pytest.raises(RunDirLocked, match=rf"rank processes of another .*pid {rank.pid}"):
            RunLock(tmp_path, wait_ranks=0.5).acquire()
        with pytest.raises(RunDirLocked, match="rank 1 of another odcfn train run"):
            RankLock(tmp_path, 1).acquire()
    finally:
        rank.kill()
        rank.wait()
    with RunLock(tmp_path, wait_ranks=0.5), RankLock(tmp_path, 1):  # the rank's death freed it
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_torchrun_rank0_locks_beside_its_own_ranks_not_another_jobs(tmp_path, monkeypatch):
    """Under torchrun every rank runs ``odcfn train``: rank 0's run lock must not mistake its own
    peers' rank locks for an earlier run's, and must still refuse another job's."""
    from odcfn.sft.lock import RankLock, RunDirLocked, RunLock

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with RankLock(tmp_path, 1):  # a peer of this job
        with RunLock(tmp_path):
            pass
        monkeypatch.setenv("MASTER_PORT", "29501")  # another torchrun job
        with pytest.raises(RunDirLocked, match="rank1"):
            RunLock(tmp_path, wait_ranks=0.2).acquire()
