"""SIGKILL a rank of a running ``odcfn train`` under automatic restart, at named phases (mid-step,
mid-snapshot, after a rank's file is written, rank 0 between its manifest and the commit) and at
a random point, and check what a user relies on: the run finishes; its final params equal an
uninterrupted run's bit for bit (deterministic mode, same world size); every step's metrics line
is there exactly once; every committed checkpoint still verifies; no shared memory, staging
directory or snapshot is left behind; a restart loses at most the save the kill interrupted.

Two launchers: ``odcfn train`` with the processes backend and ``[train] max_restarts`` (2 ranks,
a kill at each phase, one per incarnation, via ``ODCFN_TEST_KILL_AT``: see
``odcfn.checkpoint.kill_point``), and ``torchrun --max-restarts`` (3 ranks, a kill at a time
drawn from a seeded generator, printed on failure). The kill phases are the launcher's business
only in how the job restarts (the ranks run the same loop and saves under both), so each phase
is killed once, under the cheaper launcher; every incarnation costs each rank an interpreter
start. The uninterrupted references run once per world size on the test pool's warm workers,
saving as the killed runs do (asynchronous disk checkpoints and the memory tier)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import odcfn
from odcfn import cli
from odcfn.checkpoint.memory_tier import committed, verify_all
from odcfn.data.records import synthetic_records, write_jsonl
from odcfn.sft.config import config_from_dict
from odcfn.transport.shm import ShmTransport
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture

STEPS = 10


def _doc(root: Path, world: int, backend: str) -> dict:
    return {
        "out_dir": str(root / "out"),
        "model": {"vocab_size": 40, "d_model": 16, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 24},
        "data": {"path": str(root.parent / "train.jsonl"), "batch_size": 12},
        "train": {"steps": STEPS, "lr": 1e-2, "world_size": world, "backend": backend, "max_grad_norm": 1.0,
                  "max_tokens_per_microbatch": 20, "deterministic": True, "max_restarts": 5, "timeout": 30.0},
        "checkpoint": {"every": 3, "keep": 2, "memory_every": 1},
        "log": {"progress": False},
    }


def reference_worker(doc: dict) -> bool:
    from odcfn.sft.loop import train_rank

    torch.set_num_threads(1)
    cfg = config_from_dict(doc)
    mesh = odcfn.Mesh.from_env()
    with ShmTransport(mesh, timeout=30) as tr:
        train_rank(cfg, mesh.rank, tr)
    return True


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _ranks(top: int, torchrun: bool) -> list[int]:
    out = []
    for k in _children(top):
        try:
            cmd = Path(f"/proc/{k}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if ("odcfn.cli" in cmd) if torchrun else ("spawn_main" in cmd):
            out.append(k)
    return out


def _run_with_kills(cmd: list[str], metrics: Path, kills: int, seed: int, torchrun: bool, env: dict) -> str:
    rng = random.Random(seed)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done, killed_at = 0, []
    deadline = time.monotonic() + 600
    while done < kills and proc.poll() is None and time.monotonic() < deadline:
        lines = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        ranks = _ranks(proc.pid, torchrun)
        # kill once the run has made progress past the last kill's restart point
        if lines >= 1 + 3 * done + rng.randrange(2) and len(ranks) >= 2:
            time.sleep(rng.random() * 0.4)  # anywhere in a step: compute, snapshot, write, commit
            victim = rng.choice(ranks)
            try:
                os.kill(victim, signal.SIGKILL)
                done += 1
                killed_at.append(lines)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    why = f"seed {seed}, kills after lines {killed_at}:\n{out[-4000:]}"
    assert proc.returncode == 0 and done == kills, why
    return out


def _check(root: Path, ref: Path, shm: Path, world: int) -> None:
    steps = [json.loads(x)["step"] for x in (root / "out" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))  # nothing lost, nothing doubled
    ck = root / "out" / "checkpoints"
    names = sorted(p.name for p in ck.iterdir())
    assert names == [f"step-{s:08d}" for s in (9, STEPS)], names  # keep=2; no staging directory
    for _, d in committed(ck):
        verify_all(d)  # a kill during a background write never damaged a committed checkpoint
    final, want = ck / f"step-{STEPS:08d}", ref / "out" / "checkpoints" / f"step-{STEPS:08d}"
    for r in range(world):
        a = load_file(final / f"rank-{r:05d}.safetensors")
        b = load_file(want / f"rank-{r:05d}.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"rank {r} differs"
    assert not any(shm.iterdir()), sorted(p.name for p in shm.iterdir())  # segments and snapshots gone


LENGTHS = [5, 9, 7, 12, 6, 8, 10, 4, 11, 5, 7, 9, 13, 6, 8, 10, 5, 12]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, mp_pool):  # noqa: F811
    """The uninterrupted run of each world size (once per module), on the pool's warm workers,
    saving as the killed runs do: asynchronous disk checkpoints and the memory tier."""
    done: dict[int, Path] = {}

    def get(world: int) -> Path:
        if world not in done:
            root = tmp_path_factory.mktemp(f"reference{world}")
            write_jsonl(root / "train.jsonl", synthetic_records(LENGTHS, 40, seed=0))
            mp_pool.run(reference_worker, world, args=(_doc(root / "ref", world, "processes"),), timeout=300)
            done[world] = root / "ref"
        return done[world]

    return get


def _setup(tmp_path: Path, world: int, backend: str, shm: Path, reference) -> tuple[Path, Path, dict]:
    write_jsonl(tmp_path / "train.jsonl", synthetic_records(LENGTHS, 40, seed=0))
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(_doc(run, world, backend)))
    env = {**os.environ, "ODCFN_SHM_DIR": str(shm), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    return run, reference(world), env


def test_torchrun_max_restarts_three_ranks(tmp_path, shm, reference):
    run, ref, env = _setup(tmp_path, 3, "processes", shm, reference)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "--max-restarts", "3", "-m", "odcfn.cli", "train", "--config", str(run / "run.json"), "--quiet"]
    out = _run_with_kills(cmd, run / "out" / "metrics.jsonl", 1, seed=2, torchrun=True, env=env)
    # one restart: at most one resume (none if the kill beat the first snapshot's commit)
    assert out.count("resuming at step ") <= 1, out[-4000:]
    _check(run, ref, shm, 3)


# Kills at named phases (odcfn.checkpoint.kill_point), one per incarnation: PHASE:STEP:RANK@RESTART.
# Disk checkpoints every 3 steps and a memory-tier snapshot every step: steps 3, 6 and 9 save to
# both. Each kill comes after the previous incarnation's resume point (at most two steps back).
PHASE_KILLS = {
    # rank 1's file of step 3 written (disk and memory in flight); rank 0 between its manifest
    # and the rename of step 5 (the memory tier alone); rank 1 half way through the host
    # snapshot of step 7; rank 1 at the start of step 8, its peer inside the step; rank 0
    # between its manifest and the rename of step 9 (disk and memory saves in flight)
    2: "write:3:1,commit:5:0@1,snapshot:7:1@2,step:8:1@3,commit:9:0@4",
}


@pytest.mark.parametrize("world", sorted(PHASE_KILLS))
def test_kills_at_named_phases_restart_and_finish_bit_identically(
    tmp_path, shm, reference, world, monkeypatch, capfd
):
    run, ref, env = _setup(tmp_path, world, "processes", shm, reference)
    kills = [k.split("@")[0].split(":") for k in PHASE_KILLS[world].split(",")]
    for key in ("ODCFN_SHM_DIR", "OMP_NUM_THREADS"):
        monkeypatch.setenv(key, env[key])
    monkeypatch.setenv("ODCFN_TEST_KILL_AT", PHASE_KILLS[world])  # read by the ranks only
    # `odcfn train` in this process, which has imported torch already; its ranks are spawned
    # processes as ever (the launcher's, printing to this process's stdout and stderr)
    rc = cli.main(["train", "--config", str(run / "run.json"), "--quiet"])
    captured = capfd.readouterr()
    out = captured.out + captured.err
    assert rc == 0, out[-4000:]
    assert out.count("restarting all ranks") == len(kills), out[-4000:]
    # each restart resumed from the newest snapshot the kill left: a kill in a save of step N
    # loses at most that save (resume at N-1 or N), a kill at the start of step N at most the
    # snapshot of step N-1 still in flight (resume at N-2 or N-1)
    resumed = [int(x) for x in re.findall(r"resuming at step (\d+)", out)]
    lost = [int(n) - r for (phase, n, _), r in zip(kills, resumed)]
    allowed = [(1, 2) if phase == "step" else (0, 1) for phase, _, _ in kills]
    assert len(resumed) == len(kills) and all(lo <= x <= hi for x, (lo, hi) in zip(lost, allowed)), resumed
    _check(run, ref, shm, world)


def test_kill_points_are_off_unless_named_and_a_bad_spec_is_refused(monkeypatch):
    from odcfn.checkpoint.kill_point import kill_point

    monkeypatch.delenv("ODCFN_TEST_KILL_AT", raising=False)
    kill_point("commit", 3, 0)  # off by default: returns
    monkeypatch.setenv("ODCFN_TEST_KILL_AT", "commit:3:0@1,write:4:1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    kill_point("commit", 3, 0)  # named for the next incarnation only
    kill_point("write", 4, 0)  # another rank
    kill_point("write", 5, 1)  # another step
    for bad in ("commit:3", "flush:3:0", "commit:x:0", "commit:3:0@-1"):
        monkeypatch.setenv("ODCFN_TEST_KILL_AT", bad)
        with pytest.raises(ValueError, match=r"ODCFN_TEST_KILL_AT=.*PHASE:STEP:RANK\[@RESTART\]"):
            kill_point("step", 1, 0)
