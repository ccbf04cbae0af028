"""Asynchronous saves (``odcfn.save(..., blocking=False)``): the snapshot is a copy taken at the
call, the background write gives the same committed checkpoint as a blocking save, a failed write
(a file-size limit: the write syscall fails as on a full disk) reaches the caller at the next
call and leaves the previous checkpoint intact, with no staging files left."""

from __future__ import annotations

import resource
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import odcfn
from odcfn.checkpoint.sharded import read_manifest
from odcfn.launch import LaunchError
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.transport.shm import ShmTransport
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture

CFG = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)


def _state(tr, seed=0):
    model = qwen_model(CFG)
    return odcfn.TrainState.create(params=init_params(CFG, seed=seed), model=model,
                                   optimizer=odcfn.adamw(1e-2), transport=tr, step=3)


def _files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def test_async_save_snapshots_at_the_call_and_commits_what_blocking_would(tmp_path):
    def fn(rank, tr):
        state = _state(tr)
        orig = {k: v.clone() for k, v in state.params.items()}
        saver = odcfn.save(tmp_path / "async", state, blocking=False, extra={"data_step": 3})
        # training goes on: the state's tensors change while the write runs
        for t in state.params.values():
            t.add_(1.0)
        got = saver.wait()
        odcfn.save(tmp_path / "blocking", state.replace(params=orig), extra={"data_step": 3})
        back = odcfn.load(got, _state(tr, seed=1))
        return {k: torch.equal(v, orig[k]) for k, v in back.params.items()}, back.step

    out = odcfn.run_local(fn, 2)
    assert all(all(eq.values()) and step == 3 for eq, step in out)
    a, b = read_manifest(tmp_path / "async"), read_manifest(tmp_path / "blocking")
    for fa, fb in zip(a["files"], b["files"]):  # the same tensors (the metadata names the save)
        ta, tb = load_file(tmp_path / "async" / fa["name"]), load_file(tmp_path / "blocking" / fb["name"])
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert a["extra"] == {"data_step": 3} and a["tree"] == b["tree"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["async", "blocking"]  # no staging left


def disk_full_worker(root: str) -> tuple[str, bool, list[str]]:
    root_p = Path(root)
    mesh = odcfn.Mesh.from_env()
    with ShmTransport(mesh, timeout=20) as tr:
        state = _state(tr)
        odcfn.save(root_p / "ck", state, blocking=False).wait()
        before = _files(root_p / "ck")
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))
        try:
            newer = state.replace(params={k: v + 1 for k, v in state.params.items()}, step=4)
            odcfn.save(root_p / "ck", newer, overwrite=True, blocking=False)  # returns at once
            try:
                odcfn.save(root_p / "next", newer, blocking=False)  # the next call raises
                err = ""
            except RuntimeError as e:
                err = str(e)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, old)
        intact = _files(root_p / "ck") == before and odcfn.load(root_p / "ck", state).step == 3
        return err, intact, sorted(p.name for p in root_p.iterdir())


def test_a_failed_background_write_reaches_the_caller_and_keeps_the_previous_checkpoint(mp_pool, tmp_path):  # noqa: F811
    out = mp_pool.run(disk_full_worker, 2, args=(str(tmp_path),), timeout=120)
    for err, intact, names in out:
        assert "the background save of checkpoint" in err and "(step 4) failed" in err, err
        assert intact
        assert names == ["ck"], names  # nothing staged, nothing half-written, "next" never started
    assert any("File too large" in err for err, _, _ in out)  # EFBIG, as a full disk gives ENOSPC


def test_wait_raises_once_and_blocking_save_waits_first(tmp_path):
    def fn(rank, tr):
        state = _state(tr)
        saver = odcfn.save(tmp_path / "a", state, blocking=False)
        odcfn.save(tmp_path / "a2", state)  # blocking: the async one is committed first
        assert not saver.in_flight and (tmp_path / "a" / "manifest.json").exists()
        with pytest.raises(TypeError, match="blocking must be a bool"):
            odcfn.save(tmp_path / "b", state, blocking="no")
        return True

    assert odcfn.run_local(fn, 2) == [True, True]


def test_launch_error_type_is_public():
    assert issubclass(LaunchError, RuntimeError)


EXIT_SCRIPT = """
import odcfn, sys
from odcfn.models import QwenConfig, init_params, qwen_model
cfg = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
def fn(rank, tr):
    state = odcfn.TrainState.create(params=init_params(cfg, seed=0), model=qwen_model(cfg),
                                    optimizer=odcfn.sgd(0.1), transport=tr)
    odcfn.save(sys.argv[1] + "/ck", state, blocking=False)  # its parent is a file: it will fail
odcfn.run_local(fn, 1)
print("returned normally")
"""


def test_a_failure_nobody_collected_is_reported_at_exit(tmp_path):
    import subprocess
    import sys

    (tmp_path / "afile").write_text("not a directory")
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path / "afile")],
                          capture_output=True, text=True, timeout=120)
    assert "returned normally" in proc.stdout
    assert proc.returncode == 1 and "odcfn: the background save of checkpoint" in proc.stderr, proc.stderr


def test_an_async_save_over_a_committed_checkpoint_fails_at_the_call(tmp_path):
    def fn(rank, tr):
        state = _state(tr)
        odcfn.save(tmp_path / "c", state)
        with pytest.raises(FileExistsError, match="pass overwrite=True"):
            odcfn.save(tmp_path / "c", state, blocking=False)
        return odcfn.save(tmp_path / "c", state, blocking=False, overwrite=True).wait()

    assert odcfn.run_local(fn, 2) == [tmp_path / "c"] * 2
