"""docs/multinode.md's torchrun recipe, run: ``odcfn train`` as two torchrun agents on this
machine (``--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d``: two "nodes" of one rank, hybrid
sharding on the CPU IPC fabric) gives the loss curve of the same job on one node (2 local ranks,
full sharding: here ``odcfn train``'s in-process ranks, which need no interpreter start; the
single-node torchrun job is run by tests/sft/test_export.py and tests/sft/test_recovery_kill.py),
and leaves nothing in /dev/shm (issue 39)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from odcfn import cli
from odcfn.launch import free_port
from tests.sft.test_sft import _setup

ROOT = Path(__file__).resolve().parents[2]


def _agents(cmds: list[list[str]], env: dict[str, str]) -> None:
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for c in cmds]
    deadline, logs = time.monotonic() + 400, []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(logs)[-5000:]


def _losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_torchrun_agents_train_the_single_agent_loss_curve(tmp_path):
    prefix = f"odcfn-multinode-{os.getpid()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ODCFN_SHM_PREFIX": prefix}
    cfg = _setup(tmp_path, steps=4, every=2)
    # the one-node reference: the same config on 2 in-process ranks (full sharding)
    assert cli.main(["train", "--config", str(cfg), "--quiet", "--out-dir", str(tmp_path / "one")]) == 0
    train = ["-m", "odcfn.cli", "train", "--config", str(cfg), "--quiet"]
    run = [sys.executable, "-m", "torch.distributed.run"]
    port = free_port()
    two = [*run, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"localhost:{port}", "--rdzv-id", f"odcfn-{os.getpid()}", "--max-restarts", "0", *train,
           "--out-dir", str(tmp_path / "two")]
    _agents([two, two], env)
    one_curve, two_curve = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(one_curve) == 4
    assert two_curve == pytest.approx(one_curve, rel=1e-5)  # the same run, up to summation order
    assert [f for f in os.listdir("/dev/shm") if f.startswith(prefix)] == []
